"""The benchmark's child processes (a server, the vLLM driver) and how they end.

Each starts in a session of its own, so that everything it starts (vLLM's engine-core
and worker processes) can be ended with it: killing the child alone left vLLM's engine
processes and a server holding its port and 2 GB after the benchmark was interrupted.
"""

from __future__ import annotations

import os
import signal
import subprocess


def stop_group(process: subprocess.Popen[bytes] | subprocess.Popen[str],
               grace_s: float) -> None:
    """SIGTERM to the child (its own shutdown ends what it started), then after
    `grace_s` SIGKILL to its whole process group."""
    try:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
    finally:  # also when a second Ctrl-C cuts the grace period short
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()
