"""Sampling options of the offline subcommands (`generate`, `chat`).

An option left unset takes the model's recommended value where its generation config
has one (see EngineConfig's `generation_config`), else the subcommand's own default, so
`pagellm chat` samples as `LLM.chat` and the server do.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from pagellm.core.sampling_params import SamplingParams

# The options that fall back to the model's defaults; the subcommand gives its own
# fallbacks for max_tokens and temperature, SamplingParams' the others'.
_FALLING_BACK = ("top_p", "top_k", "min_p", "repetition_penalty")


def add_sampling_args(parser: argparse.ArgumentParser, *, max_tokens: int,
                      temperature: float) -> None:
    neutral = SamplingParams()
    parser.set_defaults(sampling_fallbacks={
        **{name: getattr(neutral, name) for name in _FALLING_BACK},
        "max_tokens": max_tokens, "temperature": temperature})
    group = parser.add_argument_group(
        "sampling options (unset: the model's generation config, else the default shown)")
    group.add_argument("--max-tokens", type=int, metavar="N",
                       help=f"tokens to generate at most (default: {max_tokens})")
    group.add_argument("--temperature", type=float, metavar="T",
                       help=f"0 for greedy decoding (default: {temperature})")
    group.add_argument("--top-p", type=float, metavar="P",
                       help="nucleus sampling mass (default: 1)")
    group.add_argument("--top-k", type=int, metavar="K",
                       help="sample from the k most likely tokens; 0 = all (default: 0)")
    group.add_argument("--min-p", type=float, metavar="P",
                       help="drop tokens below min-p times the top one (default: 0)")
    group.add_argument("--repetition-penalty", type=float, metavar="X",
                       help="> 1 discourages repeats (default: 1)")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="stop generating at this string (repeatable)")
    group.add_argument("--sampling-seed", type=int, default=None, metavar="SEED",
                       help="seed of each request's sampling, for reproducible output")


def sampling_params_from_args(args: argparse.Namespace,
                              model_defaults: Mapping[str, Any] | None = None
                              ) -> SamplingParams:
    """The options given, over `model_defaults` (the engine's generation defaults), over
    the subcommand's own. Raises ValueError naming the bad option (the engine's check)."""
    given = {name: getattr(args, name) for name in args.sampling_fallbacks
             if getattr(args, name) is not None}
    return SamplingParams(**{**args.sampling_fallbacks, **(model_defaults or {}), **given},
                          stop=args.stop, seed=args.sampling_seed)
