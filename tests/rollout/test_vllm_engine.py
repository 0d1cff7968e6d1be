"""The vLLM engine against the trainer: log-prob parity in fp32 across weight pushes, the sampling contract,
and FP8 rollouts (per-channel weights, FP8 KV cache) that mismatch the trainer more than BF16 does.

Integration tests: they need vLLM (on CPU the community build, ``make setup-vllm``; run them with that
environment's python) and take about a minute each on 2 CPU cores; skipped where vLLM is not installed.
"""

from __future__ import annotations

import pytest
import torch

from fp8rl import algos
from fp8rl.models.generate import SamplingConfig
from fp8rl.models.logprobs import left_pad, token_logprobs_and_entropy
from fp8rl.rollout.builtin import BuiltinEngine

from ._policies import copy_policy, peaked_policy, perturb_
from ._vllm import VLLM_INTEGRATION

pytestmark = VLLM_INTEGRATION

PARITY_TOL = 1e-4  # fp32 engine vs fp32 trainer, max |log-prob difference| over response tokens
GROUP_SIZE = 4


def engine(*args, **kwargs):
    from fp8rl.rollout.vllm_engine import VllmEngine

    return VllmEngine(*args, **kwargs)


@pytest.fixture(scope="module")
def prompts(task) -> list[list[int]]:
    """16 problems, each repeated GROUP_SIZE times (group sampling: one row per sample)."""
    return [task.prompt_ids(problem) for problem in task.train_problems[:16] for _ in range(GROUP_SIZE)]


def sampling_for(task, temperature: float) -> SamplingConfig:
    tokenizer = task.tokenizer
    return SamplingConfig(task.max_response_tokens, tokenizer.eos_ids, tokenizer.pad_id, temperature=temperature)


def row_seeds(seed: int, rows: int) -> list[int]:
    """One sampling seed per row (rows sample independently of each other)."""
    return [seed * 1000 + row for row in range(rows)]


def trainer_logprobs(model, batch, temperature):
    with torch.no_grad():
        return token_logprobs_and_entropy(
            model, batch.input_ids, batch.attention_mask, batch.response_ids.size(1), temperature
        )


def masked_max_abs(a, b, mask):
    return float((a - b)[mask.bool()].abs().max())


def check_layout(batch, prompts, sampling):
    """Prompts left-padded as the trainer does; responses right-padded, EOS kept, nothing after it."""
    prompt_ids, prompt_mask = left_pad(prompts, sampling.pad_token_id)
    assert torch.equal(batch.prompt_ids, prompt_ids) and torch.equal(batch.prompt_mask, prompt_mask)
    assert batch.response_ids.shape == (len(prompts), sampling.max_new_tokens)
    lengths = batch.response_mask.sum(1)
    assert int(lengths.min()) >= 1
    for row, length in enumerate(lengths.tolist()):
        assert batch.response_mask[row, :length].all() and not batch.response_mask[row, length:].any()
        tokens = batch.response_ids[row, :length].tolist()
        assert sampling.eos_token_ids[0] not in tokens[:-1]  # stops at the first EOS ...
        assert tokens[-1] in sampling.eos_token_ids or length == sampling.max_new_tokens  # ... or at the limit
        assert (batch.response_ids[row, length:] == sampling.pad_token_id).all()
        assert (batch.rollout_logp[row, length:] == 0).all()


@pytest.fixture(scope="module")
def fp32_engine(task, tiny_cfg):
    vllm_engine = engine(
        peaked_policy(tiny_cfg, seed=0), tiny_cfg, task.tokenizer.pad_id, dtype="float32", entropy=True, max_num_seqs=64
    )
    yield vllm_engine
    vllm_engine.close()


def test_fp32_rollout_logprobs_equal_the_trainers_across_weight_pushes(fp32_engine, task, tiny_cfg, prompts):
    model = peaked_policy(tiny_cfg, seed=0)
    sampling = sampling_for(task, temperature=0.8)
    assert fp32_engine.sync_weights(model) > 0
    for push in range(4):
        if push:
            before = copy_policy(model, tiny_cfg)
            perturb_(model, scale=0.05, seed=push)
            assert fp32_engine.sync_weights(model) > 0
        batch = fp32_engine.generate(prompts, sampling, row_seeds(push, len(prompts)))
        check_layout(batch, prompts, sampling)
        logp, entropy = trainer_logprobs(model, batch, sampling.temperature)
        mask = batch.response_mask
        assert masked_max_abs(logp, batch.rollout_logp, mask) < PARITY_TOL
        assert masked_max_abs(entropy, batch.rollout_entropy, mask) < PARITY_TOL
        if push:  # the pushed update is large next to the tolerance: parity means the engine has the new weights
            stale_logp, _ = trainer_logprobs(before, batch, sampling.temperature)
            assert masked_max_abs(stale_logp, batch.rollout_logp, mask) > 100 * PARITY_TOL


def test_sampling_is_reproducible_from_the_row_seeds(fp32_engine, task, tiny_cfg, prompts):
    fp32_engine.sync_weights(peaked_policy(tiny_cfg, seed=0))
    sampling = sampling_for(task, temperature=1.0)
    first, again, other = (fp32_engine.generate(prompts, sampling, row_seeds(seed, len(prompts))) for seed in (7, 7, 8))
    assert torch.equal(first.response_ids, again.response_ids)
    assert torch.equal(first.rollout_logp, again.rollout_logp)
    assert not torch.equal(first.response_ids, other.response_ids)
    # Group members are sampled independently.
    groups = first.response_ids.view(-1, GROUP_SIZE, first.response_ids.size(1))
    assert any(not torch.equal(group[0], group[1]) for group in groups)


def test_greedy_tokens_match_the_builtin_engine_in_fp32(fp32_engine, task, tiny_cfg, prompts):
    model = peaked_policy(tiny_cfg, seed=0)
    fp32_engine.sync_weights(model)
    greedy = sampling_for(task, temperature=0.0)
    unique_prompts = prompts[::GROUP_SIZE]
    ours = fp32_engine.generate(unique_prompts, greedy, None)
    builtin = BuiltinEngine(model, None, task.tokenizer.pad_id, compute="fp32").generate(unique_prompts, greedy, None)
    assert torch.equal(ours.response_ids, builtin.response_ids)
    assert torch.equal(ours.response_mask, builtin.response_mask)
    assert masked_max_abs(ours.rollout_logp, builtin.rollout_logp, ours.response_mask) < PARITY_TOL


def mismatch(model, batch):
    """Rollout/train mismatch and token-TIS metrics of a batch against the fp32 trainer."""
    logp, _ = trainer_logprobs(model, batch, 1.0)
    mask = batch.response_mask
    metrics = algos.metrics_to_floats(algos.rollout_mismatch_metrics(logp, batch.rollout_logp, mask))
    tis = algos.apply_rollout_correction(logp, batch.rollout_logp, mask, "tis_token")  # the paper's C = 2
    tight = algos.apply_rollout_correction(logp, batch.rollout_logp, mask, "tis_token", tis_cap=1.05)
    metrics["tis_std"] = float(tis.weights[mask.bool()].std())
    metrics["tis_trunc_frac@1.05"] = float(tight.metrics["rollout/tis_trunc_frac"])
    metrics.update(algos.metrics_to_floats(tis.metrics))
    return metrics


def test_fp8_rollout_mismatches_the_trainer_more_than_bf16_and_follows_pushes(task, tiny_cfg, prompts):
    model = peaked_policy(tiny_cfg, seed=0)
    sampling = sampling_for(task, temperature=1.0)
    pad = task.tokenizer.pad_id
    with engine(model, tiny_cfg, pad, dtype="bfloat16", max_num_seqs=64) as bf16:
        bf16_metrics = mismatch(model, bf16.generate(prompts, sampling, seeds=row_seeds(0, len(prompts))))
    with engine(model, tiny_cfg, pad, recipe="rowwise", fp8_kv_cache=True, max_num_seqs=64) as fp8:
        fp8_metrics = mismatch(model, fp8.generate(prompts, sampling, seeds=row_seeds(0, len(prompts))))
        # A push re-quantizes: the engine tracks the new weights, not the old ones.
        old = copy_policy(model, tiny_cfg)
        perturb_(model, scale=0.05, seed=1)
        fp8.sync_weights(model)
        batch = fp8.generate(prompts, sampling, seeds=row_seeds(1, len(prompts)))
        pushed, stale = mismatch(model, batch), mismatch(old, batch)
    excess = "rollout/token_mult_prob_error"  # mean exp|log ratio|, 1 when rollout and trainer agree
    assert fp8_metrics[excess] - 1 > 3 * (bf16_metrics[excess] - 1)
    assert fp8_metrics["rollout/abs_logp_diff"] > 3 * bf16_metrics["rollout/abs_logp_diff"]
    assert fp8_metrics["rollout/k3_kl"] > 10 * bf16_metrics["rollout/k3_kl"]
    assert fp8_metrics["tis_std"] > 3 * bf16_metrics["tis_std"]  # TIS weights spread more ...
    assert fp8_metrics["tis_trunc_frac@1.05"] > 2 * bf16_metrics["tis_trunc_frac@1.05"]  # ... and are truncated more
    assert fp8_metrics["rollout/tis_trunc_frac"] >= bf16_metrics["rollout/tis_trunc_frac"]
    assert pushed["rollout/k3_kl"] < 0.5 * stale["rollout/k3_kl"]
    assert pushed[excess] - 1 < 2 * (fp8_metrics[excess] - 1)


def test_exported_task_folder_serves_text_prompts_with_its_tokenizer(task, tiny_cfg, tmp_path):
    """The exported folder on its own (config, weights, tokenizer, EOS) is a model vLLM serves from text."""
    from fp8rl.models.hf import save_hf_checkpoint
    from fp8rl.rollout.vllm_engine import import_vllm, shutdown_llm

    model = peaked_policy(tiny_cfg, seed=0)
    save_hf_checkpoint(model, tiny_cfg, tmp_path, tokenizer=task.tokenizer)
    vllm = import_vllm()
    llm = vllm.LLM(
        model=str(tmp_path),
        dtype="float32",
        distributed_executor_backend="uni",
        enforce_eager=True,
        max_model_len=tiny_cfg.max_seq_len,
        kv_cache_memory_bytes=16 << 20,
    )
    try:
        texts = [problem.prompt for problem in task.train_problems[:4]]
        greedy = vllm.SamplingParams(temperature=0.0, max_tokens=task.max_response_tokens)
        outputs = llm.generate(texts, greedy, use_tqdm=False)
    finally:
        shutdown_llm(llm)
    prompts = [task.tokenizer.encode(text) for text in texts]  # <bos> + characters
    assert [list(output.prompt_token_ids) for output in outputs] == prompts
    sampling = sampling_for(task, temperature=0.0)
    builtin = BuiltinEngine(model, None, task.tokenizer.pad_id, compute="fp32").generate(prompts, sampling, None)
    for output, tokens, mask in zip(outputs, builtin.response_ids, builtin.response_mask, strict=True):
        assert list(output.outputs[0].token_ids) == tokens[mask.bool()].tolist()  # stopped at the folder's EOS
        assert output.outputs[0].text == task.tokenizer.decode(output.outputs[0].token_ids)


def kv_scales_in_engine(vllm_engine) -> dict[int, tuple[float, ...]]:
    """Each vLLM attention layer's (host key scale, host value scale, key scale tensor, value scale tensor), by
    megatron layer number (vLLM's model.layers.N is N + 1)."""

    def read(model):
        from vllm.model_executor.layers.attention.attention import Attention

        from fp8rl.rollout.vllm_kv_scales import vllm_layer_number

        return {
            vllm_layer_number(m.layer_name): (
                m._k_scale_float,
                m._v_scale_float,
                float(m._k_scale),
                float(m._v_scale),
            )
            for m in model.modules()
            if isinstance(m, Attention)
        }

    return vllm_engine.llm.apply_model(read)[0]


def test_calibrated_kv_cache_scales_reach_vllms_attention_and_survive_weight_pushes(task, tiny_cfg, prompts):
    """The trainer's per-layer scales (keys after rotary, as vLLM caches them) land where vLLM's loader puts a
    checkpoint's k_scale / v_scale, are written again after a push (a reload resets them to 1), and the CPU
    attention kernel reads them: scales 64x too small saturate the cache and wreck the log-probs."""
    from fp8rl.models.kv_cache import kv_amax, kv_scales_from_amax, recording_kv_amax

    model = peaked_policy(tiny_cfg, seed=0)
    greedy = sampling_for(task, temperature=0.0)
    unique_prompts = prompts[::GROUP_SIZE]

    def mismatch_of(batch) -> float:
        logp, _ = trainer_logprobs(model, batch, 1.0)
        return masked_max_abs(logp, batch.rollout_logp, batch.response_mask)

    kv = {"fp8_kv_cache": True, "kv_cache_scales": "calibrated", "max_num_seqs": 64}
    with engine(model, tiny_cfg, task.tokenizer.pad_id, **kv) as fp8:
        assert fp8.calibrates_kv_cache and fp8.kv_cache_keys == "post_rotary"
        unit = fp8.generate(unique_prompts, greedy, None)
        layers = kv_scales_in_engine(fp8)
        assert sorted(layers) == list(range(1, tiny_cfg.num_layers + 1))
        assert all(scales == (1.0, 1.0, 1.0, 1.0) for scales in layers.values())
        with torch.no_grad(), recording_kv_amax(model, fp8.kv_cache_keys) as records:  # as Trainer._old_logprobs
            trainer_logprobs(model, unit, 1.0)
        scales = kv_scales_from_amax(sorted(records), kv_amax(records, unit.attention_mask))
        fp8.set_kv_scales(scales)
        calibrated = fp8.generate(unique_prompts, greedy, None)
        seen = kv_scales_in_engine(fp8)
        for layer, (k, v) in scales.items():
            assert seen[layer][:2] == (k, v) and seen[layer][2:] == pytest.approx((k, v), rel=1e-6)
        fp8.sync_weights(model)
        again = fp8.generate(unique_prompts, greedy, None)
        assert kv_scales_in_engine(fp8) == seen
        assert torch.equal(again.response_ids, calibrated.response_ids)
        assert torch.equal(again.rollout_logp, calibrated.rollout_logp)
        fp8.set_kv_scales({layer: (k / 64, v / 64) for layer, (k, v) in scales.items()})
        saturated = fp8.generate(unique_prompts, greedy, None)
    assert mismatch_of(saturated) > 10 * max(mismatch_of(unit), mismatch_of(calibrated))
    assert mismatch_of(calibrated) < 0.5  # a working FP8 cache: close to the fp32 trainer
