"""Sampling options of the offline subcommands (`generate`, `chat`)."""

from __future__ import annotations

import argparse

from pagellm.core.sampling_params import SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser, *, max_tokens: int,
                      temperature: float) -> None:
    group = parser.add_argument_group("sampling options")
    group.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                       help="tokens to generate at most (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=temperature, metavar="T",
                       help="0 for greedy decoding (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0, metavar="P",
                       help="nucleus sampling mass (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=0, metavar="K",
                       help="sample from the k most likely tokens; 0 = all (default: 0)")
    group.add_argument("--min-p", type=float, default=0.0, metavar="P",
                       help="drop tokens below min-p times the top one (default: 0)")
    group.add_argument("--repetition-penalty", type=float, default=1.0, metavar="X",
                       help="> 1 discourages repeats (default: 1)")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="stop generating at this string (repeatable)")
    group.add_argument("--sampling-seed", type=int, default=None, metavar="SEED",
                       help="seed of each request's sampling, for reproducible output")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """Raises ValueError naming the bad option (the engine's check)."""
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        stop=args.stop, seed=args.sampling_seed)
