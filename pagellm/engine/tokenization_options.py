"""vLLM's `tokenization_kwargs` for `LLM.generate` and `LLM.chat`.

vLLM 0.32 moved prompt truncation out of `SamplingParams` into these keyword arguments
(`{"truncate_prompt_tokens": k}`, or the tokenizer's own `truncation` / `max_length`), so
code written for it passes them here. Those that apply to a text model's prompt are
honoured; any other is refused by name, never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagellm.core.sampling_params import BeamSearchParams, SamplingParams
from pagellm.engine.llm_engine import LLMEngine, PromptInput

_KEYS = ("add_special_tokens", "max_length", "truncate_prompt_tokens", "truncation",
         "truncation_side")
_TRUNCATION = (None, True, False)  # compared by identity: 1 and 0 are not booleans here


@dataclass(frozen=True)
class TokenizationOptions:
    """How prompts are tokenized and cut: `truncate_prompt_tokens` as in SamplingParams
    (None keeps the prompt whole), from the prompt's start (keeping its end, the default)
    or, with `keep_start`, from its end; `add_special_tokens` for text prompts."""

    truncate_prompt_tokens: int | None
    add_special_tokens: bool
    keep_start: bool = False

    def params(self, params: SamplingParams) -> SamplingParams:
        """`params` with this truncation (a different one set in both is refused)."""
        keep = self.truncate_prompt_tokens
        if keep is None or params.truncate_prompt_tokens == keep:
            return params
        if params.truncate_prompt_tokens is not None:
            raise ValueError(f"tokenization_kwargs cut the prompt to {keep} tokens but "
                             f"SamplingParams.truncate_prompt_tokens is "
                             f"{params.truncate_prompt_tokens}: give one")
        return params.clone(truncate_prompt_tokens=keep)

    def request(self, prompt: PromptInput, params: SamplingParams | BeamSearchParams,
                engine: LLMEngine) -> tuple[PromptInput, SamplingParams | BeamSearchParams]:
        """What a request is added with. The engine cuts a prompt from its start; one cut
        from its end (`truncation_side` "right") is cut here, as the server cuts it."""
        if not self.add_special_tokens:
            prompt = _tokenized(prompt, engine)
        if (not self.keep_start or not isinstance(params, SamplingParams)
                or params.truncate_prompt_tokens is None):
            return prompt, params
        _, token_ids = engine.tokenize_prompt(prompt)
        others = ({key: value for key, value in prompt.items()
                   if key not in ("prompt", "prompt_token_ids")}
                  if isinstance(prompt, Mapping) else {})
        kept = params.truncate(token_ids, engine.max_model_len, keep_start=True)
        return {**others, "prompt_token_ids": kept}, params.clone(truncate_prompt_tokens=None)


def _tokenized(prompt: PromptInput, engine: LLMEngine) -> PromptInput:
    """A text prompt's token ids without the tokenizer's special tokens (the engine adds
    them to text), kept beside its text and its other keys; token ids stay as they are."""
    if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
        return prompt
    text, token_ids = engine.tokenize_prompt(prompt, add_special_tokens=False)
    if text is None:
        return prompt
    others = dict(prompt) if isinstance(prompt, Mapping) else {}
    return {**others, "prompt": text, "prompt_token_ids": token_ids}


def tokenization_options(kwargs: Mapping[str, Any] | None,
                         add_special_tokens: bool) -> TokenizationOptions:
    """Reads vLLM's `tokenization_kwargs`; `add_special_tokens` is the caller's default
    (True for text prompts, False for a rendered chat, whose template writes its own)."""
    if kwargs is None:
        return TokenizationOptions(None, add_special_tokens)
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"tokenization_kwargs must be a dict, got {type(kwargs).__name__}")
    unknown = sorted(set(kwargs) - set(_KEYS))
    if unknown:
        raise ValueError(f"tokenization_kwargs {unknown} are not supported (it takes "
                         f"{', '.join(_KEYS)})")
    keep = kwargs.get("truncate_prompt_tokens")
    truncation = kwargs.get("truncation")
    max_length = kwargs.get("max_length")
    if not any(truncation is value for value in _TRUNCATION) and truncation not in (
            "longest_first", "do_not_truncate"):
        raise ValueError(f"tokenization_kwargs truncation must be True, False, "
                         f"'longest_first' or 'do_not_truncate', got {truncation!r}")
    if truncation is True or truncation == "longest_first":
        # The tokenizer's spelling: cut to max_length, else to what fits (vLLM's -1).
        if max_length is not None and keep is not None and keep != max_length:
            raise ValueError(f"tokenization_kwargs cut the prompt to max_length={max_length} "
                             f"and to truncate_prompt_tokens={keep}: give one")
        keep = max_length if max_length is not None else -1 if keep is None else keep
    elif max_length is not None:
        raise ValueError("tokenization_kwargs max_length cuts a prompt only with "
                         "truncation=True")
    elif truncation is not None and keep is not None:
        raise ValueError(f"tokenization_kwargs truncation={truncation!r} says not to cut "
                         f"the prompt, but truncate_prompt_tokens is {keep}: give one")
    side = kwargs.get("truncation_side", "left")
    if side not in ("left", "right"):
        raise ValueError(f"tokenization_kwargs truncation_side must be 'left' (keep the "
                         f"prompt's end, the default) or 'right' (keep its start), got "
                         f"{side!r}")
    special = kwargs.get("add_special_tokens", add_special_tokens)
    if not isinstance(special, bool):
        raise ValueError(f"tokenization_kwargs add_special_tokens must be a bool, got "
                         f"{special!r}")
    if keep is not None:  # checked as SamplingParams checks its own
        SamplingParams(truncate_prompt_tokens=keep)
    return TokenizationOptions(keep, special, keep_start=side == "right")
