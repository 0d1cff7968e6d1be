"""The directions the README promises, checked on the source (imports parsed with ast)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fp8rl"
STDLIB = set(sys.stdlib_module_names)


def imported_modules(package: str) -> dict[str, set[str]]:
    """file -> top-level-qualified modules it imports (absolute; relative imports resolved)."""
    out = {}
    for path in (PACKAGE / package).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module if node.level == 0 else f"fp8rl.{package}.{node.module}")
        out[str(path.relative_to(PACKAGE))] = names
    return out


@pytest.mark.parametrize("package", ["quant", "algos"])
def test_pure_maths_imports_only_torch_numpy_and_itself(package: str) -> None:
    for path, modules in imported_modules(package).items():
        for module in modules:
            top = module.split(".")[0]
            allowed = top in STDLIB or top in ("torch", "numpy", "__future__") or module.startswith(f"fp8rl.{package}")
            assert allowed, f"fp8rl/{path} imports {module}"


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("models", ("fp8rl.trainer", "fp8rl.tracking", "hydra", "mlflow", "submitit")),
        ("rollout", ("fp8rl.trainer", "fp8rl.tracking", "hydra", "mlflow", "submitit")),
        ("trainer", ("hydra", "submitit", "fp8rl.train")),
        ("tasks", ("fp8rl.trainer", "fp8rl.models", "hydra", "mlflow")),
        ("tracking", ("fp8rl.trainer", "fp8rl.algos", "fp8rl.quant")),
    ],
)
def test_dependency_directions(package: str, forbidden: tuple[str, ...]) -> None:
    for path, modules in imported_modules(package).items():
        for module in modules:
            hits = [f for f in forbidden if module == f or module.startswith(f + ".")]
            assert not hits, f"fp8rl/{path} imports {module}"


def test_readme_option_tables_are_generated_from_the_configs() -> None:
    from fp8rl.docs import render

    readme = (PACKAGE.parent / "README.md").read_text()
    assert render(readme) == readme, "README option tables are stale: run `make docs`"
