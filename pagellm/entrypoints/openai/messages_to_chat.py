"""An Anthropic Messages request as the chat request that answers it (see
serving_messages.py): content blocks become chat messages, each remembering the block it
came from so that errors name the client's field, and the Messages fields become chat's.
Anthropic's `cache_control` marks are accepted and change nothing: every prefix is cached
here without being asked.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagellm.entrypoints.openai.chat_bridge import (
    Conversation,
    as_chat_request,
    json_schema_format,
    renamed_error,
    required_string,
)
from pagellm.entrypoints.openai.errors import APIError, bad_request
from pagellm.entrypoints.openai.messages_protocol import MessagesRequest
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.serving import is_set, refuse_set
from pagellm.entrypoints.openai.tool_calls import auto_needs_parser

# Chat's field names in errors, and the Messages fields they stand for.
_RENAMES = ((re.compile(r"\btools\[(\d+)\]\.function\.parameters\b"), r"tools[\1].input_schema"),
            (re.compile(r"\btools\[(\d+)\]\.function\."), r"tools[\1]."),
            (re.compile(r"\bmax_completion_tokens\b"), "max_tokens"),
            (re.compile(r"\bresponse_format\b"), "output_config.format"))
# Sampling fields with the same name and meaning in chat.
_SHARED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                  "ignore_eos", "cache_salt", "priority", "structured_outputs")
_REFUSED = {"mcp_servers": "this server connects to no MCP server",
            "container": "there is no code execution container here"}
# A system block Claude Code sends with a per-request hash in it: kept, it would make
# every prompt differ from its first tokens on, so vLLM drops it, and so do we.
_BILLING_HEADER = "x-anthropic-billing-header"


def check_options(body: MessagesRequest) -> None:
    """A 400 for what this server does not do, and for values Anthropic refuses that
    chat would name by its own fields."""
    refuse_set(body, _REFUSED)
    if is_set(body.thread):
        # Anthropic's refusal of a thread it cannot hold: the SDK's tool runner and
        # thread helpers read the code and resend the whole conversation without one.
        raise APIError(400, "thread is not supported: this server holds no Messages "
                       "conversations; send the whole conversation each turn",
                       param="thread", details={"error_code": "thread_unsupported_request"})
    if body.max_tokens < 1:
        raise bad_request(f"max_tokens must be >= 1, got {body.max_tokens}", param="max_tokens")
    if "" in (body.stop_sequences or []):
        raise bad_request("stop_sequences must not contain an empty string",
                          param="stop_sequences")


def renamed(error: APIError, conversation: Conversation) -> APIError:
    """A chat error in the Messages request's terms: its fields, and the block or
    message each chat message came from."""
    return renamed_error(error, conversation.origins, "messages", _RENAMES)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """Content as a list of blocks, each a dict with a type (a string is one text
    block); no content at all is a 400, as in Anthropic's API."""
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks",
                          param=where)
    if not content:
        raise bad_request(f"{where} must not be empty", param=where)
    for index, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request(f"{where}[{index}] must be a content block with a type",
                              param=f"{where}[{index}]")
    return content


def _texts(blocks: list[dict[str, Any]], where: str) -> list[str]:
    """The text of text-only content (the system prompt, a tool result); empty text
    blocks are skipped, as vLLM does; another kind of block is a 400 naming it."""
    texts = []
    for index, block in enumerate(blocks):
        if block["type"] != "text":
            raise bad_request(f"{where}[{index}] is a {block['type']!r} block; only text "
                              "blocks are supported here", param=f"{where}[{index}]")
        text = required_string(block, "text", f"{where}[{index}]")
        if text:
            texts.append(text)
    return texts


def _system_message(system: Any) -> list[dict[str, Any]]:
    """The system prompt as one message, its blocks joined as vLLM joins them, less the
    billing-header block."""
    if system is None:
        return []
    texts = [text for text in _texts(_blocks(system, "system"), "system")
             if not text.startswith(_BILLING_HEADER)]
    return [{"role": "system", "content": "".join(texts)}] if texts else []


class _ToolUses:
    """Anthropic's pairing of tool calls with their results: each tool_use block of an
    assistant turn is answered by one tool_result block in the user turn after it, and a
    tool_result answers a tool_use of the assistant turn before it (consecutive messages
    of one role are one turn to Anthropic). Anthropic's API refuses a conversation that
    breaks this, and so do we: a template would render a result for a call the model
    never made, or a call left unanswered."""

    def __init__(self) -> None:
        self.waiting: list[str] = []
        self.asked_in = ""  # the first message of the last assistant turn
        self.followed = True  # whether a user turn came after it

    def begin(self, role: str, where: str) -> None:
        """Before each message: an assistant turn may not begin while the calls of the
        one before it are unanswered."""
        if role != "assistant":
            self.followed = True
        elif self.followed:
            if self.waiting:
                self._unanswered()
            self.asked_in, self.followed = where, False

    def ask(self, call_id: str, at: str) -> None:
        if call_id in self.waiting:
            raise bad_request(f"{at}.id {call_id!r} is the id of an earlier tool_use block "
                              f"of the assistant turn at {self.asked_in}; tool_use ids must "
                              "be unique", param=f"{at}.id")
        self.waiting.append(call_id)

    def answer(self, call_id: str, at: str) -> None:
        if call_id not in self.waiting:
            asked = f"in the assistant turn at {self.asked_in}" if self.asked_in else "before it"
            raise bad_request(f"{at}.tool_use_id {call_id!r} answers no tool_use block "
                              f"{asked} (or one answered already)", param=f"{at}.tool_use_id")
        self.waiting.remove(call_id)

    def end(self) -> None:
        """After the last message: every call answered, and no conversation ending on
        calls (it waits for their results: a 400, as in Anthropic's API)."""
        if self.waiting and self.followed:
            self._unanswered()
        if self.waiting:
            raise bad_request(f"the assistant turn at {self.asked_in} ends the conversation "
                              "with tool_use blocks, which need a user message with their "
                              "tool_result blocks after them", param=self.asked_in)

    def _unanswered(self) -> None:
        ids = ", ".join(repr(call_id) for call_id in self.waiting)
        raise bad_request(f"the assistant turn at {self.asked_in} has tool_use blocks with no "
                          f"tool_result block in the user turn after it: {ids}",
                          param=self.asked_in)


def conversation_of(system: Any, messages: list[Any]) -> Conversation:
    """The chat messages of a Messages request: the system prompt first; a user
    message's tool_result blocks as tool messages before its text (as vLLM orders them);
    an assistant's text as its content and its tool_use blocks as its tool_calls.
    Thinking blocks in an assistant's turn are dropped (the models served here do not
    think); images, documents and anything else are a 400 naming the block."""
    chat = _system_message(system)
    origins = ["system"] * len(chat)
    tool_uses = _ToolUses()
    for number, message in enumerate(messages):
        where = f"messages[{number}]"
        tool_uses.begin(message.role, where)
        texts: list[dict[str, str]] = []
        calls: list[dict[str, Any]] = []
        for index, block in enumerate(_blocks(message.content, f"{where}.content")):
            at = f"{where}.content[{index}]"
            kind = block["type"]
            if kind == "text":
                text = required_string(block, "text", at)
                if text:
                    texts.append({"type": "text", "text": text})
            elif kind == "tool_use" and message.role == "assistant":
                arguments = block.get("input")
                if not isinstance(arguments, dict):
                    raise bad_request(f"{at}.input must be an object", param=f"{at}.input")
                call_id = required_string(block, "id", at)
                tool_uses.ask(call_id, at)
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": required_string(block, "name", at),
                                           "arguments": json.dumps(arguments,
                                                                   ensure_ascii=False)}})
            elif kind == "tool_result" and message.role == "user":
                content = block.get("content", "")
                call_id = required_string(block, "tool_use_id", at)
                tool_uses.answer(call_id, at)
                chat.append({"role": "tool", "tool_call_id": call_id,
                             "content": content if isinstance(content, str) else "\n".join(
                                 _texts(_blocks(content, f"{at}.content"), f"{at}.content"))})
                origins.append(at)
            elif not (kind in ("thinking", "redacted_thinking") and message.role == "assistant"):
                article = "an" if message.role == "assistant" else "a"
                raise bad_request(f"{at} is a {kind!r} block, which is not supported in "
                                  f"{article} {message.role} message", param=at)
        if texts or calls:
            turn: dict[str, Any] = {"role": message.role, "content": texts or None}
            if calls:
                turn["tool_calls"] = calls
            chat.append(turn)
            origins.append(where)
        elif message.role == "user" and not any(o.startswith(where) for o in origins):
            raise bad_request(f"{where}.content has no text or tool result",
                              param=f"{where}.content")
    tool_uses.end()
    return Conversation(chat, origins)


def _prefill(conversation: Conversation) -> dict[str, Any]:
    """A last assistant message of text is Anthropic's prefill: the answer continues it
    (chat's continue_final_message), and holds only the new text. (One ending on
    tool_use blocks is refused by conversation_of.)"""
    last = conversation.messages[-1] if conversation.messages else {}
    if last.get("role") != "assistant":
        return {}
    return {"add_generation_prompt": False, "continue_final_message": True}


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic's client tools (name, description, input_schema) in chat's form (chat
    checks their names and schemas); its server tools (web search, code execution, ...)
    are a 400."""
    if not tools:
        return None
    converted = []
    for index, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom":
            raise bad_request(f"tools[{index}] has type {tool.get('type')!r}; only client "
                              "tools (name, description, input_schema) are supported",
                              param=f"tools[{index}].type")
        if not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"tools[{index}].input_schema must be a JSON schema object",
                              param=f"tools[{index}].input_schema")
        converted.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description", ""),
            "parameters": tool["input_schema"]}})
    return converted


def _chat_tool_choice(choice: dict[str, Any] | None, tools: list[Any] | None,
                      parser: str | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's tool_choice: auto (the
    default with tools; it needs the server's tool-call parser), any (chat's
    "required"), tool (a named function), none. Auto or none without tools mean no
    tools; chat refuses the others without tools."""
    kind = "auto" if choice is None else choice.get("type")
    parallel = False if (choice or {}).get("disable_parallel_tool_use") else None
    if kind in ("auto", "none") and not tools:
        return None, parallel
    if kind == "none":
        return "none", parallel
    if kind == "auto":
        if parser is None:
            raise auto_needs_parser('{"type": "any"} or {"type": "tool", "name": ...}',
                                    '{"type": "none"}', "tool_choice")
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice, dict) and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request('tool_choice must be {"type": "auto" | "any" | "none"} or {"type": '
                      '"tool", "name": ...}', param="tool_choice")


def _response_format(body: MessagesRequest) -> dict[str, Any] | None:
    """`output_config.format` (or the older top-level `output_format`), a JSON schema
    the answer follows, as chat's response_format."""
    spec = (body.output_config or {}).get("format") or body.output_format
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" \
            or not isinstance(spec.get("schema"), dict):
        raise bad_request('output_config.format must be {"type": "json_schema", "schema": '
                          '{...}}', param="output_config.format")
    if body.tool_choice is not None and body.tool_choice.get("type") in ("any", "tool"):
        raise bad_request("output_config.format cannot be combined with tool_choice any or "
                          "tool: the answer is then the call's arguments",
                          param="output_config.format")
    if body.messages and body.messages[-1].role == "assistant":
        raise bad_request("output_config.format cannot be combined with a prefilled "
                          "assistant message: the format would start over after it",
                          param="output_config.format")
    return json_schema_format(spec["schema"], "output")


def chat_request(body: MessagesRequest, conversation: Conversation, parser: str | None
                 ) -> ChatCompletionRequest:
    """The chat request answering `body` over `conversation` (see conversation_of)."""
    fields: dict[str, Any] = {name: getattr(body, name) for name in _SHARED_FIELDS}
    tools = _chat_tools(body.tools)
    choice, parallel = _chat_tool_choice(body.tool_choice, body.tools, parser)
    fields.update(messages=conversation.messages, max_completion_tokens=body.max_tokens,
                  stop=body.stop_sequences, tools=tools, tool_choice=choice,
                  parallel_tool_calls=parallel, response_format=_response_format(body),
                  **_prefill(conversation))
    return as_chat_request(fields)


def count_request(conversation: Conversation, tools: list[dict[str, Any]] | None
                  ) -> ChatCompletionRequest:
    """The chat request whose rendered prompt count_tokens counts: the conversation and
    the tools, as a message would render them."""
    return as_chat_request({
        "messages": conversation.messages, "tools": _chat_tools(tools),
        **_prefill(conversation)})
