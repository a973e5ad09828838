// y = x @ W.T for a Q4_1 weight with the activations quantized to int8 (the opt-in
// EngineConfig.quantize_activations): each row's 32 inputs of a block become 32 int8
// codes and a scale (their largest magnitude / 127), and the block's products are summed
// in integers, as llama.cpp and vLLM's GGUF kernels do (Q8_1 activations).
//
// Why: the float32 kernels (quant_linear.cpp) run at the CPU's FMA rate, 16 products an
// instruction with AVX-512; an integer dot-product instruction (VNNI) makes 64. On this
// project's AMD machine (AVX-512 on 256-bit units), one thread: float32 117 GFLOP/s
// against 320-330 GOP/s here, with the nibbles unpacked and every block's scaling paid.
//
// Per row and block, with the weight's scale d and min m per output lane, and the row's
// int8 codes q (scale s) and float32 sum of its 32 inputs:
//     acc = fma(float(sum of code * q), d * s, acc);  acc = fma(m, sum of inputs, acc)
// The integer sum is exact, and these float32 steps are the same for a row whatever rows
// share its pass, whatever instruction set: a row's result never depends on its batch
// (tested), which the float32 kernels' few-row tiles cannot promise. Its error against
// the float32 product is the activations' rounding to int8 (at most half a step of 1/127
// of the block's largest input), the min's term is exact in float32.
//
// Codes layout (quant_kernels.int8_activation_layout), per (tile of 16 output lanes,
// block of 32 inputs): 4 groups of 64 bytes; in group g, byte 4n + i holds lane n's code
// of input 4g + i in its low nibble and of input 16 + 4g + i in its high one. So the low
// nibbles of group g pair with the row's inputs 4g..4g+3 as one 32-bit lane of 4 bytes,
// the high ones with 16 + 4g.., which are again 4 bytes in a row of the row's codes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "parallel.h"
#include "vec_math.h"

#include <algorithm>
#include <array>
#include <utility>

namespace {

using namespace pagellm_kernels::simd;
using pagellm_kernels::for_each_task;
using pagellm_kernels::silu_mul16;

constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 32;
constexpr int64_t kCodeBytes = kLanes * kBlock / 2;  // a tile's block of nibbles
constexpr int kGroups = 8;  // of 4 inputs in a block
// Rows per pass against a pair of tiles: with AVX-512, 12 int32 sums and 12 float32
// accumulators beside 2 weight registers; with AVX2 (two registers a vector) 2 rows.
constexpr int kPassRows = kWideRegisters ? 6 : 2;
// Rows per task: a task's rows (their codes, 48 x 1,536 = 72 KB) stay in L2 while its
// passes run, and a 512-token step makes tasks enough for the threads to share evenly.
constexpr int64_t kChunkRows = 8 * kPassRows;

// The rows of x as int8 codes, block-major ([blocks][rows][32]: a pass's rows of a block
// are one fixed stride apart), with each row's scale and sum of inputs per block
// ([blocks][rows]).
struct QuantizedRows {
  const int8_t* codes;
  const float* scales;
  const float* sums;
  int64_t rows;
};

// Rows [begin, end) of x [rows, in] into a QuantizedRows' buffers.
void quantize_rows(const float* x, int64_t in, int64_t begin, int64_t end, int8_t* codes,
                   float* scales, float* sums, int64_t rows) {
  const int64_t blocks = in / kBlock;
  for (int64_t r = begin; r < end; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* p = x + r * in + b * kBlock;
      const vf a = loadu(p), c = loadu(p + kLanes);
      const float amax = reduce_max(max(max(a, sub(zero(), a)), max(c, sub(zero(), c))));
      // (NaN inputs give no positive amax: codes of 0, and the sum carries the NaN.)
      const vf inv = set1(amax > 0.0f ? 127.0f / amax : 0.0f);
      int8_t* q = codes + (b * rows + r) * kBlock;
      store_i8(q, mul(a, inv));
      store_i8(q + kLanes, mul(c, inv));
      scales[b * rows + r] = amax / 127.0f;
      sums[b * rows + r] = reduce_add(add(a, c));
    }
  }
}

// R rows from `r0` against T tiles (T = 2: a pair, which is (gate, up) when gated), over
// every block: y[r, 0 : 16 T] (gated: silu(gate) * up, y[r, 0:16]).
template <int R, int T>
void pass(const QuantizedRows& x, int64_t r0, int64_t blocks, const float* scales,
          const float* mins, const uint8_t* codes, float* y, int64_t ldy, bool gated) {
  const int64_t tile_scales = blocks * kLanes, tile_codes = blocks * kCodeBytes;
  vf acc[R][T];
  PAGELLM_UNROLL
  for (int r = 0; r < R; ++r) {
    PAGELLM_UNROLL
    for (int t = 0; t < T; ++t) acc[r][t] = zero();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* xb = x.codes + (b * x.rows + r0) * kBlock;
    const uint8_t* cb = codes + b * kCodeBytes;
    vi sum[R][T];
    PAGELLM_UNROLL
    for (int r = 0; r < R; ++r) {
      PAGELLM_UNROLL
      for (int t = 0; t < T; ++t) sum[r][t] = dot_start();
    }
    PAGELLM_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      vi w[T];
      PAGELLM_UNROLL
      for (int t = 0; t < T; ++t) {
        const vi packed = load_bytes(cb + t * tile_codes + (g % 4) * 64);
        w[t] = g < 4 ? low_nibbles(packed) : high_nibbles(packed);
      }
      PAGELLM_UNROLL
      for (int r = 0; r < R; ++r) {
        const vi xv = broadcast4(xb + r * kBlock + 4 * g);
        PAGELLM_UNROLL
        for (int t = 0; t < T; ++t) sum[r][t] = dot_add(sum[r][t], w[t], xv);
      }
    }
    PAGELLM_UNROLL
    for (int t = 0; t < T; ++t) {
      const vf d = loadu(scales + t * tile_scales + b * kLanes);
      const vf m = loadu(mins + t * tile_scales + b * kLanes);
      PAGELLM_UNROLL
      for (int r = 0; r < R; ++r) {
        const int64_t at = b * x.rows + r0 + r;
        acc[r][t] = fmadd(to_float(dot_finish(sum[r][t])), mul(d, set1(x.scales[at])),
                          acc[r][t]);
        acc[r][t] = fmadd(m, set1(x.sums[at]), acc[r][t]);
      }
    }
  }
  PAGELLM_UNROLL
  for (int r = 0; r < R; ++r) {
    if constexpr (T == 2) {
      if (gated) {
        storeu(y + r * ldy, silu_mul16(acc[r][0], acc[r][1]));
        continue;
      }
    }
    PAGELLM_UNROLL
    for (int t = 0; t < T; ++t) storeu(y + r * ldy + t * kLanes, acc[r][t]);
  }
}

using PassFn = void (*)(const QuantizedRows&, int64_t, int64_t, const float*, const float*,
                        const uint8_t*, float*, int64_t, bool);

template <int T, std::size_t... R>
constexpr std::array<PassFn, sizeof...(R)> pass_table(std::index_sequence<R...>) {
  return {pass<R + 1, T>...};
}

// [T - 1][rows - 1]
constexpr std::array<std::array<PassFn, kPassRows>, 2> kPasses = {
    pass_table<1>(std::make_index_sequence<kPassRows>()),
    pass_table<2>(std::make_index_sequence<kPassRows>())};

at::Tensor q4_1_int8_linear(const at::Tensor& x, const at::Tensor& scales, const at::Tensor& mins,
                            const at::Tensor& codes, bool gated) {
  constexpr const char* name = "q4_1_int8_linear";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), name,
              ": x must be a contiguous float32 [rows, in] tensor");
  TORCH_CHECK(scales.dim() == 3 && scales.size(2) == kLanes && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat,
              name, ": scales must be float32 [tiles, blocks, 16]");
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.is_contiguous() &&
                  mins.scalar_type() == at::kFloat,
              name, ": mins must match scales");
  TORCH_CHECK(codes.dim() == 4 && codes.size(0) == scales.size(0) &&
                  codes.size(1) == scales.size(1) && codes.size(2) == 4 && codes.size(3) == 64 &&
                  codes.is_contiguous() && codes.scalar_type() == at::kByte,
              name, ": codes must be uint8 [tiles, blocks, 4, 64] (the int8 layout)");
  const int64_t tiles = scales.size(0), blocks = scales.size(1);
  const int64_t rows = x.size(0), in = x.size(1), out = tiles * kLanes;
  TORCH_CHECK(in == blocks * kBlock, name, ": x has ", in, " inputs, the weight ",
              blocks * kBlock);
  TORCH_CHECK(blocks > 0, name, ": a weight needs at least one block of inputs");
  TORCH_CHECK(!gated || tiles % 2 == 0, name, ": a gated weight has (gate, up) pairs of tiles");
  const int64_t width = gated ? out / 2 : out;
  at::Tensor y = at::empty({rows, width}, x.options());
  if (rows == 0) return y;
  at::Tensor q = at::empty({rows * in}, x.options().dtype(at::kChar));
  at::Tensor row_scales = at::empty({2, blocks * rows}, x.options());
  int8_t* qp = q.data_ptr<int8_t>();
  float* rs = row_scales.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    quantize_rows(xp, in, begin, end, qp, rs, rs + blocks * rows, rows);
  });
  const QuantizedRows quantized{qp, rs, rs + blocks * rows, rows};
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t tile_scales = blocks * kLanes, tile_codes = blocks * kCodeBytes;
  const int64_t columns = (tiles + 1) / 2;  // pairs of tiles, and a last odd one
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  for_each_task(chunks * columns, [&](int64_t task) {
    const int64_t column = task % columns, c0 = task / columns * kChunkRows;
    const int64_t t = column * 2, pair = std::min<int64_t>(2, tiles - t);
    const int64_t n = std::min(kChunkRows, rows - c0);
    float* out_at = yp + (gated ? column * kLanes : t * kLanes);
    // Rows split evenly over the passes (7: 4 + 3, not 6 + 1).
    const int64_t passes = (n + kPassRows - 1) / kPassRows;
    for (int64_t i = 0, r0 = c0; i < passes; ++i) {
      const int64_t k = (c0 + n - r0) / (passes - i);
      kPasses[pair - 1][k - 1](quantized, r0, blocks, sp + t * tile_scales, mp + t * tile_scales,
                               cp + t * tile_codes, out_at + r0 * width, width, gated);
      r0 += k;
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("q4_1_int8_linear(Tensor x, Tensor scales, Tensor mins, Tensor codes, bool gated=False) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(pagellm, CPU, m) { m.impl("q4_1_int8_linear", &q4_1_int8_linear); }
