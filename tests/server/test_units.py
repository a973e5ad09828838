"""The server's pure parts, without a model: formats, limits, error shapes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import pytest

from pagellm.core.sampling_params import SamplingParams
from pagellm.engine.llm_engine import EngineStats
from pagellm.engine.metrics import (
    CompletionEnd,
    Counter,
    Gauge,
    LatencyHistogram,
    RequestEnd,
    RequestLatencies,
)
from pagellm.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagellm.entrypoints.openai.errors import APIError, validation_error
from pagellm.entrypoints.openai.logprobs import (
    BLOCKED_LOGPROB,
    TokenText,
    chat_logprobs,
    completion_logprobs,
)
from pagellm.entrypoints.openai.messages_protocol import AnthropicMessage
from pagellm.entrypoints.openai.messages_to_chat import conversation_of as messages_conversation
from pagellm.entrypoints.openai.metrics import ServerMetrics, prometheus_text
from pagellm.entrypoints.openai.reasoning import ThinkReasoningParser
from pagellm.entrypoints.openai.response_store import ResponseStore
from pagellm.entrypoints.openai.responses_protocol import (
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
)
from pagellm.entrypoints.openai.responses_to_chat import conversation_of
from pagellm.entrypoints.openai.serving import resolve_max_tokens
from pagellm.entrypoints.openai.serving_chat import ChatRun
from pagellm.entrypoints.openai.serving_responses import ResponseAnswer
from pagellm.entrypoints.openai.stats_logger import describe
from pagellm.entrypoints.openai.tool_calls import ToolCallFormat
from pagellm.entrypoints.openai.transport import KEEP_ALIVE, kept_alive


class FakeTokenizer:
    def decode(self, ids: list[int]) -> str:
        return f"<{ids[0]}>"


def stats(**changes: object) -> EngineStats:
    base = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_blocks=10,
                       num_free_blocks=10, prefix_cache_queries=0, prefix_cache_hits=0,
                       prefix_cache_hit_rate=0.0, num_evictions=0, num_preemptions=0,
                       prompt_tokens=0, generation_tokens=0, prompt_tokens_computed=0,
                       timings={})
    return dataclasses.replace(base, **changes)


def test_blocked_tokens_are_reported_as_finite_logprobs() -> None:
    entries = [Logprob(5, -0.5, 1, [(5, -0.5), (7, float("-inf"))], 3)]
    block = completion_logprobs(entries, TokenText(FakeTokenizer()), None)
    assert block.top_logprobs == [{"<5>": -0.5, "<7>": BLOCKED_LOGPROB}]
    assert block.text_offset == [3]
    chat = chat_logprobs(entries, TokenText(FakeTokenizer()))
    assert chat.content is not None
    assert chat.content[0].top_logprobs[1].logprob == BLOCKED_LOGPROB
    json.dumps(chat.model_dump(mode="json"), allow_nan=False)


def test_histogram_buckets_are_cumulative() -> None:
    histogram = LatencyHistogram("pagellm_time_to_first_token_seconds", (0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 5.0):
        histogram.observe(value)
    snapshot = histogram.snapshot({"model_name": 'a"b'})
    assert (snapshot.count, snapshot.sum) == (4, 5.65)
    assert snapshot.buckets == {"0.1": 2, "1.0": 3, "+Inf": 4}
    lines = prometheus_text([snapshot]).splitlines()
    name = "pagellm_time_to_first_token_seconds"
    assert lines[:2] == [f"# HELP {name} Time from a request's arrival to its first "
                         "generated token.", f"# TYPE {name} histogram"]
    assert f'{name}_bucket{{model_name="a\\"b",le="0.1"}} 2' in lines
    assert f'{name}_bucket{{model_name="a\\"b",le="1.0"}} 3' in lines
    assert f'{name}_bucket{{model_name="a\\"b",le="+Inf"}} 4' in lines
    assert lines[-1] == f'{name}_count{{model_name="a\\"b"}} 4'


def test_prometheus_families_group_their_samples() -> None:
    """Records sharing a name print under one HELP/TYPE pair; vLLM's names take
    PageLLM's help text."""
    text = prometheus_text([
        Counter("pagellm_request_finished", {"finished_reason": "stop"}, 2),
        Counter("pagellm_request_finished", {"finished_reason": "length"}, 1),
        Gauge("vllm:kv_cache_usage_perc", {}, 0.25)])
    assert text.splitlines() == [
        "# HELP pagellm_request_finished_total Completions ended, by finish reason (abort: "
        "unfinished, e.g. the client left).",
        "# TYPE pagellm_request_finished_total counter",
        'pagellm_request_finished_total{finished_reason="stop"} 2',
        'pagellm_request_finished_total{finished_reason="length"} 1',
        "# HELP vllm:kv_cache_usage_perc Fraction of KV cache blocks in use (0 when idle).",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        "vllm:kv_cache_usage_perc 0.25"]


def test_finish_reasons_are_counted_per_completion() -> None:
    """Every completion ends once in the counter, an aborted one too (but with no
    end-to-end time), and /metrics prints the engine's counts."""
    latencies = RequestLatencies(max_model_len=100)
    timing = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.25, first_token_time=1.5,
                            last_token_time=2.0, finished_time=2.0)
    for _ in range(4):
        latencies.first_token(0.5)
    latencies.token_gap(0.5)
    # Two completions of one request: the first stopped early, at its own last token.
    latencies.ended(RequestEnd(timing, [CompletionEnd("stop", 3, 0, 1.75),
                                        CompletionEnd("length", 7, 2, 2.0)], 40, 7,
                               completed=True))
    latencies.ended(RequestEnd(timing, [CompletionEnd("stop", 3), CompletionEnd(None, 1)],
                               40, 7, completed=False))
    latencies.ended(RequestEnd(RequestMetrics(arrival_time=1.0),
                               [CompletionEnd("abort", 0)] * 3, 9, None, completed=False))
    latencies.step(64)
    latencies.output_step(40, 2)  # vLLM's count: its series, not PageLLM's
    assert latencies.requests_finished == {"stop": 2, "length": 1, "abort": 4}
    assert latencies.e2e_request_latency.count == 2
    assert latencies.e2e_request_latency.sum == 0.75 + 1.0
    # vLLM's phases and sizes, of the finished request's two completions.
    assert [(h.count, h.sum) for h in (
        latencies.queue_time, latencies.prefill_time, latencies.decode_time,
        latencies.inference_time, latencies.prompt_tokens, latencies.generation_tokens,
        latencies.params_max_tokens)] == [
        (2, 0.5), (2, 0.5), (2, 0.25 + 0.5), (2, 0.5 + 0.75), (2, 80), (2, 10), (2, 14)]
    assert latencies.time_per_output_token.sum == 0.25 / 2 + 0.5 / 6
    assert [(h.count, h.sum) for h in (
        latencies.params_n, latencies.max_num_generation_tokens, latencies.num_preemptions,
        latencies.iteration_tokens)] == [(1, 2), (1, 7), (2, 2), (1, 64)]
    assert latencies.prompt_tokens.bounds == (1, 2, 5, 10, 20, 50, 100)
    copy = latencies.copy()
    latencies.first_token(0.1)
    assert (copy.time_to_first_token.count, latencies.time_to_first_token.count) == (4, 5)

    class Engine:
        def stats(self) -> EngineStats:
            return stats(latencies=latencies.copy())

    text = ServerMetrics(Engine(), "m").render()  # type: ignore[arg-type]
    # vLLM's series carry its engine label, and count no client aborts (vLLM's do not).
    for reason, count, vllm_count in (("stop", 2, 2), ("length", 1, 1), ("abort", 4, 0),
                                      ("repetition", None, 0)):
        if count is not None:
            assert ('pagellm_request_finished_total{model_name="m",finished_reason='
                    f'"{reason}"}} {count}') in text
        assert ('vllm:request_success_total{model_name="m",finished_reason='
                f'"{reason}",engine="0"}} {vllm_count}') in text
    assert 'pagellm_time_to_first_token_seconds_count{model_name="m"} 5' in text
    assert 'pagellm_request_finished_total{model_name="m",finished_reason="error"} 0' in text
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds",
                 "request_prompt_tokens", "request_generation_tokens",
                 "request_max_num_generation_tokens", "request_params_n",
                 "request_params_max_tokens", "request_num_preemptions",
                 "iteration_tokens_total"):
        assert f"# TYPE vllm:{name} histogram" in text
    assert 'pagellm_iteration_tokens_sum{model_name="m"} 64.0' in text
    assert 'vllm:iteration_tokens_total_sum{model_name="m",engine="0"} 42.0' in text
    assert "# HELP vllm:iteration_tokens_total Tokens of each engine step that produced" in text


def test_request_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    """With --enable-log-requests each request gets a line as it arrives and as it ends,
    saying what the prefix cache gave it."""
    metrics = ServerMetrics(None, "m", log_requests=True)  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, logger="pagellm.entrypoints.openai.metrics")
    metrics.log_received("r1", 1, "params")
    timing = RequestMetrics(arrival_time=1.0, first_token_time=1.5, last_token_time=2.0,
                            finished_time=2.0, token_times=[1.5, 2.0])
    done = [CompletionOutput(0, "a", [1, 2], finish_reason="stop"),
            CompletionOutput(1, "b", [1, 2], finish_reason="length")]
    metrics.log_finished(RequestOutput("r1", None, [1], done, True, metrics=timing,
                                       num_cached_tokens=0))
    partial = [CompletionOutput(0, "a", [1, 2], finish_reason="stop"),
               CompletionOutput(1, "b", [1])]
    metrics.log_aborted("r2", RequestOutput("r2", None, [1], partial, False, metrics=timing))
    metrics.log_aborted("r3", None)
    assert [record.getMessage() for record in caplog.records] == [
        "request r1 received: 1 prompt tokens, 'params'",
        "request r1 finished (length, stop): 1 prompt tokens (0 from the prefix cache), 4 "
        "generated, first token after 0.500 s, 1.000 s in all",
        "request r2 aborted: 1 prompt tokens (0 from the prefix cache), 3 generated, first "
        "token after 0.500 s, 1.000 s in all",
        "request r3 aborted: before its first token"]
    caplog.clear()
    outputs = ServerMetrics(None, "m", log_outputs=True, max_log_len=3)  # type: ignore[arg-type]
    outputs.log_finished(RequestOutput("r4", None, [1], [
        CompletionOutput(0, "Hello", [1, 2], finish_reason="stop"),
        CompletionOutput(1, "it's", [1, 2], finish_reason="stop")], True, metrics=timing,
        num_cached_tokens=0))
    assert caplog.records[0].getMessage().endswith(
        "1.000 s in all, output 0: 'Hel', output 1: \"it'\"")


def test_keep_alive_comments_fill_the_silences() -> None:
    """An SSE comment for each `interval` a stream stays silent, the events themselves
    unchanged, and the stream beneath closed with the wrapper."""
    closed: list[bool] = []

    async def events() -> AsyncGenerator[str, None]:
        try:
            yield "data: 1\n\n"
            await asyncio.sleep(0.35)
            yield "data: 2\n\n"
            await asyncio.sleep(3600)
            yield "never"
        finally:
            closed.append(True)

    async def read() -> list[str]:
        seen: list[str] = []
        async with aclosing(kept_alive(events(), 0.1)) as stream:
            async for event in stream:
                seen.append(event)
                if event == "data: 2\n\n":
                    break
        return seen

    seen = asyncio.run(read())
    assert seen[0] == "data: 1\n\n" and seen[-1] == "data: 2\n\n"
    assert set(seen[1:-1]) == {KEEP_ALIVE} and 2 <= len(seen[1:-1]) <= 4
    assert closed == [True]


@pytest.mark.parametrize(("errors", "param", "message"), [
    ([{"type": "missing", "loc": ("body", "prompt"), "msg": "Field required"}], "prompt",
     "Missing required parameter: 'prompt'."),
    ([{"type": "string_type", "loc": ("body", "messages", 2, "content", "str"),
       "msg": "Input should be a valid string"}], "messages[2].content", "messages[2].content"),
    ([{"type": "int_type", "loc": ("body", "stream_options", "include_usage"),
       "msg": "bad"}], "stream_options.include_usage", "stream_options.include_usage"),
    ([{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON decode error",
       "ctx": {"error": "Expecting value"}}], None, "could not parse the JSON"),
])
def test_validation_errors_name_the_field(errors: list[dict[str, object]], param: str | None,
                                          message: str) -> None:
    error = validation_error(errors)
    assert error.status == 400 and error.param == param
    assert message in error.message


def test_error_body_shape() -> None:
    body = APIError(503, "down").body()
    assert body == {"error": {"message": "down", "type": "server_error", "param": None,
                              "code": None}}


def test_max_tokens_default_fills_the_context_and_a_larger_one_is_cut() -> None:
    assert resolve_max_tokens(100, 30, None, 0, "prompt") == 70
    assert resolve_max_tokens(100, 30, 70, 0, "prompt") == 70
    assert resolve_max_tokens(100, 30, 5, 0, "prompt") == 5
    assert resolve_max_tokens(100, 30, 71, 70, "prompt") == 70  # as vLLM cuts it
    with pytest.raises(APIError) as prompt_too_long:
        resolve_max_tokens(100, 100, None, 0, "messages")
    assert prompt_too_long.value.param == "messages"
    assert "101 tokens (100 in the prompt, 1 for the completion)" in \
        prompt_too_long.value.message
    with pytest.raises(APIError) as asked:  # the completion's tokens as asked
        resolve_max_tokens(100, 120, 3, 0, "prompt")
    assert "123 tokens (120 in the prompt, 3 for the completion)" in asked.value.message
    with pytest.raises(APIError) as too_many_at_least:
        resolve_max_tokens(100, 30, 100, 71, "prompt")
    assert too_many_at_least.value.param == "min_tokens"


def test_stats_line_only_while_busy() -> None:
    idle = stats()
    assert describe(idle, idle, 5.0) is None
    # 100 prompt tokens, 75 of them from the cache: the prompt throughput is the 25
    # computed, as vLLM's line counts it.
    busy = stats(num_running=2, generation_tokens=50, prompt_tokens=100,
                 prompt_tokens_computed=25, prefix_cache_queries=100, prefix_cache_hits=75,
                 kv_cache_usage=0.25, prefix_cache_hit_rate=0.75)
    line = describe(idle, busy, 5.0)
    assert line is not None
    assert "prompt throughput 5.0 tok/s, generation throughput 10.0 tok/s" in line
    assert "running 2, waiting 0 |" in line  # no preemptions, none shown
    assert "KV cache usage 25.0%" in line
    assert "prefix cache hit rate 75.0%" in line
    # Preemptions are the interval's, as vLLM logs them, not the total since start.
    later = dataclasses.replace(busy, num_preemptions=3)
    assert "preempted 3 |" in (describe(busy, later, 5.0) or "")
    assert "preempted" not in (describe(later, later, 5.0) or "")


def test_chat_logprob_bytes_are_the_tokens_own_bytes() -> None:
    """Tokens holding parts of a character decode to U+FFFD each; their `bytes` must be
    their real UTF-8 bytes, so that joined they give back the text."""
    from pagellm.cache_dir import resolve_cache_dir
    from pagellm.model.loader import load_tokenizer
    from pagellm.model.resolve import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(None, resolve_cache_dir()))
    text = " Café 日本語 🎉 ok<|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    token_text = TokenText(tokenizer)
    assert any(token_text(i) == "\ufffd" for i in ids), "the text must split a character"
    entries = [Logprob(i, -1.0, 1, [(i, -1.0)]) for i in ids]
    chat = chat_logprobs(entries, token_text)
    assert chat.content is not None
    joined = b"".join(bytes(entry.bytes or []) for entry in chat.content)
    assert joined.decode() == text
    assert all(entry.top_logprobs[0].bytes == entry.bytes for entry in chat.content)
    # Built once per request on the event loop, so it must not read the whole tokenizer
    # (parsing its JSON took ~120 ms, and 64 concurrent streams went from 3 s to 10 s).
    import time

    costs = []
    for _ in range(3):
        started = time.perf_counter()
        TokenText(tokenizer).bytes(ids[0])
        costs.append(time.perf_counter() - started)
    assert min(costs) < 0.02, costs
    # An added token is written as itself, not in the byte-level alphabet.
    tokenizer.add_tokens(["<café>"])
    added = tokenizer.convert_tokens_to_ids("<café>")
    assert TokenText(tokenizer).bytes(added) == list("<café>".encode())


def test_colliding_token_texts_keep_the_likeliest_logprob() -> None:
    """lm-evaluation-harness calls a scored token greedy when its logprob is the largest
    value of its top_logprobs: a likelier token of the same text must not hide."""
    class Collide:
        def decode(self, ids: list[int]) -> str:
            return "\ufffd" if ids[0] >= 10 else f"<{ids[0]}>"

    entries = [Logprob(12, -3.0, 3, [(5, -0.5), (10, -1.0), (11, -2.0), (12, -3.0)])]
    block = completion_logprobs(entries, TokenText(Collide()), None)
    assert block.top_logprobs == [{"\ufffd": -1.0, "<5>": -0.5}]
    assert block.token_logprobs == [-3.0]
    entries = [Logprob(12, -3.0, 3, [(10, -1.0), (12, -3.0)])]
    block = completion_logprobs(entries, TokenText(Collide()), 1)
    assert block.top_logprobs == [{"\ufffd": -1.0}]  # not greedy: -3.0 is not the max
    entries = [Logprob(5, -0.5, 1, [(5, -0.5), (10, -1.0), (11, -2.0)])]
    block = completion_logprobs(entries, TokenText(Collide()), None)
    assert block.top_logprobs == [{"<5>": -0.5, "\ufffd": -1.0}]


def test_byte_fallback_pieces_give_their_bytes() -> None:
    """SentencePiece tokenizers (Llama 2, Mistral) spell a byte `<0xE6>` and a space `▁`."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581": 3, "a": 4}
    vocab.update({f"<0x{b:02X}>": 5 + b for b in range(256)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>",
                                   byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "),
                                         decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    ids = tokenizer.encode("a 春", add_special_tokens=False)
    token_text = TokenText(tokenizer)
    assert [token_text(i) for i in ids].count("\ufffd") == 3
    joined = b"".join(bytes(token_text.bytes(i)) for i in ids)
    assert joined == " a 春".encode()


def test_tokens_as_token_ids_never_collide() -> None:
    entries = [Logprob(12, -1.0, 1, [(12, -1.0), (13, -2.0)])]
    block = completion_logprobs(entries, TokenText(FakeTokenizer(), as_token_ids=True), None)
    assert block.tokens == ["token_id:12"]
    assert block.top_logprobs == [{"token_id:12": -1.0, "token_id:13": -2.0}]


def test_forced_tool_call_formats() -> None:
    """A named function's answer is its arguments' schema (no keys when it has none);
    "required" is an array of {name, parameters} whose local references are moved to
    where each tool's schema now sits; a whole answer reads back into calls."""
    from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagellm.entrypoints.openai.tool_calls import ToolCallFormat, tool_call_reader

    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    tools = [{"type": "function", "function": {"name": "draw", "parameters": {
                 "type": "object", "properties": {"at": {"$ref": "#/$defs/point"},
                                                  "then": {"$ref": "#"}},
                 "$defs": {"point": point}}}},
             {"type": "function", "function": {"name": "clear"}}]
    user = [{"role": "user", "content": "hi"}]

    def request(**fields: object) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate({"messages": user, "tools": tools, **fields})

    def tool_call_format(body: ChatCompletionRequest) -> ToolCallFormat:
        reader = tool_call_reader(body, None)
        assert isinstance(reader, ToolCallFormat)
        return reader

    named = tool_call_format(request(tool_choice={"type": "function",
                                                  "function": {"name": "clear"}}))
    assert named is not None and named.function == "clear"
    assert named.schema == {"type": "object", "properties": {},
                            "additionalProperties": False}
    content, cut = named.split('{"a"')  # a cut answer is still the named call
    (call,) = cut or []
    assert content is None
    assert (call.function.name, call.function.arguments) == ("clear", '{"a"')

    required = tool_call_format(request(tool_choice="required", parallel_tool_calls=False))
    assert required is not None and required.function is None
    assert required.schema["maxItems"] == 1
    draw = required.schema["items"]["anyOf"][0]["properties"]
    assert draw["name"] == {"const": "draw"} and draw["parameters"]["$defs"] == {"point": point}
    here = "#/items/anyOf/0/properties/parameters"
    assert draw["parameters"]["properties"] == {"at": {"$ref": f"{here}/$defs/point"},
                                                "then": {"$ref": here}}
    assert tools[0]["function"]["parameters"]["properties"]["then"] == {"$ref": "#"}
    from pagellm.core.sampling_params import StructuredOutputsParams
    from pagellm.engine.structured_output import format_error

    assert format_error(StructuredOutputsParams(json=required.schema)) is None  # it compiles
    _, calls = required.split('[{"name": "draw", "parameters": {"at": {"x": 1}}}, '
                           '{"name": "clear", "parameters": {}}]')
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls or []] == [
        ("draw", {"at": {"x": 1}}), ("clear", {})]
    assert required.split('[{"name": "dr') == ('[{"name": "dr', None)
    assert "maxItems" not in tool_call_format(request(tool_choice="required")).schema
    assert tool_call_reader(request(tool_choice="none"), "hermes") is None


def test_hermes_tool_calls_are_read_out_of_the_answer() -> None:
    from pagellm.entrypoints.openai.tool_calls import HermesToolParser

    parser = HermesToolParser()
    text = ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Zürich"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "time", "arguments": {}}')  # left open
    content, calls = parser.split(text)
    assert content == "Let me look.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls or []] == [
        ("weather", {"city": "Zürich"}), ("time", {})]
    assert "Zürich" in (calls or [])[0].function.arguments  # not \\u-escaped
    assert parser.split('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
                        )[1][0].function.arguments == '{"a": 1}'  # already JSON text
    assert parser.split("<tool_call>\n{}</tool_call>")[0] == "<tool_call>\n{}</tool_call>"
    assert parser.split("<tool_call>{not json</tool_call>")[1] is None
    for block in ('{"name": "f", "args": {"a": 1}}', '{"name": "f", "arguments": "a"}',
                  '{"name": "f", "arguments": [1]}', '{"name": "f", "arguments": null}'):
        assert parser.split(f"<tool_call>{block}</tool_call>")[1] is None, block
    (named_only,) = parser.split('<tool_call>{"name": "f"}')[1] or []
    assert named_only.function.arguments == "{}"
    (parameters,) = parser.split('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_c')[1] or []
    assert json.loads(parameters.function.arguments) == {"a": 1}  # a cut closing tag too
    assert parser.split("plain answer") == ("plain answer", None)
    assert parser.split(' \n<tool_call>{"name": "f"}</tool_call>')[0] is None

    # A stream sends the content up to where a call may begin, and nothing blank.
    assert parser.streamed_content("Let me") == "Let me"
    assert parser.streamed_content("Let me <tool") == "Let me "
    assert parser.streamed_content("Let me <toolbox") == "Let me <toolbox"
    assert parser.streamed_content("Let me <tool_call>\n{") == "Let me "
    assert parser.streamed_content("\n<tool_ca") == ""
    assert parser.streamed_content("x<") == "x"


def test_llama3_json_tool_calls_are_the_whole_answer() -> None:
    from pagellm.entrypoints.openai.tool_calls import Llama3JsonToolParser

    parser = Llama3JsonToolParser()
    content, calls = parser.split('<|python_tag|>{"name": "weather", "parameters": '
                                  '{"city": "Oslo"}}; {"name": "time", "arguments": {}}')
    assert content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls or []] == [
        ("weather", {"city": "Oslo"}), ("time", {})]
    assert parser.split(' {"name": "f", "parameters": {"a": 1}}\n')[1] is not None
    for text in ('The answer is {"name": "f", "parameters": {}}',  # prose: content
                 '{"name": "f", "parameters": {}} and then some text',
                 '{"city": "Oslo"}', '{"name": "f", "parameters": ', "Just text."):
        assert parser.split(text) == (text, None), text
    assert parser.streamed_content("  ") == ""
    assert parser.streamed_content("<|python") == ""
    assert parser.streamed_content('{"name"') == ""
    assert parser.streamed_content("Hello") == "Hello"


def _stored(response_id: str, text: str
            ) -> tuple[ResponseObject, list[dict[str, str]], list[dict[str, str]]]:
    response = ResponseObject(
        id=response_id, created_at=0, status="completed", model="m", temperature=1.0,
        top_p=1.0,
        top_logprobs=0, tools=[], tool_choice="none", parallel_tool_calls=True,
        text={"format": {"type": "text"}}, truncation="disabled", metadata={}, store=True)
    return response, [{"role": "user", "content": text}], []


def test_response_store_forgets_the_least_recently_used_past_its_size() -> None:
    one = _stored("resp_1", "a" * 100)
    size = len(one[0].model_dump_json()) + len(json.dumps(one[1])) + len(json.dumps(one[2]))
    store = ResponseStore(max_bytes=2 * size + 10)
    store.put(*one)
    store.put(*_stored("resp_2", "b" * 100))
    assert store.get("resp_1") is not None  # now the most recently used
    store.put(*_stored("resp_3", "c" * 100))
    assert store.get("resp_2") is None and store.get("resp_1") is not None
    assert len(store) == 2 and store.used_bytes <= store.max_bytes
    store.put(*_stored("resp_4", "d" * 10 * size))  # bigger than the store: not kept
    assert store.get("resp_4") is None and len(store) == 2
    assert store.delete("resp_1") and not store.delete("resp_1")
    store.put(*_stored("resp_3", "e"))  # replaced, counted once
    kept = store.get("resp_3")
    assert len(store) == 1 and kept is not None and store.used_bytes == kept.size
    with pytest.raises(ValueError, match="max_bytes"):
        ResponseStore(max_bytes=-1)


def test_response_store_finds_items_until_no_response_holds_them() -> None:
    """An item reference finds an input or output item of any stored response; an item
    listed again by a later response stays found while either is kept."""
    store = ResponseStore()
    first, conversation, _ = _stored("resp_1", "a")
    output = first.model_copy(update={"output": [OutputMessage(
        id="msg_out", status="completed", content=[OutputText(text="Red.")])]})
    store.put(output, conversation, [{"id": "msg_in", "type": "message", "role": "user",
                                      "content": [{"type": "input_text", "text": "a"}]}])
    assert store.item("msg_out")["content"][0]["text"] == "Red."  # type: ignore[index]
    assert store.item("msg_in")["role"] == "user"  # type: ignore[index]
    again, _, _ = _stored("resp_2", "b")
    store.put(again, conversation, [{"id": "msg_out", "type": "message", "role": "assistant",
                                     "content": "Red."}])
    assert store.delete("resp_1")
    assert store.item("msg_in") is None and store.item("msg_out") is not None
    assert store.delete("resp_2") and store.item("msg_out") is None
    # An id the client wrote is listed but never found, even while the response is kept.
    claimed, _, _ = _stored("resp_3", "c")
    store.put(claimed, conversation, [{"id": "msg_1", "type": "message", "role": "user",
                                       "content": "c"}], client_ids=frozenset({"msg_1"}))
    assert store.item("msg_1") is None
    assert store.get("resp_3").input_items[0]["id"] == "msg_1"  # type: ignore[union-attr]


def test_response_store_counts_utf8_bytes() -> None:
    store = ResponseStore()
    response, cjk, items = _stored("resp_1", "\u4e2d" * 100)  # 3 bytes each in UTF-8
    store.put(response, cjk, items)
    assert store.used_bytes >= len(response.model_dump_json()) + 300


def test_a_stored_turn_carries_the_call_ids_the_client_was_given() -> None:
    """The client answers a call by its call_id, so the stored conversation that the
    answer continues must name the call by that same id."""
    store = ResponseStore()
    body = ResponsesRequest(input="Weather?", tool_choice="required",
                            tools=[{"type": "function", "name": "f", "parameters": {}}])
    run = ChatRun("resp_x", [], ToolCallFormat({"type": "array"}, None), SamplingParams())
    answer = ResponseAnswer(body, "resp_x", "m", run, conversation_of([], body.input), store, None)
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "f", "parameters": {}}]'
    response = answer.finish(RequestOutput("resp_x-0", None, [1, 2, 3], [
        CompletionOutput(0, text, [5, 6], finish_reason="stop")], True))
    stored = store.get("resp_x")
    assert stored is not None
    turn = stored.conversation[-1]
    assert [call["id"] for call in turn["tool_calls"]] == [
        item.call_id for item in response.output]  # type: ignore[union-attr]
    assert stored.response.model_dump() == response.model_dump()
    cut = ResponseAnswer(body, "resp_y", "m", run, conversation_of([], body.input), store, None)
    cut_response = cut.finish(RequestOutput("resp_y-0", None, [1, 2, 3], [
        CompletionOutput(0, text[:30], [5, 6], finish_reason="length")], True))
    assert cut_response.status == "incomplete"
    cut_turn = store.get("resp_y").conversation[-1]  # type: ignore[union-attr]
    assert cut_turn == {"role": "assistant", "content": text[:30]}


_USE_A = {"type": "tool_use", "id": "a", "name": "w", "input": {"city": "Paris"}}
_RESULT_A = {"type": "tool_result", "tool_use_id": "a", "content": "Sunny"}


def test_anthropic_blocks_become_the_chat_turns_vllm_makes() -> None:
    """Tool results before the user's text, an assistant's text and tool_use in one turn,
    several results in order, thinking dropped, each message naming its block."""
    messages = [
        AnthropicMessage(role="user", content="Weather in Paris and Rome?"),
        AnthropicMessage(role="assistant", content=[
            {"type": "thinking", "thinking": "two calls", "signature": "s"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "a", "name": "w", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "b", "name": "w", "input": {"city": "Rome"}}]),
        AnthropicMessage(role="user", content=[
            {"type": "text", "text": "Here:"},
            {"type": "tool_result", "tool_use_id": "a", "content": "Sunny"},
            {"type": "tool_result", "tool_use_id": "b",
             "content": [{"type": "text", "text": "Rain"}, {"type": "text", "text": ""}]}]),
    ]
    conversation = messages_conversation([{"type": "text", "text": "Be brief."}], messages)
    assert [m["role"] for m in conversation.messages] == [
        "system", "user", "assistant", "tool", "tool", "user"]
    assistant = conversation.messages[2]
    assert assistant["content"] == [{"type": "text", "text": "Checking."}]
    assert [(c["id"], json.loads(c["function"]["arguments"])["city"])
            for c in assistant["tool_calls"]] == [("a", "Paris"), ("b", "Rome")]
    assert [(m["tool_call_id"], m["content"]) for m in conversation.messages[3:5]] == [
        ("a", "Sunny"), ("b", "Rain")]
    assert conversation.origins == ["system", "messages[0]", "messages[1]",
                                    "messages[2].content[1]", "messages[2].content[2]",
                                    "messages[2]"]


@pytest.mark.parametrize(("messages", "error"), [
    ([("user", [{"type": "tool_result", "tool_use_id": "a", "content": "Sunny"}])],
     "messages[0].content[0].tool_use_id 'a' answers no tool_use block before it"),
    ([("user", "Weather?"), ("assistant", [_USE_A]),
      ("user", [{"type": "tool_result", "tool_use_id": "b", "content": "Sunny"}])],
     "messages[2].content[0].tool_use_id 'b' answers no tool_use block in the assistant turn "
     "at messages[1]"),
    ([("user", "Weather?"), ("assistant", [_USE_A, _USE_A])],
     "messages[1].content[1].id 'a' is the id of an earlier tool_use block of the assistant "
     "turn at messages[1]"),
    ([("user", "Weather?"), ("assistant", [_USE_A]), ("user", "Well?")],
     "the assistant turn at messages[1] has tool_use blocks with no tool_result block in the "
     "user turn after it: 'a'"),
    ([("user", "Weather?"), ("assistant", [_USE_A]), ("assistant", "It is sunny.")],
     "the assistant turn at messages[1] ends the conversation with tool_use blocks"),
    ([("user", "Weather?"), ("assistant", [_USE_A]), ("assistant", [{**_USE_A, "id": "b"}]),
      ("user", [_RESULT_A]), ("assistant", "Sunny.")],
     "the assistant turn at messages[1] has tool_use blocks with no tool_result block in the "
     "user turn after it: 'b'"),
    ([("user", "Weather?"), ("assistant", [_USE_A]), ("user", [_RESULT_A]),
      ("assistant", "Sunny."), ("user", [_RESULT_A])],
     "messages[4].content[0].tool_use_id 'a' answers no tool_use block in the assistant turn "
     "at messages[3]"),
    ([("user", "Weather?"), ("assistant", [_USE_A]), ("user", [_RESULT_A, _RESULT_A])],
     "'a' answers no tool_use block in the assistant turn at messages[1] (or one answered "
     "already)"),
])
def test_anthropic_tool_results_pair_with_the_calls_before_them(
        messages: list[tuple[str, Any]], error: str) -> None:
    """Anthropic's API refuses a result for a call the assistant message before it did
    not make, a call left unanswered, and an id used twice; so do we, naming the block."""
    with pytest.raises(APIError) as refused:
        messages_conversation(None, [AnthropicMessage(role=role, content=content)
                                     for role, content in messages])
    assert error in refused.value.message


def test_anthropic_tool_calls_and_results_may_span_consecutive_messages() -> None:
    """Consecutive messages of one role are one turn to Anthropic: calls may be split
    over assistant messages and their results over user messages."""
    use_b = {**_USE_A, "id": "b"}
    conversation = messages_conversation(None, [
        AnthropicMessage(role="user", content="Weather?"),
        AnthropicMessage(role="assistant", content=[_USE_A]),
        AnthropicMessage(role="assistant", content=[{"type": "text", "text": "And"}, use_b]),
        AnthropicMessage(role="user", content=[_RESULT_A]),
        AnthropicMessage(role="user", content=[{**_RESULT_A, "tool_use_id": "b"}])])
    assert [m["role"] for m in conversation.messages] == [
        "user", "assistant", "assistant", "tool", "tool"]


def test_the_reasoning_parser_splits_as_vllm_and_streams_only_growing_parts() -> None:
    parser = ThinkReasoningParser()
    assert parser.split("I see.</think>\n\nFour.") == ("I see.", "\n\nFour.")
    assert parser.split("<think>Still thinking") == ("Still thinking", None)
    assert parser.split("Done.</think>") == ("Done.", None)
    for answer in ("<think>Let me see.</think>\n\nFour.", "Hm.</think>Yes", "<thi", "</think>x"):
        sent = ("", "")
        for end in range(len(answer) + 1):
            now = parser.streamed(answer[:end])
            assert now[0].startswith(sent[0]) and now[1].startswith(sent[1]), (answer, end)
            sent = now
        reasoning, content = parser.split(answer)
        assert (reasoning or "").startswith(sent[0]) and (content or "").startswith(sent[1])


def test_a_forced_call_replaces_every_other_format_unread() -> None:
    """vLLM's rule: the call is the whole answer, so response_format and a format in
    structured_outputs are dropped (not even checked), and the options stay."""
    from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagellm.entrypoints.openai.sampling import structured_outputs_of

    body = ChatCompletionRequest.model_validate({
        "messages": [], "response_format": {"type": "json_schema", "json_schema": {}},
        "structured_outputs": {"regex": "a+", "disable_any_whitespace": True}})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    forced = structured_outputs_of(body, schema)
    assert forced.field == "tool_choice" and forced.params is not None
    assert forced.params.json == schema and forced.params.disable_any_whitespace
    with pytest.raises(APIError, match="needs json_schema.schema"):
        structured_outputs_of(body)


def test_unset_sampling_fields_take_the_models_defaults() -> None:
    from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from pagellm.entrypoints.openai.sampling import build_sampling_params

    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "presence_penalty": 1.5,
                "max_tokens": 7}

    def build(body: object, max_tokens: int | None) -> object:
        return build_sampling_params(body, max_tokens=max_tokens, logprobs=None,  # type: ignore[arg-type]
                                     prompt_logprobs=None, vocab_size=1000, defaults=defaults)

    unset = build(ChatCompletionRequest.model_validate({"messages": []}), None)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.presence_penalty,
            unset.repetition_penalty, unset.max_tokens) == (0.6, 0.95, 20, 0.0, 1.5, 1.0, 7)
    given = build(ChatCompletionRequest.model_validate(
        {"messages": [], "temperature": 0, "top_k": 0, "presence_penalty": None}), 3)
    assert (given.temperature, given.top_k, given.presence_penalty, given.max_tokens) == (
        0.0, 0, 1.5, 3)
    # Completions' max_tokens defaults to 16 (OpenAI's); only an explicit null falls back.
    assert build(CompletionRequest.model_validate({"prompt": "x"}), 16).max_tokens == 16
    neutral = build_sampling_params(
        ChatCompletionRequest.model_validate({"messages": []}), max_tokens=None,
        logprobs=None, prompt_logprobs=None, vocab_size=1000, defaults={})
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.max_tokens) == (
        1.0, 1.0, 0, None)
    assert neutral.spaces_between_special_tokens
    assert not build(CompletionRequest.model_validate(
        {"prompt": "x", "spaces_between_special_tokens": False}), 16).spaces_between_special_tokens


def test_ignored_fields_are_named_in_a_debug_line(caplog: pytest.LogCaptureFixture) -> None:
    """As vLLM names them: an operator sees that a front-end's Ollama-style `num_ctx` was
    not applied, while the request still runs."""
    from pagellm.entrypoints.openai.protocol import ChatCompletionRequest

    caplog.set_level(logging.DEBUG, logger="pagellm.entrypoints.openai.protocol")
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "num_ctx": 4096,
         "repeat_penalty": 1.1, "temperature": 0.5})
    assert request.temperature == 0.5
    assert "present in the request but ignored: ['num_ctx', 'repeat_penalty']" in caplog.text


def test_integral_numbers_are_integers_and_nothing_else_is_coerced() -> None:
    """JSON has one kind of number: 8.0 where an integer is asked for is 8 (vLLM reads it
    so), in lists and nested bodies too; 8.5, strings and booleans stay refused, and a
    float field keeps its value."""
    from pydantic import ValidationError

    from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    chat = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8.0,
        "top_logprobs": 2.0, "seed": -3.0, "stop_token_ids": [2.0, 7], "temperature": 1.0,
        "stop": ["1.0"], "response_format": {"type": "json_schema", "json_schema": {
            "schema": {"type": "number", "minimum": 1.0}}}})
    assert (chat.max_completion_tokens, chat.top_logprobs, chat.seed, chat.stop_token_ids) == \
        (8, 2, -3, [2, 7])
    assert all(type(v) is int for v in (chat.max_completion_tokens, chat.seed,
                                         *(chat.stop_token_ids or [])))
    assert chat.temperature == 1.0 and chat.stop == ["1.0"]
    assert chat.response_format is not None
    assert type(chat.response_format["json_schema"]["schema"]["minimum"]) is float
    completion = CompletionRequest.model_validate({"prompt": [[1.0, 2.0], [3.0]],
                                                   "stream_options": {"include_usage": True}})
    assert completion.prompt == [[1, 2], [3]]
    for field, value in [("max_tokens", 8.5), ("max_tokens", "8"), ("n", True),
                         ("stream", 1), ("prompt", [1.5]), ("max_tokens", float("inf"))]:
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": "x", field: value})
