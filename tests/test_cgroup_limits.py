"""A container's memory limit and CPU quota, read from fake cgroup trees (v1 and v2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pagellm import cgroup_limits


def _files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _mountinfo(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "mountinfo"
    path.write_text("22 27 0:21 / /proc rw,relatime - proc proc rw\n"
                    + "".join(line + "\n" for line in lines))
    return path


def test_v2_takes_the_tightest_limit_of_the_group_and_its_ancestors(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1/box\n")
    root = tmp_path / "fs"
    mountinfo = _mountinfo(tmp_path, f"35 31 0:31 / {root} rw - cgroup2 cgroup2 rw")
    _files(root, {
        "kubepods/pod1/box/memory.max": "max\n",
        "kubepods/pod1/box/memory.current": "100\n",
        "kubepods/pod1/memory.max": str(4 << 30) + "\n",
        "kubepods/pod1/memory.current": str(3 << 30) + "\n",
        # Page cache the kernel may reclaim does not count as used.
        "kubepods/pod1/memory.stat": f"anon 5\ninactive_file {1 << 30}\n",
        "kubepods/pod1/box/cpu.max": "150000 100000\n",
        "kubepods/cpu.max": "max 100000\n",
        "memory.max": str(64 << 30) + "\n",
        "memory.current": str(1 << 30) + "\n",
    })
    assert cgroup_limits.memory_available(proc, mountinfo) == (4 << 30) - (2 << 30)
    assert cgroup_limits.memory_limit(proc, mountinfo) == 4 << 30
    assert cgroup_limits.cpu_limit(proc, mountinfo) == 1


def test_v1_reads_the_controllers_own_hierarchies(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu,cpuacct:/docker/c1\n4:memory:/docker/c1\n0::/\n")
    root = tmp_path / "fs"
    # A hybrid host: v1 controllers, and v2 (no controllers) at .../unified.
    mountinfo = _mountinfo(
        tmp_path, f"32 31 0:29 / {root}/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct",
        f"33 31 0:30 / {root}/memory rw - cgroup cgroup rw,memory",
        f"34 31 0:31 / {root}/unified rw - cgroup2 cgroup2 rw")
    _files(root, {
        "memory/docker/c1/memory.limit_in_bytes": str(2 << 30),
        "memory/docker/c1/memory.usage_in_bytes": str(1 << 30),
        "memory/docker/c1/memory.stat": "cache 9\ntotal_inactive_file 0\n",
        "memory/memory.limit_in_bytes": "9223372036854771712",  # no limit
        "memory/memory.usage_in_bytes": "1",
        "cpu,cpuacct/docker/c1/cpu.cfs_quota_us": "200000",
        "cpu,cpuacct/docker/c1/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1",
        "cpu,cpuacct/cpu.cfs_period_us": "100000",
    })
    assert cgroup_limits.memory_available(proc, mountinfo) == 1 << 30
    assert cgroup_limits.memory_limit(proc, mountinfo) == 2 << 30
    assert cgroup_limits.cpu_limit(proc, mountinfo) == 2


def test_no_limits_or_no_cgroups_is_none(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    (tmp_path / "fs").mkdir()
    mountinfo = _mountinfo(tmp_path, f"35 31 0:31 / {tmp_path / 'fs'} rw - cgroup2 cgroup2 rw")
    assert cgroup_limits.memory_available(proc, mountinfo) is None
    assert cgroup_limits.memory_limit(proc, mountinfo) is None
    assert cgroup_limits.cpu_limit(proc, mountinfo) is None
    assert cgroup_limits.cpu_limit(tmp_path / "missing", mountinfo) is None
    assert cgroup_limits.cpu_limit(proc, tmp_path / "missing") is None


def test_a_containers_mount_starts_at_its_own_group(tmp_path: Path) -> None:
    """Without a cgroup namespace the path names the host's group, and the container's
    mount shows that group as its root."""
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/box.scope\n")
    root = tmp_path / "fs"
    _files(root, {"memory.max": str(1 << 30), "memory.current": str(1 << 29)})
    mountinfo = _mountinfo(
        tmp_path, f"35 31 0:31 /system.slice/box.scope {root} rw - cgroup2 cgroup2 rw")
    assert cgroup_limits.memory_available(proc, mountinfo) == 1 << 29


def test_a_cpu_quota_caps_torchs_threads(tmp_path: Path) -> None:
    """A quota of one CPU on a bigger node: torch started a thread per node CPU."""
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        return
    script = ("from pagellm import cgroup_limits\n"
              "cgroup_limits.cpu_limit = lambda *a: 1\n"
              "from pagellm.process_tuning import tune_process\n"
              "import os; os.environ.pop('OMP_NUM_THREADS', None)\n"
              "tune_process()\n"
              "import torch; print(os.environ['OMP_NUM_THREADS'], torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120, check=True)
    assert done.stdout.split() == ["1", "1"]
