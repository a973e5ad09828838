"""A conversation to prompt token ids through the model's chat template.

One renderer for `LLM.chat`, the OpenAI server and the CLI, so a conversation renders to
the same tokens (and so hits the same cached prefix) whichever way it arrives. Messages
are checked here too, with errors naming the message and field, so the offline API
refuses what the server refuses.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes

from pagellm.engine.text import TextTooLong, encode_text

Message = dict[str, Any]
# vLLM's `chat_template_content_format`: how a message's content reaches the template.
ContentFormat = Literal["auto", "string", "openai"]
CONTENT_FORMATS: tuple[ContentFormat, ...] = ("auto", "string", "openai")

# Content parts that carry text, and the key that holds it (vLLM reads these as text;
# the Responses API's input_text/output_text parts come through clients that mix APIs).
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text",
              "refusal": "refusal", "thinking": "thinking"}
# Message fields passed on to the template besides role and content: templates that know
# tools render an assistant's tool calls and a tool result's call id.
_PASSED_FIELDS: dict[str, type] = {"name": str, "tool_calls": list, "tool_call_id": str}
_KIND_NAMES: dict[type, str] = {str: "a string", list: "a list of objects"}
# Arguments of apply_chat_template that the renderer sets itself, and the names the
# template is rendered with besides them (messages; self, Jinja's render's own).
_RESERVED_KWARGS = frozenset({"conversation", "messages", "self", "tokenize",
                              "add_generation_prompt", "continue_final_message", "tools",
                              "chat_template",
                              "return_dict", "return_tensors", "padding", "truncation",
                              "max_length", "tokenizer_kwargs", "documents"})


# Characters that make a `--chat-template` value the template itself, not a file name
# (vLLM's rule).
_TEMPLATE_CHARS = frozenset("{}\n")


def load_chat_template(value: str) -> str:
    """The Jinja text of a `--chat-template` value, by vLLM's rule: the file it names if
    there is one, else the value itself when it holds braces or a newline. Raises
    ValueError naming a value that is neither, before any model loads."""
    is_template = bool(_TEMPLATE_CHARS & set(value))
    try:
        path = Path(value).expanduser()
        if value and path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        if not is_template:
            raise ValueError(f"--chat-template {value!r}: cannot read it: {error}") from None
    if is_template:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a template (no '{{')")


def use_chat_template(tokenizer: Any, template: str) -> None:
    """Makes `template` the tokenizer's own chat template, for every renderer (server,
    CLI, `LLM.chat` without a template of its own); raises ValueError when it cannot
    render a one-message conversation (a syntax error, an unknown filter)."""
    if tokenizer is None:
        raise ValueError("--chat-template needs the model's tokenizer")
    previous = getattr(tokenizer, "chat_template", None)
    tokenizer.chat_template = template
    try:
        _render_text(tokenizer, [{"role": "user", "content": "Hello"}])
    except ChatError as error:
        tokenizer.chat_template = previous
        raise ValueError(f"--chat-template: {error}") from None


class ChatError(ValueError):
    """A conversation or option the template cannot take; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatOptions:
    """How to render: vLLM's `chat` and chat-completions options of the same names.

    - add_generation_prompt: end with the opening of the assistant's turn.
    - continue_final_message: leave the last message open, so the model continues it:
      an assistant's (a prefill of the answer) or, as in vLLM and transformers, any
      other role's (a user's half-written text, completed); excludes
      add_generation_prompt.
    - tools: tool definitions, for templates that render them.
    - chat_template: a Jinja template instead of the model's.
    - chat_template_kwargs: extra variables for the template (e.g. enable_thinking).
    - content_format: a message's content as one string ("string": text parts joined
      by newlines) or as OpenAI's list of text parts ("openai"), for templates that loop
      over the parts; "auto" picks "openai" for a template that loops over a message's
      content, as vLLM's "auto" does.
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    content_format: ContentFormat = "auto"

    def check(self, conversation: Sequence[Message]) -> None:
        """Raises ChatError for options that contradict each other or the conversation,
        before the template would render something else than what was asked."""
        if self.content_format not in CONTENT_FORMATS:
            raise ChatError(f"chat_template_content_format must be one of "
                            f"{', '.join(CONTENT_FORMATS)}, got {self.content_format!r}",
                            "chat_template_content_format")
        if self.add_generation_prompt and self.continue_final_message:
            raise ChatError("continue_final_message and add_generation_prompt cannot both "
                            "be true", "continue_final_message")
        check_template_kwargs(self.chat_template_kwargs or {}, "chat_template_kwargs")


def check_template_kwargs(kwargs: Mapping[str, Any], field: str) -> None:
    """Template variables may not set what the renderer sets itself (the conversation,
    the tools, add_generation_prompt, ...): a ChatError naming `field` and the keys."""
    reserved = sorted(_RESERVED_KWARGS & set(kwargs))
    if reserved:
        raise ChatError(f"{field} cannot set {', '.join(reserved)}", field)


def _content(index: int, content: Any) -> list[str]:
    """A message's texts: its string, or its text parts (strings, or parts of TEXT_PARTS'
    types); a text part without its text is skipped, as vLLM does."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        texts = []
        for number, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(kind, str) or kind not in TEXT_PARTS:
                what = f"a {kind!r} part" if isinstance(kind, str) else "a part without a type"
                raise ChatError(f"messages[{index}].content[{number}]: only text content "
                                f"parts are supported, got {what}", "messages")
            text = part.get(TEXT_PARTS[kind])
            if text is None:
                continue
            if not isinstance(text, str):
                raise ChatError(f"messages[{index}].content[{number}].{TEXT_PARTS[kind]} "
                                f"must be a string, got {text!r}", "messages")
            texts.append(text)
        return texts
    raise ChatError(f"messages[{index}].content must be a string, a list of text parts or "
                    f"None, got {type(content).__name__}", "messages")


def check_messages(messages: Any, content_format: ContentFormat = "string") -> list[Message]:
    """The conversation as the template expects it, or a ChatError naming the message.

    OpenAI's `developer` role is the newer name of `system`, which is what chat templates
    know. Content is one string, or with `content_format` "openai" a list of
    `{"type": "text", "text": ...}` parts (vLLM's two forms).
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatError("messages must be a non-empty list of messages", "messages")
    conversation = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatError(f"messages[{index}] must be a dict with 'role' and 'content'",
                            "messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatError(f"messages[{index}].role must be a non-empty string, got "
                            f"{role!r}", "messages")
        texts = _content(index, message.get("content"))
        rendered: Message = {"role": "system" if role == "developer" else role,
                             "content": [{"type": "text", "text": text} for text in texts]
                             if content_format == "openai" else "\n".join(texts)}
        for field, kind in _PASSED_FIELDS.items():
            value = message.get(field)
            if value is None:
                continue
            if not isinstance(value, kind) or (
                    isinstance(value, list) and not all(isinstance(v, dict) for v in value)):
                raise ChatError(f"messages[{index}].{field} must be "
                                f"{_KIND_NAMES[kind]}, got {value!r}", "messages")
            rendered[field] = value
        if "tool_calls" in rendered:
            calls = _tool_calls(index, rendered.pop("tool_calls"))
            if calls:
                rendered["tool_calls"] = calls
        conversation.append(rendered)
    return conversation


def json_object(value: Any) -> dict[str, Any] | None:
    """A dict, or the JSON text of one (tool-call arguments come either way); else None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None


def _tool_calls(index: int, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant's tool calls as templates read them (vLLM's rules): the arguments
    as a dict, not OpenAI's JSON text, which a template's `tojson` would encode twice;
    and an empty list left out, since `'tool_calls' in message` sends some templates
    down their tool path (Llama 3.1's then refuses anything but one call)."""
    parsed = []
    for number, call in enumerate(calls):
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise ChatError(f"messages[{index}].tool_calls[{number}] must be "
                            '{"type": "function", "function": {"name", "arguments"}}',
                            "messages")
        arguments = json_object(function.get("arguments") or {})
        if arguments is None:
            raise ChatError(f"messages[{index}].tool_calls[{number}].function.arguments "
                            "must be a JSON object (or its JSON text)", "messages")
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return parsed


class _GenerationTag(jinja2.ext.Extension):
    """Hugging Face's `{% generation %}` block (it marks the assistant's tokens for
    training), read as its body, so that templates using it can be parsed here."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _unwrapped(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """The value under filters, tests and slices (`messages[1:] | reverse`)."""
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)):
        if node.node is None:
            break
        node = node.node
    return node


@functools.lru_cache(maxsize=32)
def loops_over_content(template: str) -> bool:
    """Whether a chat template loops over a message's content (`{% for part in
    message['content'] %}`, directly, through a variable set to it, or through a macro's
    parameter): such a template wants OpenAI's list of parts, and iterating a string
    would render its characters (vLLM's "auto" detection). A message is an item of
    `messages` (or of a variable set from it, `loop_messages = messages[1:]`), or one
    indexed from it; another object's `content` (a document's) does not count."""
    try:
        tree = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, _GenerationTag]).parse(
            template)
    except jinja2.TemplateSyntaxError:
        return False

    def named(node: jinja2.nodes.Node, names: set[str]) -> bool:
        return isinstance(node, jinja2.nodes.Name) and node.name in names

    lists = {"messages"}
    for assign in tree.find_all(jinja2.nodes.Assign):  # in template order
        if isinstance(assign.target, jinja2.nodes.Name) and named(_unwrapped(assign.node), lists):
            lists.add(assign.target.name)
    messages = {loop.target.name for loop in tree.find_all(jinja2.nodes.For)
                if isinstance(loop.target, jinja2.nodes.Name)
                and named(_unwrapped(loop.iter), lists)}

    def is_message(node: jinja2.nodes.Node) -> bool:
        return named(node, messages) or (isinstance(node, jinja2.nodes.Getitem)
                                         and named(_unwrapped(node.node), lists))

    def is_content(node: jinja2.nodes.Node) -> bool:
        node = _unwrapped(node)
        return ((isinstance(node, jinja2.nodes.Getattr) and node.attr == "content"
                 and is_message(node.node))
                or (isinstance(node, jinja2.nodes.Getitem)
                    and isinstance(node.arg, jinja2.nodes.Const)
                    and node.arg.value == "content" and is_message(node.node)))

    # Macro parameters that receive a message, then names that hold its content: `{% set
    # c = message.content %}`, and macro parameters that receive that.
    macros = {macro.name: [arg.name for arg in macro.args]
              for macro in tree.find_all(jinja2.nodes.Macro)}
    calls = [(macros[call.node.name], call) for call in tree.find_all(jinja2.nodes.Call)
             if isinstance(call.node, jinja2.nodes.Name) and call.node.name in macros]

    def receiving(test: Callable[[jinja2.nodes.Node], bool]) -> set[str]:
        return {*(params[i] for params, call in calls for i, arg in enumerate(call.args)
                  if i < len(params) and test(arg)),
                *(kwarg.key for _, call in calls for kwarg in call.kwargs if test(kwarg.value))}

    messages |= receiving(is_message)
    contents = {assign.target.name for assign in tree.find_all(jinja2.nodes.Assign)
                if isinstance(assign.target, jinja2.nodes.Name) and is_content(assign.node)}
    contents |= receiving(is_content)
    return any(is_content(loop.iter) or named(_unwrapped(loop.iter), contents)
               for loop in tree.find_all(jinja2.nodes.For))


def _content_format(tokenizer: Any, options: ChatOptions) -> ContentFormat:
    if options.content_format != "auto":
        return options.content_format
    template = options.chat_template or getattr(tokenizer, "chat_template", None)
    return "openai" if isinstance(template, str) and loops_over_content(template) else "string"


def _render_text(tokenizer: Any, messages: Any, options: ChatOptions = ChatOptions()) -> str:
    """The conversation as template text; a template that rejects it (roles out of order,
    say) raises ChatError naming `messages`."""
    if tokenizer is None:
        raise ChatError("chat needs the model's tokenizer (skip_tokenizer_init is set): "
                        "render the conversation yourself and pass prompt_token_ids",
                        "messages")
    conversation = check_messages(messages, _content_format(tokenizer, options))
    options.check(conversation)
    if options.chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatError("the model has no chat template: give one (`--chat-template` on the "
                        "command line, `chat_template=` to LLM.chat), or send a completion "
                        "prompt instead", "messages")
    try:
        return str(tokenizer.apply_chat_template(
            conversation, tools=options.tools, chat_template=options.chat_template,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message, tokenize=False,
            **(options.chat_template_kwargs or {})))
    except Exception as error:  # noqa: BLE001 - jinja raises many types for bad input
        raise ChatError(f"messages cannot be rendered by the chat template: {error}",
                        "messages") from error


def render_chat(tokenizer: Any, messages: Any, options: ChatOptions = ChatOptions(),
                max_model_len: int | None = None) -> list[int]:
    """Token ids of the rendered conversation."""
    return render_chat_prompt(tokenizer, messages, options, max_model_len)[1]


def render_chat_prompt(tokenizer: Any, messages: Any, options: ChatOptions = ChatOptions(),
                       max_model_len: int | None = None) -> tuple[str, list[int]]:
    """The rendered conversation, as text and as token ids.

    Rendered to text first and then encoded without special tokens: the template already
    wrote them, and adding a BOS again would change the prompt. With `max_model_len`, a
    rendering too long to fit is refused before it is encoded (encode_text's TextTooLong).
    """
    text = _render_text(tokenizer, messages, options)
    try:
        token_ids = encode_text(tokenizer, text, "messages", add_special_tokens=False,
                                max_model_len=max_model_len)
    except TextTooLong:
        raise
    except ValueError as error:
        raise ChatError(str(error), "messages") from error
    if not token_ids:
        raise ChatError("messages: the conversation renders to an empty prompt", "messages")
    return text, token_ids
