// y = x @ W.T for a weight kept in GGUF's Q4_1 form (4-bit codes, a float scale and
// minimum per 32 inputs), dequantised in registers: a decode step streams 5 bits per
// weight from memory instead of 32.
//
// Exactness: each weight is rebuilt as (scale * code) + min with a separate multiply and
// add (this file is compiled with -ffp-contract=off), the same two roundings as the GGUF
// reader's dequantisation, so it equals the float32 weight bit for bit. Only the order
// of the dot product's additions differs from another GEMM's.
//
// Packed layout (see quant_linear.py, which builds it): output rows in tiles of 16 lanes;
// per (tile, block of 32 inputs): scales[16], mins[16] as float32 and codes[16][16] bytes,
// byte j of lane n holding input j in its low nibble and input j + 16 in its high one.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "the Q4_1 kernel needs AVX-512 (F and BW)"
#endif

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 32;
constexpr int64_t kMaxRows = 8;  // accumulators kept in registers per pass

template <int R>
void tile(const float* x, int64_t ldx, int64_t blocks, const float* scales,
          const float* mins, const uint8_t* codes, float* y, int64_t ldy) {
  // Inputs j and j + 16 go to separate accumulators: twice the independent FMA chains
  // (one row alone would otherwise wait on each FMA's latency) and shorter sums.
  __m512 acc_lo[R], acc_hi[R];
  for (int r = 0; r < R; ++r) acc_lo[r] = acc_hi[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(0xF);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 d = _mm512_loadu_ps(scales + b * kLanes);
    const __m512 m = _mm512_loadu_ps(mins + b * kLanes);
    const uint8_t* q = codes + b * kLanes * kLanes;
    const float* xb = x + b * kBlock;
    for (int j = 0; j < 16; ++j) {
      const __m512i v = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * kLanes)));
      const __m512 w_lo = _mm512_add_ps(
          _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(v, low))), m);
      const __m512 w_hi = _mm512_add_ps(
          _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4))), m);
      for (int r = 0; r < R; ++r) {
        acc_lo[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + j]), w_lo, acc_lo[r]);
        acc_hi[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + j + 16]), w_hi, acc_hi[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, _mm512_add_ps(acc_lo[r], acc_hi[r]));
}

using TileFn = void (*)(const float*, int64_t, int64_t, const float*, const float*,
                        const uint8_t*, float*, int64_t);
constexpr TileFn kTiles[kMaxRows] = {tile<1>, tile<2>, tile<3>, tile<4>,
                                     tile<5>, tile<6>, tile<7>, tile<8>};

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& scales, const at::Tensor& mins,
                       const at::Tensor& codes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "q4_1_linear: x must be a contiguous float32 [rows, in] tensor");
  TORCH_CHECK(scales.dim() == 3 && scales.size(2) == kLanes && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat,
              "q4_1_linear: scales must be float32 [tiles, blocks, 16]");
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.is_contiguous() &&
                  mins.scalar_type() == at::kFloat,
              "q4_1_linear: mins must match scales");
  TORCH_CHECK(codes.dim() == 4 && codes.size(0) == scales.size(0) &&
                  codes.size(1) == scales.size(1) && codes.size(2) == kLanes &&
                  codes.size(3) == kLanes && codes.is_contiguous() &&
                  codes.scalar_type() == at::kByte,
              "q4_1_linear: codes must be uint8 [tiles, blocks, 16, 16]");
  const int64_t tiles = scales.size(0), blocks = scales.size(1);
  const int64_t rows = x.size(0), in = x.size(1), out = tiles * kLanes;
  TORCH_CHECK(in == blocks * kBlock, "q4_1_linear: x has ", in, " inputs, the weight ",
              blocks * kBlock);
  at::Tensor y = at::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t tile_scales = blocks * kLanes, tile_codes = blocks * kLanes * kLanes;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
        const int64_t n = std::min(kMaxRows, rows - r0);
        kTiles[n - 1](xp + r0 * in, in, blocks, sp + t * tile_scales, mp + t * tile_scales,
                      cp + t * tile_codes, yp + r0 * out + t * kLanes, out);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(pagellm, m) {
  m.def("q4_1_linear(Tensor x, Tensor scales, Tensor mins, Tensor codes) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagellm, CPU, m) { m.impl("q4_1_linear", &q4_1_linear); }
