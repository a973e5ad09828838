"""Structured output: the tokens a request may generate next under its format.

A request's `StructuredOutputsParams` (JSON schema, regex, choice, grammar) is compiled
by llguidance (the library behind vLLM's "guidance" backend) into a matcher that follows
the request's tokens; before each sample the matcher says which tokens keep the text on
the format, as a bitmask over the vocabulary, and the sampler sets every other logit to
-inf. When the format is complete only EOS is allowed, so the request stops with
finish_reason "stop". Nothing here touches the KV cache: a constrained request shares
and caches its prompt's blocks like any other.

The token table llguidance needs is built on the first formatted request (about 0.3 s
for a 49k vocabulary), not at start-up, so engines that never see one do not pay for it.
A format is compiled once (and kept for the next requests with the same one, as a batch
of prompts or a chat service's fixed schema repeat it); each completion gets a copy of
the compiled matcher. Compiling may run on any thread: the server compiles a request's
format on a thread of its own before adding the request, since a large grammar can take
a second, which on the engine's thread would stall every stream (see AsyncLLMEngine);
masks and copies stay on the engine's thread.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import urllib.parse
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from pagellm.core.sampling_params import (
    MAX_SCHEMA_NESTING,
    StructuredOutputsParams,
    nesting,
)

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

logger = logging.getLogger(__name__)

# Compiled formats kept for reuse; each holds the grammar's lexer and parser tables.
_CACHED_FORMATS = 64
# Characters of llguidance's error kept in the request's error and the log.
_MAX_REASON = 500
# llguidance's parser gives up on a row of more than 2,000 items by default, which an
# object of ~500 optional properties or an enum of 2,000 objects reaches after its first
# token (the request then fails mid-answer). Rows ten times that long are allowed; the
# work of one token stays bounded by llguidance's own per-step item cap.
_LIMITS = llguidance.LLParserLimits(max_items_in_row=20_000)

_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object format",
    "regex": "regular expression",
    "choice": "list of choices",
    "grammar": "grammar (Lark or GBNF)",
}


class FormatMatcher:
    """Follows one completion's tokens through its format."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_mask(self, words: np.ndarray) -> None:
        """Writes the allowed next tokens into `words`, one int32 row of 32-token words.
        A stopped matcher (format complete) allows only EOS."""
        assert words.dtype == np.int32 and words.flags["C_CONTIGUOUS"]
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def accept(self, token_id: int) -> None:
        """Advances past a generated token. Once the format is complete only EOS is left,
        which `ignore_eos` or `min_tokens` may keep generating: those are past the format,
        not in it."""
        if not self._matcher.is_stopped():
            self._matcher.consume_token(token_id)

    @property
    def error(self) -> str | None:
        """Why the matcher can no longer follow the format (a parser limit, a token it
        did not allow), or None. An error is final: the completion must end."""
        if not self._matcher.is_error():
            return None
        reason = self._matcher.get_error() or "the matcher failed"
        # llguidance may quote the whole grammar (28 KB for 2,000 choices).
        return reason if len(reason) <= _MAX_REASON else reason[:_MAX_REASON] + " ..."


class GrammarCompiler:
    """Compiles requests' formats against one tokenizer; bad formats raise ValueError."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._tokenizer_lock = threading.Lock()
        self._cache_lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's table of every token's bytes, built on first use (see the module
        docstring). Without EOS ids llguidance takes the tokenizer's own."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer,
                        n_vocab=max(self._vocab_size, len(self._hf_tokenizer)),
                        eos_token=self._eos_token_ids or None)
                except ValueError as error:
                    raise ValueError(f"structured_outputs cannot use this model's tokenizer: "
                                     f"{error}") from error
            return self._tokenizer

    @property
    def mask_words(self) -> int:
        """int32 words in one row of the bitmask."""
        return (self.tokenizer.vocab_size + 31) // 32

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The format's compiled matcher, never advanced (copies are); from the cache of
        the last formats used when it is there. Safe from any thread; two threads
        compiling one new format at once both compile it."""
        spec = grammar_spec(params)
        with self._cache_lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
        compiled = llguidance.LLMatcher(self.tokenizer, spec, log_level=0, limits=_LIMITS)
        if compiled.is_error():
            raise ValueError(f"structured_outputs.{params.kind} is not a valid "
                             f"{_KIND_NAMES[params.kind]}: {compiled.get_error().strip()}")
        with self._cache_lock:
            self._compiled[spec] = compiled
            if len(self._compiled) > _CACHED_FORMATS:
                self._compiled.popitem(last=False)
        return compiled

    def matchers(self, params: StructuredOutputsParams, count: int) -> list[FormatMatcher]:
        """`count` fresh matchers of the format (one per completion), from one compile."""
        compiled = self.compile(params)
        return [FormatMatcher(compiled.deep_copy()) for _ in range(count)]


def grammar_spec(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for the format (ValueError if it cannot be read)."""
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else {"type": "object"}
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be a JSON object")
            if nesting(schema) > MAX_SCHEMA_NESTING:  # given as text, unchecked so far
                raise ValueError(f"it is nested more than {MAX_SCHEMA_NESTING} levels deep")
            schema = _closed_objects(_without_unknown_formats(schema))
            # As vLLM's default backend (xgrammar) reads JSON: a oneOf whose branches
            # llguidance cannot prove disjoint is an anyOf instead of refused, and a
            # string may write any character as a \u escape (Python's json.dumps does).
            options: JsonCompileOptions = {
                "whitespace_flexible": not params.disable_any_whitespace,
                "coerce_one_of": True, "json_allow_general_unicode_escapes": True}
            if params.whitespace_pattern is not None:
                options["whitespace_pattern"] = params.whitespace_pattern
            spec: str = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            return spec
        if kind == "choice":
            assert params.choice is not None
            return _choice_grammar(params.choice)
        if kind == "regex":
            assert params.regex is not None
            # \d means an ASCII digit, as most users mean it (in Rust's and Python's
            # Unicode semantics it also takes digits such as U+1FBF8, which small models
            # do produce under the constraint).
            return llguidance.LLMatcher.grammar_from_lark(
                f"start: /{llguidance.regex_to_lark(params.regex, 'd')}/")
        assert params.grammar is not None
        # vLLM's rule: a grammar with no `::=` is Lark. llguidance's own guess takes
        # Lark only where a line begins `start:`, and would read Lark's inlined
        # `?start:` (outlines' grammars begin so) as broken GBNF.
        if "::=" not in params.grammar:
            return llguidance.LLMatcher.grammar_from_lark(params.grammar)
        return llguidance.grammar_from("grammar", params.grammar)
    except (ValueError, TypeError, RecursionError) as error:  # json.loads of deep text
        raise ValueError(f"structured_outputs.{kind} is not a valid {_KIND_NAMES[kind]}: "
                         f"{error}") from error


def _without_unknown_formats(node: Any) -> Any:
    """A copy of the schema without the `format`s llguidance does not know, which JSON
    Schema reads as annotations that constrain nothing (pydantic writes `binary` for
    bytes, `password` for SecretStr): llguidance would refuse the whole schema."""
    if not isinstance(node, dict):
        return node
    kept: dict[str, Any] = {}
    for key, value in node.items():
        if key == "format" and isinstance(value, str) and value not in _enforced_formats():
            continue
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            value = {name: _without_unknown_formats(item) for name, item in value.items()}
        elif isinstance(value, list) and key in (*_BRANCHES, "prefixItems", "items"):
            value = [_without_unknown_formats(item) for item in value]
        elif key in _SUBSCHEMA:
            value = _without_unknown_formats(value)
        kept[key] = value
    return kept


# JSON Schema's own formats (draft 2020-12); llguidance enforces some of them.
_STANDARD_FORMATS = ("date-time", "date", "time", "duration", "email", "idn-email",
                     "hostname", "idn-hostname", "ipv4", "ipv6", "uri", "uri-reference",
                     "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
                     "relative-json-pointer", "regex")


@functools.cache
def _enforced_formats() -> frozenset[str]:
    """The standard formats llguidance enforces, asked of llguidance itself once (so a
    newer version's are used); a request's own names are never compiled to find out."""
    known = []
    for name in _STANDARD_FORMATS:
        spec = llguidance.LLMatcher.grammar_from_json_schema({"type": "string",
                                                              "format": name})
        if not llguidance.LLMatcher.validate_grammar(spec, None).startswith("Unknown format"):
            known.append(name)
    return frozenset(known)


def _choice_grammar(choices: list[str]) -> str:
    """The choices as one Lark terminal (an upper-case rule), which llguidance's lexer
    matches as a single automaton: as alternatives of the start rule they would be parser
    items, and llguidance's parser gives up beyond 2,000 of them in a row (measured: 2,001
    choices failed after one token). The empty choice, which no terminal can match,
    makes the terminal optional."""
    alternatives = " | ".join(json.dumps(choice) for choice in dict.fromkeys(choices) if choice)
    if not alternatives:
        return llguidance.LLMatcher.grammar_from_lark('start: ""')
    optional = "?" if "" in choices else ""
    return llguidance.LLMatcher.grammar_from_lark(
        f"start: CHOICE{optional}\nCHOICE: {alternatives}")


# JSON Schema keywords whose value is a subschema, a list of them, or a map of them:
# the only places _closed_objects looks (a `const`, `enum` or `default` is data, and a
# property may well be called "properties"). Not `not`, where closing an object would
# widen what it forbids, nor `propertyNames`, whose subschema describes strings.
_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "if", "then", "else",
              "contains", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", "dependencies",
                   "$defs", "definitions")
_BRANCHES = ("allOf", "anyOf", "oneOf")
# Where a node's properties may come from beside its own `properties`: such a node is
# left open, since closing it would refuse what a branch or a referenced schema adds.
_COMPOSED = (*_BRANCHES, "$ref")
# A JSON pointer into a schema, decoded into its parts.
Pointer = tuple[str, ...]


def _closed_objects(schema: Any) -> Any:
    """A copy of the schema where every object that lists properties (or property
    patterns) and does not say otherwise allows no other property, as vLLM's default
    backend (xgrammar, strict mode) reads most schemas; a tuple (`prefixItems`) likewise
    holds only its listed items. Left open: an object listing none (any object), one
    whose properties are composed (allOf/anyOf/oneOf/$ref beside them, or beside its own
    properties or allowed extra ones), every branch below such a composition however
    deep, every subschema a `$ref` of such a composition points to (through aliases),
    and one whose `required` names a property it does not list (closing it would make
    it unsatisfiable)."""
    return _close(schema, _extended_pointers(schema), (), closable=True)


def _widens(node: dict[str, Any]) -> bool:
    """Whether keywords beside a composition may add or ask for properties its branches
    do not list (a branch closed to its own would then refuse them)."""
    return (isinstance(node.get("properties"), dict)
            or isinstance(node.get("patternProperties"), dict)
            or node.get("additionalProperties", False) is not False
            or bool(node.get("required")) or bool(node.get("minProperties")))


def _branches_closable(node: dict[str, Any], key: str) -> bool:
    """Whether the branches under `key` (allOf, anyOf, oneOf) are the node's whole
    constraint, so each may be closed: nothing beside them lists, allows or asks for
    properties (own properties or patterns, extra properties not false, `required`,
    `minProperties`, another composition or a `$ref`), and an allOf has one branch
    (pydantic's way of describing a reference)."""
    beside = any(other in node for other in _COMPOSED if other != key)
    alone = key != "allOf" or len(node[key]) == 1
    return alone and not _widens(node) and not beside


def _close(node: Any, extended: set[Pointer], at: Pointer, closable: bool) -> Any:
    if not isinstance(node, dict):
        return node
    closable = closable and at not in extended
    closed = dict(node)
    listed = closed.get("properties")
    required = closed.get("required")
    composed = any(key in closed for key in _COMPOSED)
    if (closable and "additionalProperties" not in closed and not composed
            and (isinstance(listed, dict) or isinstance(closed.get("patternProperties"), dict))
            and (not isinstance(required, list)
                 or all(name in (listed or {}) for name in required))
            and not _more_than(closed.get("minProperties"), len(listed or {}))):
        closed["additionalProperties"] = False
    prefix = closed.get("prefixItems")
    if (closable and isinstance(prefix, list) and "items" not in closed and not composed
            and not _more_than(closed.get("minItems"), len(prefix))):
        closed["items"] = False  # a tuple holds its listed items only, as in xgrammar
    for key in _SUBSCHEMA:
        if isinstance(closed.get(key), dict):
            closed[key] = _close(closed[key], extended, (*at, key), True)
    for key in ("items", "prefixItems"):
        if isinstance(closed.get(key), list):
            closed[key] = [_close(item, extended, (*at, key, str(i)), True)
                           for i, item in enumerate(closed[key])]
    for key in _BRANCHES:
        if isinstance(closed.get(key), list):
            branches_closable = closable and _branches_closable(node, key)
            closed[key] = [_close(item, extended, (*at, key, str(i)), branches_closable)
                           for i, item in enumerate(closed[key])]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: _close(item, extended, (*at, key, name), True)
                           for name, item in closed[key].items()}
    return closed


def _more_than(minimum: Any, count: int) -> bool:
    """Whether a minProperties/minItems asks for more than the `count` listed, which a
    closed object or tuple could never hold."""
    return isinstance(minimum, (int, float)) and minimum > count


def _pointer(ref: Any) -> Pointer | None:
    """A `$ref`'s JSON pointer as its decoded parts (`#/$defs/a~1b` is ("$defs", "a/b");
    percent-escapes decoded), or None without one (an `$anchor` name is none). The
    document part is not compared with the schema's `$id`: a pointer read as this
    schema's only leaves more open."""
    if not isinstance(ref, str) or "#" not in ref:
        return None
    fragment = urllib.parse.unquote(ref.partition("#")[2])
    if fragment and not fragment.startswith("/"):
        return None
    parts = fragment.split("/")[1:]
    return tuple(part.replace("~1", "/").replace("~0", "~") for part in parts)


def _resolve(schema: Any, pointer: Pointer) -> Any:
    node = schema
    for part in pointer:
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _extended_pointers(schema: Any) -> set[Pointer]:
    """Where the subschemas are that some schema extends: the target of a `$ref` beside
    properties or other branches, or of a `$ref` anywhere below a composition whose
    branches are not its whole constraint (see `_branches_closable`); and, from each,
    what it is made of (its own `$ref`, its branches' `$ref`s)."""
    found: set[Pointer] = set()

    def walk(value: Any, extending: bool) -> None:
        if isinstance(value, list):
            for item in value:
                walk(item, extending)
            return
        if not isinstance(value, dict):
            return
        own = {"properties", "patternProperties", "allOf", "anyOf", "oneOf", "required",
               "minProperties"} & set(value)
        target = _pointer(value.get("$ref"))
        if target is not None and (extending or own):
            found.add(target)
        for key, child in value.items():
            if key in _BRANCHES and isinstance(child, list):
                walk(child, extending or not _branches_closable(value, key))
            elif isinstance(child, (dict, list)):
                walk(child, False)

    walk(schema, False)
    pending = list(found)
    while pending:
        for ref in _composed_refs(_resolve(schema, pending.pop())):
            target = _pointer(ref)
            if target is not None and target not in found:
                found.add(target)
                pending.append(target)
    return found


def _composed_refs(node: Any) -> list[Any]:
    """The `$ref`s an extended subschema is made of: its own and those of its
    allOf/anyOf/oneOf branches, however deep (each is extended with it)."""
    if not isinstance(node, dict):
        return []
    refs = [node.get("$ref")]
    for key in _BRANCHES:
        if isinstance(node.get(key), list):
            for item in node[key]:
                refs += _composed_refs(item)
    return refs


def format_error(params: StructuredOutputsParams) -> str | None:
    """Why the format does not compile, or None; without the tokenizer, so it can be
    asked before a request reaches the engine (the engine compiles it again, against
    the tokenizer, and refuses what fails there)."""
    try:
        error: str = llguidance.LLMatcher.validate_grammar(grammar_spec(params), None,
                                                           limits=_LIMITS)
    except ValueError as bad:
        return str(bad)
    if not error:
        return None
    return f"structured_outputs.{params.kind} is not a valid {_KIND_NAMES[params.kind]}: " \
           f"{error.strip()}"


def allowed_tokens(matchers: list[FormatMatcher], words: int, vocab_size: int) -> torch.Tensor:
    """[len(matchers), vocab_size] bool: which tokens each matcher allows next."""
    packed = np.empty((len(matchers), words), dtype=np.int32)
    for row, matcher in enumerate(matchers):
        matcher.fill_mask(packed[row])
    return unpack_bitmask(packed, vocab_size)


def unpack_bitmask(packed: np.ndarray, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask (bit b of int32 word w is token 32 w + b) as [rows, vocab]
    bool, one byte per token (unpacking through int32 shifts would take 32x the
    memory)."""
    bits = np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab_size]).bool()
