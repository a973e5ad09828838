// Vector math shared by the kernels (AVX-512).
#pragma once

#include <immintrin.h>

namespace pagellm_kernels {

// exp(x) for 16 floats: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for
// exp(r), scaled by 2^n. Accurate to about 2 ulp; exp(-inf) = 0 (masked scores).
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-103.0f);
  const __m512 hi = _mm512_set1_ps(88.7f);
  const __m512 clamped = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 n = _mm512_roundscale_ps(
      _mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), clamped);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512 result = _mm512_scalef_ps(p, n);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GT_OQ), result);
}

// silu(gate) * up for 16 lanes, silu(g) = g / (1 + exp(-g)): one definition, so the
// matmul's fused epilogue and the standalone op round alike.
inline __m512 silu_mul16(__m512 gate, __m512 up) {
  const __m512 silu = _mm512_div_ps(
      gate, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
  return _mm512_mul_ps(silu, up);
}

}  // namespace pagellm_kernels
