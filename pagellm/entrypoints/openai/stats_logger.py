"""One log line every few seconds while the server is busy.

An operator watching the log should see at a glance whether the server keeps up (token
throughput, queue lengths), how full the KV pool is, and whether prefix caching pays
off; an idle server stays quiet.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.llm_engine import EngineStats

logger = logging.getLogger("pagellm.server")


def _rate(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else 0.0


def describe(previous: EngineStats, current: EngineStats, seconds: float) -> str | None:
    """The log line for one interval, or None if nothing happened in it. Its prompt
    throughput is prompt tokens computed, cached ones left out as vLLM's line leaves them
    (they cost no work, so counting them would hide how busy prefill is), and prompts
    computed again after a preemption counted (they are work; vLLM's leaves them out).
    Preemptions are the interval's, shown only where there were any (as in vLLM)."""
    prompt = current.prompt_tokens_computed - previous.prompt_tokens_computed
    generated = current.generation_tokens - previous.generation_tokens
    if not (prompt or generated or current.num_running or current.num_waiting):
        return None
    queries = current.prefix_cache_queries - previous.prefix_cache_queries
    hits = current.prefix_cache_hits - previous.prefix_cache_hits
    preempted = current.num_preemptions - previous.num_preemptions
    return (
        f"prompt throughput {prompt / seconds:.1f} tok/s, "
        f"generation throughput {generated / seconds:.1f} tok/s | "
        f"running {current.num_running}, waiting {current.num_waiting}"
        + (f", preempted {preempted}" if preempted else "") + " | "
        f"KV cache usage {100.0 * current.kv_cache_usage:.1f}% | "
        f"prefix cache hit rate {_rate(hits, queries):.1f}% "
        f"(since start {100.0 * current.prefix_cache_hit_rate:.1f}%)"
    )


async def log_stats_forever(engine: AsyncLLMEngine, interval: float) -> None:
    """Logs `describe` every `interval` seconds; cancel the task to stop it."""
    previous = engine.stats()
    then = time.monotonic()
    while True:
        await asyncio.sleep(interval)
        current, now = engine.stats(), time.monotonic()
        line = describe(previous, current, now - then)
        if line is not None:
            logger.info(line)
        previous, then = current, now
