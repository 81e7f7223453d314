"""What the installed Accelerate does that a test must know: the suite runs under the oldest
supported versions as under the newest (README, "Tested versions")."""

from __future__ import annotations

import accelerate
from packaging.version import Version

#: Whether a CPU worker needs ``ACCELERATE_USE_CPU=1`` (``--use_cpu``) to see the launch's
#: other processes. From Accelerate 1.13 a process is MULTI_CPU only when asked for the CPU,
#: so without it each of N workers sees one process and zerolite refuses the launch; before,
#: a worker with ``WORLD_SIZE > 1`` and no GPU was MULTI_CPU anyway and the launch trains on
#: every process together, as with the variable.
CPU_LAUNCH_NEEDS_USE_CPU = Version(accelerate.__version__) >= Version("1.13")
