"""The `make gpu-check` runner (`tests/gpu/gpu_check.py`) on the CPU: its table from pytest's
own JUnit XML (every outcome pytest writes), the Markdown it writes, the exit status, what
it says without a GPU (exit 0) and where a package is missing (exit 2, naming it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from tests.gpu import gpu_check
from tests.gpu.gpu_check import Row, junit_rows, markdown

OUTCOMES = textwrap.dedent('''
    import pytest

    def test_passes():
        pass

    def test_fails():
        assert 1 == 2, "one is not two"

    def test_skips():
        pytest.skip("no GPU | here")

    def test_xfails():
        pytest.xfail("gloo lacks isend on CUDA tensors")

    @pytest.mark.xfail(reason="may pass")
    def test_xpasses():
        pass

    @pytest.fixture
    def broken():
        raise RuntimeError("fixture broke")

    def test_errors(broken):
        pass
''')


@pytest.fixture(scope="module")
def junit_xml(tmp_path_factory) -> str:
    """pytest's own JUnit XML for one test of each outcome (as the runner asks for it)."""
    root = tmp_path_factory.mktemp("outcomes")
    (root / "test_outcomes.py").write_text(OUTCOMES)
    xml = root / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={xml}", "-o", "junit_family=xunit1", str(root)],
                   cwd=root, capture_output=True, check=False, timeout=120)
    return xml.read_text()


def test_every_outcome_becomes_a_row(junit_xml):
    rows = {r.name.split("::")[-1]: r for r in junit_rows(junit_xml)}
    assert {name: r.outcome for name, r in rows.items()} == {
        "test_passes": "passed", "test_fails": "failed", "test_skips": "skipped",
        "test_xfails": "xfailed", "test_xpasses": "passed", "test_errors": "error",
    }
    assert "one is not two" in rows["test_fails"].note
    assert "gloo lacks isend" in rows["test_xfails"].note
    assert "fixture broke" in rows["test_errors"].note
    assert rows["test_passes"].name == "test_outcomes::test_passes"
    assert [r.ok for r in rows.values()].count(False) == 2  # the failure and the error


def test_the_markdown_table():
    rows = [Row("test_cuda::test_a", "passed", 1.25), Row("test_b", "xfailed", 0.5, "a | b"),
            Row("benchmarks/step_time.py", "failed", 100.0, "stopped at its time limit")]
    text = markdown(rows, "torch 2.11.0 (CUDA 13.0), 1 x NVIDIA H100")
    lines = text.splitlines()
    assert lines[0] == "# gpu-check: FAIL"
    assert "torch 2.11.0 (CUDA 13.0), 1 x NVIDIA H100" in lines
    assert "3 checks: 1 passed, 1 failed, 1 xfailed" in lines
    assert "| `test_b` | xfailed | 0.5 | a \\| b |" in lines  # a pipe in a note is escaped
    assert "| `benchmarks/step_time.py` | failed | 100.0 | stopped at its time limit |" in lines
    assert markdown(rows[:2], "m").startswith("# gpu-check: PASS")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: make gpu-check runs")
def test_without_a_gpu_it_says_so_and_succeeds(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "gpu-check: skipped, no CUDA device here" in said
    assert (tmp_path / "out" / "results.md").read_text().startswith("# gpu-check: skipped")


def test_a_python_without_torch(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "missing_packages", lambda names=(): list(names))
    monkeypatch.setattr(gpu_check, "nvidia_device_present", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path)]) == 0  # no GPU at all: nothing to check
    assert "skipped, no GPU here" in capsys.readouterr().out
    monkeypatch.setattr(gpu_check, "nvidia_device_present", lambda: True)
    assert gpu_check.main(["--out", str(tmp_path)]) == 2  # a GPU, and the wrong Python
    assert "GPU_PYTHON" in capsys.readouterr().out


def test_a_missing_package_is_named(tmp_path, monkeypatch, capsys):
    assert gpu_check.missing_packages(("json", "zerolite_no_such_package")) == [
        "zerolite_no_such_package"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "missing_packages",
                        lambda names=gpu_check.REQUIRED: [n for n in names if n == "safetensors"])
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "do not import" in (said := capsys.readouterr().out) and "safetensors" in said


def test_on_a_gpu_the_rows_decide_the_exit_status(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "missing_packages", lambda names=(): [])
    monkeypatch.setattr(gpu_check, "machine_line", lambda: "a GPU machine")
    monkeypatch.setattr(gpu_check, "run_benchmarks", lambda out, python: [
        Row("benchmarks/step_time.py", "passed", 9.0, "table in step_time.txt")])
    for outcome, status in (("passed", 0), ("xfailed", 0), ("failed", 1)):
        monkeypatch.setattr(gpu_check, "run_tests",
                            lambda out, python, o=outcome: [Row("test_cuda::t", o, 1.0)])
        assert gpu_check.main(["--out", str(tmp_path)]) == status, outcome
        table = (tmp_path / "results.md").read_text()
        assert f"| `test_cuda::t` | {outcome} |" in table and "step_time.py" in table
        assert table in capsys.readouterr().out
