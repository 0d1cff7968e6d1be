"""Config validation: impossible combinations fail before anything is built, saying what to change."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from fp8rl.config import ConfigError, RunConfig, flatten, from_dict, to_dict, validate

SWEEPS = Path(__file__).resolve().parents[1] / "sweeps"


def _cfg(**changes: object) -> RunConfig:
    cfg = RunConfig()
    for dotted, value in changes.items():
        section, field = dotted.split("__")
        setattr(getattr(cfg, section), field, value)
    return cfg


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"clipping__policy": "calibrated"}, "precision.mode=fp8_full"),
        (
            {"precision__mode": "fp8_full", "clipping__policy": "calibrated", "algo__num_minibatches": 1},
            "num_minibatches",
        ),
        ({"algo__prompts_per_step": 30, "algo__num_minibatches": 4}, "divisible"),
        ({"algo__prompts_per_step": 6, "algo__group_size": 4, "algo__num_minibatches": 4}, "splits groups"),
        ({"precision__recipe": "fp16"}, "precision.recipe"),
        ({"precision__recipe": "blockwise", "precision__scaling": "delayed"}, "tensorwise"),
        ({"precision__backend": "te"}, "CUDA"),
        ({"model__preset": "qwen3_8b"}, "model.preset=tiny"),
        ({"algo__eps_low": 1.5}, "eps_low"),
        ({"clipping__init_low": 1.1}, "init_low"),
        ({"rollout__temperature": 0.0}, "temperature"),
        ({"precision__fp8_kv_cache": True}, "fp8_kv_cache"),
        ({"algo__group_size": 1}, "group_size"),
    ],
)
def test_invalid_combinations_raise_with_advice(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        validate(_cfg(**changes))


def test_defaults_are_valid_and_round_trip() -> None:
    cfg = validate(RunConfig())
    assert from_dict(to_dict(cfg)) == cfg
    assert flatten({"a": {"b": 1, "c": {"d": 2}}}) == {"a.b": 1, "a.c.d": 2}


def test_unknown_field_is_refused() -> None:
    data = to_dict(RunConfig())
    data["algo"]["eps"] = 0.1
    with pytest.raises(ConfigError, match="unknown field"):
        from_dict(data)


GROUPS = {
    "algo": ["grpo", "dapo"],
    "precision": ["bf16", "fp8_rollout", "fp8_full"],
    "recipe": ["tensorwise", "rowwise", "blockwise", "mxfp8"],
    "clipping": ["standard", "tis", "calibrated"],
}


@pytest.mark.parametrize("algo", GROUPS["algo"])
@pytest.mark.parametrize("precision", GROUPS["precision"])
@pytest.mark.parametrize("clipping", GROUPS["clipping"])
def test_every_group_combination_composes_and_validates_or_explains(algo: str, precision: str, clipping: str) -> None:
    from fp8rl.train import resolve

    overrides = [f"algo={algo}", f"precision={precision}", f"clipping={clipping}", "trainer.out_dir=/tmp/x"]
    with initialize_config_dir(config_dir=str(SWEEPS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    if clipping == "calibrated" and precision != "fp8_full":
        with pytest.raises(ConfigError, match="fp8_full"):
            resolve(cfg)
    else:
        run_cfg = resolve(cfg)
        assert run_cfg.algo.name == algo and run_cfg.precision.mode == precision


def test_cli_exits_2_with_message_before_building_anything(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fp8rl.train", "precision=bf16", "clipping=calibrated", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "needs precision.mode=fp8_full" in proc.stderr
    assert not (tmp_path / "checkpoints").exists()
