import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from fp8rl.models.cpu_compat import CpuGlobalMemoryBuffer, CpuRNGStatesTracker
from fp8rl.models.logprobs import causal_padding_mask
from fp8rl.models.runtime import init_megatron

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches are not applied on a CUDA host")


def test_a_model_build_needs_megatron_initialised_first_and_a_layout_cannot_change() -> None:
    """Building a model never sets megatron up behind the caller's back (a fresh process shows it)."""
    import subprocess
    import sys

    code = (
        "from fp8rl.models.config import get_model_config, with_tokenizer_vocab\n"
        "from fp8rl.models.gpt import build_gpt_model\n"
        "from fp8rl.models.runtime import init_megatron\n"
        "cfg = with_tokenizer_vocab(get_model_config('tiny'), 18)\n"
        "try:\n    build_gpt_model(cfg)\nexcept RuntimeError as err:\n    assert 'init_megatron' in str(err), err\n"
        "else:\n    raise SystemExit('built without megatron')\n"
        "init_megatron(1, 1)\nbuild_gpt_model(cfg)\n"
        "try:\n    init_megatron(2, 1)\nexcept RuntimeError as err:\n    assert 'cannot change' in str(err), err\n"
        "else:\n    raise SystemExit('layout changed')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_init_is_idempotent_and_single_rank():
    init_megatron(seed=0)
    init_megatron(seed=0)
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert parallel_state.model_parallel_is_initialized()
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    assert parallel_state.get_pipeline_model_parallel_world_size() == 1


@cpu_only
def test_memory_buffer_is_on_cpu_and_reused():
    init_megatron(seed=0)
    buffer = parallel_state.get_global_memory_buffer()
    assert isinstance(buffer, CpuGlobalMemoryBuffer)
    big = buffer.get_tensor((4, 6), torch.float32, "test")
    small = buffer.get_tensor((2, 3), torch.float32, "test")
    assert big.device.type == "cpu" and small.shape == (2, 3)
    assert small.data_ptr() == big.data_ptr()


@cpu_only
def test_rng_tracker_forks_without_disturbing_the_caller():
    init_megatron(seed=7)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert isinstance(tracker, CpuRNGStatesTracker)
    torch.manual_seed(123)
    expected_caller_draw = torch.rand(3)
    torch.manual_seed(123)
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.rand(3), expected_caller_draw)
    with tracker.fork():
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the forked stream advances

    init_megatron(seed=7)  # re-seeding restarts the named streams
    with tensor_parallel.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(3), first)


@cpu_only
def test_rng_tracker_rejects_duplicates_and_unknown_names():
    tracker = CpuRNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError):
        tracker.add("b", 1)
    with pytest.raises(ValueError):
        tracker.add("a", 2)
    with pytest.raises(KeyError):
        with tracker.fork("missing"):
            pass


def test_default_causal_mask_equals_the_explicit_one(tiny_model):
    ids = torch.randint(0, 18, (2, 7))
    positions = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        implicit = tiny_model(ids, positions, None)
        explicit = tiny_model(ids, positions, causal_padding_mask(torch.ones(2, 7)))
    assert torch.equal(implicit, explicit)


def test_bf16_autocast_backward_matches_fp32(tiny_model):
    ids = torch.randint(0, 18, (4, 9))
    mask = causal_padding_mask(torch.ones(4, 9))
    positions = torch.arange(9).expand(4, 9)

    def grads(autocast: bool) -> torch.Tensor:
        tiny_model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = tiny_model(ids, positions, mask).float().logsumexp(-1).mean()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in tiny_model.parameters()])

    fp32, bf16 = grads(False), grads(True)
    assert torch.isfinite(bf16).all()
    assert torch.nn.functional.cosine_similarity(fp32, bf16, dim=0) > 0.99
