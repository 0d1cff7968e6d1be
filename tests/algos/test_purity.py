"""fp8rl.algos is pure tensor maths: it imports only torch, numpy, the standard library and itself."""

import ast
import sys
from pathlib import Path

import fp8rl.algos

ALLOWED_THIRD_PARTY = {"torch", "numpy"}
ALGOS_DIR = Path(fp8rl.algos.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module)
    return modules


def test_algos_imports_only_torch_numpy_stdlib_and_itself():
    sources = sorted(ALGOS_DIR.glob("*.py"))
    assert len(sources) >= 9
    offending = {}
    for path in sources:
        for module in _imported_modules(path):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY or top == "__future__":
                continue
            if module == "fp8rl.algos" or module.startswith("fp8rl.algos."):
                continue
            offending.setdefault(path.name, []).append(module)
    assert offending == {}
