"""The vLLM contender's plumbing, against a stand-in `vllm` package: the driver starts in
another interpreter, ignores vLLM's own stdout logging, and answers in prompt order.
(vLLM itself is optional and not installed here.)"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from pagellm.bench.contender import GenerateRequest
from pagellm.bench.vllm_runner import VLLMContender

FAKE_VLLM = '''
import types
print("INFO vllm is starting (a log line on stdout)")
__version__ = "0.0-fake"

class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False):
        self.max_tokens = max_tokens

class LLM:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.seen = set()

    def reset_prefix_cache(self):
        self.seen.clear()

    def generate(self, prompts, params, use_tqdm=True):
        print("INFO generating")
        outs = []
        for p in prompts:
            ids = p["prompt_token_ids"]
            cached = 16 if tuple(ids[:16]) in self.seen else 0
            self.seen.add(tuple(ids[:16]))
            outs.append(types.SimpleNamespace(
                outputs=[types.SimpleNamespace(token_ids=[ids[-1]] * params.max_tokens)],
                num_cached_tokens=cached, metrics=None))
        return outs
'''


def test_vllm_contender_speaks_the_driver_protocol(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "vllm"
    package.mkdir()
    (package / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    contender = VLLMContender("vllm", sys.executable, tmp_path / "model", True,
                              {"block_size": 16})
    startup = contender.start(kv_cache_tokens=None, warmup=[5, 4, 3])
    try:
        assert startup >= 0
        assert contender.stats() == {"vllm_version": "0.0-fake"}
        prompts = [list(range(1, 21)), list(range(1, 18)), [7, 8, 9]]
        origin = time.perf_counter()
        records = contender.generate(GenerateRequest(prompts, 3), origin)
        assert [r.output_ids for r in records] == [[20] * 3, [17] * 3, [9] * 3]
        assert [r.cached_tokens for r in records] == [0, 16, 0]
        assert [r.prompt_len for r in records] == [20, 17, 3]
        assert all(r.finish >= r.arrival >= 0 for r in records)
        assert all(r.first_token != r.first_token for r in records)  # NaN: not reported
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
