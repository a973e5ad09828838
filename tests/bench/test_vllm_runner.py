"""The vLLM contender's plumbing, against a stand-in `vllm` package: the driver starts in
another interpreter, ignores vLLM's own stdout logging, and answers in prompt order.
(vLLM itself is optional and not installed here.)"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from pagellm.bench.contender import GenerateRequest
from pagellm.bench.vllm_runner import VLLMContender

FAKE_VLLM = '''
import types
print("INFO vllm is starting (a log line on stdout)")
print("\tlocal_rank=0, core ids=[0]")
__version__ = "0.0-fake"

class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False):
        self.max_tokens = max_tokens

class _Engine:
    """Each step gives every running request one more token (its last prompt token)."""

    def __init__(self):
        self.seen = set()
        self.running = {}

    def add_request(self, request_id, prompt, params):
        ids = prompt["prompt_token_ids"]
        cached = 16 if tuple(ids[:16]) in self.seen else 0
        self.seen.add(tuple(ids[:16]))
        self.running[request_id] = (ids, params.max_tokens, cached, [])

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        print("INFO step")
        outputs = []
        for request_id, (ids, limit, cached, out) in list(self.running.items()):
            out.append(ids[-1])
            done = len(out) == limit
            if done:
                del self.running[request_id]
            outputs.append(types.SimpleNamespace(
                request_id=request_id, finished=done, num_cached_tokens=cached,
                outputs=[types.SimpleNamespace(token_ids=list(out))]))
        return outputs


class LLM:
    def __init__(self, **kwargs):
        import os
        if "VLLM_CPU_KVCACHE_SPACE" in os.environ:
            raise RuntimeError("the whole-GiB variable would override kv_cache_memory_bytes")
        self.kwargs = kwargs
        self.llm_engine = _Engine()
        # A fake 1 MiB per 128-token block, so the pool shows the bytes asked for.
        self.llm_engine.vllm_config = types.SimpleNamespace(cache_config=types.SimpleNamespace(
            num_gpu_blocks=kwargs["kv_cache_memory_bytes"] >> 20, block_size=128))

    def reset_prefix_cache(self):
        self.llm_engine.seen.clear()

    def generate(self, prompts, params, use_tqdm=True):
        for index, prompt in enumerate(prompts):
            self.llm_engine.add_request(f"warmup-{index}", prompt, params)
        while self.llm_engine.has_unfinished_requests():
            self.llm_engine.step()
'''


def test_vllm_contender_speaks_the_driver_protocol(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "vllm"
    package.mkdir()
    (package / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    contender = VLLMContender("vllm", sys.executable, tmp_path / "model", True,
                              {"block_size": 16, "max_num_seqs": 64, "max_num_batched_tokens": 512})
    startup = contender.start(kv_cache_tokens=None, warmup=[5, 4, 3])
    try:
        assert startup >= 0
        # PageLLM's default 1 GiB pool, in exact bytes
        assert contender.stats() == {"vllm_version": "0.0-fake", "kv_pool_tokens": 1024 * 128,
                                     "vllm_worker_cores": "[0]"}
        prompts = [list(range(1, 21)), list(range(1, 18)), [7, 8, 9]]
        origin = time.perf_counter()
        records = contender.generate(GenerateRequest(prompts, 3), origin)
        assert [r.output_ids for r in records] == [[20] * 3, [17] * 3, [9] * 3]
        assert [r.cached_tokens for r in records] == [0, 16, 0]
        assert [r.prompt_len for r in records] == [20, 17, 3]
        assert all(r.finish >= r.first_token > r.arrival >= 0 for r in records)
        assert all(len(r.token_times) == 3 and r.token_times == sorted(r.token_times)
                   for r in records)
        again = contender.generate(GenerateRequest(prompts[:1], 2), origin)
        assert again[0].cached_tokens == 16 and again[0].output_ids == [20, 20]
        assert contender.timings() is None
    finally:
        contender.close()
    contender.close()


def test_a_driver_that_dies_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "vllm"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('no vllm here')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    contender = VLLMContender("vllm", sys.executable, tmp_path / "model", False)
    with pytest.raises(RuntimeError, match="exited with status"):
        contender.start(kv_cache_tokens=None, warmup=[1])


def test_num_threads_binds_vllms_worker_to_as_many_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM-cpu reserves a core for its front end by default (one compute thread on two
    cores): --num-threads gives its worker as many as PageLLM gets, unless the user bound
    it; without the option vLLM keeps its default."""
    from pagellm.bench.vllm_runner import vllm_cpu_env

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 1, 2})
    assert vllm_cpu_env(2) == {"VLLM_CPU_OMP_THREADS_BIND": "1,2",
                               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert vllm_cpu_env(None) == {}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    assert vllm_cpu_env(2) == {}


def test_vllm_python_must_have_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A python without vLLM (or /bin/true) passed the check and failed after the other
    contenders had run, with "No module named vllm" inside two tracebacks."""
    import argparse

    from pagellm.bench.cli import python_path

    monkeypatch.delenv("PYTHONPATH", raising=False)
    for python in (sys.executable, "/bin/true"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a python with vLLM"):
            python_path(python)
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert python_path(sys.executable) == sys.executable


def test_a_stopped_child_takes_what_it_started_with_it(tmp_path: Path) -> None:
    """An interrupted benchmark left vLLM's engine processes (and a server holding its
    port) running after the child it had started was gone."""
    import subprocess

    from pagellm.bench.processes import stop_group

    pids = tmp_path / "pids"
    child = subprocess.Popen(["bash", "-c", f"trap '' TERM; sleep 100 & echo $! > {pids}; "
                              "wait"], start_new_session=True)
    deadline = time.monotonic() + 10
    while not pids.exists() or not pids.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int(pids.read_text())
    stop_group(child, grace_s=0.5)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{grandchild}").exists() and "Z" not in Path(
            f"/proc/{grandchild}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the child's own child still runs"
        time.sleep(0.05)
