"""The main job: the default model answers two questions that share a system prompt.

The second request finds the system prompt's KV blocks in the prefix cache, so only its
own question is computed; the script prints how many prompt tokens came from the cache.
"""

from __future__ import annotations

import time

from pagellm import LLM, SamplingParams

SYSTEM = ("You are a friendly assistant for a small bakery. You answer customers' "
          "questions about bread, pastries and opening hours in two short sentences.")


def main() -> None:
    start = time.perf_counter()
    llm = LLM()
    print(f"engine ready in {time.perf_counter() - start:.1f} s")
    params = SamplingParams(temperature=0, max_tokens=48)
    for question in ("Which bread do you recommend for sandwiches?",
                     "Are your croissants made with butter?"):
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": question}]
        begin = time.perf_counter()
        (output,) = llm.chat(messages, params, use_tqdm=False)
        completion = output.outputs[0]
        print(f"\nuser: {question}\nassistant: {completion.text.strip()}")
        print(f"[{len(output.prompt_token_ids)} prompt tokens, {output.num_cached_tokens} "
              f"from the prefix cache, {len(completion.token_ids)} generated in "
              f"{time.perf_counter() - begin:.2f} s]")
    stats = llm.llm_engine.get_stats()
    print(f"\nprefix cache hit rate: {stats.prefix_cache_hit_rate:.0%} "
          f"({stats.prefix_cache_hits}/{stats.prefix_cache_queries} prompt tokens)")


if __name__ == "__main__":
    main()
