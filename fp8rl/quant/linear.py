"""`fp8_linear`: a linear layer whose three GEMMs run on FP8-quantized operands (pure torch).

Forward ``y = x @ W^T + b`` quantizes x and W; backward quantizes the output gradient dy and computes
dgrad ``dx = dy @ W`` and wgrad ``dW = dy^T @ x`` from FP8 operands, as Transformer Engine does for
each recipe (see `fp8rl.quant.recipes` for the operand layouts). Accumulation is in FP32; the bias
and its gradient stay in high precision, as in TE.

GEMM emulation: FP8 values are exact in bf16 and fp32, so the product of two quantized operands is
computed exactly up to the accumulation order:
- scales constant along the reduction dimension ("tensor", "row"): the GEMM runs on the raw FP8
  values and the scales are applied to its output (``y = (qa @ qb^T) * sa * sb^T``), as the hardware does;
- scales that vary along the reduction dimension (blocks): the operands are dequantized first, which
  is exact in the compute dtype when the scales are powers of two (blockwise default, MXFP8 always),
  and done in fp32 otherwise.
The compute dtype is the autocast dtype when autocast is on (bf16 GEMMs with fp32 accumulation),
else the input dtype. With bf16 compute and outer scales, the GEMM output is rounded to bf16 before
the scales are applied: one extra bf16 rounding (unit roundoff 2^-8) that hardware avoids. With float16
compute, the raw-FP8 GEMM runs in fp32 (unscaled FP8 products overflow float16).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from fp8rl.quant.formats import get_format
from fp8rl.quant.granularity import TRANSPOSED
from fp8rl.quant.recipes import Fp8Recipe, get_recipe
from fp8rl.quant.tensor import Fp8Tensor, _check_finite, _is_pow2, block_amax, fp8_to_float, quantize

_OUTER_SCALED = frozenset({"tensor", "row"})


@dataclass
class DelayedScalingState:
    """Amax histories for delayed (tensorwise) scaling, one per operand role; checkpointable."""

    history_len: int = 16
    histories: dict[str, torch.Tensor] = field(default_factory=dict)

    def scaling_amax(self, role: str, algo: str) -> torch.Tensor | None:
        """The amax that sets this step's scale; None before the first step (TE then uses scale 1)."""
        history = self.histories.get(role)
        if history is None:
            return None
        return history.amax() if algo == "max" else history[0]

    def record(self, role: str, amax: torch.Tensor) -> None:
        """Push this step's amax to the front of the role's history window."""
        history = self.histories.get(role)
        if history is None:
            history = torch.zeros(self.history_len, dtype=torch.float32)
        self.histories[role] = torch.cat([amax.detach().float().reshape(1), history[:-1]])

    def state_dict(self) -> dict:
        return {"history_len": self.history_len, "histories": {k: v.clone() for k, v in self.histories.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.history_len = int(state["history_len"])
        self.histories = {k: v.clone() for k, v in state["histories"].items()}


class _WeightCache:
    """Quantized weights reused while a weight's values are bitwise unchanged.

    The in-place version counter is not enough: writes through ``weight.data`` (megatron's
    distributed optimizer, vLLM-style weight sync) and fused optimizers (``torch.optim.AdamW(fused=True)``
    on CPU) change the values without bumping ``weight._version``. So each entry keeps a snapshot of
    the weight and a hit needs a bitwise-equal weight: one compare pass instead of a requantization,
    at the memory cost of one copy of each cached weight.
    """

    def __init__(self) -> None:
        # id(weight) -> (weakref to weight, snapshot of its values, {key: quantized weight})
        self._entries: dict[int, tuple[weakref.ref, torch.Tensor, dict[tuple, Fp8Tensor]]] = {}

    def get(self, weight: torch.Tensor, key: tuple, make) -> Fp8Tensor:
        entry = self._entries.get(id(weight))
        if entry is None or entry[0]() is not weight or not _bitwise_equal(entry[1], weight):
            slot = id(weight)
            ref = weakref.ref(weight, lambda _ref, s=slot: self._entries.pop(s, None))
            entry = (ref, weight.detach().clone(), {})
            self._entries[slot] = entry
        values = entry[2]
        if key not in values:
            values[key] = make()
        return values[key]


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN payloads and the sign of zero included)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.detach().view(int_dtype), b.detach().view(int_dtype))


_WEIGHT_CACHE = _WeightCache()


def _quantize_operand(
    t: torch.Tensor, granularity: str, fmt: str, recipe: Fp8Recipe, state: DelayedScalingState | None, role: str
) -> Fp8Tensor:
    """Quantize one GEMM operand (rows, reduction); delayed scaling reads and updates `state`."""
    if recipe.scaling != "delayed" or state is None:
        return quantize(t, fmt, granularity, recipe.uses_pow2_scales)
    fp8_max = get_format(fmt).max
    history_amax = state.scaling_amax(role, recipe.amax_compute_algo)
    current_amax = block_amax(t.reshape(-1, t.shape[-1]), "tensor")
    _check_finite(current_amax, "raise")  # before recording: a NaN must not poison the history
    state.record(role, current_amax)
    if history_amax is None or float(history_amax) == 0.0:
        scaling_amax = torch.tensor(fp8_max)  # TE's initial scale: 1.0
    else:
        scaling_amax = history_amax * (2.0**recipe.margin)
    return quantize(t, fmt, granularity, recipe.uses_pow2_scales, amax=scaling_amax)


def fp8_gemm(qa: Fp8Tensor, qb: Fp8Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """``A @ B^T`` from two quantized operands laid out (rows, reduction); returns fp32 (M, N)."""
    if qa.granularity in _OUTER_SCALED and qb.granularity in _OUTER_SCALED:
        # Unscaled FP8 products reach 448^2 (E4M3) or 57344^2 (E5M2): past float16's 65504, so a
        # float16 compute dtype runs this GEMM in float32 (bf16 has float32's range).
        raw_dtype = torch.float32 if compute_dtype == torch.float16 else compute_dtype
        raw_a = fp8_to_float(qa.data, raw_dtype, check_nonfinite=qa.may_have_nonfinite)
        raw_b = fp8_to_float(qb.data, raw_dtype, check_nonfinite=qb.may_have_nonfinite)
        out = (raw_a @ raw_b.t()).float()
        if qa.scale.dim() == 0 and qb.scale.dim() == 0:
            return out.mul_(qa.scale * qb.scale)
        scale_a = qa.scale if qa.scale.dim() == 0 else qa.scale.reshape(-1, 1)
        scale_b = qb.scale if qb.scale.dim() == 0 else qb.scale.reshape(1, -1)
        return out.mul_(scale_a).mul_(scale_b)
    exact_in_compute = _is_pow2(qa.scale) and _is_pow2(qb.scale)
    dtype = compute_dtype if exact_in_compute else torch.float32
    return (qa.dequantize(dtype) @ qb.dequantize(dtype).t()).float()


def _quantize_transposed(t: torch.Tensor, q: Fp8Tensor, granularity: str, fmt: str, recipe: Fp8Recipe) -> Fp8Tensor:
    """Quantize t^T along t's rows (the other GEMM usage); reuses `q` when the blocks are symmetric."""
    if TRANSPOSED[granularity] == granularity and q.fmt == fmt:
        return q.t()
    return quantize(t, fmt, TRANSPOSED[granularity], recipe.uses_pow2_scales).t()


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, recipe: Fp8Recipe, state, compute_dtype, out_dtype):
        with torch.autocast(x2d.device.type, enabled=False):
            act = recipe.activation_granularity
            qx = _quantize_operand(x2d, act, recipe.forward_format, recipe, state, "x")
            qw = _cached_weight(weight, recipe, transposed=False, state=state)
            y = fp8_gemm(qx, qw, compute_dtype)
            if bias is not None:
                y = y + bias.float()
            # Like TE, keep only the columnwise FP8 copy of x that wgrad needs, not x itself.
            qxt = _quantize_transposed(x2d, qx, act, recipe.forward_format, recipe)
        ctx.save_for_backward(weight)
        ctx.qxt, ctx.x_dtype = qxt, x2d.dtype
        # Delayed scaling quantizes W once per step with the history's scale; dgrad must use that
        # same FP8 weight (tensorwise: its transpose), as TE does, not a current-scaled requantization.
        ctx.qw_delayed = qw if recipe.scaling == "delayed" and state is not None else None
        ctx.recipe, ctx.state, ctx.compute_dtype, ctx.has_bias = recipe, state, compute_dtype, bias is not None
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        recipe, state, compute_dtype = ctx.recipe, ctx.state, ctx.compute_dtype
        with torch.autocast(dy.device.type, enabled=False):
            grad = recipe.gradient_granularity
            qdy = _quantize_operand(dy, grad, recipe.backward_format, recipe, state, "dy")
            if ctx.qw_delayed is not None:
                qwt = ctx.qw_delayed.t()
            else:
                qwt = _cached_weight(weight, recipe, transposed=True, state=None)
            dx = fp8_gemm(qdy, qwt, compute_dtype).to(ctx.x_dtype)
            qdyt = _quantize_transposed(dy, qdy, grad, recipe.backward_format, recipe)
            dw = fp8_gemm(qdyt, ctx.qxt, compute_dtype).to(weight.dtype)
            db = dy.float().sum(0).to(weight.dtype) if ctx.has_bias else None
        ctx.qxt = ctx.qw_delayed = None
        return dx, dw, db, None, None, None, None


def _cached_weight(weight: torch.Tensor, recipe: Fp8Recipe, transposed: bool, state) -> Fp8Tensor:
    """Quantize W (N, K) for fprop or W^T (K, N) for dgrad; cached until the weight changes."""
    granularity, fmt = recipe.weight_granularity, recipe.forward_format
    if recipe.scaling == "delayed" and state is not None:
        return _quantize_operand(weight.detach(), granularity, fmt, recipe, state, "w")
    key = (granularity, fmt, recipe.uses_pow2_scales, recipe.scaling, transposed)

    def make() -> Fp8Tensor:
        if not transposed:
            return quantize(weight.detach(), fmt, granularity, recipe.uses_pow2_scales)
        rowwise = _cached_weight(weight, recipe, transposed=False, state=None)
        return _quantize_transposed(weight.detach(), rowwise, granularity, fmt, recipe)

    return _WEIGHT_CACHE.get(weight, key, make)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Fp8Recipe | str,
    state: DelayedScalingState | None = None,
) -> torch.Tensor:
    """A linear layer computed from FP8 operands in forward and backward.

    Args:
        x: (..., in_features) input.
        weight: (out_features, in_features) master weight (kept in its own dtype; quantized per use).
        bias: (out_features,) or None, added in high precision.
        recipe: an `Fp8Recipe` or a recipe name ("tensorwise", "rowwise", "blockwise", "mxfp8").
        state: amax histories for delayed scaling (required for `scaling="delayed"` to be stateful).

    Returns:
        (..., out_features) in the autocast dtype when autocast is on, else in x's dtype.
    """
    recipe = get_recipe(recipe)
    device_type = x.device.type
    autocast_on = torch.is_autocast_enabled(device_type)
    compute_dtype = torch.get_autocast_dtype(device_type) if autocast_on else x.dtype
    if compute_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        compute_dtype = torch.float32
    out_dtype = compute_dtype
    lead_shape = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    y = _Fp8LinearFunction.apply(x2d, weight, bias, recipe, state, compute_dtype, out_dtype)
    return y.reshape(*lead_shape, weight.shape[0])
