import dataclasses
from pathlib import Path

import pytest
import torch

from fp8rl.config import TaskConfig, WarmStartConfig
from fp8rl.models.config import get_model_config, with_tokenizer_vocab
from fp8rl.models.logprobs import forward_logits
from fp8rl.tasks import build_task
from fp8rl.trainer import warmstart as ws
from fp8rl.trainer.warmstart import (
    answer_loss,
    load_warmstarted_model,
    teacher_forcing_batch,
    train_warmstart,
    warmstart,
    warmstart_key,
)

TASK_CFG = TaskConfig(num_train=200, num_eval=16)
QUICK = WarmStartConfig(steps=2, batch_size=8, eval_batch_size=16)


@pytest.fixture(autouse=True, scope="module")
def _megatron(megatron: None) -> None:
    """The warm start builds models: megatron's process state first."""


@pytest.fixture(scope="module")
def task():
    return build_task(TASK_CFG)


@pytest.fixture(scope="module")
def model_cfg(task):
    return with_tokenizer_vocab(get_model_config("tiny"), task.tokenizer.vocab_size)


def test_key_changes_with_every_input(model_cfg):
    base = warmstart_key(model_cfg, TASK_CFG, QUICK)
    assert warmstart_key(model_cfg, TASK_CFG, WarmStartConfig(steps=2, batch_size=8, eval_batch_size=16)) == base
    moved = dataclasses.replace(QUICK, cache_dir="/elsewhere", eval_batch_size=64)
    assert warmstart_key(model_cfg, TASK_CFG, moved) == base  # where it is cached and how fast it is scored
    variants = [
        warmstart_key(dataclasses.replace(model_cfg, num_layers=2), TASK_CFG, QUICK),
        warmstart_key(model_cfg, dataclasses.replace(TASK_CFG, seed=1), QUICK),
        *(
            warmstart_key(model_cfg, TASK_CFG, dataclasses.replace(QUICK, **{name: value}))
            for name, value in [("steps", 3), ("lr", 2e-3), ("batch_size", 9), ("seed", 1), ("precision", "fp32")]
        ),
    ]
    assert base not in variants and len(set(variants)) == len(variants)


def test_teacher_forcing_layout(task):
    problems = [task.train_problems[0], dataclasses.replace(task.train_problems[1], prompt="1+2=", answer="3")]
    input_ids, attention_mask, loss_mask = teacher_forcing_batch(task, problems)
    prompt_width = max(len(task.prompt_ids(p)) for p in problems)
    for row, problem in enumerate(problems):
        real = input_ids[row][attention_mask[row].bool()].tolist()
        assert real == task.prompt_ids(problem) + task.target_ids(problem)
        assert input_ids[row][loss_mask[row].bool()].tolist() == task.target_ids(problem)
    assert attention_mask[1, :prompt_width].tolist()[:4] == [0, 0, 0, 0]  # the short prompt is left-padded
    assert (loss_mask <= attention_mask).all()


def test_a_few_steps_reduce_the_answer_loss(task, model_cfg):
    batch = teacher_forcing_batch(task, task.train_problems[:32])
    cfg = WarmStartConfig(steps=8, batch_size=16, lr=3e-3)
    before = answer_loss(train_warmstart(model_cfg, task, dataclasses.replace(cfg, steps=0)), *batch).item()
    losses = []
    model = train_warmstart(model_cfg, task, cfg, on_step=lambda step, loss, model: losses.append(loss))
    assert len(losses) == 8
    assert answer_loss(model, *batch).item() < 0.8 * before


def test_trains_once_then_loads_from_the_cache(task, model_cfg, tmp_path, monkeypatch):
    quick = dataclasses.replace(QUICK, cache_dir=str(tmp_path))
    first = warmstart(model_cfg, task, TASK_CFG, quick)
    assert first.weights_path.exists() and 0.0 <= first.metadata["eval/accuracy"] <= 1.0
    assert first.metadata["train_seconds"] >= 0 and first.metadata["model"]["vocab_size"] == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [
            first.weights_path.name,
            first.weights_path.with_suffix(".json").name,
            first.weights_path.with_suffix(".lock").name,
        ]
    )  # no temporary files left behind (the lock that made concurrent runs wait stays, empty)

    def must_not_train(*args, **kwargs):
        raise AssertionError("the cached warm start was retrained")

    monkeypatch.setattr(ws, "train_warmstart", must_not_train)
    assert warmstart(get_model_config("tiny"), task, TASK_CFG, quick).weights_path == first.weights_path


def test_cached_weights_reproduce_the_trained_model(task, model_cfg, tmp_path):
    path = warmstart(model_cfg, task, TASK_CFG, dataclasses.replace(QUICK, cache_dir=str(tmp_path))).weights_path
    trained = train_warmstart(model_cfg, task, QUICK)  # deterministic: same seed, same batches
    loaded = load_warmstarted_model(path, model_cfg, seed=123)
    input_ids, attention_mask, _ = teacher_forcing_batch(task, task.eval_problems[:4])
    with torch.no_grad():
        torch.testing.assert_close(
            forward_logits(loaded, input_ids, attention_mask),
            forward_logits(trained, input_ids, attention_mask),
            rtol=0,
            atol=0,
        )


def test_failed_write_leaves_nothing(tmp_path):
    target = tmp_path / "weights.safetensors"

    def crash(tmp_name):
        with open(tmp_name, "w") as handle:
            handle.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        ws._write_atomically(target, crash)
    assert list(tmp_path.iterdir()) == []


def test_fields_added_later_leave_the_key_alone_at_their_neutral_value(model_cfg):
    # Format 3: the key is the run hash's view of the task and warm-start sections (fields at their declared
    # neutral value left out), so a field added later with a neutral value keeps the key of the caches on every
    # machine; setting one of them changes it. Format 2 (3835b8b2b84f92dc here) kept a list of its own.
    base = warmstart_key(model_cfg, TASK_CFG, QUICK)
    assert base == "0841b4aea4a42eab"  # computed by the code at the format bump
    assert warmstart_key(model_cfg, TASK_CFG, dataclasses.replace(QUICK, stop_accuracy=0.5)) != base
    assert warmstart_key(model_cfg, dataclasses.replace(TASK_CFG, junk_tokens=3), QUICK) != base
    assert warmstart_key(model_cfg, dataclasses.replace(TASK_CFG, overlong_prompts="filter"), QUICK) != base


def test_stops_at_the_first_check_that_reaches_the_accuracy(task, model_cfg, monkeypatch):
    accuracies = iter([0.1, 0.3, 0.55, 0.9])
    monkeypatch.setattr(ws, "greedy_eval", lambda *args: {"eval/accuracy": next(accuracies)})
    recipe = dataclasses.replace(QUICK, steps=20, stop_accuracy=0.5, check_every=2)
    model = train_warmstart(model_cfg, task, recipe)
    assert model.warmstart_steps_done == 6
    assert model.warmstart_trace == [[2, 0.1], [4, 0.3], [6, 0.55]]
    unstopped = train_warmstart(model_cfg, task, QUICK)
    assert (unstopped.warmstart_steps_done, unstopped.warmstart_trace) == (2, [])


def test_a_warm_start_being_trained_holds_its_lock_until_cached(tmp_path: Path) -> None:
    import fcntl

    from fp8rl.trainer.warmstart import _exclusive

    lock = tmp_path / "cache" / "warmstart-k.lock"
    with _exclusive(lock), open(lock) as other, pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a second run waits while the first trains
    with open(lock) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free once the first is done


def test_the_warm_start_says_how_far_it_is_and_how_long_is_left() -> None:
    """make demo's 400-step warm start printed nothing for minutes (train_warmstart logs this line every
    PROGRESS_EVERY steps)."""
    from fp8rl.trainer.warmstart import progress_line

    assert progress_line(50, 400, 1.23456, 12.0) == "warm start 50/400 | loss 1.235 | 12 s, ~84 s left"
    assert progress_line(400, 400, 0.5, 96.0).endswith("96 s, ~0 s left")


# --------------------------------------------------------------------------------------------- shipped warm start
def _tiny_tables_key() -> str:
    from fp8rl.choices import validated
    from fp8rl.compose import compose_config

    cfg = validated(compose_config(["scale=tiny"]))
    resolved = with_tokenizer_vocab(get_model_config(cfg.model.preset), build_task(cfg.task).tokenizer.vocab_size)
    return warmstart_key(resolved, cfg.task, cfg.warmstart)


def test_the_tiny_tables_warm_start_is_shipped_and_intact() -> None:
    """A change of the tiny defaults that moves the warm-start key leaves the shipped file unused: every machine
    would train its own start again (and land elsewhere). Re-ship it: `make ship-warmstart`."""
    key = _tiny_tables_key()
    shipped = ws.shipped_warmstart(key)
    assert shipped is not None, f"no shipped warm start for the tiny defaults' key {key}: run `make ship-warmstart`"
    assert shipped.metadata["key"] == key and shipped.metadata["origin"] == "shipped"
    assert 0.3 < shipped.metadata["eval/accuracy"] < 0.9  # partly right: RL has signal and room to learn
    assert sorted(p.name for p in ws.SHIPPED_DIR.iterdir() if p.suffix != ".md") == sorted(
        ws.cache_paths(ws.SHIPPED_DIR, key)[i].name for i in range(2)
    ), "a shipped file no config uses"


def test_a_shipped_warm_start_is_used_before_the_cache_and_never_retrained(task, model_cfg, tmp_path, monkeypatch):
    key = warmstart_key(model_cfg, TASK_CFG, QUICK)
    trained = warmstart(model_cfg, task, TASK_CFG, dataclasses.replace(QUICK, cache_dir=str(tmp_path / "made")))
    shipped_dir = tmp_path / "shipped"
    shipped_dir.mkdir()
    weights, metadata = ws.cache_paths(shipped_dir, key)
    weights.write_bytes(trained.weights_path.read_bytes())
    metadata.write_text(ws.json.dumps({**trained.metadata, "sha256": ws.file_sha256(weights)}))
    monkeypatch.setattr(ws, "SHIPPED_DIR", shipped_dir)
    empty_cache = dataclasses.replace(QUICK, cache_dir=str(tmp_path / "empty"))

    def must_not_train(*args, **kwargs):
        raise AssertionError("trained although a shipped warm start exists")

    with monkeypatch.context() as patched:
        patched.setattr(ws, "train_warmstart", must_not_train)
        found = warmstart(model_cfg, task, TASK_CFG, empty_cache)
    assert found.weights_path == weights and found.metadata["origin"] == "shipped"
    assert not (tmp_path / "empty").exists()  # nothing trained, nothing cached, no lock taken
    here = warmstart(model_cfg, task, TASK_CFG, dataclasses.replace(empty_cache, shipped=False))
    assert here.metadata["origin"] == "trained here" and here.weights_path.parent == tmp_path / "empty"


def test_a_damaged_shipped_warm_start_is_an_error_not_another_start(tmp_path: Path) -> None:
    weights, metadata = ws.cache_paths(tmp_path, "0123456789abcdef")
    weights.write_bytes(b"version https://git-lfs.github.com/spec/v1\n")  # what a Git LFS pointer looks like
    metadata.write_text('{"key": "0123456789abcdef", "sha256": "00"}')
    with pytest.raises(RuntimeError, match="git checkout -- fp8rl/assets/warmstart"):
        ws.shipped_warmstart("0123456789abcdef", tmp_path)


def test_junk_noise_puts_junk_before_target_tokens_at_its_rate_from_the_seed() -> None:
    """warmstart.junk_rate: each target token is preceded by a junk token with that probability; the draws are
    fixed by the warm start's seed, and a task without junk tokens is refused."""
    chain = build_task(TaskConfig(name="chain", num_digits=1, num_train=500, num_eval=16))
    cfg = WarmStartConfig(junk_rate=0.2, seed=3)
    noise, again = ws.junk_noise(chain, cfg), ws.junk_noise(chain, cfg)
    targets = [chain.target_ids(p) for p in chain.train_problems]
    noisy = [noise(t) for t in targets]
    assert noisy == [again(t) for t in targets]
    junk = chain.junk_ids
    inserted = sum(token in junk for row in noisy for token in row)
    assert inserted == sum(len(n) - len(t) for n, t in zip(noisy, targets, strict=True))  # one junk per insertion
    assert [[t for t in row if t not in junk] for row in noisy] == targets  # the clean target, in order
    assert inserted / sum(map(len, targets)) == pytest.approx(0.2, abs=0.015)  # 3 sd of 7886 Bernoulli(0.2) draws
    assert ws.junk_noise(chain, WarmStartConfig()) is None
    with pytest.raises(ValueError, match="needs a task with junk tokens"):
        ws.junk_noise(build_task(TASK_CFG), cfg)
    ids, _, loss_mask = teacher_forcing_batch(chain, chain.train_problems[:4], noise)
    assert loss_mask.sum() >= sum(len(t) for t in targets[:4])
