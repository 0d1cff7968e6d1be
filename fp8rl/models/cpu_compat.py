"""Run megatron-core 0.16.1 in one process, on CPU as well as on one GPU.

megatron-core assumes CUDA in a handful of places that a tiny CPU model reaches. Each patch below
exists for exactly one of them, is applied only when CUDA is unavailable, and is idempotent:

1. ``GlobalMemoryBuffer.get_tensor`` allocates with ``device=torch.cuda.current_device()``; the local
   ``DotProductAttention`` takes its ``baddbmm`` output buffer from it on every forward. We replace
   the buffer *instance* held by ``parallel_state`` with a subclass allocating on the device of the
   attention's query (set by a wrapper of ``DotProductAttention.forward``): CPU here, and whatever device
   a model is moved to (the fake-device placement tests, tests/models/test_device_placement.py).
2. The CUDA RNG tracker (``model_parallel_cuda_manual_seed`` / ``get_cuda_rng_tracker``) saves and
   restores ``torch.cuda`` RNG states; ``DotProductAttention`` forks it around attention dropout on
   every forward. We install a tracker with the same interface over the CPU generator.
3. ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` when it sits on
   CPU; we keep it where it is.
4. ``Attention._allocate_memory`` (the static KV cache used for incremental decoding) allocates on
   ``torch.cuda.current_device()``; we allocate on the device of the layer's weights.
5. ``get_default_causal_mask`` (used when ``attention_mask`` is None) builds its mask on "cuda"; we
   build it on CPU. The callers in ``fp8rl.models`` always pass an explicit mask anyway.
6. The local linears run their GEMM in a custom autograd function whose ``custom_fwd/custom_bwd`` are
   bound to CUDA autocast. Under CPU bf16 autocast its forward saves the fp32 weight and yields a
   bf16 output, and its backward (outside autocast) fails on ``bf16 grad @ fp32 weight``. Without
   tensor/sequence parallelism that function is exactly ``F.linear``, which autocast handles, so
   those calls are routed there (the TP / sequence-parallel cases still go to megatron's function).

`fp8rl.models.runtime.init_megatron` applies them, after megatron's parallel state exists; nothing here
initialises process groups.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.fusions import fused_softmax
from megatron.core.models.common.embeddings import rotary_pos_embedding
from megatron.core.tensor_parallel import layers as mcore_layers
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer import attention as mcore_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.utils import GlobalMemoryBuffer

_PATCHED_ATTR = "_fp8rl_cpu_patched"


def apply_cpu_shims() -> None:
    """Patches 1 and 3-6 (idempotent); the RNG tracker (patch 2) is installed by `install_cpu_rng_tracker`."""
    use_cpu_memory_buffer()
    patch_cuda_only_code_paths()


class CpuGlobalMemoryBuffer(GlobalMemoryBuffer):
    """megatron's reusable scratch buffer, allocated on the device of the attention's query (patch 1)."""

    device = torch.device("cpu")

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        required_len = 1
        for dim in tensor_shape:
            required_len *= dim
        key = (name, dtype, self.device)
        cached = self.buffer.get(key)
        if cached is None or cached.numel() < required_len:
            self.buffer[key] = torch.empty(required_len, dtype=dtype, device=self.device, requires_grad=False)
        return self.buffer[key][0:required_len].view(*tensor_shape)


def use_cpu_memory_buffer() -> None:
    """Swap the buffer instance held by ``parallel_state`` for a device-following one (patch 1)."""
    if not isinstance(parallel_state._GLOBAL_MEMORY_BUFFER, CpuGlobalMemoryBuffer):
        parallel_state._GLOBAL_MEMORY_BUFFER = CpuGlobalMemoryBuffer()
    if getattr(DotProductAttention.forward, _PATCHED_ATTR, False):
        return
    original = DotProductAttention.forward

    @functools.wraps(original)
    def forward(self, query, *args, **kwargs):
        buffer = parallel_state._GLOBAL_MEMORY_BUFFER
        if isinstance(buffer, CpuGlobalMemoryBuffer):
            buffer.device = query.device
        return original(self, query, *args, **kwargs)

    setattr(forward, _PATCHED_ATTR, True)
    DotProductAttention.forward = forward


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """``CudaRNGStatesTracker`` over the CPU generator (patch 2).

    ``add(name, seed)`` records the CPU state a generator seeded with ``seed`` would have;
    ``fork(name)`` swaps that state in for the duration of the block and swaps the caller's back.
    Subclassing keeps megatron's ``isinstance`` checks (``get_all_rng_states``) working.
    """

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        caller_state = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(caller_state)


def install_cpu_rng_tracker(seed: int) -> None:
    """Install a fresh CPU tracker with megatron's three named states, seeded as megatron seeds them
    (model_parallel_cuda_manual_seed, tensor_parallel/random.py: the model-parallel stream is offset by the TP
    rank, the expert one by the expert ranks)."""
    tracker = CpuRNGStatesTracker()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    expert = 100 * parallel_state.get_expert_model_parallel_rank() + parallel_state.get_expert_tensor_parallel_rank()
    tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + expert)
    mcore_random._CUDA_RNG_STATE_TRACKER = tracker
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _rotary_emb_on_own_device(self: Any, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """``RotaryEmbedding.get_emb`` without the move to CUDA (patch 3). Returns (seq, 1, 1, dim)."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def _allocate_kv_memory_on_weight_device(
    self: Any, inference_max_sequence_length: int, batch_size: int, dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """``Attention._allocate_memory`` on the layer's own device (patch 4). Returns (seq, batch, groups, dim)."""
    device = self.linear_qkv.weight.device
    shape = (inference_max_sequence_length, batch_size, self.num_query_groups_per_partition, dim)
    return torch.empty(shape, dtype=dtype, device=device)


def _default_causal_mask_on_cpu(sq: int) -> torch.Tensor:
    """``get_default_causal_mask`` on CPU (patch 5). Returns (sq, sq) bool, True = masked."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _autocast_safe_linear(megatron_linear: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap one of megatron's linear functions so the single-rank case is ``F.linear`` (patch 6)."""

    @functools.wraps(megatron_linear)
    def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **kwargs: Any):
        if kwargs.get("sequence_parallel") or kwargs.get("allreduce_dgrad") or kwargs.get("grad_output_buffer"):
            return megatron_linear(input, weight, bias, **kwargs)
        return F.linear(input, weight, bias)

    return linear


def patch_cuda_only_code_paths() -> None:
    """Apply patches 3-6 once; a second call is a no-op."""
    if getattr(rotary_pos_embedding.RotaryEmbedding, _PATCHED_ATTR, False):
        return
    rotary_pos_embedding.RotaryEmbedding.get_emb = _rotary_emb_on_own_device
    mcore_attention.Attention._allocate_memory = _allocate_kv_memory_on_weight_device
    fused_softmax.get_default_causal_mask = _default_causal_mask_on_cpu
    mcore_layers.linear_with_grad_accumulation_and_async_allreduce = _autocast_safe_linear(
        mcore_layers.linear_with_grad_accumulation_and_async_allreduce
    )
    mcore_layers.linear_with_frozen_weight = _autocast_safe_linear(mcore_layers.linear_with_frozen_weight)
    setattr(rotary_pos_embedding.RotaryEmbedding, _PATCHED_ATTR, True)
