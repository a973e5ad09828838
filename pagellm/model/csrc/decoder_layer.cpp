// A decoder layer's work outside attention, as two ops: the attention input (add + norm,
// the qkv matmul, rotary, the K/V store) and the attention output (o matmul, add + norm,
// the gated MLP). Each is the other ops of this library called in sequence from C++.
//
// Why: a layer's ~12 kernels called one by one from Python cost ~190 us of interpreter,
// module and dispatcher time per layer (measured on a 1-request decode step: 3.2 of its
// 8.6 ms were outside any op). From C++ the same sequence costs a few us, so decode steps
// get faster by that much; the kernels and their roundings are the very same.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace {

using TensorPair = std::tuple<at::Tensor, at::Tensor>;

// A quantized weight as the matmul ops take it: Q4_1 when `mins` is given, else Q8_0.
at::Tensor linear(const at::Tensor& x, const at::Tensor& scales,
                  const std::optional<at::Tensor>& mins, const at::Tensor& codes, bool gated) {
  static const auto q4_1 =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagellm::q4_1_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, bool)>();
  static const auto q8_0 =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagellm::q8_0_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>();
  const at::Tensor rows = x.contiguous();
  return mins ? q4_1.call(rows, scales, *mins, codes, gated) : q8_0.call(rows, scales, codes, gated);
}

TensorPair add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagellm::add_rms_norm", "")
          .typed<TensorPair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x, residual, weight, eps);
}

// (qkv [T, (H + 2 Hkv) D] with q and k rotated, the residual stream): the stream is
// residual + hidden, or hidden itself before the first layer (no residual yet). The new
// k and v rows are stored at `slots` of kv_cache [2, N, B, Hkv, D].
TensorPair attention_input(const at::Tensor& hidden, const std::optional<at::Tensor>& residual,
                           const at::Tensor& norm_weight, double eps, const at::Tensor& scales,
                           const std::optional<at::Tensor>& mins, const at::Tensor& codes,
                           const at::Tensor& cos, const at::Tensor& sin, int64_t rotated_heads,
                           at::Tensor kv_cache, const at::Tensor& slots) {
  static const auto rms_norm =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagellm::rms_norm", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  static const auto rotary =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagellm::rotary_", "")
          .typed<void(at::Tensor, int64_t, const at::Tensor&, const at::Tensor&)>();
  static const auto write_kv =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagellm::write_kv_cache_", "")
          .typed<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  TORCH_CHECK(kv_cache.dim() == 5, "attention_input: kv_cache must be [2, N, B, Hkv, D]");
  at::Tensor normed, stream;
  if (residual) {
    std::tie(normed, stream) = add_rms_norm(hidden, *residual, norm_weight, eps);
  } else {
    normed = rms_norm.call(hidden, norm_weight, eps);
    stream = hidden;
  }
  at::Tensor qkv = linear(normed, scales, mins, codes, false);
  rotary.call(qkv, rotated_heads, cos, sin);
  const int64_t tokens = qkv.size(0), kv_heads = kv_cache.size(3), dim = kv_cache.size(4);
  const int64_t kv_width = kv_heads * dim, q_width = qkv.size(1) - 2 * kv_width;
  TORCH_CHECK(q_width > 0, "attention_input: qkv has no room for the query heads");
  write_kv.call(kv_cache, qkv.narrow(1, q_width, kv_width).view({tokens, kv_heads, dim}),
                qkv.narrow(1, q_width + kv_width, kv_width).view({tokens, kv_heads, dim}),
                slots);
  return {qkv, stream};
}

// (down(silu(gate) * up) of norm(residual + o(attn)), residual + o(attn)): the rest of
// the layer; gate_up's blocks are in the gated kernel's (gate, up) pairs.
TensorPair attention_output(const at::Tensor& attn, const at::Tensor& residual,
                            const at::Tensor& o_scales, const std::optional<at::Tensor>& o_mins,
                            const at::Tensor& o_codes, const at::Tensor& norm_weight, double eps,
                            const at::Tensor& gate_up_scales,
                            const std::optional<at::Tensor>& gate_up_mins,
                            const at::Tensor& gate_up_codes, const at::Tensor& down_scales,
                            const std::optional<at::Tensor>& down_mins,
                            const at::Tensor& down_codes) {
  const at::Tensor projected = linear(attn, o_scales, o_mins, o_codes, false);
  auto [normed, stream] = add_rms_norm(projected, residual, norm_weight, eps);
  const at::Tensor activated = linear(normed, gate_up_scales, gate_up_mins, gate_up_codes, true);
  return {linear(activated, down_scales, down_mins, down_codes, false), stream};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("attention_input(Tensor hidden, Tensor? residual, Tensor norm_weight, float eps, "
        "Tensor scales, Tensor? mins, Tensor codes, Tensor cos, Tensor sin, int rotated_heads, "
        "Tensor(a!) kv_cache, Tensor slots) -> (Tensor, Tensor)");
  m.def("attention_output(Tensor attn, Tensor residual, Tensor o_scales, Tensor? o_mins, "
        "Tensor o_codes, Tensor norm_weight, float eps, Tensor gate_up_scales, "
        "Tensor? gate_up_mins, Tensor gate_up_codes, Tensor down_scales, Tensor? down_mins, "
        "Tensor down_codes) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("attention_input", &attention_input);
  m.impl("attention_output", &attention_output);
}
