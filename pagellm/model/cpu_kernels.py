"""C++ kernels for the CPU (csrc/): quantized matmuls, paged attention, fused small ops.

They are compiled on first use with the machine's g++ for its own CPU (`-march=native`)
into `<cache_dir>/kernels/`, keyed by the sources, torch, the compiler and the CPU's
flags, and loaded into torch as `torch.ops.pagellm.*` (they run on torch's own thread
pool). Building takes about 10 s, once per machine. They are written once in 16-lane
vectors (csrc/simd.h) and built for AVX-512 or, where the CPU has none, AVX2 with FMA
(and F16C, for the weights' float16 scales);
where it also has AMX's bfloat16 tiles, matmuls of many rows run on them (exactly:
csrc/amx_matmul.h says how).
Where they cannot be built (no compiler, neither instruction set, not Linux on x86-64),
`load` says why once in the log and returns False: the model then runs on torch ops
alone, with the same results to float32 rounding.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import threading
import uuid
from pathlib import Path

import torch

from pagellm.model import file_lock

logger = logging.getLogger(__name__)
# The one-time build's own line, which the commands that log only warnings still show.
build_logger = logging.getLogger(f"{__name__}.build")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = tuple(_CSRC / name
                 for name in ("quant_linear.cpp", "int8_linear.cpp", "paged_attention.cpp",
                              "fused_ops.cpp", "decoder_layer.cpp"))
_HEADERS = (_CSRC / "amx_matmul.h", _CSRC / "kv_element.h", _CSRC / "linear_args.h",
            _CSRC / "parallel.h", _CSRC / "simd.h", _CSRC / "vec_math.h",
            _CSRC / "weight_prefetch.h")
_LIBRARY_NAME = "libpagellm_cpu_kernels.so"
# What the AMX matmul (csrc/amx_matmul.h) needs, as /proc/cpuinfo names it.
_AMX_FLAGS = frozenset({"amx_tile", "amx_bf16", "avx512_bf16"})
_NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]

_BUILD_TIMEOUT_S = 600
# The compilers running now (see _run_compiler).
_builds: set[subprocess.Popen[str]] = set()
_builds_lock = threading.Lock()
_stopped = threading.Event()  # set by stop_builds: no compiler runs after it
_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet in this process


def load(build_root: Path) -> bool:
    """Build (once per machine) and load the kernels; False, logged once, where they
    cannot run here. Safe to call from several threads and many times."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build_and_load(build_root)
        return _loaded


def loaded() -> bool:
    """Whether `load` has succeeded in this process (the `torch.ops.pagellm` ops exist)."""
    return _loaded is True


def _build_and_load(build_root: Path) -> bool:
    isa, reason = _instruction_set()
    if reason is not None:
        logger.info("CPU kernels off: %s", reason)
        return False
    missing = [str(source) for source in (*_SOURCES, *_HEADERS) if not source.is_file()]
    if missing:
        logger.info("CPU kernels off: sources not installed: %s", ", ".join(missing))
        return False
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.warning("CPU kernels off: no C++ compiler found (install g++ for the faster "
                       "kernels)")
        return False
    command = _compile_command(compiler, isa)
    directory = build_root / f"cpu-{_build_key(command, compiler)}"
    library = directory / _LIBRARY_NAME
    failed = directory / "unsupported.txt"
    if failed.is_file():
        logger.warning("CPU kernels off: an earlier build failed (see %s; delete it to try "
                       "again)", failed)
        return False
    try:
        if _intact(library, quiet=True):  # built: a read-only cache needs no lock to load it
            return _load(library)
        with file_lock.exclusive(build_root / "locks" / f"{directory.name}.lock",
                                 "building the CPU kernels") as locked:
            if failed.is_file() or (not _intact(library) and not _compile(
                    command, directory, library, failed, locked)):
                return False  # (a build that failed while this one waited said why)
    except OSError as exc:  # a read-only or full cache directory
        logger.warning("CPU kernels off: cannot build them into %s: %s (a writable cache "
                       "directory: PAGELLM_CACHE_DIR or --cache-dir)", directory, exc)
        return False
    return _load(library)


def _instruction_set() -> tuple[str, str | None]:
    """(the vector instructions the kernels will be built for, why they cannot be): the
    widest the CPU has (amx: AVX-512 with AMX's bfloat16 tiles, then avx512, then avx2),
    or `PAGELLM_CPU_ISA` (avx512 or avx2 on a CPU with more tests those builds; avx512 by
    name also leaves AVX-512 BF16 out, see `_without_bf16`).

    The set reaches the build's key through the compile command (a narrower build adds
    `-mno-...` options); the CPU's whole flag list is in the key too (see `_build_key`)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return "", f"needs Linux on x86-64, this is {platform.system()} {platform.machine()}"
    try:
        flags = _cpu_flags()
    except OSError as exc:
        return "", f"cannot read /proc/cpuinfo: {exc}"
    wanted = os.environ.get("PAGELLM_CPU_ISA", "")
    if wanted not in ("", "amx", "avx512", "avx2"):
        return "", f"PAGELLM_CPU_ISA={wanted!r}: expected amx, avx512 or avx2"
    avx512 = {"avx512f", "avx512bw"} <= flags
    if wanted in ("", "amx") and avx512 and _AMX_FLAGS <= flags:
        return "amx", None
    if wanted == "amx":
        return "", "PAGELLM_CPU_ISA=amx, but this CPU has no AMX-BF16 with AVX-512"
    if wanted != "avx2" and avx512:
        return "avx512", None
    if wanted == "avx512":
        return "", "PAGELLM_CPU_ISA=avx512, but this CPU has no AVX-512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2", None
    return "", "this CPU has neither AVX-512 nor AVX2 with FMA and F16C"


def _cpu_flags() -> frozenset[str]:
    """The feature flags of this machine's CPU (the first `flags` line of /proc/cpuinfo)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def _build_key(command: list[str], compiler: str) -> str:
    """Names a build by everything that decides its machine code: the sources, the command,
    torch, the compiler, and the CPU's flags. Why the flags: `-march=native` builds for
    every extension this CPU has (BMI2, VNNI, AVX-512 subsets...), so a cache directory
    shared by two machines (a network home, a container image) must not hand one a library
    with instructions only the other has: that is a crash (SIGILL), not a slowdown.
    Called once `_instruction_set` has read /proc/cpuinfo, so the flags are readable.
    The sources count by their bytes, not where they lie: every checkout or environment
    with the same code shares one build (a fresh clone rebuilt for 30 s)."""
    flags = " ".join(sorted(_cpu_flags()))
    paths = {str(source) for source in _SOURCES}
    return hashlib.sha256(
        b"".join(source.read_bytes() for source in (*_SOURCES, *_HEADERS))
        + " ".join(part for part in command if part not in paths).encode()
        + torch.__version__.encode()
        + _compiler_version(compiler).encode() + flags.encode()
    ).hexdigest()[:16]


def _compile_command(compiler: str, isa: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -march=native turns on every extension the CPU has; a narrower build turns some off
    # (AMX does not depend on AVX-512 in GCC's options, so it is named where the CPU has
    # it: GCC before 11 knows no -mno-amx-* and builds for CPUs without it as before).
    no_amx = _NO_AMX if isa != "amx" and "amx_tile" in _cpu_flags() else []
    no_bf16 = ["-mno-avx512bf16"] if _without_bf16(isa) else []
    narrow = [*(["-mno-avx512f"] if isa == "avx2" else []), *no_amx, *no_bf16]
    return [
        compiler, "-O3", "-march=native", *narrow, "-ffp-contract=off", "-std=c++20", "-shared",
        "-fPIC", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w",
        *[f"-I{path}" for path in include_paths()],
        *[str(source) for source in _SOURCES], f"-L{torch_lib}", "-lc10", "-ltorch_cpu",
    ]


def _without_bf16(isa: str) -> bool:
    """Whether the build for `isa` leaves out this CPU's AVX-512 BF16: PAGELLM_CPU_ISA=avx512
    asks for AVX-512 as CPUs before BF16 have it (Skylake, Ice Lake), so that a CPU with
    BF16 can build and test that case too (attention's bfloat16 products refused, float32
    attention kept); chosen on its own, avx512 keeps BF16."""
    return (isa == "avx512" and os.environ.get("PAGELLM_CPU_ISA") == "avx512"
            and "avx512_bf16" in _cpu_flags())


def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


def _load(library: Path) -> bool:
    try:
        torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
    except (OSError, RuntimeError) as exc:
        logger.warning("CPU kernels off: cannot load %s: %s", library, exc)
        return False
    logger.info("CPU kernels loaded%s", " (matmuls of many rows on AMX tiles)"
                if torch.ops.pagellm.amx_in_use() else "")
    return True


def instruction_set() -> str:
    """The instruction set the kernels are (or would be) built for here, or why none: for
    reports, which would otherwise not say which matmul path their numbers came from."""
    isa, reason = _instruction_set()
    if reason is not None:
        return f"none ({reason})"
    if isa == "amx" and loaded() and not amx_in_use():
        return "amx build, AMX refused by Linux: avx512 panels"
    if _without_bf16(isa):
        return "avx512 without AVX-512 BF16"
    return isa


def bf16_products() -> bool:
    """Whether the loaded kernels take attention's products in bfloat16 where asked
    (built with AVX-512 BF16); False where the kernels are not loaded."""
    return loaded() and bool(torch.ops.pagellm.bf16_products_available())


def amx_in_use() -> bool:
    """Whether the loaded kernels multiply many rows on AMX (built with it, and Linux
    granted this process the tile state); False where the kernels are not loaded."""
    return loaded() and bool(torch.ops.pagellm.amx_in_use())


def _digest_file(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _intact(library: Path, quiet: bool = False) -> bool:
    """Whether the built library is there whole: loading a damaged one (truncated by a
    full disk or a copy) kills the process with SIGBUS, so it is checked against the
    digest written with it, and built again if it does not match (said unless
    `quiet`)."""
    if not library.is_file():
        return False
    try:
        recorded = _digest_file(library).read_text().strip()
    except OSError:
        recorded = ""
    if recorded == hashlib.sha256(library.read_bytes()).hexdigest():
        return True
    if not quiet:
        logger.warning("the CPU kernels in %s do not match their digest (damaged, or "
                       "built by an older PageLLM); building them again", library.parent)
    return False


# A build that failed for these reasons may succeed next time: it is not recorded.
_PASSING_FAILURES = ("No space left on device", "Disk quota exceeded",
                     "Cannot allocate memory", "virtual memory exhausted",
                     "signal terminated program", "terminated with signal")


def _run_compiler(command: list[str]) -> subprocess.CompletedProcess[str]:
    """Runs the compiler in a process group of its own, which goes whole (the driver and
    the cc1plus it starts) when the build is interrupted or times out, or when
    `stop_builds` is called: killing the driver alone left its compiler running for a
    minute after a pod was deleted mid-start."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    with _builds_lock:
        _builds.add(process)
        stopped = _stopped.is_set()
    try:
        if stopped:  # stop_builds ran before this compiler started
            _stop(process)
        stdout, stderr = process.communicate(timeout=_BUILD_TIMEOUT_S)
    except BaseException:
        _stop(process)
        raise
    finally:
        with _builds_lock:
            _builds.discard(process)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _stop(process: subprocess.Popen[str]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    process.wait()


def stop_builds() -> None:
    """Stops every compiler running for this process, and any a build starts after (its
    build thread is left to fail): for a process about to exit at once, whose threads
    will not unwind."""
    with _builds_lock:
        _stopped.set()
        running = list(_builds)
    for process in running:
        _stop(process)


def _compile(command: list[str], directory: Path, library: Path, failed: Path,
             locked: bool = True) -> bool:
    """Compile into a temporary name and rename it into place (after its digest), so
    that interrupted builds never leave a half-written library; called holding the lock,
    so one start builds while the others wait.
    A failing compile is recorded in `failed`, so later starts do not spend the time
    again, unless it failed for want of space or memory, or was killed."""
    directory.mkdir(parents=True, exist_ok=True)
    if locked:  # no other build runs: these were left by one that was killed
        for abandoned in directory.glob(f".{_LIBRARY_NAME}.*"):
            abandoned.unlink(missing_ok=True)
    tmp = directory / f".{_LIBRARY_NAME}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    build_logger.info("building the CPU kernels into %s (once per machine)", directory)
    try:
        done = _run_compiler([*command, "-o", str(tmp)])
    except (OSError, subprocess.SubprocessError) as exc:  # no compiler, or a timeout
        tmp.unlink(missing_ok=True)
        logger.warning("CPU kernels off: the compiler did not run: %s", exc)
        return False
    except BaseException:  # Ctrl-C, SIGTERM: the compiler has been stopped
        tmp.unlink(missing_ok=True)
        raise
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        passing = done.returncode < 0 or any(reason in done.stderr
                                             for reason in _PASSING_FAILURES)
        if passing:
            logger.warning("CPU kernels off for now: the build failed and will be tried "
                           "again at the next start: %s", done.stderr.strip()[-300:])
            return False
        failed.write_text(done.stderr[-4000:])
        logger.warning("CPU kernels off: the build failed (details in %s; delete it to "
                       "try again)", failed)
        return False
    digest = _digest_file(library)
    digest_tmp = tmp.with_name(tmp.name + ".sha256")
    digest_tmp.write_text(hashlib.sha256(tmp.read_bytes()).hexdigest())
    os.replace(digest_tmp, digest)
    os.replace(tmp, library)
    return True
