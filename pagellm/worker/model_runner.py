"""Runs one step on the device: copy-on-write copies, input tensors, forward, sampling."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagellm.model.llama import LlamaForCausalLM
from pagellm.worker.cuda_graphs import CudaGraphRunner
from pagellm.worker.input_batch import SequenceChunk, prepare_inputs
from pagellm.worker.kv_cache import KVCache
from pagellm.worker.sampler import (
    SamplerOutput,
    SamplingMetadata,
    TokenLogprobs,
    sample,
    score_tokens,
)
from pagellm.worker.thread_tuner import ThreadTuner
from pagellm.worker.torch_threads import set_threads


@dataclass
class StepTimings:
    """Seconds spent in each phase of the last steps (accumulated; see `reset`)."""

    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    steps: int = 0
    tokens: int = 0

    def as_dict(self) -> dict[str, float]:
        return {"prepare_s": self.prepare, "forward_s": self.forward, "sample_s": self.sample,
                "steps": self.steps, "tokens": self.tokens}


_SCORE_ROWS = 64  # prompt positions scored at once (see execute)


@dataclass
class StepOutput:
    """What one step computed: the sampled tokens (None when no row samples) and, per
    chunk, the scores of its `prompt_targets` (empty where it has none)."""

    sampled: SamplerOutput | None
    prompt_logprobs: list[list[TokenLogprobs]]


@dataclass
class ModelRunner:
    """Runs steps; with a `thread_tuner`, decode steps run on as many of torch's threads
    as it finds fastest (see thread_tuner.py), every other step on all of them; with
    `graphs`, decode steps replay CUDA graphs (see cuda_graphs.py)."""

    model: LlamaForCausalLM
    kv_cache: KVCache
    device: torch.device
    thread_tuner: ThreadTuner | None = None
    graphs: CudaGraphRunner | None = None
    timings: StepTimings = field(default_factory=StepTimings)

    def _use_threads(self, decode_rows: int) -> int:
        """Sets torch's thread count for this step (only when it changes); returns it."""
        tuner = self.thread_tuner
        assert tuner is not None
        threads = tuner.threads_for(decode_rows) if decode_rows else tuner.max_threads
        set_threads(threads)
        return threads

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """A step's copy-on-write copies (src -> dst), counted in its input preparation;
        run before anything else of the step, which may fail (see LLMEngine.step)."""
        start = time.perf_counter()
        self.kv_cache.copy_blocks(pairs)
        self.timings.prepare += time.perf_counter() - start

    @torch.inference_mode()
    def execute(
        self,
        chunks: list[SequenceChunk],
        sampling: SamplingMetadata | None,
    ) -> StepOutput:
        """Computes the chunks' KV and returns one sampled token per sampling row, in the
        order of the chunks (a chunk with num_samples = k owns k consecutive rows), and
        the chunks' prompt logprobs."""
        start = time.perf_counter()
        inputs = prepare_inputs(chunks, self.kv_cache.block_size, self.device)
        decode_rows = len(chunks) if inputs.input_ids.numel() == len(chunks) else 0
        threads = self._use_threads(decode_rows) if self.thread_tuner is not None else 0
        prepared = time.perf_counter()
        hidden = None
        if decode_rows and self.graphs is not None:
            hidden = self.graphs.forward(inputs)
        if hidden is None:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.tensors,
                                inputs.attn_metadata)
        prompt_logprobs: list[list[TokenLogprobs]] = []
        first_row = 0
        for chunk in chunks:
            scores: list[TokenLogprobs] = []
            # A few rows at a time: scoring holds several [rows, vocab] tensors, which
            # for a whole chunk of a large vocabulary would be gigabytes.
            for at in range(0, len(chunk.prompt_targets), _SCORE_ROWS):
                targets = chunk.prompt_targets[at : at + _SCORE_ROWS]
                rows = hidden[first_row + at : first_row + at + len(targets)]
                scores += score_tokens(self.model.compute_logits(rows), targets,
                                       chunk.num_prompt_logprobs)
            prompt_logprobs.append(scores)
            first_row += len(chunk.token_ids)
        result = None
        if sampling is not None and inputs.logits_indices.numel():
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            forwarded = time.perf_counter()
            result = sample(logits, sampling)
        else:
            forwarded = time.perf_counter()
        done = time.perf_counter()
        if decode_rows and self.thread_tuner is not None:
            self.thread_tuner.record(decode_rows, threads, done - prepared)
        timings = self.timings
        timings.prepare += prepared - start
        timings.forward += forwarded - prepared
        timings.sample += done - forwarded
        timings.steps += 1
        timings.tokens += int(inputs.input_ids.numel())
        return StepOutput(result, prompt_logprobs)
