// The quantized matmul of many rows on Intel AMX (bfloat16 tiles), where the CPU has it,
// with the float32 results of the panels' arithmetic class: every product exact, sums
// in float32.
//
// Why it is exact: AMX multiplies bfloat16 pairs and adds the products in float32. A
// weight's code (Q4_1: 0..15; Q8_0: -128..127) is a bfloat16 exactly, and a float32 x
// is exactly the sum of three bfloat16 pieces (8 significant bits each, truncated: x's 24
// bits), so code * piece is exact and the tile's sum over a block of
// 32 inputs is float32 addition, only in another order than the panels'. Each block's
// sum is then scaled as Q4_1 is factored for the register tiles: scale * sum(x * code) +
// min * sum(x). Three tile products per block still take a third of the time of AVX-512's
// float32 FMAs for the same block, on this project's Xeon: one thread, 512 rows x 576
// inputs x 1,536 outputs, 5.4 ms on the AVX-512 panels against 2.6 ms here.
//
// A row's result depends only on that row (rows are padded to tiles with zeros), and
// every row count takes the same path, so the panels' promise holds: a prompt computed in
// one chunk or several gives the same bits. Where it is not exact: AMX reads bfloat16
// subnormals as zero, so pieces under 2^-126 (x under about 2^-103) are dropped, an error
// far below float32's rounding of any sum they are in; an infinite x goes in whole, and
// its row is infinite or NaN as on the panels.
//
// Layouts: x's pieces per 16-row tile and block, [row tiles][blocks][3][16][32] bfloat16
// (one 1 KB tile each); the weights' codes unpacked per task into B tiles [col tiles]
// [blocks][16 pairs of inputs][16 outputs][2], AMX's pair-interleaved layout (each
// format's `b_tile`).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGELLM_AMX 1

#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace pagellm_kernels::amx {

constexpr int64_t kTile = 16;   // rows, and outputs, per tile
constexpr int64_t kBlock = 32;  // inputs per block (a tile's depth in bfloat16 pairs)
constexpr int64_t kTileElems = kTile * kBlock;  // bfloat16 per A or B tile
constexpr int kPieces = 3;

// Linux gives a process AMX's tile state only on request (arch_prctl); asked once. Without
// it (an older kernel, a sandbox that refuses), the panels run instead.
inline bool available() {
  static const bool ok = [] {
    constexpr int kReqPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kReqPermission, kTileData) == 0;
  }();
  return ok;
}

// Tiles 0-3 accumulate (2 row tiles x 2 output tiles), 4-5 hold x's pieces, 6-7 codes.
struct Config {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  Config() {
    for (int i = 0; i < 8; ++i) {
      colsb[i] = 64;
      rows[i] = kTile;
    }
  }
};

// A zero tile to load into an accumulator: `tilezero` stalled the tile pipeline (one
// thread, 512 x 576 x 1,536: 2.4 -> 1.4 ms without the epilogue).
alignas(64) inline const float kZeros[kTile * kTile] = {};

// x's leading 8 significant bits (a bfloat16 exactly), truncated: rounding to nearest
// would carry the largest finite floats to infinity, and then x - piece is NaN.
inline __m512 leading_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x),
                                              _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Rows [r0, r1) of x [rows, in] as three bfloat16 pieces in A-tile layout, and each row's
// sum per block (Q4_1's min term); rows past `rows` (padding to a tile) are zeros.
inline void split_rows(const float* x, int64_t rows, int64_t in, int64_t r0, int64_t r1,
                       uint16_t* pieces, float* sums) {
  const int64_t blocks = in / kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    uint16_t* tile_row = pieces + (r / kTile) * blocks * kPieces * kTileElems + (r % kTile) * kBlock;
    for (int64_t b = 0; b < blocks; ++b) {
      __m512 v[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
      if (r < rows) {
        v[0] = _mm512_loadu_ps(x + r * in + b * kBlock);
        v[1] = _mm512_loadu_ps(x + r * in + b * kBlock + 16);
      }
      sums[r * blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
      for (int p = 0; p < kPieces; ++p) {
        uint16_t* out = tile_row + (b * kPieces + p) * kTileElems;
        for (int h = 0; h < 2; ++h) {
          const __m512 piece = leading_bf16(v[h]);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + h * 16),
                              _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(piece), 16)));
          // What is left for the next piece (exact); none after an infinity or NaN, which
          // the first piece carries whole (inf - inf would be NaN).
          const __mmask16 finite = _mm512_cmp_ps_mask(v[h], v[h], _CMP_ORD_Q) &
                                   ~_mm512_cmp_ps_mask(_mm512_abs_ps(v[h]),
                                                       _mm512_set1_ps(__builtin_inff()), _CMP_EQ_OQ);
          v[h] = _mm512_maskz_sub_ps(finite, v[h], piece);
        }
      }
    }
  }
}

// Byte rows a and b (16 outputs' codes of two successive inputs) interleaved as a B
// tile's row pairs them: byte 2n from a, 2n + 1 from b. Interleaving the bytes before
// widening them, not the widened integers, halves the instructions of the unpacking
// (32 x 576 x 3,072, 2 threads: 0.075 -> 0.042 ms with the split of x).
inline __m256i interleave_rows(const uint8_t* a, const uint8_t* b) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  return _mm256_set_m128i(_mm_unpackhi_epi8(x, y), _mm_unpacklo_epi8(x, y));
}

// 16-bit words 0..15 to bfloat16 by `_mm512_permutexvar_epi16`: the table of their
// bfloat16s (words 16..31 repeat them).
inline __m512i small_ints_bf16() {
  const __m512 ints =
      _mm512_cvtepi32_ps(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
  return (__m512i)_mm512_cvtne2ps_pbh(ints, ints);
}

}  // namespace pagellm_kernels::amx

#endif
