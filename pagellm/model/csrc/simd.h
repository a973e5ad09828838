// 16 float32 lanes for the kernels, on AVX-512 (one register) or on AVX2 with FMA and F16C
// (two).
//
// Why one type for both: the kernels are written once, in 16-lane vectors (a weight tile's
// 16 output rows, a head's 64 dims as 4 vectors), and the compiler picks the instruction
// set the machine has (-march=native). AVX2 machines are common (most AMD EPYC guests
// expose no AVX-512); on them a kernel's register tiles must be smaller, since AVX2 has
// 16 registers of 8 lanes where AVX-512 has 32 of 16: `kWideRegisters` says which, and
// each kernel sizes its tiles by it.
//
// Masks select lanes: `gt`, `eq`, `is_nan` make them, `select` and `keep` use them, and
// `bits` gives lane i as bit i.
#pragma once

#include <immintrin.h>

#include <cstdint>

// Before a loop over a register tile (a constant trip count): unrolled early, so that
// GCC keeps the tile's vectors in registers. Without it, the two-register vectors of AVX2
// were spilled to the stack on every step of a matmul's inner loop.
#define PAGELLM_UNROLL _Pragma("GCC unroll 16")

namespace pagellm_kernels::simd {

#if defined(__AVX512F__) && defined(__AVX512BW__)

constexpr bool kWideRegisters = true;
#define PAGELLM_WIDE_REGISTERS 1  // for code that exists in one of the two builds only

using vf = __m512;
using vi = __m512i;
using vmask = __mmask16;

inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf loadu(const float* p) { return _mm512_loadu_ps(p); }
inline vf load(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned
inline void storeu(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void store(float* p, vf v) { _mm512_store_ps(p, v); }  // 64-byte aligned

// v, which the compiler must hold in a register from here: reused operands are then
// loaded once, not folded into every instruction that reads them as a memory operand.
// By value: given an array element by reference, GCC kept the array in memory and stored
// the register back to it each time (the prefix kernel's passes stored 4 registers per
// dimension and per key). Without those stores, 1,536 rows x 1,024 keys on one thread
// went 117-118 -> 130-131 GFLOP/s; AVX-512 panels, 512 x 576 x 1,536 on 2 threads,
// 3.17-3.36 -> 2.80-3.19 ms.
inline vf in_register(vf v) {
  asm("" : "+v"(v));
  return v;
}

// One register: a vf here (see the AVX2 half).
using vreg = __m512;
constexpr int kRegisterLanes = 16;
constexpr int kRegisters = 32;
inline vreg zero_reg() { return _mm512_setzero_ps(); }
inline vreg load_reg(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned
inline vreg broadcast_reg(const float* p) { return _mm512_set1_ps(*p); }
// kLanes / kRegisterLanes registers as one vf.
inline vf join(const vreg* r) { return r[0]; }

inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
inline float reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(vf v) { return _mm512_reduce_max_ps(v); }
inline vf round_nearest(vf v) {
  return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// p * 2^n for whole numbers n in [-252, 252], rounded once.
inline vf scale_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }

inline vmask gt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline vmask eq(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline vmask is_nan(vf v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
inline vf select(vmask m, vf if_set, vf if_clear) { return _mm512_mask_mov_ps(if_clear, m, if_set); }
inline vf keep(vmask m, vf v) { return _mm512_maskz_mov_ps(m, v); }  // zero where clear
inline unsigned bits(vmask m) { return m; }
// Lanes 0 .. n - 1 (n in [0, 16]).
inline vmask first_lanes(int n) { return n >= 16 ? 0xFFFF : (1u << n) - 1; }
// The first n floats at p, zeros after them; nothing past p + n is read.
inline vf loadu_first(const float* p, int n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }
// 16 float16 (bits) at p as float32, exactly.
inline vf load_halves(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline vi set1_i(int32_t x) { return _mm512_set1_epi32(x); }
inline vi load_i(const int32_t* p) { return _mm512_load_si512(p); }  // 64-byte aligned
inline vi iota_i() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline vi add_i(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vi sub_i(vi a, vi b) { return _mm512_sub_epi32(a, b); }
inline vmask gt_i(vi a, vi b) { return _mm512_cmpgt_epi32_mask(a, b); }
inline vi select_i(vmask m, vi if_set, vi if_clear) {
  return _mm512_mask_mov_epi32(if_clear, m, if_set);
}
inline int32_t reduce_min_i(vmask m, vi v) { return _mm512_mask_reduce_min_epi32(m, v); }

// 16 int8 codes as floats.
inline vf from_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// 16 bytes' low nibbles and high nibbles as floats.
inline void from_nibbles(const uint8_t* p, vf& lo, vf& hi) {
  const __m512i v =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}

// Bytes, for the int8 matmul (int8_linear.cpp): a vi as 16 lanes of 4 bytes.
inline vi load_bytes(const uint8_t* p) { return _mm512_loadu_si512(p); }  // 64 bytes
inline vi low_nibbles(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline vi high_nibbles(vi v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
}
// The 4 bytes at p in every lane.
inline vi broadcast4(const int8_t* p) {
  int32_t word;
  __builtin_memcpy(&word, p, 4);
  return _mm512_set1_epi32(word);
}
// Integer dot products of 4 bytes a lane, unsigned weights w (at most 15) by signed x,
// summed: dot_add at most 8 times between dot_start and dot_finish, which gives int32
// lanes. With VNNI one instruction a step; without, pairs add up in int16 lanes (8 steps
// of 2 x 15 x 127 stay below 32,767) and are widened once. Both give the same integers.
inline vi dot_start() { return _mm512_setzero_si512(); }
#ifdef __AVX512VNNI__
inline vi dot_add(vi acc, vi w, vi x) { return _mm512_dpbusd_epi32(acc, w, x); }
inline vi dot_finish(vi acc) { return acc; }
#else
inline vi dot_add(vi acc, vi w, vi x) { return _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, x)); }
inline vi dot_finish(vi acc) { return _mm512_madd_epi16(acc, _mm512_set1_epi16(1)); }
#endif
// The same for signed weights (Q8_0's codes) by signed x, summed over any number of
// steps. With VNNI (kSignedDotOffset) the x codes must be stored offset by 128 (as
// unsigned bytes): vpdpbusd sums (x + 128) * w, and signed_dot_finish takes 128 x the
// weights' sum (signed_weight_sum, over the same steps) off. Without, each step
// multiplies |w| by x with w's sign (byte pairs at most 2 x 128 x 127) and widens at
// once. Both give the same integers.
#ifdef __AVX512VNNI__
constexpr bool kSignedDotOffset = true;
inline vi signed_dot_add(vi acc, vi w, vi x) { return _mm512_dpbusd_epi32(acc, x, w); }
inline vi signed_weight_sum(vi sum, vi w) {
  return _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), w);
}
inline vi signed_dot_finish(vi acc, vi weight_sum) {
  return _mm512_sub_epi32(acc, _mm512_slli_epi32(weight_sum, 7));
}
#else
constexpr bool kSignedDotOffset = false;
inline vi signed_dot_add(vi acc, vi w, vi x) {
  const vi signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  const vi pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(w), signed_x);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
inline vi signed_weight_sum(vi sum, vi) { return sum; }
inline vi signed_dot_finish(vi acc, vi) { return acc; }
#endif
inline vf to_float(vi v) { return _mm512_cvtepi32_ps(v); }
// 16 lanes rounded to the nearest whole number (ties to even) and saturated to int8.
inline void store_i8(int8_t* p, vf v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
}

// 16 lanes of `offset` 32-bit words on from each of rows[0..15] (floats, or pairs of
// bfloat16), transposed: out[j * stride + i] = word offset + j of rows[i], j < 16 (out
// and stride keep 64-byte alignment). Why: a tile of a few query rows (a decode's heads)
// takes its scores with keys in the lanes (attend_prefix), so its keys' dims must lie
// key by key in a register.
inline void transpose_words16(const void* const* rows, int64_t offset, float* out,
                              int64_t stride) {
  __m512 r[16], t[16];
  PAGELLM_UNROLL
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(static_cast<const float*>(rows[i]) + offset);
  // Within each 128-bit lane L: t[2i], t[2i + 1] interleave rows 2i and 2i + 1's words
  // 4L.. 4L + 1 and 4L + 2.. 4L + 3.
  PAGELLM_UNROLL
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // r[4g + c], lane L: word 4L + c of rows 4g .. 4g + 3.
  PAGELLM_UNROLL
  for (int g = 0; g < 4; ++g) {
    const auto pd = [](__m512 v) { return _mm512_castps_pd(v); };
    r[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * g]), pd(t[4 * g + 2])));
    r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * g]), pd(t[4 * g + 2])));
    r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * g + 1]), pd(t[4 * g + 3])));
    r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * g + 1]), pd(t[4 * g + 3])));
  }
  // Word 4L + c of all 16 rows: lane L of r[c], r[4 + c], r[8 + c], r[12 + c].
  PAGELLM_UNROLL
  for (int c = 0; c < 4; ++c) {
    const __m512 a0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44);
    const __m512 a1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
    const __m512 b0 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
    const __m512 b1 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
    _mm512_store_ps(out + c * stride, _mm512_shuffle_f32x4(a0, b0, 0x88));
    _mm512_store_ps(out + (4 + c) * stride, _mm512_shuffle_f32x4(a0, b0, 0xDD));
    _mm512_store_ps(out + (8 + c) * stride, _mm512_shuffle_f32x4(a1, b1, 0x88));
    _mm512_store_ps(out + (12 + c) * stride, _mm512_shuffle_f32x4(a1, b1, 0xDD));
  }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

constexpr bool kWideRegisters = false;
#define PAGELLM_WIDE_REGISTERS 0

struct vf {
  __m256 lo, hi;
};
struct vi {
  __m256i lo, hi;
};
struct vmask {
  __m256 lo, hi;  // all ones where set
};

inline vf zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vf loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline vf load(const float* p) { return {_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
inline void storeu(float* p, vf v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline void store(float* p, vf v) {
  _mm256_store_ps(p, v.lo);
  _mm256_store_ps(p + 8, v.hi);
}

// v, held in registers from here (see the AVX-512 half).
inline vf in_register(vf v) {
  asm("" : "+x"(v.lo), "+x"(v.hi));
  return v;
}

// One register, for a kernel whose register tile must count registers, not vfs: a tile
// that fits only when a vf's two halves need not be held at once (each weight register
// is loaded, used by every row, and dropped).
using vreg = __m256;
constexpr int kRegisterLanes = 8;
constexpr int kRegisters = 16;
inline vreg zero_reg() { return _mm256_setzero_ps(); }
inline vreg load_reg(const float* p) { return _mm256_load_ps(p); }  // 32-byte aligned
inline vreg broadcast_reg(const float* p) { return _mm256_broadcast_ss(p); }
inline vf join(const vreg* r) { return {r[0], r[1]}; }
inline vreg in_register(vreg v) {
  asm("" : "+x"(v));
  return v;
}
inline vreg fmadd(vreg a, vreg b, vreg c) { return _mm256_fmadd_ps(a, b, c); }
inline void store(float* p, vreg v) { _mm256_store_ps(p, v); }  // 32-byte aligned
inline void storeu(float* p, vreg v) { _mm256_storeu_ps(p, v); }
inline vreg loadu_reg(const float* p) { return _mm256_loadu_ps(p); }
inline vreg mul(vreg a, vreg b) { return _mm256_mul_ps(a, b); }
// p[j] = the sum of register j's lanes, for four registers at once: 7 instructions where
// four separate horizontal sums take 20.
inline void store_sums4(float* p, vreg a, vreg b, vreg c, vreg d) {
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(p, _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)));
}

inline vf add(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf sub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf mul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf div(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf fmadd(vf a, vf b, vf c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline vf fnmadd(vf a, vf b, vf c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline vf max(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf min(vf a, vf b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline float reduce_add(vf v) {
  const __m256 s = _mm256_add_ps(v.lo, v.hi);
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline float reduce_max(vf v) {
  const __m256 s = _mm256_max_ps(v.lo, v.hi);
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline vf round_nearest(vf v) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(v.lo, kMode), _mm256_round_ps(v.hi, kMode)};
}
// p * 2^n for whole numbers n in [-252, 252], rounded once: n is split into two halves
// whose powers of two are normal floats, and p * 2^(first half) is exact for the p that
// exp() gives (near 1), so only the second product rounds.
inline __m256 scale_pow2_8(__m256 p, __m256 n) {
  const __m256i whole = _mm256_cvtps_epi32(n);
  const __m256i first = _mm256_srai_epi32(whole, 1);
  const __m256i second = _mm256_sub_epi32(whole, first);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(first, bias), 23));
  const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(second, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}
inline vf scale_pow2(vf p, vf n) { return {scale_pow2_8(p.lo, n.lo), scale_pow2_8(p.hi, n.hi)}; }

inline vmask gt(vf a, vf b) {
  return {_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)};
}
inline vmask eq(vf a, vf b) {
  return {_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ)};
}
inline vmask is_nan(vf v) {
  return {_mm256_cmp_ps(v.lo, v.lo, _CMP_UNORD_Q), _mm256_cmp_ps(v.hi, v.hi, _CMP_UNORD_Q)};
}
inline vf select(vmask m, vf if_set, vf if_clear) {
  return {_mm256_blendv_ps(if_clear.lo, if_set.lo, m.lo),
          _mm256_blendv_ps(if_clear.hi, if_set.hi, m.hi)};
}
inline vf keep(vmask m, vf v) { return {_mm256_and_ps(m.lo, v.lo), _mm256_and_ps(m.hi, v.hi)}; }
inline unsigned bits(vmask m) {
  return static_cast<unsigned>(_mm256_movemask_ps(m.lo)) |
         static_cast<unsigned>(_mm256_movemask_ps(m.hi)) << 8;
}

inline vi set1_i(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline vi load_i(const int32_t* p) {
  return {_mm256_load_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 8))};
}
inline vi iota_i() {
  return {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};
}
inline vi add_i(vi a, vi b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline vi sub_i(vi a, vi b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
inline vmask gt_i(vi a, vi b) {
  return {_mm256_castsi256_ps(_mm256_cmpgt_epi32(a.lo, b.lo)),
          _mm256_castsi256_ps(_mm256_cmpgt_epi32(a.hi, b.hi))};
}
inline vi select_i(vmask m, vi if_set, vi if_clear) {
  const auto blend = [](__m256i clear, __m256i set, __m256 mask) {
    return _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(clear), _mm256_castsi256_ps(set), mask));
  };
  return {blend(if_clear.lo, if_set.lo, m.lo), blend(if_clear.hi, if_set.hi, m.hi)};
}
inline int32_t reduce_min_i(vmask m, vi v) {
  alignas(32) int32_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v.lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 8), v.hi);
  const unsigned set = bits(m);
  int32_t best = INT32_MAX;
  for (int i = 0; i < 16; ++i) {
    if ((set >> i & 1u) != 0 && lanes[i] < best) best = lanes[i];
  }
  return best;
}
// Lanes 0 .. n - 1 (n in [0, 16]).
inline vmask first_lanes(int n) { return gt_i(set1_i(n), iota_i()); }
// The first n floats at p, zeros after them; nothing past p + n is read.
inline vf loadu_first(const float* p, int n) {
  const vmask m = first_lanes(n);
  return {_mm256_maskload_ps(p, _mm256_castps_si256(m.lo)),
          _mm256_maskload_ps(p + 8, _mm256_castps_si256(m.hi))};
}

// 16 float16 (bits) at p as float32, exactly (F16C, which every AVX2 CPU has).
inline vf load_halves(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
// 16 int8 codes as floats.
inline vf from_i8(const int8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)))};
}
// 16 bytes' low nibbles and high nibbles as floats.
inline void from_nibbles(const uint8_t* p, vf& lo, vf& hi) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i a = _mm256_cvtepu8_epi32(v);
  const __m256i b = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(v, v));
  const __m256i low = _mm256_set1_epi32(0xF);
  lo = {_mm256_cvtepi32_ps(_mm256_and_si256(a, low)), _mm256_cvtepi32_ps(_mm256_and_si256(b, low))};
  hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
}

// Bytes, for the int8 matmul (see the AVX-512 half).
inline vi load_bytes(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline vi low_nibbles(vi v) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(v.lo, m), _mm256_and_si256(v.hi, m)};
}
inline vi high_nibbles(vi v) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(v.lo, 4), m),
          _mm256_and_si256(_mm256_srli_epi16(v.hi, 4), m)};
}
inline vi broadcast4(const int8_t* p) {
  int32_t word;
  __builtin_memcpy(&word, p, 4);
  const __m256i v = _mm256_set1_epi32(word);
  return {v, v};
}
inline vi dot_start() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline vi dot_add(vi acc, vi w, vi x) {
  return {_mm256_add_epi16(acc.lo, _mm256_maddubs_epi16(w.lo, x.lo)),
          _mm256_add_epi16(acc.hi, _mm256_maddubs_epi16(w.hi, x.hi))};
}
inline vi dot_finish(vi acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_madd_epi16(acc.lo, ones), _mm256_madd_epi16(acc.hi, ones)};
}
constexpr bool kSignedDotOffset = false;
inline vi signed_dot_add(vi acc, vi w, vi x) {
  const __m256i ones = _mm256_set1_epi16(1);
  const auto half = [&](__m256i a, __m256i wv, __m256i xv) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
    return _mm256_add_epi32(a, _mm256_madd_epi16(pairs, ones));
  };
  return {half(acc.lo, w.lo, x.lo), half(acc.hi, w.hi, x.hi)};
}
inline vi signed_weight_sum(vi sum, vi) { return sum; }
inline vi signed_dot_finish(vi acc, vi) { return acc; }
inline vf to_float(vi v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
inline void store_i8(int8_t* p, vf v) {
  // packs interleave 128-bit halves: lanes 0-3, 8-11, 4-7, 12-15 after the two packs
  const __m256i words = _mm256_packs_epi32(_mm256_cvtps_epi32(v.lo), _mm256_cvtps_epi32(v.hi));
  const __m256i bytes = _mm256_packs_epi16(words, words);
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(ordered));
}

// transpose_words16 (see the AVX-512 half) as four 8 x 8 transposes.
inline void transpose_words16(const void* const* rows, int64_t offset, float* out,
                              int64_t stride) {
  PAGELLM_UNROLL
  for (int rb = 0; rb < 16; rb += 8) {
    PAGELLM_UNROLL
    for (int wb = 0; wb < 16; wb += 8) {
      __m256 r[8], t[8], u[8];
      PAGELLM_UNROLL
      for (int i = 0; i < 8; ++i) {
        r[i] = _mm256_loadu_ps(static_cast<const float*>(rows[rb + i]) + offset + wb);
      }
      // Within each 128-bit half h: t[2i] and t[2i + 1] interleave rows 2i and 2i + 1's
      // words 4h.. 4h + 1 and 4h + 2.. 4h + 3.
      PAGELLM_UNROLL
      for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
      }
      // u[4g + c], half h: word 4h + c of rows 4g .. 4g + 3.
      PAGELLM_UNROLL
      for (int g = 0; g < 2; ++g) {
        u[4 * g] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
        u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
        u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
        u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
      }
      PAGELLM_UNROLL
      for (int c = 0; c < 4; ++c) {
        _mm256_store_ps(out + (wb + c) * stride + rb, _mm256_permute2f128_ps(u[c], u[4 + c], 0x20));
        _mm256_store_ps(out + (wb + 4 + c) * stride + rb,
                        _mm256_permute2f128_ps(u[c], u[4 + c], 0x31));
      }
    }
  }
}

#else
#error "the CPU kernels need AVX-512 (F and BW) or AVX2 with FMA and F16C"
#endif

}  // namespace pagellm_kernels::simd
