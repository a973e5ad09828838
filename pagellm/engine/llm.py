"""The offline API: `LLM(...).generate(prompts, params)`, named as in vLLM."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from tqdm import tqdm

from pagellm.core.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagellm.engine.beam_search import BeamSearchOutput, BeamSearchSequence
from pagellm.engine.chat_template import (
    ChatOptions,
    ContentFormat,
    Message,
    render_chat,
    render_chat_prompt,
)
from pagellm.engine.config import (
    EngineConfig,
    GenerateOnly,
    engine_config_kwargs,
    refuse_lora,
)
from pagellm.engine.llm_engine import LLMEngine, PromptInput, is_token_id
from pagellm.engine.metrics import Metric
from pagellm.engine.outputs import CompletionOutput, RequestOutput
from pagellm.engine.text import encode_text
from pagellm.engine.tokenization_options import TokenizationOptions, tokenization_options
from pagellm.logger import ensure_visible_logging
from pagellm.model.model_config import ModelConfig

logger = logging.getLogger(__name__)


def _prompt_list(prompts: Any) -> tuple[list[PromptInput], bool]:
    """The prompts as a list, and whether one prompt was given (not in a list)."""
    # A numeric NumPy array or a tensor: 1-D is one prompt whatever its values (a float
    # array is one bad prompt, an empty one an empty prompt), 2-D a batch. A 1-D array
    # of strings or of arrays (a dataset column) is a batch.
    kind = getattr(getattr(prompts, "dtype", None), "kind", "i")  # torch: numeric
    one_array = getattr(prompts, "ndim", None) == 1 and kind in "biuf"
    if hasattr(prompts, "tolist") and not isinstance(prompts, (list, tuple)):
        prompts = prompts.tolist()
    if not isinstance(prompts, (str, dict, list, tuple)):
        raise ValueError("prompts must be a string, a list of token ids, a prompt dict, "
                         f"or a list of these, got {type(prompts).__name__}")
    single = one_array or isinstance(prompts, (str, dict)) or (
        bool(prompts) and is_token_id(prompts[0]))
    return cast(list[PromptInput], [prompts] if single else list(prompts)), single


def _refuse_mm_kwargs(mm_processor_kwargs: object) -> None:
    """vLLM's image-processor options, there for code that passes None through."""
    if mm_processor_kwargs is not None:
        raise ValueError("mm_processor_kwargs must be None: PageLLM runs text-only models")


# `use_tqdm`: whether to draw progress, or (vLLM's) the tqdm-like class to draw it with.
ProgressOption = bool | Callable[..., Any]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _one_call_at_a_time(method: Callable[Concatenate[LLM, _P], _R]
                        ) -> Callable[Concatenate[LLM, _P], _R]:
    """Runs `method` holding the LLM's lock. Two threads stepping one engine at once
    corrupt its scheduler (a request left unfinished forever, a thread spinning), so a
    thread-pool or threaded web app sharing one `LLM` has its calls taken in turn."""
    @functools.wraps(method)
    def serialized(self: LLM, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)
    return serialized


class LLM(GenerateOnly):
    """Runs batches of prompts to completion on one engine.

    `LLM()` loads the default model (SmolLM2-135M-Instruct). Keyword arguments are those
    of `EngineConfig` (vLLM's names: `block_size`, `enable_prefix_caching`, ...). Threads
    may share one: its calls run one at a time (for requests that run together, use
    `AsyncLLMEngine`, or pass `generate` the whole list).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        ensure_visible_logging()
        self._lock = threading.RLock()
        # The requests the current (or an interrupted) call added, by id, to their prompt's
        # position (see `_run`).
        self._started: dict[str, int] = {}
        self.llm_engine = LLMEngine(EngineConfig(model=model,
                                                 **engine_config_kwargs(kwargs, "LLM()")))

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig) -> LLM:
        """vLLM's constructor: an `EngineArgs` (or any `EngineConfig`)."""
        return cls(**{f.name: getattr(engine_args, f.name)
                      for f in dataclasses.fields(EngineConfig)})

    @property
    def tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        """The model's shape and the context served (`max_model_len`), as in vLLM."""
        return self.llm_engine.model_config

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    # help(LLM) and inspect show EngineConfig's fields and defaults as LLM's arguments
    # (written out here they would be a second copy to keep in step).
    __init__.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *(inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD
                            if f.name == "model" else inspect.Parameter.KEYWORD_ONLY,
                            default=f.default, annotation=f.type)
          for f in dataclasses.fields(EngineConfig))])

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` run with when given no sampling params: the
        engine's defaults, with those of the model's generation_config.json (see
        `generation_config`), as in vLLM."""
        return self.llm_engine.get_default_sampling_params()

    @_one_call_at_a_time
    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: ProgressOption = True,
        cache_salt: str | None = None,
        priority: int | Sequence[int] | None = None,
        lora_request: None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; outputs come back in input order.

        A single prompt that is invalid raises ValueError. In a list, an invalid prompt
        does not stop the others: its output has `error` set and no completion.
        `priority`: one for all prompts or one per prompt, lower first, with
        scheduling_policy="priority" (vLLM's). `use_tqdm` may also be a tqdm-like class
        to draw the progress with, as in vLLM. `tokenization_kwargs` are vLLM 0.32's
        (`truncate_prompt_tokens`, `truncation` with `max_length`, `truncation_side`,
        `add_special_tokens`: see `tokenization_options`). `lora_request` and `mm_processor_kwargs` must be
        None (no adapters or images here; the arguments exist for code that passes None
        through).
        """
        refuse_lora(lora_request)
        _refuse_mm_kwargs(mm_processor_kwargs)
        return self._generate(prompts, sampling_params, use_tqdm, cache_salt, priority,
                              tokenization_options(tokenization_kwargs,
                                                   add_special_tokens=True))

    def _generate(self, prompts: PromptInput | Sequence[PromptInput],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                  use_tqdm: ProgressOption, cache_salt: str | None,
                  priority: int | Sequence[int] | None,
                  tokenization: TokenizationOptions) -> list[RequestOutput]:
        prompt_list, single = _prompt_list(prompts)
        if isinstance(sampling_params, BeamSearchParams) or (
                isinstance(sampling_params, Sequence)
                and any(isinstance(p, BeamSearchParams) for p in sampling_params)):
            raise ValueError("BeamSearchParams are for beam_search(), not generate()")
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompt_list):
                raise ValueError(f"got {len(sampling_params)} sampling_params for "
                                 f"{len(prompt_list)} prompts")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params if sampling_params is not None
                           else self.get_default_sampling_params()] * len(prompt_list)
        params_list = [tokenization.params(params) for params in params_list]
        # Checked before anything is queued: a priority the engine would refuse is a
        # programming error, not one prompt's failure.
        if isinstance(priority, Iterable) and not isinstance(priority, str):
            priorities = [self.llm_engine.check_priority(p) for p in priority]
        else:  # one for all (a bad one is refused by name)
            priorities = [self.llm_engine.check_priority(priority or 0)] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        return self._run(prompt_list, params_list, priorities, use_tqdm, cache_salt,
                         raise_errors=single, tokenization=tokenization)

    @_one_call_at_a_time
    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: ProgressOption = True,
        lora_request: None = None,
        priority: int | Sequence[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: ContentFormat = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Applies the chat template to one conversation or a list of them, then generates.

        The arguments are vLLM's, in its order (see `ChatOptions`; `cache_salt` is
        PageLLM's). A bad conversation raises ValueError naming the message, even inside
        a list: it is a programming error, not a prompt that is merely too long.
        Otherwise errors follow `generate`: one conversation that cannot run raises, in a
        list it gets an output with `error` set.
        """
        refuse_lora(lora_request)
        _refuse_mm_kwargs(mm_processor_kwargs)
        tokenization = tokenization_options(tokenization_kwargs, add_special_tokens=False)
        if not isinstance(messages, list):
            raise ValueError("messages must be a list of messages (or of conversations)")
        if not messages:  # no conversations, as in vLLM
            return []
        single = isinstance(messages[0], dict)
        conversations = cast(list[list[Message]], [messages] if single else messages)
        options = ChatOptions(add_generation_prompt, continue_final_message, tools,
                              chat_template, chat_template_kwargs,
                              chat_template_content_format)
        prompts: list[PromptInput] = []
        for conversation in conversations:
            text, token_ids = render_chat_prompt(self.tokenizer, conversation, options)
            if tokenization.add_special_tokens:  # the tokenizer's own on top of the template's
                token_ids = encode_text(self.tokenizer, text, "messages", True)
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        # One conversation is one prompt: invalid, it raises, as `generate` does.
        return self._generate(prompts[0] if single else prompts, sampling_params, use_tqdm,
                              cache_salt, priority, tokenization)

    @_one_call_at_a_time
    def apply_chat_template(self, messages: list[Message],
                            add_generation_prompt: bool = True) -> list[int]:
        """The prompt token ids `chat` would run for `messages`."""
        return render_chat(self.tokenizer, messages,
                           ChatOptions(add_generation_prompt=add_generation_prompt))

    @_one_call_at_a_time
    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        use_tqdm: ProgressOption = False,
        concurrency_limit: int | None = None,
        cache_salt: str | None = None,
    ) -> list[BeamSearchOutput]:
        """The `beam_width` best sequences of each prompt, best first (vLLM's
        `LLM.beam_search`), ranked as transformers' `generate(num_beams=beam_width)` ranks
        them. Each step's beams run as requests that find their shared beginning in the
        prefix cache (see beam_search.py). `concurrency_limit` searches at a time (all by
        default). As in vLLM, a sequence's `tokens` and `text` begin with the prompt's.
        An invalid prompt raises ValueError, and a search the engine failed RuntimeError.
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError("params must be a BeamSearchParams")
        prompt_list, _ = _prompt_list(prompts)
        if concurrency_limit is not None and (
                not is_token_id(concurrency_limit) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be an integer >= 1 or None, got "
                             f"{concurrency_limit!r}")
        limit = concurrency_limit or max(len(prompt_list), 1)
        results: list[BeamSearchOutput] = []
        for start in range(0, len(prompt_list), limit):
            batch = prompt_list[start:start + limit]
            for output in self._run(batch, [params] * len(batch), [0] * len(batch),
                                    use_tqdm, cache_salt, raise_errors=True,
                                    tokenization=tokenization_options(None, True)):
                if output.error is not None:
                    raise RuntimeError(f"beam search failed: {output.error}")
                results.append(BeamSearchOutput([self._sequence(output, c, params)
                                                 for c in output.outputs]))
        return results

    def _sequence(self, output: RequestOutput, completion: CompletionOutput,
                  params: BeamSearchParams) -> BeamSearchSequence:
        """A search's completion in vLLM's shape, whose text decodes the prompt and the
        continuation together (the EOS that ended the beam only with
        include_stop_str_in_output)."""
        assert completion.logprobs is not None and completion.cumulative_logprob is not None
        tokens = output.prompt_token_ids + completion.token_ids
        shown = tokens
        if completion.finish_reason == "stop" and not params.include_stop_str_in_output:
            shown = tokens[:-1]
        # Without a character the search cut in half, as `generate`'s text leaves it out.
        text = (None if self.tokenizer is None else str(self.tokenizer.decode(
            shown, skip_special_tokens=params.skip_special_tokens)).rstrip("\ufffd"))
        return BeamSearchSequence(tokens, completion.logprobs, completion.cumulative_logprob,
                                  text, completion.finish_reason, completion.stop_reason)

    @_one_call_at_a_time
    def get_metrics(self) -> list[Metric]:
        """vLLM's snapshot of the engine's metrics: the counters and gauges the server's
        /metrics page shows (prefix-cache queries and hits, KV usage, tokens, ...), under
        PageLLM's names and again under vLLM's, and the latency histograms and
        finish-reason counts of every request the engine ended (finished, aborted or
        failed; a beam search as one request)."""
        return self.llm_engine.get_metrics()

    @_one_call_at_a_time
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forgets every cached block; True, or False while requests added to
        `llm_engine` directly hold blocks (between `generate` calls nothing runs), unless
        `reset_running_requests` preempts them (see LLMEngine.reset_prefix_cache)."""
        self._abort_left_behind()
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def _abort_left_behind(self) -> None:
        """A call interrupted again while it aborted its requests (a second Ctrl-C) left
        some running: the next call would run them to the end before its own."""
        self.llm_engine.abort_request(list(self._started))
        self._started = {}

    def _run(self, prompts: list[PromptInput],
             params: Sequence[SamplingParams | BeamSearchParams],
             priorities: list[int], use_tqdm: ProgressOption, cache_salt: str | None,
             raise_errors: bool, tokenization: TokenizationOptions) -> list[RequestOutput]:
        engine = self.llm_engine
        self._abort_left_behind()
        results: list[RequestOutput | None] = [None] * len(prompts)
        positions = self._started = {}
        progress = use_tqdm if callable(use_tqdm) else tqdm
        bar = progress(total=len(prompts), desc="Generating", unit="req",
                       disable=not use_tqdm, leave=False)
        try:
            for index, (prompt, sp, priority) in enumerate(zip(prompts, params, priorities,
                                                                strict=True)):
                if isinstance(sp, SamplingParams) and sp.output_kind is RequestOutputKind.DELTA:
                    sp = sp.clone(output_kind=RequestOutputKind.FINAL_ONLY)  # whole outputs
                try:
                    prompt, sp = tokenization.request(prompt, sp, engine)
                    # The engine numbers the requests, so that ids never collide with
                    # those of requests added to `llm_engine` directly.
                    positions[engine.add_request(None, prompt, sp, cache_salt=cache_salt,
                                                 priority=priority)] = index
                except ValueError as error:
                    if raise_errors:
                        raise
                    logger.warning("prompt %d rejected: %s", index, error)
                    results[index] = RequestOutput(f"rejected-{index}", None, [], [], True,
                                                   error=str(error))
                    bar.update(1)
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished and output.request_id in positions:
                        results[positions[output.request_id]] = output
                        bar.update(1)
        finally:
            engine.abort_request([request_id for request_id, index in positions.items()
                                  if results[index] is None])
            self._started = {}
            bar.close()
        unfinished = [index for index, result in enumerate(results) if result is None]
        if unfinished:  # aborted behind generate's back, through llm_engine
            raise RuntimeError(f"prompts {unfinished} ended without an output")
        return cast(list[RequestOutput], results)
