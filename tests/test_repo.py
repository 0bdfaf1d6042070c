"""Repository hygiene that CI must hold: README commands, CI script and lint agree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command() -> None:
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    command = next(line for line in ci_lines if "pytest" in line)
    assert command in (ROOT / "README.md").read_text().splitlines()


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff comes with the test extras")
def test_ruff_lint_and_format_are_clean() -> None:
    for args in (["check", "."], ["format", "--check", "."]):
        result = subprocess.run(
            ["ruff", *args], cwd=ROOT, capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_import_aserve_loads_no_gpu_kernels() -> None:
    code = "import sys, aserve; assert 'flashinfer' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_the_command_line_answers_before_torch_loads() -> None:
    """`import aserve` and the command's option parsing import no torch (~4 s), so --help,
    a bad option and a missing model answer at once; the offline API still loads on first
    use."""
    code = (
        "import sys, aserve, aserve.cli\n"
        "assert 'torch' not in sys.modules\n"
        "for argv in (['--page-size', '0'], ['--model', '/no/such/model.gguf']):\n"
        "    try:\n"
        "        aserve.cli.main(argv)\n"
        "    except SystemExit as stop:\n"
        "        assert stop.code == 2\n"
        "    else:\n"
        "        raise AssertionError(argv)\n"
        "assert 'torch' not in sys.modules\n"
        "from aserve import LLM, SamplingParams\n"
        "assert LLM.__module__ == 'aserve.llm' and 'torch' in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "must be at least 1, got 0" in done.stderr
    assert "model path does not exist: /no/such/model.gguf" in done.stderr
