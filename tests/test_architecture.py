"""The directions the README promises, checked on the source (imports parsed with ast)."""

from __future__ import annotations

import ast
import re
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


ABOVE_MODELS = ("fp8rl.trainer", "fp8rl.job", "fp8rl.launch", "fp8rl.tracking", "fp8rl.config", "fp8rl.choices")


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("models", (*ABOVE_MODELS, "hydra", "mlflow", "submitit")),
        ("rollout", (*ABOVE_MODELS, "hydra", "mlflow", "submitit")),
        (
            "trainer",
            (
                "hydra",
                "submitit",
                "mlflow",
                "fp8rl.train",
                "fp8rl.job",
                "fp8rl.launch",
                "fp8rl.report",
                "fp8rl.ablations",
            ),
        ),
        ("models", ("fp8rl.ablations",)),
        ("algos", ("fp8rl.ablations",)),
        ("ablations", ("fp8rl.job", "fp8rl.launch", "fp8rl.report", "fp8rl.studies", "hydra", "mlflow")),
        ("tasks", ("fp8rl.trainer", "fp8rl.models", "fp8rl.job", "hydra", "mlflow")),
        ("tracking", ("fp8rl.trainer", "fp8rl.job", "fp8rl.launch", "fp8rl.algos", "fp8rl.quant", "fp8rl.models")),
        ("report", ("fp8rl.launch", "fp8rl.job")),
        ("studies", ("fp8rl.launch",)),
        ("job", ("fp8rl.launch", "fp8rl.report", "hydra", "submitit")),
    ],
)
def test_dependency_directions(package: str, forbidden: tuple[str, ...]) -> None:
    for path, modules in imported_modules(package).items():
        for module in modules:
            hits = [f for f in forbidden if module == f or module.startswith(f + ".")]
            assert not hits, f"fp8rl/{path} imports {module}"


def test_the_config_imports_nothing_else_from_fp8rl() -> None:
    for path, modules in imported_modules("config").items():
        outside = [m for m in modules if m.startswith("fp8rl") and not m.startswith("fp8rl.config")]
        assert not outside, f"fp8rl/{path} imports {outside}"


def test_only_the_job_builds_a_trainer() -> None:
    """The job builds the parts and hands them to the trainer: nothing else in the package constructs one."""
    for path in PACKAGE.rglob("*.py"):
        if "job" in path.relative_to(PACKAGE).parts:
            continue
        text = path.read_text()
        assert "RLTrainer(" not in text or path.name == "loop.py", f"fp8rl/{path.relative_to(PACKAGE)} builds a trainer"


def test_the_option_tables_and_the_glossary_are_generated_from_their_sources() -> None:
    from fp8rl.docs import has_block, render

    for page in ("configuration.md", "metrics.md"):
        text = (PACKAGE.parent / "docs" / page).read_text()
        assert has_block(text) and render(text) == text, f"docs/{page} is stale: run `make docs`"


def test_the_readme_stays_the_front_door() -> None:
    """At most 250 lines: reference pages live in docs/, numbers in results/."""
    assert len((PACKAGE.parent / "README.md").read_text().splitlines()) <= 250


def test_every_relative_link_of_the_readme_and_the_docs_reaches_a_file() -> None:
    """Pages move (docs/running.md's ranks to docs/distributed.md, Calibrated Clipping to its own page): a link
    left behind fails here."""
    root = PACKAGE.parent
    pages = [root / "README.md", root / "results" / "README.md", *sorted((root / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(root)} -> {target}")
    assert not broken, broken


def _compared_strings(path: Path) -> set[str]:
    """String constants a file compares with == or != (the shape of a switch on a name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and any(isinstance(op, ast.Eq | ast.NotEq) for op in node.ops):
            found.update(c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant))
    return {value for value in found if isinstance(value, str)}


def test_the_run_path_never_switches_on_a_registered_name() -> None:
    """Registries answer what an entry needs (its options, whether it calibrates); the trainer and the job do not
    compare a config's value with a registered name, nor do the config's own cross-section rules (the four such
    switches of issue 24 are gone; a policy's requirements are its `config_errors`)."""
    from fp8rl import algos

    registered = set()
    for registry in (algos.POLICY_LOSSES, algos.ADVANTAGE_ESTIMATORS, algos.CLIP_BOUND_POLICIES, algos.KL_ESTIMATORS):
        registered.update(registry.names())
    registered -= {"none"}  # "none" is a value (no correction), not a switch on an entry
    for folder in ("trainer", "job", "config"):
        for path in (PACKAGE / folder).rglob("*.py"):
            switches = _compared_strings(path) & registered
            assert not switches, f"fp8rl/{path.relative_to(PACKAGE)} compares with registered names {switches}"


def test_the_core_never_imports_a_study() -> None:
    """Studies (fp8rl/studies) use the core through its public parts; nothing in the core imports them."""
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "studies":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            assert not any(n.startswith("fp8rl.studies") for n in names), f"fp8rl/{path.relative_to(PACKAGE)}"
