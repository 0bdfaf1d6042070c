"""Repository hygiene that CI must hold: README commands, CI script and lint agree."""

from __future__ import annotations

import ast
import graphlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
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


def aserve_imports() -> dict[str, set[str]]:
    """Each aserve module's aserve imports, those inside functions included (they still run,
    only later) and those under `if TYPE_CHECKING:` left out (they never run)."""
    package = ROOT / "aserve"
    names = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for path in package.rglob("*.py")
    }

    def targets(node: ast.AST) -> Iterator[str]:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (t for child in node.orelse for t in targets(child))
            return
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from package import module` imports that module
                submodule = f"{node.module}.{alias.name}"
                yield submodule if submodule in names else node.module
        for child in ast.iter_child_nodes(node):
            yield from targets(child)

    return {
        name: {t for t in targets(ast.parse(path.read_text())) if t in names and t != name}
        for name, path in names.items()
    }


def test_aserve_modules_import_without_circles() -> None:
    """DESIGN's rule: imports point down, no circles. A circle, even through an import inside
    a function, ties two modules into one that cannot be read or tested apart."""
    graph = aserve_imports()
    assert len(graph) > 50 and graph["aserve.quant.fp8"]  # the walk found modules and imports
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        pytest.fail(f"import circle: {' -> '.join(error.args[1])}")
