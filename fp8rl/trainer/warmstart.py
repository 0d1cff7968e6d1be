"""Supervised warm start: make the base policy partly right, so RL has reward signal from step one.

Teacher forcing on ``<bos> prompt | answer <eos>`` with the cross-entropy on the answer and <eos>
tokens only, in the RL batch layout (prompts left-padded, targets right-padded). With ``warmstart.junk_rate``
each target token is preceded, with that probability, by one of the task's junk tokens (`JunkNoise`), drawn
afresh every step: the junk organism's start that samples a tail of garbage. The result is cached
under a hash of everything that determines it (model config with its resolved vocabulary, task
config, warm-start config, a format version), so a sweep trains it once; files are written to a
temporary name and renamed, so a reader never sees a half-written checkpoint.

A job whose model is split over ranks (TP or PP > 1) cannot train the one-process warm start in its own
processes (megatron's layers there are shards that wait for their peers): rank 0 runs it as
``python -m fp8rl.trainer.warmstart <resolved config .json>``, a process of its own, and every rank then reads
the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import Tensor

from fp8rl.config import TaskConfig, WarmStartConfig
from fp8rl.identity import hashed_fields
from fp8rl.models.config import ModelConfig, with_tokenizer_vocab
from fp8rl.models.generate import generate
from fp8rl.models.gpt import build_gpt_model, compute_precision
from fp8rl.models.logprobs import forward_logits, left_pad
from fp8rl.models.sampling import SamplingConfig
from fp8rl.tasks.base import Problem, Task, garble_metrics, junk_ids
from fp8rl.tracking.provenance import cpu_info

# Bump when the training recipe or the file layout changes meaning. 3: the key is the run hash's view of the task
# and warm-start sections (`identity.hashed_fields`); format 2 kept its own list of added fields.
CACHE_FORMAT_VERSION = 3
JUNK_SALT = 7919  # the junk insertions' generator: seeded by warmstart.seed + this


@dataclass(frozen=True)
class WarmStartResult:
    """Where the warm-started weights are and how good they are."""

    weights_path: Path  # safetensors file with the model's tensors
    metadata: dict[str, Any]  # configs, eval accuracy, train seconds (the JSON sidecar's content)


def warmstart_key(model_cfg: ModelConfig, task_cfg: TaskConfig, ws_cfg: WarmStartConfig) -> str:
    """16 hex digits identifying a warm start (model config with resolved vocab, task config, recipe)."""
    payload = {
        "format": CACHE_FORMAT_VERSION,
        "model": dataclasses.asdict(model_cfg),
        "task": hashed_fields("task", dataclasses.asdict(task_cfg)),
        "warmstart": hashed_fields("warmstart", dataclasses.asdict(ws_cfg)),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def right_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad token lists -> (ids (b, s) long, mask (b, s) long, 1 = token)."""
    width = max(len(seq) for seq in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids, mask


@dataclass
class JunkNoise:
    """Junk tokens inserted into warm-start targets: before each target token, with probability `rate`, one of
    `ids` drawn uniformly, from `generator` (so a warm start's data is fixed by its seed)."""

    ids: Sequence[int]
    rate: float
    generator: torch.Generator

    def __call__(self, target: Sequence[int]) -> list[int]:
        inserted = torch.rand(len(target), generator=self.generator) < self.rate
        picks = torch.randint(len(self.ids), (len(target),), generator=self.generator)
        out: list[int] = []
        for token, insert, pick in zip(target, inserted.tolist(), picks.tolist(), strict=True):
            out += [self.ids[pick], token] if insert else [token]
        return out


def junk_noise(task: Task, ws_cfg: WarmStartConfig) -> JunkNoise | None:
    """The warm start's junk insertions (None at ``junk_rate=0``); a task without junk tokens is refused."""
    if not ws_cfg.junk_rate:
        return None
    ids = sorted(junk_ids(task))
    if not ids:
        raise ValueError(
            f"warmstart.junk_rate={ws_cfg.junk_rate} needs a task with junk tokens (task=chain with task.junk_tokens "
            f"> 0); task {task.name!r} has none: set warmstart.junk_rate=0"
        )
    return JunkNoise(ids, ws_cfg.junk_rate, torch.Generator().manual_seed(ws_cfg.seed + JUNK_SALT))


def teacher_forcing_batch(
    task: Task, problems: Sequence[Problem], junk: JunkNoise | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``[left-padded prompt | right-padded answer+eos]`` -> (input_ids, attention_mask, loss_mask), each (b, s).

    loss_mask is 1 on the answer and <eos> tokens (the tokens to predict), 0 elsewhere; `junk` inserts junk
    tokens into the targets.
    """
    pad_id = task.tokenizer.pad_id
    prompt_ids, prompt_mask = left_pad([task.prompt_ids(p) for p in problems], pad_id)
    targets = [task.target_ids(p) for p in problems]
    target_ids, target_mask = right_pad([junk(t) for t in targets] if junk else targets, pad_id)
    input_ids = torch.cat([prompt_ids, target_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, target_mask], dim=1)
    loss_mask = torch.cat([torch.zeros_like(prompt_mask), target_mask], dim=1)
    return input_ids, attention_mask, loss_mask


def answer_loss(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor) -> Tensor:
    """Mean next-token cross-entropy (fp32) over the tokens where ``loss_mask`` is 1. Inputs (b, s)."""
    logits = forward_logits(model, input_ids, attention_mask)[:, :-1].float()
    targets = input_ids[:, 1:]
    weights = loss_mask[:, 1:].float()
    token_loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
    return (token_loss * weights.reshape(-1)).sum() / weights.sum().clamp(min=1.0)


def greedy_eval(model: torch.nn.Module, task: Task, problems: Sequence[Problem], batch_size: int) -> dict[str, float]:
    """Greedy-decoding accuracy and garble rates on ``problems`` (``eval/`` and ``rollout/`` keys)."""
    sampling = SamplingConfig(
        max_new_tokens=task.max_response_tokens,
        eos_token_ids=task.tokenizer.eos_ids,
        pad_token_id=task.tokenizer.pad_id,
        temperature=0.0,
        vocab_size=task.tokenizer.vocab_size,
    )
    rewards: list[float] = []
    reasons: list[str | None] = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        prompt_ids, prompt_mask = left_pad([task.prompt_ids(p) for p in chunk], task.tokenizer.pad_id)
        device = next(model.parameters()).device
        out = generate(model, prompt_ids.to(device), prompt_mask.to(device), sampling)
        responses = [row[mask.bool()].tolist() for row, mask in zip(out.tokens, out.response_mask, strict=True)]
        rewards += task.rewards(chunk, responses)
        reasons += [task.garble_reason(r) for r in responses]
    return {"eval/accuracy": sum(rewards) / len(rewards), **garble_metrics(reasons)}


log = logging.getLogger(__name__)
PROGRESS_EVERY = 50  # warm-start steps between progress lines


def progress_line(done: int, total: int, loss: float, seconds: float) -> str:
    """``warm start 50/400 | loss 1.234 | 12 s, ~84 s left``: the warm start used to train for minutes in silence."""
    left = seconds / done * (total - done) if done else float("nan")
    return f"warm start {done}/{total} | loss {loss:.3f} | {seconds:.0f} s, ~{left:.0f} s left"


def train_warmstart(
    model_cfg: ModelConfig,
    task: Task,
    ws_cfg: WarmStartConfig,
    on_step: Callable[[int, float, torch.nn.Module], None] | None = None,
) -> torch.nn.Module:
    """Train a fresh model for ``ws_cfg.steps`` steps; ``on_step(step, loss, model)`` is called after each one.
    With ``ws_cfg.stop_accuracy`` set, training stops at the first check (every ``check_every`` steps) whose
    greedy held-out accuracy reaches it; the model's ``warmstart_trace`` attribute lists the checks."""
    junk = junk_noise(task, ws_cfg)
    model = build_gpt_model(with_tokenizer_vocab(model_cfg, task.tokenizer.vocab_size), seed=ws_cfg.seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=ws_cfg.lr, weight_decay=ws_cfg.weight_decay)
    sampler = torch.Generator().manual_seed(ws_cfg.seed)
    problems = task.train_problems
    trace: list[list[float]] = []  # [step, greedy accuracy] of each early-stopping check
    started = time.perf_counter()
    for step in range(ws_cfg.steps):
        picks = torch.randint(len(problems), (ws_cfg.batch_size,), generator=sampler).tolist()
        loss = warmstart_step(model, optimizer, task, [problems[i] for i in picks], ws_cfg, junk)
        if on_step is not None:
            on_step(step, loss.item(), model)
        if (step + 1) % PROGRESS_EVERY == 0 or step + 1 == ws_cfg.steps:
            log.info(progress_line(step + 1, ws_cfg.steps, loss.item(), time.perf_counter() - started))
        if ws_cfg.stop_accuracy is not None and (step + 1) % ws_cfg.check_every == 0:
            if _accuracy_check(model, task, ws_cfg, step + 1, trace) >= ws_cfg.stop_accuracy:
                break
    model.warmstart_trace = trace
    model.warmstart_steps_done = step + 1 if ws_cfg.steps else 0
    return model


def warmstart_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    task: Task,
    problems: Sequence[Problem],
    ws_cfg,
    junk: JunkNoise | None = None,
) -> Tensor:
    """One supervised step on `problems` (targets with `junk` inserted); the batch goes to the model's device (a
    GPU host builds the model on CUDA). Returns the loss."""
    device = next(model.parameters()).device
    batch = [t.to(device) for t in teacher_forcing_batch(task, problems, junk)]
    with compute_precision(ws_cfg.precision):
        loss = answer_loss(model, *batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), ws_cfg.grad_clip)
    optimizer.step()
    return loss


STOP_CHECK_PROBLEMS = 256  # held-out problems of each early-stopping check


def _accuracy_check(model: torch.nn.Module, task: Task, ws_cfg: WarmStartConfig, done: int, trace: list) -> float:
    model.eval()
    accuracy = greedy_eval(model, task, task.eval_problems[:STOP_CHECK_PROBLEMS], ws_cfg.eval_batch_size)
    model.train()
    trace.append([done, accuracy["eval/accuracy"]])
    return accuracy["eval/accuracy"]


def tensor_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """The model's tensors (megatron's ``_extra_state`` entries dropped), as independent contiguous copies."""
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if isinstance(v, Tensor)}


def _write_atomically(path: Path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` for a temporary file next to ``path``, then rename it to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp_name)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def cache_paths(cache_dir: Path, key: str) -> tuple[Path, Path]:
    """(weights .safetensors, metadata .json) for a warm-start key."""
    return cache_dir / f"warmstart-{key}.safetensors", cache_dir / f"warmstart-{key}.json"


# Warm starts shipped with fp8rl (`make ship-warmstart`): the tiny tables' start, trained once, so every machine
# starts its runs from the same weights (a warm start trained on another CPU type lands elsewhere: its BF16 kernels
# differ). Looked up before the local cache; ``warmstart.shipped=false`` trains on this machine instead.
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "assets" / "warmstart"


def shipped_warmstart(key: str, shipped_dir: Path | None = None) -> WarmStartResult | None:
    """The shipped warm start of ``key`` (in `SHIPPED_DIR` unless told), or None; its weights must hash to the
    sha256 its metadata records (a truncated file or a Git LFS pointer is an error, not a different start)."""
    weights_path, metadata_path = cache_paths(shipped_dir or SHIPPED_DIR, key)
    if not (weights_path.exists() and metadata_path.exists()):
        return None
    metadata = json.loads(metadata_path.read_text())
    found = file_sha256(weights_path)
    if found != metadata.get("sha256"):
        raise RuntimeError(
            f"the shipped warm start {weights_path} has sha256 {found}, its metadata says {metadata.get('sha256')}: "
            "restore it (git checkout -- fp8rl/assets/warmstart) or set warmstart.shipped=false"
        )
    return WarmStartResult(weights_path, {**metadata, "origin": "shipped"})


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _found(key: str, ws_cfg: WarmStartConfig) -> WarmStartResult | None:
    """The shipped warm start of ``key`` (when asked for), else the local cache's, else None."""
    shipped = shipped_warmstart(key) if ws_cfg.shipped else None
    if shipped is not None:
        return shipped
    weights_path, metadata_path = cache_paths(Path(ws_cfg.cache_dir), key)
    if weights_path.exists() and metadata_path.exists():
        return WarmStartResult(weights_path, {**json.loads(metadata_path.read_text()), "origin": "cache"})
    return None


def cached_warmstart(model_cfg: ModelConfig, task: Task, task_cfg: TaskConfig, ws_cfg: WarmStartConfig):
    """The shipped or cached result for these configs, or None."""
    return _found(warmstart_key(with_tokenizer_vocab(model_cfg, task.tokenizer.vocab_size), task_cfg, ws_cfg), ws_cfg)


def warmstart_in_own_process(config_json: dict[str, Any]) -> None:
    """Train (or find) the warm start of a run config in a fresh one-process megatron (module docstring)."""
    import subprocess
    import sys

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(config_json, fh)
    try:
        subprocess.run([sys.executable, "-m", "fp8rl.trainer.warmstart", fh.name], check=True)
    finally:
        os.unlink(fh.name)


def warmstart(model_cfg: ModelConfig, task: Task, task_cfg: TaskConfig, ws_cfg: WarmStartConfig) -> WarmStartResult:
    """The warm-started weights for these configs (trained and cached under ``ws_cfg.cache_dir`` on first use)
    and their metadata (eval accuracy, train time)."""
    resolved_cfg = with_tokenizer_vocab(model_cfg, task.tokenizer.vocab_size)
    key = warmstart_key(resolved_cfg, task_cfg, ws_cfg)
    shipped = shipped_warmstart(key) if ws_cfg.shipped else None
    if shipped is not None:
        return shipped
    weights_path, metadata_path = cache_paths(Path(ws_cfg.cache_dir), key)
    # Runs of a sweep that start together share one warm start: the first trains it, the others wait for it.
    with _exclusive(weights_path.with_suffix(".lock")):
        found = _found(key, ws_cfg)
        if found is not None:
            return found
        return _train_and_cache(resolved_cfg, task, task_cfg, ws_cfg, key, weights_path, metadata_path)


def _exclusive(lock_path: Path) -> filelock.FileLock:
    """An exclusive lock on ``lock_path`` (filelock's kernel flock: released when the process dies, kill -9 too)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    return filelock.FileLock(lock_path)


def _train_and_cache(
    resolved_cfg: ModelConfig,
    task: Task,
    task_cfg: TaskConfig,
    ws_cfg: WarmStartConfig,
    key: str,
    weights_path: Path,
    metadata_path: Path,
) -> WarmStartResult:
    started = time.perf_counter()
    model = train_warmstart(resolved_cfg, task, ws_cfg)
    train_seconds = time.perf_counter() - started
    metrics = greedy_eval(model, task, task.eval_problems, ws_cfg.eval_batch_size)
    metadata = {
        "key": key,
        "model": dataclasses.asdict(resolved_cfg),
        "task": dataclasses.asdict(task_cfg),
        "warmstart": dataclasses.asdict(ws_cfg),
        "train_seconds": round(train_seconds, 2),
        "steps_done": model.warmstart_steps_done,
        "stop_trace": model.warmstart_trace,
        "torch_threads": torch.get_num_threads(),
        "machine": cpu_info(),  # which CPU and kernels made it: the numbers depend on them unless pinned
        **metrics,
    }
    # Metadata first: a weights file on disk implies its metadata is complete.
    _write_atomically(metadata_path, lambda tmp: Path(tmp).write_text(json.dumps(metadata, indent=2) + "\n"))
    _write_atomically(weights_path, lambda tmp: safetensors.torch.save_file(tensor_state_dict(model), tmp))
    return WarmStartResult(weights_path, {**metadata, "origin": "trained here"})


def ship(cfg) -> Path:
    """Train the warm start of run config ``cfg`` on this machine (never from a cache) and write it, with its
    weights' sha256, to `SHIPPED_DIR`: a deliberate change of every tiny run's start, like re-recording the golden
    record. Returns the weights' path."""
    from fp8rl.models.config import get_model_config
    from fp8rl.tasks import build_task

    task = build_task(cfg.task)
    with tempfile.TemporaryDirectory() as fresh:
        ws_cfg = dataclasses.replace(cfg.warmstart, cache_dir=fresh, shipped=False)
        result = warmstart(get_model_config(cfg.model.preset), task, cfg.task, ws_cfg)
        metadata = {k: v for k, v in result.metadata.items() if k != "origin"}
        metadata["warmstart"] = dataclasses.asdict(cfg.warmstart)
        metadata["sha256"] = file_sha256(result.weights_path)
        weights_path, metadata_path = cache_paths(SHIPPED_DIR, metadata["key"])
        _write_atomically(weights_path, lambda tmp: Path(tmp).write_bytes(result.weights_path.read_bytes()))
    _write_atomically(metadata_path, lambda tmp: Path(tmp).write_text(json.dumps(metadata, indent=2) + "\n"))
    return weights_path


def load_warmstarted_model(weights_path: str | Path, model_cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """A GPTModel for ``model_cfg`` (vocab resolved) with the weights at ``weights_path`` (strict: all keys)."""
    model = build_gpt_model(model_cfg, seed=seed)
    # megatron's linears add their missing ``_extra_state`` keys in a load pre-hook, so strict loading works.
    model.load_state_dict(safetensors.torch.load_file(str(weights_path)), strict=True)
    return model


def main(argv: list[str] | None = None) -> None:
    """``python -m fp8rl.trainer.warmstart RUN_CONFIG.json``: the warm start of that run, cached.
    ``--ship``: train the embedded defaults' tiny warm start here and ship it (`make ship-warmstart`)."""
    import argparse

    from fp8rl.config import from_dict
    from fp8rl.models.config import get_model_config
    from fp8rl.models.runtime import init_megatron
    from fp8rl.tasks import build_task

    parser = argparse.ArgumentParser(prog="python -m fp8rl.trainer.warmstart")
    parser.add_argument("config", nargs="?", type=Path, help="a resolved run config (.json)")
    parser.add_argument("--ship", action="store_true", help="train the tiny defaults' warm start and ship it")
    args = parser.parse_args(argv)
    if args.ship:
        from fp8rl.choices import validated
        from fp8rl.compose import compose_config

        cfg = validated(compose_config(["scale=tiny"]))
    else:
        cfg = from_dict(json.loads(args.config.read_text()))
    if cfg.trainer.threads:  # as the job's process does (fp8rl.job.process): the numbers depend on it
        torch.set_num_threads(cfg.trainer.threads)
    init_megatron(seed=cfg.warmstart.seed)
    if args.ship:
        print(f"shipped {ship(cfg)}")
        return
    warmstart(get_model_config(cfg.model.preset), build_task(cfg.task), cfg.task, cfg.warmstart)


if __name__ == "__main__":
    main()
