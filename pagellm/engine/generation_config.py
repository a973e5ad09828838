"""What the model's generation config gives requests (vLLM's `generation_config`).

Model authors put their recommended sampling in generation_config.json (Qwen3:
temperature 0.6, top_p 0.95, top_k 20). A request that leaves an option unset takes
that value, as in vLLM; one that sets it keeps its own. An operator's `max_new_tokens`
(a chosen folder's, or `override_generation_config`'s) is more than a default: vLLM's
server caps every request at it, and so does this one's; the model's own is only a
default.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagellm.core.sampling_params import GENERATION_SAMPLING_KEYS, SamplingParams
from pagellm.engine.config import EngineConfig
from pagellm.model.model_config import read_generation_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationDefaults:
    """`sampling`: the values of options a request leaves unset, under SamplingParams'
    names; `max_tokens_limit`: the server's cap on every request's max_tokens, or None."""

    sampling: dict[str, Any]
    max_tokens_limit: int | None


def sampling_defaults(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling defaults a generation config sets, under SamplingParams' names (only
    the keys it sets, and not to null)."""
    return {name: generation_config[key] for key, name in GENERATION_SAMPLING_KEYS.items()
            if generation_config.get(key) is not None}


def load_generation_defaults(config: EngineConfig, model_path: Path) -> GenerationDefaults:
    """Reads and checks what `config.generation_config` names, once at start-up: a bad
    value is the model's (or the operator's) error, named with where it came from, not
    every request's."""
    source = config.generation_config
    override = config.override_generation_config or {}
    found: dict[str, Any] = {}
    origin = "override_generation_config"
    if source != "vllm":
        folder = model_path if source == "auto" else Path(source)  # checked by EngineConfig
        found = read_generation_config(folder)
        origin = str(folder / "generation_config.json")
    sampling = sampling_defaults({**found, **override})
    for key, name in GENERATION_SAMPLING_KEYS.items():
        if name not in sampling:
            continue
        try:
            SamplingParams(**{name: sampling[name]})
        except (TypeError, ValueError) as error:
            where = "override_generation_config" if key in override else origin
            raise ValueError(
                f"{where}: {key} = {sampling[name]!r} cannot be a default ({error}); "
                'generation_config="vllm" ignores the model\'s file, and '
                "override_generation_config can replace the key") from error
    limit = (sampling.get("max_tokens") if source not in ("auto", "vllm")
             else override.get("max_new_tokens"))
    if sampling:
        from_file = [key for key in GENERATION_SAMPLING_KEYS
                     if key in found and key not in override and found[key] is not None]
        sources = ([origin] if from_file else []) + (
            ["override_generation_config"] if sampling_defaults(override) else [])
        logger.warning(
            "Requests that leave these sampling options unset take them from %s: %s%s. "
            'If that is not intended, start with generation_config="vllm" '
            "(--generation-config vllm).", " and ".join(sources), sampling,
            "" if limit is None else f"; every request stops at {limit} tokens at most")
    return GenerationDefaults(sampling, limit)
