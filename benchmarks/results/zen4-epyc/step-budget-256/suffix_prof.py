"""The shared-prefix suffix phase in int8 mode, budgets 512 and 256 alternated in one
process, six rounds: its wall time and a torch profile of just those steps (the steps
after the shared prefix's, until every request has its first token)."""

import collections
import os
import statistics
import time

os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.bench.workloads import build_workload  # noqa: E402

PREFIX_STEPS = {512: 2, 256: 4}  # the first 1,024 prefix tokens
SUFFIX_STEPS = {512: 3, 256: 5}  # until the 32nd first token
ROUNDS = 6


def main() -> None:
    llms = {b: LLM(max_num_batched_tokens=b, quantize_activations=True,
                   kv_cache_memory_bytes=256 << 20) for b in (512, 256)}
    workload = build_workload("shared-prefix", llms[512].get_tokenizer())
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    self_ms: dict[int, collections.Counter[str]] = {b: collections.Counter() for b in llms}
    calls: dict[int, collections.Counter[str]] = {b: collections.Counter() for b in llms}
    walls: dict[int, list[float]] = {b: [] for b in llms}
    for round_ in range(ROUNDS):
        for budget in (512, 256) if round_ % 2 == 0 else (256, 512):
            llm = llms[budget]
            engine = llm.llm_engine
            llm.reset_prefix_cache()
            for i, prompt in enumerate(workload.prompts):
                engine.add_request(f"{round_}-{i}", {"prompt_token_ids": list(prompt)}, params)
            for _ in range(PREFIX_STEPS[budget]):
                engine.step()
            with torch.profiler.profile() as profile:
                start = time.perf_counter()
                for _ in range(SUFFIX_STEPS[budget]):
                    engine.step()
                walls[budget].append(time.perf_counter() - start)
            for event in profile.key_averages():
                self_ms[budget][event.key] += event.self_cpu_time_total / 1e3
                calls[budget][event.key] += event.count
            while engine.has_unfinished_requests():
                engine.step()
    for budget in (512, 256):
        print(budget, "suffix phase", [round(x, 3) for x in walls[budget]], "median",
              round(statistics.median(walls[budget]), 3))
    keys = sorted(set(self_ms[512]) | set(self_ms[256]),
                  key=lambda k: -(self_ms[512][k] + self_ms[256][k]))[:14]
    for key in keys:
        print(f"{key:40s} 512: {self_ms[512][key] / ROUNDS:8.1f} ms "
              f"({calls[512][key] // ROUNDS:5d})  256: {self_ms[256][key] / ROUNDS:8.1f} ms "
              f"({calls[256][key] // ROUNDS:5d})")


if __name__ == "__main__":
    main()
