// Small per-token operations of a decoder layer fused into one pass each: RMSNorm (with
// the residual add before it), the gated MLP's silu(gate) * up, and the rotary embedding
// of q and k in place.
//
// Why: at decode batch sizes each of these is a handful of torch ops on a few KB, and a
// step runs ~40 of them per layer, each paying dispatch and thread-pool wake-up; the
// arithmetic itself is negligible. Rounding follows the reference order of operations
// (normalise in float32, then scale; x * cos + rotated * sin as two products and a sum);
// sums of squares and exp() round differently from torch's by an ulp or so.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "vec_math.h"

#include <cmath>
#include <limits>
#include <tuple>

namespace {

using namespace pagellm_kernels::simd;
using pagellm_kernels::silu_mul16;

// Rows per parallel task: small batches stay on one thread (waking the pool costs more
// than the work).
constexpr int64_t kRowGrain = 16;

void check_rows(const char* name, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), name,
              ": expected a contiguous float32 [rows, n] tensor");
}

void norm_row(const float* x, const float* w, float eps, int64_t n, float* out) {
  vf acc = zero();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const vf v = loadu(x + i);
    acc = fmadd(v, v, acc);
  }
  float sum = reduce_add(acc);
  for (; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows("rms_norm", x);
  const int64_t n = x.size(1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "rms_norm: weight must be float32 [", n, "]");
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row(xp + r * n, wp, static_cast<float>(eps), n, op + r * n);
    }
  });
  return out;
}

// residual + x, and the RMSNorm of that sum: the decoder's "add, then normalise".
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows("add_rms_norm", x);
  check_rows("add_rms_norm", residual);
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x and residual differ in shape");
  const int64_t n = x.size(1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "add_rms_norm: weight must be float32 [", n, "]");
  at::Tensor sum = at::empty_like(x);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < n; ++i) sp[r * n + i] = rp[r * n + i] + xp[r * n + i];
      norm_row(sp + r * n, wp, static_cast<float>(eps), n, op + r * n);
    }
  });
  return {out, sum};
}

// gate_up [rows, 2I] -> silu(gate) * up [rows, I], silu(g) = g / (1 + exp(-g)).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows("silu_mul", gate_up);
  const int64_t width = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * width && width % 16 == 0,
              "silu_mul: the width must be 2 x a multiple of 16");
  at::Tensor out = at::empty({gate_up.size(0), width}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, gate_up.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * 2 * width;
      const float* u = g + width;
      for (int64_t i = 0; i < width; i += 16) {
        storeu(op + r * width + i, silu_mul16(loadu(g + i), loadu(u + i)));
      }
    }
  });
  return out;
}

// Rotates, in place, the first `heads` head vectors of each row of `qkv` [rows, width]
// (q then k heads of head_dim each, rotate-half layout) by the row's cos/sin [rows, D].
void rotary_(at::Tensor qkv, int64_t heads, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows("rotary_", qkv);
  check_rows("rotary_", cos);
  check_rows("rotary_", sin);
  const int64_t dim = cos.size(1), half = dim / 2;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == qkv.size(0) && dim % 2 == 0 &&
                  heads * dim <= qkv.size(1),
              "rotary_: shapes do not match");
  float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t width = qkv.size(1);
  at::parallel_for(0, qkv.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + r * dim;
      const float* s = sp + r * dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = xp + r * width + h * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          x[i] = a * c[i] + (-b) * s[i];
          x[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

// The index of a row's largest value by torch.argmax's rules: the lowest index on ties, and
// the first NaN if there is one (NaN counts as the largest).
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float top = -std::numeric_limits<float>::infinity();  // a row of -inf: index 0
  if (n >= 16) {
    // Each lane keeps its largest value and where it first saw it.
    vf lane_top = loadu(x);
    vi lane_at = iota_i();
    unsigned nan = bits(is_nan(lane_top));
    vi at = lane_at;
    for (i = 16; nan == 0 && i + 16 <= n; i += 16) {
      const vf v = loadu(x + i);
      at = add_i(at, set1_i(16));
      nan = bits(is_nan(v));
      const vmask greater = gt(v, lane_top);
      lane_top = select(greater, v, lane_top);
      lane_at = select_i(greater, at, lane_at);
    }
    if (nan != 0) return i - 16 + __builtin_ctz(nan);
    top = reduce_max(lane_top);
    best = reduce_min_i(eq(lane_top, set1(top)), lane_at);
  }
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > top) {
      top = x[i];
      best = i;
    }
  }
  return best;
}

// x [rows, n] -> the index of each row's largest value [rows] (int64), as torch.argmax.
// Why: torch's CPU argmax runs ~0.9 ms on a decode step's [32, 49152] logits, its max 0.05.
at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows("argmax_rows", x);
  const int64_t n = x.size(1);
  TORCH_CHECK(n >= 1, "argmax_rows: rows must not be empty");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) qkv, int heads, Tensor cos, Tensor sin) -> ()");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary_", &rotary_);
  m.impl("argmax_rows", &argmax_rows);
}
