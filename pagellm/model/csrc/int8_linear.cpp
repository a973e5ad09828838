// y = x @ W.T for a Q4_1 or Q8_0 weight with the activations quantized to int8 (the opt-in
// EngineConfig.quantize_activations): each row's 32 inputs of a block become 32 int8
// codes and a scale (their largest magnitude / 127), and the block's products are summed
// in integers, as llama.cpp and vLLM's GGUF kernels do (Q8_1 / Q8_0 activations).
//
// Why: the float32 kernels (quant_linear.cpp) run at the CPU's FMA rate, 16 products an
// instruction with AVX-512; an integer dot-product instruction (VNNI) makes 64. On this
// project's AMD machine (AVX-512 on 256-bit units), one thread: float32 117 GFLOP/s
// against 320-330 GOP/s here, with the nibbles unpacked and every block's scaling paid.
//
// Per row and block, with the weight's scale d and min m per output lane (Q8_0: no min),
// and the row's int8 codes q (scale s) and float32 sum of its 32 inputs:
//     acc = fma(float(sum of code * q), d * s, acc);  acc = fma(m, sum of inputs, acc)
// The integer sum is exact, and these float32 steps are the same for a row whatever rows
// share its pass, whatever instruction set: a row's result never depends on its batch
// (tested, AVX2 against AVX-512 too), which the float32 kernels' few-row tiles cannot
// promise. Its error against the float32 product is the activations' rounding to int8
// (at most half a step of 1/127 of the block's largest input); Q4_1's min term takes the
// inputs' float32 sum, not their int8 codes.
//
// Codes layout (quant_kernels.int8_activation_layout), per (tile of 16 output lanes,
// block of 32 inputs), so that each lane's codes of 4 consecutive inputs are one 32-bit
// word, as the dot-product instructions read them: Q4_1, 4 groups of 64 bytes, byte
// 4n + i of group g holding lane n's code of input 4g + i in its low nibble and of input
// 16 + 4g + i in its high one (the low nibbles pair with the row's inputs 4g.., the high
// ones with 16 + 4g..); Q8_0, 8 groups of 64 signed bytes, byte 4n + i of group g lane
// n's code of input 4g + i.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "linear_args.h"
#include "parallel.h"
#include "vec_math.h"
#include "weight_prefetch.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <utility>

namespace {

using namespace pagellm_kernels::simd;
using pagellm_kernels::check_linear_args;
using pagellm_kernels::check_mins;
using pagellm_kernels::halves;
using pagellm_kernels::for_each_task;
using pagellm_kernels::Prefetch;
using pagellm_kernels::silu_mul16;

constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 32;
constexpr int kGroups = 8;  // of 4 inputs in a block

// Unsigned nibbles (0..15) and a min per block.
struct Q4_1 {
  static constexpr int64_t kCodeBytes = kLanes * kBlock / 2;
  static constexpr bool kOffsetInputs = false;  // the row's codes as signed bytes
  // Group g's weights: the 4 inputs 4g.. of each lane.
  static vi group(const uint8_t* block, int g) {
    const vi packed = load_bytes(block + (g % 4) * 64);
    return g < 4 ? low_nibbles(packed) : high_nibbles(packed);
  }
  static vi add(vi acc, vi w, vi x) { return dot_add(acc, w, x); }
  static vi weight_sum(vi sum, vi) { return sum; }
  static vi finish(vi acc, vi) { return dot_finish(acc); }
};

// Signed bytes, no min (see signed_dot_add in simd.h).
struct Q8_0 {
  static constexpr int64_t kCodeBytes = kLanes * kBlock;
  static constexpr bool kOffsetInputs = kSignedDotOffset;
  static vi group(const uint8_t* block, int g) { return load_bytes(block + g * 64); }
  static vi add(vi acc, vi w, vi x) { return signed_dot_add(acc, w, x); }
  static vi weight_sum(vi sum, vi w) { return signed_weight_sum(sum, w); }
  static vi finish(vi acc, vi weight_sum) { return signed_dot_finish(acc, weight_sum); }
};
// Rows per pass against a pair of tiles: with AVX-512, 12 int32 sums and 12 float32
// accumulators beside 2 weight registers; with AVX2 (two registers a vector) 2 rows,
// whose 16 accumulator registers spill a little. Measured with AVX2 on this project's
// AMD machine, 30 layers' Q4_1 weights against the float32 kernels (also AVX2), 32-512
// rows: 1.4x with 2 rows a pass; 1.15-1.2x with 1 (the weights unpacked for each row)
// or 3 (more spills).
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

// Rows [begin, end) of x [rows, in] into a QuantizedRows' buffers; with `offset`, the
// codes are stored plus 128, as unsigned bytes (see signed_dot_add).
void quantize_rows(const float* x, int64_t in, int64_t begin, int64_t end, int8_t* codes,
                   float* scales, float* sums, int64_t rows, bool offset) {
  const int64_t blocks = in / kBlock;
  for (int64_t r = begin; r < end; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* p = x + r * in + b * kBlock;
      const vf a = loadu(p), c = loadu(p + kLanes);
      const float amax = reduce_max(max(max(a, sub(zero(), a)), max(c, sub(zero(), c))));
      // A NaN or an infinity among the inputs: the block's scale is then NaN, which
      // spoils every output of the row (for Q8_0 too, which has no sum term). Inputs all
      // below ~3.7e-37 in magnitude, whose 127 / amax overflows, become codes of 0.
      const bool finite = std::isfinite(amax) && bits(is_nan(a)) == 0 && bits(is_nan(c)) == 0;
      const float step = 127.0f / amax;
      const vf inv = set1(finite && amax > 0.0f && std::isfinite(step) ? step : 0.0f);
      int8_t* q = codes + (b * rows + r) * kBlock;
      store_i8(q, mul(a, inv));
      store_i8(q + kLanes, mul(c, inv));
      if (offset) {
        for (int j = 0; j < kBlock; ++j) q[j] = static_cast<int8_t>(q[j] ^ 0x80);
      }
      scales[b * rows + r] = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
      sums[b * rows + r] = reduce_add(add(a, c));
    }
  }
}

// R rows from `r0` against T tiles (T = 2: a pair, which is (gate, up) when gated), over
// every block: y[r, 0 : 16 T] (gated: silu(gate) * up, y[r, 0:16]).
template <class Format, int R, int T>
void pass(const QuantizedRows& x, int64_t r0, int64_t blocks, const uint16_t* scales,
          const uint16_t* mins, const uint8_t* codes, float* y, int64_t ldy, bool gated) {
  const int64_t tile_scales = blocks * kLanes, tile_codes = blocks * Format::kCodeBytes;
  vf acc[R][T];
  PAGELLM_UNROLL
  for (int r = 0; r < R; ++r) {
    PAGELLM_UNROLL
    for (int t = 0; t < T; ++t) acc[r][t] = zero();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* xb = x.codes + (b * x.rows + r0) * kBlock;
    const uint8_t* cb = codes + b * Format::kCodeBytes;
    vi sum[R][T], weight_sum[T];
    PAGELLM_UNROLL
    for (int t = 0; t < T; ++t) weight_sum[t] = dot_start();
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
        w[t] = Format::group(cb + t * tile_codes, g);
        weight_sum[t] = Format::weight_sum(weight_sum[t], w[t]);
      }
      PAGELLM_UNROLL
      for (int r = 0; r < R; ++r) {
        const vi xv = broadcast4(xb + r * kBlock + 4 * g);
        PAGELLM_UNROLL
        for (int t = 0; t < T; ++t) sum[r][t] = Format::add(sum[r][t], w[t], xv);
      }
    }
    PAGELLM_UNROLL
    for (int t = 0; t < T; ++t) {
      const vf d = load_halves(scales + t * tile_scales + b * kLanes);
      const vf m = mins != nullptr ? load_halves(mins + t * tile_scales + b * kLanes) : zero();
      PAGELLM_UNROLL
      for (int r = 0; r < R; ++r) {
        const int64_t at = b * x.rows + r0 + r;
        acc[r][t] = fmadd(to_float(Format::finish(sum[r][t], weight_sum[t])),
                          mul(d, set1(x.scales[at])), acc[r][t]);
        if (mins != nullptr) acc[r][t] = fmadd(m, set1(x.sums[at]), acc[r][t]);
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

using PassFn = void (*)(const QuantizedRows&, int64_t, int64_t, const uint16_t*, const uint16_t*,
                        const uint8_t*, float*, int64_t, bool);

template <class Format, int T, std::size_t... R>
constexpr std::array<PassFn, sizeof...(R)> pass_table(std::index_sequence<R...>) {
  return {pass<Format, R + 1, T>...};
}

// [T - 1][rows - 1]
template <class Format>
constexpr std::array<std::array<PassFn, kPassRows>, 2> kPasses = {
    pass_table<Format, 1>(std::make_index_sequence<kPassRows>()),
    pass_table<Format, 2>(std::make_index_sequence<kPassRows>())};

template <class Format>
at::Tensor int8_linear(const char* name, const at::Tensor& x, const at::Tensor& scales,
                       const uint16_t* mins, const at::Tensor& codes, bool gated) {
  const int64_t width = check_linear_args(name, x, scales, gated);
  constexpr int64_t groups = Format::kCodeBytes / 64;
  TORCH_CHECK(codes.dim() == 4 && codes.size(0) == scales.size(0) &&
                  codes.size(1) == scales.size(1) && codes.size(2) == groups &&
                  codes.size(3) == 64 && codes.is_contiguous() && codes.element_size() == 1,
              name, ": codes must be bytes [tiles, blocks, ", groups,
              ", 64] (the int8 layout)");
  const int64_t tiles = scales.size(0), blocks = scales.size(1);
  const int64_t rows = x.size(0), in = x.size(1);
  at::Tensor y = at::empty({rows, width}, x.options());
  if (rows == 0) return y;
  at::Tensor q = at::empty({rows * in}, x.options().dtype(at::kChar));
  at::Tensor row_scales = at::empty({2, blocks * rows}, x.options());
  int8_t* qp = q.data_ptr<int8_t>();
  float* rs = row_scales.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    quantize_rows(xp, in, begin, end, qp, rs, rs + blocks * rows, rows, Format::kOffsetInputs);
  });
  const QuantizedRows quantized{qp, rs, rs + blocks * rows, rows};
  const uint16_t* sp = halves(scales);
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  float* yp = y.data_ptr<float>();
  const int64_t tile_scales = blocks * kLanes, tile_codes = blocks * Format::kCodeBytes;
  const int64_t columns = (tiles + 1) / 2;  // pairs of tiles, and a last odd one
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  // Each task first asks L2 for the next one's blocks (Prefetch): a few rows' passes are
  // too short for the hardware prefetcher to run ahead, and, unlike the float32 kernels'
  // unpacking, they left it waiting on memory. 30 layers' weights and the head streamed
  // from memory for one row, 7 alternating pairs of processes on a noisy machine: int8
  // 4.80-6.42 ms (median 5.46) -> 4.52-6.60 (median 5.10); the float32 kernels 4.07-5.07.
  for_each_task(chunks * columns, [&](int64_t task, int64_t next_task) {
    if (next_task >= 0) {
      const int64_t first = next_task % columns * 2;
      const Prefetch next(sp, mins, cp, tile_scales, tile_codes, first,
                          std::min<int64_t>(2, tiles - first));
      for (int64_t i = 0; i < next.total(); ++i) next.line(i);
    }
    const int64_t column = task % columns, c0 = task / columns * kChunkRows;
    const int64_t t = column * 2, pair = std::min<int64_t>(2, tiles - t);
    const int64_t n = std::min(kChunkRows, rows - c0);
    float* out_at = yp + (gated ? column * kLanes : t * kLanes);
    // Rows split evenly over the passes (7: 4 + 3, not 6 + 1).
    const int64_t passes = (n + kPassRows - 1) / kPassRows;
    for (int64_t i = 0, r0 = c0; i < passes; ++i) {
      const int64_t k = (c0 + n - r0) / (passes - i);
      kPasses<Format>[pair - 1][k - 1](quantized, r0, blocks, sp + t * tile_scales,
                                       mins == nullptr ? nullptr : mins + t * tile_scales,
                                       cp + t * tile_codes, out_at + r0 * width, width, gated);
      r0 += k;
    }
  });
  return y;
}

at::Tensor q4_1_int8_linear(const at::Tensor& x, const at::Tensor& scales, const at::Tensor& mins,
                            const at::Tensor& codes, bool gated) {
  check_mins("q4_1_int8_linear", mins, scales);
  TORCH_CHECK(codes.scalar_type() == at::kByte, "q4_1_int8_linear: codes must be uint8");
  return int8_linear<Q4_1>("q4_1_int8_linear", x, scales, halves(mins), codes, gated);
}

at::Tensor q8_0_int8_linear(const at::Tensor& x, const at::Tensor& scales, const at::Tensor& codes,
                            bool gated) {
  TORCH_CHECK(codes.scalar_type() == at::kChar, "q8_0_int8_linear: codes must be int8");
  return int8_linear<Q8_0>("q8_0_int8_linear", x, scales, nullptr, codes, gated);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("q4_1_int8_linear(Tensor x, Tensor scales, Tensor mins, Tensor codes, bool gated=False) "
        "-> Tensor");
  m.def("q8_0_int8_linear(Tensor x, Tensor scales, Tensor codes, bool gated=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("q4_1_int8_linear", &q4_1_int8_linear);
  m.impl("q8_0_int8_linear", &q8_0_int8_linear);
}
