"""Structured output: the tokens a request may generate next under its format.

A request's `StructuredOutputsParams` (JSON schema, regex, choice, grammar) is compiled
by llguidance (the library behind vLLM's "guidance" backend) into a matcher that follows
the request's tokens; before each sample the matcher says which tokens keep the text on
the format, as a bitmask over the vocabulary, and the sampler sets every other logit to
-inf. When the format is complete only EOS is allowed, so the request stops with
finish_reason "stop". Nothing here touches the KV cache: a constrained request shares
and caches its prompt's blocks like any other.

The token table llguidance needs is built from the tokenizer on the first constrained
request (about 0.3 s for a 49k vocabulary), not at start-up, so engines that never see
one do not pay for it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import torch

from pagellm.core.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

logger = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)


@dataclass
class Grammar:
    """A compiled format, ready to start matchers (one per completion of a request)."""

    spec: str
    tokenizer: llguidance.LLTokenizer

    def matcher(self) -> FormatMatcher:
        return FormatMatcher(llguidance.LLMatcher(self.tokenizer, self.spec, log_level=0))


class FormatMatcher:
    """Follows one completion's tokens through its format."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        self._warned = False

    def fill_mask(self, words: torch.Tensor) -> None:
        """Writes the allowed next tokens into `words`, one int32 row of 32-token words.
        A stopped matcher (format complete) allows only EOS; so does one in an error
        state, which ends the completion rather than letting it leave the format."""
        assert words.dtype == torch.int32 and words.is_contiguous()
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(),
                                              words.numel() * words.element_size())
        self._check()

    def accept(self, token_id: int) -> None:
        """Advances past a generated token. After the format is complete the only token
        left is EOS, which `ignore_eos` may keep generating; those are not the format's."""
        if not self._matcher.is_stopped():
            self._matcher.consume_token(token_id)
            self._check()

    def _check(self) -> None:
        if self._matcher.is_error() and not self._warned:
            self._warned = True
            logger.warning("structured output stopped following its format: %s",
                           self._matcher.get_error())


class GrammarCompiler:
    """Compiles requests' formats against one tokenizer; bad formats raise ValueError."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=max(self._vocab_size, len(self._hf_tokenizer)),
                    eos_token=self._eos_token_ids)
            except ValueError as error:
                raise ValueError(f"structured_outputs needs a fast (Rust) tokenizer: {error}"
                                 ) from error
        return self._tokenizer

    @property
    def mask_words(self) -> int:
        """int32 words of one row of the bitmask."""
        return (self.tokenizer.vocab_size + 31) // 32

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        spec = _grammar_spec(params)
        error = llguidance.LLMatcher.validate_grammar(spec, self.tokenizer)
        if error:
            raise ValueError(f"structured_outputs.{params.kind} is not a valid "
                             f"{_KIND_NAMES[params.kind]}: {error.strip()}")
        return Grammar(spec, self.tokenizer)


_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object format",
    "regex": "regular expression",
    "choice": "list of choices",
    "grammar": "grammar (Lark or GBNF)",
}


def _grammar_spec(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for the format (ValueError if it cannot be read)."""
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else {"type": "object"}
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be a JSON object")
            options: JsonCompileOptions = {
                "whitespace_flexible": not params.disable_any_whitespace}
            if params.whitespace_pattern is not None:
                options["whitespace_pattern"] = params.whitespace_pattern
            spec: str = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            return spec
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(params.choice))
        if kind == "regex":
            assert params.regex is not None
            # \d means an ASCII digit, as most users mean it (in Rust's and Python's
            # Unicode semantics it also takes digits such as U+1FBF8, which small models
            # do produce under the constraint).
            return llguidance.LLMatcher.grammar_from_lark(
                f"start: /{llguidance.regex_to_lark(params.regex, 'd')}/")
        assert params.grammar is not None
        return llguidance.grammar_from("grammar", params.grammar)
    except (ValueError, TypeError) as error:
        raise ValueError(f"structured_outputs.{kind} is not a valid {_KIND_NAMES[kind]}: "
                         f"{error}") from error


def allowed_tokens(matchers: list[FormatMatcher], words: int, vocab_size: int) -> torch.Tensor:
    """[len(matchers), vocab_size] bool: which tokens each matcher allows next."""
    packed = torch.empty((len(matchers), words), dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        matcher.fill_mask(packed[row])
    bits = (packed.unsqueeze(-1) >> _BITS) & 1
    return bits.view(len(matchers), -1)[:, :vocab_size].bool()
