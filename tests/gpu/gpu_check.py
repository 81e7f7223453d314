"""`make gpu-check`: everything one GPU can check, in one command, as one pass/fail table.

    python tests/gpu/gpu_check.py --out gpu-check-results

Run from the repository root by the Python that has a CUDA torch (on the lent GPU machine
its plain ``python3``: nothing is installed, the package is imported from the tree). Steps,
each a row group of the table:

1. ``pytest -m cuda tests``: ``tests/gpu/test_cuda.py``, ``tests/gpu/test_cuda_paths.py`` and
   ``tests/gpu/test_cuda_param_offload.py`` (world
   size 1 on NCCL; world size 2 with gloo over CUDA tensors on the one GPU), one row per
   test from pytest's JUnit XML, their measurements in ``pytest.log``;
2. ``benchmarks/step_time.py --device cuda --world-size 1 --rounds 1``: ``step_time.txt``;
3. ``benchmarks/checkpoint_io.py --device cuda --world-size 1 --small`` (the 11M GPT, to
   stay in the time limit): ``checkpoint_io.txt``.

The table is printed and written to ``OUT/results.md`` with the machine it ran on. The
exit status is 0 when every row passed (expected failures and skips included: the table
says why), 1 otherwise, 2 when a package it needs does not import (the message names it).
Without a CUDA device it says so, writes that to ``OUT/results.md`` and exits 0. A step
that outlives its share of the time limit is stopped and fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What the CUDA tests and benchmarks import (distribution names as imported).
REQUIRED = ("torch", "pytest", "safetensors", "psutil", "accelerate", "transformers")
# Seconds per step: under 10 minutes in all, the device machine's limit for one command.
BUDGET = {"tests": 390, "step_time": 100, "checkpoint_io": 80}


@dataclasses.dataclass
class Row:
    """One line of the table."""

    name: str
    outcome: str  # passed, failed, error, skipped, xfailed, xpassed
    seconds: float = 0.0
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome in ("passed", "skipped", "xfailed", "xpassed")


def missing_packages(names: Sequence[str] = REQUIRED) -> list[str]:
    """The ``names`` that do not import here."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a broken install fails as surely as a missing one
            missing.append(name)
    return missing


def junit_rows(xml_text: str) -> list[Row]:
    """One `Row` per test case of pytest's JUnit XML (``--junitxml``)."""
    rows = []
    for case in ET.fromstring(xml_text).iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        name = f"{module}::{case.get('name', '?')}"
        outcome, note = "passed", ""
        for child in case:
            message = (child.get("message") or child.text or "").strip().splitlines()
            first = message[0][:160] if message else ""
            if child.tag == "skipped":
                xfail = child.get("type") == "pytest.xfail"
                outcome, note = ("xfailed" if xfail else "skipped"), first
            elif child.tag in ("failure", "error"):
                outcome, note = ("failed" if child.tag == "failure" else "error"), first
        rows.append(Row(name, outcome, float(case.get("time", 0.0)), note))
    return rows


def markdown(rows: Sequence[Row], machine: str) -> str:
    """The table, in Markdown, under a line naming the machine and the tally."""
    failed = [r for r in rows if not r.ok]
    tally = ", ".join(f"{sum(r.outcome == o for r in rows)} {o}" for o in
                      ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
                      if any(r.outcome == o for r in rows))
    lines = [f"# gpu-check: {'PASS' if not failed else 'FAIL'}", "", machine, "",
             f"{len(rows)} checks: {tally or 'none'}", "",
             "| check | result | seconds | note |", "|---|---|---|---|"]
    for r in rows:
        note = r.note.replace("|", "\\|")
        lines.append(f"| `{r.name}` | {r.outcome} | {r.seconds:.1f} | {note} |")
    return "\n".join(lines) + "\n"


def machine_line() -> str:
    """torch, CUDA and the GPU this ran on."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    return (f"Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA "
            f"{torch.version.cuda}), {torch.cuda.device_count()} x {gpu}")


def _run(command: list[str], log: Path, timeout: float) -> tuple[int, float, str]:
    """Run ``command`` from the repository root, stdout and stderr to ``log``; returns its
    exit status (124 when stopped at ``timeout``), seconds, and its last output line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH")])), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return rc, time.perf_counter() - start, (lines[-1][:160] if lines else "")


def run_tests(out: Path, python: str) -> list[Row]:
    """Step 1: the cuda-marked tests, one row each."""
    xml = out / "pytest.xml"
    rc, seconds, last = _run(
        [python, "-m", "pytest", "-q", "-s", "-rsx", "-m", "cuda", "-p", "no:cacheprovider",
         f"--junitxml={xml}", "-o", "junit_family=xunit1", "tests"],
        out / "pytest.log", BUDGET["tests"])
    rows = junit_rows(xml.read_text()) if xml.exists() else []
    if rc == 124 or not rows:
        why = "stopped at its time limit" if rc == 124 else f"exit {rc}, no test report: {last}"
        rows.append(Row("pytest -m cuda", "failed", seconds, why))
    return rows


def run_benchmarks(out: Path, python: str) -> list[Row]:
    """Steps 2-3: the benchmarks on the GPU, each table in its own file."""
    rows = []
    for name, args in (
        ("step_time", ["--device", "cuda", "--world-size", "1", "--rounds", "1"]),
        ("checkpoint_io", ["--device", "cuda", "--world-size", "1", "--small"]),
    ):
        rc, seconds, last = _run([python, f"benchmarks/{name}.py", *args], out / f"{name}.txt",
                                 BUDGET[name])
        outcome = "passed" if rc == 0 else "failed"
        note = f"table in {name}.txt" if rc == 0 else (
            "stopped at its time limit" if rc == 124 else f"exit {rc}: {last}")
        rows.append(Row(f"benchmarks/{name}.py {' '.join(args)}", outcome, seconds, note))
    return rows


def nvidia_device_present() -> bool:
    """Whether the kernel shows an NVIDIA GPU (its driver's device files)."""
    return Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/gpus").is_dir()


def _skipped(out: Path, why: str) -> int:
    message = f"gpu-check: skipped, {why}; nothing was run"
    (out / "results.md").write_text(f"# gpu-check: skipped\n\n{message}\n")
    print(message)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-check-results", help="where results go")
    parser.add_argument("--no-benchmarks", action="store_true", help="the tests only")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if missing_packages(("torch",)):
        where = f"torch does not import with {sys.executable}"
        if not nvidia_device_present():
            return _skipped(out, f"no GPU here (no NVIDIA device, and {where})")
        print(f"gpu-check: {where}, yet this machine has an NVIDIA device; run it with the "
              "Python that has a CUDA torch (make gpu-check GPU_PYTHON=...)")
        return 2
    import torch

    if not torch.cuda.is_available():
        return _skipped(out, f"no CUDA device here (torch {torch.__version__}, "
                             "torch.cuda.is_available() is False)")
    missing = missing_packages()
    if missing:
        print(f"gpu-check: these packages do not import with {sys.executable}: "
              f"{', '.join(missing)}; install them (or carry their wheels) and run it again")
        return 2
    rows = run_tests(out, sys.executable)
    if not args.no_benchmarks:
        rows += run_benchmarks(out, sys.executable)
    table = markdown(rows, machine_line())
    (out / "results.md").write_text(table)
    print(table)
    print(f"gpu-check: results in {out}/ (results.md, pytest.log, pytest.xml, benchmark tables)")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
