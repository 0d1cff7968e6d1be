"""One RL step of the trainer with the model and the step's data on the fake "fakegpu" device (run by
test_device_placement.py in its own process). Prints one JSON line: what ran, or the error and where.

    _fake_device_worker.py WORKDIR [cpu]    `cpu` leaves the trainer's device on CPU (the data never moves:
                                            the bug a GPU run would hit), which must fail
    _fake_device_worker.py WORKDIR warmstart  one supervised warm-start step with the model on the fake device
"""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.fake_device import FAKE, ensure_fake_backend, fake_device_model  # noqa: E402


def main(workdir: Path, device: str) -> dict:
    from fp8rl.config import RunConfig, with_overrides
    from fp8rl.job import build_trainer
    from fp8rl.rollout.base import RolloutBatch

    changes = {
        "warmstart.steps": 0,
        "warmstart.cache_dir": str(workdir / "warmstart"),
        "trainer.out_dir": str(workdir / "run"),
        "tracking.enabled": False,
        "algo.prompts_per_step": 4,
        "algo.group_size": 4,
        "precision.compute": "fp32",  # no autocast kernels for a python backend
        "eval.every": 0,
    }
    (workdir / "warmstart").mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(with_overrides(RunConfig(), changes))
    data = trainer.sampler.collect(0)  # real CPU rollouts
    ensure_fake_backend()
    trainer.parts.device = torch.device(device)
    with fake_device_model(trainer.model) as mode:
        mode.host_syncs = []  # float(metric) on a fake tensor: stood in for, and counted
        fake = dataclasses.replace(
            data, rollout=RolloutBatch(*(mode.from_tensor(getattr(data.rollout, f)) for f in RolloutBatch.FIELDS))
        )
        fake.adv, fake.keep = mode.from_tensor(data.adv), mode.from_tensor(data.keep)
        trainer.sampler.collect = lambda step: fake
        try:
            trainer.train_step(0)
        except Exception as err:  # noqa: BLE001 - reported to the test
            frames = [f for f in traceback.extract_tb(err.__traceback__) if "/fp8rl/" in f.filename]
            where = f"{frames[-1].filename.split('fp8rl/')[-1]}:{frames[-1].lineno}" if frames else "?"
            return {"ran": False, "error": type(err).__name__, "where": where, "message": str(err)[:300]}
        finally:
            syncs = len(mode.host_syncs)
            mode.host_syncs = None
        grads = {p.grad.device.type for p in trainer.model.parameters() if p.grad is not None}
    return {"ran": True, "host_syncs": syncs, "grad_devices": sorted(grads)}


def warmstart_step_on_the_device(workdir: Path) -> dict:
    """A GPU host builds the warm start's model on CUDA (megatron's default); its batches must follow it."""
    from fp8rl.config import RunConfig
    from fp8rl.models.config import get_model_config, with_tokenizer_vocab
    from fp8rl.models.gpt import build_gpt_model
    from fp8rl.models.runtime import init_megatron
    from fp8rl.tasks import build_task
    from fp8rl.trainer.warmstart import warmstart_step

    init_megatron()
    cfg = RunConfig()
    task = build_task(cfg.task)
    model = build_gpt_model(with_tokenizer_vocab(get_model_config("tiny"), task.tokenizer.vocab_size), seed=0)
    ws_cfg = dataclasses.replace(cfg.warmstart, precision="fp32")
    with fake_device_model(model) as mode:
        mode.host_syncs = []
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            warmstart_step(model, optimizer, task, task.train_problems[:4], ws_cfg)
        except Exception as err:  # noqa: BLE001 - reported to the test
            return {"ran": False, "error": type(err).__name__, "message": str(err)[:300]}
        finally:
            mode.host_syncs = None
        grads = {p.grad.device.type for p in model.parameters() if p.grad is not None}
    return {"ran": True, "grad_devices": sorted(grads)}


if __name__ == "__main__":
    workdir, *rest = sys.argv[1:]
    if rest == ["warmstart"]:
        print(json.dumps(warmstart_step_on_the_device(Path(workdir))))
        sys.exit(0)
    device = "cpu" if rest == ["cpu"] else FAKE
    print(json.dumps(main(Path(workdir), device)))
