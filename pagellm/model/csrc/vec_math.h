// Vector math shared by the kernels, on the 16-lane vectors of simd.h.
#pragma once

#include "simd.h"

namespace pagellm_kernels {

// exp(x) for 16 floats: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for
// exp(r), scaled by 2^n. Accurate to about 2 ulp; exp(-inf) = 0 (masked scores).
inline simd::vf exp16(simd::vf x) {
  using namespace simd;
  const vf lo = set1(-103.0f);
  const vf hi = set1(88.7f);
  const vf clamped = min(max(x, lo), hi);
  const vf n = round_nearest(mul(clamped, set1(1.44269504088896341f)));
  vf r = fnmadd(n, set1(0.693145751953125f), clamped);
  r = fnmadd(n, set1(1.428606765330187045e-06f), r);
  vf p = set1(1.0f / 720);
  p = fmadd(p, r, set1(1.0f / 120));
  p = fmadd(p, r, set1(1.0f / 24));
  p = fmadd(p, r, set1(1.0f / 6));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.0f));
  p = fmadd(p, r, set1(1.0f));
  return keep(gt(x, lo), scale_pow2(p, n));
}

// silu(gate) * up for 16 lanes, silu(g) = g / (1 + exp(-g)): one definition, so the
// matmul's fused epilogue and the standalone op round alike.
inline simd::vf silu_mul16(simd::vf gate, simd::vf up) {
  using namespace simd;
  const vf silu = div(gate, add(set1(1.0f), exp16(sub(zero(), gate))));
  return mul(silu, up);
}

}  // namespace pagellm_kernels
