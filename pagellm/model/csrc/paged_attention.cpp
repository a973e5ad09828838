// Decode attention straight from the paged KV cache: one query token per request, read
// through its block table, so no copy of the request's keys and values is ever made.
//
// Why: with the torch ops, a decode step first gathers every request's blocks into a
// contiguous buffer (a full extra write and read of the context) and then runs a flash
// kernel whose tiles are sized for long queries, not for G = heads / kv_heads rows.
// Here each (request, kv head) pair streams its keys and values once, block by block,
// with the G query heads that share that kv head (grouped-query attention); with AVX2 a
// task takes several kv heads of its request at once (`attend_narrow`,
// `kv_heads_per_task`).
//
// Softmax is the usual online one, rescaled once per block of keys; the result is the
// same attention in another order of float32 operations. A prior partial attention over
// other keys (a shared prefix, from the prefix kernel) can be given with its log-sum-exp:
// the two are merged exactly in the epilogue, so a cascade costs no extra pass.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "kv_element.h"
#include "parallel.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using namespace pagellm_kernels::simd;
using pagellm_kernels::bf16;
using pagellm_kernels::kLineElements;
using pagellm_kernels::exp16;
using pagellm_kernels::for_each_task;

constexpr int kMaxBlock = 64;  // tokens per KV block the kernel handles
constexpr int64_t kMaxTaskHeads = 32;  // query heads of one task (see kv_heads_per_task)

// A block's n scores at s become exp(score - m') in place, m' the running max with them,
// and the running sum l takes them in; returns exp(m - m'), the factor for the output so
// far.
inline float softmax_block(float* s, int64_t n, float& m, float& l) {
  float block_max = s[0];
  for (int64_t t = 1; t < n; ++t) block_max = std::max(block_max, s[t]);
  const float new_m = std::max(m, block_max);
  const float correction = std::exp(m - new_m);
  m = new_m;
  float sum = 0.0f;
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int valid = static_cast<int>(std::min<int64_t>(16, n - t0));
    const vf p = keep(first_lanes(valid), exp16(sub(loadu_first(s + t0, valid), set1(new_m))));
    storeu(s + t0, p);
    sum += reduce_add(p);
  }
  l = l * correction + sum;
  return correction;
}

// One head's result from its unnormalised output `acc`, running max m and sum l: out and
// its log-sum-exp, merged with a prior part when one is given (prior_lse not null).
template <int NV>
inline void finish(const vf* acc, float m, float l, const float* prior_out,
                   const float* prior_lse, float* out, float* lse) {
  if (prior_lse == nullptr) {
    const vf inv = set1(1.0f / l);
    PAGELLM_UNROLL
    for (int v = 0; v < NV; ++v) storeu(out + v * 16, mul(acc[v], inv));
    *lse = m + std::log(l);
    return;
  }
  // Both parts weighted by their share of the total mass exp(lse_own) + exp(lse_prior).
  const float top = std::max(m, *prior_lse);
  const float own_w = std::exp(m - top), prior_w = std::exp(*prior_lse - top);
  const float total = l * own_w + prior_w;
  const vf a = set1(own_w / total), b = set1(prior_w / total);
  PAGELLM_UNROLL
  for (int v = 0; v < NV; ++v) {
    storeu(out + v * 16, fmadd(acc[v], a, mul(loadu(prior_out + v * 16), b)));
  }
  *lse = top + std::log(total);
}

// One (request, kv head): G query heads of NV * 16 dims against `len` keys.
template <typename KV, int G, int NV>
void attend(const float* q, const KV* k_cache, const KV* v_cache, const int32_t* blocks,
            int64_t len, int64_t block_size, int64_t block_stride, int64_t token_stride,
            float scale, const float* prior_out, const float* prior_lse, float* out,
            float* lse) {
  vf qv[G][NV], acc[G][NV];
  float m[G], l[G];
  PAGELLM_UNROLL
  for (int g = 0; g < G; ++g) {
    PAGELLM_UNROLL
    for (int v = 0; v < NV; ++v) {
      qv[g][v] = mul(loadu(q + g * NV * 16 + v * 16), set1(scale));
      acc[g][v] = zero();
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
  }
  alignas(64) float s[G][kMaxBlock];
  for (int64_t start = 0, b = 0; start < len; start += block_size, ++b) {
    const int64_t n = std::min(block_size, len - start);
    const KV* kb = k_cache + blocks[b] * block_stride;
    const KV* vb = v_cache + blocks[b] * block_stride;
    // The next block lies anywhere in the pool, out of the hardware prefetcher's sight:
    // ask for its rows of this head while this block is computed.
    const bool more = start + block_size < len;
    const KV* next_k = more ? k_cache + blocks[b + 1] * block_stride : nullptr;
    const KV* next_v = more ? v_cache + blocks[b + 1] * block_stride : nullptr;
    for (int64_t t = 0; t < n; ++t) {
      if (more) {
        PAGELLM_UNROLL
        for (int e = 0; e < NV * 16; e += kLineElements<KV>) {
          _mm_prefetch(reinterpret_cast<const char*>(next_k + t * token_stride + e),
                       _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(next_v + t * token_stride + e),
                       _MM_HINT_T0);
        }
      }
      const KV* k = kb + t * token_stride;
      vf kv[NV];
      PAGELLM_UNROLL
      for (int v = 0; v < NV; ++v) kv[v] = load_kv(k + v * 16);
      PAGELLM_UNROLL
      for (int g = 0; g < G; ++g) {
        vf dot = mul(qv[g][0], kv[0]);
        PAGELLM_UNROLL
        for (int v = 1; v < NV; ++v) dot = fmadd(qv[g][v], kv[v], dot);
        s[g][t] = reduce_add(dot);
      }
    }
    PAGELLM_UNROLL
    for (int g = 0; g < G; ++g) {
      const vf c = set1(softmax_block(s[g], n, m[g], l[g]));
      PAGELLM_UNROLL
      for (int v = 0; v < NV; ++v) acc[g][v] = mul(acc[g][v], c);
    }
    for (int64_t t = 0; t < n; ++t) {
      const KV* vt = vb + t * token_stride;
      PAGELLM_UNROLL
      for (int v = 0; v < NV; ++v) {
        const vf val = load_kv(vt + v * 16);
        PAGELLM_UNROLL
        for (int g = 0; g < G; ++g) {
          acc[g][v] = fmadd(set1(s[g][t]), val, acc[g][v]);
        }
      }
    }
  }
  PAGELLM_UNROLL
  for (int g = 0; g < G; ++g) {
    finish<NV>(acc[g], m[g], l[g], prior_out == nullptr ? nullptr : prior_out + g * NV * 16,
               prior_lse == nullptr ? nullptr : prior_lse + g, out + g * NV * 16, lse + g);
  }
}

#if !PAGELLM_WIDE_REGISTERS
// `attend` for AVX2, whose 16 registers cannot hold that kernel's tile: 3 heads of 64
// dims are 24 registers of queries and 24 of outputs, so GCC kept them on the stack and
// each FMA of the value loop read and wrote its accumulator there, and every (key, head)
// dot product ended in a horizontal sum of its own.
// Here queries and outputs live in L1 (aligned arrays), and both products are tiled to the
// registers over at most kNarrowHeads heads:
// - scores: kNarrowKeys keys x 3 heads of accumulators (12 registers) over the dims, beside
//   the 3 heads' query registers and one key register; the 4 keys' sums are taken together;
// - output: 3 heads x 32 dims (12 registers), each key's 3 probabilities broadcast beside
//   one value register. Its sums are those of `attend`, in the same order.
// A task takes several kv heads of its request (see kv_heads_per_task), block by block.
// Measured (SmolLM2 shapes): from L2 on one core, 35 -> 24 ns per key and kv head; 32
// requests x 1,056 keys from memory, 30 layers, in-process A/B: 146 -> 96 ms.
constexpr int kNarrowHeads = 3;
constexpr int kNarrowKeys = 4;
constexpr int kNarrowDims = 4 * kRegisterLanes;

// Heads [0, HP) of `qs` (rows q_stride apart) against the 4 key rows `keys`, of C
// registers each: scores to s[h * s_stride + 0..3].
template <typename KV, int HP, int C>
inline void narrow_scores(const float* qs, int64_t q_stride, const KV* const* keys,
                          float* s, int64_t s_stride) {
  vreg acc[HP][kNarrowKeys];
  PAGELLM_UNROLL
  for (int h = 0; h < HP; ++h) {
    PAGELLM_UNROLL
    for (int j = 0; j < kNarrowKeys; ++j) acc[h][j] = zero_reg();
  }
  PAGELLM_UNROLL
  for (int c = 0; c < C; ++c) {
    vreg qv[HP];
    PAGELLM_UNROLL
    for (int h = 0; h < HP; ++h) {
      qv[h] = in_register(load_reg(qs + h * q_stride + c * kRegisterLanes));
    }
    PAGELLM_UNROLL
    for (int j = 0; j < kNarrowKeys; ++j) {
      const vreg kv = in_register(load_reg_kv(keys[j] + c * kRegisterLanes));
      PAGELLM_UNROLL
      for (int h = 0; h < HP; ++h) acc[h][j] = fmadd(qv[h], kv, acc[h][j]);
    }
  }
  PAGELLM_UNROLL
  for (int h = 0; h < HP; ++h) {
    store_sums4(s + h * s_stride, acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
  }
}

// o[h][d0, d0 + kNarrowDims), rescaled by correction[h], plus p[h][t] * value row t for the
// block's n keys, for heads [0, HP) (rows of p and o p_stride and o_stride apart).
template <typename KV, int HP>
inline void narrow_values(const float* p, int64_t p_stride, const KV* vb,
                          int64_t token_stride, int64_t n, int d0, const float* correction,
                          float* o, int64_t o_stride) {
  constexpr int kVecs = kNarrowDims / kRegisterLanes;
  vreg acc[HP][kVecs];
  PAGELLM_UNROLL
  for (int h = 0; h < HP; ++h) {
    const vreg c = broadcast_reg(correction + h);
    PAGELLM_UNROLL
    for (int v = 0; v < kVecs; ++v) {
      acc[h][v] = mul(load_reg(o + h * o_stride + d0 + v * kRegisterLanes), c);
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    vreg pt[HP];
    PAGELLM_UNROLL
    for (int h = 0; h < HP; ++h) {
      pt[h] = in_register(broadcast_reg(p + h * p_stride + t));
    }
    const KV* vt = vb + t * token_stride + d0;
    PAGELLM_UNROLL
    for (int v = 0; v < kVecs; ++v) {
      const vreg val = in_register(load_reg_kv(vt + v * kRegisterLanes));
      PAGELLM_UNROLL
      for (int h = 0; h < HP; ++h) acc[h][v] = fmadd(pt[h], val, acc[h][v]);
    }
  }
  PAGELLM_UNROLL
  for (int h = 0; h < HP; ++h) {
    PAGELLM_UNROLL
    for (int v = 0; v < kVecs; ++v) store(o + h * o_stride + d0 + v * kRegisterLanes, acc[h][v]);
  }
}

template <typename KV, int G, int NV>
void attend_narrow(const float* q, const KV* k_cache, const KV* v_cache,
                   const int32_t* blocks, int64_t len, int64_t block_size, int64_t block_stride,
                   int64_t token_stride, float scale, int64_t count, const float* prior_out,
                   const float* prior_lse, int64_t prior_stride, float* out, float* lse) {
  constexpr int D = NV * 16, C = D / kRegisterLanes;
  constexpr int kFull = G - G % kNarrowHeads;  // heads of a kv head in full tiles
  alignas(64) float qs[kMaxTaskHeads][D], o[kMaxTaskHeads][D], s[kMaxTaskHeads][kMaxBlock];
  float m[kMaxTaskHeads], l[kMaxTaskHeads], correction[kMaxTaskHeads];
  const int64_t heads = count * G;
  for (int64_t i = 0; i < heads; ++i) {
    for (int v = 0; v < NV; ++v) {
      store(qs[i] + v * 16, mul(loadu(q + i * D + v * 16), set1(scale)));
      store(o[i] + v * 16, zero());
    }
    m[i] = -std::numeric_limits<float>::infinity();
    l[i] = 0.0f;
  }
  for (int64_t start = 0, b = 0; start < len; start += block_size, ++b) {
    const int64_t n = std::min(block_size, len - start);
    const KV* kb = k_cache + blocks[b] * block_stride;
    const KV* vb = v_cache + blocks[b] * block_stride;
    // The next block, fetched into L2 (see `attend`); into L1, it evicted this block's
    // values before the value pass reached them (32 requests x 1,056 keys, one layer's
    // pool: 5.0-5.5 -> 3.1-4.0 ms).
    const bool more = start + block_size < len;
    const KV* next_k = more ? k_cache + blocks[b + 1] * block_stride : nullptr;
    const KV* next_v = more ? v_cache + blocks[b + 1] * block_stride : nullptr;
    for (int64_t t0 = 0; t0 < n; t0 += kNarrowKeys) {
      for (int64_t h = 0; h < count; ++h) {
        // Past the block's last key, its last key again: those scores are never read.
        const KV* keys[kNarrowKeys];
        for (int j = 0; j < kNarrowKeys; ++j) {
          const int64_t t = std::min<int64_t>(t0 + j, n - 1);
          keys[j] = kb + t * token_stride + h * D;
          if (more && t0 + j < n) {
            for (int e = 0; e < D; e += kLineElements<KV>) {
              const int64_t at = t * token_stride + h * D + e;
              _mm_prefetch(reinterpret_cast<const char*>(next_k + at), _MM_HINT_T1);
              _mm_prefetch(reinterpret_cast<const char*>(next_v + at), _MM_HINT_T1);
            }
          }
        }
        const int64_t i = h * G;
        for (int g = 0; g < kFull; g += kNarrowHeads) {
          narrow_scores<KV, kNarrowHeads, C>(qs[i + g], D, keys, s[i + g] + t0, kMaxBlock);
        }
        if constexpr (kFull < G) {
          narrow_scores<KV, G - kFull, C>(qs[i + kFull], D, keys, s[i + kFull] + t0, kMaxBlock);
        }
      }
    }
    for (int64_t i = 0; i < heads; ++i) correction[i] = softmax_block(s[i], n, m[i], l[i]);
    for (int64_t h = 0; h < count; ++h) {
      const int64_t i = h * G;
      for (int d0 = 0; d0 < D; d0 += kNarrowDims) {
        for (int g = 0; g < kFull; g += kNarrowHeads) {
          narrow_values<KV, kNarrowHeads>(s[i + g], kMaxBlock, vb + h * D, token_stride, n, d0,
                                      correction + i + g, o[i + g], D);
        }
        if constexpr (kFull < G) {
          narrow_values<KV, G - kFull>(s[i + kFull], kMaxBlock, vb + h * D, token_stride, n, d0,
                                   correction + i + kFull, o[i + kFull], D);
        }
      }
    }
  }
  for (int64_t i = 0; i < heads; ++i) {
    vf acc[NV];
    for (int v = 0; v < NV; ++v) acc[v] = load(o[i] + v * 16);
    const int64_t prior_row = (i / G) * prior_stride + i % G;
    finish<NV>(acc, m[i], l[i], prior_out == nullptr ? nullptr : prior_out + prior_row * D,
               prior_lse == nullptr ? nullptr : prior_lse + prior_row, out + i * D, lse + i);
  }
}
#endif

#if PAGELLM_WIDE_REGISTERS
// kv heads [0, count) of one request, one after the other.
template <typename KV, int G, int NV>
void attend_heads(const float* q, const KV* k_cache, const KV* v_cache,
                  const int32_t* blocks, int64_t len, int64_t block_size, int64_t block_stride,
                  int64_t token_stride, float scale, int64_t count, const float* prior_out,
                  const float* prior_lse, int64_t prior_stride, float* out, float* lse) {
  constexpr int D = NV * 16;
  for (int64_t h = 0; h < count; ++h) {
    attend<KV, G, NV>(q + h * G * D, k_cache + h * D, v_cache + h * D, blocks, len, block_size,
                  block_stride, token_stride, scale,
                  prior_out == nullptr ? nullptr : prior_out + h * prior_stride * D,
                  prior_lse == nullptr ? nullptr : prior_lse + h * prior_stride,
                  out + h * G * D, lse + h * G);
  }
}
#endif

// One task: kv heads [0, count) of one request (q, out and lse at its first head, the
// caches at its first head's dims, the prior's rows of successive kv heads prior_stride
// rows apart).
template <typename KV>
using AttendFn = void (*)(const float*, const KV*, const KV*, const int32_t*, int64_t, int64_t,
                          int64_t, int64_t, float, int64_t, const float*, const float*,
                          int64_t, float*, float*);

template <typename KV, int G>
AttendFn<KV> pick_dims(int64_t nv) {
  switch (nv) {
#if PAGELLM_WIDE_REGISTERS
    case 4: return attend_heads<KV, G, 4>;
    case 8: return attend_heads<KV, G, 8>;
#else
    case 4: return attend_narrow<KV, G, 4>;
    case 8: return attend_narrow<KV, G, 8>;
#endif
    default: return nullptr;
  }
}

template <typename KV>
AttendFn<KV> pick(int64_t group, int64_t nv) {
  switch (group) {
    case 1: return pick_dims<KV, 1>(nv);
    case 2: return pick_dims<KV, 2>(nv);
    case 3: return pick_dims<KV, 3>(nv);
    case 4: return pick_dims<KV, 4>(nv);
    case 5: return pick_dims<KV, 5>(nv);
    case 6: return pick_dims<KV, 6>(nv);
    case 7: return pick_dims<KV, 7>(nv);
    case 8: return pick_dims<KV, 8>(nv);
    default: return nullptr;
  }
}

// kv heads per task. With AVX2, all of a request's (up to kMaxTaskHeads query heads) once
// there are requests enough to keep the threads busy: each block is then read whole, one
// contiguous run of the pool, where head by head each task reads 256 of every 768 bytes
// (SmolLM2) and the prefetchers fell behind: plain reads of the pool ran at 17 GB/s that
// way against 26-30 GB/s whole. With AVX-512, whose kernel takes a task's heads one after
// the other, only where the longest request's keys and values (`request_bytes`, all its
// heads) fit in a share of L2: the heads after the first then read the blocks from L2.
// 30 layers' pools, 2 threads, alternating processes: 32 requests x 64 keys (the
// shared-prefix workload's own keys beside the cascade's prefix) 3.3-3.9 -> 3.0-3.1 ms,
// 64 x 300 keys 47.4-48.2 -> 43.1-43.7 ms; past L2, 32 x 1,056 keys went 81.6-83.1 ->
// 83.6-89.5 ms, so those stay one head per task.
constexpr int64_t kL2Share = 512 * 1024;
int64_t kv_heads_per_task(int64_t requests, int64_t kv_heads, int64_t group,
                          int64_t request_bytes) {
  if (requests < 4 * at::get_num_threads() || (kWideRegisters && request_bytes > kL2Share)) {
    return 1;
  }
  return std::max<int64_t>(1, std::min<int64_t>(kv_heads, kMaxTaskHeads / group));
}

// Queries as the decode and prefill kernels read them, in place: float32 [rows, H, D] with
// each row's heads contiguous; rows may lie apart (a view of the qkv output).
void check_queries(const char* op, const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 &&
                  (q.size(1) == 1 || q.stride(1) == q.size(2)),
              op, ": q must be float32 [rows, H, D] with contiguous heads");
}

// The paged pool every attention op reads: K and V, each contiguous [N, B, Hkv, D], both
// float32 or both bfloat16 (kv_element.h).
void check_caches(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const auto type = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 && (type == at::kFloat || type == at::kBFloat16) &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == type && v_cache.is_contiguous(),
              op, ": caches must be contiguous float32 or bfloat16 [N, B, Hkv, D], both alike");
}

// run(element) with a value of the pool's element type, float or bf16, so that an op's
// body is written once for both (the element is only a tag for the type).
template <typename Run>
void with_elements(const at::Tensor& cache, Run&& run) {
  if (cache.scalar_type() == at::kBFloat16) {
    run(bf16{});
  } else {
    run(0.0f);
  }
}

template <typename KV>
const KV* elements(const at::Tensor& cache) {
  return static_cast<const KV*>(cache.const_data_ptr());
}

// q [R, H, D] (check_queries); k_cache, v_cache [N, B, Hkv, D]; block_tables [R, W]
// int32, row r the blocks of request r's keys from its first; lens [R] keys per request
// (>= 1).
// prior_out [Hkv, R * G, D] and prior_lse [Hkv, R * G] (the prefix kernel's layout, G =
// H / Hkv), optional: the same queries' attention over other keys, merged into the result.
// Returns out [R, H, D] and the log-sum-exp of the (scaled) scores [R, H].
std::tuple<at::Tensor, at::Tensor> paged_decode_attention(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_tables, const at::Tensor& lens, double scale,
    const std::optional<at::Tensor>& prior_out, const std::optional<at::Tensor>& prior_lse) {
  check_queries("paged_decode_attention", q);
  check_caches("paged_decode_attention", k_cache, v_cache);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt &&
                  block_tables.size(0) == q.size(0) && block_tables.stride(1) == 1,
              "paged_decode_attention: block_tables must be int32 [R, W], rows contiguous");
  TORCH_CHECK(lens.dim() == 1 && lens.scalar_type() == at::kInt && lens.size(0) == q.size(0) &&
                  lens.is_contiguous(),
              "paged_decode_attention: lens must be int32 [R]");
  const int64_t requests = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0 && block_size <= kMaxBlock,
              "paged_decode_attention: shapes do not match");
  TORCH_CHECK(prior_out.has_value() == prior_lse.has_value(),
              "paged_decode_attention: prior_out and prior_lse go together");
  if (prior_out.has_value()) {
    TORCH_CHECK(prior_out->scalar_type() == at::kFloat && prior_out->is_contiguous() &&
                    prior_out->numel() == q.numel() && prior_lse->scalar_type() == at::kFloat &&
                    prior_lse->is_contiguous() && prior_lse->numel() == q.size(0) * q.size(1),
                "paged_decode_attention: prior_out must be contiguous float32 [Hkv, R * G, D] "
                "and prior_lse [Hkv, R * G]");
  }
  TORCH_CHECK(dim % 16 == 0 && pick<float>(heads / kv_heads, dim / 16) != nullptr,
              "paged_decode_attention: ", heads / kv_heads, " query heads per kv head of ",
              dim, " dims are not supported");
  at::Tensor out = at::empty({requests, heads, dim}, q.options());
  at::Tensor lse = at::empty({requests, heads}, q.options());
  const int32_t* len_p = lens.data_ptr<int32_t>();
  const int64_t width = block_tables.size(1);
  int64_t longest = 0;
  for (int64_t r = 0; r < requests; ++r) {
    TORCH_CHECK(len_p[r] >= 1 && len_p[r] <= width * block_size,
                "paged_decode_attention: request ", r, " has ", len_p[r], " keys for ", width,
                " blocks");
    longest = std::max<int64_t>(longest, len_p[r]);
  }
  const int64_t group = heads / kv_heads;
  const float* qp = q.data_ptr<float>();
  const int64_t q_stride = q.stride(0);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float* po = prior_out.has_value() ? prior_out->data_ptr<float>() : nullptr;
  const float* pl = prior_lse.has_value() ? prior_lse->data_ptr<float>() : nullptr;
  const int64_t token_stride = kv_heads * dim, block_stride = block_size * token_stride;
  const float s = static_cast<float>(scale);
  const int64_t run = kv_heads_per_task(requests, kv_heads, group,
                                        2 * longest * token_stride * k_cache.element_size());
  const int64_t runs = (kv_heads + run - 1) / run;
  with_elements(k_cache, [&](auto element) {
    using KV = decltype(element);
    const AttendFn<KV> fn = pick<KV>(group, dim / 16);
    const KV* kp = elements<KV>(k_cache);
    const KV* vp = elements<KV>(v_cache);
    for_each_task(requests * runs, [&](int64_t i) {
      const int64_t r = i / runs, h = i % runs * run;
      const int64_t out_offset = (r * heads + h * group) * dim;
      const int64_t prior_row = (h * requests + r) * group;
      fn(qp + r * q_stride + h * group * dim, kp + h * dim, vp + h * dim,
         tables + r * table_stride, len_p[r], block_size, block_stride, token_stride, s,
         std::min(run, kv_heads - h), po == nullptr ? nullptr : po + prior_row * dim,
         pl == nullptr ? nullptr : pl + prior_row, requests * group, op + out_offset,
         lp + r * heads + h * group);
    });
  });
  return {out, lse};
}

// Many queries against one run of keys: every query of every request of a cascade group
// against their shared prefix (`blocks`, whole blocks), or a request's prompt chunk
// against its context and itself (causal, paged_prefill_attention). Keys and values are
// read in place.
//
// Both products are register-blocked like a GEMM, with no transposed copy of the keys and
// no horizontal sums: scores are computed key-major (a key's scalar broadcast against 16
// query rows at once, 6 keys x 4 row vectors per pass), so the online softmax runs down
// each row vector with vertical max and sum; then the output takes 6 rows (3 for 128
// dims) x the whole head per pass, each value row loaded once for all of them. The
// softmax is rescaled once per chunk of 48 keys. A tile of a few rows (a decode's query
// heads, at most kLaneRows) goes the other way round for its scores: keys transposed
// into the lanes, a horizontal max; and its output passes take just its rows (see
// attend_prefix).
// With AVX2's 16 registers of 8 lanes, the passes are narrower: 6 keys x 1 row vector of
// scores, and 6 rows x 16 dims of output, 12 registers each, beside the 2 registers of
// the vector every FMA reads (kept in registers: folded into the FMAs as memory operands,
// they made 15 loads per 12 FMAs).
constexpr int kKeyChunk = 48;
constexpr int kKeysPerPass = 6;
constexpr int kScoreVecs = kWideRegisters ? 4 : 1;  // row vectors per score pass
constexpr int kPvVecs = kWideRegisters ? 8 : 1;     // output vectors of a row per pass
constexpr int64_t kPrefixRowTile = 64;
// Tiles of at most this many rows take their scores with keys in the lanes (see
// attend_prefix). Why 8: the rows-in-lanes way costs a 48-key chunk 48 instructions a dim
// (or pair of dims) for any number of rows up to 16, keys in the lanes 3 a row, plus the
// transpose and the copy of the probabilities into st: a gain for few rows, none short
// of 16.
constexpr int64_t kLaneRows = 8;
constexpr int64_t kMinPrefixTasks = 4;  // see paged_prefix_attention

// Where a kv head's query and output rows lie: row r is head r % group of query
// r / group; queries are `q_stride` (`out_stride`) floats apart and a query's heads D
// apart. A contiguous [M, D] run of rows is group 1 with strides D.
struct RowLayout {
  int64_t group, q_stride, out_stride;
};

// Scores of kKeysPerPass keys (rows `keys`) against C row vectors from vector r0 of the
// d-major queries `qt`, stored key-major at `st` (a key's W rows); `top` gathers each row
// vector's largest score when the whole pass is visible.
// With bfloat16 keys (K = bf16: bfloat16 products, see kBf16Products), `qt` holds pairs of
// dims, and each step takes a pair: D / 2 steps of one vdpbf16ps where float32 takes D FMAs.
template <int D, int W, int C, typename K>
inline void score_pass(const float* qt, const K* const* keys, int r0, float* st,
                       bool whole, vf* top) {
  constexpr bool kPairs = std::is_same_v<K, bf16>;
  vf s[kKeysPerPass][C];
  PAGELLM_UNROLL
  for (int j = 0; j < kKeysPerPass; ++j) {
    PAGELLM_UNROLL
    for (int r = 0; r < C; ++r) s[j][r] = zero();
  }
  for (int d = 0; d < (kPairs ? D / 2 : D); ++d) {
    vf qv[C];
    PAGELLM_UNROLL
    for (int r = 0; r < C; ++r) {
      qv[r] = in_register(load(qt + d * W + (r0 + r) * 16));
    }
    PAGELLM_UNROLL
    for (int j = 0; j < kKeysPerPass; ++j) {
      if constexpr (kPairs) {
        float pair;  // dims 2d and 2d + 1 of key j, as bits
        std::memcpy(&pair, keys[j] + 2 * d, sizeof pair);
        const vf k = set1(pair);
        PAGELLM_UNROLL
        for (int r = 0; r < C; ++r) s[j][r] = dot_bf16_pairs(s[j][r], k, qv[r]);
      } else {
        const vf k = set1(keys[j][d]);
        PAGELLM_UNROLL
        for (int r = 0; r < C; ++r) s[j][r] = fmadd(k, qv[r], s[j][r]);
      }
    }
  }
  PAGELLM_UNROLL
  for (int j = 0; j < kKeysPerPass; ++j) {
    PAGELLM_UNROLL
    for (int r = 0; r < C; ++r) {
      store(st + j * W + (r0 + r) * 16, s[j][r]);
      if (whole) top[r0 + r] = max(top[r0 + r], s[j][r]);
    }
  }
}

// pass.template operator()<rows>(0) for P <= rows < Max: a pass of exactly a small
// tile's rows.
template <int P, int Max, typename Pass>
inline void few_rows_pass(int64_t rows, const Pass& pass) {
  if constexpr (P < Max) {
    if (rows == P) return pass.template operator()<P>(0);
    few_rows_pass<P + 1, Max>(rows, pass);
  } else {
    TORCH_CHECK(false, "few_rows_pass: ", rows, " rows are not fewer than a pass's ", Max);
  }
}

// Lanes [0, count) of a vector, none where count <= 0.
inline vmask lanes_below(int64_t count) {
  return first_lanes(static_cast<int>(std::clamp<int64_t>(count, 0, 16)));
}

// A chunk's scores with keys in the lanes, for a tile of `rows` <= kLaneRows rows (see
// attend_prefix): row r's score of key t at lane_s[r * kKeyChunk + t], and in `top` lane
// r the largest of those it sees (-inf in padding lanes). `keys` holds kKeyChunk rows
// (those past the chunk's n point at a real key) of float32 dims or, with K = bf16,
// pairs of dims. Lane t of row r takes the steps of score_pass's lane r for key t: from
// zero, one FMA a dim (or one vdpbf16ps a pair of dims) in order, whose products are the
// same either way round. The largest score is the same value as score_pass's running
// maximum (only the sign of a zero or which NaN could differ: a zero's exp is 1 either
// way, and a NaN spoils its row either way).
template <int D, int W, typename K>
inline void lane_scores(const float* qt, const K* const* keys, int64_t rows,
                        const int32_t* lim, int64_t start, int n, float* key_t, float* lane_s,
                        vf* top) {
  constexpr bool kPairs = std::is_same_v<K, bf16>;
  constexpr int kWords = kPairs ? D / 2 : D, kVecs = kKeyChunk / 16;
  const void* rows_at[16];
  for (int kb = 0; kb < kVecs; ++kb) {
    for (int i = 0; i < 16; ++i) rows_at[i] = keys[kb * 16 + i];
    for (int e0 = 0; e0 < kWords; e0 += 16) {
      transpose_words16(rows_at, e0, key_t + e0 * kKeyChunk + kb * 16, kKeyChunk);
    }
  }
  const vf neg_inf = set1(-std::numeric_limits<float>::infinity());
  alignas(64) float tops[16];
  std::fill(tops, tops + 16, -std::numeric_limits<float>::infinity());
  for (int64_t row = 0; row < rows; ++row) {
    vf s[kVecs];
    PAGELLM_UNROLL
    for (int kb = 0; kb < kVecs; ++kb) s[kb] = zero();
    for (int e = 0; e < kWords; ++e) {
      const vf q = set1(qt[e * W + row]);
      PAGELLM_UNROLL
      for (int kb = 0; kb < kVecs; ++kb) {
        const vf k = load(key_t + e * kKeyChunk + kb * 16);
        if constexpr (kPairs) {
          s[kb] = dot_bf16_pairs(s[kb], q, k);
        } else {
          s[kb] = fmadd(q, k, s[kb]);
        }
      }
    }
    const int64_t visible = std::clamp<int64_t>(lim[row] - start, 0, n);
    vf best = neg_inf;
    PAGELLM_UNROLL
    for (int kb = 0; kb < kVecs; ++kb) {
      store(lane_s + row * kKeyChunk + kb * 16, s[kb]);
      best = max(best, select(lanes_below(visible - kb * 16), s[kb], neg_inf));
    }
    tops[row] = reduce_max(best);
  }
  top[0] = load(tops);
}

// The probabilities of lane_scores' rows, as attend_prefix's softmax computes them (each
// row's `shift` lane subtracted, exp16, then `weight`, attend_prefix's own rounding; zero
// where a row does not see a key), laid out in st as the output pass reads them:
// st[t * W + row], t < n.
template <int W, typename Weight>
inline void lane_probabilities(float* lane_s, int64_t rows, const int32_t* lim, int64_t start,
                               int n, vf shift, const Weight& weight, float* st) {
  alignas(64) float shifts[16];
  store(shifts, shift);
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t visible = std::clamp<int64_t>(lim[row] - start, 0, n);
    const vf sh = set1(shifts[row]);
    for (int kb = 0; kb * 16 < n; ++kb) {
      float* p = lane_s + row * kKeyChunk + kb * 16;
      store(p, keep(lanes_below(visible - kb * 16), weight(exp16(sub(load(p), sh)))));
    }
  }
  for (int t = 0; t < n; ++t) {
    for (int64_t row = 0; row < rows; ++row) st[t * W + row] = lane_s[row * kKeyChunk + t];
  }
}

// One (kv head, tile of at most RV * 16 query rows, from row `first`) against the
// prefix's keys; `limits`, when given, holds each row's number of visible keys
// (ascending, causal attention).
// A row's softmax state after keys [0, key_begin) can come in (`state_in`: its unscaled
// output, running max and sum, D + 2 floats a row from the tile's first) and the state
// after the last key can go out (`state_out`) instead of the result: keys walked in two
// calls split at a multiple of kKeyChunk give the same bits as one call, since every
// chunk's steps are the same (a row never depends on the rest of its tile).
// With float32 products, a bfloat16 pool's chunk of keys is widened into float32 rows
// once per chunk, for every row of the tile, since the score pass reads keys one scalar
// at a time; values are read as vectors, widened as they are loaded.
// With Bf16 (bfloat16 products, kv_element.h), queries, keys, probabilities and values
// are rounded to bfloat16 and both products take pairs: of dims for the scores (queries
// paired once per tile, a bfloat16 pool's keys read in place, a float32 pool's rounded
// once per chunk), of successive keys for the output (probabilities and values paired
// once per chunk, an odd last key beside a zero). The softmax state stays float32, and
// its sum takes the rounded probabilities, the ones the output is weighted by. A row's
// steps still do not depend on its tile or chunk split, so a state split at a multiple of
// kKeyChunk gives one pass's bits here too.
template <typename KV, int NV, int RV, bool Bf16>
void attend_prefix(const float* q, int64_t first, int64_t rows, RowLayout layout, float scale,
                   const KV* k_cache, const KV* v_cache, const int32_t* blocks,
                   int64_t keys, int64_t block_size, int64_t block_stride,
                   int64_t token_stride, const int64_t* limits, float* out, float* lse,
                   int64_t key_begin, const float* state_in, float* state_out) {
  constexpr int D = NV * 16;
  constexpr int W = RV * 16;                   // rows, padded to whole vectors
  constexpr int kPvDims = std::min(NV, kPvVecs);
  constexpr int kPvRows = kWideRegisters ? 24 / NV : 6;  // output rows per pass
  // Scaled queries, d-major: qt[d * W + row]; with Bf16, pairs of dims: qt[d / 2 * W + row].
  alignas(64) float qt[D * W];
  alignas(64) float st[kKeyChunk * W + kPvRows];  // scores, then probabilities: [key][row]
  // With Bf16, pairs of successive keys' probabilities ([key / 2][row], and as st a tail
  // for the output passes to read past the last row, see below) and values
  // ([key / 2][dim]).
  alignas(64) float pair_p[Bf16 ? kKeyChunk / 2 * W + kPvRows : 1];
  alignas(64) float pair_v[Bf16 ? kKeyChunk / 2 * D : 1];
  alignas(64) float acc[(W + kPvRows) * D];    // unnormalised outputs
  alignas(64) float m[W], l[W], corr[W + kPvRows];
  alignas(64) int32_t lim[W];
  int64_t q_at[W], out_at[W];
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t query = (first + row) / layout.group, head = (first + row) % layout.group;
    q_at[row] = query * layout.q_stride + head * D;
    out_at[row] = query * layout.out_stride + head * D;
  }
  if constexpr (Bf16) {
    for (int d = 0; d < D; d += 2) {
      for (int row = 0; row < W; ++row) {
        uint32_t pair = 0;
        if (row < rows) {
          const float* x = q + q_at[row] + d;
          pair = pagellm_kernels::round_bf16(x[0] * scale).bits |
                 static_cast<uint32_t>(pagellm_kernels::round_bf16(x[1] * scale).bits) << 16;
        }
        std::memcpy(qt + d / 2 * W + row, &pair, sizeof pair);
      }
    }
    std::fill(pair_p, pair_p + kKeyChunk / 2 * W + kPvRows, 0.0f);
  } else {
    for (int d = 0; d < D; ++d) {
      for (int row = 0; row < W; ++row) {
        qt[d * W + row] = row < rows ? q[q_at[row] + d] * scale : 0.0f;
      }
    }
  }
  int64_t end = keys;
  for (int row = 0; row < W; ++row) {
    // Padding rows copy the last real row's limit: they never widen the key range.
    const int64_t limit = limits == nullptr ? keys : limits[std::min<int64_t>(row, rows - 1)];
    lim[row] = static_cast<int32_t>(std::min(limit, keys));
    m[row] = -std::numeric_limits<float>::infinity();
    l[row] = 0.0f;
  }
  if (limits != nullptr) end = std::min(keys, limits[rows - 1]);
  std::fill(acc, acc + (W + kPvRows) * D, 0.0f);
  if (state_in != nullptr) {
    for (int64_t row = 0; row < rows; ++row) {
      const float* s = state_in + row * (D + 2);
      std::copy(s, s + D, acc + row * D);
      m[row] = s[D];
      l[row] = s[D + 1];
    }
  }
  std::fill(corr, corr + W + kPvRows, 0.0f);
  // The output passes read up to kPvRows - 1 rows past the last real one, into padding,
  // the next key's row or the tail: zeros at first, later what earlier chunks left. Only
  // rows past the last real one take them in, into acc rows that are never written out.
  std::fill(st, st + kKeyChunk * W + kPvRows, 0.0f);
  // Row pointers of a chunk's keys, walked block by block (no division per key). Keys
  // past the end point at the last one: computed, then masked or, in a chunk every row
  // sees whole, harmless duplicates of a real key.
  const auto locate = [&](int64_t first, int count, const KV** k_rows, const KV** v_rows) {
    int64_t b = first / block_size, slot = first % block_size;
    for (int t = 0; t < kKeyChunk; ++t) {
      const int64_t offset = blocks[b] * block_stride + slot * token_stride;
      k_rows[t] = k_cache + offset;
      v_rows[t] = v_cache + offset;
      if (t + 1 < count && ++slot == block_size) {
        slot = 0;
        ++b;
      }
    }
  };
  using KeyRow = std::conditional_t<Bf16, bf16, float>;  // keys as the score pass reads them
  const KeyRow* kp[kKeyChunk];
  const KV* vp[kKeyChunk];
  const KV* next_kp[kKeyChunk];
  const KV* next_vp[kKeyChunk];
  constexpr bool kConvert = !std::is_same_v<KV, KeyRow>;
  // The chunk's keys as KeyRow, where the pool holds the other type (a bfloat16 pool's
  // widened for float32 products, a float32 pool's rounded for bfloat16 ones); otherwise
  // they are read in place.
  alignas(64) KeyRow chunk_k[kConvert ? kKeyChunk * D : 1];
  const vf neg_inf = set1(-std::numeric_limits<float>::infinity());
  // A tile of a few rows (a decode's query heads) takes its scores with keys in the
  // lanes: the chunk's keys transposed, key_t[dim or pair of dims][key], then each row's
  // scores, 16 keys an FMA or vdpbf16ps, at lane_s[row][key]; its probabilities are
  // computed there too and only then laid out in st as the output pass reads them. Each
  // score, probability and sum takes the very steps of the rows-in-lanes way, so a row's
  // bits do not depend on which way its tile went. Why: a decode's 3 rows against a
  // broadcast key used 3 of each instruction's 16 lanes, for the scores, the softmax and
  // (in passes of kPvRows rows) the output. 30 layers, 2 threads, bfloat16 pool,
  // bfloat16 products: 32 decodes over 1,100 keys 59-65 -> 38 ms (the float32 decode
  // kernel, which reads the same pool: 35 ms), 64 over 600 keys 73-80 -> 45 ms, 8 over
  // 300 keys 3.5 -> 2.3; with float32 products, 32 over 1,100 keys 72 -> 53 ms (AVX-512)
  // and 82 -> 54 ms (AVX2).
  constexpr bool kLaneKernel = RV == 1;
  const bool lanes = kLaneKernel && rows <= kLaneRows;
  alignas(64) float key_t[kLaneKernel ? (Bf16 ? D / 2 : D) * kKeyChunk : 1];
  alignas(64) float lane_s[kLaneKernel ? kLaneRows * kKeyChunk : 1];
  if (end > key_begin) {
    locate(key_begin, static_cast<int>(std::min<int64_t>(kKeyChunk, end - key_begin)), next_kp,
           next_vp);
  }
  for (int64_t start = key_begin; start < end; start += kKeyChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kKeyChunk, end - start));
    if constexpr (kConvert) {
      // Rows past the n-th point at the last one, as `locate` leaves them.
      for (int t = 0; t < kKeyChunk; ++t) {
        if (t < n) {
          PAGELLM_UNROLL
          for (int v = 0; v < NV; ++v) {
            const vf key = load_kv(next_kp[t] + v * 16);
            if constexpr (Bf16) {
              store_bf16(chunk_k + t * D + v * 16, key);
            } else {
              store(chunk_k + t * D + v * 16, key);
            }
          }
        }
        kp[t] = chunk_k + std::min(t, n - 1) * D;
      }
    } else {
      std::copy(next_kp, next_kp + kKeyChunk, kp);
    }
    std::copy(next_vp, next_vp + kKeyChunk, vp);
    // The next chunk's rows of this head, fetched while this chunk is computed: each
    // key's row is a short piece of a token's slot, too scattered for the hardware
    // prefetcher to run ahead of (a decode cascade, 96 rows x 768 keys, 30 layers
    // streamed from memory: 6.6-7.2 -> 5.7-6.0 ms). Into L2, not L1: the next chunk's
    // keys and values (24 KB for 64 dims) beside this chunk's evicted the values before
    // the output pass read them. AVX2, 30 layers, in-process A/B: 96 rows x 1,024 keys
    // 24.0 -> 20.8 ms, 24 rows x 512 keys 7.3 -> 6.1 ms; a 512-token chunk, whose keys
    // stay in cache for all its rows, unchanged.
    const int64_t next = start + kKeyChunk;
    if (next < end) {
      const int next_n = static_cast<int>(std::min<int64_t>(kKeyChunk, end - next));
      locate(next, next_n, next_kp, next_vp);
      for (int t = 0; t < next_n; ++t) {
        for (int line = 0; line < D; line += kLineElements<KV>) {
          _mm_prefetch(reinterpret_cast<const char*>(next_kp[t] + line), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(next_vp[t] + line), _MM_HINT_T1);
        }
      }
    }
    // Rows' limits ascend: when the first row sees the whole chunk, every row does, and
    // the softmax needs no masks; its maximum is then taken from the score registers.
    const bool whole = start + n <= lim[0];
    vf top[RV];
    PAGELLM_UNROLL
    for (int r = 0; r < RV; ++r) top[r] = neg_inf;
    if constexpr (kLaneKernel) {
      if (lanes) lane_scores<D, W, KeyRow>(qt, kp, rows, lim, start, n, key_t, lane_s, top);
    }
    for (int t0 = 0; t0 < (lanes ? 0 : n); t0 += kKeysPerPass) {
      int r0 = 0;
      for (; r0 + kScoreVecs <= RV; r0 += kScoreVecs) {
        score_pass<D, W, kScoreVecs, KeyRow>(qt, kp + t0, r0, st + t0 * W, whole, top);
      }
      if constexpr (RV % kScoreVecs != 0) {
        score_pass<D, W, RV % kScoreVecs, KeyRow>(qt, kp + t0, r0, st + t0 * W, whole, top);
      }
    }
    for (int r = 0; r < RV; ++r) {
      // Key start + t is visible to a row while start + t < its limit.
      const vi visible = sub_i(load_i(lim + r * 16), set1_i(static_cast<int32_t>(start)));
      if (!whole && !lanes) {
        for (int t = 0; t < n; ++t) {
          const vmask mask = gt_i(visible, set1_i(t));
          top[r] = max(top[r], select(mask, load(st + t * W + r * 16), neg_inf));
        }
      }
      const vf old_m = load(m + r * 16);
      const vf new_m = max(old_m, top[r]);
      // A row with nothing visible yet keeps m = -inf; shifting it by 0 keeps exp at 0.
      const vf shift = select(eq(new_m, neg_inf), zero(), new_m);
      const vf c = exp16(sub(old_m, shift));
      // A probability as the output is weighted by it.
      const auto weight = [](vf e) {
        if constexpr (Bf16) return to_bf16_values(e);
        else return e;
      };
      vf sum = zero();
      if (lanes) {
        if constexpr (kLaneKernel) {
          lane_probabilities<W>(lane_s, rows, lim, start, n, shift, weight, st);
          for (int t = 0; t < n; ++t) sum = add(sum, load(st + t * W));
        }
      } else if (whole) {
        for (int t = 0; t < n; ++t) {
          float* p = st + t * W + r * 16;
          const vf e = weight(exp16(sub(load(p), shift)));
          store(p, e);
          sum = add(sum, e);
        }
      } else {
        for (int t = 0; t < n; ++t) {
          const vmask mask = gt_i(visible, set1_i(t));
          float* p = st + t * W + r * 16;
          const vf e = keep(mask, weight(exp16(sub(load(p), shift))));
          store(p, e);
          sum = add(sum, e);
        }
      }
      store(m + r * 16, new_m);
      store(l + r * 16, fmadd(load(l + r * 16), c, sum));
      store(corr + r * 16, c);
    }
    if constexpr (Bf16) {
      for (int t = 0; t < n; t += 2) {
        const bool second = t + 1 < n;
        PAGELLM_UNROLL
        for (int r = 0; r < RV; ++r) {
          store(pair_p + t / 2 * W + r * 16,
                pack_bf16_pairs(load(st + t * W + r * 16),
                                second ? load(st + (t + 1) * W + r * 16) : zero()));
        }
        PAGELLM_UNROLL
        for (int v = 0; v < NV; ++v) {
          store(pair_v + t / 2 * D + v * 16,
                pack_bf16_pairs(load_bf16_values(vp[t] + v * 16),
                                second ? load_bf16_values(vp[t + 1] + v * 16) : zero()));
        }
      }
    }
    const int steps = Bf16 ? (n + 1) / 2 : n;  // output steps: keys, or pairs of keys
    // P rows from r0 a pass. A row's steps are the same whatever P, so a tile of fewer
    // rows than a full pass (a decode's query heads) takes a pass of just its rows.
    const auto output_pass = [&]<int P>(int64_t r0) {
      for (int d0 = 0; d0 < D; d0 += kPvDims * 16) {
        vf o[P][kPvDims];
        PAGELLM_UNROLL
        for (int i = 0; i < P; ++i) {
          const vf c = set1(corr[r0 + i]);
          PAGELLM_UNROLL
          for (int v = 0; v < kPvDims; ++v) {
            o[i][v] = mul(load(acc + (r0 + i) * D + d0 + v * 16), c);
          }
        }
        for (int t = 0; t < steps; ++t) {
          vf val[kPvDims];
          PAGELLM_UNROLL
          for (int v = 0; v < kPvDims; ++v) {
            if constexpr (Bf16) {
              val[v] = in_register(load(pair_v + t * D + d0 + v * 16));
            } else {
              val[v] = in_register(load_kv(vp[t] + d0 + v * 16));
            }
          }
          const float* p = (Bf16 ? pair_p : st) + t * W + r0;
          PAGELLM_UNROLL
          for (int i = 0; i < P; ++i) {
            const vf pt = set1(p[i]);
            PAGELLM_UNROLL
            for (int v = 0; v < kPvDims; ++v) {
              if constexpr (Bf16) {
                o[i][v] = dot_bf16_pairs(o[i][v], pt, val[v]);
              } else {
                o[i][v] = fmadd(pt, val[v], o[i][v]);
              }
            }
          }
        }
        PAGELLM_UNROLL
        for (int i = 0; i < P; ++i) {
          PAGELLM_UNROLL
          for (int v = 0; v < kPvDims; ++v) store(acc + (r0 + i) * D + d0 + v * 16, o[i][v]);
        }
      }
    };
    if constexpr (RV == 1) {
      if (rows < kPvRows) {
        few_rows_pass<1, kPvRows>(rows, output_pass);
        continue;
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kPvRows) output_pass.template operator()<kPvRows>(r0);
  }
  for (int64_t row = 0; row < rows; ++row) {
    if (state_out != nullptr) {
      float* s = state_out + row * (D + 2);
      std::copy(acc + row * D, acc + (row + 1) * D, s);
      s[D] = m[row];
      s[D + 1] = l[row];
      continue;
    }
    const vf inv = set1(1.0f / l[row]);
    PAGELLM_UNROLL
    for (int v = 0; v < NV; ++v) {
      storeu(out + out_at[row] + v * 16, mul(load(acc + row * D + v * 16), inv));
    }
    lse[row] = m[row] + std::log(l[row]);
  }
}

template <typename KV>
using PrefixFn = void (*)(const float*, int64_t, int64_t, RowLayout, float, const KV*,
                          const KV*, const int32_t*, int64_t, int64_t, int64_t, int64_t,
                          const int64_t*, float*, float*, int64_t, const float*, float*);

template <typename KV, int NV, bool Bf16>
PrefixFn<KV> pick_prefix_rows(int64_t rows) {
  switch ((rows + 15) / 16) {
    case 1: return attend_prefix<KV, NV, 1, Bf16>;
    case 2: return attend_prefix<KV, NV, 2, Bf16>;
    case 3: return attend_prefix<KV, NV, 3, Bf16>;
    default: return attend_prefix<KV, NV, 4, Bf16>;
  }
}

// The prefix kernel for a tile of `rows` rows of `dim` dims; with bfloat16 products only
// where this build has them (check_bf16_products), the only builds that instantiate them.
template <typename KV>
PrefixFn<KV> pick_prefix(int64_t dim, int64_t rows, bool bf16_products) {
  if constexpr (kBf16Products) {
    if (bf16_products) {
      return dim == 64 ? pick_prefix_rows<KV, 4, true>(rows) : pick_prefix_rows<KV, 8, true>(rows);
    }
  }
  return dim == 64 ? pick_prefix_rows<KV, 4, false>(rows) : pick_prefix_rows<KV, 8, false>(rows);
}

void check_bf16_products(const char* op, bool bf16_products) {
  TORCH_CHECK(!bf16_products || kBf16Products, op,
              ": bf16_products needs AVX-512 BF16, which this build of the kernels has not "
              "(see bf16_products_available)");
}

// Whether the kernels take bf16_products here: built for a CPU with AVX-512 BF16.
bool bf16_products_available() { return kBf16Products; }

// q [R, H, D], the model's queries in place (check_queries), kv head h's rows being heads
// hG .. hG + G - 1 of each query (G = group), so M = R * G rows a kv head. k_cache,
// v_cache [N, B, Hkv, D]; blocks [nb] int32. Returns out [Hkv, M, D], lse [Hkv, M]. Why
// in place: a decode cascade had copied its queries into [Hkv, M, D] every layer (~12 us,
// with the Python around it ~25 us a layer).
// With `with_state`, returns instead each row's softmax state after the prefix (see
// attend_prefix) as state [Hkv, M, D + 2], and an empty tensor: for
// paged_prefill_attention to go on from (`prior_state`), which must take the same
// `bf16_products` (see attend_prefix).
std::tuple<at::Tensor, at::Tensor> prefix_attention(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& blocks, double scale, int64_t group, bool with_state,
    bool bf16_products) {
  check_queries("paged_prefix_attention", q);
  check_bf16_products("paged_prefix_attention", bf16_products);
  TORCH_CHECK(group >= 1 && q.size(1) % group == 0,
              "paged_prefix_attention: rows must be whole groups of query heads");
  check_caches("paged_prefix_attention", k_cache, v_cache);
  TORCH_CHECK(blocks.dim() == 1 && blocks.scalar_type() == at::kInt && blocks.is_contiguous() &&
                  blocks.numel() >= 1,
              "paged_prefix_attention: blocks must be a non-empty int32 vector");
  const int64_t dim = q.size(2), block_size = k_cache.size(1);
  const int64_t kv_heads = q.size(1) / group, rows = q.size(0) * group;
  TORCH_CHECK(k_cache.size(2) == kv_heads && k_cache.size(3) == dim,
              "paged_prefix_attention: shapes do not match");
  TORCH_CHECK(dim == 64 || dim == 128, "paged_prefix_attention: ", dim,
              " dims are not supported");
  TORCH_CHECK(rows >= 1, "paged_prefix_attention: no queries");
  const int32_t* bp = blocks.data_ptr<int32_t>();
  for (int64_t b = 0; b < blocks.numel(); ++b) {
    TORCH_CHECK(bp[b] >= 0 && bp[b] < k_cache.size(0), "paged_prefix_attention: block ",
                bp[b], " is outside the cache");
  }
  at::Tensor out = at::empty({kv_heads, rows, with_state ? dim + 2 : dim}, q.options());
  at::Tensor lse = at::empty({with_state ? 0 : kv_heads, rows}, q.options());
  float* state = with_state ? out.data_ptr<float>() : nullptr;
  const float* qp = q.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const int64_t token_stride = kv_heads * dim, block_stride = block_size * token_stride;
  // Rows split evenly over the fewest tiles (96 rows: two of 48, not 64 + 32), so the
  // tasks the threads share are the same size. Where that leaves fewer than
  // kMinPrefixTasks (a cascade of a few requests: 3 kv heads, one tile each), the keys
  // are split too, each part attended alone and the parts merged through their
  // log-sum-exp. Why: 3 tasks on 2 threads left one thread idle half the time; 30
  // layers, in-process A/B: 6 rows x 1,024 keys 4.71 -> 3.87 ms, 48 rows x 2,048 keys
  // 14.4 -> 10.7 ms. The count is fixed, not taken from the thread pool, so a result
  // does not depend on how many threads computed it. A state is never split: the merge
  // rounds otherwise than one pass.
  const int64_t tiles = (rows + kPrefixRowTile - 1) / kPrefixRowTile;
  const int64_t tile_rows = ((rows + tiles - 1) / tiles + 15) / 16 * 16;
  const int64_t n_blocks = blocks.numel(), tasks = kv_heads * tiles;
  const int64_t splits = tasks >= kMinPrefixTasks || with_state
      ? 1 : std::min(n_blocks, (kMinPrefixTasks + tasks - 1) / tasks);
  at::Tensor part_out, part_lse;
  if (splits > 1) {
    part_out = at::empty({splits, kv_heads, rows, dim}, q.options());
    part_lse = at::empty({splits, kv_heads, rows}, q.options());
  }
  float* pop = splits > 1 ? part_out.data_ptr<float>() : nullptr;
  float* plp = splits > 1 ? part_lse.data_ptr<float>() : nullptr;
  // Tasks go head by head, so a thread's next task mostly reads the keys its last one
  // left in L2.
  with_elements(k_cache, [&](auto element) {
    using KV = decltype(element);
    const KV* kp = elements<KV>(k_cache);
    const KV* vp = elements<KV>(v_cache);
    for_each_task(tasks * splits, [&](int64_t i) {
      const int64_t split = i % splits, task = i / splits;
      const int64_t h = task / tiles, r0 = (task % tiles) * tile_rows;
      const int64_t n = std::min(tile_rows, rows - r0);  // >= 1: (tiles - 1) * 64 < rows
      // A head's output rows are one contiguous run.
      const RowLayout layout{group, q.stride(0), group * dim};
      const int64_t head_offset = h * rows * dim;
      const float* head_q = qp + h * group * dim;
      const PrefixFn<KV> fn = pick_prefix<KV>(dim, n, bf16_products);
      const int64_t b0 = n_blocks * split / splits, b1 = n_blocks * (split + 1) / splits;
      float* o =
          splits > 1 ? pop + split * kv_heads * rows * dim + head_offset : op + head_offset;
      float* l = splits > 1 ? plp + split * kv_heads * rows + h * rows + r0 : lp + h * rows + r0;
      fn(head_q, r0, n, layout, sc, kp + h * dim, vp + h * dim, bp + b0,
         (b1 - b0) * block_size, block_size, block_stride, token_stride, nullptr, o, l, 0,
         nullptr, state == nullptr ? nullptr : state + (h * rows + r0) * (dim + 2));
    });
  });
  if (splits > 1) {
    const int64_t part_stride = kv_heads * rows;
    for (int64_t row = 0; row < kv_heads * rows; ++row) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < splits; ++s) top = std::max(top, plp[s * part_stride + row]);
      float total = 0.0f;
      float w[kMinPrefixTasks];
      for (int64_t s = 0; s < splits; ++s) {
        w[s] = std::exp(plp[s * part_stride + row] - top);
        total += w[s];
      }
      for (int64_t d0 = 0; d0 < dim; d0 += 16) {
        vf acc = zero();
        for (int64_t s = 0; s < splits; ++s) {
          acc = fmadd(set1(w[s] / total),
                                loadu(pop + (s * part_stride + row) * dim + d0), acc);
        }
        storeu(op + row * dim + d0, acc);
      }
      lp[row] = top + std::log(total);
    }
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> paged_prefix_attention(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& blocks, double scale, int64_t group) {
  return prefix_attention(q, k_cache, v_cache, blocks, scale, group, false, false);
}

// Each row's softmax state over the prefix, [Hkv, M, D + 2] (see prefix_attention).
at::Tensor paged_prefix_state(const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& blocks, double scale,
                              int64_t group, bool bf16_products) {
  return std::get<0>(
      prefix_attention(q, k_cache, v_cache, blocks, scale, group, true, bf16_products));
}

// Every prompt chunk of a step in one call: request r's queries are rows starts[r] ..
// starts[r] + lens[r] of q [T, H, D] (the model's layout: rows may be strided, each
// query's heads contiguous), at positions contexts[r] + i, each seeing keys 0 ..
// contexts[r] + i of its row of `tables` [R, W] int32, read in place. Returns out
// [sum(lens), H, D], request after request, and lse [Hkv, sum(lens) * group].
// With `prior_state` [Hkv, sum(lens) * group, D + 2] (rows as lse's: paged_prefix_state of
// these queries over each request's first `prior_keys` keys, a multiple of 48 below every
// query's position), each row goes on from that state at key `prior_keys`: the same bits
// as attending all its keys here (a cascade that keeps every token's result the same
// whatever shares its step; see use_row_invariant_attention in attention/batched.py),
// given the same `bf16_products` (attend_prefix) as the state.
// Why: a step's chunks had gone through one padded SDPA call per shape bucket (keys
// gathered, an additive mask, padded rows and keys computed and thrown away), or a cascade
// of the shared prefix plus each request's own keys merged by log-sum-exp. Here each
// (request, kv head, row tile) is a task of the prefix kernel, with no copy, padding or
// merge; on prompt chunks, compute-bound, reading a shared prefix once per request costs
// nothing measurable.
std::tuple<at::Tensor, at::Tensor> paged_prefill_attention(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& tables, const at::Tensor& starts, const at::Tensor& lens,
    const at::Tensor& contexts, double scale, int64_t group,
    const std::optional<at::Tensor>& prior_state, int64_t prior_keys, bool bf16_products) {
  check_queries("paged_prefill_attention", q);
  check_bf16_products("paged_prefill_attention", bf16_products);
  check_caches("paged_prefill_attention", k_cache, v_cache);
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kInt && tables.is_contiguous(),
              "paged_prefill_attention: tables must be contiguous int32 [R, W]");
  const int64_t requests = tables.size(0);
  for (const at::Tensor* t : {&starts, &lens, &contexts}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == requests && t->scalar_type() == at::kLong &&
                    t->is_contiguous(),
                "paged_prefill_attention: starts, lens and contexts must be int64 [R]");
  }
  TORCH_CHECK(group >= 1 && q.size(1) % group == 0,
              "paged_prefill_attention: rows must be whole groups of query heads");
  const int64_t dim = q.size(2), block_size = k_cache.size(1), kv_heads = q.size(1) / group;
  TORCH_CHECK(k_cache.size(2) == kv_heads && k_cache.size(3) == dim,
              "paged_prefill_attention: shapes do not match");
  TORCH_CHECK(dim == 64 || dim == 128, "paged_prefill_attention: ", dim,
              " dims are not supported");
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* np = lens.data_ptr<int64_t>();
  const int64_t* cp = contexts.data_ptr<int64_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  std::vector<int64_t> first(requests + 1, 0);  // each request's first output row
  for (int64_t r = 0; r < requests; ++r) {
    TORCH_CHECK(np[r] >= 1 && sp[r] >= 0 && np[r] <= q.size(0) - sp[r] && cp[r] >= 0 &&
                    np[r] <= tables.size(1) * block_size - cp[r],
                "paged_prefill_attention: request ", r, " has queries or keys out of range");
    for (int64_t b = 0; b < (cp[r] + np[r] + block_size - 1) / block_size; ++b) {
      const int32_t id = tp[r * tables.size(1) + b];
      TORCH_CHECK(id >= 0 && id < k_cache.size(0), "paged_prefill_attention: request ", r,
                  " reads block ", id, ", outside the cache");
    }
    first[r + 1] = first[r] + np[r];
  }
  const int64_t total = first[requests];
  const float* prior = nullptr;
  TORCH_CHECK(prior_state || prior_keys == 0,
              "paged_prefill_attention: prior_keys without a prior_state");
  if (prior_state) {
    TORCH_CHECK(prior_state->dim() == 3 && prior_state->size(0) == kv_heads &&
                    prior_state->size(1) == total * group && prior_state->size(2) == dim + 2 &&
                    prior_state->scalar_type() == at::kFloat && prior_state->is_contiguous(),
                "paged_prefill_attention: prior_state must be float32 [Hkv, rows, D + 2]");
    TORCH_CHECK(prior_keys > 0 && prior_keys % kKeyChunk == 0,
                "paged_prefill_attention: prior_keys must be a positive multiple of ",
                kKeyChunk);
    for (int64_t r = 0; r < requests; ++r) {
      TORCH_CHECK(cp[r] >= prior_keys, "paged_prefill_attention: request ", r, " has ", cp[r],
                  " keys before its queries, fewer than the prior state's ", prior_keys);
    }
    prior = prior_state->data_ptr<float>();
  }
  at::Tensor out = at::empty({total, q.size(1), dim}, q.options());
  at::Tensor lse = at::empty({kv_heads, total * group}, q.options());
  // (request, kv head, first row, rows): requests with the most keys first, so the
  // longest tasks are not left for last; within a request head by head, so a thread's
  // next task mostly reads the keys its last one left in L2, and last tile first: the
  // last tiles see the most keys, and a head's short tasks even out the end.
  struct Task {
    int64_t r, h, r0, n;
  };
  std::vector<int64_t> order(requests);
  for (int64_t r = 0; r < requests; ++r) order[r] = r;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cp[a] + np[a] > cp[b] + np[b]; });
  std::vector<Task> tasks;
  for (const int64_t r : order) {
    const int64_t rows = np[r] * group;
    const int64_t tiles = (rows + kPrefixRowTile - 1) / kPrefixRowTile;
    const int64_t tile_rows = ((rows + tiles - 1) / tiles + 15) / 16 * 16;
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t t = tiles - 1; t >= 0; --t) {
        tasks.push_back({r, h, t * tile_rows, std::min(tile_rows, rows - t * tile_rows)});
      }
    }
  }
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t token_stride = kv_heads * dim, block_stride = block_size * token_stride;
  const RowLayout layout{group, q.stride(0), out.stride(0)};
  with_elements(k_cache, [&](auto element) {
    using KV = decltype(element);
    const KV* kp = elements<KV>(k_cache);
    const KV* vp = elements<KV>(v_cache);
    for_each_task(static_cast<int64_t>(tasks.size()), [&](int64_t i) {
      const Task& t = tasks[i];
      int64_t limits[kPrefixRowTile];
      for (int64_t j = 0; j < t.n; ++j) limits[j] = cp[t.r] + (t.r0 + j) / group + 1;
      const PrefixFn<KV> fn = pick_prefix<KV>(dim, t.n, bf16_products);
      const int64_t head = t.h * group * dim;
      fn(qp + sp[t.r] * q.stride(0) + head, t.r0, t.n, layout, sc, kp + t.h * dim,
         vp + t.h * dim, tp + t.r * tables.size(1), cp[t.r] + np[t.r], block_size,
         block_stride, token_stride, limits, op + first[t.r] * out.stride(0) + head,
         lp + t.h * total * group + first[t.r] * group + t.r0, prior ? prior_keys : 0,
         prior ? prior + (t.h * total * group + first[t.r] * group + t.r0) * (dim + 2)
               : nullptr,
         nullptr);
    });
  });
  return {out, lse};
}

// Stores a step's new key and value rows [T, Hkv, D] (rows may be strided, as the k and v
// column ranges of the fused qkv output are) at flat slots of kv_cache [2, N, B, Hkv, D],
// rounded to bfloat16 for a bfloat16 pool. Why: torch's two index_copy_ calls cost ~25 us
// each per layer even for a decode step's few rows, in TensorIterator set-up; here a
// float32 row is a memcpy.
void write_kv_cache_(at::Tensor kv_cache, const at::Tensor& key, const at::Tensor& value,
                     const at::Tensor& slots) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  (kv_cache.scalar_type() == at::kFloat ||
                   kv_cache.scalar_type() == at::kBFloat16),
              "write_kv_cache_: kv_cache must be a contiguous float32 or bfloat16 "
              "[2, N, B, Hkv, D] tensor");
  const int64_t kv_heads = kv_cache.size(3), dim = kv_cache.size(4);
  for (const at::Tensor* rows : {&key, &value}) {
    TORCH_CHECK(rows->dim() == 3 && rows->scalar_type() == at::kFloat &&
                    rows->size(1) == kv_heads && rows->size(2) == dim &&
                    (rows->stride(2) == 1 || dim == 1) &&
                    (rows->stride(1) == dim || kv_heads == 1) && rows->size(0) == slots.numel(),
                "write_kv_cache_: key and value must be float32 [T, Hkv, D] with contiguous "
                "rows, one per slot");
  }
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "write_kv_cache_: slots must be a contiguous int64 vector");
  const int64_t tokens = slots.numel(), capacity = kv_cache.size(1) * kv_cache.size(2);
  const int64_t row = kv_heads * dim;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "write_kv_cache_: slot ", sp[t],
                " is outside the cache's ", capacity, " slots");
  }
  const float* keys = key.data_ptr<float>();
  const float* values = value.data_ptr<float>();
  const int64_t key_stride = key.stride(0), value_stride = value.stride(0);
  with_elements(kv_cache, [&](auto element) {
    using KV = decltype(element);
    KV* kp = static_cast<KV*>(kv_cache.data_ptr());
    KV* vp = kp + capacity * row;
    // A decode step's rows stay on one thread: waking the pool costs more than the copy.
    at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        pagellm_kernels::store_row(kp + sp[t] * row, keys + t * key_stride, row);
        pagellm_kernels::store_row(vp + sp[t] * row, values + t * value_stride, row);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor lens, float scale, Tensor? prior_out=None, Tensor? prior_lse=None) "
        "-> (Tensor, Tensor)");
  m.def("paged_prefix_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor blocks, "
        "float scale, int group) -> (Tensor, Tensor)");
  m.def("paged_prefix_state(Tensor q, Tensor k_cache, Tensor v_cache, Tensor blocks, "
        "float scale, int group, bool bf16_products=False) -> Tensor");
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, "
        "Tensor starts, Tensor lens, Tensor contexts, float scale, int group, "
        "Tensor? prior_state=None, int prior_keys=0, bool bf16_products=False) "
        "-> (Tensor, Tensor)");
  m.def("bf16_products_available() -> bool", &bf16_products_available);
  m.def("write_kv_cache_(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefix_attention", &paged_prefix_attention);
  m.impl("paged_prefix_state", &paged_prefix_state);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("write_kv_cache_", &write_kv_cache_);
}
