"""vLLM's `LLM.beam_search` for bench_beam_search.py, run inside vLLM's own venv.

Started as `<vllm venv>/bin/python vllm_beam_search.py '<json config>'`; it imports only
vLLM and the standard library (PageLLM is not installed there) and prints one JSON line:
the start-up time, each round's wall time (the prefix cache reset before each, as for
PageLLM) and the last round's generated tokens of every beam.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    config = json.loads(sys.argv[1])
    begin = time.perf_counter()
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    llm = LLM(model=config["model"], dtype="float32", seed=0, enable_prefix_caching=True,
              kv_cache_memory_bytes=config["kv_cache_memory_bytes"],
              max_model_len=config["max_model_len"])
    startup = time.perf_counter() - begin
    prompts = [TokensPrompt(prompt_token_ids=p) for p in config["prompts"]]
    params = BeamSearchParams(beam_width=config["beam_width"],
                              max_tokens=config["max_tokens"])
    times = []
    beams = []
    for _ in range(config["repeats"]):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.beam_search(prompts, params)
        times.append(time.perf_counter() - start)
        beams = [[list(s.tokens[len(p):]) for s in o.sequences]
                 for p, o in zip(config["prompts"], outputs, strict=True)]
    print("@@beam@@ " + json.dumps({"startup_s": startup, "times": times, "beams": beams,
                                    "version": getattr(sys.modules["vllm"], "__version__",
                                                       "?")}))


if __name__ == "__main__":
    main()
