"""Run megatron-core 0.16.1 with several ranks on CPU (gloo): the shims beyond ``cpu_compat``'s.

``cpu_compat`` makes one process work; tensor parallelism, Megatron's DistributedDataParallel and its
optimizers reach more CUDA-only code. Each shim below exists for the megatron lines it names, is applied
only when CUDA is unavailable, and is idempotent:

S1. ``torch.cuda.current_device()`` returns the CPU device. megatron allocates on it: DDP param/grad buffers
    (distributed/param_and_grad_buffer.py:800,806), sequence-parallel gathers and the dgrad reduce-scatter
    (tensor_parallel/mappings.py:91,141,148,181, tensor_parallel/layers.py:552), distributed-optimizer state
    loading (optimizer/distrib_optimizer.py:791), an empty ChainedOptimizer's loss scale (optimizer.py:1141).
S2. The TP / sequence-parallel linear as ``F.linear`` plus megatron's own mappings. megatron's
    ``LinearWithGradAccumulationAndAsyncCommunication`` (tensor_parallel/layers.py:443) is decorated with
    custom_fwd/custom_bwd bound to CUDA autocast (layers.py:68-69): under CPU bf16 autocast its backward
    fails on ``bf16 grad @ fp32 weight`` (layers.py:531), and cpu_compat's patch 6 routes exactly the TP
    calls (``allreduce_dgrad`` / ``sequence_parallel``) there. Same maths: ``allreduce_dgrad`` is
    ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce of dgrad), ``sequence_parallel`` is
    ``gather_from_sequence_parallel_region`` (all-gather forward, reduce-scatter backward), as megatron's
    ``linear_with_frozen_weight`` does (layers.py:432). Calls with a ``grad_output_buffer`` or gradient
    accumulation fusion still go to megatron's function.
S3. Grad norm, clipping and zero counting on CPU tensors: optimizer/clip_grads.py:103,115,174,207 create
    ``device='cuda'`` buffers, clip_grads.py:167 asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``,
    and utils.py:1207 (``local_multi_tensor_l2_norm``, the fallback without TE/apex) returns its norm on
    "cuda". The three functions run under :class:`CudaArgsToCpu`, in clip_grads and where optimizer/
    optimizer.py:50 imported them.
S4. Optimizer constructors: optimizer.py:473,481,485 (MixedPrecisionOptimizer: found_inf, dummy overflow
    buffer, unit scale on 'cuda'), optimizer.py:907 (FP32Optimizer._scale on 'cuda'), and
    optimizer/distrib_optimizer.py:361,420,582 (DistributedOptimizer picks its code path from
    ``param.type() == 'torch.cuda.FloatTensor'`` etc. and raises TypeError otherwise) run under
    :class:`CudaArgsToCpu`.
(The per-TP-rank model-parallel RNG offsets, megatron's ``seed + 2718 + tp_rank``, are in
``cpu_compat.install_cpu_rng_tracker``.)

Not needed for TP + DP: ``torch.cuda.synchronize`` (pipeline_parallel/p2p_communication.py:242,398, only
pipeline schedules).

Applied by `fp8rl.models.runtime.init_megatron` after megatron's groups exist with the run's layout, when
the world has more than one rank. Tested by tests/models/test_distributed_compat.py (two
spawned gloo ranks). Measured with these shims on a 2-layer GPT (fp32, vs one process): TP=2 logits 1.8e-7
and grads 6e-8 (after summing the QK-norm grads over TP); DP=2 synced grads 2.2e-8 and params after one
clipped AdamW step 1.8e-7, replicated or distributed optimizer; TP=2 x DP=2 grad norm 7e-9.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_FLAG = "_fp8rl_multirank"


def _is_cuda_device(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # megatron passes torch.cuda.current_device()'s int as a device
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaArgsToCpu(TorchFunctionMode):
    """Inside: ``device="cuda"`` (or an int) -> "cpu", ``t.cuda()`` -> t, ``t.type()`` -> "torch.cuda.<X>Tensor".

    Entered only around the megatron functions of S3 and S4, never around a model's forward/backward.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = torch.Tensor.type(args[0])
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _under_cuda_args_to_cpu(fn):
    if getattr(fn, _FLAG, False):
        return fn

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with CudaArgsToCpu():
            return fn(*args, **kwargs)

    setattr(wrapped, _FLAG, True)
    return wrapped


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


setattr(_cpu_current_device, _FLAG, True)


def shim_current_device() -> None:
    """S1."""
    torch.cuda.current_device = _cpu_current_device


def shim_tp_linear() -> None:
    """S2."""
    from megatron.core.tensor_parallel import layers, mappings

    def make(megatron_fn):
        if getattr(megatron_fn, _FLAG, False):
            return megatron_fn
        original = getattr(megatron_fn, "__wrapped__", megatron_fn)  # below cpu_compat's patch 6, if applied

        @functools.wraps(original)
        def linear(
            input,
            weight,
            bias=None,
            gradient_accumulation_fusion=False,
            allreduce_dgrad=False,
            sequence_parallel=False,
            grad_output_buffer=None,
            wgrad_deferral_limit=None,
            async_grad_allreduce=None,
            tp_group=None,
        ):
            if grad_output_buffer is not None or gradient_accumulation_fusion:
                return original(
                    input,
                    weight,
                    bias,
                    gradient_accumulation_fusion,
                    allreduce_dgrad,
                    sequence_parallel,
                    grad_output_buffer,
                    wgrad_deferral_limit,
                    async_grad_allreduce,
                    tp_group,
                )
            if sequence_parallel:
                input = mappings.gather_from_sequence_parallel_region(
                    input, tensor_parallel_output_grad=True, group=tp_group
                )
            elif allreduce_dgrad:
                input = mappings.copy_to_tensor_model_parallel_region(input, group=tp_group)
            return F.linear(input, weight, bias)

        setattr(linear, _FLAG, True)
        return linear

    layers.linear_with_grad_accumulation_and_async_allreduce = make(
        layers.linear_with_grad_accumulation_and_async_allreduce
    )
    layers.linear_with_frozen_weight = make(layers.linear_with_frozen_weight)


def shim_grad_norm_and_clip() -> None:
    """S3."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    for module in (clip_grads, mcore_optimizer):
        for name in ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32"):
            setattr(module, name, _under_cuda_args_to_cpu(getattr(module, name)))


def shim_optimizer_constructors() -> None:
    """S4."""
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer import optimizer as mcore_optimizer

    for cls in (
        mcore_optimizer.FP32Optimizer,
        mcore_optimizer.MixedPrecisionOptimizer,
        distrib_optimizer.DistributedOptimizer,
    ):
        cls.__init__ = _under_cuda_args_to_cpu(cls.__init__)


def apply_cpu_multirank_shims() -> None:
    """S1-S4 (module docstring); a no-op on a CUDA host; idempotent.

    Call after ``initialize_model_parallel`` with the run's layout and before building the model.
    """
    if torch.cuda.is_available():
        return
    shim_current_device()
    shim_tp_linear()
    shim_grad_norm_and_clip()
    shim_optimizer_constructors()
