"""What structured output costs: the same batch decoded free and under formats.

A script, not a test: `python benchmarks/bench_structured_output.py [--out FILE.md]`.
N chat prompts (default 32) each generate exactly T tokens (default 64) greedily, once
free and once under each format (a JSON schema, any JSON object, a regex, a choice
list), the runs alternating for R rounds (default 3) in one process so that a noisy
machine disturbs every contender alike. Every run must produce N x T tokens, so the
formats are given `ignore_eos` (past a completed format only EOS is allowed; those
steps still compute a mask). Reported per contender: the median wall time, output
tokens/s, and the ratio to free decoding; and the mean cost of one step's masks (all
rows), timed by replaying the generated tokens through fresh matchers outside the
engine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from pagellm.engine.structured_output import allowed_tokens

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "city": {"type": "string"}, "bio": {"type": "string"}},
    "required": ["name", "age", "city", "bio"],
}
FORMATS: dict[str, StructuredOutputsParams | None] = {
    "free": None,
    "json schema": StructuredOutputsParams(json=SCHEMA),
    "json object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"([A-Z][a-z]+ ){1,60}[a-z]+\."),
    "choice (200)": StructuredOutputsParams(choice=[f"option number {i}" for i in range(200)]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the table here too")
    args = parser.parse_args()

    llm = LLM()
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe person number {i} as JSON, with a long bio."}],
        tokenize=False, add_generation_prompt=True) for i in range(args.num_requests)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    for fmt in FORMATS.values():  # the token table and the compiles, not timed
        llm.llm_engine.prepare_format(SamplingParams(structured_outputs=fmt))
    walls: dict[str, list[float]] = {name: [] for name in FORMATS}
    generated: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, fmt in FORMATS.items():
            params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                                    structured_outputs=fmt)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            walls[name].append(time.perf_counter() - start)
            generated[name] = [list(o.outputs[0].token_ids) for o in outputs]
            assert sum(map(len, generated[name])) == args.num_requests * args.output_len

    engine = llm.llm_engine
    compiler = engine._grammars
    assert compiler is not None
    lines = [f"{args.num_requests} requests x {args.output_len} greedy tokens, default model, "
             f"median of {args.rounds} alternating rounds",
             "",
             "| format | wall s | output tok/s | vs free | masks ms per step (all rows) |",
             "| --- | --- | --- | --- | --- |"]
    free = statistics.median(walls["free"])
    tokens = args.num_requests * args.output_len
    for name, fmt in FORMATS.items():
        wall = statistics.median(walls[name])
        mask_ms = "-"
        if fmt is not None:
            matchers = compiler.matchers(fmt, args.num_requests)
            spent = 0.0
            for step in range(args.output_len):
                start = time.perf_counter()
                allowed_tokens(matchers, compiler.mask_words, engine.model_config.vocab_size)
                spent += time.perf_counter() - start
                for matcher, tokens_of in zip(matchers, generated[name], strict=True):
                    matcher.accept(tokens_of[step])
            mask_ms = f"{spent * 1000 / args.output_len:.2f}"
        lines.append(f"| {name} | {wall:.2f} | {tokens / wall:.1f} | {free / wall:.2f}x | "
                     f"{mask_ms} |")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
