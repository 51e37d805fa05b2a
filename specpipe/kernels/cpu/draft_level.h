// specpipe's CPU kernel, a draft's decoder layer and its whole level in one call (AVX512_BF16 builds, weights in column
// blocks): block_decoder_layer runs a Llama decoder layer over bf16 rows (its products from blocks.h, its norms from
// norm.h, its attention from attention.h, its gate from gate.h, the rotary embedding, cache writes and residual adds
// inline); block_draft_level runs an EAGLE head's or a draft model's level: the embedding, fc, the layers, the final
// norm and the output layer's log-probs.
//
// Why: around its products and attention a draft level spent much of its time in small torch ops and the Python
// between them. Each op here is the one the op-by-op path runs, rounded as that path rounds it, so a level's outputs
// are that path's (specpipe.engine.draft_level.BlockLayers, KernelDraftLevel).
// A part of kernel.cpp's one translation unit (see there).

#pragma once

#include "attention.h"
#include "blocks.h"
#include "gate.h"
#include "norm.h"

// ---- a draft head's decoder layer in one call (AVX512_BF16, weights in column blocks) ----
// A Llama decoder layer over bf16 rows: x + attention(norm(x)), then + the SiLU-gated MLP of its norm, with
// every product over column blocks, the norms and the attention above, and the rotary embedding, the cache
// writes, the residual adds and the SiLU gate inline. Each elementwise op rounds to bf16 as torch's bf16 ops
// do; the SiLU gate is silu_gate's (ATen's vector exp) where the intermediate size is a multiple of the
// vector, else the C library's exp, which may differ from transformers' by a bf16 step now and then: this
// serves a draft head's layers (an EAGLE head), whose drafts the target verifies, never the target's own. Why: a
// bf16 EAGLE head's level spent about as long in ~100 small torch ops and their Python as in its products and
// attention.
namespace {

inline float widen(at::BFloat16 v) { return static_cast<float>(v); }
inline at::BFloat16 rounded(float v) { return at::BFloat16(v); }  // to nearest even, as a cast to bf16 rounds

// a [q, n] bf16 tensor of a + b, rounded as torch's bf16 add rounds
torch::Tensor bf16_add(const torch::Tensor& a, const torch::Tensor& b) {
  auto out = torch::empty_like(a);
  const at::BFloat16* x = a.data_ptr<at::BFloat16>();
  const at::BFloat16* y = b.data_ptr<at::BFloat16>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  for (int64_t i = 0, n = a.numel(); i < n; ++i) o[i] = rounded(widen(x[i]) + widen(y[i]));
  return out;
}

}  // namespace

// One sequence's rows of a draft layer or level: rows [start, start + rows) of the call's, appended to its own cache
// (key_cache / value_cache [1, kv_heads, capacity, head_dim] bf16, `length` rows valid before them), attending
// under `mask` [rows, length + rows] bool (True = attend; undefined: every row sees every key).
struct DraftSegment {
  int64_t start, rows;
  torch::Tensor key_cache, value_cache;
  int64_t length;
  torch::Tensor mask;
};

namespace {

void check_segments(const std::vector<DraftSegment>& segments, int64_t q, int64_t kv_heads, int64_t head_dim) {
  TORCH_CHECK(!segments.empty() && segments.front().start == 0 && segments.back().start + segments.back().rows == q,
              "the sequences' rows must cover the call's rows");
  for (size_t b = 0; b < segments.size(); ++b) {
    const DraftSegment& seg = segments[b];
    TORCH_CHECK(seg.rows >= 1 && (b == 0 || seg.start == segments[b - 1].start + segments[b - 1].rows),
                "each sequence's rows follow the previous one's");
    const auto& key_cache = seg.key_cache;
    const auto& value_cache = seg.value_cache;
    TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() && key_cache.size(0) == 1 &&
                key_cache.size(1) == kv_heads && key_cache.size(3) == head_dim &&
                key_cache.size(2) >= seg.length + seg.rows && key_cache.is_contiguous() &&
                value_cache.is_contiguous() && key_cache.scalar_type() == torch::kBFloat16 &&
                value_cache.scalar_type() == torch::kBFloat16,
                "key_cache, value_cache: contiguous bf16 [1, kv_heads, capacity >= length + q, head_dim]");
    TORCH_CHECK(!seg.mask.defined() || (seg.mask.scalar_type() == torch::kBool && seg.mask.dim() == 2 &&
                                        seg.mask.size(0) == seg.rows && seg.mask.size(1) == seg.length + seg.rows &&
                                        seg.mask.is_contiguous()),
                "mask: bool [q, length + q]");
  }
}

// The layer of block_decoder_layer over several sequences' rows: the products, norms and gate over all rows at once
// (each row's outputs are those of its rows alone: the sums run the same way for any number of rows), the rotary
// embedding, the cache writes and the attention per sequence (attend_ragged: each unit as `attend` computes it).
// amx_rows > 0: the products of that many rows and more on AMX tiles (amx_block_product's), 0 = never.
torch::Tensor decoder_layer_segments(const torch::Tensor& hidden, const c10::optional<torch::Tensor>& input_norm,
                                     const torch::Tensor& post_norm, double eps,
                                     const std::vector<torch::Tensor>& blocks,
                                     const std::vector<c10::optional<torch::Tensor>>& scales,
                                     const std::vector<c10::optional<torch::Tensor>>& biases, int64_t heads,
                                     int64_t kv_heads, int64_t intermediate, const torch::Tensor& cos,
                                     const torch::Tensor& signed_sin, const std::vector<DraftSegment>& segments,
                                     double scale, int64_t amx_rows) {
#ifdef __AVX512BF16__
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == torch::kBFloat16 && hidden.is_contiguous(),
              "hidden: contiguous bf16 [q, width]");
  TORCH_CHECK(blocks.size() == 4 && scales.size() == 4 && biases.size() == 4,
              "blocks, scales, biases: one each for q|k|v, o, gate|up, down");
  const int64_t q = hidden.size(0), width = hidden.size(1), head_dim = cos.size(-1);
  TORCH_CHECK(cos.sizes() == signed_sin.sizes() && cos.dim() == 2 && cos.size(0) == q && cos.is_contiguous() &&
              signed_sin.is_contiguous() && cos.scalar_type() == torch::kBFloat16 &&
              signed_sin.scalar_type() == torch::kBFloat16 && head_dim % 2 == 0,
              "cos, signed_sin: contiguous bf16 [q, head_dim], head_dim even");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  check_segments(segments, q, kv_heads, head_dim);
  const int64_t rotated = heads + kv_heads, half = head_dim / 2;
  auto normed = input_norm.has_value() ? rms_norm(hidden, *input_norm, eps) : hidden;
  auto qkv = blocks_times(normed, blocks[0], (rotated + kv_heads) * head_dim, scales[0], biases[0], true, amx_rows);
  // rotary embedding of the q and k heads (x * cos + rotate_half(x) * sin: each product and the sum rounded),
  // the queries into `query` [1, heads, q, head_dim], the keys and values into their sequence's cache rows
  auto query = torch::empty({1, heads, q, head_dim}, hidden.options());
  const at::BFloat16* qkv_data = qkv.data_ptr<at::BFloat16>();
  const at::BFloat16* cos_data = cos.data_ptr<at::BFloat16>();
  const at::BFloat16* sin_data = signed_sin.data_ptr<at::BFloat16>();
  at::BFloat16* query_data = query.data_ptr<at::BFloat16>();
  for (const DraftSegment& seg : segments) {
    at::BFloat16* keys = seg.key_cache.data_ptr<at::BFloat16>();
    at::BFloat16* values = seg.value_cache.data_ptr<at::BFloat16>();
    const int64_t capacity = seg.key_cache.size(2);
    for (int64_t r = seg.start; r < seg.start + seg.rows; ++r) {
      const int64_t at_row = seg.length + r - seg.start;
      const at::BFloat16* row = qkv_data + r * (rotated + kv_heads) * head_dim;
      const at::BFloat16* c = cos_data + r * head_dim;
      const at::BFloat16* s = sin_data + r * head_dim;
      for (int64_t h = 0; h < rotated; ++h) {
        const at::BFloat16* x = row + h * head_dim;
        at::BFloat16* out = h < heads ? query_data + (h * q + r) * head_dim
                                      : keys + ((h - heads) * capacity + at_row) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) {
          const float turned = widen(x[i < half ? i + half : i - half]);
          out[i] = rounded(widen(rounded(widen(x[i]) * widen(c[i]))) + widen(rounded(turned * widen(s[i]))));
        }
      }
      for (int64_t h = 0; h < kv_heads; ++h)
        std::memcpy(values + (h * capacity + at_row) * head_dim, row + (rotated + h) * head_dim,
                    head_dim * sizeof(at::BFloat16));
    }
  }
  auto attended = torch::empty({1, q, heads, head_dim}, hidden.options());
  if (segments.size() == 1) {
    const DraftSegment& seg = segments[0];
    attend<at::BFloat16, uint16_t>(query, seg.key_cache.narrow(2, 0, seg.length + q),
                                   seg.value_cache.narrow(2, 0, seg.length + q),
                                   seg.mask.defined() ? seg.mask.data_ptr<bool>() : nullptr, static_cast<float>(scale),
                                   attended);
  } else {
    std::vector<torch::Tensor> keys, values;
    std::vector<int64_t> starts;
    std::vector<const bool*> masks;
    for (const DraftSegment& seg : segments) {
      keys.push_back(seg.key_cache.narrow(2, 0, seg.length + seg.rows));
      values.push_back(seg.value_cache.narrow(2, 0, seg.length + seg.rows));
      starts.push_back(seg.start);
      masks.push_back(seg.mask.defined() ? seg.mask.data_ptr<bool>() : nullptr);
    }
    starts.push_back(q);
    attend_ragged<at::BFloat16, uint16_t>(query, keys, values, starts, masks, static_cast<float>(scale), attended);
  }
  auto x = bf16_add(hidden, blocks_times(attended.view({q, heads * head_dim}), blocks[1], width, scales[1], biases[1],
                                         true, amx_rows));
  auto gate_up = blocks_times(rms_norm(x, post_norm, eps), blocks[2], 2 * intermediate, scales[2], biases[2], true,
                              amx_rows);
  if (intermediate % kLanes == 0 && has_aten_exp())  // ATen's vector exp, over both threads
    return bf16_add(x, blocks_times(silu_gate(gate_up), blocks[3], width, scales[3], biases[3], true, amx_rows));
  auto gated = torch::empty({q, intermediate}, hidden.options());
  const at::BFloat16* gate_up_data = gate_up.data_ptr<at::BFloat16>();
  at::BFloat16* gated_data = gated.data_ptr<at::BFloat16>();
  for (int64_t r = 0; r < q; ++r)
    for (int64_t i = 0; i < intermediate; ++i) {
      const float gate = widen(gate_up_data[r * 2 * intermediate + i]);
      const at::BFloat16 silu = rounded(gate / (1.0f + std::exp(-gate)));
      gated_data[r * intermediate + i] = rounded(widen(silu) * widen(gate_up_data[(r * 2 + 1) * intermediate + i]));
    }
  return bf16_add(x, blocks_times(gated, blocks[3], width, scales[3], biases[3], true, amx_rows));
#else
  TORCH_CHECK(false, "block_decoder_layer needs the kernel's AVX512_BF16 build");
  return hidden;
#endif
}

}  // namespace

// hidden [q, width] bf16 -> [q, width] bf16, and the layer's keys and values of these q rows written into
// key_cache / value_cache [1, kv_heads, capacity, head_dim] bf16 at rows length ... length + q - 1.
// input_norm [width] bf16 or None (EAGLE-1's first layer has none), post_norm [width] bf16, eps: the RMSNorms.
// blocks: column blocks (pair_blocks or int8_pair_blocks) of q|k|v [(heads + 2 kv_heads) * head_dim, width],
// o [width, heads * head_dim], gate|up [2 intermediate, width] and down [width, intermediate]; scales and biases:
// each product's [out] fp32 or None. cos, signed_sin [q, head_dim] bf16: the rotary tables of the rows' positions
// (blocks.py's rotary_tables: sin with its first half negated). mask [q, length + q] bool (True = attend) or None.
torch::Tensor block_decoder_layer(torch::Tensor hidden, c10::optional<torch::Tensor> input_norm,
                                  torch::Tensor post_norm, double eps, std::vector<torch::Tensor> blocks,
                                  std::vector<c10::optional<torch::Tensor>> scales,
                                  std::vector<c10::optional<torch::Tensor>> biases, int64_t heads, int64_t kv_heads,
                                  int64_t intermediate, torch::Tensor cos, torch::Tensor signed_sin,
                                  torch::Tensor key_cache, torch::Tensor value_cache, int64_t length,
                                  c10::optional<torch::Tensor> mask, double scale) {
  const std::vector<DraftSegment> one{{0, hidden.size(0), key_cache, value_cache, length,
                                       mask.has_value() ? mask->contiguous() : torch::Tensor()}};
  return decoder_layer_segments(hidden, input_norm, post_norm, eps, blocks, scales, biases, heads, kv_heads,
                                intermediate, cos, signed_sin, one, scale, 0);
}

// One level of a draft in one call: an EAGLE head's (the rows' token embeddings beside their features through fc) or
// a draft model's (the embeddings alone), then the decoder layers (block_decoder_layer's, in order), the draft
// model's final norm, and the output layer's log-probs of each sequence's last rows; the rows of several sequences
// at once (a batch's level), each sequence over its own cache.
// Why: around the layers' own calls a level still spent much of its time in small torch ops and the Python between
// them (embedding, cat, fc, the rotary lookup, the cache's bookkeeping, the head, the log-softmax), and a batch's
// level, op by op, in them once more per sequence. Every op here is the one the op-by-op path runs (ATen's
// embedding, cat, index_select and log_softmax, rms_norm, blocks_times' sums, the same for any number of rows), so an
// EAGLE level's outputs are bitwise those of that path (BlockLayers' layer calls), and a draft model's those of
// BlockLayers over its layers; a sequence's rows in a batch's call are bitwise its rows alone.
// token_ids [q] int64, embedding [vocab, width] bf16; an EAGLE head: features [q, width] bf16 and fc's column
// blocks of [width, 2 width] with scale and bias [width] fp32 or None; a draft model: features and fc_blocks None.
// cos_table, signed_sin_table [n, head_dim] bf16 (rotary_tables' rows of positions 0 .. n - 1), positions [q]
// int64 < n. Per layer l: input_norms[l], post_norms[l], blocks, scales and biases [4 l .. 4 l + 3] as
// block_decoder_layer takes them. The q rows are S sequences' in order, sequence b's rows[b] of them; per layer l
// and sequence b, key_caches[l * S + b] and value_caches[l * S + b] as block_decoder_layer takes them, written at
// rows lengths[b] .. lengths[b] + rows[b] - 1, under masks[b] [rows[b], lengths[b] + rows[b]] or None.
// final_norm [width] bf16 or None (eps as the layers'). head: column blocks of [head_features, width], scale and
// bias [head_features] fp32 or None. amx_rows > 0: the products of that many rows and more on AMX tiles (only after
// amx_request() granted them; a row's sums then run in the tiles' order), 0 = never. -> {hidden [q, width] bf16
// (after final_norm), log-probs
// [sum(logprob_rows), head_features] fp32: the last logprob_rows[b] rows of each sequence b, in order}.
std::vector<torch::Tensor> block_draft_level(
    torch::Tensor token_ids, c10::optional<torch::Tensor> features, torch::Tensor embedding,
    c10::optional<torch::Tensor> fc_blocks, c10::optional<torch::Tensor> fc_scale,
    c10::optional<torch::Tensor> fc_bias, torch::Tensor cos_table, torch::Tensor signed_sin_table,
    torch::Tensor positions, std::vector<c10::optional<torch::Tensor>> input_norms,
    std::vector<torch::Tensor> post_norms, double eps, std::vector<torch::Tensor> blocks,
    std::vector<c10::optional<torch::Tensor>> scales, std::vector<c10::optional<torch::Tensor>> biases,
    int64_t heads, int64_t kv_heads, int64_t intermediate, std::vector<torch::Tensor> key_caches,
    std::vector<torch::Tensor> value_caches, std::vector<int64_t> lengths, std::vector<int64_t> rows,
    std::vector<c10::optional<torch::Tensor>> masks, double scale, c10::optional<torch::Tensor> final_norm,
    torch::Tensor head_blocks, int64_t head_features, c10::optional<torch::Tensor> head_scale,
    c10::optional<torch::Tensor> head_bias, std::vector<int64_t> logprob_rows, int64_t amx_rows) {
  const size_t layers = post_norms.size(), sequences = rows.size();
  TORCH_CHECK(layers >= 1 && input_norms.size() == layers && blocks.size() == 4 * layers &&
              scales.size() == 4 * layers && biases.size() == 4 * layers, "one input norm and post norm per layer, "
              "and four blocks, scales and biases per layer");
  TORCH_CHECK(sequences >= 1 && lengths.size() == sequences && masks.size() == sequences &&
              logprob_rows.size() == sequences && key_caches.size() == layers * sequences &&
              value_caches.size() == layers * sequences, "per sequence its rows, length, mask and log-prob rows, "
              "and a key cache and a value cache per layer and sequence");
  TORCH_CHECK(token_ids.dim() == 1 && token_ids.scalar_type() == torch::kLong, "token_ids: int64 [q]");
  const int64_t q = token_ids.size(0);
  TORCH_CHECK(q >= 1 && embedding.dim() == 2 && embedding.scalar_type() == torch::kBFloat16,
              "embedding: bf16 [vocab, width], q >= 1");
  const int64_t width = embedding.size(1);
  TORCH_CHECK(features.has_value() == fc_blocks.has_value(), "features and fc_blocks: both (an EAGLE head) or neither");
  TORCH_CHECK(!features.has_value() || (features->dim() == 2 && features->size(0) == q &&
                                        features->size(1) == width && features->scalar_type() == torch::kBFloat16),
              "features: bf16 [q, width]");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == q && positions.scalar_type() == torch::kLong,
              "positions: int64 [q]");
  TORCH_CHECK(cos_table.dim() == 2 && cos_table.sizes() == signed_sin_table.sizes() &&
              positions.max().item<int64_t>() < cos_table.size(0) && positions.min().item<int64_t>() >= 0,
              "cos_table, signed_sin_table: [n, head_dim] with every position below n");
  std::vector<int64_t> last_rows;  // each sequence's last logprob_rows[b] rows
  int64_t start = 0;
  std::vector<std::vector<DraftSegment>> segments(layers);
  for (size_t b = 0; b < sequences; ++b) {
    TORCH_CHECK(logprob_rows[b] >= 1 && logprob_rows[b] <= rows[b], "logprob_rows: from 1 to q");
    torch::Tensor mask = masks[b].has_value() ? masks[b]->contiguous() : torch::Tensor();
    for (size_t l = 0; l < layers; ++l)
      segments[l].push_back({start, rows[b], key_caches[l * sequences + b], value_caches[l * sequences + b],
                             lengths[b], mask});
    start += rows[b];
    for (int64_t r = start - logprob_rows[b]; r < start; ++r) last_rows.push_back(r);
  }
  TORCH_CHECK(start == q, "the sequences' rows must add up to q");
  auto hidden = at::embedding(embedding, token_ids);  // [q, width]
  if (fc_blocks.has_value())
    hidden = blocks_times(torch::cat({hidden, *features}, 1), *fc_blocks, width, fc_scale, fc_bias, true, amx_rows);
  const auto cos = cos_table.index_select(0, positions), signed_sin = signed_sin_table.index_select(0, positions);
  for (size_t l = 0; l < layers; ++l) {
    std::vector<torch::Tensor> layer_blocks(blocks.begin() + 4 * l, blocks.begin() + 4 * l + 4);
    std::vector<c10::optional<torch::Tensor>> layer_scales(scales.begin() + 4 * l, scales.begin() + 4 * l + 4);
    std::vector<c10::optional<torch::Tensor>> layer_biases(biases.begin() + 4 * l, biases.begin() + 4 * l + 4);
    hidden = decoder_layer_segments(hidden, input_norms[l], post_norms[l], eps, layer_blocks, layer_scales,
                                    layer_biases, heads, kv_heads, intermediate, cos, signed_sin, segments[l], scale,
                                    amx_rows);
  }
  if (final_norm.has_value()) hidden = rms_norm(hidden, *final_norm, eps);
  const auto heads_rows = sequences == 1 ? hidden.narrow(0, q - logprob_rows[0], logprob_rows[0])
                                         : hidden.index_select(0, torch::tensor(last_rows, torch::kLong));
  auto logits = blocks_times(heads_rows.contiguous(), head_blocks, head_features, head_scale, head_bias, true,
                             amx_rows);  // [sum(logprob_rows), head_features] bf16
  return {hidden, at::log_softmax(logits.to(torch::kFloat), -1)};
}
