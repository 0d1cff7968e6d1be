"""Directions around the launcher: nothing below it imports it, and planning a sweep needs no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fp8rl"


def _top_level_imports(path: Path) -> set[str]:
    """Modules imported at module level (not inside functions)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _all_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


# Entry points that sit above the launcher: the CLI, the report (reads sweeps back from MLflow) and the
# studies (compose configs the way sweeps do). Nothing they build on imports them or the launcher.
ABOVE_THE_LAUNCHER = ("launch", "report", "studies")


def test_only_the_entry_points_import_the_launcher() -> None:
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name in ABOVE_THE_LAUNCHER or path.name == "cli.py":
            continue
        hits = [m for m in _all_imports(path) if m.startswith("fp8rl.launch")]
        assert not hits, f"{path.relative_to(PACKAGE.parent)} imports {hits}: the trainer knows no launcher"


def test_launcher_modules_import_no_torch_at_module_level() -> None:
    for path in (PACKAGE / "launch").glob("*.py"):
        heavy = [m for m in _top_level_imports(path) if m.split(".")[0] in ("torch", "megatron")]
        heavy += [m for m in _top_level_imports(path) if m.startswith(("fp8rl.trainer", "fp8rl.models"))]
        assert not heavy, f"{path.name} imports {heavy} at module level"


@pytest.mark.timeout(300)
def test_a_dry_run_plans_without_importing_megatron_or_vllm(tmp_path: Path) -> None:
    """Planning checks every point's registry names (the pure-maths registries import torch), but builds
    nothing: megatron and vLLM stay unimported."""
    code = (
        "import sys; from fp8rl.cli import main; "
        f"rc = main(['sweep', 'grpo_granularity', '--dry-run', '--root', {str(tmp_path)!r}, "
        f"'--tracking-uri', 'sqlite:///{tmp_path}/none.db']); "
        "assert rc == 0, rc; heavy = [m for m in ('megatron', 'vllm') if m in sys.modules]; "
        "assert not heavy, f'{heavy} imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
