// The KV pool's element types: float32, or bfloat16 (`kv_cache_dtype="bfloat16"`), which
// halves the pool's bytes, so it holds twice the tokens (twice the prefixes to find again)
// and a decode step reads half the bytes per key.
//
// The attention kernels are written once over the element type: keys and values are
// widened to float32 as they are loaded (a bfloat16 is a float32's upper 16 bits, so
// widening is exact), and everything after the load is the float32 kernel unchanged. So
// attention over a bfloat16 pool gives, bit for bit, what the float32 kernel gives over a
// pool holding the same values (tested). Rounding happens once, where a step's new rows
// are stored (`round_bf16`, torch's rounding: to nearest, ties to even, NaN kept a NaN).
#pragma once

#include "simd.h"

#include <cstdint>
#include <cstring>

namespace pagellm_kernels {

struct bf16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2);

// Elements of a 64-byte cache line: the step of a loop that prefetches a row.
template <typename KV>
constexpr int kLineElements = 64 / static_cast<int>(sizeof(KV));

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  const uint32_t wide = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

// torch's float -> bfloat16 (c10::BFloat16's round_to_nearest_even).
inline bf16 round_bf16(float x) {
  if (x != x) return bf16{0x7FC0};
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return bf16{static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}

inline void store_row(float* dst, const float* src, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void store_row(bf16* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = round_bf16(src[i]);
}

namespace simd {

// 16 elements at p as float32 lanes (no alignment needed).
inline vf load_kv(const float* p) { return loadu(p); }
#if PAGELLM_WIDE_REGISTERS
inline vf load_kv(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#else
inline __m256 widen8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vf load_kv(const bf16* p) { return {widen8(p), widen8(p + 8)}; }
// One register's lanes (AVX2's 8) at p, for the kernels that count registers.
inline vreg load_reg_kv(const float* p) { return loadu_reg(p); }
inline vreg load_reg_kv(const bf16* p) { return widen8(p); }
#endif

}  // namespace simd
}  // namespace pagellm_kernels
