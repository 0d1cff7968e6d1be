"""The measurements of `benchmarks/gpu_check.sh` on one GPU, as ratios taken side by side in one run.

Sections (each runs if its stack imports, else is reported as skipped with the reason; one failing
section is reported with its error and does not stop the others):

0. ``environment``: `fp8rl.models.te_recipes.gpu_environment_report` (device, compute capability, CUDA,
   TE / torchao / megatron / vLLM versions) and `check_gpu_environment` per recipe on the TE backend.
1. ``parity``: the emulator (fp8rl.quant) against the GPU's own FP8 GEMM (``torch._scaled_mm``) on
   identically quantized operands, tensorwise and rowwise: needs only torch.
2. ``train_step``: a training step (forward, backward, Adam) of a Qwen3-8B-shaped layer stack (a few
   layers, random weights, BF16 parameters) in BF16 vs FP8 tensorwise vs FP8 blockwise through
   megatron's Transformer Engine spec (`fp8rl.models.te_backend`). Without megatron/TE, a fallback
   times the same GEMM shapes with ``torch._scaled_mm`` (tensorwise only) and says so in the report.
   Targets: tensorwise >= 1.3x, blockwise >= 1.1x BF16 throughput.
3. ``vllm``: vLLM decode throughput BF16 vs FP8 (online per-tensor quantization, ``fp8_per_tensor``:
   vLLM 0.32's ``quantization="fp8"`` refuses a BF16 checkpoint) on a small Qwen3-shaped model with random
   weights written as an HF folder; in-process, ``enforce_eager=True``, each engine shut down explicitly
   before the next starts. Target: FP8 >= 1.2x.
4. ``mismatch``: one RL step of the tiny task with vLLM FP8 rollout and the FP8 trainer (TE):
   ``rollout/token_mult_prob_error``, ``rollout/k3_kl``, ``rollout/abs_logp_diff``.

Writes ``gpu_check.json`` and ``gpu_check.md`` (with provenance) into ``--out`` after every section, so
that a run stopped by its timeout keeps what finished.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import write_json  # noqa: E402

TARGETS = {"train_step tensorwise": 1.3, "train_step blockwise": 1.1, "vllm decode fp8": 1.2}


def have(*modules: str) -> str | None:
    """None when every module imports, else the reason to skip (never raises).

    Imports them: ``importlib.util.find_spec("megatron.core")`` itself raises ModuleNotFoundError when the
    parent package is missing, and a module that is found may still fail to import (a CUDA library).
    """
    reasons = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            missing = err.name and module.startswith(err.name)
            reasons.append(f"not installed: {module}" if missing else f"{module}: {err}")
        except Exception as err:  # noqa: BLE001 - any import failure is a reason to skip, reported as such
            reasons.append(f"{module} fails to import: {type(err).__name__}: {err}")
    return "; ".join(reasons) or None


def cuda_time(fn, repeats: int, warmup: int = 2) -> float:
    """Median seconds of `fn()` on the GPU (CUDA events), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


# ----------------------------------------------------------------------------------------- 1. parity
def parity() -> dict[str, Any]:
    """fp8rl's dequantized FP32 product vs ``torch._scaled_mm`` on the same FP8 codes and scales.

    Both multiply identical FP8 operands; the tensor cores accumulate with >= 14-bit partial sums promoted
    to FP32 (2^-7 relative to sum |a||b|, DeepSeek-V3 3.3.2); rowwise scaled_mm returns BF16 (+2^-8).
    """
    from fp8rl.quant import quantize

    gen = torch.Generator(device="cuda").manual_seed(0)
    m, k, n = 512, 4096, 1024
    x = torch.randn(m, k, device="cuda", generator=gen)
    x[:, :8] *= 40  # outlier channels
    w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
    out = {}
    for granularity, name, out_dtype, extra in (
        ("tensor", "tensorwise", torch.float32, 0.0),
        ("row", "rowwise", torch.bfloat16, 2.0**-8),
    ):
        qx, qw = quantize(x, "e4m3", granularity), quantize(w, "e4m3", granularity)
        sx = qx.scale.reshape(-1, 1) if granularity == "row" else qx.scale
        sw_cols = qw.scale.reshape(-1, 1) if granularity == "row" else qw.scale  # per output row of w
        sw = qw.scale.reshape(1, -1) if granularity == "row" else qw.scale  # scaled_mm's (1, n) layout
        ours = (qx.data.float() * sx) @ (qw.data.float() * sw_cols).t()
        theirs = torch._scaled_mm(qx.data, qw.data.t(), scale_a=sx.float(), scale_b=sw.float(), out_dtype=out_dtype)
        magnitude = (qx.data.float().abs() * sx) @ (qw.data.float().abs() * sw_cols).t()
        rel = ((ours - theirs.float()).abs() / magnitude.clamp_min(1e-30)).max().item()
        bound = 2.0**-7 + (k + 6) * 2.0**-24 + extra
        out[name] = {"max_error_over_abs_product": rel, "bound": bound, "ok": rel <= bound}
    return out


# ------------------------------------------------------------------------------------- 2. train step
def qwen3_8b_stack(layers: int):
    from fp8rl.models.config import get_model_config

    cfg = get_model_config("qwen3_8b")
    return cfg.__class__(**{**cfg.__dict__, "num_layers": layers, "name": f"qwen3_8b_{layers}layers"})


def train_step_te(layers: int, seq: int, micro: int, repeats: int) -> dict[str, Any]:
    from fp8rl.models.parallel import ParallelLayout
    from fp8rl.models.runtime import init_megatron
    from fp8rl.models.te_backend import build_te_gpt_model, te_fp8

    cfg = qwen3_8b_stack(layers)
    layout = ParallelLayout(gpus_per_node=1, max_seq_len=seq, activation_recompute=False)
    init_megatron()  # build_te_gpt_model needs megatron's process state (TP = PP = 1 here)
    model = build_te_gpt_model(cfg, layout, None, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
    ids = torch.randint(0, cfg.vocab_size, (micro, seq), device="cuda")
    pos = torch.arange(seq, device="cuda").expand(micro, seq)

    def step(recipe):
        def run():
            with te_fp8(model, recipe):
                loss = model(ids, pos, None).float().logsumexp(-1).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return run

    try:
        seconds = {
            name: cuda_time(step(recipe), repeats)
            for name, recipe in (("bf16", None), ("tensorwise", "tensorwise"), ("blockwise", "blockwise"))
        }
    finally:  # leave no model-parallel state behind for the later sections (the RL step builds its own)
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    return {
        "backend": "megatron TE spec",
        "layers": layers,
        "seq": seq,
        "micro_batch": micro,
        "seconds": seconds,
        "speedup": {k: seconds["bf16"] / v for k, v in seconds.items()},
    }


def train_step_torch(layers: int, seq: int, micro: int, repeats: int) -> dict[str, Any]:
    """Fallback without megatron/TE: the stack's GEMMs (QKV, proj, FC1, FC2) fwd + bwd, BF16 vs FP8 tensorwise."""
    cfg = qwen3_8b_stack(layers)
    h, f, heads = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads
    qkv = (heads + 2 * cfg.num_query_groups) * cfg.kv_channels
    shapes = [(qkv, h), (h, heads * cfg.kv_channels), (2 * f, h), (h, f)] * layers
    weights = [torch.randn(o, i, device="cuda", dtype=torch.bfloat16) / i**0.5 for o, i in shapes]
    x = torch.randn(micro * seq, h, device="cuda", dtype=torch.bfloat16)
    e4m3 = torch.float8_e4m3fn

    def fp8_mm(a, b):  # a (m, k) @ b (n, k).t(), both quantized per tensor
        sa, sb = a.abs().amax().float() / 448, b.abs().amax().float() / 448
        qa, qb = (a / sa).to(e4m3), (b / sb).to(e4m3)
        return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    def run(fp8: bool):
        def go():
            for w in weights:
                inp = (
                    x if w.shape[1] == h else torch.empty(micro * seq, w.shape[1], device="cuda", dtype=torch.bfloat16)
                )
                y = fp8_mm(inp, w) if fp8 else inp @ w.t()
                dy = torch.ones_like(y)
                (fp8_mm(dy, w.t().contiguous()) if fp8 else dy @ w)  # dgrad
                (fp8_mm(dy.t().contiguous(), inp.t().contiguous()) if fp8 else dy.t() @ inp)  # wgrad

        return go

    seconds = {"bf16": cuda_time(run(False), repeats), "tensorwise": cuda_time(run(True), repeats)}
    return {
        "backend": "torch._scaled_mm fallback (GEMMs only, no TE)",
        "layers": layers,
        "seq": seq,
        "micro_batch": micro,
        "seconds": seconds,
        "speedup": {k: seconds["bf16"] / v for k, v in seconds.items()},
    }


# ------------------------------------------------------------------------------------------- 3. vLLM
def small_qwen3_folder(directory: Path) -> Path:
    """An 8-layer, 2048-wide Qwen3-shaped HF folder with random weights (needs no megatron)."""
    import safetensors.torch

    from fp8rl.models.hf import hf_config_from_model_config

    base = qwen3_8b_stack(8)
    cfg = base.__class__(
        **{
            **base.__dict__,
            "name": "qwen3_small",
            "hidden_size": 2048,
            "num_attention_heads": 16,
            "num_query_groups": 4,
            "ffn_hidden_size": 6144,
            "vocab_size": 32768,
            "max_seq_len": 4096,
        }
    )
    gen = torch.Generator().manual_seed(0)
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.kv_channels
    q, kv = cfg.num_attention_heads * d, cfg.num_query_groups * d

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": rand(cfg.vocab_size, h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": rand(cfg.vocab_size, h),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "self_attn.q_proj.weight": rand(q, h),
                p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h),
                p + "self_attn.o_proj.weight": rand(h, q),
                p + "self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
                p + "self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
                p + "mlp.gate_proj.weight": rand(f, h),
                p + "mlp.up_proj.weight": rand(f, h),
                p + "mlp.down_proj.weight": rand(h, f),
            }
        )
    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config_from_model_config(cfg, dtype="bfloat16", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    safetensors.torch.save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def shutdown_vllm(llm: Any) -> None:
    """Stop an in-process vLLM 0.32 engine and free its GPU memory.

    ``vllm.LLM`` 0.32 has no ``shutdown()``; its engine-core client has: InprocClient.shutdown detaches the
    client's finalizer and runs EngineCore.shutdown (executor and scheduler shutdown, then
    ``cleanup_dist_env_and_memory``: vLLM's process groups and the default one destroyed, CUDA cache
    emptied); SyncMPClient.shutdown stops the engine process.
    """
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
    gc.collect()
    torch.cuda.empty_cache()


def vllm_decode(repeats: int) -> dict[str, Any]:
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: a timeout kills one process
    from vllm import LLM, SamplingParams

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = small_qwen3_folder(Path(tmp) / "model")
        prompts = [[1 + (i * 7 + j) % 30 for j in range(32)] for i in range(256)]
        params = SamplingParams(max_tokens=256, ignore_eos=True, temperature=1.0, seed=0, detokenize=False)
        for name, quant in (("bf16", None), ("fp8", "fp8_per_tensor")):
            llm = LLM(
                str(folder),
                dtype="bfloat16",
                quantization=quant,
                gpu_memory_utilization=0.4,
                max_model_len=512,
                enforce_eager=True,
                seed=0,
                skip_tokenizer_init=True,
                distributed_executor_backend="uni",
            )
            try:
                llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], params, use_tqdm=False)  # warm-up
                t = time.perf_counter()
                for _ in range(repeats):
                    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                seconds = (time.perf_counter() - t) / repeats
                out[name] = {"seconds": seconds, "tokens_per_s": len(prompts) * 256 / seconds}
            finally:
                shutdown_vllm(llm)
                del llm
                gc.collect()
                torch.cuda.empty_cache()
    out["speedup_fp8"] = out["fp8"]["tokens_per_s"] / out["bf16"]["tokens_per_s"]
    out["note"] = "in-process vLLM, enforce_eager=True (no CUDA graphs): decode ratios without graph capture"
    return out


def environment() -> dict[str, Any]:
    """This host's stack and which recipes the TE backend can run here (`check_gpu_environment`)."""
    from fp8rl.models.te_recipes import check_gpu_environment, gpu_environment_report

    report = gpu_environment_report()
    checks = {}
    for recipe in ("tensorwise", "blockwise", "mxfp8"):
        try:
            check_gpu_environment(recipe, "te", report)
            checks[recipe] = "ok"
        except ValueError as err:
            checks[recipe] = str(err)
    return {**report, "te_recipes": checks}


# --------------------------------------------------------------------------------------- 4. mismatch
MISMATCH_RUN = {  # one RL step of the tiny model: vLLM FP8 rollout, TE FP8 trainer, token TIS
    "model.device": "cuda",
    "rollout.engine": "vllm",
    "precision.mode": "fp8_full",
    "precision.recipe": "tensorwise",
    "precision.backend": "te",
    "clipping.rollout_correction": "tis_token",
    "tracking.enabled": False,
    "warmstart.steps": 100,
}


def mismatch_config(out_dir: str):
    """The run config of the mismatch section (frozen dataclasses: built by overrides, checked as a job is)."""
    from fp8rl.choices import validated
    from fp8rl.config import RunConfig, with_overrides

    return validated(with_overrides(RunConfig(), {**MISMATCH_RUN, "trainer.out_dir": out_dir}))


def mismatch() -> dict[str, Any]:
    from fp8rl.job import build_trainer

    trainer = build_trainer(mismatch_config(tempfile.mkdtemp()))
    try:
        metrics = trainer.train_step(1).metrics
    finally:
        getattr(trainer.engine, "close", lambda: None)()  # the rollout engine's resources, as the job does
    keys = ("rollout/token_mult_prob_error", "rollout/k3_kl", "rollout/abs_logp_diff", "rollout/max_abs_logp_diff")
    return {k: metrics[k] for k in keys if k in metrics}


SECTION_NAMES = ("environment", "parity", "train_step", "vllm", "mismatch")


def section_runners(args: argparse.Namespace) -> dict[str, Callable[[], dict[str, Any]]]:
    """name -> a callable returning the section's result; {"skipped": reason} when its stack is missing."""

    def needs(modules: tuple[str, ...], fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            reason = have(*modules)
            return {"skipped": reason} if reason else fn()

        return run

    def train_step() -> dict[str, Any]:
        missing = have("megatron.core", "transformer_engine")
        fn = train_step_torch if missing else train_step_te
        result = fn(args.layers, args.seq, args.micro, args.repeats)
        gc.collect()  # the stack's model and optimizer are gone with the call: return their memory
        torch.cuda.empty_cache()
        if missing:
            result["note"] = f"TE path skipped ({missing})"
        return result

    return {
        "environment": environment,
        "parity": parity,
        "train_step": train_step,
        "vllm": needs(("vllm",), lambda: vllm_decode(args.repeats)),
        "mismatch": needs(("vllm", "transformer_engine", "megatron.core"), mismatch),
    }


def run_sections(
    names: list[str],
    runners: dict[str, Callable[[], dict[str, Any]]],
    write: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the named sections in order; after each one, ``write(results so far)`` (a timeout keeps them)."""
    results: dict[str, Any] = {}
    for name in names:
        t = time.perf_counter()
        try:
            if name not in runners:
                raise KeyError(f"unknown section {name!r}; valid: {list(runners)}")
            results[name] = runners[name]()
        except Exception as err:  # noqa: BLE001 - one broken section must not hide the others
            results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        results[name]["wall_s"] = time.perf_counter() - t
        print(f"{name}: {json.dumps(results[name], default=str)[:400]}", flush=True)
        if write is not None:
            write(results)
    return results


def verdicts(results: dict[str, Any]) -> dict[str, Any]:
    """Ratios against the targets; the GEMM-only fallback is no training step and is not scored."""
    out = {}
    train_step = results.get("train_step", {})
    speed = train_step.get("speedup", {}) if train_step.get("backend") == "megatron TE spec" else {}
    for recipe in ("tensorwise", "blockwise"):
        if recipe in speed:
            out[f"train_step {recipe}"] = {
                "ratio": speed[recipe],
                "target": TARGETS[f"train_step {recipe}"],
                "met": speed[recipe] >= TARGETS[f"train_step {recipe}"],
            }
    if "speedup_fp8" in results.get("vllm", {}):
        ratio = results["vllm"]["speedup_fp8"]
        out["vllm decode fp8"] = {"ratio": ratio, "target": 1.2, "met": ratio >= 1.2}
    return out


def markdown(results: dict[str, Any], targets: dict[str, Any], prov: dict[str, str], device: str) -> str:
    lines = [
        "# GPU check (benchmarks/gpu_check.sh)",
        "",
        f"Device: {device}. git {prov.get('git_sha', '?')[:10]}"
        f"{' (dirty)' if prov.get('git_dirty') == 'true' else ''}, "
        f"{prov.get('date', '')}, torch {prov.get('version.torch', '?')}. Ratios are throughput relative to BF16, "
        "measured side by side in this run.",
        "",
        "| target | ratio | required | met |",
        "|---|---|---|---|",
    ]
    for name, v in targets.items():
        lines.append(f"| {name} | {v['ratio']:.2f}x | {v['target']}x | {'yes' if v['met'] else 'NO'} |")
    for name, value in results.items():
        lines += ["", f"## {name}", "", "```json", json.dumps(value, indent=1, default=str)[:4000], "```"]
    return "\n".join(lines) + "\n"


def write_report(out: Path, results: dict[str, Any], device: str, done: bool) -> None:
    """gpu_check.json and gpu_check.md from the results so far (``done``: every section ran)."""
    from fp8rl.tracking.provenance import provenance

    targets = verdicts(results)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "gpu_check.json", {"device": device, "complete": done, "results": results, "targets": targets})
    (out / "gpu_check.md").write_text(markdown(results, targets, provenance(), device))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/gpu"))
    parser.add_argument("--sections", default=",".join(SECTION_NAMES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: gpu_bench measures the GPU path only", file=sys.stderr)
        return 2
    device = (
        f"{torch.cuda.get_device_name()} (compute capability {'.'.join(map(str, torch.cuda.get_device_capability()))})"
    )
    names = [n for n in args.sections.split(",") if n]
    results = run_sections(names, section_runners(args), lambda r: write_report(args.out, r, device, done=False))
    write_report(args.out, results, device, done=True)
    print(f"wrote {args.out / 'gpu_check.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
