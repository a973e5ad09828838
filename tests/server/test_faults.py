"""Faults inside one request fail that request only; the engine thread survives them.

These run the app in-process (httpx's ASGI transport) on a real engine, so a fault can be
injected exactly where it is wanted.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagellm.core.sampling_params import SamplingParams
from pagellm.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from pagellm.engine.config import EngineConfig
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.openai import api_server, serving_completion
from pagellm.entrypoints.openai.api_server import ServerSettings, create_app
from tests.server.conftest import MODEL_NAME


@pytest.fixture(scope="module")
def llm_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory_bytes=32 << 20, max_model_len=256))


@pytest.fixture()
def engine(llm_engine: LLMEngine) -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine(lambda: llm_engine)
    yield engine
    engine.shutdown()
    assert not llm_engine.has_unfinished_requests()
    assert llm_engine.get_stats().kv_cache_usage == 0


def post_all(engine: AsyncLLMEngine, bodies: list[dict[str, Any]],
             api_key: str | list[str] | None = None, headers: dict[str, str] | None = None,
             path: str = "/v1/completions") -> list[httpx.Response]:
    app = create_app(engine, ServerSettings(model_names=[MODEL_NAME], api_key=api_key))

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     headers=headers, timeout=60) as client:
            return list(await asyncio.gather(*[
                client.post(path, json=body) for body in bodies]))

    return asyncio.run(run())


def test_the_model_path_as_given_is_answered_to_not_listed(engine: AsyncLLMEngine) -> None:
    """vLLM serves a model under its path as given, which its clients send; PageLLM lists
    the short name only and answers to both."""
    path = "/models/SmolLM2-135M-Instruct/"
    app = create_app(engine, ServerSettings(model_names=[MODEL_NAME], model_aliases=[path]))

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     timeout=60) as client:
            return [await client.post("/v1/completions", json={
                        "model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0})
                    for model in (path, MODEL_NAME, "/models/other")] + [
                    await client.get("/v1/models")]

    by_path, by_name, other, models = asyncio.run(run())
    assert by_path.status_code == by_name.status_code == 200
    assert by_path.json()["choices"][0]["text"] == by_name.json()["choices"][0]["text"]
    assert by_path.json()["model"] == MODEL_NAME
    assert other.status_code == 404
    assert [card["id"] for card in models.json()["data"]] == [MODEL_NAME]


def fail_the_third_model_run(engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = engine.engine.runner
    execute = runner.execute
    calls = {"n": 0}

    def flaky_execute(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected model failure")
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", flaky_execute)


def test_a_bug_in_one_request_fails_only_that_request(
        engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    original = serving_completion._response

    def response(context: Any, request_id: str, body: Any, outputs: Any) -> Any:
        if outputs[0].prompt == "boom":
            raise RuntimeError("injected")
        return original(context, request_id, body, outputs)

    monkeypatch.setattr(serving_completion, "_response", response)
    failed, served = post_all(engine, [{"prompt": "boom", "max_tokens": 3},
                                       {"prompt": "Hello", "max_tokens": 3}])
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "server_error"
    assert served.status_code == 200, served.text
    assert post_all(engine, [{"prompt": "Again", "max_tokens": 2}])[0].status_code == 200


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(
        engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    step = engine.engine.step
    calls = {"n": 0}

    def flaky_step() -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected step failure")
        return step()

    monkeypatch.setattr(engine.engine, "step", flaky_step)
    failed = post_all(engine, [{"prompt": "Hello", "max_tokens": 4}])[0]
    assert failed.status_code == 500
    assert "injected step failure" in failed.json()["error"]["message"]
    assert post_all(engine, [{"prompt": "Hello", "max_tokens": 2}])[0].status_code == 200


def test_a_failing_model_run_fails_a_beam_search_and_only_it(
        engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The third model run is one of the search's later steps: the search fails with its
    error and its other beams are dropped; a request after it is served."""
    fail_the_third_model_run(engine, monkeypatch)
    failed = post_all(engine, [{"prompt": "Hello", "max_tokens": 8, "n": 3,
                                "use_beam_search": True, "ignore_eos": True}])[0]
    assert failed.status_code == 500
    assert "injected model failure" in failed.json()["error"]["message"]
    served = post_all(engine, [{"prompt": "Hello", "max_tokens": 4, "n": 2,
                                "use_beam_search": True}])[0]
    assert served.status_code == 200, served.text
    assert len(served.json()["choices"]) == 2


def test_an_aborted_beam_search_frees_its_beams(engine: AsyncLLMEngine) -> None:
    from pagellm.core.sampling_params import BeamSearchParams

    aborted_before = engine.stats().latencies.requests_finished.get("abort", 0)

    async def run() -> None:
        stream = await engine.add_request(
            "search", "Hello there", BeamSearchParams(beam_width=4, max_tokens=200,
                                                      ignore_eos=True))
        await asyncio.sleep(0.3)  # a few steps in
        stream.abort()
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not engine.stats().num_running and not engine.stats().kv_cache_usage:
                break
        assert not engine.engine.has_unfinished_requests()
        assert engine.stats().kv_cache_usage == 0

    asyncio.run(run())
    # Recorded once, as a request of four completions, not once per step of its beams.
    assert engine.stats().latencies.requests_finished["abort"] == aborted_before + 4


def test_a_failing_model_run_fails_the_stream_with_an_error_event(
        engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    fail_the_third_model_run(engine, monkeypatch)
    response = post_all(engine, [{"prompt": "Hello", "max_tokens": 6, "stream": True}])[0]
    assert response.status_code == 200
    events = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert '"error"' in events[-2] and "injected model failure" in events[-2]
    assert events[-1] == "data: [DONE]"


def test_a_failing_model_run_ends_a_responses_stream_with_an_error_event(
        engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenAI's form: an `error` event (type, code, message), and no `[DONE]`."""
    fail_the_third_model_run(engine, monkeypatch)
    response = post_all(engine, [{"input": "Hello", "max_output_tokens": 6, "stream": True}],
                        path="/v1/responses")[0]
    assert response.status_code == 200
    blocks = [block for block in response.text.split("\n\n") if block]
    assert blocks[-1].startswith("event: error\n")
    last = json.loads(blocks[-1].split("data: ", 1)[1])
    assert last["type"] == "error" and "injected model failure" in last["message"]
    assert last["code"] == "server_error" and "[DONE]" not in response.text


def test_a_failing_model_run_ends_a_messages_stream_with_an_error_event(
        engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    fail_the_third_model_run(engine, monkeypatch)
    response = post_all(engine, [{"max_tokens": 6, "stream": True,
                                  "messages": [{"role": "user", "content": "Hello"}]}],
                        path="/v1/messages")[0]
    blocks = [block for block in response.text.split("\n\n") if block]
    assert blocks[0].startswith("event: message_start\n")
    assert blocks[-1].startswith("event: error\n")
    last = json.loads(blocks[-1].split("data: ", 1)[1])
    assert last["error"]["type"] == "api_error"
    assert "injected model failure" in last["error"]["message"]


def test_api_key_guards_the_api(engine: AsyncLLMEngine) -> None:
    """/v1 and SageMaker's /invocations, and /tokenize and /detokenize, which would read
    the chat template (and a system prompt an operator put in it) back to anyone."""
    for path in ("/tokenize", "/detokenize", "/invocations"):
        refused = post_all(engine, [{"prompt": "Hi", "tokens": [1]}], api_key="s3cret",
                           path=path)[0]
        assert refused.status_code == 401, path
    body = {"prompt": "Hi", "max_tokens": 1}
    missing = post_all(engine, [body], api_key="s3cret")[0]
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    wrong = post_all(engine, [body], api_key="s3cret",
                     headers={"Authorization": "Bearer nope"})[0]
    assert wrong.status_code == 401
    right = post_all(engine, [body], api_key="s3cret",
                     headers={"Authorization": "Bearer s3cret"})[0]
    assert right.status_code == 200, right.text
    # The scheme's case does not matter (RFC 7235, as vLLM reads it); of a repeated
    # header the first counts, as Starlette reads it.
    for value in ("bearer s3cret", "BEARER s3cret"):
        assert post_all(engine, [body], api_key="s3cret",
                        headers={"Authorization": value})[0].status_code == 200, value
    for pair, status in (([("Authorization", "Bearer s3cret"), ("Authorization", "Bearer x")],
                          200),
                         ([("Authorization", "Bearer x"), ("Authorization", "Bearer s3cret")],
                          401)):
        app = create_app(engine, ServerSettings(model_names=[MODEL_NAME], api_key="s3cret"))
        answer = asyncio.run(_raw_post(app, "/v1/completions", body, pair))
        assert answer.status_code == status, pair
    # Several keys (vLLM's list, for rotating them): any one of them is let in.
    for key, status in (("old", 200), ("new", 200), ("s3cret", 401)):
        answer = post_all(engine, [body], api_key=["old", "new"],
                          headers={"Authorization": f"Bearer {key}"})[0]
        assert answer.status_code == status, key


async def _raw_post(app: Any, path: str, body: dict[str, Any],
                    headers: list[tuple[str, str]]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test", timeout=60) as client:
        return await client.post(path, json=body, headers=httpx.Headers(headers))


def test_anthropic_clients_may_send_the_key_as_x_api_key(engine: AsyncLLMEngine) -> None:
    body = {"max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    right, wrong, missing = (
        post_all(engine, [body], api_key="s3cret", headers=headers, path="/v1/messages")[0]
        for headers in ({"x-api-key": "s3cret"}, {"x-api-key": "nope"}, {}))
    assert right.status_code == 200, right.text
    assert wrong.status_code == missing.status_code == 401
    assert wrong.json() == {"type": "error", "error": {
        "type": "authentication_error", "message": "Incorrect API key provided."}}


def test_reset_prefix_cache_empties_the_cache_when_idle(engine: AsyncLLMEngine) -> None:
    """vLLM's POST /reset_prefix_cache: a repeat is served from the cache, and after a
    reset it is computed again; it fails while a request holds blocks unless asked to
    preempt it, and needs the API key when the server has one."""
    app = create_app(engine, ServerSettings(model_names=[MODEL_NAME], api_key="s3cret"))
    body = {"prompt": "The history of the paged KV cache, told briefly. " * 4, "max_tokens": 1}
    key = {"Authorization": "Bearer s3cret"}

    async def cached_tokens(client: httpx.AsyncClient) -> int:
        reply = await client.post("/v1/completions", json=body, headers=key)
        return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     timeout=60) as client:
            await cached_tokens(client)
            assert await cached_tokens(client) > 0
            assert (await client.post("/reset_prefix_cache")).status_code == 401
            assert (await client.get("/tokenizer_info")).status_code == 401  # the template
            reset = await client.post("/reset_prefix_cache", headers=key)
            assert reset.status_code == 200 and reset.json() == {"success": True}
            assert await cached_tokens(client) == 0
            stream = await engine.add_request("holding", "Hello there",
                                              SamplingParams(max_tokens=50, ignore_eos=True))
            async with stream:
                await stream.__anext__()
                busy = await client.post("/reset_prefix_cache", headers=key)
                assert busy.json() == {"success": False}
                # vLLM's query option preempts the holder (it recomputes and goes on).
                forced = await client.post("/reset_prefix_cache?reset_running_requests=true",
                                           headers=key)
                assert forced.json() == {"success": True}
                async for output in stream:
                    last = output
                assert len(last.outputs[0].token_ids) == 50

    asyncio.run(run())


def test_cors_as_vllm_offers_it(engine: AsyncLLMEngine) -> None:
    """--allowed-origins: a browser's preflight is answered without the key, and
    answers (a 401 too) carry the CORS headers; with no origin allowed, none do."""
    origin = {"Origin": "http://app.example"}
    preflight = {**origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}

    async def run(settings: ServerSettings) -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=create_app(engine, settings))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.options("/v1/chat/completions", headers=preflight),
                    await client.post("/v1/completions", headers=origin,
                                      json={"prompt": "Hi", "max_tokens": 1}),
                    await client.get("/health", headers=origin)]

    allowing = ServerSettings(model_names=[MODEL_NAME], api_key="s3cret",
                              allowed_origins=["http://app.example"])
    asked, refused, health = asyncio.run(run(allowing))
    assert asked.status_code == 200, asked.text
    assert asked.headers["access-control-allow-origin"] == "http://app.example"
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == "http://app.example"
    assert health.headers["access-control-allow-origin"] == "http://app.example"
    closed = asyncio.run(run(ServerSettings(model_names=[MODEL_NAME])))
    assert all("access-control-allow-origin" not in r.headers for r in closed)


def test_admin_keys_alone_open_the_cache_stream_and_reset(engine: AsyncLLMEngine) -> None:
    """On a server shared by tenants, a client's key must not read every tenant's cached
    prompts from the event stream, nor empty everyone's cache: with admin keys, those
    two take an admin key and no client key; the API takes the client keys as before."""
    app = create_app(engine, ServerSettings(model_names=[MODEL_NAME], api_key="tenant",
                                            admin_api_key=["operator"]))

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     timeout=60) as client:
            def auth(key: str) -> dict[str, str]:
                return {"Authorization": f"Bearer {key}"}
            return [await client.post("/reset_prefix_cache", headers=auth("tenant")),
                    await client.get("/kv_cache_events", headers=auth("tenant")),
                    await client.post("/reset_prefix_cache", headers=auth("operator")),
                    await client.get("/kv_cache_events", headers=auth("operator")),
                    await client.post("/v1/completions", headers=auth("tenant"),
                                      json={"prompt": "Hi", "max_tokens": 1}),
                    await client.post("/v1/completions", headers=auth("operator"),
                                      json={"prompt": "Hi", "max_tokens": 1})]

    tenant_reset, tenant_events, reset, events, completion, operator_completion = asyncio.run(run())
    for refused in (tenant_reset, tenant_events):
        assert refused.status_code == 401
        assert "--admin-api-key" in refused.json()["error"]["message"]
    assert reset.status_code == 200 and reset.json() == {"success": True}
    assert events.status_code == 404  # past the key: the events are off on this server
    assert completion.status_code == 200, completion.text
    assert operator_completion.status_code == 401
    open_api = create_app(engine, ServerSettings(model_names=[MODEL_NAME],
                                                 admin_api_key=["operator"]))

    async def without_key() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=open_api)
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     timeout=60) as client:
            return [await client.post("/reset_prefix_cache"),
                    await client.post("/v1/completions", json={"prompt": "Hi",
                                                               "max_tokens": 1})]

    reset_refused, served = asyncio.run(without_key())
    assert reset_refused.status_code == 401 and served.status_code == 200, served.text
    with pytest.raises(ValueError, match="admin_api_key"):
        ServerSettings(model_names=[MODEL_NAME], admin_api_key=[""])


def test_kv_cache_events_off_is_a_404_that_says_how_to_turn_them_on(
        engine: AsyncLLMEngine) -> None:
    app = create_app(engine, ServerSettings(model_names=[MODEL_NAME]))

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/kv_cache_events")

    reply = asyncio.run(run())
    assert reply.status_code == 404
    assert "--enable-kv-cache-events" in reply.json()["error"]["message"]


def test_shutdown_ends_streams_and_refuses_new_requests(engine: AsyncLLMEngine) -> None:
    async def run() -> tuple[BaseException | None, BaseException | None]:
        stream = await engine.add_request("long", "Tell me a story.",
                                          SamplingParams(max_tokens=200, ignore_eos=True))
        in_flight: BaseException | None = None
        async with stream:
            await stream.__anext__()
            await asyncio.to_thread(engine.shutdown)
            try:
                async for _ in stream:
                    pass
            except (EngineDeadError, RequestFailedError) as error:
                in_flight = error
        late: BaseException | None = None
        try:
            await engine.add_request("late", "Hi", SamplingParams(max_tokens=1))
        except EngineDeadError as error:
            late = error
        return in_flight, late

    in_flight, late = asyncio.run(run())
    assert isinstance(in_flight, EngineDeadError)
    assert isinstance(late, EngineDeadError)
    assert not engine.is_running


def test_rejected_request_raises_value_error_and_queues_nothing(engine: AsyncLLMEngine) -> None:
    async def run() -> None:
        with pytest.raises(ValueError, match="prompt is empty"):
            await engine.add_request("empty", "", SamplingParams())

    asyncio.run(run())
    assert not engine.engine.has_unfinished_requests()


def test_a_format_compiles_off_the_engine_thread_while_others_stream(
        engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A format that takes long to compile (a large grammar can take a second) is
    compiled on a thread of its own: a running stream keeps getting tokens meanwhile,
    and a format that does not compile is refused with nothing queued."""
    from pagellm.core.sampling_params import StructuredOutputsParams

    compiled_on: list[str] = []
    prepare = LLMEngine.prepare_format

    def slow(self: LLMEngine, params: SamplingParams) -> None:
        compiled_on.append(threading.current_thread().name)
        threading.Event().wait(1.0)
        prepare(self, params)

    monkeypatch.setattr(LLMEngine, "prepare_format", slow)
    fmt = StructuredOutputsParams(choice=[" yes", " no"])

    async def run() -> tuple[int, str]:
        free = await engine.add_request("free", "Count: one, two,", SamplingParams(
            temperature=0, max_tokens=200, ignore_eos=True))
        counts: list[int] = []

        async def read() -> None:
            async for output in free:
                counts.append(len(output.outputs[0].token_ids))

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0.3)
        before = counts[-1] if counts else 0
        formatted = await engine.add_request("formatted", "Is it day?", SamplingParams(
            temperature=0, max_tokens=4, structured_outputs=fmt))
        during = (counts[-1] if counts else 0) - before
        async for output in formatted:
            text = output.outputs[0].text
        with pytest.raises(ValueError, match="not a valid regular expression"):
            await engine.add_request("bad", "x", SamplingParams(
                structured_outputs=StructuredOutputsParams(regex="(")))
        free.abort()
        reader.cancel()
        return during, text

    during, text = asyncio.run(run())
    assert compiled_on and all(name.startswith("pagellm-formats") for name in compiled_on)
    assert during > 5  # tokens kept coming during the one-second compile
    assert text in (" yes", " no")


def test_the_engine_is_built_and_stepped_on_one_thread(llm_engine: LLMEngine) -> None:
    """torch's kernels must run on one thread only (a second OpenMP team made decode
    30-50% slower on 2 cores), so the build runs on the thread that steps."""
    threads: list[threading.Thread] = []

    def build() -> LLMEngine:
        threads.append(threading.current_thread())
        return llm_engine

    engine = AsyncLLMEngine(build)
    try:
        assert threads == [engine._loop._thread] and threads[0] is not threading.main_thread()
        assert engine.engine is llm_engine and engine.is_running
    finally:
        engine.shutdown()


def test_an_engine_dropped_without_shutdown_stops_its_thread(llm_engine: LLMEngine) -> None:
    """As vLLM's AsyncLLM on deletion: an engine built again and again (a notebook, a
    test loop) kept its thread and its whole engine alive when only the thread held it."""
    engine = AsyncLLMEngine(lambda: llm_engine)
    thread, dropped = engine._loop._thread, weakref.ref(engine)

    async def answer(asker: AsyncLLMEngine) -> str:
        text = ""
        async for output in asker.generate("Hello", SamplingParams(max_tokens=3), "drop"):
            text = output.outputs[0].text
        return text

    assert asyncio.run(answer(engine))
    del engine
    gc.collect()
    assert dropped() is None
    thread.join(10)
    assert not thread.is_alive()
    assert not llm_engine.has_unfinished_requests()


def test_a_shutdown_on_the_engine_thread_stops_it_without_waiting_for_itself(
        llm_engine: LLMEngine) -> None:
    """The garbage collector finalizes a dropped engine held in a reference cycle on
    whichever thread collects, often the engine's own: the stop must still happen."""
    engine = AsyncLLMEngine(lambda: llm_engine)
    loop = engine._loop
    loop._submit(loop.shutdown)
    loop._thread.join(10)
    assert not loop._thread.is_alive() and not engine.is_running


def test_exiting_mid_request_stops_the_engine_first(tmp_path: Path) -> None:
    """At exit the interpreter killed the engine thread inside a torch kernel, which
    aborted the process ("terminate called without an active exception", exit 134);
    the engine is now shut down before that."""
    script = tmp_path / "exit_mid_request.py"
    script.write_text(textwrap.dedent("""
        import asyncio
        from pagellm import AsyncLLMEngine, SamplingParams
        from pagellm.engine.config import EngineConfig
        from pagellm.engine.llm_engine import LLMEngine
        config = EngineConfig(kv_cache_memory_bytes=32 << 20, max_model_len=512,
                              num_threads=1)
        engine = AsyncLLMEngine(lambda: LLMEngine(config))
        async def consume():
            params = SamplingParams(max_tokens=400, ignore_eos=True)
            async for _ in engine.generate("Tell a long story.", params, "long"):
                pass
        async def main():
            try:
                await asyncio.wait_for(consume(), timeout=0.5)
            except TimeoutError:
                print("timed out")
        asyncio.run(main())
    """))
    for _ in range(3):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        assert "timed out" in done.stdout


def test_a_failing_build_raises_from_the_constructor() -> None:
    def build() -> LLMEngine:
        raise ValueError("no such model: nowhere")

    with pytest.raises(ValueError, match="no such model"):
        AsyncLLMEngine(build)


def test_a_second_shutdown_during_the_first_waits_instead_of_raising(
        llm_engine: LLMEngine) -> None:
    """The server's grace-period abort and its lifespan both shut the engine down, and
    the second call can come while the first is finishing: it once raised
    EngineDeadError there (a traceback in the log of a SIGTERM mid-stream)."""
    engine = AsyncLLMEngine(lambda: llm_engine)
    finishing, release = threading.Event(), threading.Event()
    drain = engine._loop._drain_inbox

    def slow_drain() -> None:  # the thread has marked itself dead and is finishing
        finishing.set()
        release.wait(10)
        drain()

    engine._loop._drain_inbox = slow_drain  # type: ignore[method-assign]
    first = threading.Thread(target=engine.shutdown)
    first.start()
    assert finishing.wait(10)
    threading.Timer(0.2, release.set).start()
    engine.shutdown()
    first.join(10)
    assert not engine._loop._thread.is_alive() and not first.is_alive()


def test_the_stats_logger_runs_at_its_interval_or_not_at_all(
        llm_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--disable-log-stats` (interval None) starts no logger task at all."""
    started: list[float] = []

    async def log_stats_forever(engine: AsyncLLMEngine, interval: float) -> None:
        started.append(interval)
        await asyncio.Event().wait()

    monkeypatch.setattr(api_server, "log_stats_forever", log_stats_forever)

    async def serve_briefly(interval: float | None) -> None:
        engine = AsyncLLMEngine(lambda: llm_engine)
        app = create_app(engine, ServerSettings(model_names=[MODEL_NAME],
                                                log_stats_interval=interval))
        async with app.router.lifespan_context(app):
            await asyncio.sleep(0.05)

    asyncio.run(serve_briefly(None))
    assert started == []
    asyncio.run(serve_briefly(2.5))
    assert started == [2.5]
