"""POST /v1/responses (OpenAI's Responses API), and the stored responses' GET and DELETE.

A response is a chat completion underneath, as in vLLM: the input items (with the
instructions as a system message, and the stored conversation of `previous_response_id`
before them) become a chat conversation, the Responses fields become the chat request's,
and the one chat path renders, queues and reads tool calls. Only the shapes differ: the
answer comes back as output items (a message of `output_text`, then one `function_call`
item per call), and a stream is OpenAI's typed events (`response.output_text.delta`, ...)
rather than chat chunks. Errors name the Responses field (`input`, `max_output_tokens`,
`text.format`, `tools[0].parameters`), not the chat field they were checked as.
"""

from __future__ import annotations

import itertools
import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.engine.outputs import CompletionOutput, RequestOutput
from pagellm.entrypoints.openai.errors import APIError, bad_request, failure
from pagellm.entrypoints.openai.logprobs import TokenText, chat_logprobs
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, ChatTokenLogprob, ToolCall
from pagellm.entrypoints.openai.response_store import ResponseStore
from pagellm.entrypoints.openai.responses_protocol import (
    DeletedResponse,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    Status,
    StreamEvent,
)
from pagellm.entrypoints.openai.serving import ServerContext, final_outputs, merged, usage
from pagellm.entrypoints.openai.serving_chat import ChatRun, start_chat
from pagellm.entrypoints.openai.tool_calls import ToolCallReader
from pagellm.entrypoints.openai.transport import EventStreamResponse, unless_disconnected

# The include entry that asks for the output text's logprobs.
_LOGPROBS = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text")


async def create_response(context: ServerContext, store: ResponseStore,
                          body: ResponsesRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    context.check_model(body.model)
    _check_options(body)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise APIError(404, f"Response with id '{body.previous_response_id}' not found.",
                           param="previous_response_id")
        history = previous.conversation
    conversation = history + _input_messages(body.input)
    instructions = ([{"role": "system", "content": body.instructions}]
                    if body.instructions else [])
    response_id = f"resp_{uuid.uuid4().hex}"
    try:
        run = await start_chat(context, _chat_request(body, instructions + conversation),
                               arrival, response_id)
    except APIError as error:
        raise _renamed(error) from error
    answer = _Answer(body, response_id, context.model_name, run, conversation,
                     store if body.store else None,
                     TokenText(context.engine.tokenizer) if _wants_logprobs(body) else None)
    if body.stream:
        return EventStreamResponse(answer.events(context))
    outputs = await unless_disconnected(raw, final_outputs(run.streams, context.metrics))
    return JSONResponse(answer.finish(outputs[0]).model_dump(mode="json"))


def retrieve_response(store: ResponseStore, response_id: str) -> ResponseObject:
    stored = store.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored.response


def delete_response(store: ResponseStore, response_id: str) -> DeletedResponse:
    if not store.delete(response_id):
        raise _not_found(response_id)
    return DeletedResponse(id=response_id)


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id")


def _check_options(body: ResponsesRequest) -> None:
    """A 400 for what this server does not do, where going on would answer 200 with
    something other than what the client asked for."""
    refused = {"background": "background responses are not supported; ask with stream "
                             "to read the answer as it is generated",
               "conversation": "conversation objects are not supported; continue with "
                               "previous_response_id",
               "prompt": "stored prompt templates are not supported; send the input"}
    for option, reason in refused.items():
        if getattr(body, option) not in (None, False):
            raise bad_request(f"{option} is not supported: {reason}", param=option)
    if isinstance(body.input, list) and not body.input and body.previous_response_id is None:
        raise bad_request("input must not be empty", param="input")


def _wants_logprobs(body: ResponsesRequest) -> bool:
    return _LOGPROBS in (body.include or []) or bool(body.top_logprobs)


def _text_content(content: Any, where: str) -> str | list[dict[str, str]] | None:
    """A message's content as chat takes it: a string, or its text parts (input_text,
    output_text) as chat text parts; any other part is a 400 naming it."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts",
                          param=f"{where}.content")
    parts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{index}] is a {kind!r} part; only text parts "
                              "(input_text, output_text) are supported",
                              param=f"{where}.content[{index}]")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def _input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as chat messages: a string is one user message; items are messages,
    the client's record of earlier function calls (merged into the assistant message
    before them, as one chat turn with tool_calls) and their outputs (tool messages).
    Reasoning items are dropped: the models served here do not reason."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be one of user, system, developer, "
                                  f"assistant, got {role!r}", param=f"{where}.role")
            messages.append({"role": role,
                             "content": _text_content(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _text_content(item.get("output"), where)})
        elif kind != "reasoning":
            raise bad_request(f"{where} has type {kind!r}, which is not supported (message, "
                              "function_call, function_call_output)", param=f"{where}.type")
    return messages


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in chat's form; a built-in tool (web_search,
    file_search, ...) is a 400: there is nothing here to run it."""
    if tools is None:
        return None
    converted = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{index}] has type {kind!r}; only function tools are "
                              "supported", param=f"tools[{index}].type")
        converted.append({"type": "function", "function": {
            key: tool[key] for key in ("name", "description", "parameters", "strict")
            if key in tool}})
    return converted


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": '
                      '"function", "name": ...}', param="tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (whose json_schema nests what Responses
    gives flat)."""
    spec = (text or {}).get("format")
    kind = spec.get("type") if isinstance(spec, dict) else None
    if spec is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if spec.get("schema") is None:
            raise bad_request("text.format of type 'json_schema' needs schema, the JSON "
                              "schema of the answer", param="text.format")
        return {"type": "json_schema", "json_schema": {
            key: spec[key] for key in ("name", "schema", "strict") if key in spec}}
    raise bad_request(f"text.format type must be 'text', 'json_object' or 'json_schema', "
                      f"got {kind!r}", param="text.format")


# Fields with the same name and meaning in both requests.
_SHARED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids",
                  "min_tokens", "ignore_eos", "logit_bias", "skip_special_tokens",
                  "include_stop_str_in_output", "cache_salt", "priority",
                  "parallel_tool_calls")


def _chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]
                  ) -> ChatCompletionRequest:
    fields: dict[str, Any] = {name: getattr(body, name) for name in _SHARED_FIELDS}
    logprobs = _wants_logprobs(body)
    fields.update(
        messages=messages, max_completion_tokens=body.max_output_tokens,
        logprobs=logprobs, top_logprobs=body.top_logprobs if logprobs else None,
        tools=_chat_tools(body.tools), tool_choice=_chat_tool_choice(body.tool_choice),
        response_format=_response_format(body.text),
        truncate_prompt_tokens=-1 if body.truncation == "auto" else None)
    return ChatCompletionRequest.model_validate(fields)


# Chat's field names in errors, and the Responses fields they stand for.
_RENAMES = ((re.compile(r"\btools\[(\d+)\]\.function\."), r"tools[\1]."),
            (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
            (re.compile(r"\bresponse_format\b"), "text.format"),
            (re.compile(r"\bmessages\b"), "input"))


def _renamed(error: APIError) -> APIError:
    def rename(text: str) -> str:
        for pattern, replacement in _RENAMES:
            text = pattern.sub(replacement, text)
        return text

    return APIError(error.status, rename(error.message),
                    param=None if error.param is None else rename(error.param),
                    code=error.code, type=error.type)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Answer:
    """One response being answered: builds its output items and the response object,
    streamed or whole, and stores it (with the conversation so far) when it ends."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str, run: ChatRun,
                 conversation: list[dict[str, Any]], store: ResponseStore | None,
                 token_text: TokenText | None) -> None:
        self.body = body
        self.response_id = response_id
        self.model = model
        self.created_at = int(time.time())
        self.run = run
        self.conversation = conversation
        self.store = store
        self.token_text = token_text
        self.message_id = _item_id("msg")

    @property
    def reader(self) -> ToolCallReader | None:
        return self.run.reader

    def response(self, status: Status, output: list[OutputItem],
                 result: RequestOutput | None = None) -> ResponseObject:
        body = self.body
        finish = result.outputs[0].finish_reason if result is not None else None
        return ResponseObject(
            id=self.response_id, created_at=self.created_at, status=status,
            completed_at=int(time.time()) if result is not None else None,
            incomplete_details=(IncompleteDetails(reason="max_output_tokens")
                                if finish == "length" else None),
            model=self.model, output=output,
            usage=_usage(result) if result is not None else None,
            instructions=body.instructions, previous_response_id=body.previous_response_id,
            max_output_tokens=body.max_output_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_logprobs=body.top_logprobs or 0, tools=body.tools or [],
            tool_choice=body.tool_choice or ("auto" if body.tools else "none"),
            parallel_tool_calls=body.parallel_tool_calls,
            text=body.text or {"format": {"type": "text"}}, truncation=body.truncation,
            metadata=body.metadata or {}, store=body.store, reasoning=body.reasoning,
            user=body.user)

    def split(self, completion: CompletionOutput) -> tuple[str | None, list[ToolCall] | None]:
        if self.reader is None:
            return completion.text, None
        return self.reader.split(completion.text)

    def logprobs(self, completion: CompletionOutput, start: int = 0
                 ) -> list[ChatTokenLogprob] | None:
        if self.token_text is None or completion.logprobs is None:
            return None
        return chat_logprobs(completion.logprobs[start:], self.token_text).content or []

    def items(self, completion: CompletionOutput) -> list[OutputItem]:
        """The message (when there is text, or no call) and one item per call."""
        content, calls = self.split(completion)
        status = _status(completion)
        items: list[OutputItem] = []
        if content or not calls:
            items.append(self.message(content or "", status, self.logprobs(completion)))
        items.extend(FunctionCallItem(id=_item_id("fc"), call_id=call.id,
                                      name=call.function.name,
                                      arguments=call.function.arguments, status="completed")
                     for call in calls or [])
        return items

    def message(self, text: str, status: Status, logprobs: list[ChatTokenLogprob] | None
                ) -> OutputMessage:
        return OutputMessage(id=self.message_id, status=status,
                             content=[OutputText(text=text, logprobs=logprobs)])

    def finish(self, result: RequestOutput) -> ResponseObject:
        """The response with its whole output, kept in the store if asked."""
        completion = result.outputs[0]
        response = self.response(_status(completion), self.items(completion), result)
        if self.store is not None:
            content, calls = self.split(completion)
            answer: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                answer["tool_calls"] = [call.model_dump() for call in calls]
            self.store.put(response, [*self.conversation, answer])
        return response

    async def events(self, context: ServerContext) -> AsyncGenerator[str, None]:
        """OpenAI's event stream: created, in_progress, the message's text as deltas as
        it comes (held back where a tool call may begin, as chat's stream does), each
        item's done events, and the whole response last. That last event is
        "response.completed" whatever the status inside (as vLLM sends it; OpenAI's SDK
        reads the final response only from that event). A failure is an "error" event;
        the stream has no `[DONE]`, as OpenAI's has none."""
        numbers = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            payload = StreamEvent(type=kind, sequence_number=next(numbers), **fields)
            return (f"event: {kind}\ndata: "
                    f"{json.dumps(payload.model_dump(mode='json'), ensure_ascii=False)}\n\n")

        try:
            started = self.response("in_progress", [])
            yield event("response.created", response=started)
            yield event("response.in_progress", response=started)
            sent = 0
            sent_logprobs = 0
            opened = False
            async with aclosing(merged(self.run.streams, context.metrics)) as outputs:
                async for _, result in outputs:
                    completion = result.outputs[0]
                    finished = completion.finish_reason is not None
                    if not finished:
                        shown = (completion.text if self.reader is None
                                 else self.reader.streamed_content(completion.text))
                    else:
                        shown = self.split(completion)[0] or ""
                    if len(shown) > sent:
                        if not opened:
                            yield _open_events(self, event)
                            opened = True
                        logprobs = (self.logprobs(completion, sent_logprobs)
                                    if self.reader is None else None)
                        sent_logprobs = len(completion.logprobs or [])
                        yield event("response.output_text.delta", item_id=self.message_id,
                                    output_index=0, content_index=0, delta=shown[sent:],
                                    logprobs=logprobs or [])
                        sent = len(shown)
                    if finished:
                        response = self.finish(result)
                        for index, item in enumerate(response.output):
                            if isinstance(item, OutputMessage) and not opened:
                                yield _open_events(self, event)
                            for text in _item_done_events(item, index, event):
                                yield text
                        yield event("response.completed", response=response)
        except Exception as error:  # noqa: BLE001 - reported to the client as OpenAI does
            info = failure(error)
            yield event("error", code=info.code or info.type, message=info.message,
                        param=info.param)


def _open_events(answer: _Answer, event: Callable[..., str]) -> str:
    """The events that open the message item, before its first text."""
    return (event("response.output_item.added", output_index=0,
                  item=answer.message("", "in_progress", None).model_copy(
                      update={"content": []}))
            + event("response.content_part.added", item_id=answer.message_id,
                    output_index=0, content_index=0, part=OutputText(text="")))


def _item_done_events(item: OutputItem, index: int, event: Callable[..., str]
                      ) -> list[str]:
    """The events that close an item: a message's text and part done, or a function
    call added whole with its arguments in one delta; then the item done."""
    if isinstance(item, OutputMessage):
        part = item.content[0]
        return [event("response.output_text.done", item_id=item.id, output_index=index,
                      content_index=0, text=part.text, logprobs=part.logprobs or []),
                event("response.content_part.done", item_id=item.id, output_index=index,
                      content_index=0, part=part),
                event("response.output_item.done", output_index=index, item=item)]
    return [event("response.output_item.added", output_index=index,
                  item=item.model_copy(update={"arguments": "", "status": "in_progress"})),
            event("response.function_call_arguments.delta", item_id=item.id,
                  output_index=index, delta=item.arguments),
            event("response.function_call_arguments.done", item_id=item.id,
                  output_index=index, arguments=item.arguments),
            event("response.output_item.done", output_index=index, item=item)]


def _status(completion: CompletionOutput) -> Status:
    """Cut by max_output_tokens: incomplete (OpenAI's reason); otherwise completed."""
    return "incomplete" if completion.finish_reason == "length" else "completed"


def _usage(result: RequestOutput) -> ResponseUsage:
    counted = usage([result])
    cached = counted.prompt_tokens_details.cached_tokens if counted.prompt_tokens_details else 0
    return ResponseUsage(input_tokens=counted.prompt_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached),
                         output_tokens=counted.completion_tokens,
                         total_tokens=counted.total_tokens)
