"""The engine for servers: `LLMEngine` stepping in its own thread, outputs streamed to asyncio.

`LLMEngine.step` is synchronous and runs a forward pass, so it cannot run on the event loop
without freezing every client. Instead one background thread owns the engine outright: it
builds it, takes commands (add, abort, stop) from a thread-safe inbox between steps, steps
while any request is unfinished, and hands each output to the asking request's stream on
that request's event loop with `loop.call_soon_threadsafe`. Owning the engine from a single
thread needs no lock around it, and nothing on the event loop ever waits for a step: an
add waits only for the step in flight to end.

The engine is built on that thread too, so that one thread only ever runs torch's parallel
kernels. Every thread that does gets its own GNU OpenMP team, and once OpenMP's threads
outnumber the cores it cuts its spin-wait to 100 iterations, so its workers sleep between
kernels and each kernel pays a wake-up: a model loaded on the main thread and stepped on
another decoded 30-50% slower on 2 cores (21.8 -> 33 ms per token, one request).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import copyreg
import dataclasses
import functools
import logging
import queue
import threading
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from pagellm.core.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagellm.engine.config import EngineConfig, GenerateOnly, refuse_lora
from pagellm.engine.generation_config import GenerationDefaults
from pagellm.engine.kv_events import KVEventHub
from pagellm.engine.llm_engine import EngineStats, LLMEngine, PromptInput
from pagellm.engine.outputs import OutputShaper, RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")
_Command = Callable[[], None]


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shutdown or a fatal error); no request can run."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (its `RequestOutput.error`); others keep running."""


class RequestStream:
    """The outputs of one request, as an async iterator: cumulative, or as the request's
    `output_kind` asks (see OutputShaper).

    Use it as an async context manager: leaving the block before the last output (a
    client that disconnected, a cancelled task, an exception) aborts the request, so its
    blocks are freed at once instead of when it would have finished.
    """

    def __init__(self, owner: _EngineLoop, request_id: str, stream: _OutputStream,
                 kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        """`request_id` is the engine's; the outputs carry the caller's (they differ
        where the caller gave an id already running, see _EngineLoop.add_request)."""
        self._owner = owner
        self.request_id = request_id
        self._stream = stream
        self._shaper = OutputShaper(kind)
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self.finished:
            try:
                output = await self._stream.get()
            except StopAsyncIteration:  # aborted by id: already out of the engine
                self.finished = True
                raise
            except BaseException:
                self.abort()
                raise
            self.finished = output.finished
            if output.error is not None:
                raise RequestFailedError(output.error)
            shaped = self._shaper(output)
            if shaped is not None:
                if shaped.request_id != self._stream.caller_id:
                    shaped = dataclasses.replace(shaped, request_id=self._stream.caller_id)
                return shaped
        raise StopAsyncIteration

    def abort(self) -> None:
        """Ends the request now unless it already finished; idempotent. Only this
        stream's request: if it finished meanwhile and its id was taken again, the new
        request is left alone."""
        if not self.finished:
            self.finished = True
            self._owner.abort_stream(self.request_id, self._stream)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.abort()


class _Done(Coroutine[None, None, None]):
    """What `AsyncLLMEngine.abort` returns: nothing to wait for, but a coroutine as
    vLLM's abort is, so callers may await it or hand it to `asyncio.create_task`. It is
    not a native one: a plain call, never awaited, draws no "never awaited" warning."""

    def __await__(self) -> Generator[None, None, None]:
        return
        yield

    def send(self, value: None) -> None:
        raise StopIteration

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> None:
        raise typ if val is None else val

    def close(self) -> None:
        return None


class _OutputStream:
    """The outputs of one request, read on its event loop.

    Outputs are cumulative (each holds the whole text so far), so a newer one supersedes
    an older one that was not read yet: keeping only the newest bounds the memory a slow
    client can pin to one output, however far it falls behind.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.caller_id = ""  # the request id the caller gave (or the engine picked)
        self._latest: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called on the stream's loop (via call_soon_threadsafe); an error is final."""
        if isinstance(self._latest, BaseException):
            return
        self._latest = item
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        self._ready.clear()
        item, self._latest = self._latest, None
        if isinstance(item, BaseException):
            raise item
        assert item is not None
        return item


@dataclass
class _Pending:
    """A command's result, delivered to the awaiting coroutine's loop."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]

    def resolve(self, value: Any = None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(value)

        _post(self.loop, settle)


def _ids_taken(request_id: str, n: int) -> list[str]:
    """The ids a request takes in the engine: its own, and its samples' with n > 1."""
    return [request_id, *(f"{request_id}#{index}" for index in range(n if n > 1 else 0))]


_AWAITABLE_CLASSES: dict[type, type] = {}
# What the default pickling of an object names to make it again from its class.
_NEWOBJ = vars(copyreg)["__newobj__"]


def _new_object(cls: Any, *args: Any) -> Any:
    """What pickle's own `copyreg.__newobj__` does, under another name: pickle refuses
    that one for a class other than the object's own."""
    return cls.__new__(cls, *args)


def awaitable_tokenizer(tokenizer: Any) -> Any:
    """`tokenizer` itself, made awaitable (to itself) by a subclass of its own class, so
    that `await engine.get_tokenizer()` (older vLLM's coroutine) and
    `engine.get_tokenizer().encode(...)` (vLLM 0.32's method) both work, and isinstance
    checks still pass. It pickles and copies as its own class. One whose class cannot
    be extended so (slots, a native type) is returned as it is, not awaitable."""
    if tokenizer is None:
        return None
    base = type(tokenizer)
    try:
        if base not in _AWAITABLE_CLASSES:
            def __await__(self: Any) -> Generator[None, None, Any]:
                return self
                yield  # a generator that finishes at once, with the tokenizer

            def __reduce_ex__(self: Any, protocol: Any) -> Any:
                reduced = cast(Any, base).__reduce_ex__(self, protocol)
                if isinstance(reduced, tuple) and reduced[0] is _NEWOBJ:
                    plain = len(reduced[1]) == 1 and cast(Any, base).__new__ is object.__new__
                    maker = object.__new__ if plain else _new_object
                    return (maker, (base, *reduced[1][1:]), *reduced[2:])
                return reduced

            _AWAITABLE_CLASSES[base] = type(base.__name__, (base,), {
                "__await__": __await__, "__reduce_ex__": __reduce_ex__,
                "__module__": base.__module__, "__qualname__": base.__qualname__})
        tokenizer.__class__ = _AWAITABLE_CLASSES[base]
    except TypeError:
        pass
    return tokenizer


def _post(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """Schedules `callback` on `loop`; a loop that has closed has nobody left to tell."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        pass


class _EngineLoop:
    """What `AsyncLLMEngine` runs: the engine thread and everything it shares with the
    callers (the inbox, the streams, the latest stats). The thread holds this, never the
    `AsyncLLMEngine`, so that dropping the last reference to that stops the thread."""

    def __init__(self, build: Callable[[], LLMEngine]) -> None:
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _OutputStream] = {}
        self._stopping = False
        self._dead: BaseException | None = None
        self._formats = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pagellm-formats")
        self.engine: LLMEngine
        self.kv_events: KVEventHub | None
        self._stats: EngineStats
        self.tokenizer: Any
        built: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(build, built.put),
                                        name="pagellm-engine", daemon=True)
        self._thread.start()
        try:
            error = built.get()
        except BaseException:
            # Interrupted while the engine is still being built: the thread drops it as
            # soon as the build returns instead of waiting for requests nobody will send.
            self._stopping = True
            raise
        if error is not None:
            raise error

    # ---- what the server reads --------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def generation_defaults(self) -> GenerationDefaults:
        return self.engine.generation_defaults

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self._dead is None

    def stats(self) -> EngineStats:
        return self._stats

    # ---- requests ---------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        sampling_params: SamplingParams | BeamSearchParams,
        *,
        arrival_time: float | None,
        priority: int,
        cache_salt: str | None,
    ) -> RequestStream:
        stream = _OutputStream(asyncio.get_running_loop())
        arrival = time.monotonic() if arrival_time is None else arrival_time
        kind = RequestOutputKind.CUMULATIVE
        if isinstance(sampling_params, SamplingParams):
            # Checked as a copy first (as add_request does): what follows reads its fields.
            sampling_params = sampling_params.clone()
        if (isinstance(sampling_params, SamplingParams)
                and sampling_params.output_kind is RequestOutputKind.DELTA):
            # Shaped as the stream is read: it keeps only the newest output, which must
            # then hold everything so far (FINAL_ONLY the engine applies itself).
            kind = RequestOutputKind.DELTA
            sampling_params = sampling_params.clone(output_kind=RequestOutputKind.CUMULATIVE)
        if (isinstance(sampling_params, SamplingParams)
                and sampling_params.structured_outputs is not None):
            # Compiled here, not between two steps (see LLMEngine.prepare_format); the
            # compiling thread stops with the engine.
            if not self.is_running:
                raise EngineDeadError("the engine is not running")
            await asyncio.get_running_loop().run_in_executor(
                self._formats, self.engine.prepare_format, sampling_params)

        chosen: list[str] = []  # the id as the engine took it (None: one it picked)

        def add() -> str:
            # An id already running is taken again, as vLLM takes it: the engine runs
            # this one under an id of its own, its outputs carry the caller's, and an
            # abort by the caller's id ends both.
            engine_id = request_id
            while engine_id is not None and any(
                    self.engine.has_request(taken) for taken in _ids_taken(
                        str(engine_id), getattr(sampling_params, "n", 1))):
                engine_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
            chosen.append(self.engine.add_request(
                engine_id, prompt, sampling_params, arrival_time=arrival, priority=priority,
                cache_salt=cache_salt))
            stream.caller_id = chosen[0] if request_id is None else str(request_id)
            self._streams[chosen[0]] = stream
            return chosen[0]

        def abort_added() -> None:
            # Only this request: one that finished meanwhile may have left its id to
            # another caller's.
            if chosen and self._streams.get(chosen[0]) is stream:
                self._abort_now(chosen[0])

        try:
            engine_id = await self._call(add)
        except asyncio.CancelledError:
            # The add may still run after we stop waiting; the abort queued behind it
            # makes sure nobody's request keeps running with no reader.
            if self.is_running:
                self._submit(abort_added)
            raise
        return RequestStream(self, engine_id, stream, kind)

    def abort(self, request_id: str | Iterable[str]) -> _Done:
        if isinstance(request_id, (str, int)):
            ids: list[str | int] = [request_id]
        elif isinstance(request_id, Iterable):
            ids = list(request_id)
        else:
            raise TypeError(f"abort takes a request id or an iterable of ids, got "
                            f"{request_id!r}")
        if self.is_running:
            for one in ids:
                self._submit(functools.partial(self._abort_caller, str(one)))
        return _Done()

    def _abort_caller(self, caller_id: str) -> None:
        """On the engine thread: every running request the caller gave this id."""
        engine_ids = [engine_id for engine_id, stream in self._streams.items()
                      if stream.caller_id == caller_id]
        for engine_id in engine_ids or [caller_id]:
            self._abort_now(engine_id)

    def abort_stream(self, request_id: str, stream: _OutputStream) -> None:
        """Aborts the request `stream` reads, if it is still the one under its id."""
        if self.is_running:
            self._submit(lambda: self._abort_now(request_id)
                         if self._streams.get(request_id) is stream else None)

    def _abort_now(self, request_id: str) -> None:
        """On the engine thread. The request's stream, if anyone still reads it (an
        abort by id, as vLLM callers send it), ends with the request's last output,
        finish_reason "abort", as vLLM's does (a beam search's just ends)."""
        stream = self._streams.pop(request_id, None)
        last: list[RequestOutput] = []
        try:
            last = self.engine.abort_request(request_id)
        finally:  # the reader ends even if the engine failed to abort
            if stream is not None:
                _post(stream.loop, functools.partial(stream.put, last[0] if last
                                                     else StopAsyncIteration()))

    @property
    def errored(self) -> bool:
        return self._dead is not None and not isinstance(self._dead, EngineDeadError)

    async def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        return await self._call(functools.partial(self.engine.reset_prefix_cache,
                                                  reset_running_requests))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Also called on the engine thread itself, when the garbage collector finalizes
        a dropped `AsyncLLMEngine` there (a reference cycle): the stop is then queued, and
        the thread ends after its current command instead of waiting for itself."""
        self._formats.shutdown(wait=False, cancel_futures=True)
        if self._thread.is_alive():
            with contextlib.suppress(EngineDeadError):  # already stopping or stopped
                self._submit(self._stop)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout)

    # ---- the thread -------------------------------------------------------------------

    async def _call(self, command: Callable[[], T]) -> T:
        """Runs `command` on the engine thread between steps and returns its result."""
        loop = asyncio.get_running_loop()
        pending = _Pending(loop, loop.create_future())

        def run() -> None:
            if self._stopping:
                pending.resolve(error=EngineDeadError("the server is shutting down"))
                return
            try:
                pending.resolve(command())
            except Exception as error:  # noqa: BLE001 - the caller decides what it means
                pending.resolve(error=error)

        self._submit(run)
        result: T = await pending.future
        return result

    def _submit(self, command: _Command) -> None:
        if self._dead is not None or (self._stopping and command is not self._stop):
            raise EngineDeadError("the engine is not running")
        self._inbox.put(command)

    def _run(self, build: Callable[[], LLMEngine],
             report: Callable[[BaseException | None], None]) -> None:
        try:
            self.engine = build()
            self._stats = self.engine.get_stats()
            self.kv_events = KVEventHub() if self.engine.config.enable_kv_cache_events else None
            # Hugging Face fast tokenizers are not safe to share between threads
            # (concurrent use fails with "Already borrowed"), and this thread detokenizes
            # on every step: callers on the event loop get their own copy.
            self.tokenizer = awaitable_tokenizer(copy.deepcopy(self.engine.tokenizer))
        except BaseException as error:  # noqa: BLE001 - the constructor re-raises it
            self._dead = error
            report(error)
            return
        report(None)
        try:
            while not self._stopping:
                self._run_commands(block=not self.engine.has_unfinished_requests())
                if self._stopping:
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                else:  # what the commands changed (an abort, a reset)
                    self._stats = self.engine.get_stats()
                if self.kv_events is not None:
                    self.kv_events.publish(self.engine.take_kv_cache_events())
        except BaseException as error:
            self._dead = error
            logger.exception("the engine thread died; failing every request")
            self._fail_all(EngineDeadError(f"the engine stopped: {error}"))
            return
        finally:
            if self.kv_events is not None:
                self.kv_events.close()
        self._dead = EngineDeadError("the engine has shut down")
        self._drain_inbox()

    def _run_commands(self, block: bool) -> None:
        """Runs the queued commands; when idle, first waits for one instead of spinning."""
        if block:
            self._execute(self._inbox.get())
        while not self._stopping:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._execute(command)

    @staticmethod
    def _execute(command: _Command) -> None:
        """A failing command (an abort of a broken request) must not stop the thread."""
        try:
            command()
        except Exception:  # noqa: BLE001 - logged; the engine goes on
            logger.exception("engine command failed")

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # noqa: BLE001 - one bad step fails its requests, not us
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_all(RequestFailedError(f"internal error: {error}"))
            outputs = []
        # Taken before the outputs are handed out: a client reading /metrics as soon as
        # its answer came finds its request counted.
        self._stats = self.engine.get_stats()
        for output in outputs:
            stream = (self._streams.pop(output.request_id, None) if output.finished
                      else self._streams.get(output.request_id))
            if stream is not None:
                _post(stream.loop, functools.partial(stream.put, output))

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            _post(stream.loop, functools.partial(stream.put, error))
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - keep failing the rest
                logger.exception("could not abort request %s", request_id)

    def _stop(self) -> None:
        self._stopping = True
        self._fail_all(EngineDeadError("the server is shutting down"))
        self._stats = self.engine.get_stats()

    def _drain_inbox(self) -> None:
        """Runs what was queued behind the stop so no caller waits forever: adds fail."""
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._execute(command)


class AsyncLLMEngine(GenerateOnly):
    """Runs an `LLMEngine` in a background thread and streams its outputs to coroutines.

    `add_request` returns a `RequestStream`, an async iterator of `RequestOutput`s
    (cumulative unless the request's output_kind says otherwise), and `generate` is
    vLLM's loop over one; leaving it early (a client that disconnects, a cancelled task)
    aborts the request so its blocks are freed. `stats()` is the snapshot taken after the
    latest step, so metrics never wait on one. With `enable_kv_cache_events`, `kv_events`
    publishes each step's prefix-cache events (else it is None).

    `shutdown()` stops it; so does dropping the last reference to it (as vLLM's
    `AsyncLLM` does on deletion: an engine built in a loop would otherwise keep its
    memory and thread), and so does the interpreter's exit, which would otherwise kill
    the thread in the middle of a kernel and abort the process.
    """

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig) -> AsyncLLMEngine:
        """vLLM's constructor: the engine of an `AsyncEngineArgs` (any `EngineConfig`),
        built on its thread."""
        return cls(lambda: LLMEngine(engine_args))

    def __init__(self, build: Callable[[], LLMEngine]) -> None:
        """Calls `build` on the engine thread and returns once it has (re-raising what it
        raised): pass `lambda: LLMEngine(config)`, not an engine built here, to keep
        torch's kernels on one thread (see the module docstring)."""
        self._loop = _EngineLoop(build)
        weakref.finalize(self, self._loop.shutdown)

    @property
    def engine(self) -> LLMEngine:
        """The engine the thread steps: read it, but call it only through this object."""
        return self._loop.engine

    @property
    def tokenizer(self) -> Any:
        """A copy of the engine's tokenizer for the callers' thread (see _EngineLoop)."""
        return self._loop.tokenizer

    @property
    def kv_events(self) -> KVEventHub | None:
        return self._loop.kv_events

    @property
    def max_model_len(self) -> int:
        return self._loop.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._loop.vocab_size

    @property
    def generation_defaults(self) -> GenerationDefaults:
        """What a request's unset sampling fields default to, and the cap on max_tokens
        (see `generation_config`)."""
        return self._loop.generation_defaults

    @property
    def is_running(self) -> bool:
        return self._loop.is_running

    @property
    def errored(self) -> bool:
        """Whether the engine thread died of an error, not of a shutdown (vLLM's name)."""
        return self._loop.errored

    def stats(self) -> EngineStats:
        return self._loop.stats()

    async def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        sampling_params: SamplingParams | BeamSearchParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queues a request and returns the stream of its outputs.

        Raises ValueError (the engine's message) if the request is rejected, in which case
        nothing was queued; a server can still answer with a plain error status then.
        """
        return await self._loop.add_request(request_id, prompt, sampling_params,
                                            arrival_time=arrival_time, priority=priority,
                                            cache_salt=cache_salt)

    async def generate(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | BeamSearchParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as they come (vLLM's `AsyncLLM.generate`): cumulative,
        or only what is new with `output_kind=RequestOutputKind.DELTA`. Leaving the loop
        early (a break, a cancelled task) aborts the request. A request the engine
        refuses raises ValueError; one it fails, RequestFailedError."""
        refuse_lora(lora_request)
        stream = await self.add_request(request_id, prompt, sampling_params,
                                        cache_salt=cache_salt, priority=priority)
        async with stream:
            async for output in stream:
                yield output

    def abort(self, request_id: str | Iterable[str]) -> _Done:
        """Aborts requests (one id or several, as vLLM takes them) without waiting: safe
        from `finally` blocks during cancellation. It may also be awaited, as vLLM's
        coroutine is. A stream still read ends.

        Once the engine has stopped there is nothing left to free, so this is then a no-op.
        """
        return self._loop.abort(request_id)

    def get_tokenizer(self) -> Any:
        """vLLM's: the `tokenizer` attribute (a copy for the event loop's thread). A plain
        method in vLLM 0.32 and a coroutine in older vLLM: the tokenizer may be awaited
        too (see awaitable_tokenizer), so code written for either runs. Without one
        (skip_tokenizer_init) a ValueError, as in vLLM."""
        if self._loop.tokenizer is None:
            raise ValueError("there is no tokenizer: the engine was built with "
                             "skip_tokenizer_init")
        return self._loop.tokenizer

    async def check_health(self) -> None:
        """vLLM's: raises EngineDeadError once the engine no longer runs."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forgets every cached block, between two steps; False while requests hold
        blocks, unless `reset_running_requests` preempts them (see
        LLMEngine.reset_prefix_cache)."""
        return await self._loop.reset_prefix_cache(reset_running_requests)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Aborts every request (their streams get EngineDeadError) and stops the thread.

        Safe to call again while a first call is still stopping it (the server's grace
        period and its lifespan both call it): the later call just waits for the thread."""
        self._loop.shutdown(timeout)
