"""Two engines in one process, step budgets 512 and 256, alternated round by round on the
same random prompts, caching off (`python pair.py int8|f32 ROUNDS MAX_TOKENS PROMPTS`)."""

import os
import random
import statistics
import sys
import time

os.environ["HF_HUB_OFFLINE"] = "1"

from pagellm import LLM, SamplingParams  # noqa: E402


def main() -> None:
    int8, rounds = sys.argv[1] == "int8", int(sys.argv[2])
    max_tokens, num_prompts = int(sys.argv[3]), int(sys.argv[4])
    llms = {budget: LLM(quantize_activations=int8, max_num_batched_tokens=budget,
                        enable_prefix_caching=False) for budget in (512, 256)}
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(1024)]}
               for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for llm in llms.values():
        llm.generate(prompts[:1], params, use_tqdm=False)
    times: dict[int, list[float]] = {512: [], 256: []}
    for r in range(rounds):
        order = list(llms.items()) if r % 2 == 0 else list(llms.items())[::-1]
        for budget, llm in order:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times[budget].append(time.perf_counter() - start)
    for budget, values in times.items():
        print(budget, [round(x, 2) for x in values], "median",
              round(statistics.median(values), 3))
    print("ratio 256/512 per pair",
          [round(a / b, 3) for a, b in zip(times[256], times[512], strict=True)])


if __name__ == "__main__":
    main()
