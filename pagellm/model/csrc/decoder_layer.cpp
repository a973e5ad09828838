// A decoder layer's work outside attention, as two ops: the attention input (add + norm,
// the qkv matmul, rotary, the K/V store) and the attention output (o matmul, add + norm,
// the gated MLP); and for a step of decodes only, the whole layer as one op with the
// paged decode attention between them. Each is the other ops of this library called in
// sequence from C++.
//
// Why: a layer's ~12 kernels called one by one from Python cost ~190 us of interpreter,
// module and dispatcher time per layer (measured on a 1-request decode step: 3.2 of its
// 8.6 ms were outside any op). From C++ the same sequence costs a few us, so decode steps
// get faster by that much; the kernels and their roundings are the very same.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "kv_element.h"

#include <optional>
#include <string>
#include <tuple>

namespace {

using TensorPair = std::tuple<at::Tensor, at::Tensor>;

// The library's op `name` (pagellm::name), typed `Signature`, for calls from C++.
template <class Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow((std::string("pagellm::") + name).c_str(), "")
      .template typed<Signature>();
}

// A quantized weight as the matmul ops take it: Q4_1 when `mins` is given, else Q8_0; on
// the int8-activation kernels when its codes are in their [tiles, blocks, groups, 64]
// layout (quant_kernels.int8_activation_layout).
at::Tensor linear(const at::Tensor& x, const at::Tensor& scales,
                  const std::optional<at::Tensor>& mins, const at::Tensor& codes, bool gated) {
  using Q4_1 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, bool);
  static const auto q4_1 = op<Q4_1>("q4_1_linear");
  static const auto q4_1_int8 = op<Q4_1>("q4_1_int8_linear");
  using Q8_0 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);
  static const auto q8_0 = op<Q8_0>("q8_0_linear");
  static const auto q8_0_int8 = op<Q8_0>("q8_0_int8_linear");
  const at::Tensor rows = x.contiguous();
  const bool int8 = codes.dim() == 4 && codes.size(3) == 64;
  if (!mins) return (int8 ? q8_0_int8 : q8_0).call(rows, scales, codes, gated);
  return (int8 ? q4_1_int8 : q4_1).call(rows, scales, *mins, codes, gated);
}

TensorPair add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  static const auto add_norm =
      op<TensorPair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
          "add_rms_norm");
  return add_norm.call(x, residual, weight, eps);
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
      op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("rms_norm");
  static const auto rotary =
      op<void(at::Tensor, int64_t, const at::Tensor&, const at::Tensor&)>("rotary_");
  static const auto write_kv =
      op<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "write_kv_cache_");
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

// A decode step's whole layer, where the step is one decode-kernel call over the batch in
// order: attention_input, the paged decode attention of each request's blocks (merged
// with the prefix kernel's attention over a shared prefix when `prefix_blocks` is given),
// and attention_output, from one Python call. With `prefill_rows` ([3, R] int64: the
// prefill kernel's starts, lens and contexts, made once a step; made here, they were four
// small tensor ops a layer, ~4% of a one-request decode), the prefill kernel attends
// instead (row-invariant attention, see attention/batched.py), each request a chunk of
// one query as the module path calls it, with its products in bfloat16 where
// `bf16_products`. The very ops the three calls made, in the
// same order, so the same bits. Why: the Python between them (the backend's plan, views
// of q and the caches, three dispatches) was ~40 us a layer, 4-8% of a decode step.
TensorPair decode_layer(const at::Tensor& hidden, const std::optional<at::Tensor>& residual,
                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor kv_cache,
                        const at::Tensor& slots, const at::Tensor& tables,
                        const at::Tensor& key_lens,
                        const std::optional<at::Tensor>& prefix_blocks,
                        const std::optional<at::Tensor>& prefill_rows, bool bf16_products,
                        const at::Tensor& input_norm, double input_eps,
                        const at::Tensor& qkv_scales, const std::optional<at::Tensor>& qkv_mins,
                        const at::Tensor& qkv_codes, int64_t num_heads, double scale,
                        const at::Tensor& o_scales, const std::optional<at::Tensor>& o_mins,
                        const at::Tensor& o_codes, const at::Tensor& post_norm, double post_eps,
                        const at::Tensor& gate_up_scales,
                        const std::optional<at::Tensor>& gate_up_mins,
                        const at::Tensor& gate_up_codes, const at::Tensor& down_scales,
                        const std::optional<at::Tensor>& down_mins,
                        const at::Tensor& down_codes) {
  static const auto decode =
      op<TensorPair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, double, const std::optional<at::Tensor>&,
                    const std::optional<at::Tensor>&)>("paged_decode_attention");
  static const auto prefix =
      op<TensorPair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    double, int64_t)>("paged_prefix_attention");
  static const auto prefill =
      op<TensorPair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                    const std::optional<at::Tensor>&, int64_t, bool)>("paged_prefill_attention");
  TORCH_CHECK(kv_cache.dim() == 5, "decode_layer: kv_cache must be [2, N, B, Hkv, D]");
  const int64_t kv_heads = kv_cache.size(3), dim = kv_cache.size(4);
  TORCH_CHECK(kv_heads > 0 && num_heads > 0 && num_heads % kv_heads == 0,
              "decode_layer: num_heads must be a multiple of the cache's kv heads");
  TORCH_CHECK(!prefill_rows || !prefix_blocks,
              "decode_layer: the prefill kernel takes no prefix_blocks");
  TORCH_CHECK(prefill_rows || !bf16_products,
              "decode_layer: bf16_products is for the prefill kernel");
  // As the ops would refuse them, but before attention_input stores the step's rows.
  TORCH_CHECK(!prefill_rows ||
                  (prefill_rows->dim() == 2 && prefill_rows->size(0) == 3 &&
                   prefill_rows->scalar_type() == at::kLong && prefill_rows->is_contiguous()),
              "decode_layer: prefill_rows must be contiguous int64 [3, R]");
  TORCH_CHECK(!prefill_rows || (prefill_rows->size(1) == hidden.size(0) &&
                                tables.size(0) == hidden.size(0)),
              "decode_layer: prefill_rows and tables must hold one request per token");
  TORCH_CHECK(!bf16_products || pagellm_kernels::simd::kBf16Products,
              "decode_layer: bf16_products needs AVX-512 BF16, which this build of the "
              "kernels has not");
  auto [qkv, stream] = attention_input(hidden, residual, input_norm, input_eps, qkv_scales,
                                       qkv_mins, qkv_codes, cos, sin, num_heads + kv_heads,
                                       kv_cache, slots);
  const int64_t tokens = qkv.size(0);
  const at::Tensor q = qkv.narrow(1, 0, num_heads * dim).view({tokens, num_heads, dim});
  const at::Tensor k_cache = kv_cache.select(0, 0), v_cache = kv_cache.select(0, 1);
  if (prefill_rows) {
    const at::Tensor attn = std::get<0>(prefill.call(
        q, k_cache, v_cache, tables, prefill_rows->select(0, 0), prefill_rows->select(0, 1),
        prefill_rows->select(0, 2), scale, num_heads / kv_heads, std::nullopt, 0,
        bf16_products));
    return attention_output(attn.view({tokens, num_heads * dim}), stream, o_scales, o_mins,
                            o_codes, post_norm, post_eps, gate_up_scales, gate_up_mins,
                            gate_up_codes, down_scales, down_mins, down_codes);
  }
  std::optional<at::Tensor> prior_out, prior_lse;
  if (prefix_blocks) {
    std::tie(prior_out, prior_lse) =
        prefix.call(q, k_cache, v_cache, *prefix_blocks, scale, num_heads / kv_heads);
  }
  const at::Tensor attn = std::get<0>(
      decode.call(q, k_cache, v_cache, tables, key_lens, scale, prior_out, prior_lse));
  return attention_output(attn.view({tokens, num_heads * dim}), stream, o_scales, o_mins,
                          o_codes, post_norm, post_eps, gate_up_scales, gate_up_mins,
                          gate_up_codes, down_scales, down_mins, down_codes);
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
  m.def("decode_layer(Tensor hidden, Tensor? residual, Tensor cos, Tensor sin, "
        "Tensor(a!) kv_cache, Tensor slots, Tensor tables, Tensor key_lens, "
        "Tensor? prefix_blocks, Tensor? prefill_rows, bool bf16_products, Tensor input_norm, "
        "float input_eps, Tensor qkv_scales, "
        "Tensor? qkv_mins, Tensor qkv_codes, int num_heads, float scale, Tensor o_scales, "
        "Tensor? o_mins, Tensor o_codes, Tensor post_norm, float post_eps, "
        "Tensor gate_up_scales, Tensor? gate_up_mins, Tensor gate_up_codes, "
        "Tensor down_scales, Tensor? down_mins, Tensor down_codes) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("attention_input", &attention_input);
  m.impl("attention_output", &attention_output);
  m.impl("decode_layer", &decode_layer);
}
