import os
import sys
from pathlib import Path

# This machine (and CI) has no internet: without these, transformers waits on the hub.
# Rank processes started by run_ranks inherit the environment.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# examples/ holds the GPT the tests train; rank processes inherit this path.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
