"""fp8rl.models.pipeline: PP=2 over gloo in two processes against the single-process model."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8rl.models.pipeline import global_key

WORKER = Path(__file__).with_name("_pipeline_pp2_worker.py")


def test_global_key_shifts_only_decoder_layer_indices():
    assert global_key("decoder.layers.0.mlp.linear_fc1.weight", 2) == "decoder.layers.2.mlp.linear_fc1.weight"
    assert global_key("decoder.layers.11.input_layernorm.weight", 12) == "decoder.layers.23.input_layernorm.weight"
    assert global_key("decoder.final_layernorm.weight", 2) == "decoder.final_layernorm.weight"
    assert global_key("embedding.word_embeddings.weight", 2) == "embedding.word_embeddings.weight"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the worker runs gloo on CPU")
def test_pp2_logprobs_loss_and_grads_equal_single_process():
    """Variable (b, s) micro-batches, fp32 and bf16 autocast, untied and tied embeddings: log-probs, entropies,
    the globally token-normalised loss and every parameter's gradient within 1e-6 of one process."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "PIPELINE WORKER OK" in result.stdout, (
        result.stdout[-3000:] + result.stderr[-3000:]
    )
