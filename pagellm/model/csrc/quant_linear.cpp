// y = x @ W.T for a weight kept in a GGUF block format, dequantised in registers: a
// decode step streams 5 (Q4_1) or 9 (Q8_0) bits per weight from memory instead of 32.
//
// Exactness: each weight is rebuilt with the same float32 roundings as the GGUF reader's
// dequantisation: Q4_1 (scale * code) + min as a separate multiply and add (this file is
// compiled with -ffp-contract=off), Q8_0 scale * code (exact). So the kernel multiplies
// by the float32 weights bit for bit; only the order of the dot product's additions
// differs from another GEMM's.
//
// Packed layouts (built by quant_kernels.py): output rows in tiles of 16 lanes, then per
// (tile, block of 32 inputs):
//   Q4_1: scales[16], mins[16] float32; codes[16][16] bytes, byte j of lane n holding
//         input j in its low nibble and input j + 16 in its high one;
//   Q8_0: scales[16] float32; codes[32][16] int8, input j of lane n.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "the quantized matmul kernels need AVX-512 (F and BW)"
#endif

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 32;
constexpr int64_t kMaxRows = 8;  // rows whose accumulators stay in registers per pass

struct Q4_1 {
  static constexpr int64_t kCodeBytes = kLanes * kLanes;

  // Inputs j and j + 16 go to separate accumulators: twice the independent FMA chains
  // (one row alone would otherwise wait on each FMA's latency) and shorter sums.
  template <int R>
  static void block(const float* xb, int64_t ldx, const float* scales, const float* mins,
                    const uint8_t* q, __m512* acc_a, __m512* acc_b) {
    const __m512 d = _mm512_loadu_ps(scales);
    const __m512 m = _mm512_loadu_ps(mins);
    const __m512i low = _mm512_set1_epi32(0xF);
    for (int j = 0; j < 16; ++j) {
      const __m512i v = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * kLanes)));
      const __m512 w_lo = _mm512_add_ps(
          _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(v, low))), m);
      const __m512 w_hi = _mm512_add_ps(
          _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4))), m);
      for (int r = 0; r < R; ++r) {
        acc_a[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + j]), w_lo, acc_a[r]);
        acc_b[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + j + 16]), w_hi, acc_b[r]);
      }
    }
  }
};

struct Q8_0 {
  static constexpr int64_t kCodeBytes = kBlock * kLanes;

  // Even and odd inputs go to separate accumulators (see Q4_1).
  template <int R>
  static void block(const float* xb, int64_t ldx, const float* scales, const float*,
                    const uint8_t* q, __m512* acc_a, __m512* acc_b) {
    const __m512 d = _mm512_loadu_ps(scales);
    for (int j = 0; j < 32; j += 2) {
      const __m512 w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * kLanes)))));
      const __m512 w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (j + 1) * kLanes)))));
      for (int r = 0; r < R; ++r) {
        acc_a[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + j]), w0, acc_a[r]);
        acc_b[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + j + 1]), w1, acc_b[r]);
      }
    }
  }
};

// R rows of x against one tile of 16 output rows: y[r, 0:16] over every input block.
template <class Format, int R>
void tile(const float* x, int64_t ldx, int64_t blocks, const float* scales,
          const float* mins, const uint8_t* codes, float* y, int64_t ldy) {
  __m512 acc_a[R], acc_b[R];
  for (int r = 0; r < R; ++r) acc_a[r] = acc_b[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    Format::template block<R>(x + b * kBlock, ldx, scales + b * kLanes,
                              mins == nullptr ? nullptr : mins + b * kLanes,
                              codes + b * Format::kCodeBytes, acc_a, acc_b);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, _mm512_add_ps(acc_a[r], acc_b[r]));
}

using TileFn = void (*)(const float*, int64_t, int64_t, const float*, const float*,
                        const uint8_t*, float*, int64_t);

template <class Format>
constexpr TileFn kTiles[kMaxRows] = {tile<Format, 1>, tile<Format, 2>, tile<Format, 3>,
                                     tile<Format, 4>, tile<Format, 5>, tile<Format, 6>,
                                     tile<Format, 7>, tile<Format, 8>};

template <class Format>
at::Tensor quantized_linear(const char* name, const at::Tensor& x, const at::Tensor& scales,
                            const float* mins, const at::Tensor& codes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), name,
              ": x must be a contiguous float32 [rows, in] tensor");
  TORCH_CHECK(scales.dim() == 3 && scales.size(2) == kLanes && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat,
              name, ": scales must be float32 [tiles, blocks, 16]");
  TORCH_CHECK(codes.size(0) == scales.size(0) && codes.size(1) == scales.size(1) &&
                  codes.numel() == scales.numel() / kLanes * Format::kCodeBytes &&
                  codes.is_contiguous() && codes.element_size() == 1,
              name, ": codes do not match the scales");
  const int64_t tiles = scales.size(0), blocks = scales.size(1);
  const int64_t rows = x.size(0), in = x.size(1), out = tiles * kLanes;
  TORCH_CHECK(in == blocks * kBlock, name, ": x has ", in, " inputs, the weight ",
              blocks * kBlock);
  at::Tensor y = at::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* sp = scales.data_ptr<float>();
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  float* yp = y.data_ptr<float>();
  const int64_t tile_scales = blocks * kLanes, tile_codes = blocks * Format::kCodeBytes;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
        const int64_t n = std::min(kMaxRows, rows - r0);
        kTiles<Format>[n - 1](xp + r0 * in, in, blocks, sp + t * tile_scales,
                              mins == nullptr ? nullptr : mins + t * tile_scales,
                              cp + t * tile_codes, yp + r0 * out + t * kLanes, out);
      }
    }
  });
  return y;
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& scales, const at::Tensor& mins,
                       const at::Tensor& codes) {
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.is_contiguous() &&
                  mins.scalar_type() == at::kFloat,
              "q4_1_linear: mins must match scales");
  TORCH_CHECK(codes.scalar_type() == at::kByte, "q4_1_linear: codes must be uint8");
  return quantized_linear<Q4_1>("q4_1_linear", x, scales, mins.data_ptr<float>(), codes);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& scales, const at::Tensor& codes) {
  TORCH_CHECK(codes.scalar_type() == at::kChar, "q8_0_linear: codes must be int8");
  return quantized_linear<Q8_0>("q8_0_linear", x, scales, nullptr, codes);
}

}  // namespace

TORCH_LIBRARY(pagellm, m) {
  m.def("q4_1_linear(Tensor x, Tensor scales, Tensor mins, Tensor codes) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor scales, Tensor codes) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("q4_1_linear", &q4_1_linear);
  m.impl("q8_0_linear", &q8_0_linear);
}
