"""What the process's control groups allow it: a container's memory limit and CPU quota.

psutil's available memory and the CPU affinity mask describe the machine, while
Kubernetes' `limits.memory` and `limits.cpu` (and docker's `--memory`, `--cpus`,
systemd's `MemoryMax=`) are cgroup settings: a KV pool sized from the node's free memory
is OOM-killed without a message, and a thread per node CPU is throttled by the quota.
Both cgroup versions are read, for the process's own group and every ancestor that is
visible (a limit may sit on any of them). Pure standard library: read before torch loads.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

PROC_CGROUP = Path("/proc/self/cgroup")
MOUNTINFO = Path("/proc/self/mountinfo")
# cgroup v1 writes "no limit" as a number near 2**63.
_V1_UNLIMITED = 1 << 62


def _mounts(mountinfo: Path) -> list[tuple[str, str, set[str]]]:
    """(mount point, root within the hierarchy, controllers; none for v2) of each cgroup
    mount: v2 is not always at /sys/fs/cgroup (a hybrid host mounts it at .../unified)."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return []
    mounts = []
    for line in lines:
        fields, _, tail = line.partition(" - ")
        parts, described = fields.split(), tail.split()
        if len(parts) < 5 or len(described) < 3 or described[0] not in ("cgroup", "cgroup2"):
            continue
        controllers = set() if described[0] == "cgroup2" else set(described[2].split(","))
        mounts.append((parts[4], parts[3], controllers))
    return mounts


def _groups(controller: str, proc: Path, mountinfo: Path) -> list[tuple[Path, bool]]:
    """(directory, is v2) of the process's group for `controller` and its ancestors that
    are visible, in every hierarchy that has the controller."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return []
    mounts = _mounts(mountinfo)
    groups = []
    for line in lines:
        _, names, path = line.split(":", 2)
        v2 = not names
        if not v2 and controller not in names.split(","):
            continue
        for point, root, controllers in mounts:
            if v2 != (not controllers) or (not v2 and controller not in controllers):
                continue
            # A container's mount may start at its own group: the path is below its root.
            inside = PurePosixPath(path)
            if root != "/" and inside.is_relative_to(root):
                inside = PurePosixPath("/") / inside.relative_to(root)
            parts = inside.parts[1:]
            for depth in range(len(parts), -1, -1):
                directory = Path(point).joinpath(*parts[:depth])
                if directory.is_dir():
                    groups.append((directory, v2))
    return groups


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _memory_limits(proc: Path, mountinfo: Path) -> list[tuple[int, int]]:
    """(limit, usage) of each memory group above this process that has a limit. Usage
    leaves out the page cache it may reclaim (inactive files, as `docker stats` and the
    kubelet leave them out), so reading the model's files does not count against it."""
    limits = []
    for directory, v2 in _groups("memory", proc, mountinfo):
        if v2:
            limit = _read_int(directory / "memory.max")  # "max": None
            usage = _read_int(directory / "memory.current")
            inactive = _stat(directory / "memory.stat", "inactive_file")
        else:
            limit = _read_int(directory / "memory.limit_in_bytes")
            limit = None if limit is None or limit >= _V1_UNLIMITED else limit
            usage = _read_int(directory / "memory.usage_in_bytes")
            inactive = _stat(directory / "memory.stat", "total_inactive_file")
        if limit is not None and usage is not None:
            limits.append((limit, max(0, usage - inactive)))
    return limits


def memory_available(proc: Path = PROC_CGROUP, mountinfo: Path = MOUNTINFO) -> int | None:
    """Bytes the tightest memory limit still allows, or None without a limit."""
    left = [max(0, limit - usage) for limit, usage in _memory_limits(proc, mountinfo)]
    return min(left) if left else None


def memory_limit(proc: Path = PROC_CGROUP, mountinfo: Path = MOUNTINFO) -> int | None:
    """The tightest memory limit in bytes (a container's whole memory), or None."""
    limits = [limit for limit, _usage in _memory_limits(proc, mountinfo)]
    return min(limits) if limits else None


def cpu_limit(proc: Path = PROC_CGROUP, mountinfo: Path = MOUNTINFO) -> int | None:
    """Whole CPUs the tightest CPU quota allows (at least 1; 1.5 CPUs is 1, as vLLM
    rounds it: a thread more than the quota is throttled), or None without a quota."""
    cpus: int | None = None
    for directory, v2 in _groups("cpu", proc, mountinfo):
        if v2:
            try:
                quota_text, period_text = (directory / "cpu.max").read_text().split()
                quota, period = int(quota_text), int(period_text)  # "max": no quota
            except (OSError, ValueError):
                continue
        else:
            quota = _read_int(directory / "cpu.cfs_quota_us") or -1
            period = _read_int(directory / "cpu.cfs_period_us") or 0
            if quota <= 0 or period <= 0:
                continue
        allowed = max(1, quota // period)
        cpus = allowed if cpus is None else min(cpus, allowed)
    return cpus

