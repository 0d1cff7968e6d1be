"""``trainer.export_every``: the trained policy as a Hugging Face folder that loads back to the same weights."""

from __future__ import annotations

from pathlib import Path

import torch

from fp8rl.config import RunConfig, with_overrides
from fp8rl.job import run_job
from fp8rl.models.hf import hf_to_megatron, model_config_from_hf_folder, read_hf_tensors
from fp8rl.trainer import checkpoint as ckpt


def test_the_exported_folder_holds_the_checkpointed_weights_and_the_tokenizer(small_cfg: RunConfig) -> None:
    cfg = with_overrides(small_cfg, {"trainer.export_every": 2})
    run_job(cfg)
    folder = Path(cfg.trainer.out_dir) / "hf" / "step_000002"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert not (Path(cfg.trainer.out_dir) / "hf" / "step_000001").exists()
    model_cfg = model_config_from_hf_folder(folder)
    exported = hf_to_megatron(read_hf_tensors(folder), model_cfg)
    _, state = ckpt.latest_good_checkpoint(cfg.trainer.out_dir)
    trained = {k: v for k, v in state["model"].items() if torch.is_tensor(v) and not k.endswith("_extra_state")}
    assert exported.keys() == trained.keys()
    for key, value in trained.items():
        assert torch.equal(exported[key].float(), value.to(torch.bfloat16).float()), key  # stored in BF16
