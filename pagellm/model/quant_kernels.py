"""Matrix multiplies that read a GGUF checkpoint's 4-bit weight blocks directly (CPU).

Why: a decode step multiplies a few rows by every weight of the model, so its speed is
set by how many weight bytes stream from memory. SmolLM2-135M's linear layers are 425 MB
as float32 but 66 MB as Q4_1 blocks (5 bits per weight as packed here). Measured on this
project's 2-core AVX-512 machine, 30 layers' worth of matmuls: 1 row 11.7 -> 2.8 ms,
8 rows 13.2 -> 6.1 ms, 32 rows 22.6 -> 19.5 ms; from 64 rows on oneDNN's float32 GEMM is as
fast or faster, so prefill keeps it (`MAX_ROWS`).

Exactness: the kernel rebuilds each weight as `(scale * code) + min` with the same two
float32 roundings as the GGUF reader's dequantisation (the loader checks this on sampled
rows), so it multiplies by exactly the float32 weights the model was loaded with; only the
summation order differs from another GEMM's, as between any two GEMM libraries.

The C++ kernel (csrc/q4_1_linear.cpp) is compiled on first use with the machine's g++ for
its own CPU (`-march=native`) into `<cache_dir>/kernels/`, keyed by the source, torch and
compiler, and loaded as `torch.ops.pagellm.q4_1_linear`. Where that cannot happen (no
compiler, no AVX-512, another device or dtype), `load_kernels` says so once in the log and
everything stays on the float32 path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Rows below which a matmul takes the 4-bit kernel (at 64 rows oneDNN catches up).
MAX_ROWS = 64

# GGUF's Q4_1 block: float16 scale, float16 min, 16 bytes of 4-bit codes for 32 weights.
Q4_1_BLOCK = 32
Q4_1_BLOCK_BYTES = 20
_LANES = 16  # output rows per kernel tile (one AVX-512 register of float32)

_SOURCE = Path(__file__).parent / "csrc" / "q4_1_linear.cpp"
_LIBRARY_NAME = "libpagellm_q4_1.so"

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet in this process


@dataclass(frozen=True)
class Q4_1Weight:
    """A [out, in] weight in the kernel's tiled layout (see csrc/q4_1_linear.cpp)."""

    scales: torch.Tensor  # float32 [out / 16, in / 32, 16]
    mins: torch.Tensor  # float32 [out / 16, in / 32, 16]
    codes: torch.Tensor  # uint8 [out / 16, in / 32, 16, 16]

    @property
    def out_features(self) -> int:
        return int(self.scales.shape[0]) * _LANES

    @property
    def in_features(self) -> int:
        return int(self.scales.shape[1]) * Q4_1_BLOCK


def q4_1_packable(out_features: int, in_features: int) -> bool:
    """Whether a weight of this shape fits the kernel's tiles."""
    return out_features % _LANES == 0 and in_features % Q4_1_BLOCK == 0


def dequantize_q4_1(blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """Float32 weights [rows, in] of raw Q4_1 blocks [rows, in / 32 * 20], rounded as the
    GGUF reader rounds them: (scale * code) + min."""
    raw = blocks.reshape(blocks.shape[0], in_features // Q4_1_BLOCK, Q4_1_BLOCK_BYTES)
    scale = raw[..., 0:2].contiguous().view(torch.float16).float()
    minimum = raw[..., 2:4].contiguous().view(torch.float16).float()
    packed = raw[..., 4:].long()
    codes = torch.cat([packed & 0xF, packed >> 4], dim=-1).float()
    return (scale * codes + minimum).reshape(blocks.shape[0], in_features)


def pack_q4_1(blocks: torch.Tensor, in_features: int) -> Q4_1Weight:
    """The kernel's layout for raw Q4_1 blocks [out, in / 32 * 20] (GGUF's byte order)."""
    out_features = blocks.shape[0]
    if not q4_1_packable(out_features, in_features):
        raise ValueError(f"a [{out_features}, {in_features}] weight does not fit Q4_1 tiles")
    n_blocks = in_features // Q4_1_BLOCK
    expected = (out_features, n_blocks * Q4_1_BLOCK_BYTES)
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != expected:
        raise ValueError(f"Q4_1 blocks must be uint8 {expected}, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    raw = blocks.reshape(out_features // _LANES, _LANES, n_blocks, Q4_1_BLOCK_BYTES)

    def per_lane(field: torch.Tensor) -> torch.Tensor:  # [tiles, lanes, blocks] -> [t, b, l]
        return field.contiguous().view(torch.float16).float().squeeze(-1).transpose(1, 2)

    return Q4_1Weight(
        scales=per_lane(raw[..., 0:2]).contiguous(),
        mins=per_lane(raw[..., 2:4]).contiguous(),
        codes=raw[..., 4:].permute(0, 2, 3, 1).contiguous(),
    )


def q4_1_linear(x: torch.Tensor, weight: Q4_1Weight) -> torch.Tensor:
    """x [rows, in] @ weight.T through the kernel (call `load_kernels` first)."""
    out: torch.Tensor = torch.ops.pagellm.q4_1_linear(
        x.contiguous(), weight.scales, weight.mins, weight.codes
    )
    return out


def load_kernels(build_root: Path) -> bool:
    """Build (once per machine) and load the kernel; False, logged once, where it cannot
    run here. Safe to call from several threads and many times."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build_and_load(build_root)
        return _loaded


def _build_and_load(build_root: Path) -> bool:
    reason = _unsupported_reason()
    if reason is not None:
        logger.info("4-bit matmul kernel off: %s", reason)
        return False
    if not _SOURCE.is_file():
        logger.info("4-bit matmul kernel off: its source %s is not installed", _SOURCE)
        return False
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.info("4-bit matmul kernel off: no C++ compiler found")
        return False
    command = _compile_command(compiler)
    key = hashlib.sha256(
        _SOURCE.read_bytes() + " ".join(command).encode() + torch.__version__.encode()
        + _compiler_version(compiler).encode()
    ).hexdigest()[:16]
    directory = build_root / f"q4_1-{key}"
    library = directory / _LIBRARY_NAME
    failed = directory / "unsupported.txt"
    if failed.is_file():
        logger.info("4-bit matmul kernel off: an earlier build failed (%s)", failed)
        return False
    if not library.is_file() and not _compile(command, directory, library, failed):
        return False
    try:
        torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
    except (OSError, RuntimeError) as exc:
        logger.warning("4-bit matmul kernel off: cannot load %s: %s", library, exc)
        return False
    return True


def _unsupported_reason() -> str | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs Linux on x86-64, this is {platform.system()} {platform.machine()}"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError as exc:
        return f"cannot read /proc/cpuinfo: {exc}"
    if " avx512f" not in flags or " avx512bw" not in flags:
        return "this CPU has no AVX-512"
    return None


def _compile_command(compiler: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler, "-O3", "-march=native", "-ffp-contract=off", "-std=c++20", "-shared",
        "-fPIC", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w",
        *[f"-I{path}" for path in include_paths()],
        str(_SOURCE), f"-L{torch_lib}", "-lc10", "-ltorch_cpu",
    ]


def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


def _compile(command: list[str], directory: Path, library: Path, failed: Path) -> bool:
    """Compile into a temporary name and rename it into place, so that concurrent
    starts and interrupted builds never load a half-written library."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{_LIBRARY_NAME}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    logger.info("building the 4-bit matmul kernel into %s (once per machine)", directory)
    try:
        done = subprocess.run([*command, "-o", str(tmp)], capture_output=True, text=True,
                              timeout=600, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("4-bit matmul kernel off: the compiler did not run: %s", exc)
        return False
    if done.returncode != 0:
        failed.write_text(done.stderr[-4000:])
        logger.warning("4-bit matmul kernel off: the build failed (details in %s)", failed)
        tmp.unlink(missing_ok=True)
        return False
    os.replace(tmp, library)
    return True
