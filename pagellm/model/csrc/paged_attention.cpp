// Decode attention straight from the paged KV cache: one query token per request, read
// through its block table, so no copy of the request's keys and values is ever made.
//
// Why: with the torch ops, a decode step first gathers every request's blocks into a
// contiguous buffer (a full extra write and read of the context) and then runs a flash
// kernel whose tiles are sized for long queries, not for G = heads / kv_heads rows.
// Here each (request, kv head) pair streams its keys and values once, block by block,
// with the G query heads that share that kv head (grouped-query attention).
//
// Softmax is the usual online one, rescaled once per block of keys; the result is the
// same attention in another order of float32 operations. The log-sum-exp of the scores is
// returned too, so a partial attention (a request's own blocks after a shared prefix) can
// be merged with another exactly.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

namespace {

using pagellm_kernels::exp16;

constexpr int kMaxBlock = 64;  // tokens per KV block the kernel handles

// One (request, kv head): G query heads of NV * 16 dims against `len` keys.
template <int G, int NV>
void attend(const float* q, const float* k_cache, const float* v_cache, const int32_t* blocks,
            int64_t len, int64_t block_size, int64_t block_stride, int64_t token_stride,
            float scale, float* out, float* lse) {
  __m512 qv[G][NV], acc[G][NV];
  float m[G], l[G];
  for (int g = 0; g < G; ++g) {
    for (int v = 0; v < NV; ++v) {
      qv[g][v] = _mm512_mul_ps(_mm512_loadu_ps(q + g * NV * 16 + v * 16), _mm512_set1_ps(scale));
      acc[g][v] = _mm512_setzero_ps();
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
  }
  alignas(64) float s[G][kMaxBlock];
  for (int64_t start = 0, b = 0; start < len; start += block_size, ++b) {
    const int64_t n = std::min(block_size, len - start);
    const float* kb = k_cache + blocks[b] * block_stride;
    const float* vb = v_cache + blocks[b] * block_stride;
    // The next block lies anywhere in the pool, out of the hardware prefetcher's sight:
    // ask for its rows of this head while this block is computed.
    const bool more = start + block_size < len;
    const float* next_k = more ? k_cache + blocks[b + 1] * block_stride : nullptr;
    const float* next_v = more ? v_cache + blocks[b + 1] * block_stride : nullptr;
    for (int64_t t = 0; t < n; ++t) {
      if (more) {
        for (int v = 0; v < NV; ++v) {
          _mm_prefetch(reinterpret_cast<const char*>(next_k + t * token_stride + v * 16),
                       _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(next_v + t * token_stride + v * 16),
                       _MM_HINT_T0);
        }
      }
      const float* k = kb + t * token_stride;
      __m512 kv[NV];
      for (int v = 0; v < NV; ++v) kv[v] = _mm512_loadu_ps(k + v * 16);
      for (int g = 0; g < G; ++g) {
        __m512 dot = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int v = 1; v < NV; ++v) dot = _mm512_fmadd_ps(qv[g][v], kv[v], dot);
        s[g][t] = _mm512_reduce_add_ps(dot);
      }
    }
    for (int g = 0; g < G; ++g) {
      float block_max = s[g][0];
      for (int64_t t = 1; t < n; ++t) block_max = std::max(block_max, s[g][t]);
      const float new_m = std::max(m[g], block_max);
      const float correction = std::exp(m[g] - new_m);
      m[g] = new_m;
      float sum = 0.0f;
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const __mmask16 valid = n - t0 >= 16 ? 0xFFFF : (1u << (n - t0)) - 1;
        const __m512 e = exp16(_mm512_sub_ps(
            _mm512_maskz_loadu_ps(valid, s[g] + t0), _mm512_set1_ps(new_m)));
        const __m512 p = _mm512_maskz_mov_ps(valid, e);
        _mm512_storeu_ps(s[g] + t0, p);
        sum += _mm512_reduce_add_ps(p);
      }
      l[g] = l[g] * correction + sum;
      const __m512 c = _mm512_set1_ps(correction);
      for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_mul_ps(acc[g][v], c);
    }
    for (int64_t t = 0; t < n; ++t) {
      const float* vt = vb + t * token_stride;
      for (int v = 0; v < NV; ++v) {
        const __m512 val = _mm512_loadu_ps(vt + v * 16);
        for (int g = 0; g < G; ++g) {
          acc[g][v] = _mm512_fmadd_ps(_mm512_set1_ps(s[g][t]), val, acc[g][v]);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[g]);
    for (int v = 0; v < NV; ++v) {
      _mm512_storeu_ps(out + g * NV * 16 + v * 16, _mm512_mul_ps(acc[g][v], inv));
    }
    lse[g] = m[g] + std::log(l[g]);
  }
}

using AttendFn = void (*)(const float*, const float*, const float*, const int32_t*, int64_t,
                          int64_t, int64_t, int64_t, float, float*, float*);

template <int G>
AttendFn pick_dims(int64_t nv) {
  switch (nv) {
    case 4: return attend<G, 4>;
    case 8: return attend<G, 8>;
    default: return nullptr;
  }
}

AttendFn pick(int64_t group, int64_t nv) {
  switch (group) {
    case 1: return pick_dims<1>(nv);
    case 2: return pick_dims<2>(nv);
    case 3: return pick_dims<3>(nv);
    case 4: return pick_dims<4>(nv);
    case 5: return pick_dims<5>(nv);
    case 6: return pick_dims<6>(nv);
    case 7: return pick_dims<7>(nv);
    case 8: return pick_dims<8>(nv);
    default: return nullptr;
  }
}

// q [R, H, D]; k_cache, v_cache [N, B, Hkv, D]; block_tables [R, W] int32, row r the
// blocks of request r's keys from its first; lens [R] keys per request (>= 1).
// Returns out [R, H, D] and the log-sum-exp of the (scaled) scores [R, H].
std::tuple<at::Tensor, at::Tensor> paged_decode_attention(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_tables, const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "paged_decode_attention: q must be a contiguous float32 [R, H, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "paged_decode_attention: caches must be contiguous float32 [N, B, Hkv, D]");
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
  const AttendFn fn = dim % 16 == 0 ? pick(heads / kv_heads, dim / 16) : nullptr;
  TORCH_CHECK(fn != nullptr, "paged_decode_attention: ", heads / kv_heads,
              " query heads per kv head of ", dim, " dims are not supported");
  at::Tensor out = at::empty({requests, heads, dim}, q.options());
  at::Tensor lse = at::empty({requests, heads}, q.options());
  const int32_t* len_p = lens.data_ptr<int32_t>();
  const int64_t width = block_tables.size(1);
  for (int64_t r = 0; r < requests; ++r) {
    TORCH_CHECK(len_p[r] >= 1 && len_p[r] <= width * block_size,
                "paged_decode_attention: request ", r, " has ", len_p[r], " keys for ", width,
                " blocks");
  }
  const int64_t group = heads / kv_heads;
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const int64_t token_stride = kv_heads * dim, block_stride = block_size * token_stride;
  const float s = static_cast<float>(scale);
  at::parallel_for(0, requests * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / kv_heads, h = i % kv_heads;
      const int64_t q_offset = (r * heads + h * group) * dim;
      fn(qp + q_offset, kp + h * dim, vp + h * dim, tables + r * table_stride, len_p[r],
         block_size, block_stride, token_stride, s, op + q_offset, lp + r * heads + h * group);
    }
  });
  return {out, lse};
}

// Many queries against one run of keys with no mask: every query of every request of a
// cascade group against their shared prefix (`blocks`, whole blocks, read in place).
// Keys go in chunks of 64, transposed into d-major tiles so that scores come out of
// broadcast FMAs with no horizontal sums, four query rows sharing each tile load; the
// online softmax is rescaled once per chunk.
constexpr int kChunk = 64;
constexpr int kChunkVecs = kChunk / 16;
constexpr int kRowsPerPass = 4;

// `limits`, when given, holds each row's number of visible keys (causal attention): key
// start + t is masked for a row once start + t >= limits[row].
template <int NV>
void attend_chunk_rows(const float* q, int64_t rows, const float* kt, const float* vt,
                       int valid, const int64_t* limits, int64_t start, float* m, float* l,
                       float* acc) {
  constexpr int D = NV * 16;
  const int used = (valid + 15) / 16;
  for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass) {
    const int n = static_cast<int>(std::min<int64_t>(kRowsPerPass, rows - r0));
    __m512 s[kRowsPerPass][kChunkVecs];
    for (int i = 0; i < kRowsPerPass; ++i) {
      for (int c = 0; c < kChunkVecs; ++c) s[i][c] = _mm512_setzero_ps();
    }
    for (int d = 0; d < D; ++d) {
      for (int c = 0; c < kChunkVecs; ++c) {
        if (c >= used) break;
        const __m512 k = _mm512_load_ps(kt + d * kChunk + c * 16);
        for (int i = 0; i < kRowsPerPass; ++i) {
          if (i < n) s[i][c] = _mm512_fmadd_ps(_mm512_set1_ps(q[(r0 + i) * D + d]), k, s[i][c]);
        }
      }
    }
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int i = 0; i < n; ++i) {
      const int64_t row = r0 + i;
      const int row_valid = limits == nullptr ? valid
          : static_cast<int>(std::clamp<int64_t>(limits[row] - start, 0, valid));
      if (row_valid == 0) continue;
      __mmask16 masks[kChunkVecs];
      for (int c = 0; c < kChunkVecs; ++c) {
        const int left = row_valid - c * 16;
        masks[c] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (1u << left) - 1;
      }
      __m512 top = neg_inf;
      for (int c = 0; c < used; ++c) {
        s[i][c] = _mm512_mask_mov_ps(neg_inf, masks[c], s[i][c]);
        top = _mm512_max_ps(top, s[i][c]);
      }
      const float new_m = std::max(m[row], _mm512_reduce_max_ps(top));
      const float correction = std::exp(m[row] - new_m);
      const __m512 shift = _mm512_set1_ps(new_m);
      alignas(64) float probs[kChunk];
      __m512 total = _mm512_setzero_ps();
      for (int c = 0; c < used; ++c) {
        const __m512 p = _mm512_maskz_mov_ps(masks[c], exp16(_mm512_sub_ps(s[i][c], shift)));
        total = _mm512_add_ps(total, p);
        _mm512_store_ps(probs + c * 16, p);
      }
      m[row] = new_m;
      l[row] = l[row] * correction + _mm512_reduce_add_ps(total);
      float* a = acc + row * D;
      __m512 out[NV];
      const __m512 corr = _mm512_set1_ps(correction);
      for (int v = 0; v < NV; ++v) out[v] = _mm512_mul_ps(_mm512_loadu_ps(a + v * 16), corr);
      for (int t = 0; t < row_valid; ++t) {
        const __m512 pt = _mm512_set1_ps(probs[t]);
        for (int v = 0; v < NV; ++v) {
          out[v] = _mm512_fmadd_ps(pt, _mm512_load_ps(vt + t * D + v * 16), out[v]);
        }
      }
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(a + v * 16, out[v]);
    }
  }
}

// One (kv head, tile of query rows) against every key of the prefix (or, with `limits`,
// ascending, each row's first limits[row] keys).
constexpr int64_t kPrefixRowTile = 64;

template <int NV>
void attend_prefix(const float* q, int64_t rows, float scale, const float* k_cache,
                   const float* v_cache, const int32_t* blocks, int64_t keys,
                   int64_t block_size, int64_t block_stride, int64_t token_stride,
                   const int64_t* limits, float* out, float* lse, float* m, float* l) {
  constexpr int D = NV * 16;
  alignas(64) float kt[D * kChunk];
  alignas(64) float vt[kChunk * D];
  alignas(64) float qs[kPrefixRowTile * D];
  for (int64_t i = 0; i < rows * D; ++i) qs[i] = q[i] * scale;
  for (int64_t row = 0; row < rows; ++row) {
    m[row] = -std::numeric_limits<float>::infinity();
    l[row] = 0.0f;
  }
  std::fill(out, out + rows * D, 0.0f);
  const int64_t end = limits == nullptr ? keys : std::min(keys, limits[rows - 1]);
  for (int64_t start = 0; start < end; start += kChunk) {
    const int valid = static_cast<int>(std::min<int64_t>(kChunk, end - start));
    for (int t = 0; t < kChunk; ++t) {
      if (t < valid) {
        const int64_t j = start + t;
        const int64_t offset = blocks[j / block_size] * block_stride +
                               (j % block_size) * token_stride;
        const float* k = k_cache + offset;
        for (int d = 0; d < D; ++d) kt[d * kChunk + t] = k[d];
        std::copy(v_cache + offset, v_cache + offset + D, vt + t * D);
      } else {
        for (int d = 0; d < D; ++d) kt[d * kChunk + t] = 0.0f;
      }
    }
    attend_chunk_rows<NV>(qs, rows, kt, vt, valid, limits, start, m, l, out);
  }
  for (int64_t row = 0; row < rows; ++row) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[row]);
    for (int v = 0; v < NV; ++v) {
      float* o = out + row * D + v * 16;
      _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), inv));
    }
    lse[row] = m[row] + std::log(l[row]);
  }
}

// q [Hkv, M, D]; k_cache, v_cache [N, B, Hkv, D]; blocks [nb] int32. Returns out
// [Hkv, M, D], lse [Hkv, M]. With `causal_context` >= 0 the rows are one request's
// queries in (query, head of the group) order, `group` heads per query, query i at
// position causal_context + i: it sees keys 0 .. causal_context + i (a prefill chunk
// after its context, read in place with its own new keys).
std::tuple<at::Tensor, at::Tensor> paged_prefix_attention(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& blocks, double scale, int64_t causal_context, int64_t group) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "paged_prefix_attention: q must be a contiguous float32 [Hkv, M, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "paged_prefix_attention: caches must be contiguous float32 [N, B, Hkv, D]");
  TORCH_CHECK(blocks.dim() == 1 && blocks.scalar_type() == at::kInt && blocks.is_contiguous() &&
                  blocks.numel() >= 1,
              "paged_prefix_attention: blocks must be a non-empty int32 vector");
  const int64_t kv_heads = q.size(0), rows = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == kv_heads && k_cache.size(3) == dim,
              "paged_prefix_attention: shapes do not match");
  TORCH_CHECK(dim == 64 || dim == 128, "paged_prefix_attention: ", dim,
              " dims are not supported");
  TORCH_CHECK(group >= 1 && (causal_context < 0 || rows % group == 0),
              "paged_prefix_attention: rows must be whole groups of query heads");
  at::Tensor out = at::empty({kv_heads, rows, dim}, q.options());
  at::Tensor lse = at::empty({kv_heads, rows}, q.options());
  at::Tensor stats = at::empty({kv_heads, rows, 2}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int32_t* bp = blocks.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  float* sp = stats.data_ptr<float>();
  const int64_t keys = blocks.numel() * block_size;
  const int64_t token_stride = kv_heads * dim, block_stride = block_size * token_stride;
  const int64_t tiles = (rows + kPrefixRowTile - 1) / kPrefixRowTile;
  at::parallel_for(0, kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / tiles, r0 = (i % tiles) * kPrefixRowTile;
      const int64_t n = std::min(kPrefixRowTile, rows - r0);
      const int64_t base = h * rows + r0;
      float* m = sp + base * 2;
      float* l = m + n;  // the tile's 2n floats of stats: n maxima, then n sums
      int64_t tile_limits[kPrefixRowTile];
      const int64_t* limits = nullptr;
      if (causal_context >= 0) {
        for (int64_t j = 0; j < n; ++j) tile_limits[j] = causal_context + (r0 + j) / group + 1;
        limits = tile_limits;
      }
      if (dim == 64) {
        attend_prefix<4>(qp + base * dim, n, sc, kp + h * dim, vp + h * dim, bp, keys, block_size,
                         block_stride, token_stride, limits, op + base * dim, lp + base, m, l);
      } else {
        attend_prefix<8>(qp + base * dim, n, sc, kp + h * dim, vp + h * dim, bp, keys, block_size,
                         block_stride, token_stride, limits, op + base * dim, lp + base, m, l);
      }
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor lens, float scale) -> (Tensor, Tensor)");
  m.def("paged_prefix_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor blocks, "
        "float scale, int causal_context=-1, int group=1) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefix_attention", &paged_prefix_attention);
}
