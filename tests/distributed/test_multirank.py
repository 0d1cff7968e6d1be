"""The trainer on several gloo ranks (torchrun) against one process: the same step, whatever the layout.

Each test launches ``tests/distributed/worker.py`` with ``torchrun --standalone``; the one-process reference
is the same script with one rank. Compute is FP32 (``precision.compute=fp32``), so layouts agree to FP32
round-off: rollouts token for token, the updated weights to 1e-6. Ratio quantiles are combined over shares
approximately (`fp8rl.trainer.loop.combine_shares`) and are not compared.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.golden.record import torchrun_command, torchrun_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = Path(__file__).with_name("worker.py")
ROOT = Path(__file__).resolve().parents[2]
APPROXIMATE = ("actor/ratio_q",)  # combined over shares approximately
WEIGHT_TOLERANCE = 1e-6


def torchrun(ranks: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    # On the golden record's pinned kernels (AVX2 code paths): with AVX-512 MKL picks GEMM kernels by the row count,
    # so a rank's half batch and the whole one round differently (measured here: 2e-6 in rollout log-probs).
    done = subprocess.run(
        [*torchrun_command(ranks), str(WORKER), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=torchrun_env(),
        cwd=ROOT,
    )
    if check and done.returncode != 0:
        pytest.fail(f"torchrun {' '.join(args)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}")
    return done


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("multirank")  # one warm-start cache for the module


def first_step(workdir: Path, name: str, ranks: int, *overrides: str) -> dict:
    out = workdir / name
    if not (out / "result.pt").exists():
        torchrun(ranks, "first-step", str(out), *overrides)
    return torch.load(out / "result.pt", weights_only=False)


@pytest.fixture(scope="module")
def reference(workdir: Path) -> dict:
    return first_step(workdir, "one", 1)


def assert_same_step(one: dict, many: dict, logp_tolerance: float = 0.0) -> None:
    assert torch.equal(one["rows"]["response_ids"], many["rows"]["response_ids"])
    assert torch.equal(one["rows"]["adv"], many["rows"]["adv"])
    torch.testing.assert_close(many["rows"]["rollout_logp"], one["rows"]["rollout_logp"], atol=logp_tolerance, rtol=0)
    assert one["state"].keys() == many["state"].keys()
    worst = max(float((one["state"][k] - many["state"][k]).abs().max()) for k in one["state"])
    assert worst <= WEIGHT_TOLERANCE, f"updated weights differ by {worst:.2e}"
    for key, value in one["metrics"].items():
        if key.startswith(("time/", *APPROXIMATE)):
            continue
        assert many["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_two_data_parallel_ranks_take_the_same_step_as_one_process(workdir: Path, reference: dict) -> None:
    assert_same_step(reference, first_step(workdir, "dp2", 2))


def test_two_tensor_parallel_ranks_take_the_same_step_as_one_process(workdir: Path, reference: dict) -> None:
    # Log-probs through a vocab-parallel softmax round differently (sampling picks the same tokens).
    assert_same_step(reference, first_step(workdir, "tp2", 2, "parallel.tensor_parallel=2"), logp_tolerance=1e-5)


def test_two_pipeline_stages_take_the_same_step_as_one_process(workdir: Path, reference: dict) -> None:
    assert_same_step(reference, first_step(workdir, "pp2", 2, "parallel.pipeline_parallel=2"), logp_tolerance=1e-5)


def test_tensor_and_data_parallel_together_take_the_same_step(workdir: Path, reference: dict) -> None:
    assert_same_step(reference, first_step(workdir, "tp2dp2", 4, "parallel.tensor_parallel=2"), logp_tolerance=1e-5)


def test_calibrated_clipping_gives_every_rank_the_same_bounds(workdir: Path) -> None:
    cc = ("precision.mode=fp8_full", "clipping.policy=calibrated", "clipping.rollout_correction=tis_token")
    result = first_step(workdir, "cc_dp2", 2, *cc)
    assert result["metrics"]["clip/calib_count"] == 1.0  # the step calibrated
    assert len(result["bounds"]) == 2 and result["bounds"][0] == result["bounds"][1]


def test_calibrated_kv_cache_scales_reach_every_stage_whole(workdir: Path) -> None:
    """Each pipeline stage records only its own layers' keys and values; every rank's engine gets every layer's
    scales (vLLM runs the whole model on each rank), equal to one process's (the trainer's pass unquantized: FP8
    rollout, fp32 compute)."""
    kv = ("precision.mode=fp8_rollout", "precision.fp8_kv_cache=true", "precision.kv_cache_scales=calibrated")
    one = first_step(workdir, "kv_one", 1, *kv)["kv_scales"][0]
    stages = first_step(workdir, "kv_pp2", 2, *kv, "parallel.pipeline_parallel=2")["kv_scales"]
    assert len(stages) == 2 and stages[0] == stages[1] and sorted(stages[0]) == sorted(one) and len(one) >= 2
    for layer, (k, v) in one.items():
        assert stages[0][layer] == pytest.approx((k, v), rel=1e-5)


def test_a_stopped_two_rank_job_resumes_where_an_uninterrupted_one_is(workdir: Path) -> None:
    torchrun(2, "run", str(workdir / "full"))
    torchrun(2, "run", str(workdir / "resumed"), "stop-after=1")
    checkpoints = sorted(p.name for p in (workdir / "resumed" / "run" / "checkpoints").glob("*.pt"))
    assert checkpoints == ["step_000001.pt", "step_000001.rank00001.pt"]  # one file per rank
    torchrun(2, "run", str(workdir / "resumed"))
    full = json.loads((workdir / "full" / "history.json").read_text())
    resumed = json.loads((workdir / "resumed" / "history.json").read_text())
    assert full["steps_done"] == resumed["steps_done"] == 2
    last, again = full["history"][-1], resumed["history"][-1]
    assert {k: v for k, v in again.items() if not k.startswith(("time/", "launch/"))} == {
        k: v for k, v in last.items() if not k.startswith(("time/", "launch/"))
    }


def test_a_two_rank_checkpoint_is_refused_by_one_rank_with_a_clear_message(workdir: Path) -> None:
    if not (workdir / "resumed" / "run" / "checkpoints").exists():
        torchrun(2, "run", str(workdir / "resumed"), "stop-after=1")
    done = torchrun(1, "run", str(workdir / "resumed"), check=False)
    assert done.returncode != 0
    assert "written by 2 rank(s), this job has 1" in done.stdout + done.stderr


@pytest.mark.parametrize("layout", [[], ["parallel.tensor_parallel=2"]], ids=["dp2", "tp2"])
def test_the_training_command_under_torchrun_logs_one_mlflow_run(tmp_path: Path, layout: list[str]) -> None:
    """What a user types: ``torchrun ... -m fp8rl.train``; every rank trains, rank 0 alone tracks."""
    from mlflow.tracking import MlflowClient

    (tmp_path / "warmstart").mkdir()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [
        "trainer.steps=2",
        "warmstart.steps=20",
        "warmstart.batch_size=32",
        f"warmstart.cache_dir={tmp_path / 'warmstart'}",
        "algo.prompts_per_step=4",
        "algo.group_size=4",
        "algo.num_minibatches=2",
        "eval.size=16",
        "task.num_eval=16",
        f"trainer.out_dir={tmp_path / 'run'}",
        f"tracking.tracking_uri={uri}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
        "trainer.export_every=2",
        *layout,
    ]
    done = subprocess.run(
        [*torchrun_command(2), "-m", "fp8rl.train", *overrides],
        capture_output=True,
        text=True,
        timeout=900,
        env=torchrun_env(),
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("fp8rl").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["fp8rl.world_size"] == "2"
    history = client.get_metric_history(runs[0].info.run_id, "rollout/reward")
    assert [m.step for m in history] == [1, 2]
    assert "step 2/2" in done.stdout + done.stderr  # the per-step log line
    exported = tmp_path / "run" / "hf" / "step_000002"  # the TP shards gathered into one checkpoint
    from fp8rl.models.hf import read_hf_tensors

    hf_config = json.loads((exported / "config.json").read_text())
    embedding = read_hf_tensors(exported)["model.embed_tokens.weight"]
    assert tuple(embedding.shape) == (hf_config["vocab_size"], hf_config["hidden_size"])


def test_emulated_fp8_under_tensor_parallelism_reduces_the_sharded_amaxes(workdir: Path) -> None:
    """``precision.amax_reduction=tp_invariant``: the per-tensor scales of TP shards are all-reduced, so TP=2 samples
    what one process samples in FP8 (without it, the shards' own scales change the sampled tokens). Log-probs agree
    to an FP8 step, not to round-off: a round-off difference can move a value across an FP8 rounding boundary."""
    fp8 = ("precision.mode=fp8_full", "precision.amax_reduction=tp_invariant")
    one = first_step(workdir, "fp8_one", 1, *fp8)
    tp2 = first_step(workdir, "fp8_tp2", 2, *fp8, "parallel.tensor_parallel=2")
    assert torch.equal(one["rows"]["response_ids"], tp2["rows"]["response_ids"])
    torch.testing.assert_close(tp2["rows"]["rollout_logp"], one["rows"]["rollout_logp"], atol=2e-3, rtol=0)
    # the loss averages ratios whose log-probs agree to 2e-3 (an FP8 step): measured 2.1e-3 relative (token-mean)
    assert tp2["metrics"]["actor/pg_loss"] == pytest.approx(one["metrics"]["actor/pg_loss"], rel=5e-3)


def test_the_vllm_engines_first_checkpoint_of_a_tensor_parallel_policy_is_the_whole_model(workdir: Path) -> None:
    """A TP = 2 policy exports its gathered weights (the engine used to export the rank's shard, which vLLM's
    start splits again with the full head counts): the same tensors as the one-process export."""
    from safetensors.torch import load_file

    torchrun(1, "hf-export", str(workdir / "export-tp1"))
    torchrun(2, "hf-export", str(workdir / "export-tp2"), "parallel.tensor_parallel=2")
    one, two = (load_file(str(workdir / name / "hf" / "model.safetensors")) for name in ("export-tp1", "export-tp2"))
    assert one.keys() == two.keys()
    for name, tensor in one.items():
        assert two[name].shape == tensor.shape and torch.equal(two[name], tensor), name
