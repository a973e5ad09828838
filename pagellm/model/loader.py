"""Load a model and its tokenizer from a Hugging Face directory (safetensors weights).

The model is allocated directly in the target dtype and device with uninitialised weights
(see layers.Linear), so start-up never runs random initialisation or holds a float32
copy of a bf16 model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pagellm.model import cpu_kernels, quant_kernels
from pagellm.model.errors import CorruptModelError, ModelNotFoundError
from pagellm.model.gguf_loader import BLOCKS_FILE, QUANTIZED_DIR
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.model_config import ModelConfig, load_model_config
from pagellm.model.registry import get_model_class

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig | None = None) -> torch.dtype:
    """A torch dtype from a name; "auto" means the checkpoint's dtype (float32 if unknown)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        saved = config.checkpoint_dtype if config is not None else None
        return _DTYPES.get(saved or "float32", torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(
            f"dtype {dtype!r} is not supported; use auto, float32, bfloat16 or float16"
        )
    return _DTYPES[dtype]


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters in `dtype` (torch has a device context manager but no dtype one)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of an HF directory, as transformers picks them:
    `model.safetensors`, else the files its index lists; other files beside them (a
    LoRA adapter's `adapter_model.safetensors`, Mistral's `consolidated.safetensors`) are
    not the checkpoint. A directory with neither takes all of its *.safetensors."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CorruptModelError(f"cannot parse {index}: {exc}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelNotFoundError(f"{index} lists missing files: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weight files in {path}")
    return files


def iter_safetensors(
    files: list[Path], device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from each file, naming the file when one is unreadable."""
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types and OSError
            raise CorruptModelError(f"cannot read weight file {file}: {exc}") from exc


def iter_quantized_blocks(file: Path) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yield (name, GGUF format, raw blocks) from a converted model's blocks file, for
    the formats the kernels read."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            formats = handle.metadata() or {}
            for name in handle.keys():
                if formats.get(name) in quant_kernels.FORMATS:
                    yield name, formats[name], handle.get_tensor(name)
    except Exception as exc:  # safetensors raises its own error types and OSError
        raise CorruptModelError(f"cannot read weight file {file}: {exc}") from exc


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attention_backend: str | None = None,
    kernel_dir: Path | None = None,
    quantize_activations: bool = False,
) -> LlamaForCausalLM:
    """Build the model of an HF directory and load its weights, ready for inference.

    With `kernel_dir` (where compiled kernels are kept), a float32 CPU model runs decode
    attention through the compiled paged kernel and, when its directory has raw quantized
    blocks (a converted GGUF), its matmuls on them (see cpu_kernels,
    quant_kernels); None keeps everything on torch ops and float32 weights.
    `quantize_activations` puts the blocks on the int8-activation kernel (see
    EngineConfig.quantize_activations); ValueError where that cannot run: the reason named.
    """
    directory = Path(path)
    config = load_model_config(directory)
    torch_dtype = resolve_dtype(dtype, config)
    target = torch.device(device)
    files = safetensors_files(directory)
    model_cls = get_model_class(config.architecture)
    with torch.device(target), _default_dtype(torch_dtype):
        model = model_cls(config, attention_backend=attention_backend)
    # Tensors are read on the target device, so on CUDA they go file -> GPU once; see
    # load_weights for which are adopted as they are and which are copied (fused, cast).
    model.load_weights(iter_safetensors(files, target if target.type == "cuda" else "cpu"))
    model.requires_grad_(False)
    blocks_file = directory / QUANTIZED_DIR / BLOCKS_FILE
    if (kernel_dir is not None and target.type == "cpu" and torch_dtype == torch.float32
            and cpu_kernels.load(kernel_dir)):
        model.use_cpu_kernels()
        if blocks_file.is_file():
            model.attach_quantized(iter_quantized_blocks(blocks_file), quantize_activations)
    if quantize_activations and not model.int8_activation_weights():
        raise ValueError(
            "quantize_activations needs Q4_1 or Q8_0 weights on the CPU kernels: "
            + ("the CPU kernels are off or could not be built here (see the log)"
               if not cpu_kernels.loaded() or kernel_dir is None
               else f"{directory} has no Q4_1 or Q8_0 blocks (a GGUF of either has them)"))
    model.pack_weights()
    return model.eval()


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of an HF directory (a transformers fast tokenizer, chat template incl.).

    When the directory's tokenizer is the generic tokenizer.json one (always the case for a
    converted GGUF), it is loaded directly as `PreTrainedTokenizerFast`: AutoTokenizer's
    class resolution costs about a second more at start-up (measured 0.8 s vs 1.9 s incl.
    imports for SmolLM2). Directories that name a specific tokenizer class, or ship only a
    sentencepiece model, go through AutoTokenizer so that class's behaviour is kept.
    Either way it cuts text from the left when asked to truncate, as vLLM's does for a
    generation model (a prompt keeps its end, next to the answer).
    """
    directory = Path(path)
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelNotFoundError(
            f"no tokenizer in model directory {directory} (looked for {', '.join(_TOKENIZER_FILES)})"
        )
    try:
        if _generic_fast_tokenizer(directory):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(directory), truncation_side="left")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory), truncation_side="left")
    except Exception as exc:
        raise CorruptModelError(f"cannot load the tokenizer in {directory}: {exc}") from exc


_GENERIC_TOKENIZER_CLASSES = {None, "PreTrainedTokenizerFast", "TokenizersBackend"}


def _generic_fast_tokenizer(directory: Path) -> bool:
    if not (directory / "tokenizer.json").is_file():
        return False
    config_file = directory / "tokenizer_config.json"
    if not config_file.is_file():
        return True
    try:
        tokenizer_class = json.loads(config_file.read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError) as exc:
        raise CorruptModelError(f"cannot parse {config_file}: {exc}") from exc
    return tokenizer_class in _GENERIC_TOKENIZER_CLASSES
