"""Logs each engine step's start and duration in a process that imports it (put this
folder on PYTHONPATH and set STEPLOG=PATH; each process writes PATH.PID at exit)."""

import atexit
import os
import time

if os.environ.get("STEPLOG"):
    from pagellm.engine import llm_engine

    _orig = llm_engine.LLMEngine.step
    _log = []

    def _step(self):
        t = time.perf_counter()
        out = _orig(self)
        _log.append((t, time.perf_counter() - t, len(out)))
        return out

    llm_engine.LLMEngine.step = _step

    def _dump():
        with open(os.environ["STEPLOG"] + f".{os.getpid()}", "w") as f:
            f.write(repr(_log))

    atexit.register(_dump)
