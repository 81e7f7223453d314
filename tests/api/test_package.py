"""What a bare `import zerolite` gives a user: the subpackages as attributes, nothing heavy."""

import subprocess
import sys

PROBE = """
import sys
import zerolite
heavy = [m for m in ("transformers", "peft", "accelerate", "zerolite.memory", "zerolite.testing")
         if m in sys.modules]
assert not heavy, f"import zerolite imported {heavy}"
lazily = zerolite.memory.footprint
from zerolite.memory import footprint
assert lazily is footprint
assert callable(zerolite.testing.run_ranks) and callable(zerolite.checkpoint.save)
assert {"memory", "checkpoint", "testing"} <= set(dir(zerolite))
try:
    zerolite.nosuch
except AttributeError as exc:
    assert "nosuch" in str(exc)
else:
    raise AssertionError("zerolite.nosuch did not raise")
print("ok")
"""


def test_subpackages_are_attributes_and_import_is_light():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
