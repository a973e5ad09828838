"""How one request wants its tokens chosen and when it wants generation to stop.

Names and defaults follow vLLM's `SamplingParams` (which follow the OpenAI API), so that
client code and request bodies carry over unchanged. Every value is checked once, here,
when the request is built: a bad value must fail at `add_request` with an error that
names the field, never deep inside a batched step where it would take other requests
down with it. This module is pure bookkeeping (standard library only) so that `core/` and
the HTTP layer can validate without importing torch.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Below this temperature, dividing logits by it overflows float32 and sampling becomes
# argmax anyway; treating it as greedy keeps the result exact and deterministic.
SAMPLING_EPS = 1e-5

MAX_N = 128
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
# Bad words are tokenized when the request is added, on the engine's thread: a cap keeps
# one request from stalling every other (vLLM has none; a few dozen is the usual use).
MAX_BAD_WORDS = 1024


class SamplingType(enum.IntEnum):
    """How the sampler picks this request's tokens; rows are grouped by it per step."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.Enum):
    """What each of a request's outputs holds (vLLM's): everything so far, only what is
    new since the last output (for streaming without re-reading), or nothing until the
    final output."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _number(name: str, value: object, low: float, high: float, *,
            low_open: bool = False, high_open: bool = False) -> float:
    """Checks that `value` is a real number in the range and returns it as a float.

    bool is rejected although it is an int subclass: `temperature=True` is a client bug,
    not a request for temperature 1. NaN fails every comparison, so it is rejected too.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    x = float(value)
    above_low = x > low if low_open else x >= low
    below_high = x < high if high_open else x <= high
    if not (above_low and below_high):
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        raise ValueError(f"{name} must be in {left}{low:g}, {high:g}{right}, got {value!r}")
    return x


def _integer(name: str, value: object) -> int:
    """Checks that `value` is an int (not a bool, not a float such as 3.0)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def _strings(name: str, value: object, *, blank_ok: bool) -> list[str]:
    """Normalises `stop` or `bad_words` to a list: a bare string means one string. A stop
    string may be whitespace ("\n" is a common one); a bad word may not, since it is
    matched as a word without its leading spaces."""
    if value is None:
        return []
    if isinstance(value, str):
        items: list[object] = [value]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError(f"{name} must be a string or a list of strings, got {value!r}")
    strings: list[str] = []
    for item in items:
        if not isinstance(item, str) or not (item if blank_ok else item.strip()):
            kind = "non-empty" if blank_ok else "non-blank"
            raise ValueError(f"{name} must contain only {kind} strings, got {item!r}")
        strings.append(item)
    return strings


def _token_ids(name: str, value: object) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of integers, got {value!r}")
    ids: list[int] = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ValueError(f"{name} must contain integers >= 0, got {item!r}")
        ids.append(item)
    return ids


def _top_count(name: str, value: object) -> int | None:
    """A logprobs count: None for none, else how many alternatives, in [0, 20]."""
    if value is None:
        return None
    count = _integer(name, value)
    if not 0 <= count <= MAX_LOGPROBS:
        raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {value!r}")
    return count


def _logit_bias(value: object) -> dict[int, float] | None:
    """{token id: bias} with OpenAI's range; empty means none. Whether the ids are in the
    vocabulary is checked where the vocabulary is known (the engine, the server)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {value!r}")
    bias: dict[int, float] = {}
    for token, amount in value.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        bias[token] = _number(f"logit_bias[{token}]", amount, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return bias or None


def _bias_key(token: object) -> object:
    """A logit_bias key as `SamplingParams.from_optional` reads it: a string of digits is
    the token id it spells; anything else is left for the constructor to judge."""
    if isinstance(token, str):
        try:
            return int(token)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got "
                             f"{token!r}") from None
    return token


def clamp_logit_bias(amount: float) -> float:
    """A request's bias as vLLM's server reads it: beyond [-100, 100] it is clamped, so a
    client banning a token with -1e9 gets the ban (the constructor refuses such values)."""
    return float(min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, amount)))


def _clamped_bias(amount: object) -> object:
    """A logit_bias value as `SamplingParams.from_optional` reads it: a number is clamped;
    anything else (NaN too) is left for the constructor to judge."""
    if isinstance(amount, (int, float)) and not isinstance(amount, bool) and amount == amount:
        return clamp_logit_bias(amount)
    return amount


# SamplingParams.from_optional's fields for which None means the default.
_DEFAULTED_WHEN_NONE = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty",
                        "temperature", "top_p")


# The formats of StructuredOutputsParams, of which a request sets exactly one.
FORMAT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's request fields for a format before 0.11, and the StructuredOutputsParams field
# each one sets (the server still takes them).
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern"}
# Keys of vLLM's StructuredOutputsParams that change nothing here: its private fields
# (`_backend`, ...) and disable_fallback (which backend to fall back to).
_IGNORED_KEYS = frozenset({"disable_fallback"})


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A format the generated text must follow (vLLM's `StructuredOutputsParams`): exactly
    one of

    - json: a JSON schema (a dict, or its JSON text) the output must validate against;
    - regex: a regular expression the whole output must match;
    - choice: the output is exactly one of these strings;
    - grammar: a context-free grammar, in Lark or GBNF (llama.cpp's) syntax;
    - json_object: True for any JSON object (OpenAI's `{"type": "json_object"}`).

    JSON options: disable_any_whitespace keeps JSON compact (no whitespace between
    tokens), which also stops a small model from filling its budget with newlines;
    whitespace_pattern is a regex for the whitespace JSON may hold instead. An object
    that lists its properties allows no other unless it says so (`additionalProperties`),
    as vLLM's default backend (xgrammar, strict) reads schemas: a model left free adds
    keys until its budget runs out. disable_additional_properties, which asks vLLM's
    guidance backend for that reading, is accepted and changes nothing; vLLM's
    structural_tag is a field so that None is accepted, and refused when set. Only the shape
    is checked here; the engine
    compiles the format and refuses one that does not compile. Frozen, and its lists and
    dicts are copied, so a request's format cannot change under it.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported; the format "
                             f"must be one of {', '.join(FORMAT_KINDS)}")
        given = [name for name in FORMAT_KINDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(FORMAT_KINDS)}; got {', '.join(given) or 'none'}")
        if self.json is not None:
            if not isinstance(self.json, (str, dict)):
                raise ValueError("structured_outputs.json must be a JSON schema (a dict or "
                                 f"its JSON text), got {type(self.json).__name__}")
            if nesting(self.json) > MAX_SCHEMA_NESTING:
                raise ValueError(f"structured_outputs.json is nested more than "
                                 f"{MAX_SCHEMA_NESTING} levels deep")
            object.__setattr__(self, "json", copy.deepcopy(self.json))
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"structured_outputs.regex must be a string (\"\" matches "
                             f"only the empty answer), got {self.regex!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError("structured_outputs.grammar must be a non-empty string, "
                             f"got {self.grammar!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(item, str) for item in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 f"strings, got {self.choice!r}")
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be True (leave it unset "
                             f"for no format), got {self.json_object!r}")
        _flag("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)
        _flag("structured_outputs.disable_additional_properties",
              self.disable_additional_properties)
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("structured_outputs.whitespace_pattern must be a string, got "
                             f"{self.whitespace_pattern!r}")

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> StructuredOutputsParams:
        """From JSON-like input (a request body, a JSONL line). Null values count as unset
        and vLLM's backend keys are ignored, as a client serialising vLLM's whole
        dataclass sends them; unknown keys are errors, so a misspelt format is not
        silently dropped."""
        given = {key: value for key, value in fields.items()
                 if value is not None and not key.startswith("_") and key not in _IGNORED_KEYS}
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(given) - names)
        if unknown:
            raise ValueError(f"structured_outputs keys must be among {', '.join(sorted(names))}"
                             f"; got {unknown[0]!r}")
        return cls(**given)

    @property
    def kind(self) -> str:
        """Which format is set: one of "json", "regex", "choice", "grammar",
        "json_object"."""
        return next(name for name in FORMAT_KINDS if getattr(self, name) is not None)


def _structured_outputs(value: object) -> StructuredOutputsParams | None:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict of "
                         f"its fields, got {type(value).__name__}")
    return StructuredOutputsParams.from_dict(value)


# Deeper schemas are refused: copying and compiling one walk it recursively (a few
# hundred levels exhaust Python's stack), and no real schema comes near.
MAX_SCHEMA_NESTING = 64


def nesting(value: Any) -> int:
    """How deep dicts and lists nest in `value`, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            if depth <= MAX_SCHEMA_NESTING:
                stack.extend((child, depth + 1) for child in item)
    return deepest


# generation_config.json's keys that give defaults to requests that leave them unset
# (the ones vLLM reads), and the SamplingParams field each sets: HF's max_new_tokens is
# max_tokens.
GENERATION_SAMPLING_KEYS: dict[str, str] = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens",
}


@dataclass(init=False)
class SamplingParams:
    """Sampling and stopping options of one request, validated on construction.

    The constructor is keyword-only and hand-written rather than generated so that the
    accepted input types (`stop` as a string or a list, `top_k=-1`) can be wider than the
    stored ones: after construction `stop` is always a `list[str]`, `stop_token_ids` a
    `list[int]`, float options are floats, and a disabled `top_k` is always 0, so
    consumers never re-check shapes. Every bad value raises `ValueError` naming the field
    and its allowed range.

    - n: completions to return for the prompt, in [1, 128].
    - temperature: in [0, 100]; below 1e-5 means greedy (argmax).
    - top_p: nucleus probability mass in (0, 1]; 1 disables it.
    - top_k: keep the k most likely tokens; 0 or -1 disables it (stored as 0).
    - min_p: drop tokens whose probability is below min_p times the top one's, in [0, 1].
    - seed: makes this request's random draws reproducible, alone or in any batch. Any
      int; the sampler reduces it modulo 2**64. -1 means no seed, as in vLLM.
    - max_tokens: generated-token limit, >= 1; None means up to the context limit.
    - min_tokens: EOS and stop_token_ids are blocked until this many tokens exist.
    - stop / stop_token_ids: strings / token ids that end generation.
    - ignore_eos: keep generating past EOS (benchmarks).
    - include_stop_str_in_output: keep the matched stop string in the returned text.
    - presence_penalty, frequency_penalty: OpenAI-style, in [-2, 2], over generated tokens.
    - repetition_penalty: Hugging Face-style, in (0, 100], over prompt and generated
      tokens; > 1 discourages repeats, 1 disables it.
    - logprobs: None for none; k in [0, 20] for the sampled token's logprob plus the k
      most likely alternatives at each step.
    - skip_special_tokens: drop special tokens when detokenizing.
    - spaces_between_special_tokens: put spaces between special tokens in the text, where
      the tokenizer decodes token by token (a "slow" one); a tokenizer.json decodes them
      as written whatever it says, as in vLLM.
    - prompt_logprobs: None for none; k in [0, 20] for each prompt token's logprob (after
      the first) plus the k most likely alternatives at its position. Such a request's
      prompt is computed whole, not from the prefix cache: cached positions have no
      logits.
    - logit_bias: {token id: bias in [-100, 100]} added to those logits before anything
      else, greedy rows included (OpenAI's and vLLM's `logit_bias`); None for none.
    - detokenize: False returns token ids only, with empty text (no stop strings then).
    - truncate_prompt_tokens: keep only the prompt's last k tokens (k >= 1; -1: as many
      as fit in max_model_len beside max_tokens); None keeps it whole.
    - allowed_token_ids: only these token ids may be generated (vLLM's name); None for
      the whole vocabulary.
    - bad_words: words never to generate, as vLLM matches them: each word is tokenized
      alone and after a space, and a generated sequence may not end with either
      tokenization (the word's last token is banned where the tokens before it were just
      generated). At most 1,024 words; None for none.
    - structured_outputs: a `StructuredOutputsParams` format (JSON schema, regex, choice,
      grammar) every completion must follow, or a dict of its fields; None for free text.
    - skip_reading_prefix_cache: compute the prompt whole instead of reading its cached
      blocks (it still caches its own for others), e.g. to time a cold prefill; None
      (vLLM's default) means True with prompt_logprobs, which need every position
      computed, and False otherwise.
    - extra_args: a dict kept with the request for the caller's own code (vLLM's: no
      sampling code reads it, here or there); None for none.
    - output_kind: a `RequestOutputKind`: CUMULATIVE outputs (the default), DELTA (each
      output's text, token ids and logprobs are those new since the previous one; the
      prompt's logprobs come once, with the first) or FINAL_ONLY (only the last output).
      `LLM.generate` returns whole outputs whatever it says, as vLLM's does.
    """

    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    max_tokens: int | None
    min_tokens: int
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int | None
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    logit_bias: dict[int, float] | None
    prompt_logprobs: int | None
    detokenize: bool
    truncate_prompt_tokens: int | None
    allowed_token_ids: list[int] | None
    bad_words: list[str] | None
    structured_outputs: StructuredOutputsParams | None
    skip_reading_prefix_cache: bool | None
    extra_args: dict[str, Any] | None
    output_kind: RequestOutputKind

    def __init__(
        self,
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        max_tokens: int | None = 16,
        min_tokens: int = 0,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        include_stop_str_in_output: bool = False,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logprobs: int | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        logit_bias: dict[int, float] | None = None,
        prompt_logprobs: int | None = None,
        detokenize: bool = True,
        truncate_prompt_tokens: int | None = None,
        allowed_token_ids: Sequence[int] | None = None,
        bad_words: str | Sequence[str] | None = None,
        structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None,
        skip_reading_prefix_cache: bool | None = None,
        extra_args: dict[str, Any] | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        self.n = _integer("n", n)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {n!r}")
        self.temperature = _number("temperature", temperature, 0.0, MAX_TEMPERATURE)
        self.top_p = _number("top_p", top_p, 0.0, 1.0, low_open=True)
        self.top_k = _integer("top_k", top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {top_k!r}")
        self.top_k = max(self.top_k, 0)
        self.min_p = _number("min_p", min_p, 0.0, 1.0)
        self.seed = None if seed is None else _integer("seed", seed)
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        if max_tokens is None:
            self.max_tokens = None
        else:
            self.max_tokens = _integer("max_tokens", max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens!r}")
        self.min_tokens = _integer("min_tokens", min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {min_tokens!r}")
        self.stop = _strings("stop", stop, blank_ok=True)
        self.stop_token_ids = _token_ids("stop_token_ids", stop_token_ids)
        self.ignore_eos = _flag("ignore_eos", ignore_eos)
        self.include_stop_str_in_output = _flag(
            "include_stop_str_in_output", include_stop_str_in_output)
        self.presence_penalty = _number("presence_penalty", presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _number("frequency_penalty", frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = _number(
            "repetition_penalty", repetition_penalty, 0.0, MAX_REPETITION_PENALTY,
            low_open=True)
        self.logprobs = _top_count("logprobs", logprobs)
        self.prompt_logprobs = _top_count("prompt_logprobs", prompt_logprobs)
        self.skip_special_tokens = _flag("skip_special_tokens", skip_special_tokens)
        self.spaces_between_special_tokens = _flag("spaces_between_special_tokens",
                                                   spaces_between_special_tokens)
        self.logit_bias = _logit_bias(logit_bias)
        self.detokenize = _flag("detokenize", detokenize)
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True: they are matched in the "
                             "text (stop_token_ids work without it)")
        self.truncate_prompt_tokens = (None if truncate_prompt_tokens is None else
                                       _integer("truncate_prompt_tokens",
                                                truncate_prompt_tokens))
        if self.truncate_prompt_tokens is not None and not (
                self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1):
            raise ValueError("truncate_prompt_tokens must be >= 1, or -1 for as many as "
                             f"fit, got {truncate_prompt_tokens!r}")
        self.allowed_token_ids = (None if allowed_token_ids is None else
                                  _token_ids("allowed_token_ids", allowed_token_ids))
        if self.allowed_token_ids == []:
            raise ValueError("allowed_token_ids must not be empty: it would allow no token "
                             "(None allows every token)")
        self.bad_words = _strings("bad_words", bad_words, blank_ok=False) or None
        if self.bad_words is not None and len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words must hold at most {MAX_BAD_WORDS} words, got "
                             f"{len(self.bad_words)}")
        self.structured_outputs = _structured_outputs(structured_outputs)
        # Kept as given (None: decided by prompt_logprobs when the request is admitted),
        # so that clone() and fields set after construction keep the rule.
        self.skip_reading_prefix_cache = (None if skip_reading_prefix_cache is None else
                                          _flag("skip_reading_prefix_cache",
                                                skip_reading_prefix_cache))
        if self.prompt_logprobs is not None and self.skip_reading_prefix_cache is False:
            raise ValueError("prompt_logprobs need every prompt position computed: "
                             "skip_reading_prefix_cache cannot be False with them")
        if extra_args is not None and not isinstance(extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got "
                             f"{type(extra_args).__name__}")
        self.extra_args = None if extra_args is None else dict(extra_args)
        if not isinstance(output_kind, RequestOutputKind):
            raise ValueError("output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or "
                             f"FINAL_ONLY), got {output_kind!r}")
        self.output_kind = output_kind

    @staticmethod
    def from_optional(**fields: Any) -> SamplingParams:
        """vLLM's constructor for values read from a request that may hold None where the
        default is meant: None for n, the three penalties, temperature or top_p gives the
        field's default (those fields take no None themselves), and logit_bias keys may
        be token ids written as strings, as JSON writes a dict's keys, with biases beyond
        [-100, 100] clamped (as vLLM's server reads a request's; the constructor refuses
        them)."""
        for name in _DEFAULTED_WHEN_NONE:
            if name in fields and fields[name] is None:
                del fields[name]
        bias = fields.get("logit_bias")
        if isinstance(bias, dict):
            fields["logit_bias"] = {_bias_key(token): _clamped_bias(amount)
                                    for token, amount in bias.items()}
        return SamplingParams(**fields)

    def truncate(self, prompt_token_ids: list[int], max_model_len: int,
                 keep_start: bool = False) -> list[int]:
        """The prompt as `truncate_prompt_tokens` keeps it: its last tokens (its first with
        `keep_start`, vLLM's truncation_side "right"), at most a
        context's (a larger count is a ValueError, as in vLLM: it asks for a prompt the
        model could not take, and keeping it would ignore the setting). -1 keeps as
        many as leave room for `max_tokens` (one token when None): keeping the whole
        context would leave no room to generate, and the request would be refused. A
        `max_tokens` that leaves no room for any prompt is a ValueError (vLLM refuses it
        too), not a prompt silently cut to nothing."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return prompt_token_ids
        if keep > max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({keep}) is larger than the model's "
                             f"context ({max_model_len} tokens): keep at most that many")
        if keep == -1:
            room = self.max_tokens or 1
            if room >= max_model_len:
                raise ValueError(
                    f"truncate_prompt_tokens=-1 keeps the prompt's last tokens that leave "
                    f"room for max_tokens, but max_tokens ({room}) leaves none in the "
                    f"context of {max_model_len} tokens")
            keep = max_model_len - room
        return prompt_token_ids[:keep] if keep_start else prompt_token_ids[-keep:]

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler must look at this request's earlier tokens at all."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with some fields replaced; lists and dicts are not shared."""
        return dataclasses.replace(self, **changes)

    def for_child(self, index: int) -> SamplingParams:
        """The params of completion `index` of an n > 1 request, sampled as its own request.

        Children get consecutive seeds so that a seeded n > 1 request is reproducible
        while its completions still differ from each other.
        """
        seed = None if self.seed is None else self.seed + index
        return self.clone(n=1, seed=seed)


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search options (vLLM's `BeamSearchParams`), validated on construction.

    - beam_width: beams kept at each step, and sequences returned, in [1, 10]. Each step
      ranks the best `2 * beam_width` continuations (one more `beam_width` per EOS token
      beyond the first), which the engine reads as logprobs, at most 20 of them: a model
      with three EOS tokens takes a width of 5 at most (unless ignore_eos).
    - max_tokens: generated-token limit, >= 1 (cut to what the context leaves).
    - ignore_eos: EOS does not end a beam.
    - temperature: 0 only; the search is deterministic (beam sampling is not
      implemented), and the field exists so that vLLM code constructs unchanged.
    - length_penalty: a finished beam scores its cumulative logprob divided by its length
      (EOS included) to this power, as transformers scores it: > 0 favours longer
      sequences, < 0 shorter ones.
    - include_stop_str_in_output: keep the text of the EOS that ended a beam.
    - skip_special_tokens: drop special tokens when detokenizing.
    - logprobs: alternatives kept with each generated token's logprob, at most the
      continuations a step ranks; None keeps them all (vLLM's output). Not vLLM's field:
      the server sets it from a request's `logprobs`.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None

    def __post_init__(self) -> None:
        width = _integer("beam_width", self.beam_width)
        if not 1 <= width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be in [1, {MAX_LOGPROBS // 2}], got {width!r}")
        if _integer("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        _flag("ignore_eos", self.ignore_eos)
        temperature = _number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        object.__setattr__(self, "temperature", temperature)
        if temperature >= SAMPLING_EPS:
            raise ValueError(f"temperature must be 0 for beam search (it is deterministic; "
                             f"beam sampling is not implemented), got {self.temperature!r}")
        object.__setattr__(self, "length_penalty", _number(
            "length_penalty", self.length_penalty, -math.inf, math.inf, low_open=True,
            high_open=True))
        _flag("include_stop_str_in_output", self.include_stop_str_in_output)
        _flag("skip_special_tokens", self.skip_special_tokens)
        _top_count("logprobs", self.logprobs)

    def candidates(self, num_eos_tokens: int) -> int:
        """Continuations a step ranks: transformers' `max(2, 1 + #EOS) * num_beams`, so
        that after the finished ones leave, `beam_width` still remain to run on."""
        stops = 0 if self.ignore_eos else num_eos_tokens
        return max(2, 1 + stops) * self.beam_width
