"""Decode steps padded to captured shapes (worker/cuda_graphs.py), checked on the CPU.

A CUDA graph only exists on a GPU (test_cuda.py captures real ones there), but everything
around it does not: the padded batch, the widened block tables, the static buffers that
rows of earlier steps leave behind, the padding block and the fixed-shape attention. Here
the runner's capture is replaced by running the step eagerly each time, on the same
buffers, and the engine must still give the float32 reference's greedy tokens and leave
no block in use.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.engine import llm_engine
from pagellm.engine.config import EngineConfig
from pagellm.engine.llm_engine import LLMEngine
from pagellm.worker import cuda_graphs
from pagellm.worker.cuda_graphs import CudaGraphRunner, capture_sizes
from tests.engine.conftest import assert_greedy_equal, assert_idle, hf_greedy, make_tiny_model


@pytest.fixture
def replayed_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine builds its graph runner on the CPU too, and a 'capture' returns the step
    itself, run on every replay."""
    monkeypatch.setattr(llm_engine, "uses_cuda_graphs", lambda *args: True)
    monkeypatch.setattr(CudaGraphRunner, "_record", lambda self, step: step)


def test_capture_sizes_double_up_to_the_limit() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]


def check_shrinking_batches(llm: LLM, reference: Any) -> None:
    """Five requests stop one after another, so batches of 5, 4, 3, 2 and 1 run, padded to
    6, 4, 4, 2 and 1 rows over rows that earlier steps left; their contexts cross table
    widths of 4, 8 and 16 blocks. `llm` has block_size 8 and max_num_seqs 6."""
    engine = llm.llm_engine
    graphs = engine.runner.graphs
    assert graphs is not None
    assert engine.kv_cache.padding_block == engine.kv_manager.pool.num_blocks
    assert engine.kv_cache.tensors[0].shape[1] == engine.kv_manager.pool.num_blocks + 1
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 384) for _ in range(n)] for n in (3, 20, 31, 9, 70)]
    lengths = [30, 24, 18, 12, 6]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    for warm in (False, True):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        assert_idle(engine)
        for prompt, out, n in zip(prompts, outputs, lengths, strict=True):
            assert_greedy_equal(reference, prompt, list(out.outputs[0].token_ids),
                                hf_greedy(reference, prompt, n), f"padded decode {warm=}")
    shapes = set(graphs._replays)
    assert {batch for batch, _ in shapes} == {1, 2, 4, 6}
    assert {width for _, width in shapes} >= {4, 8, 16}


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch", "cpu_kernels"])
def test_padded_decode_steps_give_the_reference_tokens(
        replayed_eagerly: None, tiny: Path, reference: Any, cpu_kernels: bool) -> None:
    check_shrinking_batches(LLM(str(tiny), device="cpu", skip_tokenizer_init=True,
                                block_size=8, max_num_seqs=6, kv_cache_memory_bytes=2 << 20,
                                cpu_kernels=cpu_kernels), reference)


def test_preempted_requests_resume_through_padded_steps(
        replayed_eagerly: None, tiny: Path, reference: Any) -> None:
    llm = LLM(str(tiny), device="cpu", skip_tokenizer_init=True, block_size=8,
              kv_cache_memory_bytes=512 * 8 * 14, cpu_kernels=False)
    rng = random.Random(11)
    prompts = [[rng.randrange(2, 384) for _ in range(n)] for n in (46, 52, 61)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                           use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    assert_idle(llm.llm_engine)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_greedy_equal(reference, prompt, list(out.outputs[0].token_ids),
                            hf_greedy(reference, prompt, 24), "padded decode, preempted")


def test_steps_beyond_the_captured_shapes_run_eagerly(replayed_eagerly: None,
                                                      tiny: Path) -> None:
    llm = LLM(str(tiny), device="cpu", skip_tokenizer_init=True, block_size=8,
              max_num_seqs=2, kv_cache_memory_bytes=2 << 20, cpu_kernels=False)
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None
    graphs.batch_sizes = [1]
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 3)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(out.outputs[0].token_ids) for out in outputs] == [6, 3]
    assert {batch for batch, _ in graphs._replays} == {1}
    assert_idle(llm.llm_engine)


def test_stale_padding_rows_under_a_sliding_window(replayed_eagerly: None,
                                                   tmp_path: Path) -> None:
    """Step A runs 4 rows, one of them 101 tokens long; step B pads 3 short rows to 4
    over one block, and its padding row, left as step A had it, would see no key within
    its window of 4 and write the NaN of an empty softmax into the padding block. A later
    step of exactly 8 rows (no padding row to overwrite it) has new rows whose padded
    columns point there: they must still give the reference's tokens."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "mistral", "mistral", sliding_window=4)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", skip_tokenizer_init=True,
                                    block_size=8, max_num_seqs=8, cpu_kernels=False,
                                    kv_cache_memory_bytes=2 << 20))
    rng = random.Random(3)
    requests: dict[str, tuple[list[int], int]] = {}
    done: dict[str, list[int]] = {}

    def add(request_id: str, prompt_len: int, max_tokens: int) -> None:
        prompt = [rng.randrange(2, 384) for _ in range(prompt_len)]
        requests[request_id] = (prompt, max_tokens)
        engine.add_request(request_id, {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=max_tokens,
                                          ignore_eos=True))

    def run(steps: int) -> None:
        for _ in range(steps):
            if not engine.has_unfinished_requests():
                return
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)

    for i in range(3):
        add(f"short{i}", 5, 12)
    add("long", 100, 2)
    run(3)
    add("new0", 20, 6)
    for i in range(1, 5):
        add(f"new{i}", 5, 6)
    run(1000)
    assert_idle(engine)
    for request_id, (prompt, max_tokens) in requests.items():
        assert_greedy_equal(reference, prompt, done[request_id],
                            hf_greedy(reference, prompt, max_tokens), request_id)


def test_widely_padded_steps_run_eagerly(replayed_eagerly: None, tiny: Path,
                                         reference: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One long request among short ones: padding every row to its table would gather
    many times the keys the rows hold, so the step runs eagerly."""
    monkeypatch.setattr(cuda_graphs, "MAX_PADDED_KEYS", 64)
    llm = LLM(str(tiny), device="cpu", skip_tokenizer_init=True, block_size=8,
              max_num_seqs=4, kv_cache_memory_bytes=2 << 20, cpu_kernels=False)
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None
    rng = random.Random(8)
    prompts = [[rng.randrange(2, 384) for _ in range(n)] for n in (90, 3, 4, 5)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
    assert graphs.num_graphs == 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_greedy_equal(reference, prompt, list(out.outputs[0].token_ids),
                            hf_greedy(reference, prompt, 4), "widely padded")
    llm.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(max_tokens=3),
                 use_tqdm=False)
    assert graphs.num_graphs == 1
    assert_idle(llm.llm_engine)


def test_a_failed_capture_leaves_that_shape_eager(
        tiny: Path, reference: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def fail(self: CudaGraphRunner, step: Any) -> Any:
        calls.append(1)
        raise torch.cuda.OutOfMemoryError("out of memory while capturing")

    monkeypatch.setattr(llm_engine, "uses_cuda_graphs", lambda *args: True)
    monkeypatch.setattr(CudaGraphRunner, "_record", fail)
    llm = LLM(str(tiny), device="cpu", skip_tokenizer_init=True, block_size=8,
              kv_cache_memory_bytes=2 << 20, cpu_kernels=False)
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None
    prompt = [7, 8, 9, 10, 11]
    for _ in range(2):
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)[0]
        assert_greedy_equal(reference, prompt, list(out.outputs[0].token_ids),
                            hf_greedy(reference, prompt, 6), "capture failed")
    # One try per shape (1 row over 1 block, then 2 blocks), never retried.
    assert len(calls) == len(graphs._replays) == 2
    assert graphs.num_graphs == 0
    assert "could not be captured" in caplog.text
    assert_idle(llm.llm_engine)


def test_graphs_only_on_cuda_and_not_when_eager_is_enforced(tiny: Path) -> None:
    llm = LLM(str(tiny), device="cpu", skip_tokenizer_init=True,
              kv_cache_memory_bytes=1 << 20)
    assert llm.llm_engine.runner.graphs is None
    assert llm.llm_engine.kv_cache.padding_block is None
    model = llm.llm_engine.model
    cuda = torch.device("cuda")
    assert llm_engine.uses_cuda_graphs(cuda, EngineConfig(), model)
    assert not llm_engine.uses_cuda_graphs(cuda, EngineConfig(enforce_eager=True), model)
    assert not llm_engine.uses_cuda_graphs(torch.device("cpu"), EngineConfig(), model)


@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_through_padded_steps(replayed_eagerly: None, tmp_path: Path,
                                             seed: int) -> None:
    """Requests of random lengths arrive while others run, on a sliding-window model
    (odd seeds) or a plain one, in a 112-token pool that makes most seeds preempt: every
    request still gives the reference's greedy tokens and the pool ends empty."""
    from transformers import AutoModelForCausalLM

    rng = random.Random(seed)
    arch, extra = ("mistral", {"sliding_window": rng.choice([3, 6, 11])}) if seed % 2 else (
        "llama", {})
    path = make_tiny_model(tmp_path / arch, arch, **extra)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", skip_tokenizer_init=True,
                                    block_size=rng.choice([4, 8]), max_num_seqs=6,
                                    cpu_kernels=False, max_num_batched_tokens=64,
                                    kv_cache_memory_bytes=512 * 8 * 14))
    requests: dict[str, tuple[list[int], int]] = {}
    done: dict[str, list[int]] = {}
    for _ in range(400):
        if len(requests) < 16 and rng.random() < 0.3:
            request_id = f"r{len(requests)}"
            prompt = [rng.randrange(2, 384) for _ in range(rng.choice([rng.randint(1, 8), rng.randint(1, 60)]))]
            max_tokens = rng.randint(1, 24)
            requests[request_id] = (prompt, max_tokens)
            engine.add_request(request_id, {"prompt_token_ids": prompt},
                               SamplingParams(temperature=0, max_tokens=max_tokens,
                                              ignore_eos=True))
        for out in engine.step() if engine.has_unfinished_requests() else []:
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if len(requests) == 16 and not engine.has_unfinished_requests():
            break
    assert len(done) == len(requests) == 16
    assert_idle(engine)
    if seed in (2, 5):  # these draws overflow the 112-token pool
        assert engine.get_stats().num_preemptions > 0
    for request_id, (prompt, max_tokens) in requests.items():
        assert_greedy_equal(reference, prompt, done[request_id],
                            hf_greedy(reference, prompt, max_tokens), f"{seed} {request_id}")
