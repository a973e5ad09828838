"""The engine loop: requests in, one scheduled step at a time, outputs out.

One step is: schedule (core) -> prepare inputs, forward, sample (worker) -> append the
tokens, publish newly full blocks, detokenize, check stops (core + here). `step` is
synchronous and single-threaded; the async server drives it from a background thread.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pagellm.core import scheduler as scheduler_module
from pagellm.core.block_hash import BlockHasher
from pagellm.core.config import SchedulerConfig
from pagellm.core.events import KVCacheEvent
from pagellm.core.kv_cache_manager import KVCacheManager, blocks_for_tokens
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagellm.core.scheduler import Scheduler, SchedulerOutput
from pagellm.engine.beam_searches import BeamSearches
from pagellm.engine.config import EngineConfig, refuse_lora, resolve_device
from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.engine.generation_config import load_generation_defaults
from pagellm.engine.metrics import (
    CompletionEnd,
    Metric,
    RequestEnd,
    RequestLatencies,
    metrics_snapshot,
)
from pagellm.engine.outputs import (
    CompletionOutput,
    Logprob,
    OutputShaper,
    RequestMetrics,
    RequestOutput,
)
from pagellm.engine.structured_output import FormatMatcher, GrammarCompiler, allowed_tokens
from pagellm.engine.text import bad_words_token_ids, check_unicode, encode_text
from pagellm.model.errors import CorruptModelError
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.loader import load_model, load_tokenizer
from pagellm.model.model_config import load_model_config
from pagellm.model.resolve import resolve_model_path, served_model_name
from pagellm.worker.cuda_graphs import CudaGraphRunner
from pagellm.worker.input_batch import SequenceChunk
from pagellm.worker.kv_cache import KVCache, device_memory_bytes, num_blocks_for_budget
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.sampler import BadWords, SamplingMetadata, TokenLogprobs, make_generator
from pagellm.worker.thread_tuner import ThreadTuner
from pagellm.worker.torch_threads import set_threads, users_threads

logger = logging.getLogger(__name__)

PromptInput = str | dict[str, Any] | list[int]
# What a prompt dict may hold (vLLM's TextPrompt / TokensPrompt keys that apply here).
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}


def is_token_id(value: Any) -> bool:
    """An int, or an integer scalar such as NumPy's int64; not a bool, and not an array
    (which has `__index__` too)."""
    return (not isinstance(value, (bool, str)) and hasattr(value, "__index__")
            and getattr(value, "ndim", 0) == 0)


def _kv_cache_dtype(name: str, model_dtype: torch.dtype,
                    model: LlamaForCausalLM) -> torch.dtype:
    """The pool's element type: "auto" is the model's, except where attention rounds
    keys and values to bfloat16 wherever it reads them (int8 activations with bfloat16
    products): there a float32 pool only doubles the memory and the bytes each step
    reads, for the very same outputs."""
    if name != "auto":
        return _TORCH_DTYPES[name]
    if model.attention_rounds_kv_to_bf16:
        logger.info("kv_cache_dtype auto: bfloat16, since attention rounds keys and values "
                    "to it (quantize_activations, bfloat16 products): the same outputs as "
                    "a float32 pool, twice the tokens")
        return torch.bfloat16
    return model_dtype


def _fitted_max_model_len(requested: int | None, context: int, pool_tokens: int,
                          pool_option: str) -> int:
    """The longest request the engine takes: as asked, else the model's context, and
    never more than the KV pool holds. A request longer than the pool could never run: it
    used to be accepted and cut short with finish_reason "length" although its max_tokens
    fitted max_model_len, and the server advertised a context it could not serve. vLLM
    refuses to start then; here the length is lowered to the pool, with a warning, so
    that configurations with a deliberately small pool (eviction tests) keep working and
    every reported max_model_len is one a request can reach. A pool under two tokens
    fits no request at all, and is refused."""
    wanted = requested or context
    if pool_tokens < 2:  # as max_model_len itself: a prompt token and a generated one
        raise ValueError(f"the KV cache holds {pool_tokens} token, too few for any "
                         f"request (a prompt token and a generated one); raise "
                         f"{pool_option}")
    if wanted > pool_tokens:
        logger.warning("max_model_len lowered from %d (%s) to %d, what the KV cache holds; "
                       "raise %s for more", wanted,
                       "as asked" if requested else "the model's context length",
                       pool_tokens, pool_option)
        return pool_tokens
    return wanted


@dataclass
class _Sample:
    """One of a request's n samples: its core request and its text state."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    logprobs: list[Logprob] | None
    matcher: FormatMatcher | None = None
    cumulative_logprob: float = 0.0
    last_token_time: float | None = None  # time.monotonic() of its latest token


@dataclass
class _Group:
    """A user request: n samples of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    metrics: RequestMetrics
    by_core_id: dict[str, _Sample] = field(default_factory=dict)
    prompt_logprobs: list[Logprob | None] | None = None
    bad_words: BadWords | None = None
    error: str | None = None
    shaper: OutputShaper = field(
        default_factory=lambda: OutputShaper(RequestOutputKind.CUMULATIVE))

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)

    def end(self, completed: bool) -> RequestEnd:
        """What the metrics record of the request as it ends."""
        return RequestEnd(self.metrics, [CompletionEnd(
            s.request.status.finish_reason, s.request.num_output_tokens,
            s.request.num_preemptions, s.last_token_time) for s in self.samples],
            len(self.prompt_token_ids), self.samples[0].request.sampling_params.max_tokens,
            completed)


@dataclass
class EngineStats:
    """Counters since start-up, plus the current queue and pool state."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_evictions: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    # Prompt positions run through the model: the prompt tokens not served from the
    # cache, and again those of a prompt recomputed after its request was preempted.
    prompt_tokens_computed: int
    timings: dict[str, float]
    # The latency histograms and finish-reason counts (a copy, safe to read anywhere).
    latencies: RequestLatencies = field(default_factory=RequestLatencies)
    # The KV cache's configuration, as vLLM's cache_config_info labels name it.
    cache_config: dict[str, str] = field(default_factory=dict)


def uses_cuda_graphs(device: torch.device, config: EngineConfig,
                     model: LlamaForCausalLM) -> bool:
    """Decode steps replay CUDA graphs on a GPU unless `enforce_eager` is set or the
    attention backend cannot be captured."""
    return (device.type == "cuda" and not config.enforce_eager
            and model.attn_backend.supports_graph_decode())


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token's own text, as logprob entries give it."""
    return str(tokenizer.decode([token_id]))


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.config = config
        set_threads(config.num_threads or users_threads())
        self.device = resolve_device(config.device)
        # Requests without a seed draw from this, seeded once: the same engine setup
        # samples the same, and the user's torch.manual_seed is left alone.
        self.generator = make_generator(config.seed, self.device)
        assert config.cache_dir is not None
        model_path = resolve_model_path(config.model, config.cache_dir)
        # The model as given (a path or hub id), else the local directory loaded: what a
        # client may load the tokenizer from (the server's model cards say it as `root`).
        self.model_root = config.model or str(model_path)
        self.model_config = load_model_config(model_path)
        context = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > context:
            raise ValueError(f"max_model_len is {config.max_model_len}, but the model's "
                             f"context length (max_position_embeddings) is {context}")
        dtype_name = "float32" if config.dtype == "auto" else config.dtype
        self.dtype = _TORCH_DTYPES[dtype_name]
        self.generation_defaults = load_generation_defaults(config, model_path)
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(model_path)
        # A token's own text (a piece of a character reads U+FFFD), for logprob entries'
        # `decoded_token`: holding the tokenizer, not the engine, so that outputs a
        # caller keeps do not keep the whole engine alive.
        self.decode_token: Callable[[int], str] | None = (
            None if self.tokenizer is None else functools.partial(token_text, self.tokenizer))
        if self.tokenizer is not None and len(self.tokenizer) > self.model_config.vocab_size:
            logger.warning("the tokenizer has %d tokens, the model's vocabulary %d: a prompt "
                           "holding one past it is refused", len(self.tokenizer),
                           self.model_config.vocab_size)
        # What gpu_memory_utilization's pool is sized against: the engine's own use.
        free_at_start = device_memory_bytes(self.device)[0]
        try:
            self.model = load_model(
                model_path, dtype=self.dtype, device=self.device,
                attention_backend=config.attention_backend,
                kernel_dir=config.cache_dir / "kernels" if config.cpu_kernels else None,
                quantize_activations=config.quantize_activations)
        except CorruptModelError as error:
            if model_path.parent != config.cache_dir / "gguf":
                raise
            # A conversion damaged after it was written (a bad copy, a full disk).
            raise CorruptModelError(f"{error} (in the conversion {model_path}: delete that "
                                    "directory and start again to convert anew)") from error
        self.kv_cache_dtype = _kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.model)
        num_blocks = num_blocks_for_budget(
            self.model_config, config.block_size, self.kv_cache_dtype, self.device,
            config.kv_cache_memory_bytes, config.kv_cache_memory_fraction,
            config.num_gpu_blocks_override, config.gpu_memory_utilization, free_at_start)
        # What sized the pool, for the messages that ask for another size.
        if config.num_gpu_blocks_override:
            pool_option = "num_gpu_blocks_override (--num-gpu-blocks-override)"
        elif config.gpu_memory_utilization and config.kv_cache_memory_bytes is None:
            pool_option = "gpu_memory_utilization (--gpu-memory-utilization)"
        else:
            pool_option = ("kv_cache_memory_bytes (--kv-cache-memory-bytes) or "
                           "kv_cache_memory_fraction")
        self.max_model_len = _fitted_max_model_len(
            config.max_model_len, context, num_blocks * config.block_size, pool_option)
        self.model_config = replace(self.model_config,
                                    max_model_len=self.max_model_len)
        graphs = uses_cuda_graphs(self.device, config, self.model)
        self.kv_cache = KVCache(self.model, num_blocks, config.block_size, self.kv_cache_dtype,
                                pool_option, padding_block=graphs)
        self.kv_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching,
            config.enable_kv_cache_events,
            # Where prompts depart from cached ones is only ever logged (at debug level).
            index_children=logging.getLogger(scheduler_module.__name__).isEnabledFor(
                logging.DEBUG))
        self.hasher = BlockHasher(config.block_size, config.prefix_caching_hash_algo)
        budget = config.step_budget()
        if budget < config.max_num_seqs:
            logger.warning("max_num_batched_tokens (%d) is below max_num_seqs (%d), which "
                           "vLLM refuses: at most %d requests run at once (more only as the "
                           "n > 1 samples of one request, which then decode in turn); leave "
                           "the budget unset, or give at least max_num_seqs", budget,
                           config.max_num_seqs, budget)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=self.max_model_len,
                max_num_batched_tokens=budget,
                max_num_seqs=config.max_num_seqs,
                policy=config.scheduling_policy,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
            ),
            self.kv_manager,
        )
        # Unless the thread count was fixed, decode steps may run on fewer threads when
        # that is faster (cores shared with another process; see thread_tuner.py).
        tuner = (ThreadTuner(torch.get_num_threads())
                 if self.device.type == "cpu" and not config.num_threads
                 and torch.get_num_threads() > 1 else None)
        self.runner = ModelRunner(
            self.model, self.kv_cache, self.device, tuner,
            CudaGraphRunner(self.model, self.kv_cache, config.max_num_seqs, self.max_model_len)
            if graphs else None)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self._grammars = (None if self.tokenizer is None else
                          GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                          sorted(self.eos_token_ids)))
        self._groups: dict[str, _Group] = {}
        self._core_to_group: dict[str, _Group] = {}
        self._beams = BeamSearches(self)
        # Each request's token latencies as they come and its finish as it ends (a beam
        # search as a whole, not its steps' requests), and each step's tokens.
        self.latencies = RequestLatencies(self.max_model_len)
        self._ids = itertools.count()
        self._prompt_tokens = 0
        self._prompt_tokens_computed = 0
        self._generation_tokens = 0
        self._schedule_time = 0.0
        self._update_time = 0.0
        self.startup_seconds = time.perf_counter() - start
        logger.info(
            "PageLLM ready in %.2f s: %s, %s on %s, KV pool %d blocks x %d = %d tokens%s, "
            "prefix caching %s%s", self.startup_seconds, model_path.name, dtype_name,
            self.device, num_blocks, config.block_size, num_blocks * config.block_size,
            "" if self.kv_cache_dtype == self.dtype
            else f" ({str(self.kv_cache_dtype).removeprefix('torch.')})",
            "on" if config.enable_prefix_caching else "off",
            ", decode steps from CUDA graphs" if graphs else "")

    # ---- requests -------------------------------------------------------------------

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig) -> LLMEngine:
        """vLLM's constructor: an `EngineArgs` (or any `EngineConfig`)."""
        return cls(engine_args)

    def get_tokenizer(self) -> Any:
        """vLLM's accessor of `tokenizer` (None with skip_tokenizer_init)."""
        return self.tokenizer

    def tokenize_prompt(self, prompt: PromptInput,
                        add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """A prompt is text, token ids (a list, tuple or 1-D array), or a prompt dict
        ({"prompt_token_ids": [...]} / {"prompt": "..."}, optionally with "cache_salt");
        returns (text or None, token ids), checked. Text gets the tokenizer's special
        tokens unless `add_special_tokens` is False (vLLM's tokenization_kwargs)."""
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - PROMPT_KEYS)
            if unknown:
                raise ValueError(f"prompt dict key {unknown[0]!r} is not supported (a prompt "
                                 f"dict takes {', '.join(sorted(PROMPT_KEYS))})")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set): "
                                 "pass prompt_token_ids")
            ids = encode_text(self.tokenizer, prompt, "prompt", add_special_tokens)
            past = next((t for t in ids if t >= self.model_config.vocab_size), None)
            if past is not None:
                raise ValueError(
                    f"the tokenizer gives the prompt token id {past}, past the model's "
                    f"vocabulary of {self.model_config.vocab_size} (the tokenizer does not "
                    "fit the model)")
            return prompt, ids
        if isinstance(prompt, (list, tuple)) or hasattr(prompt, "tolist"):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got "
                         f"{type(prompt).__name__}")

    def _check_token_ids(self, token_ids: Any) -> list[int]:
        """Plain ints of a list, tuple, or 1-D array (NumPy, torch): ids often come from a
        dataset or a tokenizer called with return_tensors."""
        if hasattr(token_ids, "tolist") and not isinstance(token_ids, (list, tuple)):
            token_ids = token_ids.tolist()
        if not isinstance(token_ids, (list, tuple)):
            raise ValueError("prompt_token_ids must be a list of integers")
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        ids = []
        for token in token_ids:
            if not is_token_id(token):
                raise ValueError(f"prompt_token_ids must be integers, got {token!r}")
            token_id = operator.index(token)
            if not 0 <= token_id < vocab:
                raise ValueError(
                    f"prompt_token_ids must be integers in [0, {vocab}), got {token!r}")
            ids.append(token_id)
        return ids

    def check_prompt_length(self, num_prompt_tokens: int) -> None:
        """Rejects prompts that leave no room for one generated token (max_model_len is
        never more than the KV pool holds, so such a prompt could also never fit)."""
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt is {num_prompt_tokens} tokens long, but max_model_len is "
                f"{self.max_model_len} (the prompt plus at least one generated token must "
                "fit)")

    def check_priority(self, priority: Any) -> int:
        """The request priority as an int (NumPy integers too); ValueError for anything
        else, or for a non-zero one unless the scheduling policy is "priority" (vLLM
        refuses it too: it would be ignored)."""
        try:
            if isinstance(priority, bool):
                raise TypeError
            value = operator.index(priority)
        except TypeError:
            raise ValueError(f"priority must be an integer, got {priority!r}") from None
        if value != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority is {value}, but the scheduling policy is "
                             f"{self.config.scheduling_policy!r}: start the engine with "
                             "scheduling_policy='priority' (--scheduling-policy priority)")
        return value

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptInput,
        sampling_params: SamplingParams | BeamSearchParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: None = None,
    ) -> str:
        """Validates and queues a request; raises ValueError naming the problem, in which
        case nothing was queued. The arguments after the params are named only: vLLM's
        order (arrival_time first) differs from what a positional call meant here.
        `priority` (lower runs first) needs the "priority" scheduling policy, as in vLLM.
        With `BeamSearchParams` the request is a beam search, whose one output comes
        when it ends, with its `beam_width` best sequences as completions, best first."""
        refuse_lora(lora_request)
        params = (self.get_default_sampling_params() if sampling_params is None
                  else sampling_params)
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError("sampling_params must be a SamplingParams (or BeamSearchParams)")
        if isinstance(params, SamplingParams):
            # Checked again, as a copy: fields set after construction skip the
            # constructor's checks, and a copy keeps later changes by the caller out of
            # a request already queued (vLLM clones them too).
            params = params.clone()
        priority = self.check_priority(priority)
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            # vLLM's place for it: a salt in the prompt dict keys that prompt's blocks.
            if cache_salt is not None and cache_salt != prompt["cache_salt"]:
                raise ValueError("cache_salt is given twice, differently: in the prompt "
                                 "dict and as an argument")
            cache_salt = prompt["cache_salt"]
        if cache_salt is not None:
            if not isinstance(cache_salt, str) or not cache_salt:
                raise ValueError("cache_salt must be a non-empty string")
            check_unicode(cache_salt, "cache_salt")  # hashed as UTF-8 into the block keys
        if request_id is None:
            request_id = self._new_request_id()
        request_id = str(request_id)
        if self.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(params, BeamSearchParams):
            text, token_ids = self.tokenize_prompt(prompt)
            self.check_prompt_length(len(token_ids))
            self._beams.start(request_id, text, token_ids, params, cache_salt,
                              time.monotonic() if arrival_time is None else arrival_time,
                              priority)
            return request_id
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set): "
                             "use stop_token_ids")
        vocab = self.model_config.vocab_size
        for token in params.stop_token_ids:
            if not 0 <= token < vocab:
                raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {token}")
        for token in params.logit_bias or {}:
            if token >= vocab:
                raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}), got {token}")
        bad_words = self._bad_words(params)
        self._check_allowed_token_ids(params, bad_words)
        text, token_ids = self.tokenize_prompt(prompt)
        kept = params.truncate(token_ids, self.max_model_len)
        if len(kept) < len(token_ids):
            text, token_ids = None, kept
        self.check_prompt_length(len(token_ids))
        matchers = self._format_matchers(params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        samples = []
        leader: Request | None = None
        for index in range(params.n):
            core_id = request_id if params.n == 1 else f"{request_id}#{index}"
            sample_params = params if params.n == 1 else params.for_child(index)
            if leader is None:
                request = Request(core_id, token_ids, sample_params, self.hasher,
                                  self.eos_token_ids, cache_salt, None, arrival, priority)
                leader = request
            else:
                request = leader.fork(core_id, sample_params)
            generator = (make_generator(sample_params.seed, self.device)
                         if sample_params.seed is not None else None)
            samples.append(_Sample(
                index, request,
                IncrementalDetokenizer(self.tokenizer if params.detokenize else None,
                                       token_ids, params.stop,
                                       params.include_stop_str_in_output,
                                       params.skip_special_tokens, params.min_tokens,
                                       params.spaces_between_special_tokens),
                generator, [] if params.logprobs is not None else None,
                matchers[index] if matchers else None))
        assert leader is not None
        group = _Group(request_id, text, token_ids, samples, RequestMetrics(arrival),
                       prompt_logprobs=None if params.prompt_logprobs is None else [None],
                       bad_words=bad_words, shaper=OutputShaper(params.output_kind))
        # The scheduler first: it refuses a sample's id already in use (a caller's "a#1"
        # beside n=2's "a#0", "a#1") before anything here points at the new group.
        self.scheduler.add_request(leader, [s.request for s in samples[1:]])
        for sample in samples:
            group.by_core_id[sample.request.request_id] = sample
            self._core_to_group[sample.request.request_id] = group
        self._groups[request_id] = group
        return request_id

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without sampling params runs with: the engine's defaults, with
        those of `generation_config` (vLLM's method)."""
        return SamplingParams(**self.generation_defaults.sampling)

    def _new_request_id(self) -> str:
        """The next number no running request has taken (a caller may have named one
        "3" itself)."""
        while self.has_request(request_id := str(next(self._ids))):
            pass
        return request_id

    def has_request(self, request_id: str) -> bool:
        """Whether an unfinished request (a beam search, or one of its steps, or one
        sample "id#k" of a request with n > 1) has this id."""
        return (request_id in self._groups or request_id in self._beams
                or request_id in self._core_to_group)

    def _check_allowed_token_ids(self, params: SamplingParams,
                                 bad_words: BadWords | None) -> None:
        """Allowed tokens outside the vocabulary, or only ones that are always banned
        (one-token bad words) or blocked from the start (EOS and stop ids before
        min_tokens), would leave the first step nothing to sample."""
        if params.allowed_token_ids is None:
            return
        vocab = self.model_config.vocab_size
        for token in params.allowed_token_ids:
            if token >= vocab:
                raise ValueError(f"allowed_token_ids must be token ids in [0, {vocab}), "
                                 f"got {token}")
        blocked = set(bad_words.always) if bad_words is not None else set()
        if params.min_tokens:
            blocked |= set(params.stop_token_ids)
            if not params.ignore_eos:
                blocked |= self.eos_token_ids
        if set(params.allowed_token_ids) <= blocked:
            raise ValueError("allowed_token_ids leaves nothing to generate: each allowed "
                             "token is a bad word, or EOS or a stop token that "
                             f"min_tokens={params.min_tokens} blocks")

    def _bad_words(self, params: SamplingParams) -> BadWords | None:
        """The request's bad words as token sequences; spellings holding a token the
        model cannot produce (the tokenizer's added tokens beyond its vocabulary) can
        never be generated, so they are left out."""
        if not params.bad_words:
            return None
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer (skip_tokenizer_init is set): "
                             "use logit_bias to ban token ids")
        vocab = self.model_config.vocab_size
        words = [word for word in bad_words_token_ids(self.tokenizer, params.bad_words)
                 if max(word) < vocab]
        return BadWords.from_token_ids(words) if words else None

    def prepare_format(self, params: SamplingParams) -> None:
        """Compiles the request's format ahead of `add_request`, from any thread, so that
        `add_request` finds it compiled (a large grammar takes up to a second, all of it
        on the caller's thread). Raises ValueError for a format that does not compile."""
        if params.structured_outputs is not None and self._grammars is not None:
            self._grammars.compile(params.structured_outputs)

    def _format_matchers(self, params: SamplingParams) -> list[FormatMatcher]:
        """One matcher per completion of a formatted request (none without a format).
        Called after the cheap checks: compiling is the costly one."""
        if params.structured_outputs is None:
            return []
        if self._grammars is None:
            raise ValueError("structured_outputs needs a tokenizer (skip_tokenizer_init is "
                             "set)")
        return self._grammars.matchers(params.structured_outputs, params.n)

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Ends requests now and frees their blocks (they stay cached). Unknown ids are
        ignored: a client may abort a request that just finished. So are a beam search's
        step requests, which end with their search.

        Returns the aborted requests' last outputs (finished, their unfinished completions
        with finish_reason "abort"), which `step` will not: the async engine hands them
        to a stream still read, as vLLM's does. A beam search returns none."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for request_id in request_ids:
            if request_id in self._beams:
                self._beams.abort(request_id)
                continue
            if self._beams.owns(request_id):  # a search's step ends with the search only
                continue
            output = self._end_aborted(request_id, record=True)
            if output is not None:
                outputs.append(output)
        return outputs

    def _end_aborted(self, request_id: str, record: bool) -> RequestOutput | None:
        """Ends one request's samples as aborted and frees their blocks; its last output,
        or None for an id not running. `record`: count it in the latencies (a beam
        search's step is not a request of its own: the search records itself)."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for sample in group.samples:
            self.scheduler.finish(sample.request, RequestStatus.FINISHED_ABORTED)
            self._core_to_group.pop(sample.request.request_id, None)
        group.metrics.finished_time = time.monotonic()
        if record:
            self.latencies.ended(group.end(completed=False))
        return self._output(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or bool(self._beams)

    def get_num_unfinished_requests(self) -> int:
        """Requests as added: a beam search counts once, not once per beam."""
        return len(self._groups) - len(self._beams.step_ids()) + len(self._beams)

    # ---- the step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step; returns the outputs of every request that changed
        (as each request's output_kind shapes them: a FINAL_ONLY one only when done)."""
        begin = time.perf_counter()
        scheduled = self.scheduler.schedule()
        scheduled_at = time.perf_counter()
        self._schedule_time += scheduled_at - begin
        if scheduled.is_empty:
            return []
        # PageLLM's count, every step's work: tokens computed and generated, so a prompt's
        # last chunk counts the first token sampled from it too (vLLM's is output_step's).
        self.latencies.step(scheduled.num_batched_tokens + sum(
            1 + len(item.forks) for item in scheduled.scheduled
            if item.samples and item.request.num_computed_tokens < item.request.num_prompt_tokens))
        self._prompt_tokens_computed += sum(
            max(0, min(item.request.num_computed_tokens + item.num_new_tokens,
                       item.request.num_prompt_tokens) - item.request.num_computed_tokens)
            for item in scheduled.scheduled)
        now = time.monotonic()
        for item in scheduled.scheduled:
            group = self._core_to_group[item.request.request_id]
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
        rows, chunks = self._chunks(scheduled)
        samples: list[_Sample] = []
        try:
            # First: a sibling forked last step and not scheduled in this one must get
            # its copied block even if the rest of this step fails.
            self.runner.copy_blocks([(c.src, c.dst) for c in scheduled.block_copies])
            sampling = None
            if rows:
                groups = [self._core_to_group[r.request_id] for r in rows]
                samples = [group.by_core_id[r.request_id]
                           for group, r in zip(groups, rows, strict=True)]
                bad_words = [group.bad_words for group in groups]
                sampling = SamplingMetadata.from_requests(
                    [r.sampling_params for r in rows],
                    [r.prompt_token_ids for r in rows],
                    [r.output_token_ids for r in rows],
                    [sample.generator for sample in samples],
                    eos_token_ids=sorted(self.eos_token_ids),
                    bad_words=bad_words if any(bad_words) else None,
                    format_tokens=self._format_tokens(samples),
                    generator=self.generator,
                    device=self.device,
                )
            result = self.runner.execute(chunks, sampling)
        except Exception as error:  # noqa: BLE001 - one bad step must not kill the engine
            logger.exception("step failed; failing its %d requests", len(chunks))
            return self._beams.collect(self._fail_step(scheduled, error))
        updated_at = time.perf_counter()
        self._add_prompt_logprobs(scheduled, chunks, result.prompt_logprobs)
        sampled: dict[str, int] = {}
        format_failures: dict[str, str] = {}
        if result.sampled is not None:
            for request, sample, token, logprob in zip(
                    rows, samples, result.sampled.sampled_token_ids, result.sampled.logprobs,
                    strict=True):
                sampled[request.request_id] = token
                if sample.matcher is not None:
                    sample.matcher.accept(token)
                    if sample.matcher.error is not None:
                        format_failures[request.request_id] = sample.matcher.error
                if logprob is not None:
                    sample.cumulative_logprob += logprob.logprob
                    if sample.logprobs is not None:
                        sample.logprobs.append(Logprob(
                            logprob.token_id, logprob.logprob, logprob.rank,
                            logprob.top_logprobs, len(sample.detokenizer.text),
                            self._decoder(request.sampling_params)))
        updated = self.scheduler.update_from_output(scheduled, sampled)
        for request in updated:
            if request.request_id in format_failures:
                self._fail_format(request, format_failures[request.request_id])
        outputs = self._beams.collect(self._process(updated))
        self._update_time += time.perf_counter() - updated_at
        return outputs

    def _fail_format(self, request: Request, reason: str) -> None:
        """Ends a completion whose matcher failed: what it would generate next is no longer
        known to follow the format, and its text must not pass for a formatted answer."""
        logger.warning("request %s: structured output failed: %s", request.request_id, reason)
        group = self._core_to_group[request.request_id]
        group.error = f"structured output failed: {reason}"
        if not request.is_finished:
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        else:
            request.status = RequestStatus.FINISHED_ERROR

    def _format_tokens(self, samples: list[_Sample]) -> tuple[list[int], torch.Tensor] | None:
        """The rows under structured output and the tokens their formats allow next."""
        rows = [row for row, sample in enumerate(samples) if sample.matcher is not None]
        matchers = [sample.matcher for sample in samples if sample.matcher is not None]
        if not matchers:
            return None
        assert self._grammars is not None
        return rows, allowed_tokens(matchers, self._grammars.mask_words,
                                    self.model_config.vocab_size)

    def _add_prompt_logprobs(self, scheduled: SchedulerOutput, chunks: list[SequenceChunk],
                             scores: list[list[TokenLogprobs]]) -> None:
        """Appends the prompt tokens scored this step. A prompt computed again after a
        preemption scores the same tokens again: only new positions are kept."""
        for item, chunk, chunk_scores in zip(scheduled.scheduled, chunks, scores, strict=True):
            if not chunk_scores:
                continue
            collected = self._core_to_group[item.request.request_id].prompt_logprobs
            assert collected is not None
            for offset, score in enumerate(chunk_scores):
                if chunk.start_pos + 1 + offset == len(collected):
                    collected.append(Logprob(score.token_id, score.logprob, score.rank,
                                             score.top_logprobs, 0,
                                             self._decoder(item.request.sampling_params)))

    def _decoder(self, params: SamplingParams) -> Callable[[int], str] | None:
        """What gives logprob entries their `decoded_token` (vLLM's): nothing without
        text, or without a tokenizer."""
        if not params.detokenize:
            return None
        return self.decode_token

    def _prompt_unscored(self, request: Request) -> bool:
        collected = self._core_to_group[request.request_id].prompt_logprobs
        return collected is not None and len(collected) < request.num_prompt_tokens

    def _chunks(self, scheduled: SchedulerOutput) -> tuple[list[Request], list[SequenceChunk]]:
        rows: list[Request] = []
        chunks: list[SequenceChunk] = []
        for item in scheduled.scheduled:
            request = item.request
            start = request.num_computed_tokens
            num_samples = 1 + len(item.forks) if item.samples else 0
            end = start + item.num_new_tokens
            num_top = request.sampling_params.prompt_logprobs
            targets: list[int] = []
            if num_top is not None and self._prompt_unscored(request):
                # Positions up to the last prompt token's predecessor score the prompt.
                last = min(end, request.num_prompt_tokens - 1)
                targets = request.all_token_ids[start + 1 : last + 1]
            chunks.append(SequenceChunk(
                request.all_token_ids[start:end], start,
                self.kv_manager.get_block_ids(request), num_samples, targets, num_top or 0))
            if item.samples:
                rows.append(request)
                rows.extend(item.forks)
        return rows, chunks

    def _process(self, updated: list[Request]) -> list[RequestOutput]:
        now = time.monotonic()
        changed: dict[str, _Group] = {}
        generated = prompts_computed = 0
        for request in updated:
            group = self._core_to_group.get(request.request_id)
            if group is None:
                continue
            sample = group.by_core_id[request.request_id]
            generated += 1
            if not self._beams.owns(group.request_id):  # a search records its own
                if sample.last_token_time is None:
                    self.latencies.first_token(now - group.metrics.arrival_time)
                else:
                    self.latencies.token_gap(now - sample.last_token_time)
            sample.last_token_time = now
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
                # Counted once the prompt is computed, as vLLM counts it: a request aborted
                # while queued adds none.
                self._prompt_tokens += len(group.prompt_token_ids)
                prompts_computed += (len(group.prompt_token_ids)
                                     - max(group.samples[0].request.num_cached_tokens, 0))
            self._detokenize(sample)
            changed[group.request_id] = group
        self._generation_tokens += generated
        if generated:
            self.latencies.output_step(prompts_computed, generated)
        outputs = []
        for group in changed.values():
            group.metrics.last_token_time = now
            group.metrics.token_times.append(now)
            output = self._output(group)
            if output is not None:
                outputs.append(output)
            if group.finished:
                group.metrics.finished_time = now
                if not self._beams.owns(group.request_id):
                    self.latencies.ended(group.end(completed=True))
                self._forget(group)
        return outputs

    def _detokenize(self, sample: _Sample) -> None:
        """Adds the request's new token to its text and ends the request on a stop string.

        As in vLLM, the token that stopped the request (EOS or one of `stop_token_ids`)
        adds no text unless `include_stop_str_in_output` is set. A stop string found in
        the last step's text wins over the reason the scheduler gave (length, say): the
        text was cut at it; but not over an error, which says the text cannot be trusted.
        """
        request = sample.request
        stopped_on_token = request.status == RequestStatus.FINISHED_STOPPED
        detokenizer = sample.detokenizer
        stop = None
        if not stopped_on_token or request.sampling_params.include_stop_str_in_output:
            stop = detokenizer.add_token(request.output_token_ids[-1])
        if stop is None and request.is_finished:
            stop = detokenizer.finish()
        if stop is None:
            return
        request.stop_reason = stop
        if request.is_finished:
            if request.status != RequestStatus.FINISHED_ERROR:
                request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)

    def _output(self, group: _Group) -> RequestOutput | None:
        """The group's output as its output_kind shapes it (None: held back)."""
        if not group.shaper.wants(group.finished):
            return None
        completions = []
        for sample in group.samples:
            request = sample.request
            finish_reason = request.status.finish_reason
            completions.append(CompletionOutput(
                index=sample.index,
                text=sample.detokenizer.visible_text(finish_reason is not None),
                token_ids=list(request.output_token_ids),
                finish_reason=finish_reason,
                stop_reason=request.stop_reason,
                logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
                cumulative_logprob=(sample.cumulative_logprob
                                    if sample.logprobs is not None else None),
            ))
        leader = group.samples[0].request
        return group.shaper(RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=group.finished,
            num_cached_tokens=max(leader.num_cached_tokens, 0),
            metrics=group.metrics,
            prompt_logprobs=(list(group.prompt_logprobs)
                             if group.prompt_logprobs is not None else None),
            error=group.error,
        ))

    def _forget(self, group: _Group) -> None:
        self._groups.pop(group.request_id, None)
        for sample in group.samples:
            self._core_to_group.pop(sample.request.request_id, None)

    def _fail_step(self, scheduled: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        outputs = []
        groups: dict[str, _Group] = {}
        for item in scheduled.scheduled:
            group = self._core_to_group.get(item.request.request_id)
            if group is not None:
                groups[group.request_id] = group
        for group in groups.values():
            for sample in group.samples:
                self.scheduler.finish(sample.request, RequestStatus.FINISHED_ERROR)
            group.error = f"internal error while computing this request: {error}"
            if not self._beams.owns(group.request_id):
                self.latencies.ended(group.end(completed=True))
            output = self._output(group)
            assert output is not None  # a finished output is never held back
            outputs.append(output)
            self._forget(group)
        return outputs

    # ---- introspection --------------------------------------------------------------

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forgets every cached block; False while requests hold blocks (as in vLLM),
        unless `reset_running_requests` preempts them first: they recompute their
        prompts and tokens so far, from nothing, and go on (greedy tokens unchanged)."""
        if reset_running_requests:
            self.scheduler.preempt_running()
        if self.kv_manager.reset_prefix_cache():
            return True
        logger.warning("prefix cache not reset: %d requests are unfinished; reset when "
                       "the engine is idle", self.get_num_unfinished_requests())
        return False

    def take_kv_cache_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call, oldest first: `BlockStored`
        (a full block became findable, with its parent's hash and its tokens),
        `BlockRemoved` (evicted) and `AllBlocksCleared` (reset). Replaying them keeps an
        observer's copy of the cached hashes exact."""
        if not self.config.enable_kv_cache_events:
            raise ValueError("KV cache events are off: build the engine with "
                             "enable_kv_cache_events=True")
        return self.kv_manager.take_events()

    def _request_counts(self) -> tuple[int, int]:
        """Running and waiting requests as callers added them. A beam search counts once,
        as running once a step of it has run or runs now: between two steps its next
        step's requests wait, and a dashboard would otherwise show a busy search as
        queued."""
        running, waiting = self.scheduler.num_running, self.scheduler.num_waiting
        started = self._beams.started()
        for step_id, search_id in self._beams.step_ids():
            group = self._groups.get(step_id)
            if group is None:  # finished, its output not yet collected
                continue
            if group.samples[0].request.status == RequestStatus.RUNNING:
                running -= 1
                started.add(search_id)
            else:
                waiting -= 1
        return running + len(started), waiting + len(self._beams) - len(started)

    def get_stats(self) -> EngineStats:
        cache = self.kv_manager.stats()
        timings = self.runner.timings.as_dict()
        timings["schedule_s"] = self._schedule_time
        timings["update_s"] = self._update_time
        num_running, num_waiting = self._request_counts()
        return EngineStats(
            num_running=num_running,
            num_waiting=num_waiting,
            kv_cache_usage=cache.usage,
            num_blocks=cache.num_blocks,
            num_free_blocks=cache.blocks_free,
            prefix_cache_queries=cache.queries,
            prefix_cache_hits=cache.hits,
            prefix_cache_hit_rate=cache.hit_rate,
            num_evictions=cache.evictions,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            prompt_tokens_computed=self._prompt_tokens_computed,
            timings=timings,
            latencies=self.latencies.copy(),
            cache_config={"block_size": str(self.config.block_size),
                          "num_gpu_blocks": str(cache.num_blocks),
                          "kv_cache_size_tokens": str(cache.num_blocks * self.config.block_size),
                          "kv_cache_max_concurrency": str(cache.num_blocks / blocks_for_tokens(
                              self.max_model_len, self.config.block_size)),
                          "enable_prefix_caching": str(self.config.enable_prefix_caching),
                          "prefix_caching_hash_algo": self.config.prefix_caching_hash_algo,
                          "cache_dtype": self.config.kv_cache_dtype,
                          "gpu_memory_utilization": str(self.config.gpu_memory_utilization)},
        )

    def get_metrics(self) -> list[Metric]:
        """vLLM's snapshot of the engine's metrics (see `LLM.get_metrics`)."""
        return metrics_snapshot(self.get_stats(), served_model_name(self.config.model))
