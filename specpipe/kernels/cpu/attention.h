// specpipe's CPU kernel, the attention of a decoding step or a tree verify: tree_attention computes softmax(q k^T *
// scale) v per query head over the KV cache's own rows (any row stride) under a boolean tree mask, with fp32 sums, into
// the [1, q, heads, head_dim] layout the output projection reads; ragged_tree_attention does it for several sequences'
// rows of one forward, each appended to and attending its own cache. The query heads that share a KV head read each key
// and value row once together; on AVX512_BF16 builds bf16 heads of 64 or 128 dims multiply bf16 pairs
// (attend_heads_paired).
//
// Why: for a few query rows over a cache, SDPA's own cost per call and the transposes and folded masks a verify needs
// around it outweighed the arithmetic (engine.kernel_attention). The result agrees with SDPA to float rounding, not
// bitwise (specpipe.engine.cpu_kernel checks it when the kernel loads).
//
// Every row is computed over the keys its mask lets it see, taken in cache order as one run (SeenKeys), never over
// masked keys: a key's place in every reduction (its lane, its group of four or sixteen scores, its value pair) is its
// index in that run, so a tree node's row gets bitwise what the one-row forward of its own path gets over the same
// keys stored one after another, whatever the tree's shape or the rows beside it.
// A part of kernel.cpp's one translation unit (see there).

#pragma once

#include <atomic>

#include "lanes.h"

namespace {

// The keys one query row sees, in cache order, as a run of `count` keys: cache rows [0, prefix) where they lie,
// then the cache rows `later` lists (ascending). A one-row forward sees every row of its cache: prefix = count.
struct SeenKeys {
  int64_t count = 0;
  int64_t prefix = 0;
  const int64_t* later = nullptr;
  int64_t operator[](int64_t j) const { return j < prefix ? j : later[j - prefix]; }
};

// Each of q mask rows ([q, kv] bool, or null: every row sees all kv keys) as the run of keys it sees; `later`
// holds the rows' keys past their leading visible run.
inline std::vector<SeenKeys> seen_keys_of(const bool* mask, int64_t q, int64_t kv, std::vector<int64_t>& later) {
  std::vector<SeenKeys> rows(q);
  if (mask == nullptr) {
    for (auto& row : rows) row.count = row.prefix = kv;
    return rows;
  }
  std::vector<int64_t> offsets(q);
  later.clear();
  for (int64_t r = 0; r < q; ++r) {
    const bool* visible = mask + r * kv;
    const int64_t prefix = std::find(visible, visible + kv, false) - visible;
    rows[r].prefix = prefix;
    offsets[r] = static_cast<int64_t>(later.size());
    for (int64_t k = prefix; k < kv; ++k)
      if (visible[k]) later.push_back(k);
    rows[r].count = prefix + static_cast<int64_t>(later.size()) - offsets[r];
  }
  for (int64_t r = 0; r < q; ++r) rows[r].later = later.data() + offsets[r];  // `later` no longer grows
  return rows;
}

inline void store_value(float* p, float v) { *p = v; }
// rounded to the nearest bf16 (ties to even), as casting an fp32 tensor to bf16 rounds
inline void store_value(uint16_t* p, float v) { *p = c10::BFloat16(v).x; }

// scores [kv] (a masked key's is -inf) -> in place, e^(score - the largest score): a softmax's weights before
// normalizing, exactly 0 for a masked key; returns their sum.
float softmax_weights(float* scores, int64_t kv) {
  const int64_t vector_end = kv - kv % kLanes;
  Lanes top_so_far = lanes_set(-INFINITY);
  for (int64_t k = 0; k < vector_end; k += kLanes) top_so_far = lanes_max(top_so_far, lanes_load(scores + k));
  alignas(64) float tops[kLanes];
  lanes_store(tops, top_so_far);
  float top = -INFINITY;
  for (int64_t k = 0; k < kLanes; ++k) top = std::max(top, tops[k]);
  for (int64_t k = vector_end; k < kv; ++k) top = std::max(top, scores[k]);
  const Lanes top_lanes = lanes_set(top);
  Lanes total = lanes_zero();
  for (int64_t k = 0; k < vector_end; k += kLanes) {
    const Lanes s = lanes_load(scores + k);
    const Lanes weight = lanes_where_finite(lanes_exp(lanes_sub(s, top_lanes)), s);
    lanes_store(scores + k, weight);
    total = lanes_add(total, weight);
  }
  if (vector_end < kv) {  // the last keys through the same vector exp, padded with masked ones
    alignas(64) float tail[kLanes];
    for (int64_t k = 0; k < kLanes; ++k) tail[k] = vector_end + k < kv ? scores[vector_end + k] : -INFINITY;
    const Lanes s = lanes_load(tail);
    const Lanes weight = lanes_where_finite(lanes_exp(lanes_sub(s, top_lanes)), s);
    lanes_store(tail, weight);
    total = lanes_add(total, weight);
    for (int64_t k = vector_end; k < kv; ++k) scores[k] = tail[k - vector_end];
  }
  return lanes_sum(total);
}

// One query row of one head: softmax(q k^T * scale) v over the keys it sees, summed in fp32, for any
// head_dim. Keys and values are rows of the KV cache (`*_stride` apart); `scores` [seen.count] and `sums`
// [head_dim] are the calling thread's scratch.
template <typename T>
void attend_row(const T* query, const T* keys, int64_t key_stride, const T* values, int64_t value_stride,
                const SeenKeys& seen, int64_t head_dim, float scale, T* out, float* scores, float* sums) {
  const int64_t vector_end = head_dim - head_dim % kLanes, kv = seen.count;
  float* row = sums;  // the query row, widened, until the scores are made
  for (int64_t d = 0; d < head_dim; ++d) row[d] = as_float(query[d]);
  for (int64_t j = 0; j < kv; ++j) {
    const T* key = keys + seen[j] * key_stride;
    Lanes acc = lanes_zero();
    for (int64_t d = 0; d < vector_end; d += kLanes) acc = lanes_fma(load_weights(key + d), lanes_load(row + d), acc);
    float dot = lanes_sum(acc);
    for (int64_t d = vector_end; d < head_dim; ++d) dot += as_float(key[d]) * row[d];
    scores[j] = dot * scale;
  }
  const float total = softmax_weights(scores, kv);
  std::fill(sums, sums + head_dim, 0.0f);
  for (int64_t j = 0; j < kv; ++j) {
    const float weight = scores[j];
    if (weight == 0.0f) continue;  // vanishing: adds nothing
    const T* value = values + seen[j] * value_stride;
    const Lanes weight_lanes = lanes_set(weight);
    for (int64_t d = 0; d < vector_end; d += kLanes)
      lanes_store(sums + d, lanes_fma(load_weights(value + d), weight_lanes, lanes_load(sums + d)));
    for (int64_t d = vector_end; d < head_dim; ++d) sums[d] += as_float(value[d]) * weight;
  }
  const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
  for (int64_t d = 0; d < head_dim; ++d) store_value(out + d, sums[d] * inverse);
}

// A query row held in registers and its dot products with key rows (kLanes fp32 partial sums): NV
// vectors widened to fp32; bf16 pairs on the AVX512_BF16 build (half the instructions, no widening).
template <int NV, typename T>
struct QueryRow {
  static constexpr int kRegisters = NV;
  Lanes values[NV];
  void load(const T* row) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) values[v] = load_weights(row + v * kLanes);
  }
  Lanes dot(const T* key) const {
    Lanes acc = lanes_zero();
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc = lanes_fma(load_weights(key + v * kLanes), values[v], acc);
    return acc;
  }
};

#ifdef __AVX512BF16__
template <int NV>
struct QueryRow<NV, uint16_t> {
  static_assert(NV % 2 == 0, "bf16 pairs fill 512-bit registers two fp32 vectors' worth at a time");
  static constexpr int kRegisters = NV / 2;
  __m512i pairs[NV / 2];
  void load(const uint16_t* row) {
#pragma GCC unroll 8
    for (int v = 0; v < NV / 2; ++v) pairs[v] = _mm512_loadu_si512(row + 32 * v);
  }
  Lanes dot(const uint16_t* key) const {
    Lanes acc = lanes_zero();
#pragma GCC unroll 8
    for (int v = 0; v < NV / 2; ++v)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(key + 32 * v), (__m512bh)pairs[v]);
    return acc;
  }
};
#endif

// How many query heads of one KV head attend together (G of attend_heads): their rows, and G x 4 dot
// products in flight, must fit the registers beside the keys being read.
template <int NV, typename T>
constexpr int max_heads_together() {
  constexpr int per_head = QueryRow<NV, T>::kRegisters;
  return per_head * 4 <= kRegisters / 2 ? 4 : per_head * 2 <= kRegisters / 2 ? 2 : 1;
}

// One query row of G query heads that read the same KV head, for a head_dim of NV whole vectors (64 or
// 128 on either build): softmax(q k^T * scale) v with fp32 sums, each key and value row read once for
// all G heads. The query rows and the value sums stay in registers; four keys' dot products per head are
// in flight at once (one at a time waited on its chain of multiply-adds). Grouped-query models read each
// KV head for several query heads (SmolLM2-135M: 3, Llama-3-70B: 8): one head at a time re-read them
// from the caches G times, so a verify's rows over long contexts waited on those reads. `scores` [G, kv]
// is scratch.
template <int NV, int G, typename T>
void attend_heads(const T* const* queries, const T* keys, int64_t key_stride, const T* values, int64_t value_stride,
                  const SeenKeys& seen, float scale, T* const* outs, float* scores) {
  constexpr int64_t kHeadDim = NV * kLanes;
  const int64_t kv = seen.count;
  QueryRow<NV, T> rows[G];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) rows[g].load(queries[g]);
  int64_t j = 0;
  for (; j + 4 <= kv; j += 4) {
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      lanes_sum4(rows[g].dot(keys + seen[j] * key_stride), rows[g].dot(keys + seen[j + 1] * key_stride),
                 rows[g].dot(keys + seen[j + 2] * key_stride), rows[g].dot(keys + seen[j + 3] * key_stride),
                 scores + g * kv + j);
    }
  }
  for (; j < kv; ++j)
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) scores[g * kv + j] = lanes_sum(rows[g].dot(keys + seen[j] * key_stride));
  float inverse[G];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    float* head_scores = scores + g * kv;
    for (int64_t k = 0; k < kv; ++k) head_scores[k] *= scale;
    const float sum = softmax_weights(head_scores, kv);
    inverse[g] = sum > 0.0f ? 1.0f / sum : 0.0f;
  }
  // one head alone sums even and odd keys apart, which keeps as many multiply-adds in flight as G heads do
  constexpr int kSplit = G == 1 ? 2 : 1;
  Lanes acc[kSplit][G][NV];
  for (int u = 0; u < kSplit; ++u)
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[u][g][v] = lanes_zero();
  j = 0;
  for (; j + kSplit <= kv; j += kSplit) {
#pragma GCC unroll 2
    for (int u = 0; u < kSplit; ++u) {
      Lanes weight[G];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) weight[g] = lanes_set(scores[g * kv + j + u]);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) {
        const Lanes value = load_weights(values + seen[j + u] * value_stride + v * kLanes);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) acc[u][g][v] = lanes_fma(value, weight[g], acc[u][g][v]);
      }
    }
  }
  for (; j < kv; ++j) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const Lanes value = load_weights(values + seen[j] * value_stride + v * kLanes);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[0][g][v] = lanes_fma(value, lanes_set(scores[g * kv + j]), acc[0][g][v]);
    }
  }
  alignas(64) float result[kHeadDim];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    const Lanes head_inverse = lanes_set(inverse[g]);
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      Lanes total = acc[0][g][v];
      if (kSplit == 2) total = lanes_add(total, acc[kSplit - 1][g][v]);
      lanes_store(result + v * kLanes, lanes_mul(total, head_inverse));
    }
    for (int64_t d = 0; d < kHeadDim; ++d) store_value(outs[g] + d, result[d]);
  }
}

#ifdef __AVX512BF16__
// lane k of the result = the sum of dots[k]'s lanes: 16 horizontal sums in 45 shuffles and adds where
// one reduction each takes ~8
inline __m512 lanes_sum16(const __m512* dots) {
  __m512 halves[8], quarters[4];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k)
    halves[k] = _mm512_add_ps(_mm512_unpacklo_ps(dots[2 * k], dots[2 * k + 1]),
                              _mm512_unpackhi_ps(dots[2 * k], dots[2 * k + 1]));
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(halves[2 * k]), b = _mm512_castps_pd(halves[2 * k + 1]);
    quarters[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // each 128-bit block of quarters[k] now holds that block's part of dots 4k..4k+3
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quarters[0], quarters[1], 0x44),
                                   _mm512_shuffle_f32x4(quarters[0], quarters[1], 0xEE));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quarters[2], quarters[3], 0x44),
                                    _mm512_shuffle_f32x4(quarters[2], quarters[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}

// The value rows of keys j and j + 1 as pairs (dims interleaved 16 bits apart), the operand vdpbf16ps
// multiplies by a pair of weights: per 32 dims, `lo` holds dims 0-3, 8-11, 16-19, 24-27 and `hi` the rest
template <int NV>
inline void value_pairs(const uint16_t* first, const uint16_t* second, __m512i* pairs) {
#pragma GCC unroll 8
  for (int v = 0; v < NV / 2; ++v) {
    const __m512i a = _mm512_loadu_si512(first + 32 * v), b = _mm512_loadu_si512(second + 32 * v);
    pairs[2 * v] = _mm512_unpacklo_epi16(a, b);
    pairs[2 * v + 1] = _mm512_unpackhi_epi16(a, b);
  }
}

// sums[h][v] += the HC heads' weight pairs times the values' pairs, over the keys seen: two keys per
// vdpbf16ps, each pair of value rows interleaved once for all HC heads; an odd last key pairs with zeros
template <int NV, int HC>
void accumulate_value_pairs(const uint16_t* values, int64_t value_stride, const SeenKeys& seen,
                            const uint32_t* weight_pairs, int64_t pairs_per_head, __m512* sums) {
  const int64_t kv = seen.count;
  __m512 acc[HC][NV];
#pragma GCC unroll 4
  for (int h = 0; h < HC; ++h)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_setzero_ps();
  __m512i pairs[NV];
  const int64_t even_end = kv - kv % 2;
  for (int64_t j = 0; j < even_end; j += 2) {
    value_pairs<NV>(values + seen[j] * value_stride, values + seen[j + 1] * value_stride, pairs);
#pragma GCC unroll 4
    for (int h = 0; h < HC; ++h) {
      const __m512bh weight = (__m512bh)_mm512_set1_epi32(weight_pairs[h * pairs_per_head + j / 2]);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_dpbf16_ps(acc[h][v], (__m512bh)pairs[v], weight);
    }
  }
  if (even_end < kv) {
    alignas(64) uint16_t zeros[NV * 16] = {};
    value_pairs<NV>(values + seen[even_end] * value_stride, zeros, pairs);
#pragma GCC unroll 4
    for (int h = 0; h < HC; ++h) {
      const __m512bh weight = (__m512bh)_mm512_set1_epi32(weight_pairs[h * pairs_per_head + even_end / 2]);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_dpbf16_ps(acc[h][v], (__m512bh)pairs[v], weight);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < HC; ++h)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) sums[h * NV + v] = acc[h][v];
}

// accumulate_value_pairs for heads [First, G), as many at once as their sums and the value pairs leave
// registers for (4 heads of 64 dims, 2 of 128)
template <int NV, int G, int First>
void accumulate_heads(const uint16_t* values, int64_t value_stride, const SeenKeys& seen,
                      const uint32_t* weight_pairs, int64_t pairs_per_head, __m512* sums) {
  if constexpr (First < G) {
    constexpr int kAtOnce = NV <= 4 ? 4 : 2;
    constexpr int kCount = G - First < kAtOnce ? G - First : kAtOnce;
    accumulate_value_pairs<NV, kCount>(values, value_stride, seen, weight_pairs + First * pairs_per_head,
                                       pairs_per_head, sums + First * NV);
    accumulate_heads<NV, G, First + kCount>(values, value_stride, seen, weight_pairs, pairs_per_head, sums);
  }
}

// One query row of G query heads that read the same KV head, bf16 on the AVX512_BF16 build, head_dim
// NV x 16 (64 or 128): attend_heads' result to bf16 rounding, in fewer instructions. Its multiply-adds had
// bound it (one per 16 values of a value row per head, each key alone): here 16 keys' scores come out of
// one vector reduction and are scaled and masked 16 at a time, and the weights, rounded to bf16 (as
// transformers' eager attention and ATen's flash attention round them before their products with the
// values), multiply two value rows per vdpbf16ps. `scores` [G, seen.count] and `weight_pairs`
// [G, seen.count / 2 + 1] are scratch.
template <int NV, int G>
void attend_heads_paired(const uint16_t* const* queries, const uint16_t* keys, int64_t key_stride,
                         const uint16_t* values, int64_t value_stride, const SeenKeys& seen, float scale,
                         uint16_t* const* outs, float* scores, uint32_t* weight_pairs) {
  constexpr int kPairRegisters = NV / 2;  // a row of head_dim bf16 values
  const int64_t kv = seen.count;
  const __m512 scale_lanes = _mm512_set1_ps(scale);
  // every key's score comes out of lanes_sum16 (a last, partial block padded with zero dots), so a key's
  // score has the same bits whatever keys follow it
  for (int64_t j = 0; j < kv; j += 16) {
    const int count = static_cast<int>(std::min<int64_t>(16, kv - j));
    const __mmask16 present = static_cast<__mmask16>((1u << count) - 1);
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      __m512i row[kPairRegisters];
#pragma GCC unroll 8
      for (int v = 0; v < kPairRegisters; ++v) row[v] = _mm512_loadu_si512(queries[g] + 32 * v);
      __m512 dots[16];
#pragma GCC unroll 16
      for (int k = 0; k < 16; ++k) {
        __m512 acc = _mm512_setzero_ps();
        if (count == 16 || k < count)
#pragma GCC unroll 8
          for (int v = 0; v < kPairRegisters; ++v)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(keys + seen[j + k] * key_stride + 32 * v),
                                   (__m512bh)row[v]);
        dots[k] = acc;
      }
      _mm512_mask_storeu_ps(scores + g * kv + j, present, _mm512_mul_ps(lanes_sum16(dots), scale_lanes));
    }
  }
  const int64_t pairs_per_head = kv / 2 + 1;
  float inverse[G];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    float* head_scores = scores + g * kv;
    const float sum = softmax_weights(head_scores, kv);
    inverse[g] = sum > 0.0f ? 1.0f / sum : 0.0f;
    uint16_t* rounded = reinterpret_cast<uint16_t*>(weight_pairs + g * pairs_per_head);
    int64_t k = 0;
    for (; k + 16 <= kv; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rounded + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(head_scores + k)));
    for (; k < kv; ++k) rounded[k] = c10::BFloat16(head_scores[k]).x;
    rounded[kv] = 0;  // an odd last key's partner
  }
  __m512 sums[G * NV];
  accumulate_heads<NV, G, 0>(values, value_stride, seen, weight_pairs, pairs_per_head, sums);
  // back to the dims' order: per 32 dims, lo's and hi's blocks of four alternate
  const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  alignas(64) float result[NV * 16];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    const __m512 head_inverse = _mm512_set1_ps(inverse[g]);
#pragma GCC unroll 8
    for (int v = 0; v < NV / 2; ++v) {
      const __m512 lo = sums[g * NV + 2 * v], hi = sums[g * NV + 2 * v + 1];
      _mm512_store_ps(result + 32 * v, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first_half, hi), head_inverse));
      _mm512_store_ps(result + 32 * v + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second_half, hi), head_inverse));
    }
    for (int64_t d = 0; d < NV * 16; ++d) store_value(outs[g] + d, result[d]);
  }
}
#endif

#if defined(SPECPIPE_AMX) && defined(__AVX512BF16__)
// Whether bf16 heads of 64 dims attend on AMX tiles (attend_rows_tiles): one setting for the process, made at load once
// Linux granted the tiles and before any forward (specpipe.engine.cpu_kernel), never changed while a model decodes: a
// tree node's row must be computed as its path's one-row forward computes it, whichever forward either is in.
inline std::atomic<bool>& attention_tiles() {
  static std::atomic<bool> on{false};
  return on;
}

// The tiles' shapes for G query heads a KV head: 0-5 = 16 rows of 64 bytes (16 keys' or 16 vectors' fp32 sums, the A
// and B operands of the shared parts), 6-7 = G rows of 64 bytes (one row's sums of 16 dims and its weights)
template <int G>
SPECPIPE_AMX_TARGET inline void configure_attention_tiles() {
  AmxConfig config;
  for (int t = 0; t <= 7; ++t) config.rows[t] = t < 6 ? 16 : G, config.bytes_per_row[t] = 64;
  asm volatile("" : : "r"(&config) : "memory");  // every shape stored before LDTILECFG reads them (amx_configure)
  _tile_loadconfig(&config);
}

// rows[16] of 16 floats -> out[c] = column c (out[c] lane k = rows[k] lane c)
inline void transpose16(const __m512* rows, __m512* out) {
  __m512 a[16], b[16], c[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d x0 = _mm512_castps_pd(a[4 * i]), x1 = _mm512_castps_pd(a[4 * i + 1]);
    const __m512d y0 = _mm512_castps_pd(a[4 * i + 2]), y1 = _mm512_castps_pd(a[4 * i + 3]);
    b[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(x0, y0));
    b[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x0, y0));
    b[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(x1, y1));
    b[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(x1, y1));
  }
  for (int i = 0; i < 2; ++i)  // b[4 i + k]'s 128-bit lane l: rows 4 i .. 4 i + 3 of column 4 l + k
    for (int k = 0; k < 4; ++k) {
      c[8 * i + k] = _mm512_shuffle_f32x4(b[8 * i + k], b[8 * i + 4 + k], 0x88);
      c[8 * i + 4 + k] = _mm512_shuffle_f32x4(b[8 * i + k], b[8 * i + 4 + k], 0xdd);
    }
  for (int k = 0; k < 8; ++k) {
    out[k] = _mm512_shuffle_f32x4(c[k], c[8 + k], 0x88);
    out[k + 8] = _mm512_shuffle_f32x4(c[k], c[8 + k], 0xdd);
  }
}

// The scores of run positions [j, j + count) of `row` (every row's, where shared) for the 16 vectors in tiles 3-4:
// the keys as the A tiles 1-2 (as they lie in the cache where they are 16 cache rows in order, else gathered into
// `gathered` [16 x 64], zeros past count), their sums in tile 0, turned to one vector of 16 keys' scores per query
// vector in `columns` (unscaled).
SPECPIPE_AMX_TARGET inline void key_block_scores(const uint16_t* keys, int64_t key_stride, const SeenKeys& row,
                                                 int64_t j, int count, uint16_t* gathered, __m512* columns) {
  if (count == 16 && j + 16 <= row.prefix) {
    _tile_loadd(1, keys + j * key_stride, key_stride * 2);
    _tile_loadd(2, keys + j * key_stride + 32, key_stride * 2);
  } else {
    for (int r = 0; r < 16; ++r) {
      if (r < count)
        std::memcpy(gathered + r * 64, keys + row[j + r] * key_stride, 128);
      else
        std::memset(gathered + r * 64, 0, 128);
    }
    _tile_loadd(1, gathered, 128);
    _tile_loadd(2, gathered + 32, 128);
  }
  _tile_zero(0);
  _tile_dpbf16ps(0, 1, 3);
  _tile_dpbf16ps(0, 2, 4);
  alignas(64) float block[16][16];
  _tile_stored(0, block, 64);
  __m512 rows[16];
  for (int r = 0; r < 16; ++r) rows[r] = _mm512_load_ps(block[r]);
  transpose16(rows, columns);
}

// Run positions [c, c + 32) of a vector: its weights (scores from `head`) rounded to bf16 as attend_heads_paired rounds
// them, zeros past its `keys_seen` keys, into weights[32]
inline void weight_chunk(const float* head, int64_t c, int64_t keys_seen, uint16_t* weights) {
  const int64_t left = keys_seen - c;
  const __mmask16 low = static_cast<__mmask16>(left >= 16 ? 0xFFFF : left <= 0 ? 0 : (1u << left) - 1);
  const __mmask16 high = static_cast<__mmask16>(left >= 32 ? 0xFFFF : left <= 16 ? 0 : (1u << (left - 16)) - 1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights),
                      (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(low, head + c)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + 16),
                      (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(high, head + c + 16)));
}

// The value rows of run positions [c, c + 32) of `row` interleaved in pairs of keys, zeros past `keys_seen`: pairs
// [4][16][32], per 32 dims block 2w holding dims 0-3, 8-11, 16-19, 24-27 and block 2w + 1 the rest (value_pairs'
// unpacking), each block the B operand of one TDPBF16PS (16 pairs of keys x 16 dims)
inline void value_chunk(const uint16_t* values, int64_t value_stride, const SeenKeys& row, int64_t c,
                        int64_t keys_seen, uint16_t (*pairs)[16][32]) {
  alignas(64) static const uint16_t kZeros[64] = {};
  for (int k = 0; k < 16; ++k) {
    const int64_t a = c + 2 * k, b = a + 1;
    const uint16_t* x_row = a < keys_seen ? values + row[a] * value_stride : kZeros;
    const uint16_t* y_row = b < keys_seen ? values + row[b] * value_stride : kZeros;
    for (int w = 0; w < 2; ++w) {
      const __m512i x = _mm512_loadu_si512(x_row + 32 * w), y = _mm512_loadu_si512(y_row + 32 * w);
      _mm512_storeu_si512(pairs[2 * w][k], _mm512_unpacklo_epi16(x, y));
      _mm512_storeu_si512(pairs[2 * w + 1][k], _mm512_unpackhi_epi16(x, y));
    }
  }
}

// The G query heads of 64 dims of one KV head over `rows` rows of one sequence, bf16, on AMX tiles: per row,
// attend_heads_paired's result with the scores summed in the tiles' order. queries / outs: rows * G vectors (at most
// 16), row by row (vector r * G + h); seen: each row's keys. The keys every row sees in cache order (the shared
// prefix) are read once for all the vectors: their scores are one TDPBF16PS pair per 16 keys (the keys' rows as they
// lie in the cache times the vectors' pairs of dims), their weighted values one TDPBF16PS per 32 keys and 16 dims (the
// weights, rounded to bf16, times the value rows interleaved in pairs of keys). Each row's other keys (a tree node's
// ancestors, a prompt chunk's earlier rows) follow, gathered, its sums in tiles of its own. A score depends on its key
// and query alone, and a row's value sums run over its run of keys in pairs, in chunks of 32 from the run's first key,
// whatever rows share the call: a tree node's row is bitwise its path's one-row row. `scratch` is the calling thread's.
template <int G>
SPECPIPE_AMX_TARGET void attend_rows_tiles(int rows, const uint16_t* const* queries, const uint16_t* keys,
                                           int64_t key_stride, const uint16_t* values, int64_t value_stride,
                                           const SeenKeys* seen, float scale, uint16_t* const* outs,
                                           std::vector<float>& scratch) {
  static_assert(G >= 1 && G <= 4, "up to 4 query heads a KV head");
  const int n = rows * G;
  int64_t shared = seen[0].prefix, longest = 0;
  for (int r = 0; r < rows; ++r) shared = std::min(shared, seen[r].prefix), longest = std::max(longest, seen[r].count);
  scratch.resize(static_cast<size_t>(n) * static_cast<size_t>(longest));
  float* scores = scratch.data();  // vector v's score of the key its run has at j: scores[v * longest + j]
  configure_attention_tiles<G>();
  alignas(64) uint32_t vector_pairs[2][16][16] = {};  // [dims 0-31 | 32-63][pair of dims][vector]: the B operands
  for (int v = 0; v < n; ++v) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(queries[v]);
    for (int k = 0; k < 16; ++k) vector_pairs[0][k][v] = pairs[k], vector_pairs[1][k][v] = pairs[16 + k];
  }
  _tile_loadd(3, vector_pairs[0], 64);
  _tile_loadd(4, vector_pairs[1], 64);
  alignas(64) uint16_t gathered[16 * 64];
  const __m512 scale_lanes = _mm512_set1_ps(scale);
  __m512 columns[16];
  for (int64_t j = 0; j < shared; j += 16) {
    const int count = static_cast<int>(std::min<int64_t>(16, shared - j));
    key_block_scores(keys, key_stride, seen[0], j, count, gathered, columns);
    const __mmask16 present = static_cast<__mmask16>((1u << count) - 1);
    for (int v = 0; v < n; ++v)
      _mm512_mask_storeu_ps(scores + v * longest + j, present, _mm512_mul_ps(columns[v], scale_lanes));
  }
  for (int r = 0; r < rows; ++r)
    for (int64_t j = shared; j < seen[r].count; j += 16) {
      const int count = static_cast<int>(std::min<int64_t>(16, seen[r].count - j));
      key_block_scores(keys, key_stride, seen[r], j, count, gathered, columns);
      const __mmask16 present = static_cast<__mmask16>((1u << count) - 1);
      for (int h = 0; h < G; ++h)
        _mm512_mask_storeu_ps(scores + (r * G + h) * longest + j, present,
                              _mm512_mul_ps(columns[r * G + h], scale_lanes));
    }
  float inverse[16];
  for (int v = 0; v < n; ++v) {
    const float sum = softmax_weights(scores + v * longest, seen[v / G].count);
    inverse[v] = sum > 0.0f ? 1.0f / sum : 0.0f;
  }
  alignas(64) uint16_t pairs[4][16][32];
  alignas(64) uint16_t weights[16][32] = {};
  alignas(64) float sums[4][16][16];  // [dim block][vector][16 dims]
  const int64_t shared_chunks = shared / 32 * 32;  // chunks of keys every row sees in cache order
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < shared_chunks; c += 32) {
    for (int v = 0; v < n; ++v) weight_chunk(scores + v * longest, c, seen[v / G].count, weights[v]);
    value_chunk(values, value_stride, seen[0], c, shared_chunks, pairs);
    _tile_loadd(4, weights, 64);
    _tile_loadd(5, pairs[0], 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, pairs[1], 64);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, pairs[2], 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, pairs[3], 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  _tile_stored(2, sums[2], 64);
  _tile_stored(3, sums[3], 64);
  for (int r = 0; r < rows; ++r) {
    const int64_t tail = seen[r].count - shared_chunks;
    if (tail <= 0) continue;
    const int64_t chunks = (tail + 31) / 32;
    std::vector<uint16_t> row_weights(static_cast<size_t>(chunks) * G * 32);
    std::vector<uint16_t> row_pairs(static_cast<size_t>(chunks) * 4 * 16 * 32);
    for (int64_t i = 0; i < chunks; ++i) {
      for (int h = 0; h < G; ++h)
        weight_chunk(scores + (r * G + h) * longest, shared_chunks + 32 * i, seen[r].count,
                     row_weights.data() + (i * G + h) * 32);
      value_chunk(values, value_stride, seen[r], shared_chunks + 32 * i, seen[r].count,
                  reinterpret_cast<uint16_t(*)[16][32]>(row_pairs.data() + i * 4 * 16 * 32));
    }
    for (int t = 0; t < 4; ++t) {
      _tile_loadd(6, sums[t][r * G], 64);
      for (int64_t i = 0; i < chunks; ++i) {
        _tile_loadd(7, row_weights.data() + i * G * 32, 64);
        _tile_loadd(5, row_pairs.data() + (i * 4 + t) * 16 * 32, 64);
        _tile_dpbf16ps(6, 7, 5);
      }
      _tile_stored(6, sums[t][r * G], 64);
    }
  }
  for (int v = 0; v < n; ++v)
    for (int t = 0; t < 4; ++t)
      for (int c = 0; c < 16; ++c)
        store_value(outs[v] + 32 * (t / 2) + (c / 4) * 8 + (t % 2) * 4 + c % 4, sums[t][v][c] * inverse[v]);
}

// One sequence's q rows in groups of attend_rows_tiles (its tiles hold 16 query vectors: up to 16 / G rows), as even as
// those groups allow: `count` groups of `per` rows (the last fewer)
struct TileRowGroups {
  int64_t count, per;
};
inline TileRowGroups tile_row_groups(int64_t q, int64_t groups) {
  const int64_t most = 16 / groups, count = (q + most - 1) / most;
  return {count, (q + count - 1) / count};
}

// Unit `unit` of one sequence's attention on the tiles (KV head unit / groups.count, its row group unit % count): its
// rows' query and output vectors found at `row_offset` + r in query [1, heads, R, 64] and out [1, R, heads, 64].
inline void attend_tiles_unit(int64_t unit, TileRowGroups split, int64_t q, int64_t groups, const torch::Tensor& query,
                              const uint16_t* query_data, int64_t row_offset, const uint16_t* key_data,
                              int64_t key_head_stride, int64_t key_stride, const uint16_t* value_data,
                              int64_t value_head_stride, int64_t value_stride, const SeenKeys* seen, float scale,
                              uint16_t* out_data, int64_t heads, std::vector<float>& scratch) {
  const int64_t g = unit / split.count, first = (unit % split.count) * split.per;
  const int rows = static_cast<int>(std::min<int64_t>(split.per, q - first));
  const uint16_t* queries[16];
  uint16_t* outs[16];
  for (int r = 0; r < rows; ++r)
    for (int64_t h = 0; h < groups; ++h) {
      const int64_t row = row_offset + first + r, head = g * groups + h;
      queries[r * groups + h] = query_data + head * query.stride(1) + row * query.stride(2);
      outs[r * groups + h] = out_data + (row * heads + head) * 64;
    }
  const uint16_t* keys = key_data + g * key_head_stride;
  const uint16_t* values = value_data + g * value_head_stride;
  switch (groups) {
    case 4:
      return attend_rows_tiles<4>(rows, queries, keys, key_stride, values, value_stride, seen + first, scale, outs,
                                  scratch);
    case 3:
      return attend_rows_tiles<3>(rows, queries, keys, key_stride, values, value_stride, seen + first, scale, outs,
                                  scratch);
    case 2:
      return attend_rows_tiles<2>(rows, queries, keys, key_stride, values, value_stride, seen + first, scale, outs,
                                  scratch);
    default:
      return attend_rows_tiles<1>(rows, queries, keys, key_stride, values, value_stride, seen + first, scale, outs,
                                  scratch);
  }
}

// Whether a call's heads attend on the tiles: bf16, 64 dims, up to 4 query heads a KV head, the tiles on
template <typename Raw>
bool on_tiles(int64_t head_dim, int64_t groups) {
  return std::is_same_v<Raw, uint16_t> && head_dim == 64 && groups >= 1 && groups <= 4 &&
         attention_tiles().load(std::memory_order_relaxed);
}
#endif

// G query heads that read the same KV head over one row, each computed exactly as attend_heads<NV, 1> computes it
// alone (the same products and sums in the same order), with each key and value row read once for all G: where
// the registers hold only one head's query row (AVX2: 16 registers, a 64-dim fp32 row takes 8), one head at a time
// read every key and value row G times from the caches, and those reads bound it. The queries are read from memory
// (widened once), the keys two at a time for all heads; the values a slice of two vectors at a time, all G heads'
// sums of that slice in registers. `scores` [G, kv] is scratch.
template <int NV, int G, typename T>
void attend_heads_streamed(const T* const* queries, const T* keys, int64_t key_stride, const T* values,
                           int64_t value_stride, const SeenKeys& seen, float scale, T* const* outs, float* scores) {
  constexpr int64_t kHeadDim = NV * kLanes;
  const int64_t kv = seen.count;
  alignas(64) float query_rows[G][kHeadDim];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < NV; ++v) lanes_store(query_rows[g] + v * kLanes, load_weights(queries[g] + v * kLanes));
  int64_t j = 0;
  for (; j + 4 <= kv; j += 4) {
    Lanes dots[4][G];
    for (int pair = 0; pair < 4; pair += 2) {
      const T* first = keys + seen[j + pair] * key_stride;
      const T* second = keys + seen[j + pair + 1] * key_stride;
      Lanes acc[2][G];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[0][g] = acc[1][g] = lanes_zero();
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) {
        const Lanes a = load_weights(first + v * kLanes), b = load_weights(second + v * kLanes);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          const Lanes q = lanes_load(query_rows[g] + v * kLanes);
          acc[0][g] = lanes_fma(a, q, acc[0][g]);
          acc[1][g] = lanes_fma(b, q, acc[1][g]);
        }
      }
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) dots[pair][g] = acc[0][g], dots[pair + 1][g] = acc[1][g];
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) lanes_sum4(dots[0][g], dots[1][g], dots[2][g], dots[3][g], scores + g * kv + j);
  }
  for (; j < kv; ++j) {
    const T* key = keys + seen[j] * key_stride;
    for (int g = 0; g < G; ++g) {
      Lanes acc = lanes_zero();
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc = lanes_fma(load_weights(key + v * kLanes), lanes_load(query_rows[g] + v * kLanes), acc);
      scores[g * kv + j] = lanes_sum(acc);
    }
  }
  float inverse[G];
  for (int g = 0; g < G; ++g) {
    float* head_scores = scores + g * kv;
    for (int64_t k = 0; k < kv; ++k) head_scores[k] *= scale;
    const float sum = softmax_weights(head_scores, kv);
    inverse[g] = sum > 0.0f ? 1.0f / sum : 0.0f;
  }
  // attend_heads<NV, 1> sums even and odd keys apart: so does each head here, a slice of two vectors at a time
  alignas(64) float result[G][kHeadDim];
  for (int slice = 0; slice < NV; slice += 2) {
    Lanes acc[2][G][2];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g)
      acc[0][g][0] = acc[0][g][1] = acc[1][g][0] = acc[1][g][1] = lanes_zero();
    int64_t k = 0;
    for (; k + 2 <= kv; k += 2) {
#pragma GCC unroll 2
      for (int u = 0; u < 2; ++u) {
        const T* value = values + seen[k + u] * value_stride + slice * kLanes;
        const Lanes low = load_weights(value), high = load_weights(value + kLanes);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          const Lanes weight = lanes_set(scores[g * kv + k + u]);
          acc[u][g][0] = lanes_fma(low, weight, acc[u][g][0]);
          acc[u][g][1] = lanes_fma(high, weight, acc[u][g][1]);
        }
      }
    }
    if (k < kv) {
      const T* value = values + seen[k] * value_stride + slice * kLanes;
      const Lanes low = load_weights(value), high = load_weights(value + kLanes);
      for (int g = 0; g < G; ++g) {
        const Lanes weight = lanes_set(scores[g * kv + k]);
        acc[0][g][0] = lanes_fma(low, weight, acc[0][g][0]);
        acc[0][g][1] = lanes_fma(high, weight, acc[0][g][1]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const Lanes head_inverse = lanes_set(inverse[g]);
      for (int t = 0; t < 2; ++t)
        lanes_store(result[g] + (slice + t) * kLanes, lanes_mul(lanes_add(acc[0][g][t], acc[1][g][t]), head_inverse));
    }
  }
  for (int g = 0; g < G; ++g)
    for (int64_t d = 0; d < kHeadDim; ++d) store_value(outs[g] + d, result[g][d]);
}

// The query heads [first, first + count) of one KV head over one row, `count` of them together where the
// head size has a vector path (count <= max_heads_together), else one at a time through attend_row. bf16
// rows of 64 or 128 dims take attend_heads_paired on the AVX512_BF16 build (SPECPIPE_ATTENTION_PAIRS=0
// builds without it); `weight_pairs` [count, kv / 2 + 1] is its scratch.
#ifndef SPECPIPE_ATTENTION_PAIRS
#define SPECPIPE_ATTENTION_PAIRS 1
#endif
template <int NV, typename T>
void attend_heads_of(int count, const T* const* queries, const T* keys, int64_t key_stride, const T* values,
                     int64_t value_stride, const SeenKeys& seen, float scale, T* const* outs,
                     float* scores, uint32_t* weight_pairs) {
#if defined(__AVX512BF16__) && SPECPIPE_ATTENTION_PAIRS
  if constexpr (std::is_same_v<T, uint16_t> && (NV == 4 || NV == 8)) {
    switch (count) {
      case 4:
        return attend_heads_paired<NV, 4>(queries, keys, key_stride, values, value_stride, seen, scale, outs,
                                          scores, weight_pairs);
      case 3:
        return attend_heads_paired<NV, 3>(queries, keys, key_stride, values, value_stride, seen, scale, outs,
                                          scores, weight_pairs);
      case 2:
        return attend_heads_paired<NV, 2>(queries, keys, key_stride, values, value_stride, seen, scale, outs,
                                          scores, weight_pairs);
    }
    for (int g = 0; g < count; ++g)
      attend_heads_paired<NV, 1>(queries + g, keys, key_stride, values, value_stride, seen, scale, outs + g,
                                 scores, weight_pairs);
    return;
  }
#endif
  if constexpr (max_heads_together<NV, T>() == 1 && NV % 2 == 0) {
    switch (count) {
      case 4:
        return attend_heads_streamed<NV, 4>(queries, keys, key_stride, values, value_stride, seen, scale, outs, scores);
      case 3:
        return attend_heads_streamed<NV, 3>(queries, keys, key_stride, values, value_stride, seen, scale, outs, scores);
      case 2:
        return attend_heads_streamed<NV, 2>(queries, keys, key_stride, values, value_stride, seen, scale, outs, scores);
    }
  }
  switch (count) {
    case 4:
      if constexpr (max_heads_together<NV, T>() >= 4)
        return attend_heads<NV, 4>(queries, keys, key_stride, values, value_stride, seen, scale, outs, scores);
      break;
    case 3:
      if constexpr (max_heads_together<NV, T>() >= 3)
        return attend_heads<NV, 3>(queries, keys, key_stride, values, value_stride, seen, scale, outs, scores);
      break;
    case 2:
      if constexpr (max_heads_together<NV, T>() >= 2)
        return attend_heads<NV, 2>(queries, keys, key_stride, values, value_stride, seen, scale, outs, scores);
      break;
  }
  for (int g = 0; g < count; ++g)
    attend_heads<NV, 1>(queries + g, keys, key_stride, values, value_stride, seen, scale, outs + g, scores);
}

// How many query heads attend together: the largest count up to the vector path's limit that divides the
// heads per KV head (so every unit of work is alike), 1 without a vector path.
template <typename T>
int heads_together(int nv, int64_t groups) {
  const int in_registers = nv == 4 ? max_heads_together<4, T>() : nv == 8 ? max_heads_together<8, T>()
                          : nv == 16 ? max_heads_together<16, T>() : 1;
  const int limit = in_registers == 1 && nv > 4 ? 4 : in_registers;  // attend_heads_streamed
  for (int count = std::min<int64_t>(limit, groups); count > 1; --count)
    if (groups % count == 0) return count;
  return 1;
}

// One unit of attention work: query heads [first, first + together) of one KV head over one query row
// (queries / outs: `together` row pointers), through the vector path of its head size.
template <typename Raw>
void attend_unit(int nv, int together, const Raw* const* queries, const Raw* head_keys, int64_t key_stride,
                 const Raw* head_values, int64_t value_stride, const SeenKeys& seen, int64_t head_dim,
                 float scale, Raw* const* outs, float* scores, float* sums, uint32_t* weight_pairs) {
  switch (nv) {
    case 4:
      return attend_heads_of<4>(together, queries, head_keys, key_stride, head_values, value_stride, seen,
                                scale, outs, scores, weight_pairs);
    case 8:
      return attend_heads_of<8>(together, queries, head_keys, key_stride, head_values, value_stride, seen,
                                scale, outs, scores, weight_pairs);
    case 16:
      return attend_heads_of<16>(together, queries, head_keys, key_stride, head_values, value_stride, seen,
                                 scale, outs, scores, weight_pairs);
    default:
      attend_row(queries[0], head_keys, key_stride, head_values, value_stride, seen, head_dim, scale, outs[0],
                 scores, sums);
  }
}

inline int vector_path(int64_t head_dim) {
  return head_dim == kLanes * 4 ? 4 : head_dim == kLanes * 8 ? 8 : head_dim == kLanes * 16 ? 16 : 0;
}

template <typename T, typename Raw>
void attend(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value, const bool* mask,
            float scale, torch::Tensor& out) {
  const int64_t heads = query.size(1), q = query.size(2), head_dim = query.size(3);
  const int64_t kv_heads = key.size(1), kv = key.size(2), groups = heads / kv_heads;
  const Raw* query_data = reinterpret_cast<const Raw*>(query.data_ptr<T>());
  const Raw* key_data = reinterpret_cast<const Raw*>(key.data_ptr<T>());
  const Raw* value_data = reinterpret_cast<const Raw*>(value.data_ptr<T>());
  Raw* out_data = reinterpret_cast<Raw*>(out.data_ptr<T>());
  const int nv = vector_path(head_dim);
  const int together = heads_together<Raw>(nv, groups);
  const int64_t chunks = groups / together;  // per KV head
  const int64_t key_stride = key.stride(2), value_stride = value.stride(2);
  std::vector<int64_t> later;
  const std::vector<SeenKeys> seen = seen_keys_of(mask, q, kv, later);
#if defined(SPECPIPE_AMX) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<Raw, uint16_t>) {
    if (on_tiles<Raw>(head_dim, groups)) {  // one (KV head, group of rows) per unit
      const TileRowGroups split = tile_row_groups(q, groups);
      at::parallel_for(0, kv_heads * split.count, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scratch;
        for (int64_t unit = begin; unit < end; ++unit)
          attend_tiles_unit(unit, split, q, groups, query, query_data, 0, key_data, key.stride(1), key_stride,
                            value_data, value.stride(1), value_stride, seen.data(), scale, out_data, heads, scratch);
      });
      return;
    }
  }
#endif
  // one (KV head, chunk of its query heads, row) per unit, the rows of one chunk next to each other (they
  // read the same keys); a verify's units spread evenly over the threads
  at::parallel_for(0, kv_heads * chunks * q, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(together * kv), sums(head_dim);
    std::vector<uint32_t> weight_pairs(together * (kv / 2 + 1));
    const Raw* queries[4];
    Raw* outs[4];
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t r = unit % q, chunk = unit / q;
      const int64_t g = chunk / chunks;  // the KV head (transformers' repeat_kv order: heads g*groups...)
      const int64_t first = g * groups + (chunk % chunks) * together;
      for (int i = 0; i < together; ++i) {
        queries[i] = query_data + (first + i) * query.stride(1) + r * query.stride(2);
        outs[i] = out_data + (r * heads + first + i) * head_dim;
      }
      attend_unit(nv, together, queries, key_data + g * key.stride(1), key_stride, value_data + g * value.stride(1),
                  value_stride, seen[r], head_dim, scale, outs, scores.data(), sums.data(), weight_pairs.data());
    }
  });
}

// Several sequences' rows in one call: sequence b's rows [starts[b], starts[b + 1]) of query attend its own
// keys and values (`keys[b]`, `values[b]`: [1, kv_heads, lengths[b], head_dim] views of its cache), under its own
// mask (`masks[b]` [q_b, lengths[b]], or none for one row). Every unit is computed as `attend` computes it.
template <typename T, typename Raw>
void attend_ragged(const torch::Tensor& query, const std::vector<torch::Tensor>& keys,
                   const std::vector<torch::Tensor>& values, const std::vector<int64_t>& starts,
                   const std::vector<const bool*>& masks, float scale, torch::Tensor& out) {
  const int64_t heads = query.size(1), head_dim = query.size(3);
  const int64_t kv_heads = keys[0].size(1), groups = heads / kv_heads;
  const int64_t sequences = static_cast<int64_t>(keys.size());
  const Raw* query_data = reinterpret_cast<const Raw*>(query.data_ptr<T>());
  Raw* out_data = reinterpret_cast<Raw*>(out.data_ptr<T>());
  const int nv = vector_path(head_dim);
  const int together = heads_together<Raw>(nv, groups);
  const int64_t chunks = groups / together;
  std::vector<int64_t> first_unit(sequences + 1, 0);  // each sequence's units follow the previous one's
  int64_t longest = 0;
  std::vector<std::vector<int64_t>> later(sequences);
  std::vector<std::vector<SeenKeys>> seen(sequences);
  for (int64_t b = 0; b < sequences; ++b) {
    first_unit[b + 1] = first_unit[b] + kv_heads * chunks * (starts[b + 1] - starts[b]);
    longest = std::max<int64_t>(longest, keys[b].size(2));
    seen[b] = seen_keys_of(masks[b], starts[b + 1] - starts[b], keys[b].size(2), later[b]);
  }
#if defined(SPECPIPE_AMX) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<Raw, uint16_t>) {
    if (on_tiles<Raw>(head_dim, groups)) {  // one (sequence, KV head, group of its rows) per unit
      std::vector<TileRowGroups> splits(sequences);
      for (int64_t b = 0; b < sequences; ++b) {
        splits[b] = tile_row_groups(starts[b + 1] - starts[b], groups);
        first_unit[b + 1] = first_unit[b] + kv_heads * splits[b].count;
      }
      at::parallel_for(0, first_unit[sequences], 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scratch;
        for (int64_t unit = begin; unit < end; ++unit) {
          const int64_t b = std::upper_bound(first_unit.begin(), first_unit.end(), unit) - first_unit.begin() - 1;
          attend_tiles_unit(unit - first_unit[b], splits[b], starts[b + 1] - starts[b], groups, query, query_data,
                            starts[b], reinterpret_cast<const Raw*>(keys[b].data_ptr<T>()), keys[b].stride(1),
                            keys[b].stride(2), reinterpret_cast<const Raw*>(values[b].data_ptr<T>()),
                            values[b].stride(1), values[b].stride(2), seen[b].data(), scale, out_data, heads, scratch);
        }
      });
      return;
    }
  }
#endif
  at::parallel_for(0, first_unit[sequences], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(together * longest), sums(head_dim);
    std::vector<uint32_t> weight_pairs(together * (longest / 2 + 1));
    const Raw* queries[4];
    Raw* outs[4];
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = std::upper_bound(first_unit.begin(), first_unit.end(), unit) - first_unit.begin() - 1;
      const int64_t q = starts[b + 1] - starts[b], local = unit - first_unit[b];
      const int64_t r = local % q, chunk = local / q;
      const int64_t g = chunk / chunks;
      const int64_t first = g * groups + (chunk % chunks) * together;
      const int64_t row = starts[b] + r;
      for (int i = 0; i < together; ++i) {
        queries[i] = query_data + (first + i) * query.stride(1) + row * query.stride(2);
        outs[i] = out_data + (row * heads + first + i) * head_dim;
      }
      const Raw* key_data = reinterpret_cast<const Raw*>(keys[b].data_ptr<T>());
      const Raw* value_data = reinterpret_cast<const Raw*>(values[b].data_ptr<T>());
      attend_unit(nv, together, queries, key_data + g * keys[b].stride(1), keys[b].stride(2),
                  value_data + g * values[b].stride(1), values[b].stride(2), seen[b][r], head_dim, scale, outs,
                  scores.data(), sums.data(), weight_pairs.data());
    }
  });
}

}  // namespace

// Puts bf16 heads of 64 dims on AMX tiles (`on`, once Linux granted them: amx_request) or back on attend_heads_paired
// for every later call in this process; returns whether they are on (never on a build without the tiles). Set at load,
// before any forward (see attention_tiles).
bool set_attention_tiles(bool on) {
#if defined(SPECPIPE_AMX) && defined(__AVX512BF16__) && SPECPIPE_ATTENTION_PAIRS
  attention_tiles().store(on);
  return on;
#else
  (void)on;
  return false;
#endif
}

// Whether bf16 heads of 64 dims attend on AMX tiles now (set_attention_tiles)
bool attention_tiles_on() {
#if defined(SPECPIPE_AMX) && defined(__AVX512BF16__) && SPECPIPE_ATTENTION_PAIRS
  return attention_tiles().load();
#else
  return false;
#endif
}

// Attention of a decoding step or a tree verify, batch 1: query [1, heads, q, head_dim], key and value
// [1, kv_heads, kv, head_dim] (the KV cache's rows, any strides but the last), mask [q, kv] bool (True =
// attend) or None (every row sees every key) -> [1, q, heads, head_dim] in query's dtype (the layout the
// output projection reads). Sums run in fp32. In place of SDPA, and of the transposes and folded masks a
// verify needs around it.
torch::Tensor tree_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                             c10::optional<torch::Tensor> mask, double scale) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "query: fp32 or bf16");
  TORCH_CHECK(key.scalar_type() == dtype && value.scalar_type() == dtype, "key and value: query's dtype");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && query.size(0) == 1 && key.size(0) == 1 &&
                  value.size(0) == 1, "query [1, heads, q, head_dim], key and value [1, kv_heads, kv, head_dim]");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(3) == query.size(3) && query.size(1) % key.size(1) == 0,
              "key and value must match, share query's head_dim, and divide its heads");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1, "head_dim must be contiguous");
  const int64_t q = query.size(2), kv = key.size(2);
  torch::Tensor mask_rows;
  const bool* mask_data = nullptr;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->dim() == 2 && mask->size(0) == q && mask->size(1) == kv,
                "mask: bool [q, kv]");
    mask_rows = mask->contiguous();
    mask_data = mask_rows.data_ptr<bool>();
  }
  auto out = torch::empty({1, q, query.size(1), query.size(3)}, query.options());
  if (dtype == torch::kBFloat16)
    attend<at::BFloat16, uint16_t>(query, key, value, mask_data, static_cast<float>(scale), out);
  else
    attend<float, float>(query, key, value, mask_data, static_cast<float>(scale), out);
  return out;
}

// rows [first, first + count) of `rows` [1, kv_heads, R, head_dim] into `buffer` [1, kv_heads, capacity, head_dim]
// from its row `at` on, head by head (both of one dtype, head_dim contiguous): what narrow(...).copy_(...) does,
// without the ATen dispatch that costs more than these few hundred bytes for a decoding step's rows
inline void append_rows(const torch::Tensor& rows, int64_t first, int64_t count, torch::Tensor& buffer, int64_t at) {
  const int64_t heads = rows.size(1), head_bytes = rows.size(3) * rows.element_size();
  const char* source = static_cast<const char*>(rows.data_ptr());
  char* target = static_cast<char*>(buffer.data_ptr());
  const int64_t element = rows.element_size();
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < count; ++r)
      std::memcpy(target + (h * buffer.stride(1) + (at + r) * buffer.stride(2)) * element,
                  source + (h * rows.stride(1) + (first + r) * rows.stride(2)) * element, head_bytes);
}

// The attention of several sequences' rows of one forward (a batch of requests, each over its own cache):
// query [1, heads, R, hd] and the rows' own key, value [1, kv_heads, R, hd]; sequence b owns rows
// [starts[b], starts[b + 1]), its cache's key and value buffers [1, kv_heads, capacity, hd] hold cached[b] rows
// and get its new ones appended after them (the caller has made room: PositionIndexedCache.rows_to_write), and
// it attends under masks[b] [q_b, cached[b] + q_b] bool (an empty tensor: one row, which sees everything).
// Returns [1, R, heads, hd], each row exactly what tree_attention gives for its sequence alone.
torch::Tensor ragged_tree_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                                    std::vector<torch::Tensor> key_buffers, std::vector<torch::Tensor> value_buffers,
                                    std::vector<int64_t> cached, std::vector<int64_t> starts,
                                    std::vector<torch::Tensor> masks, double scale) {
  const auto dtype = query.scalar_type();
  const int64_t sequences = static_cast<int64_t>(key_buffers.size());
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "query: fp32 or bf16");
  TORCH_CHECK(sequences > 0 && static_cast<int64_t>(value_buffers.size()) == sequences &&
                  static_cast<int64_t>(cached.size()) == sequences &&
                  static_cast<int64_t>(starts.size()) == sequences + 1 &&
                  static_cast<int64_t>(masks.size()) == sequences, "one buffer pair, length and mask per sequence");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && query.size(0) == 1 && key.size(0) == 1 &&
                  value.size(0) == 1 && key.sizes() == value.sizes() && key.size(2) == query.size(2) &&
                  key.size(3) == query.size(3) && query.size(1) % key.size(1) == 0,
              "query [1, heads, R, head_dim], key and value [1, kv_heads, R, head_dim]");
  TORCH_CHECK(key.scalar_type() == dtype && value.scalar_type() == dtype, "key and value: query's dtype");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1, "head_dim must be contiguous");
  TORCH_CHECK(starts[0] == 0 && starts[sequences] == query.size(2), "starts must cover the rows from 0");
  const int64_t kv_heads = key.size(1), head_dim = key.size(3);
  std::vector<torch::Tensor> keys(sequences), values(sequences), mask_rows(sequences);
  std::vector<const bool*> mask_data(sequences, nullptr);
  for (int64_t b = 0; b < sequences; ++b) {
    const int64_t q = starts[b + 1] - starts[b];
    TORCH_CHECK(q >= 1, "every sequence has a row");
    for (const auto* buffer : {&key_buffers[b], &value_buffers[b]})
      TORCH_CHECK(buffer->scalar_type() == dtype && buffer->dim() == 4 && buffer->size(0) == 1 &&
                      buffer->size(1) == kv_heads && buffer->size(3) == head_dim && buffer->stride(3) == 1 &&
                      cached[b] >= 0 && cached[b] + q <= buffer->size(2),
                  "a cache buffer [1, kv_heads, capacity, head_dim] with room for its rows");
    append_rows(key, starts[b], q, key_buffers[b], cached[b]);
    append_rows(value, starts[b], q, value_buffers[b], cached[b]);
    keys[b] = key_buffers[b].narrow(2, 0, cached[b] + q);
    values[b] = value_buffers[b].narrow(2, 0, cached[b] + q);
    if (masks[b].numel() > 0) {
      TORCH_CHECK(masks[b].scalar_type() == torch::kBool && masks[b].dim() == 2 && masks[b].size(0) == q &&
                      masks[b].size(1) == cached[b] + q, "mask: bool [q, cached + q]");
      mask_rows[b] = masks[b].contiguous();
      mask_data[b] = mask_rows[b].data_ptr<bool>();
    } else {
      TORCH_CHECK(q == 1, "a sequence of several rows needs its mask");
    }
  }
  auto out = torch::empty({1, query.size(2), query.size(1), head_dim}, query.options());
  if (dtype == torch::kBFloat16)
    attend_ragged<at::BFloat16, uint16_t>(query, keys, values, starts, mask_data, static_cast<float>(scale), out);
  else
    attend_ragged<float, float>(query, keys, values, starts, mask_data, static_cast<float>(scale), out);
  return out;
}
