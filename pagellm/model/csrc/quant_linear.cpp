// y = x @ W.T for a weight kept in a GGUF block format, dequantised in registers: a
// decode step streams 5 (Q4_1) or 8.5 (Q8_0) bits per weight from memory instead of 32.
//
// Exactness: where weights are rebuilt (the panels of many rows), it is with the same
// float32 roundings as the GGUF reader's dequantisation: Q4_1 (scale * code) + min as a
// separate multiply and add (this file is compiled with -ffp-contract=off), Q8_0 scale *
// code (exact). So the panels multiply by the float32 weights bit for bit; only the order
// of the dot product's additions differs from another GEMM's. The register tiles of a few
// rows factor Q4_1's scale and min out of each block (see Q4_1::block): equal in exact
// arithmetic, rounded differently.
//
// Packed layouts (built by quant_kernels.py): output rows in tiles of 16 lanes, then per
// (tile, block of 32 inputs):
//   Q4_1: scales[16], mins[16] float16; codes[16][16] bytes, byte j of lane n holding
//         input j in its low nibble and input j + 16 in its high one;
//   Q8_0: scales[16] float16; codes[32][16] int8, input j of lane n.
// The scales and mins are the GGUF's own float16, widened exactly as they are loaded
// (load_halves). Why not widened once at load: a one-row matmul streams its weight from
// memory, and float32 scales and mins made a Q4_1 weight 6 bits a weight, not 5.
//
// Gated (a gated MLP's fused gate and up weight): tiles come in pairs, the gate's 16 rows
// then the up's same 16 rows, and the result is silu(gate) * up [rows, out / 2], taken
// from the accumulators as they are stored. The [rows, out] product is never written out
// and read back by a separate op: for a 512-token step that is 6 MB each way per layer.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "amx_matmul.h"
#include "linear_args.h"
#include "parallel.h"
#include "vec_math.h"
#include "weight_prefetch.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <new>
#include <utility>

namespace {

using namespace pagellm_kernels::simd;
using pagellm_kernels::check_linear_args;
using pagellm_kernels::check_mins;
using pagellm_kernels::halves;
using pagellm_kernels::for_each_task;
using pagellm_kernels::Prefetch;
using pagellm_kernels::silu_mul16;
#ifdef PAGELLM_AMX
namespace amx = pagellm_kernels::amx;
#endif

constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 32;
struct Q4_1 {
  static constexpr int64_t kCodeBytes = kLanes * kLanes;
  // Rows per pass of the register tiles, and the most rows that go to them rather than
  // to panels: a row's per-block sums stay in registers. With AVX2 6 rows, 12 registers
  // of sums; it was 4 before the tiles were factored, when both accumulators of every row
  // had to stay.
  static constexpr int64_t kMaxRows = kWideRegisters ? 8 : 6;

  // The 16 lanes' weights of inputs j (low nibbles) and j + 16 (high nibbles).
  static void weights(vf d, vf m, const uint8_t* q, int j, vf& lo, vf& hi) {
    vf low_codes, high_codes;
    from_nibbles(q + j * kLanes, low_codes, high_codes);
    lo = add(mul(d, low_codes), m);
    hi = add(mul(d, high_codes), m);
  }

  // A few rows (the register tiles) against a block, factored: each row's sum of x *
  // code over the block, times the scale, plus the min times the row's sum of x over the
  // block (`sums`, one per row; `xb`, the rows' inputs of the block one after the other:
  // see pack_rows). The weights are never rebuilt: the multiply and
  // add per weight were a third of a few-row step's arithmetic, which the rows' FMAs do
  // not amortise. In exact arithmetic the result is the rebuilt weights' product; in
  // float32 it is rounded differently (bounded by the float64 test), and a lone 1 in x
  // still reads back each weight bit for bit. Up to 2 rows a pass with AVX2 (4 with
  // AVX-512), inputs j and j + 16 go to separate sums: twice the independent FMA chains,
  // which one row alone needs (it would otherwise wait on each FMA's latency); more rows
  // have chains enough, and registers for one sum each. So a row's bits depend on how
  // many rows share its pass, as they already did on tiles against panels: the engine
  // relies on row independence only for panels (prompt chunks, tested).
  template <int R>
  static void block(const float* xb, const uint16_t* scales, const uint16_t* mins,
                    const uint8_t* q, const float* sums, vf* acc_a, vf* acc_b) {
    constexpr bool split = R * (kWideRegisters ? 1 : 2) <= 4;
    vf pa[R], pb[R];
    PAGELLM_UNROLL
    for (int r = 0; r < R; ++r) pa[r] = pb[r] = zero();
    PAGELLM_UNROLL
    for (int j = 0; j < 16; ++j) {
      vf lo, hi;
      from_nibbles(q + j * kLanes, lo, hi);
      PAGELLM_UNROLL
      for (int r = 0; r < R; ++r) {
        pa[r] = fmadd(set1(xb[r * kBlock + j]), lo, pa[r]);
        if constexpr (split) {
          pb[r] = fmadd(set1(xb[r * kBlock + j + 16]), hi, pb[r]);
        } else {
          pa[r] = fmadd(set1(xb[r * kBlock + j + 16]), hi, pa[r]);
        }
      }
    }
    const vf d = load_halves(scales);
    const vf m = load_halves(mins);
    PAGELLM_UNROLL
    for (int r = 0; r < R; ++r) {
      acc_a[r] = fmadd(d, pa[r], acc_a[r]);
      if constexpr (split) acc_b[r] = fmadd(d, pb[r], acc_b[r]);
      acc_b[r] = fmadd(m, set1(sums[r]), acc_b[r]);
    }
  }

#ifdef PAGELLM_AMX
  static constexpr bool kHasMins = true;
  // The block's B tile (amx_matmul.h). Byte rows 2i and 2i + 1 interleaved hold pair
  // rows i (their low nibbles: inputs 2i, 2i + 1) and i + 8 (high: 2i + 16, 2i + 17).
  static void b_tile(const uint8_t* q, uint16_t* tile) {
    const __m512i table = amx::small_ints_bf16();
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < 8; ++i) {
      const __m256i bytes = amx::interleave_rows(q + 2 * i * kLanes, q + (2 * i + 1) * kLanes);
      const __m512i low = _mm512_cvtepu8_epi16(_mm256_and_si256(bytes, nibble));
      const __m512i high =
          _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble));
      _mm512_store_si512(tile + i * 32, _mm512_permutexvar_epi16(low, table));
      _mm512_store_si512(tile + (i + 8) * 32, _mm512_permutexvar_epi16(high, table));
    }
  }
#endif

  // The block's 32 x 16 weights as float32, input-major with row stride `ld`.
  static void unpack(const uint16_t* scales, const uint16_t* mins, const uint8_t* q, float* w,
                     int64_t ld) {
    const vf d = load_halves(scales);
    const vf m = load_halves(mins);
    PAGELLM_UNROLL
    for (int j = 0; j < 16; ++j) {
      vf lo, hi;
      weights(d, m, q, j, lo, hi);
      store(w + j * ld, lo);
      store(w + (j + 16) * ld, hi);
    }
  }
};

struct Q8_0 {
  static constexpr int64_t kCodeBytes = kBlock * kLanes;
  // Both accumulators of every row stay in registers: 4 rows with AVX2.
  static constexpr int64_t kMaxRows = kWideRegisters ? 8 : 4;

  // The 16 lanes' weights of input j.
  static vf weight(vf d, const uint8_t* q, int j) {
    return mul(d, from_i8(reinterpret_cast<const int8_t*>(q + j * kLanes)));
  }

  // Even and odd inputs go to separate accumulators (see Q4_1). A scale alone needs no
  // sums of x.
  template <int R>
  static void block(const float* xb, const uint16_t* scales, const uint16_t*, const uint8_t* q,
                    const float*, vf* acc_a, vf* acc_b) {
    const vf d = load_halves(scales);
    PAGELLM_UNROLL
    for (int j = 0; j < 32; j += 2) {
      const vf w0 = weight(d, q, j);
      const vf w1 = weight(d, q, j + 1);
      PAGELLM_UNROLL
      for (int r = 0; r < R; ++r) {
        acc_a[r] = fmadd(set1(xb[r * kBlock + j]), w0, acc_a[r]);
        acc_b[r] = fmadd(set1(xb[r * kBlock + j + 1]), w1, acc_b[r]);
      }
    }
  }

  static void unpack(const uint16_t* scales, const uint16_t*, const uint8_t* q, float* w,
                     int64_t ld) {
    const vf d = load_halves(scales);
    PAGELLM_UNROLL
    for (int j = 0; j < 32; ++j) store(w + j * ld, weight(d, q, j));
  }

#ifdef PAGELLM_AMX
  static constexpr bool kHasMins = false;
  // The block's B tile (amx_matmul.h): pair row i from byte rows 2i and 2i + 1, each
  // code exact as a bfloat16.
  static void b_tile(const uint8_t* q, uint16_t* tile) {
    for (int i = 0; i < 16; ++i) {
      const __m256i bytes = amx::interleave_rows(q + 2 * i * kLanes, q + (2 * i + 1) * kLanes);
      const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
      const __m512 second =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
      _mm512_store_si512(tile + i * 32, (__m512i)_mm512_cvtne2ps_pbh(second, first));
    }
  }
#endif
};

// One pass's rows of x (`rows`, at most a register tile's) as the tiles read them: block
// by block, the rows' 32 inputs one after the other, and where `sums` is given (Q4_1)
// each row's sum of x over each block, [blocks, rows]. Why: read in place, the rows lay
// a runtime stride apart, and with 16 x R addresses a block GCC kept their offsets on
// the stack, so each FMA waited on a load of its address beside its own load; packed,
// each is one fixed offset from the block's start. Each sum adds its block's inputs in
// order, as unpacked, 8 blocks at a time so that the adds do not wait on each other. The
// results are the same bits. 30 layers' weights, 2 threads, alternating processes: 4 rows
// 8.6 -> 6.9-7.3 ms, 8 rows 13.4-14.0 -> 10.5-11.1 ms (AVX2: 6 rows 13.9 -> 11.4 ms); a
// decode step of 8 requests 33.9-34.9 -> 30.0-30.4 ms.
void pack_rows(const float* x, int64_t rows, int64_t in, float* packed, float* sums) {
  const int64_t blocks = in / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(packed + (b * rows + r) * kBlock, x + r * in + b * kBlock,
                  kBlock * sizeof(float));
    }
  }
  if (sums == nullptr) return;
  constexpr int64_t kChains = 8;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * in;
    int64_t b0 = 0;
    for (; b0 + kChains <= blocks; b0 += kChains) {
      float s[kChains] = {};
      for (int64_t j = 0; j < kBlock; ++j) {
        PAGELLM_UNROLL
        for (int64_t u = 0; u < kChains; ++u) s[u] += row[(b0 + u) * kBlock + j];
      }
      for (int64_t u = 0; u < kChains; ++u) sums[(b0 + u) * rows + r] = s[u];
    }
    for (; b0 < blocks; ++b0) {
      float sum = 0.0f;
      for (int64_t j = 0; j < kBlock; ++j) sum += row[b0 * kBlock + j];
      sums[b0 * rows + r] = sum;
    }
  }
}

// R rows of x, packed (pack_rows), against one tile of 16 output rows: y[r, 0:16] over
// every input block.
template <class Format, int R>
void tile(const float* x, int64_t blocks, const uint16_t* scales, const uint16_t* mins,
          const uint8_t* codes, const float* sums, float* y, int64_t ldy) {
  vf acc_a[R], acc_b[R];
  PAGELLM_UNROLL
  for (int r = 0; r < R; ++r) acc_a[r] = acc_b[r] = zero();
  for (int64_t b = 0; b < blocks; ++b) {
    Format::template block<R>(x + b * R * kBlock, scales + b * kLanes,
                              mins == nullptr ? nullptr : mins + b * kLanes,
                              codes + b * Format::kCodeBytes,
                              sums == nullptr ? nullptr : sums + b * R, acc_a, acc_b);
  }
  PAGELLM_UNROLL
  for (int r = 0; r < R; ++r) storeu(y + r * ldy, add(acc_a[r], acc_b[r]));
}

using TileFn = void (*)(const float*, int64_t, const uint16_t*, const uint16_t*, const uint8_t*,
                        const float*, float*, int64_t);

template <class Format, std::size_t... R>
constexpr std::array<TileFn, sizeof...(R)> tile_table(std::index_sequence<R...>) {
  return {tile<Format, R + 1>...};
}

template <class Format>
constexpr auto kTiles = tile_table<Format>(std::make_index_sequence<Format::kMaxRows>());

// More than Format::kMaxRows rows: a panel of kPanel tiles is unpacked once into float32
// (input-major, kPanel * 16 lanes per input) and every row streams it, kPanelRows rows x
// the panel's lanes per pass, like a GEMM micro-kernel; `tile` would unpack the codes
// again for each pass of kMaxRows rows. While a panel is multiplied, the next one's blocks
// are fetched into L2 (see Prefetch). Measured with 30 layers' weights streamed from
// memory (as in a decode step), against the register tiles: 16 rows 11.5 -> 10.5 ms, 24
// rows 16.4 -> 14.3 ms; and against oneDNN's float32 GEMM: 32 rows 26.5 -> 18.2 ms, 128
// rows 70.1 -> 64.6 ms, 512 rows 268 -> 264 ms (oneDNN ahead from 1,024 rows: 510 vs 526
// ms).
constexpr int64_t kPanel = 2;
// Rows per pass: 24 accumulators with AVX-512 (two registers a row) beside the panel's row
// of weights; with AVX2, 12 accumulators (four registers a row) beside the 3 rows' inputs
// and one weight register, all 16 registers. The AVX2 tile had been 2 rows holding the
// weights: 8 accumulators only just cover the FMA latency (4 cycles, 2 FMAs a cycle), and
// any late load stalled it. 3 rows, same sums bit for bit, 30 layers' weights on 2 threads,
// in-process A/B (medians of 10 alternating rounds): 512 rows 834 -> 737 ms, 1,024 rows
// 1,716 -> 1,504, 128 rows 228 -> 197, 32 rows 54 -> 51.
constexpr int kPanelRows = kWideRegisters ? 12 : 3;
constexpr int64_t kRowBlock = 512;  // rows per sweep over the panels (see quantized_linear)
// Inputs per sweep of the row passes over a panel: with AVX2, 128 inputs' slice of the
// panel (16 KB) stays in L1 for all the passes, where the whole panel (72 KB for 576
// inputs) streamed from L2 for each pass of rows; with AVX-512 a pass of 12 rows does 4x
// the FMAs per panel load, and the whole panel is one chunk.
constexpr int64_t kDepthChunk = kWideRegisters ? int64_t{1} << 40 : 128;
// Panels from the first row count that needs a second pass of register tiles, which would
// read every block again: with AVX2 (4 rows a pass, unfactored), 30 layers' weights at 8
// rows 26 -> 18 ms and at 5 rows 21 -> 17 ms, in-process A/B; with AVX-512, 8 rows as
// measured above. Factored, Q4_1's tiles overtook the panels at 5 rows (12.7 -> 10.0 ms,
// 30 layers, min of 25, alternating processes) and tie at 6, so its AVX2 tiles take 6.

// A thread's scratch, one per `slot` (0: an unpacked panel, 1: its partial sums, 2: the
// register tiles' packed rows and Q4_1's sums of x): 64-byte aligned (aligned vector loads), grown as
// needed and kept, so a decode step allocates nothing.
float* thread_scratch(int slot, int64_t floats) {
  struct Scratch {
    float* data = nullptr;
    int64_t size = 0;
    ~Scratch() { ::operator delete(data, std::align_val_t{64}); }
  };
  thread_local Scratch scratch[3];
  Scratch& s = scratch[slot];
  if (s.size < floats) {
    ::operator delete(s.data, std::align_val_t{64});
    s.data = static_cast<float*>(
        ::operator new(static_cast<std::size_t>(floats) * sizeof(float), std::align_val_t{64}));
    s.size = floats;
  }
  return s.data;
}

// R rows against inputs [0, depth) of a panel, from the partial sums at `partial` (R x
// the panel's lanes) unless `first`; the sums go back to `partial`, or, when `y` is given
// (the panel's last inputs), to y as the result.
template <int R>
void panel_rows(const float* x, int64_t ldx, int64_t depth, const float* w, float* partial,
                bool first, const Prefetch* prefetch, int64_t first_line, float* y,
                int64_t ldy, bool gated) {
  constexpr int64_t kWidth = kPanel * kLanes;
  constexpr int kVecs = kWidth / kRegisterLanes;  // registers in a row of the panel
  vreg acc[R][kVecs];
  PAGELLM_UNROLL
  for (int r = 0; r < R; ++r) {
    PAGELLM_UNROLL
    for (int v = 0; v < kVecs; ++v) {
      acc[r][v] = first ? zero_reg() : load_reg(partial + r * kWidth + v * kRegisterLanes);
    }
  }
  for (int64_t k = 0; k < depth; ++k) {
    if (prefetch != nullptr) prefetch->line(first_line + k);
    if constexpr (R * kVecs + kVecs + 1 <= kRegisters) {
      // The panel's row of weights held, each row's input broadcast in turn.
      vreg wv[kVecs];
      PAGELLM_UNROLL
      for (int v = 0; v < kVecs; ++v) {
        wv[v] = in_register(load_reg(w + k * kWidth + v * kRegisterLanes));
      }
      PAGELLM_UNROLL
      for (int r = 0; r < R; ++r) {
        const vreg xv = broadcast_reg(x + r * ldx + k);
        PAGELLM_UNROLL
        for (int v = 0; v < kVecs; ++v) acc[r][v] = fmadd(xv, wv[v], acc[r][v]);
      }
    } else {
      // Too few registers for that (AVX2, 3 rows: 12 accumulators): the rows' inputs held,
      // each weight register loaded once and used by every row.
      vreg xv[R];
      PAGELLM_UNROLL
      for (int r = 0; r < R; ++r) {
        xv[r] = in_register(broadcast_reg(x + r * ldx + k));
      }
      PAGELLM_UNROLL
      for (int v = 0; v < kVecs; ++v) {
        const vreg wv = in_register(load_reg(w + k * kWidth + v * kRegisterLanes));
        PAGELLM_UNROLL
        for (int r = 0; r < R; ++r) acc[r][v] = fmadd(xv[r], wv, acc[r][v]);
      }
    }
  }
  static_assert(kPanel == 2, "a gated panel is one (gate, up) pair of tiles");
  PAGELLM_UNROLL
  for (int r = 0; r < R; ++r) {
    if (y == nullptr) {
      PAGELLM_UNROLL
      for (int v = 0; v < kVecs; ++v) store(partial + r * kWidth + v * kRegisterLanes, acc[r][v]);
    } else if (gated) {
      storeu(y + r * ldy, silu_mul16(join(acc[r]), join(acc[r] + kVecs / 2)));
    } else {
      PAGELLM_UNROLL
      for (int v = 0; v < kVecs; ++v) storeu(y + r * ldy + v * kRegisterLanes, acc[r][v]);
    }
  }
}

using PanelFn = void (*)(const float*, int64_t, int64_t, const float*, float*, bool,
                        const Prefetch*, int64_t, float*, int64_t, bool);

template <std::size_t... R>
constexpr std::array<PanelFn, sizeof...(R)> panel_table(std::index_sequence<R...>) {
  return {panel_rows<R + 1>...};
}

constexpr auto kPanelRowFns = panel_table(std::make_index_sequence<kPanelRows>());

template <class Format>
void panel(const float* x, int64_t rows, int64_t in, int64_t blocks, const uint16_t* scales,
           const uint16_t* mins, const uint8_t* codes, int64_t tile_scales, int64_t tile_codes,
           float* y, int64_t ldy, int64_t next_panel, bool gated) {
  constexpr int64_t kWidth = kPanel * kLanes;
  float* w = thread_scratch(0, in * kWidth);
  // The blocks of the panel `next_panel` panels on (none when 0), fetched meanwhile.
  const bool prefetch_next = next_panel > 0;
  const Prefetch next(scales, mins, codes, tile_scales, tile_codes, next_panel * kPanel,
                      prefetch_next ? kPanel : 0);
  for (int64_t p = 0; p < kPanel; ++p) {
    for (int64_t b = 0; b < blocks; ++b) {
      Format::unpack(scales + p * tile_scales + b * kLanes,
                     mins == nullptr ? nullptr : mins + p * tile_scales + b * kLanes,
                     codes + p * tile_codes + b * Format::kCodeBytes,
                     w + b * kBlock * kWidth + p * kLanes, kWidth);
    }
  }
  // Rows split evenly over the passes (16: 8 + 8, not 12 + 4). Each pass adds the same
  // inputs in the same order whatever the chunks, so chunking never changes a result.
  const int64_t passes = (rows + kPanelRows - 1) / kPanelRows;
  float* partial = kDepthChunk < in ? thread_scratch(1, rows * kWidth) : nullptr;
  for (int64_t k0 = 0; k0 < in; k0 += kDepthChunk) {
    const int64_t depth = std::min(kDepthChunk, in - k0);
    const bool last = k0 + depth == in;
    for (int64_t i = 0, r0 = 0; i < passes; ++i) {
      const int64_t n = (rows - r0) / (passes - i);
      kPanelRowFns[n - 1](x + r0 * in + k0, in, depth, w + k0 * kWidth,
                          partial == nullptr ? nullptr : partial + r0 * kWidth, k0 == 0,
                          i == 0 && prefetch_next ? &next : nullptr, k0,
                          last ? y + r0 * ldy : nullptr, ldy, gated);
      r0 += n;
    }
  }
}

#ifdef PAGELLM_AMX
// acc += scale * (the block's tile sums) (+ min * the row's block sum), for one sub-block
// of 2 row tiles x 2 output tiles, stored in `sums_of_tiles`.
template <class Format>
void amx_scale(const float (*sums_of_tiles)[amx::kTile][amx::kTile], const uint16_t* scales,
               const uint16_t* mins, int64_t tile_scales, int64_t b, const float* row_sums,
               int64_t blocks, float* acc, int64_t ld_acc) {
  for (int j = 0; j < 2; ++j) {
    const vf d = load_halves(scales + j * tile_scales + b * kLanes);
    vf m = zero();
    if constexpr (Format::kHasMins) m = load_halves(mins + j * tile_scales + b * kLanes);
    for (int i = 0; i < 2; ++i) {
      PAGELLM_UNROLL
      for (int r = 0; r < amx::kTile; ++r) {
        float* a = acc + (i * amx::kTile + r) * ld_acc + j * kLanes;
        vf sum = fmadd(load(sums_of_tiles[i * 2 + j][r]), d, load(a));
        if constexpr (Format::kHasMins) {
          sum = fmadd(set1(row_sums[(i * amx::kTile + r) * blocks + b]), m, sum);
        }
        store(a, sum);
      }
    }
  }
}

// The AMX path (amx_matmul.h) for one task: `kPairs` panels (2 * kPairs output tiles from
// the tile `scales` and `codes` start at) against a chunk of rows (`pieces`, `row_sums`
// and `y` at its first row; `rows` of its `padded_rows` real), 64 rows at a time, each
// block's tile sums scaled into float32 accumulators that stay in L1. The codes are
// unpacked into B tiles once per task, into this thread's scratch.
template <class Format, int kPairs>
void amx_columns(const uint16_t* pieces, const float* row_sums, int64_t rows,
                 int64_t padded_rows, int64_t blocks, const uint16_t* scales, const uint16_t* mins,
                 const uint8_t* codes, int64_t tile_scales, int64_t tile_codes, float* y,
                 int64_t ldy, bool gated, const Prefetch& next) {
  constexpr int64_t kRowsPerPass = 64, kWidth = 2 * kPairs * kLanes;
  const int64_t tile_elems = amx::kTileElems;
  uint16_t* b_tiles = reinterpret_cast<uint16_t*>(
      thread_scratch(0, 2 * kPairs * blocks * tile_elems / 2));
  // Block b's B tiles, unpacked during the first pass over the rows (later passes reuse
  // them): block b + 1's while the tiles compute block b's first sub-block, so the vector
  // units unpack while the tile unit multiplies. Unpacked all before the first pass, a
  // decode step's 32 rows spent a third of their matmul time waiting for it. With each
  // block, the same share of the next task's blocks is fetched: a decode step's weights
  // come from memory, not cache (32 x 576 x 3,072 with 128 weights in turn, 2 threads:
  // 0.24-0.25 -> 0.21-0.22 ms; shared-prefix decode steps 48.7-51.7 -> 46.3-47.5 ms).
  const int64_t next_lines = next.total();
  auto unpack_block = [&](int64_t b) {
    for (int64_t i = b * next_lines / blocks; i < (b + 1) * next_lines / blocks; ++i) {
      next.line(i);
    }
    for (int t = 0; t < 2 * kPairs; ++t) {
      Format::b_tile(codes + t * tile_codes + b * Format::kCodeBytes,
                     b_tiles + (t * blocks + b) * tile_elems);
    }
    // GCC's tile intrinsics do not tell it which memory they read: the stores of the
    // unpacked tiles must not move past them.
    asm volatile("" ::: "memory");
  };
  unpack_block(0);
  const amx::Config config;
  asm volatile("" ::: "memory");  // the config's stores, likewise
  _tile_loadconfig(&config);
  alignas(64) float stored[2][4][amx::kTile][amx::kTile];
  alignas(64) float acc[kRowsPerPass * kWidth];
  const int64_t piece_stride = blocks * amx::kPieces * tile_elems;  // one row tile's
  for (int64_t r0 = 0; r0 < padded_rows; r0 += kRowsPerPass) {
    const int sub_rows = static_cast<int>(std::min<int64_t>(2, (padded_rows - r0) / 32));
    std::fill(acc, acc + sub_rows * 32 * kWidth, 0.0f);
    // Each sub-block's sums are scaled while the tiles compute the next one's: read
    // straight after the tile store, they waited for it (one thread, 512 x 576 x 1,536:
    // 2.96 -> 2.58 ms).
    int pending_b = -1, pending_ci = 0, pending_ri = 0, slot = 0;
    auto scale_pending = [&] {
      const int64_t col = pending_ci * 2;
      amx_scale<Format>(stored[slot ^ 1], scales + col * tile_scales,
                        mins == nullptr ? nullptr : mins + col * tile_scales, tile_scales,
                        pending_b, row_sums + (r0 + pending_ri * 32) * blocks, blocks,
                        acc + pending_ri * 32 * kWidth + col * kLanes, kWidth);
    };
    for (int64_t b = 0; b < blocks; ++b) {
      for (int ci = 0; ci < kPairs; ++ci) {
        for (int ri = 0; ri < sub_rows; ++ri) {
          const uint16_t* a = pieces + (r0 / amx::kTile + 2 * ri) * piece_stride +
                              b * amx::kPieces * tile_elems;
          _tile_loadd(0, amx::kZeros, 64);
          _tile_loadd(1, amx::kZeros, 64);
          _tile_loadd(2, amx::kZeros, 64);
          _tile_loadd(3, amx::kZeros, 64);
          _tile_loadd(6, b_tiles + ((2 * ci) * blocks + b) * tile_elems, 64);
          _tile_loadd(7, b_tiles + ((2 * ci + 1) * blocks + b) * tile_elems, 64);
          for (int p = 0; p < amx::kPieces; ++p) {
            _tile_loadd(4, a + p * tile_elems, 64);
            _tile_loadd(5, a + piece_stride + p * tile_elems, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
          if (r0 == 0 && ci == 0 && ri == 0 && b + 1 < blocks) unpack_block(b + 1);
          if (pending_b >= 0) scale_pending();
          _tile_stored(0, stored[slot][0], 64);
          _tile_stored(1, stored[slot][1], 64);
          _tile_stored(2, stored[slot][2], 64);
          _tile_stored(3, stored[slot][3], 64);
          pending_b = static_cast<int>(b);
          pending_ci = ci;
          pending_ri = ri;
          slot ^= 1;
        }
      }
    }
    scale_pending();
    for (int64_t r = r0; r < std::min(rows, r0 + sub_rows * 32); ++r) {
      const float* row = acc + (r - r0) * kWidth;
      for (int pair = 0; pair < kPairs; ++pair) {
        const float* p = row + pair * 2 * kLanes;
        if (gated) {
          storeu(y + r * ldy + pair * kLanes, silu_mul16(load(p), load(p + kLanes)));
        } else {
          storeu(y + r * ldy + pair * 2 * kLanes, load(p));
          storeu(y + r * ldy + pair * 2 * kLanes + kLanes, load(p + kLanes));
        }
      }
    }
  }
  _tile_release();
}

// Many rows on AMX: x split once (its pieces and block sums, rows padded to 32), then a
// task per two panels (one for a last odd panel) and chunk of rows, the chunks' pieces at
// most 1 MB (half of L2 here). Why the chunks: a weight of 576 outputs makes only 9
// column tasks, which 2 threads share 5 to 4, and a down projection's task read all of
// its 512 rows x 1,536 inputs (4.7 MB of pieces) from L3. In chunks the tasks are many
// and their pieces stay in L2. 2 threads, alternating builds: 512 x 1,536 x 576
// 2.39-2.43 -> 2.16-2.20 ms, 512 x 576 x 576 0.89-0.90 -> 0.80-0.83 ms; 32 rows are one
// chunk, as before. A row's result does not depend on its chunk.
template <class Format>
void amx_linear(const float* x, int64_t rows, int64_t in, int64_t tiles, const uint16_t* scales,
                const uint16_t* mins, const uint8_t* codes, float* y, int64_t ldy, bool gated) {
  const int64_t blocks = in / kBlock;
  const int64_t padded_rows = (rows + 31) / 32 * 32;
  at::Tensor pieces = at::empty({padded_rows * in * amx::kPieces}, at::kBFloat16);
  at::Tensor sums = at::empty({padded_rows * blocks}, at::kFloat);
  uint16_t* pp = static_cast<uint16_t*>(pieces.data_ptr());
  float* sp = sums.data_ptr<float>();
  at::parallel_for(0, padded_rows, amx::kTile, [&](int64_t begin, int64_t end) {
    amx::split_rows(x, rows, in, begin, end, pp, sp);
  });
  constexpr int64_t kChunkBytes = 1 << 20;  // of L2's 2 MB on this project's Xeon
  const int64_t row_bytes = in * amx::kPieces * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t min_chunks = (padded_rows * row_bytes + kChunkBytes - 1) / kChunkBytes;
  const int64_t chunk_rows = (padded_rows / 32 + min_chunks - 1) / min_chunks * 32;
  const int64_t chunks = (padded_rows + chunk_rows - 1) / chunk_rows;
  const int64_t tile_scales = blocks * kLanes, tile_codes = blocks * Format::kCodeBytes;
  const int64_t panels = tiles / kPanel, column_tasks = (panels + 1) / 2;
  const int64_t piece_stride = blocks * amx::kPieces * amx::kTileElems;  // one row tile's
  for_each_task(chunks * column_tasks, [&](int64_t task, int64_t next_task) {
    const int64_t column = task % column_tasks, r0 = task / column_tasks * chunk_rows;
    const int64_t t = column * 2 * kPanel;
    const uint16_t* tm = mins == nullptr ? nullptr : mins + t * tile_scales;
    float* out = y + r0 * ldy + (gated ? t / 2 : t) * kLanes;
    const int64_t n = std::max<int64_t>(next_task, 0) % column_tasks * 2 * kPanel;
    const Prefetch next(scales, mins, codes, tile_scales, tile_codes, n,
                        next_task < 0 ? 0 : std::min(2 * kPanel, tiles - n));
    const uint16_t* chunk_pieces = pp + r0 / amx::kTile * piece_stride;
    const float* chunk_sums = sp + r0 * blocks;
    const int64_t chunk_padded = std::min(chunk_rows, padded_rows - r0);
    const int64_t chunk_rows_real = std::min(chunk_rows, rows - r0);  // >= 1: r0 < rows
    if (2 * column + 1 < panels) {
      amx_columns<Format, 2>(chunk_pieces, chunk_sums, chunk_rows_real, chunk_padded, blocks,
                             scales + t * tile_scales, tm, codes + t * tile_codes, tile_scales,
                             tile_codes, out, ldy, gated, next);
    } else {
      amx_columns<Format, 1>(chunk_pieces, chunk_sums, chunk_rows_real, chunk_padded, blocks,
                             scales + t * tile_scales, tm, codes + t * tile_codes, tile_scales,
                             tile_codes, out, ldy, gated, next);
    }
  });
}
#endif

template <class Format>
at::Tensor quantized_linear(const char* name, const at::Tensor& x, const at::Tensor& scales,
                            const uint16_t* mins, const at::Tensor& codes, bool gated) {
  const int64_t width = check_linear_args(name, x, scales, gated);
  TORCH_CHECK(codes.size(0) == scales.size(0) && codes.size(1) == scales.size(1) &&
                  codes.numel() == scales.numel() / kLanes * Format::kCodeBytes &&
                  codes.is_contiguous() && codes.element_size() == 1,
              name, ": codes do not match the scales");
  const int64_t tiles = scales.size(0), blocks = scales.size(1);
  const int64_t rows = x.size(0), in = x.size(1), out = tiles * kLanes;
  at::Tensor y = at::empty({rows, width}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* sp = halves(scales);
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  float* yp = y.data_ptr<float>();
  const int64_t tile_scales = blocks * kLanes, tile_codes = blocks * Format::kCodeBytes;
#ifdef PAGELLM_AMX
  if (rows > Format::kMaxRows && tiles % kPanel == 0 && amx::available()) {
    amx_linear<Format>(xp, rows, in, tiles, sp, mins, cp, yp, width, gated);
    return y;
  }
#endif
  if (rows > Format::kMaxRows && tiles % kPanel == 0) {
    // Rows in blocks, each multiplied by every panel before the next block: a block's
    // inputs stay in cache while the panels stream past, however many rows there are.
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int64_t n = std::min(kRowBlock, rows - r0);
      for_each_task(tiles / kPanel, [&](int64_t i, int64_t next) {
        const int64_t t = i * kPanel;
        panel<Format>(xp + r0 * in, n, in, blocks, sp + t * tile_scales,
                      mins == nullptr ? nullptr : mins + t * tile_scales, cp + t * tile_codes,
                      tile_scales, tile_codes, yp + r0 * width + (gated ? i : t) * kLanes,
                      width, next < 0 ? 0 : next - i, gated);
      });
    }
    return y;
  }
  // Few rows: each tile on its own, then a gated weight's pairs are combined (a few rows
  // of scratch, next to the weights streamed).
  at::Tensor full = gated ? at::empty({rows, out}, x.options()) : y;
  float* fp = full.data_ptr<float>();
  // The passes' packed rows and Q4_1's sums, in this thread's scratch: the tiles only
  // read them.
  float* packed = thread_scratch(2, rows * (in + blocks));
  float* sums = mins == nullptr ? nullptr : packed + rows * in;
  for (int64_t r0 = 0; r0 < rows; r0 += Format::kMaxRows) {
    pack_rows(xp + r0 * in, std::min(Format::kMaxRows, rows - r0), in, packed + r0 * in,
              sums == nullptr ? nullptr : sums + r0 * blocks);
  }
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r0 = 0; r0 < rows; r0 += Format::kMaxRows) {
        const int64_t n = std::min(Format::kMaxRows, rows - r0);
        kTiles<Format>[n - 1](packed + r0 * in, blocks, sp + t * tile_scales,
                              mins == nullptr ? nullptr : mins + t * tile_scales,
                              cp + t * tile_codes,
                              sums == nullptr ? nullptr : sums + r0 * blocks,
                              fp + r0 * out + t * kLanes, out);
      }
    }
  });
  if (gated) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < width / kLanes; ++i) {
        const float* pair = fp + r * out + i * 2 * kLanes;
        storeu(yp + r * width + i * kLanes,
                         silu_mul16(loadu(pair), loadu(pair + kLanes)));
      }
    }
  }
  return y;
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& scales, const at::Tensor& mins,
                       const at::Tensor& codes, bool gated) {
  check_mins("q4_1_linear", mins, scales);
  TORCH_CHECK(codes.scalar_type() == at::kByte, "q4_1_linear: codes must be uint8");
  TORCH_CHECK(codes.dim() == 4 && codes.size(3) == kLanes, "q4_1_linear: codes must be "
              "[tiles, blocks, 16, 16] (codes in the int8 layout go to q4_1_int8_linear)");
  return quantized_linear<Q4_1>("q4_1_linear", x, scales, halves(mins), codes, gated);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& scales, const at::Tensor& codes,
                       bool gated) {
  TORCH_CHECK(codes.scalar_type() == at::kChar, "q8_0_linear: codes must be int8");
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == kBlock, "q8_0_linear: codes must be "
              "[tiles, blocks, 32, 16] (codes in the int8 layout go to q8_0_int8_linear)");
  return quantized_linear<Q8_0>("q8_0_linear", x, scales, nullptr, codes, gated);
}

// Whether many-row matmuls run on AMX in this process (built for it, and Linux granted the
// tile state).
bool amx_in_use() {
#ifdef PAGELLM_AMX
  return amx::available();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(pagellm, m) {
  m.def("amx_in_use() -> bool", &amx_in_use);
  m.def("q4_1_linear(Tensor x, Tensor scales, Tensor mins, Tensor codes, bool gated=False) "
        "-> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor scales, Tensor codes, bool gated=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("q4_1_linear", &q4_1_linear);
  m.impl("q8_0_linear", &q8_0_linear);
}
