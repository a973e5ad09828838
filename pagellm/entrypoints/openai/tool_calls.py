"""Tool calls: read out of a chat answer into OpenAI's `tool_calls`.

Forced calls (`tool_choice` "required" or a named function) are answered as JSON under
the tools' schemas (structured output), as vLLM answers them, with no model-specific
parser: a named function's answer is its arguments, a JSON object under its
`parameters` schema (finish_reason "stop", as OpenAI gives for a forced function);
"required" answers a JSON array of `{"name", "parameters"}` objects, one per call
(finish_reason "tool_calls").

"auto", where the model decides whether to call a tool, in its own syntax, needs a
parser of that syntax (vLLM's `--enable-auto-tool-choice --tool-call-parser NAME`):
here `hermes`, the `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks of
Qwen2.5/Qwen3, Hermes and the many models trained on that format, and `llama3_json`,
Llama 3.1-3.3's answer of `{"name": ..., "parameters": ...}` objects. Without a parser
"auto" is refused, as in vLLM.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from pagellm.core.sampling_params import StructuredOutputsParams
from pagellm.engine.structured_output import format_error
from pagellm.engine.text import check_unicode
from pagellm.entrypoints.openai.errors import APIError, bad_request
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, FunctionCall, ToolCall


@dataclass(frozen=True)
class ToolCallFormat:
    """What a forced tool call makes of a chat completion: the JSON schema its answer
    follows, and the forced function's name (None for "required": any of the tools)."""

    schema: dict[str, Any]
    function: str | None

    def split(self, text: str) -> tuple[str | None, list[ToolCall] | None]:
        """(content, calls) of an answer. A named function's call is its text whole or
        cut (by max_tokens: its finish_reason says so), as a stream sends its arguments
        piece by piece; "required" calls are read from the whole array, and a cut one
        comes back as content."""
        if self.function is not None:
            return None, [_call(self.function, text)]
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text, None
        if not isinstance(value, list) or not all(
                isinstance(item, dict) and {"name", "parameters"} <= set(item) for item in value):
            return text, None
        return None, [_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                      for item in value]

    def streamed_content(self, text: str) -> str:
        """A forced answer is all calls: no content before the end."""
        return ""

    @property
    def finish_reason(self) -> str | None:
        """The reason of an answer that made calls (None: its own, "stop")."""
        return None if self.function is not None else "tool_calls"


_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)


class HermesToolParser:
    """`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks, after
    optional text (the content; text between and after blocks is dropped, as in vLLM).
    A block left open at the end still counts (a model may stop there, or max_tokens cut
    its closing tag). A block that is not a call (not JSON; no name; arguments that are
    not an object or its JSON text) makes the whole answer content, as in vLLM; a call
    may give its arguments as "parameters", as some models write them."""

    finish_reason = "tool_calls"

    def split(self, text: str) -> tuple[str | None, list[ToolCall] | None]:
        start = text.find(_HERMES_OPEN)
        if start < 0:
            return text, None
        calls = []
        for match in _HERMES_CALL.finditer(_without_cut_close(text), start):
            call = _hermes_call(match.group(1))
            if call is None:
                return text, None
            calls.append(call)
        content = text[:start]
        return (content if content.strip() else None), calls

    def streamed_content(self, text: str) -> str:
        """The text a stream may send before the end: what comes before a tool call,
        less a tail that may be the start of one, and nothing while it is all blank
        (an answer that is only calls has no content)."""
        start = text.find(_HERMES_OPEN)
        if start < 0:
            start = len(text) - partial_tag(text, _HERMES_OPEN)
        shown = text[:start]
        return shown if shown.strip() else ""


class Llama3JsonToolParser:
    """Llama 3.1-3.3's tool calls: the whole answer is one `{"name": ...,
    "parameters": {...}}` object or several separated by ";", after an optional
    `<|python_tag|>` (the chat template asks for this form; vLLM's `llama3_json`). An
    answer of anything else is content. Stricter than vLLM's parser, which takes any
    such object found anywhere in the text, prose around it included."""

    finish_reason = "tool_calls"

    def split(self, text: str) -> tuple[str | None, list[ToolCall] | None]:
        rest = text.lstrip().removeprefix(_PYTHON_TAG).lstrip()
        if not rest.startswith("{"):
            return text, None
        calls = []
        decoder = json.JSONDecoder()
        while rest:
            try:
                value, end = decoder.raw_decode(rest)
            except json.JSONDecodeError:
                return text, None
            call = _named_call(value)
            if call is None:
                return text, None
            calls.append(call)
            rest = rest[end:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return text, None
        return None, calls

    def streamed_content(self, text: str) -> str:
        """Nothing while the answer may still be calls (blank, or begun with "{" or the
        tag); all of it once it cannot be."""
        start = text.lstrip()
        if not start or _PYTHON_TAG.startswith(start) or start.startswith((_PYTHON_TAG, "{")):
            return ""
        return text


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (without being all
    of it)."""
    return next((keep for keep in range(min(len(tag) - 1, len(text)), 0, -1)
                 if tag.startswith(text[-keep:])), 0)


def _without_cut_close(text: str) -> str:
    """The answer less a closing tag cut short at its very end."""
    return text[:len(text) - partial_tag(text, _HERMES_CLOSE)]


def _hermes_call(block: str) -> ToolCall | None:
    try:
        call = json.loads(block)
    except json.JSONDecodeError:
        return None
    return _named_call(call)


def _named_call(call: Any) -> ToolCall | None:
    """A call from a model's `{"name": ..., "arguments" or "parameters": {...}}`; None
    if that is not what it is (the answer is then content)."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    key = next((key for key in ("arguments", "parameters") if key in call), None)
    if key is None and set(call) != {"name"}:
        return None
    arguments = {} if key is None else call[key]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return _call(call["name"], json.dumps(arguments, ensure_ascii=False))


_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class FirstCallOnly:
    """`parallel_tool_calls: false` with a parsed syntax, which cannot be made to write
    one call only: the answer's first call is read, later ones are dropped (as text
    after a call is)."""

    parser: HermesToolParser | Llama3JsonToolParser
    finish_reason: ClassVar[str] = "tool_calls"

    def split(self, text: str) -> tuple[str | None, list[ToolCall] | None]:
        content, calls = self.parser.split(text)
        return content, calls[:1] if calls else calls

    def streamed_content(self, text: str) -> str:
        return self.parser.streamed_content(text)


ToolCallReader = ToolCallFormat | HermesToolParser | Llama3JsonToolParser | FirstCallOnly
# The parsers of models' own tool-call syntax, by their vLLM names.
TOOL_CALL_PARSERS: dict[str, type[HermesToolParser | Llama3JsonToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments))


def new_call_id() -> str:
    """A call's id, unique, in vLLM's form: the client sends it back with the tool's
    result (`tool_call_id`)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call_reader(body: ChatCompletionRequest, parser: str | None) -> ToolCallReader | None:
    """How the request's answer is read for tool calls: a forced call's format, the
    server's parser for "auto", or None (no tools, or tool_choice "none": the tools are
    only rendered into the prompt). Bad tools or choices are a 400."""
    choice = body.tool_choice
    if not body.tools:
        # "auto" over an empty list (LangChain's bind_tools([])) has nothing to call: a
        # plain answer, as the Responses and Messages APIs give it.
        if choice not in (None, "none") and not (choice == "auto" and body.tools == []):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    tools = function_schemas(body.tools)
    if choice == "none":
        return None
    if (choice is None or choice == "auto") and parser is not None:
        syntax = TOOL_CALL_PARSERS[parser]()
        return FirstCallOnly(syntax) if body.parallel_tool_calls is False else syntax
    if choice is None or choice == "auto":
        raise auto_needs_parser('"required" or a named function', '"none"',
                                "tool_choice" if choice is not None else "tools")
    if choice == "required":
        _compiled(tools, list(tools))
        return ToolCallFormat(_any_call_schema(tools, body.parallel_tool_calls), None)
    name = _named_function(choice)
    if name not in tools:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools",
                          param="tool_choice")
    _compiled(tools, [name])
    return ToolCallFormat(tools[name], name)


def auto_needs_parser(forced: str, none: str, param: str) -> APIError:
    """The 400 for tool_choice "auto" on a server without a tool-call parser, saying how
    to start one, and the API's own words for the forced choices and for "none"."""
    return bad_request(
        'tool_choice "auto" (the default with tools) needs a parser of the model\'s own '
        "tool-call syntax: start the server with --enable-auto-tool-choice "
        f"--tool-call-parser hermes, or use {forced} (answered as JSON under the tools' "
        f"schemas), or {none}", param=param)


def function_schemas(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each function's name and its arguments' schema (an empty object when it takes
    none), their shapes checked. Whether a schema compiles is asked only of the tools a
    call is forced under (see `_compiled`): with "auto" or "none" they are only
    rendered into the prompt, as vLLM treats them."""
    functions: dict[str, dict[str, Any]] = {}
    for index, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise bad_request(f'tools[{index}] must be {{"type": "function", "function": '
                              '{"name": ..., "parameters": ...}}', param=f"tools[{index}]")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{index}].function.name must be a non-empty string",
                              param=f"tools[{index}].function.name")
        try:
            check_unicode(name, f"tools[{index}].function.name")
        except ValueError as error:
            raise bad_request(str(error), param=f"tools[{index}].function.name") from None
        if name in functions:
            raise bad_request(f"tools[{index}].function.name {name!r} is given twice",
                              param=f"tools[{index}].function.name")
        parameters = function.get("parameters")
        if parameters is not None and (not isinstance(parameters, dict)
                                       or parameters.get("type", "object") != "object"):
            raise bad_request(f"tools[{index}].function.parameters must be the JSON schema "
                              "of an object (the arguments)",
                              param=f"tools[{index}].function.parameters")
        functions[name] = parameters or _NO_ARGUMENTS
    return functions


def _compiled(functions: dict[str, dict[str, Any]], names: list[str]) -> None:
    """A 400 naming the first of these tools whose schema does not compile (within the
    call's format the error would name tool_choice)."""
    for index, (name, parameters) in enumerate(functions.items()):
        if name not in names:
            continue
        try:
            error = format_error(StructuredOutputsParams(json=parameters))
        except ValueError as refused:  # checked as it is built (nested too deeply, ...)
            error = str(refused)
        if error is not None:
            raise bad_request(error.replace("structured_outputs.json",
                                            f"tools[{index}].function.parameters", 1),
                              param=f"tools[{index}].function.parameters")


# The arguments of a function that declares none: "{}", as OpenAI answers.
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def _named_function(choice: Any) -> str:
    """The function a `{"type": "function", "function": {"name": ...}}` choice names."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str):
            return name
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": '
                      '"function", "function": {"name": ...}}', param="tool_choice")


def _any_call_schema(tools: dict[str, dict[str, Any]], parallel: bool | None
                     ) -> dict[str, Any]:
    """A JSON array of one call or more (one if parallel_tool_calls is false), each
    `{"name": <a tool>, "parameters": <its arguments>}`."""
    calls = []
    for index, (name, parameters) in enumerate(tools.items()):
        nested = f"#/items/anyOf/{index}/properties/parameters"
        calls.append({"type": "object",
                      "properties": {"name": {"const": name},
                                     "parameters": _moved_refs(parameters, nested)},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def _moved_refs(node: Any, root: str) -> Any:
    """A copy of a tool's schema whose local references (`#`, `#/$defs/..`,
    `#/definitions/..`, any pointer into it) point where the schema now sits, nested in
    the array of calls; left alone, `#` would mean the whole array."""
    if isinstance(node, dict):
        return {key: (root + value[1:] if key == "$ref" and isinstance(value, str)
                      and value.startswith("#") else _moved_refs(value, root))
                for key, value in node.items()}
    if isinstance(node, list):
        return [_moved_refs(value, root) for value in node]
    return node
