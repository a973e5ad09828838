"""GGUF conversion on tiny files written here: names, quant types, q/k permutation, caching.

The files are written the way llama.cpp's converter does (q/k rows permuted for the llama
arch, quantized tensors), from a random transformers checkpoint whose expected values we
know. The tokenizer step needs a real vocabulary and is covered by the SmolLM2 test, so
it is stubbed here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from paged_sim import PagedSim
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagellm.model import (
    CacheWriteError,
    CorruptModelError,
    gguf_loader,
    load_model,
    load_model_config,
    resolve_model_path,
)

HIDDEN = 256  # K-quants pack rows in blocks of 256


@pytest.fixture(autouse=True)
def no_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_loader, "_write_tokenizer", lambda source, out: None)


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to attn_q/attn_k rows (written independently of ours)."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def random_kquant(rows: int, cols: int, qtype: Q, seed: int) -> np.ndarray:
    """Valid raw bytes of a K-quant tensor (random quants, sane fp16 scales)."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, type_size), np.uint8)
    scale = np.array([0.01], dtype=np.float16).view(np.uint8)
    if qtype == Q.Q4_K:  # d, dmin at the start of each block
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    elif qtype == Q.Q6_K:  # d at the end
        raw[..., -2:] = scale
    return raw.reshape(rows, -1)


# GGUF tensor kind -> storage type in the tiny file.
TYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.Q6_K,
    "output_norm": Q.F32,
    "attn_norm": Q.F32,
    "ffn_norm": Q.F32,
    "attn_q_norm": Q.F32,
    "attn_k_norm": Q.F32,
    "attn_q": Q.Q8_0,
    "attn_k": Q.Q4_1,
    "attn_v": Q.F16,
    "attn_output": Q.Q4_0,
    "ffn_gate": Q.Q4_1,
    "ffn_up": Q.Q8_0,
    "ffn_down": Q.Q4_K,
}

HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "lm_head": "output",
    "model.norm": "output_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> tuple[str, str]:
    """(full GGUF name, tensor kind) for an HF parameter name."""
    module, _, suffix = hf_name.rpartition(".")
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        return f"blk.{layer}.{HF_TO_GGUF[rest]}.{suffix}", HF_TO_GGUF[rest]
    return f"{HF_TO_GGUF[module]}.{suffix}", HF_TO_GGUF[module]


def write_tiny_gguf(path: Path, arch: str, hf_config: Any) -> dict[str, torch.Tensor]:
    """Write a GGUF for a random checkpoint; return the HF tensors it must convert back to."""
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if cfg.rope_parameters.get("rope_type") == "llama3":  # llama.cpp keeps the divisors
        theta = float(cfg.rope_parameters["rope_theta"])
        plain = 1.0 / theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        writer.add_tensor("rope_freqs.weight", (plain / scaled).numpy().astype(np.float32))
    expected: dict[str, torch.Tensor] = {}
    for i, (name, param) in enumerate(hf_model.state_dict().items()):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        full, kind = gguf_name(name)
        weight = param.numpy() + np.random.default_rng(i).normal(0, 0.05, param.shape).astype(
            np.float32
        )
        qtype = TYPES[kind] if weight.ndim == 2 else Q.F32
        heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
        permute = arch == "llama" and kind in heads
        if qtype in (Q.Q4_K, Q.Q6_K):
            raw = random_kquant(*weight.shape, qtype, seed=i)
            dequant = gguf.quants.dequantize(raw, qtype).reshape(weight.shape)
            expected[name] = torch.from_numpy(dequant.copy())
            writer.add_tensor(full, raw, raw_dtype=qtype)
            continue
        stored = llama_cpp_permute(weight, heads[kind]) if permute else weight
        raw = gguf.quants.quantize(stored, qtype)
        # Quantization is per row, and the permutation moves whole rows: unpermuting the
        # dequantized tensor gives the dequantized original.
        expected[name] = torch.from_numpy(
            gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype)
            .reshape(weight.shape)
            .astype(np.float32)
        )
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(full, raw)
        else:
            writer.add_tensor(full, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


SMALL = dict(
    hidden_size=HIDDEN,
    intermediate_size=HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=128,
    initializer_range=0.1,
)

ARCHS = {
    "llama": lambda: LlamaConfig(**SMALL, rms_norm_eps=1e-5),
    # Llama 3.2's rope (3.1's has factor 8), which llama.cpp stores as rope_freqs only.
    "llama_rope32": lambda: LlamaConfig(**SMALL, rms_norm_eps=1e-5, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama_tied": lambda: LlamaConfig(**SMALL, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**SMALL, head_dim=32, rms_norm_eps=1e-6),
}


@pytest.mark.parametrize("variant", sorted(ARCHS))
def test_conversion_restores_hf_weights_and_logits(tmp_path: Path, variant: str) -> None:
    arch = variant.split("_")[0]
    source = tmp_path / f"tiny-{variant}.gguf"
    expected = write_tiny_gguf(source, arch, ARCHS[variant]())
    converted = resolve_model_path(source, tmp_path / "cache")
    stored = load_file(str(converted / "model.safetensors"))
    assert set(stored) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(stored[name], tensor), name
    config = load_model_config(converted)
    assert config.tie_word_embeddings == variant.endswith("tied")
    assert config.qk_norm == (arch == "qwen3")
    rope = config.rope_scaling or {}
    assert (rope.get("rope_type"), rope.get("factor")) == (
        ("llama3", 32.0) if variant == "llama_rope32" else (None, None))
    # transformers reads the converted directory too, and agrees with us on it.
    reference = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    tokens = list(range(3, 40))
    with torch.inference_mode():
        want = reference(torch.tensor([tokens])).logits[0]
    ours = PagedSim(load_model(converted), block_size=8).step([("r", tokens)])
    # Equal up to float32 rounding of another summation order (these random logits reach
    # the hundreds, so the bound is relative).
    assert (ours - want).abs().max().item() < 1e-5 * want.abs().max().item()


def test_conversion_is_cached_by_file_identity(tmp_path: Path) -> None:
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, "llama", ARCHS["llama"]())
    first = resolve_model_path(source, tmp_path / "cache")
    assert resolve_model_path(source, tmp_path / "cache") == first
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = resolve_model_path(source, tmp_path / "cache")
    assert second != first and (second / "config.json").is_file()
    # The newest other conversion of the file stays (two installs sharing a cache, whose
    # GGUF has one path and two mtimes, would otherwise convert again at every start);
    # older ones go (each is the model in float32).
    assert first.exists()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
    latest = resolve_model_path(source, tmp_path / "cache")
    assert latest not in (first, second) and second.exists() and not first.exists()
    assert resolve_model_path(source, tmp_path / "cache") == latest
    # One of another file of the same name stays.
    other = tmp_path / "elsewhere" / "tiny.gguf"
    other.parent.mkdir()
    other.write_bytes(source.read_bytes())
    third = resolve_model_path(other, tmp_path / "cache")
    assert sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir()) == sorted(
        [second.name, latest.name, third.name])
    # A link (the Hugging Face cache's snapshots are links to blobs) is named as given.
    link = tmp_path / "linked.gguf"
    link.symlink_to(other)
    linked = resolve_model_path(link, tmp_path / "cache")
    stat = other.stat()
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    relinked = resolve_model_path(link, tmp_path / "cache")
    assert relinked != linked and linked.exists()
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
    assert resolve_model_path(link, tmp_path / "cache") not in (linked, relinked)
    assert relinked.exists() and not linked.exists()


def test_failed_conversion_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, "llama", ARCHS["llama"]())

    def crash(source: Path, out: Path) -> None:
        raise RuntimeError("simulated crash while saving the tokenizer")

    def weights(*args: Any) -> None:
        raise AssertionError("weights converted before the tokenizer was read")

    monkeypatch.setattr(gguf_loader, "_write_tokenizer", crash)
    with monkeypatch.context() as patch:  # a GGUF without a tokenizer fails before them
        patch.setattr(gguf_loader, "_write_weights", weights)
        with pytest.raises(RuntimeError, match="simulated crash"):
            resolve_model_path(source, tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
    monkeypatch.setattr(gguf_loader, "_write_tokenizer", lambda source, out: None)
    assert (resolve_model_path(source, tmp_path / "cache") / "config.json").is_file()


def test_abandoned_conversion_is_cleaned_up(tmp_path: Path) -> None:
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, "llama", ARCHS["llama"]())
    target = gguf_loader.gguf_cache_dir(source, tmp_path / "cache")
    target.parent.mkdir(parents=True)
    dead_pid = 2**22 + 12345  # above the kernel's pid limit, so never alive
    abandoned = target.parent / f".tmp-{target.name}-{dead_pid}-deadbeef"
    abandoned.mkdir()
    (abandoned / "model.safetensors").write_bytes(b"half written")
    assert resolve_model_path(source, tmp_path / "cache") == target
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_under_the_lock_any_half_written_conversion_is_abandoned(tmp_path: Path) -> None:
    """Containers sharing a cache have pid namespaces of their own, so a live pid proves
    nothing (it removed a live conversion in another container, and kept a dead pid 1's
    for ever): only the converting process holds the lock, so whatever it finds
    half-written, or a conversion that lost its config.json, was left by one that died."""
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, "llama", ARCHS["llama"]())
    target = gguf_loader.gguf_cache_dir(source, tmp_path / "cache")
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"no config.json beside it")
    for pid in (1, os.getpid()):
        (target.parent / f".tmp-{target.name}-{pid}-deadbeef").mkdir()
    assert resolve_model_path(source, tmp_path / "cache") == target
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]
    assert (target / "config.json").is_file()
    modes = {f.name: f.stat().st_mode & 0o777 for f in target.rglob("*") if f.is_file()}
    assert len(set(modes.values())) == 1, modes  # safetensors' 0600 made readable alike


def test_a_second_start_waits_for_the_conversion_instead_of_repeating_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, "llama", ARCHS["llama"]())
    write = gguf_loader._write_hf_directory
    started, release, calls = threading.Event(), threading.Event(), []

    def slow_write(source: Path, out: Path) -> None:
        calls.append(out)
        started.set()
        release.wait(30)
        write(source, out)

    monkeypatch.setattr(gguf_loader, "_write_hf_directory", slow_write)
    results: list[Path] = []
    first = threading.Thread(target=lambda: results.append(
        resolve_model_path(source, tmp_path / "cache")))
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=lambda: results.append(
        resolve_model_path(source, tmp_path / "cache")))
    second.start()
    second.join(0.5)
    assert second.is_alive(), "the second start must wait for the first's conversion"
    release.set()
    first.join(30)
    second.join(30)
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]


def test_a_full_disk_is_a_clear_error_naming_the_cache(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, "llama", ARCHS["llama"]())

    def full(*args: Any) -> None:  # as safetensors reports it
        raise Exception("Error while serializing: I/O error: No space left on device "
                        "(os error 28)")

    monkeypatch.setattr(gguf_loader, "_write_weights", full)
    with pytest.raises(CacheWriteError, match="No space left.*PAGELLM_CACHE_DIR"):
        resolve_model_path(source, tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o500)
    if os.access(readonly, os.W_OK):  # root writes anyway
        pytest.skip("the test runs as root")
    with pytest.raises(CacheWriteError, match="--cache-dir"):
        resolve_model_path(source, readonly / "cache")


def test_truncated_gguf_is_a_clear_error(tmp_path: Path) -> None:
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, "llama", ARCHS["llama"]())
    data = source.read_bytes()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(data[: len(data) // 3])
    with pytest.raises(CorruptModelError, match="broken.gguf"):
        resolve_model_path(broken, tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_garbage_after_magic_is_a_clear_error(tmp_path: Path) -> None:
    broken = tmp_path / "garbage.gguf"
    broken.write_bytes(b"GGUF" + os.urandom(256))
    with pytest.raises(CorruptModelError, match="garbage.gguf"):
        resolve_model_path(broken, tmp_path / "cache")


def test_a_damaged_conversion_says_which_directory_to_delete(tmp_path: Path) -> None:
    """A converted file damaged after it was written (a bad copy, a disk that filled)
    named neither the file nor what to do about it."""
    from pagellm.engine.config import EngineConfig
    from pagellm.engine.llm_engine import LLMEngine

    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, "llama", ARCHS["llama"]())
    config = EngineConfig(model=str(source), cache_dir=tmp_path / "cache",
                          skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 20,
                          cpu_kernels=False)
    LLMEngine(config)
    converted = resolve_model_path(source, tmp_path / "cache")
    weights = converted / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CorruptModelError, match="delete that directory") as raised:
        LLMEngine(config)
    assert str(converted) in str(raised.value)


def test_a_projection_whose_shards_mix_formats_loads_with_the_kernels(tmp_path: Path) -> None:
    """q in Q8_0 and k in Q4_1 (or gate and up) have rows of different byte widths: the
    kernels' loader concatenated them before seeing the formats differ, and the model
    failed to load ("Sizes of tensors must match"); such a projection stays on float32."""
    from pagellm.cache_dir import resolve_cache_dir
    from pagellm.model import cpu_kernels

    kernels = resolve_cache_dir() / "kernels"
    if not cpu_kernels.load(kernels):
        pytest.skip("the CPU kernels cannot be built or run on this machine")
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, "llama", ARCHS["llama"]())
    converted = resolve_model_path(source, tmp_path / "cache")
    with_kernels = load_model(converted, kernel_dir=kernels)
    plain = load_model(converted)
    for (name, ours), (_, theirs) in zip(with_kernels.state_dict().items(),
                                         plain.state_dict().items(), strict=True):
        assert torch.equal(ours, theirs), name
