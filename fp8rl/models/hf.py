"""Hugging Face checkpoints <-> megatron GPTModel: one name and layout mapping, used in both directions.

Supported HF architectures (``model_type``): ``qwen3`` (Qwen3ForCausalLM: QK-norm, no bias), ``qwen2``
(Qwen2ForCausalLM, also Qwen2.5: bias on q/k/v only) and ``llama`` (LlamaForCausalLM: no bias, or bias on
every linear). All are RMSNorm + SwiGLU + plain RoPE (rope_type "default"); tied or untied embeddings.

Layout differences the mapping handles (megatron-core 0.16, local layer spec, TP = 1):

| megatron                                         | Hugging Face                                        |
|--------------------------------------------------|-----------------------------------------------------|
| ``embedding.word_embeddings.weight``             | ``model.embed_tokens.weight``                       |
| ``decoder.layers.{i}.input_layernorm.weight``    | ``model.layers.{i}.input_layernorm.weight``         |
| ``...self_attention.linear_qkv.{weight,bias}``   | ``...self_attn.{q,k,v}_proj.{weight,bias}``, fused  |
|   per query group g: [q heads of g; k_g; v_g]    |   (see :func:`_merge_qkv`)                          |
| ``...self_attention.{q,k}_layernorm.weight``     | ``...self_attn.{q,k}_norm.weight``                  |
| ``...self_attention.linear_proj.{weight,bias}``  | ``...self_attn.o_proj.{weight,bias}``               |
| ``...pre_mlp_layernorm.weight``                  | ``...post_attention_layernorm.weight``              |
| ``...mlp.linear_fc1.{weight,bias}``              | ``...mlp.{gate,up}_proj``, stacked [gate; up]       |
| ``...mlp.linear_fc2.{weight,bias}``              | ``...mlp.down_proj.{weight,bias}``                  |
| ``decoder.final_layernorm.weight``               | ``model.norm.weight``                               |
| ``output_layer.weight`` (untied only)            | ``lm_head.weight`` (untied only)                    |

Conversions are reshapes and concatenations only, so ``megatron_to_hf(hf_to_megatron(w)) == w`` bit for bit.
Importing needs only ``safetensors`` (no ``transformers``); the tests compare logits with ``transformers``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import Tensor

from fp8rl.models.config import ModelConfig

HF_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
MODEL_TYPES = tuple(HF_ARCHITECTURES)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
DEFAULT_ROPE_THETA = 10_000.0  # transformers' default when a config.json gives none
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

# Fields of ModelConfig that define the computation (the rest are names, init and dropout).
ARCHITECTURE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "vocab_size",
    "kv_channels",
    "rotary_base",
    "norm_epsilon",
    "normalization",
    "qk_layernorm",
    "add_qkv_bias",
    "add_bias_linear",
    "swiglu",
    "tie_embeddings",
)


class HFConversionError(ValueError):
    """A checkpoint or config that the megatron <-> HF mapping cannot represent; the message says why."""


# --------------------------------------------------------------------------------------------------
# Configs


def model_config_from_hf(hf: Mapping[str, Any], name: str | None = None) -> ModelConfig:
    """ModelConfig for an HF ``config.json`` dict of a supported architecture; anything else raises."""
    model_type = hf.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        raise HFConversionError(f"model_type={model_type!r} is not supported; valid: {list(MODEL_TYPES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConversionError(f"hidden_act={hf['hidden_act']!r}: only SwiGLU (silu) MLPs are mapped")
    if hf.get("use_sliding_window", False):
        raise HFConversionError("use_sliding_window=true: sliding-window attention is not mapped")
    heads = hf["num_attention_heads"]
    qk_layernorm, add_qkv_bias, add_bias_linear = False, False, False
    if model_type == "qwen3":
        qk_layernorm = True
        if hf.get("attention_bias", False):
            raise HFConversionError("qwen3 with attention_bias=true (bias on o_proj but not the MLP) is not mapped")
    elif model_type == "qwen2":
        add_qkv_bias = True  # Qwen2 / Qwen2.5: q, k, v carry a bias, o_proj and the MLP do not
    else:
        attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
        if attention_bias != mlp_bias:
            raise HFConversionError(
                f"llama with attention_bias={attention_bias}, mlp_bias={mlp_bias}: megatron has one switch "
                "(add_bias_linear) for both"
            )
        add_bias_linear = attention_bias
    return ModelConfig(
        name=name or f"hf-{model_type}",
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_seq_len=hf["max_position_embeddings"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rotary_base=_rope_theta(hf),
        norm_epsilon=hf["rms_norm_eps"],
        normalization="RMSNorm",
        qk_layernorm=qk_layernorm,
        add_qkv_bias=add_qkv_bias,
        add_bias_linear=add_bias_linear,
        swiglu=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_dropout=float(hf.get("attention_dropout", 0.0) or 0.0),
        init_std=hf.get("initializer_range", 0.02),
    )


def _rope_theta(hf: Mapping[str, Any]) -> float:
    """RoPE base of a config in the transformers 5 form (``rope_parameters``) or the older one (``rope_theta``)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise HFConversionError(f"rope_type={rope_type!r}: only plain RoPE ('default') is mapped")
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFConversionError("partial_rotary_factor != 1 is not mapped")
    return float(params.get("rope_theta", hf.get("rope_theta", DEFAULT_ROPE_THETA)))


def default_model_type(cfg: ModelConfig) -> str:
    """The HF architecture that expresses ``cfg``: QK-norm -> qwen3, QKV bias only -> qwen2, else llama."""
    if cfg.qk_layernorm:
        return "qwen3"
    if cfg.add_qkv_bias and not cfg.add_bias_linear:
        return "qwen2"
    return "llama"


def hf_config_from_model_config(
    cfg: ModelConfig,
    model_type: str | None = None,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """HF ``config.json`` dict for ``cfg`` (vocab resolved); raises if ``model_type`` cannot express it."""
    if cfg.vocab_size is None:
        raise HFConversionError(f"model {cfg.name!r} has no vocab_size yet; resolve it with with_tokenizer_vocab()")
    model_type = model_type or default_model_type(cfg)
    if model_type not in HF_ARCHITECTURES:
        raise HFConversionError(f"model_type={model_type!r} is not supported; valid: {list(MODEL_TYPES)}")
    hf: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_epsilon,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base},
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": cfg.attention_dropout,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "dtype": dtype,
    }
    if model_type == "llama":
        hf["attention_bias"] = hf["mlp_bias"] = cfg.add_bias_linear
    else:
        hf["use_sliding_window"] = False
        hf["sliding_window"] = None
        if model_type == "qwen3":
            hf["attention_bias"] = False
    # The mapping is only right if reading the config back gives the same computation.
    back = model_config_from_hf(hf)
    differs = [f for f in ARCHITECTURE_FIELDS if getattr(back, f) != getattr(cfg, f)]
    if differs:
        raise HFConversionError(
            f"model_type={model_type!r} cannot express model {cfg.name!r}: it differs in {differs}"
            + ("" if model_type != "qwen2" else " (Qwen2 always has a q/k/v bias)")
        )
    return hf


# --------------------------------------------------------------------------------------------------
# The tensor mapping


@dataclass(frozen=True)
class _Rule:
    """One megatron tensor and the HF tensor(s) it is made of; ``kind`` says how: copy, qkv or fc1."""

    megatron: str
    hf: tuple[str, ...]
    kind: str = "copy"


def _mapping_rules(cfg: ModelConfig) -> list[_Rule]:
    """Every tensor of the GPTModel built from ``cfg`` with its HF counterpart(s), in model order."""
    rules = [_Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
    linear_bias = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    qkv_params = ("weight", "bias") if (cfg.add_qkv_bias or cfg.add_bias_linear) else ("weight",)
    for i in range(cfg.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        rules.append(_Rule(m + "input_layernorm.weight", (h + "input_layernorm.weight",)))
        for p in qkv_params:
            qkv = tuple(f"{h}self_attn.{x}_proj.{p}" for x in "qkv")
            rules.append(_Rule(f"{m}self_attention.linear_qkv.{p}", qkv, "qkv"))
        if cfg.qk_layernorm:
            for x in "qk":
                rules.append(_Rule(f"{m}self_attention.{x}_layernorm.weight", (f"{h}self_attn.{x}_norm.weight",)))
        for p in linear_bias:
            rules.append(_Rule(f"{m}self_attention.linear_proj.{p}", (f"{h}self_attn.o_proj.{p}",)))
        rules.append(_Rule(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",)))
        for p in linear_bias:
            rules.append(_Rule(f"{m}mlp.linear_fc1.{p}", (f"{h}mlp.gate_proj.{p}", f"{h}mlp.up_proj.{p}"), "fc1"))
            rules.append(_Rule(f"{m}mlp.linear_fc2.{p}", (f"{h}mlp.down_proj.{p}",)))
    rules.append(_Rule("decoder.final_layernorm.weight", ("model.norm.weight",)))
    if not cfg.tie_embeddings:
        rules.append(_Rule("output_layer.weight", ("lm_head.weight",)))
    return rules


def _group_shapes(cfg: ModelConfig) -> tuple[int, int, int]:
    """(query groups, rows of q per group, rows of k or v per group) of the fused QKV projection."""
    groups, head_dim = cfg.num_query_groups, cfg.kv_channels
    return groups, cfg.num_attention_heads // groups * head_dim, head_dim


def _merge_qkv(q: Tensor, k: Tensor, v: Tensor, cfg: ModelConfig) -> Tensor:
    """HF q (nq d, ...), k, v (ng d, ...) -> megatron's fused rows: for each group g, [q heads of g; k_g; v_g]."""
    groups, q_rows, kv_rows = _group_shapes(cfg)
    rest = q.shape[1:]
    parts = (q.reshape(groups, q_rows, *rest), k.reshape(groups, kv_rows, *rest), v.reshape(groups, kv_rows, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_qkv(qkv: Tensor, cfg: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`_merge_qkv`."""
    groups, q_rows, kv_rows = _group_shapes(cfg)
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, q_rows + 2 * kv_rows, *rest).split([q_rows, kv_rows, kv_rows], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _merge(rule: _Rule, parts: list[Tensor], cfg: ModelConfig) -> Tensor:
    if rule.kind == "qkv":
        return _merge_qkv(*parts, cfg)
    if rule.kind == "fc1":
        return torch.cat(parts, dim=0)  # megatron's gated MLP: act(first half) * second half
    return parts[0]


def _split(rule: _Rule, tensor: Tensor, cfg: ModelConfig) -> tuple[Tensor, ...]:
    if rule.kind == "qkv":
        return _split_qkv(tensor, cfg)
    if rule.kind == "fc1":
        return tuple(tensor.chunk(2, dim=0))
    return (tensor,)


def _checked_rules(hf_tensors: Mapping[str, Tensor], cfg: ModelConfig) -> list[_Rule]:
    """The mapping's rules, once every expected HF tensor is there and no unexpected one (a tied ``lm_head.weight``
    equal to the embedding is accepted and dropped); the names only are read, and the two tied tensors."""
    rules = _mapping_rules(cfg)
    missing = [name for rule in rules for name in rule.hf if name not in hf_tensors]
    expected = {name for rule in rules for name in rule.hf}
    unexpected = sorted(set(hf_tensors) - expected)
    if cfg.tie_embeddings and "lm_head.weight" in unexpected:
        if not torch.equal(hf_tensors["lm_head.weight"], hf_tensors["model.embed_tokens.weight"]):
            raise HFConversionError("tie_word_embeddings=true but lm_head.weight differs from the embedding")
        unexpected.remove("lm_head.weight")
    if missing or unexpected:
        raise HFConversionError(
            f"HF tensors do not match the config: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    return rules


def hf_to_megatron(hf_tensors: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF tensors -> the GPTModel's state dict (without megatron's ``_extra_state`` entries), every tensor at once.

    Every expected HF tensor must be there; an unexpected one raises (a tied ``lm_head.weight`` equal to
    the embedding is accepted and dropped). Tensors keep their dtype.
    """
    return dict(MegatronStateFromHF(hf_tensors, cfg, dtype=None))


class MegatronStateFromHF(Mapping[str, Tensor]):
    """:func:`hf_to_megatron` as a mapping whose tensors are built when asked: each from its HF parts (read then,
    from a `LazyHFTensors`), merged and cast to `dtype` (None: kept). A rank that loads its TP shard or its
    pipeline stage from it holds one full tensor at a time, not the whole model in FP32 (issue 25, item 8)."""

    def __init__(self, hf_tensors: Mapping[str, Tensor], cfg: ModelConfig, dtype: torch.dtype | None) -> None:
        self._hf, self._cfg, self._dtype = hf_tensors, cfg, dtype
        self._rules = {rule.megatron: rule for rule in _checked_rules(hf_tensors, cfg)}

    def __getitem__(self, name: str) -> Tensor:
        rule = self._rules[name]
        tensor = _merge(rule, [self._hf[part] for part in rule.hf], self._cfg)
        return tensor if self._dtype is None else tensor.to(self._dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)


def iter_hf_tensors(megatron_tensors: Mapping[str, Any], cfg: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    """(HF name, tensor) pairs of a GPTModel state dict, as views where possible (no copies: for weight pushes)."""
    for rule in _mapping_rules(cfg):
        if rule.megatron not in megatron_tensors:
            raise HFConversionError(f"megatron state dict has no {rule.megatron!r}: does it match model {cfg.name!r}?")
        yield from zip(rule.hf, _split(rule, megatron_tensors[rule.megatron], cfg), strict=True)


def megatron_to_hf(megatron_tensors: Mapping[str, Any], cfg: ModelConfig) -> dict[str, Tensor]:
    """The GPTModel's state dict -> HF tensors (independent contiguous copies); ``_extra_state`` is ignored."""
    known = {rule.megatron for rule in _mapping_rules(cfg)}
    unexpected = sorted(k for k, v in megatron_tensors.items() if isinstance(v, Tensor) and k not in known)
    if unexpected:
        raise HFConversionError(f"megatron tensors not in the mapping: {unexpected[:8]}")
    return {name: t.detach().clone().contiguous() for name, t in iter_hf_tensors(megatron_tensors, cfg)}


def hf_weights(model: torch.nn.Module, cfg: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    """(HF name, tensor) pairs of ``model``'s current weights, detached views (what a rollout engine loads)."""
    state = {k: v.detach() for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, Tensor)}
    return iter_hf_tensors(local_names(model, state), cfg)


def local_names(model: torch.nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A Transformer Engine model's state under the local spec's names (the mapping's), else as is."""
    inner = getattr(model, "module", model)
    if getattr(inner, "fp8rl_backend", None) != "te":
        return state
    from fp8rl.models.te_backend import te_to_local_state_dict

    return te_to_local_state_dict({k.removeprefix("module."): v for k, v in state.items()})


# --------------------------------------------------------------------------------------------------
# Folders


def _weight_files(directory: Path) -> list[Path]:
    """``model.safetensors``, or the shards listed in ``model.safetensors.index.json``."""
    if (directory / WEIGHTS_NAME).exists():
        return [directory / WEIGHTS_NAME]
    if (directory / INDEX_NAME).exists():
        shards = sorted(set(json.loads((directory / INDEX_NAME).read_text())["weight_map"].values()))
        return [directory / shard for shard in shards]
    raise FileNotFoundError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {directory}")


def read_hf_tensors(directory: str | Path) -> dict[str, Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``."""
    tensors: dict[str, Tensor] = {}
    for file in _weight_files(Path(directory)):
        tensors.update(safetensors.torch.load_file(str(file)))
    return tensors


class LazyHFTensors(Mapping[str, Tensor]):
    """The tensors of a HF folder's safetensors files, each read from its file when asked (``safe_open``: the
    header at construction, one tensor's bytes per lookup), so nothing is held that the caller does not keep."""

    def __init__(self, directory: str | Path) -> None:
        self._file: dict[str, str] = {}
        for file in _weight_files(Path(directory)):
            with safetensors.safe_open(str(file), framework="pt") as handle:
                self._file.update((name, str(file)) for name in handle.keys())  # noqa: SIM118 - not a dict

    def __getitem__(self, name: str) -> Tensor:
        with safetensors.safe_open(self._file[name], framework="pt") as handle:
            return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)


def megatron_state_from_hf_folder(directory: str | Path, cfg: ModelConfig) -> MegatronStateFromHF:
    """The GPTModel state of a local HF folder in FP32 master precision, read tensor by tensor when asked."""
    return MegatronStateFromHF(LazyHFTensors(directory), cfg, dtype=torch.float32)


def model_config_from_hf_folder(directory: str | Path, name: str | None = None) -> ModelConfig:
    """ModelConfig from a local HF folder's config.json (named after the folder unless `name` is given)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise HFConversionError(f"{directory} has no config.json: is it a Hugging Face checkpoint folder?")
    return model_config_from_hf(json.loads(config_path.read_text()), name=name or f"hf-{directory.name}")


def load_hf_checkpoint(directory: str | Path, name: str | None = None) -> tuple[ModelConfig, torch.nn.Module]:
    """(ModelConfig, GPTModel with fp32 master weights) from a local HF folder (config.json + safetensors)."""
    from fp8rl.models.gpt import build_gpt_model  # imports megatron-core: keep this module light to import

    directory = Path(directory)
    cfg = model_config_from_hf_folder(directory, name=name)
    state = megatron_state_from_hf_folder(directory, cfg)
    model = build_gpt_model(cfg)
    # megatron's linears add their missing ``_extra_state`` keys in a load pre-hook, so strict loading works.
    model.load_state_dict(state, strict=True)
    return cfg, model


def save_hf_checkpoint(
    model_or_state: torch.nn.Module | Mapping[str, Any],
    cfg: ModelConfig,
    directory: str | Path,
    *,
    tokenizer: Any = None,
    model_type: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write an HF folder a serving engine (vLLM) or ``transformers`` can load: config.json, model.safetensors,
    generation_config.json and the tokenizer files.

    ``tokenizer``: a :class:`fp8rl.tasks.tokenizer.CharTokenizer` (saved, its special ids go into the configs),
    a folder to copy tokenizer files from, or None (no tokenizer files). ``dtype`` is the stored precision.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = (
        local_names(model_or_state, model_or_state.state_dict())
        if isinstance(model_or_state, torch.nn.Module)
        else model_or_state
    )
    special: dict[str, int | None] = {}
    if hasattr(tokenizer, "save"):  # CharTokenizer
        tokenizer.save(directory, model_max_length=cfg.max_seq_len)
        special = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    elif tokenizer is not None:
        for file_name in TOKENIZER_FILES:
            if (Path(tokenizer) / file_name).exists():
                shutil.copy(Path(tokenizer) / file_name, directory / file_name)
    dtype_name = str(dtype).removeprefix("torch.")
    hf_config = hf_config_from_model_config(cfg, model_type, dtype=dtype_name, **special)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {k: v for k, v in special.items() if v is not None}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tensors = {k: v.to(dtype) for k, v in megatron_to_hf(state, cfg).items()}
    safetensors.torch.save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    return directory


def hf_architecture_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The fields of ``cfg`` that define its computation (for comparing an imported config with its source)."""
    return {f: getattr(cfg, f) for f in ARCHITECTURE_FIELDS}
