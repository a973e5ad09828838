"""Process-wide settings that make torch's CPU kernels fast here, applied on import of
`pagellm`, before torch loads: some are read only once, when their library starts.

A value the user has set (an environment variable) is always kept.
"""

from __future__ import annotations

import ctypes
import os
import platform

from pagellm import cgroup_limits

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Buffers up to this size come from the heap instead of a fresh mmap each time.
MMAP_THRESHOLD_BYTES = 32 << 20
# Free heap memory kept by the process rather than returned to the system.
TRIM_THRESHOLD_BYTES = 1 << 30


def tune_process() -> None:
    """Apply every setting below; each is a no-op where it does not apply."""
    _short_openmp_spin()
    _threads_within_cpu_quota()
    _keep_freed_buffers()


def _threads_within_cpu_quota() -> None:
    """torch starts a thread per CPU the process may run on, blind to a container's CPU
    quota (Kubernetes' limits.cpu): with a quota of one CPU on a bigger node, its threads
    are throttled in turn while every parallel region waits for the last of them. The
    thread count is capped at the quota's whole CPUs, as vLLM caps its own. OpenMP reads
    it when torch loads."""
    if "OMP_NUM_THREADS" in os.environ or not hasattr(os, "sched_getaffinity"):
        return
    quota = cgroup_limits.cpu_limit()
    if quota is not None and quota < len(os.sched_getaffinity(0)):
        os.environ["OMP_NUM_THREADS"] = str(quota)


def _short_openmp_spin() -> None:
    """torch's OpenMP threads spin for a long time (GNU OpenMP: 300,000 iterations) waiting
    for the next parallel region. As soon as another process wants a core (a benchmark
    client, a test runner, a second server) that spinning made a step 5-10x slower here.
    A short spin keeps most of the quiet-machine speed (passive waiting was 25% slower per
    decode step) and none of the collapse. OpenMP reads it when torch loads."""
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def _keep_freed_buffers() -> None:
    """Stop glibc from handing every large activation buffer back to the system.

    A forward pass allocates and frees buffers of several MB per layer (13 MB for a
    1,056-token MLP activation). glibc serves those with a fresh mmap and unmaps them on
    free, so every step page-faults its activations in again: measured on a 1,056-token
    prefill of the default model, elementwise ops took 3-4x longer than their memory
    traffic and the whole step 20% longer (1.12 -> 0.89 s of CPU). Raising the mmap and
    trim thresholds keeps freed buffers in the heap for the next step. The cost is that
    the process keeps up to TRIM_THRESHOLD_BYTES of freed memory instead of returning it.
    """
    if platform.libc_ver()[0] != "glibc":
        return
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return
    libc = ctypes.CDLL(None)
    libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
