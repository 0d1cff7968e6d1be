"""HF checkpoint <-> megatron GPTModel mapping: configs, tensor layout (against a looped reference), exact
round trips, and logits equal to ``transformers``' for tiny random Qwen3 / Qwen2 / Llama models built here.

The ``transformers`` tests are skipped where it is not installed (the base suite does not need it).
"""

from __future__ import annotations

import json

import pytest
import torch

from fp8rl.models.config import ModelConfig, get_model_config, with_tokenizer_vocab
from fp8rl.models.gpt import build_gpt_model
from fp8rl.models.hf import (
    HFConversionError,
    default_model_type,
    hf_architecture_fields,
    hf_config_from_model_config,
    hf_to_megatron,
    hf_weights,
    load_hf_checkpoint,
    megatron_to_hf,
    model_config_from_hf,
    read_hf_tensors,
    save_hf_checkpoint,
)
from fp8rl.models.logprobs import forward_logits

pytestmark = pytest.mark.timeout(300)

# Tiny shapes of each architecture; GQA everywhere but "llama_bias" (MHA); qwen3's head_dim (32) is not
# hidden / heads (16), so o_proj is not square.
ARCHS: dict[str, ModelConfig] = {
    "qwen3": ModelConfig(
        name="qwen3",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        vocab_size=40,
        max_seq_len=32,
        head_dim=32,
        rotary_base=1e6,
        qk_layernorm=True,
    ),
    "qwen2_tied": ModelConfig(
        name="qwen2_tied",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        vocab_size=40,
        max_seq_len=32,
        rotary_base=1e4,
        norm_epsilon=1e-5,
        qk_layernorm=False,
        add_qkv_bias=True,
        tie_embeddings=True,
    ),
    "llama": ModelConfig(
        name="llama",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=1,
        ffn_hidden_size=96,
        vocab_size=40,
        max_seq_len=32,
        rotary_base=5e5,
        norm_epsilon=1e-5,
        qk_layernorm=False,
    ),
    "llama_bias": ModelConfig(
        name="llama_bias",
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=4,
        ffn_hidden_size=96,
        vocab_size=40,
        max_seq_len=32,
        rotary_base=1e4,
        qk_layernorm=False,
        add_bias_linear=True,
        tie_embeddings=True,
    ),
}
MODEL_TYPE = {"qwen3": "qwen3", "qwen2_tied": "qwen2", "llama": "llama", "llama_bias": "llama"}


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter redrawn (norm weights around 1, biases non-zero), so no part of the mapping is untested."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            is_norm = "norm" in name
            param.copy_(1 + 0.1 * noise if is_norm else 0.1 * noise)
    return model


def megatron_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


# --------------------------------------------------------------------------------------------------
# Configs (no transformers needed)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_config_round_trip(arch):
    cfg = ARCHS[arch]
    hf = hf_config_from_model_config(cfg, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    assert hf["model_type"] == MODEL_TYPE[arch] == default_model_type(cfg)
    back = model_config_from_hf(json.loads(json.dumps(hf)), name=cfg.name)
    assert hf_architecture_fields(back) == hf_architecture_fields(cfg)
    assert back.max_seq_len == cfg.max_seq_len


def test_config_from_legacy_rope_theta_and_qwen2_without_head_dim():
    hf = hf_config_from_model_config(ARCHS["qwen2_tied"])
    del hf["rope_parameters"], hf["head_dim"]
    hf["rope_theta"] = 12345.0
    cfg = model_config_from_hf(hf)
    assert cfg.rotary_base == 12345.0 and cfg.kv_channels == 16


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "not supported"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "sliding"),
        ({"model_type": "llama", "attention_bias": True, "mlp_bias": False}, "add_bias_linear"),
    ],
)
def test_unmappable_hf_configs_raise(change, message):
    hf = {**hf_config_from_model_config(ARCHS["llama"]), **change}
    with pytest.raises(HFConversionError, match=message):
        model_config_from_hf(hf)


@pytest.mark.parametrize(
    ("cfg", "model_type", "message"),
    [
        (ARCHS["llama"], "qwen2", "q/k/v bias"),
        (ARCHS["qwen3"], "llama", "qk_layernorm"),
        (ModelConfig("ln", 1, 64, 4, 4, 96, 40, 32, normalization="LayerNorm"), None, "normalization"),
        (ModelConfig("gelu", 1, 64, 4, 4, 96, 40, 32, swiglu=False), None, "swiglu"),
        (ModelConfig("both", 1, 64, 4, 4, 96, 40, 32, qk_layernorm=True, add_qkv_bias=True), None, "add_qkv_bias"),
    ],
)
def test_inexpressible_model_configs_raise(cfg, model_type, message):
    with pytest.raises(HFConversionError, match=message):
        hf_config_from_model_config(cfg, model_type)


# --------------------------------------------------------------------------------------------------
# Tensors (no transformers needed)


def looped_qkv_reference(q, k, v, cfg):
    """megatron's fused QKV rows built head by head: for each group, its query heads, then its k, then its v."""
    d, per_group = cfg.kv_channels, cfg.num_attention_heads // cfg.num_query_groups
    rows = []
    for g in range(cfg.num_query_groups):
        for h in range(per_group):
            head = g * per_group + h
            rows.append(q[head * d : (head + 1) * d])
        rows.append(k[g * d : (g + 1) * d])
        rows.append(v[g * d : (g + 1) * d])
    return torch.cat(rows)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_export_matches_a_looped_reference_and_round_trips_exactly(arch):
    cfg = ARCHS[arch]
    state = megatron_state(randomized(build_gpt_model(cfg, seed=0), seed=1))
    hf = megatron_to_hf(state, cfg)
    for i in range(cfg.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        params = ("weight", "bias") if cfg.add_qkv_bias or cfg.add_bias_linear else ("weight",)
        for p in params:
            q, k, v = (hf[f"{attn}{x}_proj.{p}"] for x in "qkv")
            fused = state[f"decoder.layers.{i}.self_attention.linear_qkv.{p}"]
            assert torch.equal(looped_qkv_reference(q, k, v, cfg), fused)
        fc1 = state[f"decoder.layers.{i}.mlp.linear_fc1.weight"]
        assert torch.equal(torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]]), fc1)
    assert ("lm_head.weight" in hf) == (not cfg.tie_embeddings)
    back = hf_to_megatron(hf, cfg)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    again = megatron_to_hf(back, cfg)
    assert again.keys() == hf.keys() and all(torch.equal(again[k], hf[k]) for k in hf)


def test_hf_weights_are_views_of_the_live_model():
    cfg = ARCHS["qwen3"]
    model = build_gpt_model(cfg, seed=0)
    weights = dict(hf_weights(model, cfg))
    assert weights["model.embed_tokens.weight"].data_ptr() == model.embedding.word_embeddings.weight.data_ptr()
    assert weights.keys() == megatron_to_hf(megatron_state(model), cfg).keys()


def test_import_rejects_missing_unexpected_and_untied_head():
    cfg = ARCHS["qwen2_tied"]
    hf = megatron_to_hf(megatron_state(build_gpt_model(cfg, seed=0)), cfg)
    with pytest.raises(HFConversionError, match="missing"):
        hf_to_megatron({k: v for k, v in hf.items() if k != "model.norm.weight"}, cfg)
    with pytest.raises(HFConversionError, match="unexpected"):
        hf_to_megatron({**hf, "model.layers.0.mlp.gate_proj.bias": torch.zeros(96)}, cfg)
    # A tied checkpoint that stores lm_head anyway is fine if it is the embedding, an error otherwise.
    hf_to_megatron({**hf, "lm_head.weight": hf["model.embed_tokens.weight"].clone()}, cfg)
    with pytest.raises(HFConversionError, match="differs"):
        hf_to_megatron({**hf, "lm_head.weight": torch.zeros(40, 64)}, cfg)


def test_save_and_load_a_folder_round_trips(tmp_path):
    cfg = ARCHS["qwen3"]
    model = randomized(build_gpt_model(cfg, seed=0), seed=2)
    save_hf_checkpoint(model, cfg, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "generation_config.json", "model.safetensors"}
    loaded_cfg, loaded = load_hf_checkpoint(tmp_path)
    assert hf_architecture_fields(loaded_cfg) == hf_architecture_fields(cfg)
    state, loaded_state = megatron_state(model), megatron_state(loaded)
    assert all(torch.equal(state[k], loaded_state[k]) for k in state)


def test_task_model_exports_with_its_tokenizer(tmp_path):
    from fp8rl.tasks.arithmetic import ALPHABET
    from fp8rl.tasks.tokenizer import CharTokenizer, build_char_tokenizer

    tokenizer = build_char_tokenizer(ALPHABET)
    cfg = with_tokenizer_vocab(get_model_config("tiny"), tokenizer.vocab_size)
    save_hf_checkpoint(build_gpt_model(cfg, seed=0), cfg, tmp_path, tokenizer=tokenizer, dtype=torch.bfloat16)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    assert CharTokenizer.load(tmp_path).encode("1+2=") == tokenizer.encode("1+2=")
    assert read_hf_tensors(tmp_path)["model.embed_tokens.weight"].dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------------
# Against transformers


def random_hf_model(arch: str, seed: int):
    transformers = pytest.importorskip("transformers")
    hf_config = hf_config_from_model_config(ARCHS[arch])
    config_class = transformers.AutoConfig.for_model(hf_config["model_type"]).__class__
    config = config_class.from_dict(hf_config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    return randomized(model, seed)


def hf_logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def megatron_logits(model, input_ids):
    with torch.no_grad():
        return forward_logits(model.eval(), input_ids, torch.ones_like(input_ids))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_imported_checkpoint_has_the_hf_logits_and_exports_back_exactly(arch, tmp_path):
    hf_model = random_hf_model(arch, seed=3)
    hf_model.save_pretrained(tmp_path / "hf")
    cfg, model = load_hf_checkpoint(tmp_path / "hf")
    assert hf_architecture_fields(cfg) == hf_architecture_fields(ARCHS[arch])
    input_ids = torch.randint(0, cfg.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    expected = hf_logits(hf_model, input_ids)
    torch.testing.assert_close(megatron_logits(model, input_ids), expected, rtol=1e-5, atol=2e-5)

    original = read_hf_tensors(tmp_path / "hf")
    exported = megatron_to_hf(megatron_state(model), cfg)
    if cfg.tie_embeddings:
        original.pop("lm_head.weight", None)
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_exported_folder_loads_in_transformers_with_the_same_logits(arch, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = ARCHS[arch]
    model = randomized(build_gpt_model(cfg, seed=0), seed=4)
    save_hf_checkpoint(model, cfg, tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf_model).__name__ == json.loads((tmp_path / "config.json").read_text())["architectures"][0]
    input_ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(hf_logits(hf_model, input_ids), megatron_logits(model, input_ids), rtol=1e-5, atol=2e-5)


def test_exported_task_tokenizer_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from fp8rl.tasks.arithmetic import ALPHABET
    from fp8rl.tasks.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(ALPHABET)
    cfg = with_tokenizer_vocab(get_model_config("tiny"), tokenizer.vocab_size)
    save_hf_checkpoint(build_gpt_model(cfg, seed=0), cfg, tmp_path, tokenizer=tokenizer)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tokenizer("12+3=")["input_ids"] == tokenizer.encode("12+3=")
    assert hf_tokenizer.eos_token_id == tokenizer.eos_id


# --------------------------------------------------------------------------------------------------
# Host memory at start-up (issue 25, item 8): the checkpoint is read tensor by tensor, each rank keeping its part


class _CountingReads(dict):
    """HF tensors that count each read and track which read tensors are still alive (and their bytes)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.reads, self.alive, self.peak = 0, 0, 0

    def __getitem__(self, name: str) -> torch.Tensor:
        import weakref

        self.reads += 1
        tensor = super().__getitem__(name).clone()  # a fresh tensor, as a read from the file is
        self.alive += tensor.nbytes
        self.peak = max(self.peak, self.alive)
        weakref.finalize(tensor, self._freed, tensor.nbytes)
        return tensor

    def _freed(self, nbytes: int) -> None:
        self.alive -= nbytes


def test_a_checkpoints_megatron_state_is_read_when_asked_and_equals_the_eager_one(tmp_path):
    from fp8rl.models.hf import LazyHFTensors, MegatronStateFromHF, megatron_state_from_hf_folder

    cfg = ARCHS["qwen3"]
    save_hf_checkpoint(randomized(build_gpt_model(cfg, seed=0), seed=3), cfg, tmp_path, dtype=torch.bfloat16)
    lazy = megatron_state_from_hf_folder(tmp_path, cfg)
    eager = hf_to_megatron({k: v.float() for k, v in read_hf_tensors(tmp_path).items()}, cfg)
    assert isinstance(lazy, MegatronStateFromHF) and list(lazy) == list(eager)
    assert all(lazy[k].dtype == torch.float32 and torch.equal(lazy[k], eager[k]) for k in eager)
    assert set(LazyHFTensors(tmp_path)) == set(read_hf_tensors(tmp_path))

    counting = _CountingReads(read_hf_tensors(tmp_path))
    state = MegatronStateFromHF(counting, cfg, dtype=torch.float32)
    assert counting.reads == 0, "building the mapping reads names only"
    state["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert counting.reads == 3, "one megatron tensor reads its HF parts (q, k, v) and nothing else"


def test_a_tensor_parallel_rank_holds_one_full_tensor_at_a_time(tmp_path):
    """Loading this rank's TP shard from the lazy state: the full FP32 tensors are read one by one and dropped
    once sharded, so the peak is this rank's shards plus one full tensor (before: the whole model in the
    checkpoint's dtype and again in FP32, on every rank: > 190 GB for Qwen2.5-32B)."""
    from types import SimpleNamespace

    from fp8rl.models.hf import MegatronStateFromHF
    from fp8rl.models.policy import load_full_state

    cfg = ARCHS["qwen3"]
    full = build_gpt_model(cfg, seed=0)
    save_hf_checkpoint(randomized(full, seed=3), cfg, tmp_path)
    counting = _CountingReads(read_hf_tensors(tmp_path))
    state = MegatronStateFromHF(counting, cfg, dtype=torch.float32)
    shard = _tensor_parallel_half(full)
    load_full_state(shard, state, SimpleNamespace(tp=2, tp_rank=1))
    peak = counting.peak
    total = sum(t.nbytes for t in read_hf_tensors(tmp_path).values())
    largest_read = max(sum(counting[p].nbytes for p in parts) for parts in _hf_parts(cfg))
    kept = sum(p.nbytes for p in shard.parameters())
    assert peak <= kept + 2 * largest_read < total, (peak, kept, largest_read, total)


def _hf_parts(cfg: ModelConfig) -> list[tuple[str, ...]]:
    from fp8rl.models.hf import _mapping_rules

    return [rule.hf for rule in _mapping_rules(cfg)]


def _tensor_parallel_half(model: torch.nn.Module) -> torch.nn.Module:
    """A module with `model`'s parameter names and TP = 2 shapes (megatron's partition_dim / stride), standing in
    for a TP = 2 rank's GPTModel (which needs two processes)."""
    half = torch.nn.Module()
    for name, param in model.named_parameters():
        shape = list(param.shape)
        if getattr(param, "tensor_model_parallel", False):
            shape[param.partition_dim] //= 2
        new = torch.nn.Parameter(torch.zeros(shape))
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(param, attr):
                setattr(new, attr, getattr(param, attr))
        owner = half
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, new)
    return half
