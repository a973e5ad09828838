"""POST /v1/responses (OpenAI's Responses API), and the stored responses' GET and DELETE.

A response is a chat completion underneath, as in vLLM: the input (after the stored
conversation of `previous_response_id`) becomes a chat conversation (responses_to_chat.py),
and the one chat path renders, queues and reads tool calls. Only the shapes differ: the
answer comes back as output items (a message of `output_text`, then one `function_call`
item per call), and a stream is OpenAI's typed events (`response.output_text.delta`, ...)
rather than chat chunks.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagellm.engine.outputs import CompletionOutput, RequestOutput
from pagellm.entrypoints.openai.chat_bridge import Conversation, split_answer, streamed_text
from pagellm.entrypoints.openai.errors import APIError, bad_request, failure
from pagellm.entrypoints.openai.json_text import JSONResponse
from pagellm.entrypoints.openai.logprobs import TokenText, chat_logprobs
from pagellm.entrypoints.openai.protocol import ChatTokenLogprob
from pagellm.entrypoints.openai.reasoning import answer_parts, count_reasoning_tokens
from pagellm.entrypoints.openai.response_store import ResponseStore
from pagellm.entrypoints.openai.responses_protocol import (
    DeletedResponse,
    FunctionCallItem,
    IncompleteDetails,
    InputItemList,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    Status,
    StreamEvent,
)
from pagellm.entrypoints.openai.responses_to_chat import (
    chat_request,
    check_options,
    client_item_ids,
    conversation_of,
    input_items,
    renamed,
    resolve_references,
    wants_logprobs,
)
from pagellm.entrypoints.openai.serving import (
    ServerContext,
    check_max_tokens,
    final_outputs,
    fits_context,
    merged,
    usage,
)
from pagellm.entrypoints.openai.serving_chat import ChatRun, render_messages, start_chat
from pagellm.entrypoints.openai.transport import EventStreamResponse, sse, unless_disconnected

Emit = Callable[..., str]


async def create_response(context: ServerContext, store: ResponseStore,
                          body: ResponsesRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    context.check_model(body.model)
    check_max_tokens(body.max_output_tokens, context.engine.max_model_len, "max_output_tokens")
    client_ids = client_item_ids(body.input)
    body = body.model_copy(update={"input": resolve_references(body.input, store.item)})
    check_options(body)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = previous.conversation
        if body.cache_salt is None and previous.cache_salt is not None:
            # Its turns are cached under its salt: a follow-up that forgets the salt
            # would compute them again, and cache a tenant's history unsalted.
            body = body.model_copy(update={"cache_salt": previous.cache_salt})
    conversation = conversation_of(history, body.input)
    if not conversation.messages:
        raise bad_request("input has no message to answer (reasoning items are dropped)",
                          param="input")
    response_id = f"resp_{uuid.uuid4().hex}"
    try:
        if body.truncation == "auto":
            # Before the request starts: one that fits with a cut budget would start,
            # and a longer history would then get a longer answer than a shorter one.
            conversation = await _fitting(context, body, conversation) or conversation
        run = await start_chat(context, chat_request(body, conversation), arrival, response_id)
    except APIError as error:
        raise renamed(error, body, conversation) from error
    answer = ResponseAnswer(body, response_id, context.model_name, run, conversation,
                            store if body.store else None,
                            context.token_text() if wants_logprobs(body) else None,
                            client_ids)
    if body.stream:
        return EventStreamResponse(answer.events(context), run.streams,
                                   context.sse_keep_alive)
    outputs = await unless_disconnected(raw, final_outputs(run.streams, context.metrics))
    return JSONResponse((await answer.finished(context, outputs[0])).model_dump(mode="json"))


async def _fitting(context: ServerContext, body: ResponsesRequest, conversation: Conversation
                   ) -> Conversation | None:
    """truncation "auto": the conversation less as few of its oldest turns as make it fit
    beside max_output_tokens (OpenAI's rule; the instructions stay; the model's default
    and the operator's cap apply as to any request); where no tail leaves that much
    room, as few as leave room for min_tokens (or one token; the budget is then cut, as
    always); None if even the last turn does not. Turns drop whole, so the longer tails
    only ever fit less: once the whole conversation is found not to fit (the usual case
    is that it does), a binary search renders O(log turns) tails on the tokenizer
    thread."""
    starts = [0, *conversation.turn_starts()]  # 0: the whole conversation
    limit = context.engine.max_model_len
    lengths: dict[int, int] = {}

    async def length(start: int) -> int:
        if start not in lengths:
            lengths[start] = len(await context.off_loop(
                render_messages, context, chat_request(body, conversation.tail(start))))
        return lengths[start]

    async def earliest(budget: int | None) -> int | None:
        """The earliest turn start whose tail fits beside `budget`."""
        if fits_context(limit, await length(0), budget):
            return 0
        best = None
        low, high = 0, len(starts)
        while low < high:
            middle = (low + high) // 2
            if fits_context(limit, await length(starts[middle]), budget):
                best = high = middle
            else:
                low = middle + 1
        return best

    least = body.min_tokens or None  # what the answer needs at the least
    defaults = context.engine.generation_defaults
    asked = (body.max_output_tokens if body.max_output_tokens is not None
             else defaults.sampling.get("max_tokens"))
    wanted = min((n for n in (asked, defaults.max_tokens_limit) if n is not None),
                 default=None)  # the budget the answer will run with (see sampling.py)
    best = await earliest(wanted if wanted is not None else least)
    if best is None and wanted is not None:
        best = await earliest(least)
    return None if best is None else conversation.tail(starts[best])


def retrieve_response(store: ResponseStore, response_id: str) -> ResponseObject:
    """A stored response, as it was answered (a 404 once deleted or forgotten)."""
    stored = store.get(response_id)
    if stored is None:
        raise _not_found(response_id, "response_id")
    return stored.response


def list_input_items(store: ResponseStore, response_id: str, after: str | None, limit: int,
                     order: str) -> InputItemList:
    """A stored response's input items, a page at a time (OpenAI's cursor: the items
    after the id `after`, in `order`, newest first by default)."""
    stored = store.get(response_id)
    if stored is None:
        raise _not_found(response_id, "response_id")
    if not 1 <= limit <= 100:
        raise bad_request(f"limit must be in [1, 100], got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc', got {order!r}", param="order")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"after: no input item {after!r} in response {response_id!r}",
                              param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                         last_id=page[-1]["id"] if page else None,
                         has_more=len(items) > limit)


def delete_response(store: ResponseStore, response_id: str) -> DeletedResponse:
    """Forgets a stored response; continuing from it is a 404 afterwards."""
    if not store.delete(response_id):
        raise _not_found(response_id, "response_id")
    return DeletedResponse(id=response_id)


def cancel_response(store: ResponseStore, response_id: str) -> ResponseObject:
    """vLLM's answer: only a background response can be cancelled, and there are none
    here (a stored one has finished); an unknown id is a 404."""
    retrieve_response(store, response_id)
    raise bad_request("Cannot cancel a synchronous response.", param="response_id")


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param=param)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _status(completion: CompletionOutput) -> Status:
    """Cut by max_output_tokens: incomplete (OpenAI's reason); otherwise completed."""
    return "incomplete" if completion.finish_reason == "length" else "completed"


class ResponseAnswer:
    """One response being answered: builds its output items and the response object,
    streamed or whole, and stores it (with the conversation so far) when it ends."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str, run: ChatRun,
                 conversation: Conversation, store: ResponseStore | None,
                 token_text: TokenText | None,
                 client_ids: frozenset[str] = frozenset()) -> None:
        """`client_ids`: the ids the client wrote on its input items (see
        ResponseStore.put)."""
        self.body = body
        self.client_ids = client_ids
        self.response_id = response_id
        self.model = model
        self.created_at = int(time.time())
        self.run = run
        self.conversation = conversation
        self.store = store
        self.token_text = token_text
        self.message_id = _item_id("msg")
        self.reasoning_id = _item_id("rs")

    def response(self, status: Status, output: list[OutputItem],
                 result: RequestOutput | None = None, reasoning_tokens: int = 0
                 ) -> ResponseObject:
        """The response object: the output so far, and the request's settings echoed."""
        body = self.body
        text = body.text or {}
        return ResponseObject(
            id=self.response_id, created_at=self.created_at, status=status,
            completed_at=int(time.time()) if result is not None else None,
            incomplete_details=(IncompleteDetails(reason="max_output_tokens")
                                if status == "incomplete" else None),
            model=self.model, output=output,
            usage=_usage(result, reasoning_tokens) if result is not None else None,
            instructions=body.instructions, previous_response_id=body.previous_response_id,
            max_output_tokens=self.run.params.max_tokens,
            temperature=self.run.params.temperature, top_p=self.run.params.top_p,
            top_logprobs=body.top_logprobs or 0, tools=body.tools or [],
            tool_choice=body.tool_choice or "auto",
            parallel_tool_calls=body.parallel_tool_calls,
            text={**text, "format": text.get("format") or {"type": "text"}},
            truncation=body.truncation, metadata=body.metadata or {}, store=body.store,
            reasoning=body.reasoning, max_tool_calls=body.max_tool_calls,
            prompt_cache_key=body.prompt_cache_key, safety_identifier=body.safety_identifier,
            user=body.user)

    def logprobs(self, completion: CompletionOutput, start: int = 0
                 ) -> list[ChatTokenLogprob] | None:
        """The logprobs of the completion's tokens from `start`, if they were asked for."""
        if self.token_text is None or completion.logprobs is None:
            return None
        return chat_logprobs(completion.logprobs[start:], self.token_text).content or []

    def message(self, text: str, status: Status, logprobs: list[ChatTokenLogprob] | None
                ) -> OutputMessage:
        return OutputMessage(id=self.message_id, status=status,
                             content=[OutputText(text=text, logprobs=logprobs)])

    def reasoning(self, text: str, status: Status) -> ReasoningItem:
        return ReasoningItem(id=self.reasoning_id, status=status,
                             content=[ReasoningText(text=text)])

    async def finished(self, context: ServerContext, result: RequestOutput) -> ResponseObject:
        """`finish`, with the reasoning's tokens counted on the tokenizer thread (the
        tokenizer is not safe to share with it, and a long reasoning is slow to encode
        on the event loop)."""
        reasoning, _ = answer_parts(self.run.thinking, result.outputs[0])
        counted = (await context.off_loop(count_reasoning_tokens, context.engine.tokenizer,
                                          reasoning)) if reasoning else 0
        return self.finish(result, counted)

    def finish(self, result: RequestOutput, reasoning_tokens: int = 0) -> ResponseObject:
        """The whole response: the reasoning (with a reasoning parser, when there is
        some), the message (when there is text, or no call) and one item per call, read
        once, so that the stored conversation carries the very call ids the client
        answers with; kept in the store if asked (without the reasoning, which chat
        templates leave out of earlier turns). A call cut short is text (see
        split_answer)."""
        completion = result.outputs[0]
        reasoning, answer = answer_parts(self.run.thinking, completion)
        content, calls = split_answer(self.run.reader, answer)
        status = _status(completion)
        output: list[OutputItem] = [self.reasoning(reasoning, "completed")] if reasoning else []
        if content or not calls:
            output.append(self.message(content or "", status, self.logprobs(completion)))
        output.extend(FunctionCallItem(id=_item_id("fc"), call_id=call.id,
                                       name=call.function.name,
                                       arguments=call.function.arguments,
                                       status="completed")
                      for call in calls or [])
        response = self.response(status, output, result, reasoning_tokens)
        if self.store is not None:
            turn: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                turn["tool_calls"] = [call.model_dump() for call in calls]
            self.store.put(response, [*self.conversation.messages, turn],
                           input_items(self.body.input), self.client_ids,
                           self.body.cache_salt)
        return response

    async def events(self, context: ServerContext) -> AsyncGenerator[str, None]:
        """OpenAI's event stream: created, in_progress; with a reasoning parser, the
        reasoning item's text as deltas, closed once the message's text begins; the
        message's text as deltas as it comes (held back where a tool call may begin, as
        chat's stream does; each delta with the logprobs of the tokens since the last),
        each item's done events, and the whole response last. That last event is
        "response.completed" whatever the status inside (as vLLM sends it; OpenAI's SDK
        reads the final response only from that event). A failure is an "error" event;
        the stream has no `[DONE]`, as OpenAI's has none."""
        numbers = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            payload = StreamEvent(type=kind, sequence_number=next(numbers), **fields)
            return sse(payload.model_dump(mode="json"), kind)

        sent = sent_logprobs = sent_thought = 0
        opened = thinking = thought = False
        try:
            started = self.response("in_progress", [])
            yield event("response.created", response=started)
            yield event("response.in_progress", response=started)
            async with aclosing(merged(self.run.streams, context.metrics)) as outputs:
                async for _, result in outputs:
                    completion = result.outputs[0]
                    reasoning, answer = answer_parts(self.run.thinking, completion)
                    if len(reasoning) > sent_thought:
                        if not thinking:
                            yield self._opening_reasoning(event)
                            thinking = True
                        yield event("response.reasoning_text.delta", item_id=self.reasoning_id,
                                    output_index=0, content_index=0,
                                    delta=reasoning[sent_thought:])
                        sent_thought = len(reasoning)
                    response = None
                    if completion.finish_reason is None:
                        shown = streamed_text(self.run.reader, answer)
                    else:
                        response = await self.finished(context, result)
                        message = next((item for item in response.output
                                        if isinstance(item, OutputMessage)), None)
                        shown = message.content[0].text if message is not None else ""
                    if thinking and not thought and (shown or response is not None):
                        for text in _closing(self.reasoning(reasoning, "completed"), 0, event):
                            yield text
                        thought = True
                    index = 1 if thinking else 0
                    logprobs = self.logprobs(completion, sent_logprobs)
                    # The last tokens' logprobs (EOS adds no text) close the deltas, so
                    # that they add up to the message's.
                    last = response is not None and message is not None and bool(logprobs)
                    if len(shown) > sent or last:
                        if not opened:
                            yield self._opening(event, index)
                            opened = True
                        yield event("response.output_text.delta", item_id=self.message_id,
                                    output_index=index, content_index=0, delta=shown[sent:],
                                    logprobs=logprobs or [])
                        sent, sent_logprobs = len(shown), len(completion.logprobs or [])
                    if response is not None:
                        for index, item in enumerate(response.output):
                            if isinstance(item, ReasoningItem):
                                continue
                            if isinstance(item, OutputMessage) and not opened:
                                yield self._opening(event, index)
                            for text in _closing(item, index, event):
                                yield text
                        yield event("response.completed", response=response)
        except Exception as error:  # noqa: BLE001 - reported to the client as OpenAI does
            info = failure(error)
            yield event("error", code=info.code or info.type, message=info.message,
                        param=info.param)

    def _opening(self, event: Emit, index: int) -> str:
        """The events that open the message item, before its first text."""
        empty = OutputMessage(id=self.message_id, status="in_progress", content=[])
        return (event("response.output_item.added", output_index=index, item=empty)
                + event("response.content_part.added", item_id=self.message_id,
                        output_index=index, content_index=0, part=OutputText(text="")))

    def _opening_reasoning(self, event: Emit) -> str:
        """The events that open the reasoning item (always the first), as vLLM's."""
        empty = ReasoningItem(id=self.reasoning_id, status="in_progress", content=[])
        return (event("response.output_item.added", output_index=0, item=empty)
                + event("response.content_part.added", item_id=self.reasoning_id,
                        output_index=0, content_index=0, part=ReasoningText(text="")))


def _closing(item: OutputItem, index: int, event: Emit) -> list[str]:
    """The events that close an item: a reasoning item's or a message's text and part
    done, or a function call added whole with its arguments in one delta; then the item
    done."""
    if isinstance(item, ReasoningItem):
        reasoning = item.content[0]
        return [event("response.reasoning_text.done", item_id=item.id, output_index=index,
                      content_index=0, text=reasoning.text),
                event("response.content_part.done", item_id=item.id, output_index=index,
                      content_index=0, part=reasoning),
                event("response.output_item.done", output_index=index, item=item)]
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


def _usage(result: RequestOutput, reasoning_tokens: int) -> ResponseUsage:
    counted = usage([result])
    return ResponseUsage(input_tokens=counted.prompt_tokens,
                         input_tokens_details=InputTokensDetails(
                             cached_tokens=result.num_cached_tokens),
                         output_tokens=counted.completion_tokens,
                         output_tokens_details=OutputTokensDetails(
                             reasoning_tokens=reasoning_tokens),
                         total_tokens=counted.total_tokens)
