"""The model's shape and hyper-parameters, read once from a Hugging Face config.json.

Every architecture quirk (Qwen2's always-on q/k/v bias, Qwen3's per-head q/k norm, Mistral's
sliding window) is resolved here into plain fields, so the model code reads flags instead of
branching on architecture names. Both the old (`rope_theta` + `rope_scaling`) and the
transformers-5 (`rope_parameters`) spellings of RoPE settings are accepted, because real
checkpoints on disk use either.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagellm.model.errors import CorruptModelError, ModelNotFoundError, UnsupportedArchitectureError


@dataclass(frozen=True)
class _ArchTraits:
    """What an architecture fixes that its config.json does not spell out."""

    qkv_bias: bool | None  # None: read `attention_bias` from the config
    o_proj_bias: bool | None  # None: same as `attention_bias`
    qk_norm: bool
    mlp_bias_from_config: bool
    all_layers_slide: bool  # a set `sliding_window` applies to every layer (Mistral)


_ARCH_TRAITS: dict[str, _ArchTraits] = {
    "LlamaForCausalLM": _ArchTraits(None, None, False, True, False),
    "MistralForCausalLM": _ArchTraits(False, False, False, False, True),
    "Qwen2ForCausalLM": _ArchTraits(True, False, False, False, False),
    "Qwen3ForCausalLM": _ArchTraits(None, None, True, False, False),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ARCH_TRAITS)

# Rope variants whose only effect is on the inverse frequencies (attention scaling 1.0),
# each with the parameters it needs besides its type and theta (all positive numbers).
_ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}
SUPPORTED_ROPE_TYPES: tuple[str, ...] = tuple(_ROPE_KEYS)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code and the KV cache allocation need to know.

    `rope_scaling` is None for plain RoPE, else a dict with at least `rope_type`.
    `layer_types[i]` is "full_attention" or "sliding_attention"; a sliding layer sees only the
    last `sliding_window` keys (query position - key position < sliding_window).
    `eos_token_ids` merges config.json and generation_config.json, since instruct models often
    list their end-of-turn token only in the latter.
    """

    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    layer_types: tuple[str, ...]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # The context the engine serves, set once it has sized its KV pool (None as read from
    # disk: the model's own is max_position_embeddings). vLLM's ModelConfig holds it, and
    # code written for vLLM reads `llm.llm_engine.model_config.max_model_len`.
    max_model_len: int | None = None

    def get_vocab_size(self) -> int:
        """vLLM's accessor, for code written for it."""
        return self.vocab_size

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The key window of one layer (None: attends to the whole context)."""
        if self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        """Shape of one layer's KV tensor: [2 (K, V), num_blocks, block_size, kv_heads, head_dim]."""
        return (2, num_blocks, block_size, self.num_key_value_heads, self.head_dim)

    def kv_cache_bytes_per_token(self, element_size: int) -> int:
        """Bytes one token's keys and values cost across all layers, for sizing the pool
        from a memory budget (times the block size for a block)."""
        per_layer = 2 * self.num_key_value_heads * self.head_dim * element_size
        return per_layer * self.num_hidden_layers

    @classmethod
    def from_dict(
        cls, raw: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None
    ) -> ModelConfig:
        """Build from the parsed config.json (and generation_config.json if there is one)."""
        architecture = _architecture(raw)
        _refuse_quantized(raw)
        traits = _ARCH_TRAITS[architecture]
        hidden_size = _require_int(raw, "hidden_size")
        num_heads = _require_int(raw, "num_attention_heads")
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
        num_layers = _require_int(raw, "num_hidden_layers")
        if num_heads % num_kv_heads:
            raise CorruptModelError(
                f"config.json: num_attention_heads ({num_heads}) is not a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise UnsupportedArchitectureError(
                f"config.json: hidden_act {hidden_act!r} is not supported (only 'silu')"
            )
        rope_theta, rope_scaling = _rope(raw)
        attention_bias = bool(raw.get("attention_bias", False))
        qkv_bias = attention_bias if traits.qkv_bias is None else traits.qkv_bias
        o_bias = attention_bias if traits.o_proj_bias is None else traits.o_proj_bias
        sliding_window, layer_types = _sliding(raw, traits, num_layers)
        eos = _token_ids(raw.get("eos_token_id"))
        bos = _token_ids(raw.get("bos_token_id"))
        if generation_config:
            eos += tuple(
                t for t in _token_ids(generation_config.get("eos_token_id")) if t not in eos
            )
            bos = bos or _token_ids(generation_config.get("bos_token_id"))
        dtype = raw.get("dtype") or raw.get("torch_dtype")
        return cls(
            architecture=architecture,
            model_type=str(raw.get("model_type", "")),
            hidden_size=hidden_size,
            intermediate_size=_require_int(raw, "intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=_require_int(raw, "vocab_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) if traits.mlp_bias_from_config else False,
            qk_norm=traits.qk_norm,
            sliding_window=sliding_window,
            layer_types=layer_types,
            bos_token_id=bos[0] if bos else None,
            eos_token_ids=eos,
            checkpoint_dtype=str(dtype) if dtype else None,
            extra=dict(raw),
        )


def read_generation_config(directory: str | Path) -> dict[str, Any]:
    """`directory/generation_config.json` parsed, or {} where there is none."""
    path = Path(directory) / "generation_config.json"
    return _read_json(path) if path.is_file() else {}


def load_model_config(path: str | Path) -> ModelConfig:
    """Read `path/config.json` (and `generation_config.json` beside it, if present)."""
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"no config.json in model directory {directory}")
    raw = _read_json(config_file)
    return ModelConfig.from_dict(raw, read_generation_config(directory))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptModelError(f"cannot parse {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise CorruptModelError(f"{path} does not hold a JSON object")
    return data


def _architecture(raw: Mapping[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not archs:
        raise UnsupportedArchitectureError(
            "config.json names no 'architectures'; supported: " + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    arch = str(archs[0])
    if arch not in _ARCH_TRAITS:
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} is not supported; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    return arch


def _refuse_quantized(raw: Mapping[str, Any]) -> None:
    """A checkpoint quantized for vLLM's or transformers' kernels (GPTQ, AWQ, FP8, ...)
    holds tensors no layer here has a place for: refused by its method, not later as a
    checkpoint tensor that looks corrupt."""
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise UnsupportedArchitectureError(
            f"config.json: quantization_config (quant_method {method!r}) is not supported: "
            "load the unquantized checkpoint (float32, bfloat16 or float16 safetensors) or "
            "a GGUF file (Q4_1, Q8_0, F16 or F32 weights)")


def _require_int(raw: Mapping[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CorruptModelError(f"config.json: {key!r} must be a positive integer, got {value!r}")
    return value


def _rope(raw: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"config.json: rope type {rope_type!r} is not supported; supported: "
            + ", ".join(SUPPORTED_ROPE_TYPES)
        )
    if rope_type == "default":
        return theta, None
    for key in _ROPE_KEYS[rope_type]:
        value = params.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise CorruptModelError(
                f"config.json: rope type {rope_type!r} needs {key!r}, a positive number "
                f"(in rope_scaling or rope_parameters), got {value!r}")
    return theta, {"rope_type": rope_type, **params}


def _sliding(
    raw: Mapping[str, Any], traits: _ArchTraits, num_layers: int
) -> tuple[int | None, tuple[str, ...]]:
    window = raw.get("sliding_window")
    if raw.get("use_sliding_window") is False:
        window = None
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise CorruptModelError(
                f"config.json: layer_types has {len(layer_types)} entries for {num_layers} layers"
            )
        types = tuple(str(t) for t in layer_types)
    elif window is not None and traits.all_layers_slide:
        types = ("sliding_attention",) * num_layers
    elif window is not None and raw.get("use_sliding_window"):
        first = int(raw.get("max_window_layers", num_layers))
        types = tuple(
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        )
    else:
        types = ("full_attention",) * num_layers
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise UnsupportedArchitectureError(
            f"config.json: unsupported layer types {sorted(unknown)}"
        )
    if "sliding_attention" in types and window is None:
        raise CorruptModelError("config.json: sliding layers without a sliding_window")
    return (int(window) if window is not None else None), types


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
