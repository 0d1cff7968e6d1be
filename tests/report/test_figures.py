"""Training-curve figures from a real (sqlite) MLflow store holding a small synthetic three-seed sweep."""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgb

from fp8rl.launch.parent import ensure_parent
from fp8rl.report import figures
from fp8rl.report.frames import load_runs
from fp8rl.tracking import store as runs

EXPERIMENT = "grpo_granularity-tiny"
ARMS = {  # arm -> run tags the trainer sets
    "bf16": {"precision": "bf16", "recipe": "none", "clipping": "standard"},
    "fp8_tensorwise": {"precision": "fp8_full", "recipe": "tensorwise", "clipping": "standard"},
    "cc_tensorwise": {"precision": "fp8_full", "recipe": "tensorwise", "clipping": "calibrated"},
    "cc_rowwise": {"precision": "fp8_full", "recipe": "rowwise", "clipping": "calibrated"},
}


def _child(client, exp_id: str, parent: str, arm: str, seed: int) -> None:
    from mlflow.entities import Metric

    tags = {"mlflow.parentRunId": parent, "sweep.arm": arm, "fp8rl.config_hash": f"{arm}-{seed}", **ARMS[arm]}
    run_id = client.create_run(exp_id, tags=tags, run_name=f"{arm}-{seed}").info.run_id
    low = 0.8 if ARMS[arm]["clipping"] == "standard" else 0.75
    metrics = []
    for step in range(1, 11):
        metrics += [Metric("rollout/entropy", 0.2 + 0.01 * seed + 0.001 * step, 0, step)]
        metrics += [Metric("clip/bound_low", low, 0, step), Metric("clip/bound_high", 1.2, 0, step)]
        metrics += [Metric("rollout/garbled_rate", 0.01 * seed, 0, step)]
    client.log_batch(run_id, metrics=metrics)
    client.set_terminated(run_id, "FINISHED")


@pytest.fixture
def store(tmp_path: Path) -> str:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = runs.client(uri)
    exp_id = runs.experiment_id(client, EXPERIMENT, create=True)
    parent = ensure_parent(client, exp_id, EXPERIMENT, {"fp8rl.axes": "sweep.arm,sweep.trainer.seed"})
    for arm in ARMS:
        for seed in range(3):
            _child(client, exp_id, parent, arm, seed)
    return uri


def _texts(fig) -> list[str]:
    texts = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]
    return [t for t in texts if t]


def test_curves_are_a_block_per_recipe_with_seed_bands_labelled_axes_and_no_local_path(
    store: str, tmp_path: Path
) -> None:
    keys = [key for panel in figures.CURVE_PANELS for key in panel.keys]
    run_data, group_by, _ = load_runs(EXPERIMENT, keys, tracking_uri=store)
    fig = figures.curve_figure(EXPERIMENT, run_data, group_by)
    drawn = [ax for ax in fig.axes if ax.axison]
    assert len(drawn) == 2 * len(figures.CURVE_PANELS)  # a block for tensorwise, one for rowwise
    assert all(ax.get_ylabel() and ax.get_xlabel() == "RL step" for ax in drawn)
    tensorwise, rowwise = drawn[0], drawn[len(figures.CURVE_PANELS)]
    assert tensorwise.get_title() == rowwise.get_title() == "rollout entropy"
    assert tensorwise.get_ylabel() == "entropy (nats / token)"
    assert tensorwise.get_shared_y_axes().joined(tensorwise, rowwise)  # the blocks compare on one scale

    def bands(ax) -> int:
        return len([c for c in ax.collections if isinstance(c, PolyCollection)])

    assert (bands(tensorwise), bands(rowwise)) == (3, 2)  # BF16 in each block, then the block's own arms
    texts = _texts(fig)
    assert "tensorwise" in texts and "rowwise" in texts  # the blocks' headers
    assert any("clip bounds" in ax.get_title() for ax in drawn) and "garbled rollouts" in texts
    assert not any(str(tmp_path) in text or "sqlite" in text for text in texts)
    figures._plt().close(fig)


def test_each_arm_has_its_recipe_block_its_own_colour_and_the_method_as_line_style(store: str) -> None:
    run_data, group_by, _ = load_runs(EXPERIMENT, ["rollout/entropy"], tracking_uri=store)
    groups: dict = {}
    for run in run_data:
        groups.setdefault(run.group, []).append(run)
    styles = {group[0]: style for group, style in figures.arm_styles(groups, group_by).items()}
    assert styles["bf16"].color == to_rgb("black") and styles["bf16"].column == figures.REFERENCE
    assert styles["fp8_tensorwise"].column == styles["cc_tensorwise"].column == "tensorwise"
    assert styles["fp8_tensorwise"].color == to_rgb("tab:red") and styles["cc_tensorwise"].color == to_rgb("tab:blue")
    assert styles["cc_rowwise"].color == styles["cc_tensorwise"].color  # a method's colour in every block
    assert (styles["fp8_tensorwise"].linestyle, styles["cc_tensorwise"].linestyle) == ("--", "-")
    assert styles["cc_rowwise"].column == "rowwise"
    assert figures.figure_columns(figures.arm_styles(groups, group_by)) == ["tensorwise", "rowwise"]
    assert styles["cc_tensorwise"].label.startswith("FP8 + CC tensorwise (arm=cc_tensorwise; 3 seeds)")


def test_bf16_arms_beside_the_reference_get_a_block_of_their_own_and_colours_of_their_own() -> None:
    from fp8rl.report.frames import RunData

    bf16 = {"precision": "bf16", "recipe": "none", "clipping": "standard"}
    arms = ("bf16", "control_dropjunk", "control_dropother")
    groups = {(arm,): [RunData(arm, arm, (arm,), bf16, {}, {})] for arm in arms}
    styles = figures.arm_styles(groups, ["arm"])
    assert len({styles[arm,].color for arm in arms}) == 3  # two arms of one method in one block: two colours
    assert styles["control_dropjunk",].column == figures.BF16_COLUMN and styles["bf16",].column == figures.REFERENCE
    assert figures.figure_columns(styles) == [figures.BF16_COLUMN]
    assert figures.figure_columns({("bf16",): styles["bf16",]}) == [figures.REFERENCE]  # the reference alone


def test_figures_are_written_and_attached_to_the_sweeps_parent_run(store: str, tmp_path: Path) -> None:
    written = figures.training_curves(EXPERIMENT, tmp_path / "figures", tracking_uri=store)
    assert sorted(p.name for p in written) == [f"{EXPERIMENT}_curves.pdf", f"{EXPERIMENT}_curves.png"]
    client = runs.client(store)
    parent = runs.find_parent(client, runs.experiment_id(client, EXPERIMENT, create=False), EXPERIMENT)
    attached = sorted(a.path for a in client.list_artifacts(parent.info.run_id, "figures"))
    assert attached == [f"figures/{EXPERIMENT}_curves.pdf", f"figures/{EXPERIMENT}_curves.png"]


def test_the_band_of_a_share_stops_at_zero() -> None:
    from fp8rl.report.frames import RunData

    panel = next(p for p in figures.CURVE_PANELS if p.keys == ("rollout/garbled_rate",))
    members = [  # mean 0.01, sd 0.017 at every step: mean - sd is below 0, which no share can be
        RunData(f"r{seed}", f"r{seed}", ("fp8",), ARMS["fp8_tensorwise"], {}, {panel.keys[0]: [(1, v), (2, v)]})
        for seed, v in enumerate((0.0, 0.0, 0.03))
    ]
    groups = {("fp8",): members}
    plt = figures._plt()
    fig, ax = plt.subplots()
    figures._draw_panel(ax, panel, groups, figures.arm_styles(groups, ["arm"]))
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert band.get_paths()[0].vertices[:, 1].min() == 0.0
    plt.close(fig)


def test_bf16_on_another_axis_than_the_arm_is_no_reference_and_the_title_names_what_is_drawn() -> None:
    from fp8rl.report.frames import RunData

    tags = {"precision": "bf16", "recipe": "none", "clipping": "standard"}
    groups = {
        ("grpo", "bf16"): [RunData("a", "a", ("grpo", "bf16"), tags, {}, {})],
        ("dapo", "bf16"): [RunData("b", "b", ("dapo", "bf16"), tags, {}, {})],
    }
    styles = figures.arm_styles(groups, ["algo", "precision"])  # the fallback axes: no arm axis
    assert {s.column for s in styles.values()} == {figures.BF16_COLUMN}
    assert styles["grpo", "bf16"].color != styles["dapo", "bf16"].color
    title = figures._title("x", 2, figures.figure_columns(styles), styles)
    assert title == "x: mean over seeds, band ± 1 sd (2 runs); one block; BF16 green solid"
