"""Experiments (``sweeps/experiment/*.yaml``) -> sweep points -> resolved `RunConfig`s, through Hydra.

An experiment is a Hydra multirun definition: a ``# @package _global_`` file that picks config groups
and lists its sweep axes in ``hydra.sweeper.params``. `expand_experiment` composes it exactly as
``python -m fp8rl.train -m experiment=<name>`` would (BasicSweeper's cartesian product of the
params, command-line sweeps such as ``trainer.seed=0,1,2`` added as further axes or replacing the file's
list for the same key), one Hydra compose
per point. `expand_points` does the same for an explicit list of points. Nothing here validates: a
point that does not compose carries its error, and the sweep runner reports all of them at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8rl.compose import SWEEPS_DIR, compose, hydra_context, sweeper_params
from fp8rl.config import ConfigError, RunConfig, from_dict

SCALES = ("tiny", "paper")


@dataclass
class SweepPoint:
    """One run of a sweep, before validation."""

    overrides: list[str]  # the Hydra overrides that compose it
    axes: dict[str, str]  # swept key -> this point's value, e.g. {"+experiment/arm": "cc_rowwise"}
    cfg: RunConfig | None = None  # resolved config (None when composing failed)
    choices: dict[str, str] = field(default_factory=dict)  # Hydra's group choices (hydra.runtime.choices)
    error: str | None = None  # why it did not compose

    @property
    def label(self) -> str:
        """Short, human name from the axis values: ``arm=cc_rowwise interval=10``."""
        return " ".join(f"{axis_name(k)}={v}" for k, v in self.axes.items()) or "base"


@dataclass
class SweepDefinition:
    """Every point of a sweep, plus where it came from."""

    experiment: str | None  # file name in sweeps/experiment/ (None for explicit points)
    scale: str | None
    axes: list[str]  # swept keys, in order
    points: list[SweepPoint]


def experiment_description(experiment: str, sweeps_dir: Path = SWEEPS_DIR) -> str:
    """The experiment file's own header comment (what it runs and why), as one paragraph per comment block; the
    MLflow experiment and the sweep's parent run show it."""
    lines = []
    for line in (sweeps_dir / "experiment" / f"{experiment}.yaml").read_text().splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            lines.append(line[1:].strip())
    return "\n".join(lines).strip()


def list_experiments(sweeps_dir: Path = SWEEPS_DIR) -> list[str]:
    """Experiment names (the top-level files of sweeps/experiment/; sub-folders hold shared arms)."""
    return sorted(p.stem for p in (sweeps_dir / "experiment").glob("*.yaml"))


def axis_name(key: str) -> str:
    """``"+experiment/arm"`` -> ``"arm"``, ``"clipping.interval"`` -> ``"interval"``."""
    return key.lstrip("+~").rsplit("/", 1)[-1].rsplit(".", 1)[-1]


def axis_tag(key: str) -> str:
    """MLflow tag of a sweep axis: ``"+experiment/arm"`` -> ``"sweep.arm"``, dotted keys kept whole."""
    bare = key.lstrip("+~").rsplit("/", 1)[-1]
    return f"sweep.{bare}"


def expand_experiment(
    experiment: str, scale: str | None = None, overrides: Sequence[str] = (), sweeps_dir: Path = SWEEPS_DIR
) -> SweepDefinition:
    """Compose every point of ``sweeps/experiment/<experiment>.yaml`` at `scale` (the file's default if None)."""
    if experiment not in list_experiments(sweeps_dir):
        raise ConfigError(f"unknown experiment {experiment!r}; valid: {list_experiments(sweeps_dir)}")
    if scale is not None and scale not in SCALES:
        raise ConfigError(f"scale={scale!r} is not valid; choose one of {list(SCALES)}")
    selection = [f"experiment={experiment}", *([f"scale={scale}"] if scale else [])]
    base, cli_sweeps = _split_sweeps(overrides)
    with hydra_context(sweeps_dir):
        # As Hydra's BasicSweeper: the file's params first, the command line after it (a plain override
        # of a swept key pins it, a command-line sweep of it replaces the file's list); the experiment
        # selection stays in front.
        replaced = {_key(o) for o in cli_sweeps}
        params = [f"{k}={v}" for k, v in sweeper_params([*selection, *base]).items() if k not in replaced]
        grid = _cartesian([*selection, *params, *base, *cli_sweeps])
        pinned = {_key(o) for o in base}
        axes = [k for k in dict.fromkeys(_key(o) for o in [*params, *cli_sweeps]) if k not in pinned]
        points = [_compose_point(point, axes) for point in grid]
    resolved_scale = next((p.choices.get("scale") for p in points if p.choices), scale)
    return SweepDefinition(experiment=experiment, scale=resolved_scale, axes=axes, points=points)


def expand_points(
    points: Sequence[Sequence[str]], base_overrides: Sequence[str] = (), sweeps_dir: Path = SWEEPS_DIR
) -> SweepDefinition:
    """An explicit list of points (each a list of overrides) on top of shared `base_overrides`."""
    keyed = [{_key(o): o.split("=", 1)[1] for o in point} for point in points]
    axes = [k for k in dict.fromkeys(k for p in keyed for k in p) if len({p.get(k) for p in keyed}) > 1]
    with hydra_context(sweeps_dir):
        composed = [_compose_point([*base_overrides, *point], axes) for point in points]
    for point in composed:  # a point that leaves an axis at its default still gets a value (tags, labels)
        point.axes = {k: point.axes.get(k) or _default_value(point, k) for k in axes}
    scale = next((p.choices.get("scale") for p in composed if p.choices), None)
    return SweepDefinition(experiment=None, scale=scale, axes=axes, points=composed)


def _default_value(point: SweepPoint, key: str) -> str:
    """The value a point has for an axis it does not set: its group choice, or the config field."""
    bare = key.lstrip("+~")
    if bare in point.choices:
        return point.choices[bare]
    node: Any = point.cfg
    for part in bare.split("."):
        node = getattr(node, part, None)
    return str(node) if node is not None else ""


def _split_sweeps(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """Command-line overrides -> (plain ones, sweeps such as ``trainer.seed=0,1,2``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    plain = [o.input_line for o in parsed if not o.is_sweep_override()]
    sweeps = [o.input_line for o in parsed if o.is_sweep_override()]
    return plain, sweeps


def _cartesian(overrides: list[str]) -> list[list[str]]:
    """The cartesian product of sweep overrides, as Hydra's BasicSweeper expands them, through Hydra's public
    override parser: a later override of a key replaces the earlier one's values in its first position; each
    sweep's values become an axis."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    by_key: dict[str, list[str]] = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        if override.is_sweep_override():
            values = list(override.sweep_string_iterator())
        else:
            values = [override.get_value_element_as_str()]
        by_key[key] = [f"{key}={value}" for value in values]
    return [list(point) for point in itertools.product(*by_key.values())]


def _key(override: str) -> str:
    return override.split("=", 1)[0]


def _compose_point(overrides: list[str], axes: list[str]) -> SweepPoint:
    values = {_key(o): o.split("=", 1)[1] for o in overrides}
    point = SweepPoint(overrides=list(overrides), axes={k: values[k] for k in axes if k in values})
    try:
        container, point.choices = compose(overrides)
        point.cfg = from_dict(container)
    except Exception as err:  # noqa: BLE001 - Hydra raises many types; the message is what the user needs
        point.error = f"{type(err).__name__}: {err}"
    return point
