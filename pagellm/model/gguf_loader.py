"""Convert a GGUF file, once, into a Hugging Face directory that the normal loader reads.

Dequantizing a GGUF and rebuilding its tokenizer takes tens of seconds; loading a
safetensors file takes well under one. So the first start converts into
`<cache_root>/gguf/<name>-<key>/` (config.json, model*.safetensors, tokenizer files with
the chat template, generation_config.json) and every later start just loads that
directory. The key hashes the GGUF's absolute path, size and mtime plus the converter
version, so an edited or replaced file, or a change to this converter, gets a fresh
conversion. The directory is written under a temporary name and renamed into place, so a
crash mid-conversion never leaves a cache that looks complete; one process converts a
file at a time (see file_lock), so others starting meanwhile wait and load its work.

Quantized tensors are stored dequantized in float32: that is exact (their values are
`scale * q + min` products no 16-bit type holds) and the model casts on load. Q4_1 and
Q8_0 tensors are also kept as their raw blocks in `quantized/blocks.safetensors` (the
metadata names each one's format), for the matmul kernels that read them directly (see
quant_kernels).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from pagellm.model import file_lock
from pagellm.model.errors import (
    CacheWriteError,
    CorruptModelError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)
from pagellm.model.rotary import rope_inverse_frequencies

logger = logging.getLogger(__name__)

# Bump when the conversion output changes, so old caches are not reused.
CONVERTER_VERSION = 3

# Raw quantized blocks beside the float32 weights: <model dir>/QUANTIZED_DIR/BLOCKS_FILE,
# its metadata mapping each tensor name to its GGUF format.
QUANTIZED_DIR = "quantized"
BLOCKS_FILE = "blocks.safetensors"
_KEPT_FORMATS = ("Q4_1", "Q8_0")

# GGUF `general.architecture` -> (HF architecture, HF model_type, q/k stored permuted).
# llama.cpp reorders the rows of attn_q/attn_k for the "llama" arch (it rotates interleaved
# pairs, HF checkpoints rotate halves); Qwen GGUFs keep the HF order.
_GGUF_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Write a new safetensors shard once this many bytes are pending, to bound peak memory.
_SHARD_BYTES = 2 << 30

# Rope scaling Llama 3.1/3.2 ship with; llama.cpp stores only its effect (rope_freqs).
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def gguf_cache_key(gguf_path: Path) -> str:
    """Identity of a GGUF file for the cache: absolute path, size, mtime, converter version."""
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    ident = f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}\0{CONVERTER_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def gguf_cache_dir(gguf_path: Path, cache_root: Path) -> Path:
    """Where the converted HF directory for this GGUF lives (it may not exist yet)."""
    return cache_root / "gguf" / f"{gguf_path.stem}-{gguf_cache_key(gguf_path)}"


def convert_gguf(gguf_path: str | Path, cache_root: str | Path) -> Path:
    """The HF directory for `gguf_path`, converting it first if no complete cache exists."""
    source = Path(gguf_path).expanduser()
    if not source.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {source}")
    target = gguf_cache_dir(source, Path(cache_root).expanduser())
    if (target / "config.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Locks live beside gguf/, whose entries are conversions.
        with file_lock.exclusive(target.parent.parent / "locks" / f"{target.name}.lock",
                                 f"converting {source.name}") as locked:
            if not (target / "config.json").is_file():  # another process may have done it
                _convert(source, target, locked)
    except CacheWriteError:
        raise
    except OSError as error:
        raise CacheWriteError(_cannot_write(target, error)) from error
    _remove_stale_conversions(source, target)
    return target


def _convert(source: Path, target: Path, locked: bool) -> None:
    """Writes the conversion under a temporary name and renames it into place. Holding
    the lock, anything half-written that it finds was left by a process that died."""
    if locked:
        for abandoned in target.parent.glob(f".tmp-{glob.escape(target.name)}-*"):
            shutil.rmtree(abandoned, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)  # incomplete: it lost its config.json
    logger.info("converting %s into %s (once; later starts load it)", source.name, target)
    tmp = target.parent / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        try:
            _write_hf_directory(source.resolve(), tmp)
        except Exception as error:
            # safetensors reports a failed write (a full disk) as its own error type.
            if isinstance(error, OSError) or "(os error" not in str(error):
                raise
            raise CacheWriteError(_cannot_write(target, error)) from error
        # safetensors writes its files readable by their owner only; give them the mode
        # config.json got from the umask, so a cache warmed by one user (an image built
        # as root) can be read by another.
        mode = (tmp / "config.json").stat().st_mode & 0o777
        for written in tmp.rglob("*"):
            if written.is_file():
                written.chmod(mode)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Unlocked (see file_lock), another process finished first: as good.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cannot_write(target: Path, error: BaseException) -> str:
    return (f"cannot write the converted model into {target.parent}: {error} (converting "
            "takes the model's size in float32 there: give it room and write access, or "
            "choose another cache directory with PAGELLM_CACHE_DIR or --cache-dir)")


def _remove_stale_conversions(source: Path, target: Path) -> None:
    """Delete older conversions of the same file (changed since, or converted by an
    older converter): each is the model's size in float32, so replacing a GGUF a few
    times would otherwise fill the disk. The newest other one is kept: two installs that
    share a cache (containers of two images, whose GGUF has one path but two mtimes)
    would otherwise delete each other's at every start and convert again. `source` is
    the path as given: conversions are named after it (a link's name, not its target's)
    and record the file it resolves to."""
    resolved = str(source.resolve())
    others = []
    for other in target.parent.glob(f"{glob.escape(source.stem)}-*"):
        if other == target:
            continue
        try:
            config = other / "config.json"
            converted_from = json.loads(config.read_text()).get("pagellm_gguf_source")
            if converted_from == resolved:
                others.append((config.stat().st_mtime, other))
        except (OSError, ValueError, AttributeError):
            continue  # not a conversion of ours, or one being removed
    for _, stale in sorted(others, reverse=True)[1:]:
        shutil.rmtree(stale, ignore_errors=True)


def _write_hf_directory(source: Path, out: Path) -> None:
    reader = _open_reader(source)
    fields = _read_fields(reader)
    arch_name = str(fields.get("general.architecture", ""))
    if arch_name not in _GGUF_ARCHS:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch_name!r} in {source} is not supported; supported: "
            + ", ".join(sorted(_GGUF_ARCHS))
        )
    tensor_names = {t.name for t in reader.tensors}
    config = _hf_config(fields, arch_name, tensor_names, reader, source)
    # The tokenizer first: a GGUF without one fails in seconds, not after its weights.
    _write_tokenizer(source, out)
    _write_weights(reader, arch_name, config, out)
    _write_quantized_blocks(reader, arch_name, config, out)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _open_reader(source: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(source)
    except Exception as exc:  # the reader raises ValueError, struct errors, IndexError...
        raise CorruptModelError(f"cannot read GGUF file {source}: {exc}") from exc


def _read_fields(reader: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            continue  # large, and the tokenizer is rebuilt by transformers
        try:
            values[key] = field.contents()
        except Exception as exc:
            raise CorruptModelError(f"GGUF metadata field {key!r} is unreadable: {exc}") from exc
    return values


def _hf_config(
    fields: dict[str, Any], arch: str, tensor_names: set[str], reader: Any, source: Path
) -> dict[str, Any]:
    hf_arch, model_type, _ = _GGUF_ARCHS[arch]

    def need(key: str) -> Any:
        value = fields.get(f"{arch}.{key}")
        if value is None:
            raise CorruptModelError(f"GGUF {source} lacks metadata field {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    num_kv_heads = int(fields.get(f"{arch}.attention.head_count_kv", num_heads))
    head_dim = int(fields.get(f"{arch}.attention.key_length", hidden // num_heads))
    vocab = fields.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise CorruptModelError(f"GGUF {source} has neither a vocab size nor a vocabulary")
        vocab = len(tokens.data)
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": int(vocab),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(fields.get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "torch_dtype": "float32",
    }
    rope_scaling = _rope_scaling(fields, arch, head_dim, config["rope_theta"], reader)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    for ours, theirs in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if theirs in fields:
            config[ours] = int(fields[theirs])
    config["pagellm_gguf_source"] = str(source)
    return config


def _rope_scaling(
    fields: dict[str, Any], arch: str, head_dim: int, theta: float, reader: Any
) -> dict[str, Any] | None:
    """Recover HF rope_scaling from GGUF metadata (or from llama.cpp's rope_freqs tensor)."""
    kind = fields.get(f"{arch}.rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(fields[f"{arch}.rope.scaling.factor"])}
    if kind not in (None, "none"):
        raise UnsupportedArchitectureError(f"GGUF rope scaling {kind!r} is not supported")
    freq_tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freq_tensor is None:
        return None
    # llama.cpp divides each frequency by rope_freqs[i]; accept it only if it is exactly
    # the Llama 3 scheme, rather than silently running with different positions. Its
    # factor is the divisor of the longest wavelengths: 8 for Llama 3.1, 32 for 3.2.
    divisors = torch.from_numpy(np.asarray(freq_tensor.data, dtype=np.float32).copy())
    plain = rope_inverse_frequencies(head_dim, theta, None)
    if divisors.shape == plain.shape:
        rope = {**_LLAMA3_ROPE, "factor": round(float(divisors.max()), 4)}
        scaled = rope_inverse_frequencies(head_dim, theta, rope)
        if torch.allclose(plain / divisors, scaled, rtol=1e-4):
            return rope
    raise UnsupportedArchitectureError(
        "GGUF rope_freqs do not match the Llama 3 rope scaling; this rope variant is not supported"
    )


def _hf_tensor_name(name: str) -> str | None:
    """The HF checkpoint name for a GGUF tensor name; None for tensors we do not load."""
    stem, _, suffix = name.rpartition(".")
    if stem == "rope_freqs":
        return None
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise CorruptModelError(f"GGUF tensor {name!r} is not part of a supported model")


def _unpermute_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows (pair, 2) back to (2, half).

    llama.cpp stores each head's rows as interleaved (x0, x_half, x1, x_half+1, ...) so its
    kernel can rotate adjacent pairs; HF rotates the first half against the second.
    """
    rows = weight.shape[0]
    half = rows // n_heads // 2
    grouped = weight.reshape(n_heads, half, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape)


def _iter_tensors(
    reader: Any, arch: str, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    permuted = _GGUF_ARCHS[arch][2]
    for tensor in reader.tensors:
        hf_name = _hf_tensor_name(tensor.name)
        if hf_name is None:
            continue
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise CorruptModelError(
                f"cannot dequantize GGUF tensor {tensor.name!r} ({tensor.tensor_type.name}): {exc}"
            ) from exc
        expected = tuple(int(d) for d in reversed(tensor.shape))
        if tuple(array.shape) != expected:
            array = array.reshape(expected)
        if not array.flags.writeable:
            array = array.copy()  # unquantized tensors come back as views of the mmap
        weight = torch.from_numpy(np.ascontiguousarray(array))
        if weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            weight = weight.float()
        if permuted and ".self_attn.q_proj." in hf_name:
            weight = _unpermute_rows(weight, config["num_attention_heads"])
        elif permuted and ".self_attn.k_proj." in hf_name:
            weight = _unpermute_rows(weight, config["num_key_value_heads"])
        yield hf_name, weight.contiguous()


def _write_quantized_blocks(reader: Any, arch: str, config: dict[str, Any], out: Path) -> None:
    """Save the raw blocks of every Q4_1 or Q8_0 tensor (q/k rows put back in HF order,
    whole rows of blocks move with them) under its HF name; nothing when there are none."""
    permuted = _GGUF_ARCHS[arch][2]
    blocks: dict[str, torch.Tensor] = {}
    formats: dict[str, str] = {}
    for tensor in reader.tensors:
        hf_name = _hf_tensor_name(tensor.name)
        if hf_name is None or tensor.tensor_type.name not in _KEPT_FORMATS:
            continue
        rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
        raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(rows, -1))
        if permuted and ".self_attn.q_proj." in hf_name:
            raw = _unpermute_rows(raw, config["num_attention_heads"])
        elif permuted and ".self_attn.k_proj." in hf_name:
            raw = _unpermute_rows(raw, config["num_key_value_heads"])
        blocks[hf_name] = raw.contiguous()
        formats[hf_name] = tensor.tensor_type.name
    if blocks:
        (out / QUANTIZED_DIR).mkdir()
        save_file(blocks, str(out / QUANTIZED_DIR / BLOCKS_FILE), metadata=formats)


def _write_weights(reader: Any, arch: str, config: dict[str, Any], out: Path) -> None:
    """Write dequantized tensors as safetensors shards (+ an index when there are several)."""
    shards: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    for name, weight in _iter_tensors(reader, arch, config):
        pending[name] = weight
        pending_bytes += weight.numel() * weight.element_size()
        if pending_bytes >= _SHARD_BYTES:
            shards.append(_save_shard(pending, out, len(shards)))
            pending, pending_bytes = {}, 0
    if pending or not shards:
        shards.append(_save_shard(pending, out, len(shards)))
    if len(shards) == 1:
        (out / "shard-0.safetensors").rename(out / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (out / f"shard-{i}.safetensors").rename(out / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _save_shard(tensors: dict[str, torch.Tensor], out: Path, i: int) -> list[str]:
    save_file(tensors, str(out / f"shard-{i}.safetensors"), metadata={"format": "pt"})
    return list(tensors)


def _write_tokenizer(source: Path, out: Path) -> None:
    """Rebuild the tokenizer from the GGUF vocabulary (via transformers) and save it."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except Exception as exc:
        raise CorruptModelError(f"cannot build a tokenizer from GGUF {source}: {exc}") from exc
    tokenizer.save_pretrained(str(out))
