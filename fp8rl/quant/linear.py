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

Work kept off the hot path (all bit-identical to computing every operand afresh): the weight's FP8
tensor and GEMM input are cached per compute dtype until W's bits change (W^T's are views of W's when
the granularity is symmetric); an operand quantized rowwise and columnwise is converted to float32
once; a forward under no_grad (rollout, old log-probs, shadow passes) or with a frozen weight skips
x's columnwise quantization, which only wgrad reads; and with a symmetric granularity (tensorwise)
wgrad reads the forward's GEMM input of x, transposed, instead of widening the FP8 copy again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fp8rl.quant.formats import get_format
from fp8rl.quant.granularity import TRANSPOSED
from fp8rl.quant.recipes import Fp8Recipe, get_recipe
from fp8rl.quant.tensor import Fp8Tensor, _check_finite, _is_pow2, block_amax, fp8_to_float, quantize

_OUTER_SCALED = frozenset({"tensor", "row"})

AmaxReduce = Callable[[str, torch.Tensor], torch.Tensor]
"""``(role, local amax) -> amax to scale with``, for per-tensor ("tensor") scales only; role is "x" (activation),
"w" (weight) or "dy" (output gradient), amax a 0-d float32 tensor. A caller whose GEMM operand is one shard of a
larger tensor (tensor parallelism) passes e.g. an all-reduce MAX over its group, so the shard gets the scale of
the whole tensor; this package stays free of torch.distributed."""


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

    def values(self, weight: torch.Tensor) -> dict:
        """The values cached for `weight` (key -> value), emptied first if its bits changed (one compare)."""
        entry = self._entries.get(id(weight))
        if entry is None or entry[0]() is not weight or not _bitwise_equal(entry[1], weight):
            slot = id(weight)
            ref = weakref.ref(weight, lambda _ref, s=slot: self._entries.pop(s, None))
            entry = (ref, weight.detach().clone(), {})
            self._entries[slot] = entry
        return entry[2]


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN payloads and the sign of zero included)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.detach().view(int_dtype), b.detach().view(int_dtype))


_WEIGHT_CACHE = _WeightCache()


def _quantize_operand(
    t: torch.Tensor,
    granularity: str,
    fmt: str,
    recipe: Fp8Recipe,
    state: DelayedScalingState | None,
    role: str,
    amax_reduce: AmaxReduce | None = None,
) -> Fp8Tensor:
    """Quantize one GEMM operand (rows, reduction); delayed scaling reads and updates `state`."""
    if recipe.scaling != "delayed" or state is None:
        if amax_reduce is None or granularity != "tensor":
            return quantize(t, fmt, granularity, recipe.uses_pow2_scales)
        local_amax = block_amax(t.reshape(-1, t.shape[-1]), "tensor")
        _check_finite(local_amax, "raise")
        return quantize(t, fmt, granularity, recipe.uses_pow2_scales, amax=amax_reduce(role, local_amax))
    fp8_max = get_format(fmt).max
    history_amax = state.scaling_amax(role, recipe.amax_compute_algo)
    current_amax = block_amax(t.reshape(-1, t.shape[-1]), "tensor")
    _check_finite(current_amax, "raise")  # before recording: a NaN must not poison the history
    if amax_reduce is not None:
        current_amax = amax_reduce(role, current_amax)
    state.record(role, current_amax)
    if history_amax is None or float(history_amax) == 0.0:
        scaling_amax = torch.tensor(fp8_max)  # TE's initial scale: 1.0
    else:
        scaling_amax = history_amax * (2.0**recipe.margin)
    return quantize(t, fmt, granularity, recipe.uses_pow2_scales, amax=scaling_amax)


def gemm_input(q: Fp8Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """The matrix the emulated GEMM multiplies for operand `q` (exact in its dtype).

    Outer-scaled granularities ("tensor", "row"): the raw FP8 values, whose scales go on the GEMM's
    output; in the compute dtype, or float32 for float16 compute (unscaled FP8 products reach 448^2
    (E4M3) or 57344^2 (E5M2), past float16's 65504; bf16 has float32's range).
    Block granularities: the dequantized values, in the compute dtype when every scale is a power of
    two (then exact), else in float32.
    """
    if q.granularity in _OUTER_SCALED:
        raw_dtype = torch.float32 if compute_dtype == torch.float16 else compute_dtype
        return fp8_to_float(q.data, raw_dtype, check_nonfinite=q.may_have_nonfinite)
    return _dequantized_input(q, compute_dtype)


def _dequantized_input(q: Fp8Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    return q.dequantize(compute_dtype if _is_pow2(q.scale) else torch.float32)


def _gemm(a: torch.Tensor, b: torch.Tensor, qa: Fp8Tensor, qb: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b^T`` from two `gemm_input`s, outer scales applied in float32, rounded once to `out_dtype`."""
    if a.dtype != b.dtype:  # one block operand with scales that are not all powers of two
        a, b = a.float(), b.float()
    out = a @ b.t()
    if qa.granularity not in _OUTER_SCALED or qb.granularity not in _OUTER_SCALED:
        return out.to(out_dtype)  # block operands: dequantized inputs, nothing left to scale
    if qa.scale.dim() == 0 and qb.scale.dim() == 0:
        scale = qa.scale * qb.scale
        if out.dtype == out_dtype == torch.bfloat16:
            # One pass, the same bits: ATen multiplies a bf16 tensor by a 0-d float32 tensor in float32
            # with the scalar's original value, then rounds once to bf16.
            return torch.mul(out, scale)
        return out.float().mul_(scale).to(out_dtype)
    out = out.float()  # convert first: mixed-dtype elementwise ops with a scale vector are far slower on CPU
    scale_a = qa.scale if qa.scale.dim() == 0 else qa.scale.reshape(-1, 1)
    scale_b = qb.scale if qb.scale.dim() == 0 else qb.scale.reshape(1, -1)
    return out.mul_(scale_a).mul_(scale_b).to(out_dtype)


def fp8_gemm(qa: Fp8Tensor, qb: Fp8Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """``A @ B^T`` from two quantized operands laid out (rows, reduction); returns fp32 (M, N)."""
    both_outer = qa.granularity in _OUTER_SCALED and qb.granularity in _OUTER_SCALED
    to_input = gemm_input if both_outer else _dequantized_input  # a mixed pair: both dequantized
    return _gemm(to_input(qa, compute_dtype), to_input(qb, compute_dtype), qa, qb, torch.float32)


def _as_float32(t: torch.Tensor) -> torch.Tensor:
    """One float32 copy of a GEMM operand that is quantized twice (rowwise and columnwise), exact for bf16/fp16."""
    return t if t.dtype == torch.float32 else t.float()


def _is_symmetric(granularity: str, q: Fp8Tensor, fmt: str) -> bool:
    """True when quantizing t^T gives the transpose of `q` (the same blocks and format)."""
    return TRANSPOSED[granularity] == granularity and q.fmt == fmt


def _quantize_transposed(t: torch.Tensor, q: Fp8Tensor, granularity: str, fmt: str, recipe: Fp8Recipe) -> Fp8Tensor:
    """Quantize t^T along t's rows (the other GEMM usage); reuses `q` when the blocks are symmetric."""
    if _is_symmetric(granularity, q, fmt):
        return q.t()
    return quantize(t, fmt, TRANSPOSED[granularity], recipe.uses_pow2_scales).t()


def _transposed_operand(
    t: torch.Tensor, q: Fp8Tensor, q_input: torch.Tensor, granularity: str, fmt: str, recipe: Fp8Recipe
) -> tuple[Fp8Tensor, torch.Tensor | None]:
    """(t^T quantized, its GEMM input or None to widen at use); a symmetric granularity reuses both."""
    if _is_symmetric(granularity, q, fmt):
        return q.t(), q_input.t()
    return _quantize_transposed(t, q, granularity, fmt, recipe), None


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x2d, weight, bias, recipe: Fp8Recipe, state, compute_dtype, out_dtype, wgrad_possible, amax_reduce
    ):
        x_dtype = x2d.dtype
        with torch.autocast(x2d.device.type, enabled=False):
            act = recipe.activation_granularity
            x2d = _as_float32(x2d) if TRANSPOSED[act] != act else x2d  # quantized twice: convert once
            qx = _quantize_operand(x2d, act, recipe.forward_format, recipe, state, "x", amax_reduce)
            x_input = gemm_input(qx, compute_dtype)
            qw, w_input = _weight_operand(weight, recipe, False, state, compute_dtype, amax_reduce)
            y = _gemm(x_input, w_input, qx, qw, out_dtype if bias is None else torch.float32)
            if bias is not None:
                y = (y + bias.float()).to(out_dtype)
            # Like TE, keep for wgrad only x's columnwise FP8 copy, not x itself: its GEMM input when
            # the transpose reuses the rowwise quantization (tensorwise: the same FP8 values, held in
            # the compute dtype, which is exact), else the FP8 tensor, widened in backward. Forward-only
            # passes (no_grad, frozen weight) skip it.
            needs_wgrad = wgrad_possible and weight.requires_grad
            ctx.xt = _transposed_operand(x2d, qx, x_input, act, recipe.forward_format, recipe) if needs_wgrad else None
        ctx.save_for_backward(weight)
        ctx.x_dtype = x_dtype
        # Delayed scaling quantizes W once per step with the history's scale; dgrad must use that
        # same FP8 weight (tensorwise: its transpose), as TE does, not a current-scaled requantization.
        delayed = recipe.scaling == "delayed" and state is not None
        ctx.w_delayed = (qw.t(), w_input.t()) if delayed else None
        ctx.recipe, ctx.state, ctx.compute_dtype, ctx.amax_reduce = recipe, state, compute_dtype, amax_reduce
        return y

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        recipe, state, compute_dtype = ctx.recipe, ctx.state, ctx.compute_dtype
        with torch.autocast(dy.device.type, enabled=False):
            grad, fmt = recipe.gradient_granularity, recipe.backward_format
            dy = _as_float32(dy) if TRANSPOSED[grad] != grad else dy
            qdy = _quantize_operand(dy, grad, fmt, recipe, state, "dy", ctx.amax_reduce)
            dy_input = gemm_input(qdy, compute_dtype)
            dx = dw = None
            if ctx.needs_input_grad[0]:
                if ctx.w_delayed is not None:
                    qwt, wt_input = ctx.w_delayed
                else:
                    qwt, wt_input = _weight_operand(weight, recipe, True, None, compute_dtype, ctx.amax_reduce)
                dx = _gemm(dy_input, wt_input, qdy, qwt, ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                qdyt, dyt_input = _transposed_operand(dy, qdy, dy_input, grad, fmt, recipe)
                qxt, xt_input = ctx.xt
                dyt_input = gemm_input(qdyt, compute_dtype) if dyt_input is None else dyt_input
                xt_input = gemm_input(qxt, compute_dtype) if xt_input is None else xt_input
                dw = _gemm(dyt_input, xt_input, qdyt, qxt, weight.dtype)
            db = dy.float().sum(0).to(weight.dtype) if ctx.needs_input_grad[2] else None
        ctx.xt = ctx.w_delayed = ctx.amax_reduce = None
        return dx, dw, db, None, None, None, None, None, None


def _weight_operand(
    weight: torch.Tensor,
    recipe: Fp8Recipe,
    transposed: bool,
    state,
    compute_dtype: torch.dtype,
    amax_reduce: AmaxReduce | None = None,
) -> tuple[Fp8Tensor, torch.Tensor]:
    """W (N, K) for fprop or W^T (K, N) for dgrad: quantized and as GEMM input, cached until W changes.

    With `amax_reduce` (per-tensor scales) the local amax is cached with W and reduced on every call; the
    FP8 copies are cached per reduced amax (another rank's shard may change while this one does not).
    """
    granularity, fmt = recipe.weight_granularity, recipe.forward_format
    if recipe.scaling == "delayed" and state is not None:
        qw = _quantize_operand(weight.detach(), granularity, fmt, recipe, state, "w", amax_reduce)
        return qw, gemm_input(qw, compute_dtype)
    cached = _WEIGHT_CACHE.values(weight)  # one bitwise check of W per call
    key = (granularity, fmt, recipe.uses_pow2_scales)
    amax = None
    if amax_reduce is not None and granularity == "tensor":
        if "local_amax" not in cached:
            cached["local_amax"] = block_amax(weight.detach(), "tensor")
        amax = amax_reduce("w", cached["local_amax"])
        key = (*key, float(amax))
    if (key, False) not in cached:
        qw = quantize(weight.detach(), fmt, granularity, recipe.uses_pow2_scales, amax=amax)
        cached[key, False] = qw
        cached[key, False, compute_dtype] = gemm_input(qw, compute_dtype)
    if (key, False, compute_dtype) not in cached:
        cached[key, False, compute_dtype] = gemm_input(cached[key, False], compute_dtype)
    if not transposed:
        return cached[key, False], cached[key, False, compute_dtype]
    if (key, True, compute_dtype) not in cached:
        qw = cached[key, False]
        if _is_symmetric(granularity, qw, fmt):  # W^T: views of W's FP8 tensor and GEMM input
            cached[key, True] = qw.t()
            cached[key, True, compute_dtype] = cached[key, False, compute_dtype].t()
        else:
            cached[key, True] = _quantize_transposed(weight.detach(), qw, granularity, fmt, recipe)
            cached[key, True, compute_dtype] = gemm_input(cached[key, True], compute_dtype)
    return cached[key, True], cached[key, True, compute_dtype]


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Fp8Recipe | str,
    state: DelayedScalingState | None = None,
    amax_reduce: AmaxReduce | None = None,
) -> torch.Tensor:
    """A linear layer computed from FP8 operands in forward and backward.

    Args:
        x: (..., in_features) input.
        weight: (out_features, in_features) master weight (kept in its own dtype; quantized per use).
        bias: (out_features,) or None, added in high precision.
        recipe: an `Fp8Recipe` or a recipe name ("tensorwise", "rowwise", "blockwise", "mxfp8").
        state: amax histories for delayed scaling (required for `scaling="delayed"` to be stateful).
        amax_reduce: per-tensor scales only: maps each operand's local amax to the amax to scale with
            (see `AmaxReduce`); None = each tensor's own amax.

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
    wgrad_possible = torch.is_grad_enabled()
    y = _Fp8LinearFunction.apply(
        x2d, weight, bias, recipe, state, compute_dtype, out_dtype, wgrad_possible, amax_reduce
    )
    return y.reshape(*lead_shape, weight.shape[0])
