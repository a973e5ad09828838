// The checks every quantized matmul op (quant_linear.cpp, int8_linear.cpp) makes alike;
// each kernel checks its own codes layout.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace pagellm_kernels {

// x a contiguous float32 [rows, in], the weight's scales float16 [tiles, blocks, 16] with
// in = 32 blocks, and a gated weight's tiles in (gate, up) pairs. Returns the output's
// width: the tiles' rows, half of them when gated.
inline int64_t check_linear_args(const char* name, const at::Tensor& x, const at::Tensor& scales,
                                 bool gated) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), name,
              ": x must be a contiguous float32 [rows, in] tensor");
  TORCH_CHECK(scales.dim() == 3 && scales.size(2) == 16 && scales.is_contiguous() &&
                  scales.scalar_type() == at::kHalf,
              name, ": scales must be float16 [tiles, blocks, 16]");
  const int64_t tiles = scales.size(0), blocks = scales.size(1);
  TORCH_CHECK(x.size(1) == blocks * 32, name, ": x has ", x.size(1), " inputs, the weight ",
              blocks * 32);
  TORCH_CHECK(blocks > 0, name, ": a weight needs at least one block of inputs");
  TORCH_CHECK(!gated || tiles % 2 == 0, name, ": a gated weight has (gate, up) pairs of tiles");
  return gated ? tiles * 8 : tiles * 16;
}

// Q4_1's mins: float16, shaped as the scales.
inline void check_mins(const char* name, const at::Tensor& mins, const at::Tensor& scales) {
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.is_contiguous() &&
                  mins.scalar_type() == at::kHalf,
              name, ": mins must match scales");
}

// A float16 tensor's elements as their bits, which the kernels widen exactly (load_halves).
inline const uint16_t* halves(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
}

}  // namespace pagellm_kernels
