"""The standard comparison set: every workload offline with every contender, a run that
keeps 64 requests running (the bookkeeping target), and the cache-sensitive workloads
online; one report under benchmarks/results/.

    python benchmarks/run_all.py [--quick] [--vllm-python PATH] [--output-dir DIR]

Full size takes a long time on a small CPU machine: run it alone, once. `--quick` runs
the same set at development size (minutes) and writes to benchmarks/results-quick/ by
default, so it never overwrites the committed full results.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm.bench.cli import check_output_dir, python_path, report_failures  # noqa: E402
from pagellm.bench.compare import (  # noqa: E402
    HF_GENERATE,
    PAGELLM,
    PAGELLM_NOCACHE,
    VLLM,
    VLLM_NOCACHE,
)
from pagellm.bench.report import JSON_NAME, read_report, write_report  # noqa: E402
from pagellm.bench.suite import (  # noqa: E402
    CONTENDERS,
    BenchOptions,
    build_report,
    run_comparison,
)
from pagellm.bench.workloads import build_workload  # noqa: E402
from pagellm.cache_dir import resolve_cache_dir  # noqa: E402
from pagellm.entrypoints.engine_args import whole_number  # noqa: E402
from pagellm.model.loader import load_tokenizer  # noqa: E402
from pagellm.model.resolve import resolve_model_path  # noqa: E402

HERE = Path(__file__).resolve().parent
ONLINE = (PAGELLM, PAGELLM_NOCACHE, VLLM, VLLM_NOCACHE)
# transformers' continuous batching takes about 9 minutes per full-size workload on a 2-core
# CPU, so only the headline workload runs every contender; the others run the rest.
WITHOUT_HF_CB = (PAGELLM, PAGELLM_NOCACHE, HF_GENERATE, VLLM, VLLM_NOCACHE)

# (label, workload, mode, workload parameters, contenders or None for all, online rate)
Spec = tuple[str, str, str, dict[str, Any], tuple[str, ...] | None, float]

FULL: list[Spec] = [
    ("shared-prefix", "shared-prefix", "offline", {}, None, math.inf),
    ("multi-turn", "multi-turn", "offline", {}, WITHOUT_HF_CB, math.inf),
    ("few-shot", "few-shot", "offline", {}, WITHOUT_HF_CB, math.inf),
    ("eviction", "eviction", "offline", {}, WITHOUT_HF_CB, math.inf),
    ("no-sharing", "no-sharing", "offline", {}, WITHOUT_HF_CB, math.inf),
    ("decode-64", "shared-prefix", "offline",
     dict(num_requests=64, prefix_len=128, suffix_len=32, output_len=64),
     (PAGELLM, PAGELLM_NOCACHE), math.inf),
    ("shared-prefix", "shared-prefix", "online", {}, ONLINE, 1.0),
    ("multi-turn", "multi-turn", "online", {}, ONLINE, 0.5),
]

QUICK: list[Spec] = [
    ("shared-prefix", "shared-prefix", "offline",
     dict(num_requests=4, prefix_len=128, suffix_len=16, output_len=4), None, math.inf),
    ("multi-turn", "multi-turn", "offline",
     dict(num_conversations=2, num_turns=2, system_len=64, user_len=16, output_len=4), None,
     math.inf),
    ("few-shot", "few-shot", "offline", dict(num_requests=4, num_examples=3, output_len=4),
     None, math.inf),
    ("eviction", "eviction", "offline",
     # Requests of 212 tokens in an 848-token pool: vLLM's 128-token blocks, one of them
     # its null block, must still hold one request.
     dict(num_requests=8, num_prefixes=6, prefix_len=192, suffix_len=16, output_len=4), None,
     math.inf),
    ("no-sharing", "no-sharing", "offline", dict(num_requests=4, prompt_len=144, output_len=4),
     None, math.inf),
    ("decode-64", "shared-prefix", "offline",
     dict(num_requests=64, prefix_len=32, suffix_len=16, output_len=4),
     (PAGELLM, PAGELLM_NOCACHE), math.inf),
    ("shared-prefix", "shared-prefix", "online",
     dict(num_requests=4, prefix_len=128, suffix_len=16, output_len=4), ONLINE, 4.0),
    ("multi-turn", "multi-turn", "online",
     dict(num_conversations=2, num_turns=2, system_len=64, user_len=16, output_len=4), ONLINE,
     2.0),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="development size (minutes), written to results-quick/")
    parser.add_argument("--vllm-python", type=python_path, default=None,
                        help="python of a venv with vLLM's CPU build (else vLLM is skipped)")
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--only", default=None,
                        help="comma-separated labels to run (default: all)")
    parser.add_argument("--skip-online", action="store_true")
    parser.add_argument("--rerender", action="store_true",
                        help="rewrite the report and plots from the output directory's "
                             "results.json (after a change to the report), running nothing; "
                             "the footnotes are today's: a report measured before 2026-12-07 "
                             "counted the harness in a vLLM or server contender's peak RSS "
                             "and PageLLM's start-up without its warm-up")
    parser.add_argument("--hf-batch-size", type=whole_number(1), default=8)
    parser.add_argument("--num-threads", type=whole_number(1), default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=whole_number(1), default=1,
                        help="runs per contender, median reported (3 on a busy machine)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    out = args.output_dir or HERE / ("results-quick" if args.quick else "results")
    if args.rerender:
        if not (out / JSON_NAME).is_file():
            parser.error(f"--rerender: no {JSON_NAME} in {out} (give its --output-dir)")
        write_report(read_report(out / JSON_NAME), out)
        print(f"rewrote {out}")
        return 0
    specs = QUICK if args.quick else FULL
    if args.only:
        wanted = set(args.only.split(","))
        labels = sorted({s[0] for s in specs})
        if wanted - set(labels):
            parser.error(f"--only: unknown label(s) {', '.join(sorted(wanted - set(labels)))}; "
                         f"the labels are {', '.join(labels)}")
        specs = [s for s in specs if s[0] in wanted]
    if args.skip_online:
        specs = [s for s in specs if s[2] != "online"]
    if args.quick and args.output_dir is None:
        # Development results are never meant to be committed next to the full ones.
        out.mkdir(parents=True, exist_ok=True)
        (out / ".gitignore").write_text("*\n")
    try:
        check_output_dir(out)
    except ValueError as error:
        parser.error(str(error))
    model_dir = resolve_model_path(None, resolve_cache_dir())
    tokenizer = load_tokenizer(model_dir)
    engine_kwargs = {"num_threads": args.num_threads} if args.num_threads else {}
    comparisons = []
    for label, name, mode, params, contenders, rate in specs:
        options = BenchOptions(model_dir=model_dir, contenders=contenders or CONTENDERS,
                               engine_kwargs=dict(engine_kwargs),
                               hf_batch_size=args.hf_batch_size, vllm_python=args.vllm_python,
                               request_rate=rate, seed=args.seed, repeats=args.repeats)
        begin = time.perf_counter()
        workload = build_workload(name, tokenizer, seed=args.seed, **params)
        comparisons.append(run_comparison(workload, mode, options, tokenizer, label))
        logging.info("%s (%s) took %.0f s", label, mode, time.perf_counter() - begin)
        report = build_report(comparisons, options)
        report.meta["scale"] = "quick (development size)" if args.quick else "full (the issue's)"
        write_report(report, out)
    print(f"wrote {out}")
    return report_failures(comparisons)


if __name__ == "__main__":
    raise SystemExit(main())
