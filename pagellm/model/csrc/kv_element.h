// The KV pool's element types: float32, or bfloat16 (`kv_cache_dtype="bfloat16"`, or
// "auto" under quantize_activations with bfloat16 products), which halves the pool's
// bytes, so it holds twice the tokens (twice the prefixes to find again) and a decode step
// reads half the bytes per key.
//
// The attention kernels are written once over the element type: with float32 products,
// keys and values are widened to float32 as they are loaded (a bfloat16 is a float32's
// upper 16 bits, so widening is exact), and everything after the load is the float32
// kernel unchanged. So attention over a bfloat16 pool gives, bit for bit, what the
// float32 kernel gives over a pool holding the same values (tested). Rounding happens
// once, where a step's new rows are stored (`round_bf16`, torch's rounding: to nearest,
// ties to even, NaN kept a NaN); attention with bfloat16 products (below) also rounds
// what it multiplies, the same way.
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

// Attention's products in bfloat16 (quantize_activations, where the CPU has AVX-512 BF16):
// queries, keys, probabilities and values rounded to bfloat16, each pair of products taken
// by one vdpbf16ps into float32 sums, twice the multiply-adds of an FMA per instruction.
// A pair is two bfloat16 in the 32 bits of a lane, the first in the low half; `vf`
// registers carry pairs as bits.
// Rounding is round_bf16's (not vcvtneps2bf16's, which flushes denormals): a float32
// pool's keys and values then round to the very bits a bfloat16 pool stores, so the two
// pools give the same results.
#if PAGELLM_WIDE_REGISTERS && defined(__AVX512BF16__)
constexpr bool kBf16Products = true;
// v rounded to bfloat16 as round_bf16 does, as float32 lanes.
inline vf to_bf16_values(vf v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
  const vf rounded =
      _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  return select(is_nan(v), _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)), rounded);
}
// 16 pool elements at p as bfloat16 values in float32 lanes: a float32 pool's rounded, a
// bfloat16 pool's only widened (they are bfloat16 values already).
inline vf load_bf16_values(const float* p) { return to_bf16_values(loadu(p)); }
inline vf load_bf16_values(const bf16* p) { return load_kv(p); }
// Lanes of pairs (first[i], second[i]) from two vectors of bfloat16 values (to_bf16_values).
inline vf pack_bf16_pairs(vf first, vf second) {
  const __m512i high = _mm512_castps_si512(second);
  const __m512i low = _mm512_srli_epi32(_mm512_castps_si512(first), 16);
  return _mm512_castsi512_ps(_mm512_or_si512(high, low));
}
// Lane by lane (a, b vectors of pairs), acc + a.second * b.second, rounded, then
// + a.first * b.first, rounded (products of bfloat16 are exact in float32; vdpbf16ps
// reads denormal inputs as zero and flushes denormal results).
inline vf dot_bf16_pairs(vf acc, vf a, vf b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}
// 16 float32 lanes rounded as to_bf16_values, stored as 16 bfloat16 at p.
inline void store_bf16(bf16* p, vf v) {
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(to_bf16_values(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(high));
}
#else
constexpr bool kBf16Products = false;
// Declared only, so that the kernels' bfloat16 branches, never instantiated in this build,
// still compile.
vf to_bf16_values(vf v);
vf load_bf16_values(const float* p);
vf load_bf16_values(const bf16* p);
vf pack_bf16_pairs(vf first, vf second);
vf dot_bf16_pairs(vf acc, vf a, vf b);
void store_bf16(bf16* p, vf v);
#endif

}  // namespace simd
}  // namespace pagellm_kernels
