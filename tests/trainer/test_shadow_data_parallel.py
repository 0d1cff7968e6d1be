"""Calibrated Clipping over data-parallel ranks: the BF16-shadow pool is gathered, so two gloo ranks holding
half the tokens each calibrate to exactly the bounds of one process holding them all, on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp8rl.algos.calibration import CalibratedClipBounds
from fp8rl.config import RunConfig
from fp8rl.models.dims import SINGLE, ParallelDims
from fp8rl.trainer.shadow import ShadowComparison

ROWS, LENGTH, MINIBATCHES = 32, 64, 4


def noisy_minibatches(seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """(ratio_ref, ratio_fp8, adv, mask) per mini-batch: FP8 noise on top of a BF16 ratio, as in the paper."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(MINIBATCHES):
        log_ratio = torch.randn(ROWS, LENGTH, generator=g) * 0.1
        ratio_fp8 = torch.exp(log_ratio + torch.randn(ROWS, LENGTH, generator=g) * 0.1)
        mask = torch.rand(ROWS, LENGTH, generator=g) < 0.8
        out.append((torch.exp(log_ratio), ratio_fp8, torch.randn(ROWS, generator=g), mask))
    return out


def calibrated(dims: ParallelDims) -> tuple[tuple[float, float], dict[str, float]]:
    """This rank's bounds and shadow metrics after pooling its share (half the rows of each mini-batch)."""
    policy = CalibratedClipBounds(first_step=0, ema=0.0)
    shadow = ShadowComparison(lambda batch, recipe: None, RunConfig().algo, dims)  # the pool only: no log-probs
    share = slice(dims.dp_rank * ROWS // dims.dp, (dims.dp_rank + 1) * ROWS // dims.dp)
    for ratio_ref, ratio_fp8, adv, mask in noisy_minibatches():
        keys = torch.arange(ROWS)[share] * 7919  # a sequence's key travels with it, whichever rank holds it
        shadow.add(ratio_ref[share], ratio_fp8[share], adv[share], mask[share], keys)
    metrics = shadow.finish(0, policy)
    return tuple(policy.bounds), metrics


def _rank(rank: int, store: str, queue) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        queue.put((rank, calibrated(ParallelDims(dp=2, dp_rank=rank))))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_calibrate_to_the_single_process_bounds(tmp_path) -> None:
    single_bounds, single_metrics = calibrated(SINGLE)
    assert single_metrics["clip/calib_ok"] == 1.0 and single_bounds[0] < 0.8  # the noise moved the lower bound
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_rank, args=(r, str(tmp_path / "store"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for rank in (0, 1):
        bounds, metrics = results[rank]
        assert bounds == single_bounds, (rank, bounds, single_bounds)
        for key in ("clip/shadow_tokens", "clip/shadow_overclip_neg", "clip/cc_oos_low_neg", "clip/calib_ok"):
            assert metrics[key] == pytest.approx(single_metrics[key], abs=1e-9), key
