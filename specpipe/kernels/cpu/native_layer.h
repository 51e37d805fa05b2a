// specpipe's CPU kernel, a target's decoder layer over GGUF blocks in one call: native_decoder_layer runs a Llama
// decoder layer for the rows of one forward (one sequence, or several sequences' rows each over its own cache) with
// every product over the layer's weights in their GGUF blocks (gguf.h), the norms of norm.h, the attention of
// attention.h (ragged_tree_attention, which also appends the rows' keys and values to their caches), the SiLU gate of
// gate.h, and the rotary embedding and residual adds inline.
//
// Why: with the products over blocks a one-row step of a small model spends about as long in the ~20 torch ops per
// layer around them and the Python between those as in the products. Every op here is the one the op-by-op lean
// forward runs (specpipe.engine.lean_model), in its dtype and rounded as it rounds, so the layer's output and cache
// rows are that forward's bit for bit (specpipe.engine.native_layers; tests/test_native_layers.py).
// A part of kernel.cpp's one translation unit (see there).

#pragma once

#include "attention.h"
#include "gate.h"
#include "gguf.h"
#include "norm.h"

namespace {


// a + b over n values, in T as torch's add of two T tensors rounds (a float sum, rounded once to bf16)
template <typename T>
void residual_add(const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(to_float(a[i]) + to_float(b[i]));
}

// The rotary embedding of the q and k heads of each row (x * cos + rotate_half(x) * sin, each product and the sum
// rounded to T as torch's T ops round; signed_sin carries rotate_half's sign), the queries into query [1, heads, R,
// head_dim], the keys into key and the values copied into value [1, kv_heads, R, head_dim].
template <typename T>
void rotate_rows(const T* qkv, const T* cos, const T* signed_sin, int64_t rows, int64_t heads, int64_t kv_heads,
                 int64_t head_dim, T* query, T* key, T* value) {
  const int64_t rotated = heads + kv_heads, half = head_dim / 2, width = (rotated + kv_heads) * head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = qkv + r * width;
    const T* c = cos + r * head_dim;
    const T* s = signed_sin + r * head_dim;
    for (int64_t h = 0; h < rotated; ++h) {
      const T* x = row + h * head_dim;
      T* out = h < heads ? query + (h * rows + r) * head_dim : key + ((h - heads) * rows + r) * head_dim;
      for (int64_t i = 0; i < head_dim; ++i) {
        const T straight = static_cast<T>(to_float(x[i]) * to_float(c[i]));
        const T turned = static_cast<T>(to_float(x[i < half ? i + half : i - half]) * to_float(s[i]));
        out[i] = static_cast<T>(to_float(straight) + to_float(turned));
      }
    }
    for (int64_t h = 0; h < kv_heads; ++h)
      std::memcpy(value + (h * rows + r) * head_dim, row + (rotated + h) * head_dim, head_dim * sizeof(T));
  }
}

template <typename T>
torch::Tensor residual(const torch::Tensor& a, const torch::Tensor& b) {
  auto out = torch::empty_like(a);
  residual_add(a.data_ptr<T>(), b.data_ptr<T>(), out.data_ptr<T>(), a.numel());
  return out;
}

}  // namespace

// hidden [R, width] fp32 or bf16, contiguous -> the decoder layer's output [R, width] in its dtype.
// input_norm, post_norm [width] of hidden's dtype and eps: the layer's RMSNorms. blocks, formats, biases: the GGUF
// blocks (gguf_product's), their type ids and fp32 biases (or None) of q|k|v [(heads + 2 kv_heads) * head_dim, width],
// o [width, heads * head_dim], gate|up [2 intermediate, width] and down [width, intermediate]. gate_kernel: the SiLU
// gate by silu_gate (where the lean MLP takes it, CpuKernel.gate for these rows), else ATen's silu and product.
// cos, signed_sin [R, head_dim] of hidden's dtype: the rows' rotary tables (blocks.py's rotary_tables). The caches,
// rows and masks as ragged_tree_attention takes them (one sequence: one of each), scale the attention's.
torch::Tensor native_decoder_layer(torch::Tensor hidden, torch::Tensor input_norm, torch::Tensor post_norm,
                                   double eps, std::vector<torch::Tensor> blocks, std::vector<int64_t> formats,
                                   std::vector<c10::optional<torch::Tensor>> biases, int64_t heads, int64_t kv_heads,
                                   int64_t intermediate, bool gate_kernel, torch::Tensor cos,
                                   torch::Tensor signed_sin, std::vector<torch::Tensor> key_buffers,
                                   std::vector<torch::Tensor> value_buffers, std::vector<int64_t> cached,
                                   std::vector<int64_t> starts, std::vector<torch::Tensor> masks, double scale) {
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat32 || dtype == torch::kBFloat16) && hidden.dim() == 2 && hidden.is_contiguous(),
              "hidden: contiguous fp32 or bf16 [R, width]");
  TORCH_CHECK(blocks.size() == 4 && formats.size() == 4 && biases.size() == 4,
              "blocks, formats, biases: one each for q|k|v, o, gate|up, down");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  const int64_t rows = hidden.size(0), width = hidden.size(1), head_dim = cos.size(-1);
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == signed_sin.sizes() && cos.size(0) == rows && cos.is_contiguous() &&
                  signed_sin.is_contiguous() && cos.scalar_type() == dtype && signed_sin.scalar_type() == dtype &&
                  head_dim % 2 == 0,
              "cos, signed_sin: contiguous [R, head_dim] of hidden's dtype, head_dim even");
  const int64_t qkv_width = (heads + 2 * kv_heads) * head_dim;
  auto qkv = gguf_product(rms_norm(hidden, input_norm, eps), blocks[0], formats[0], width, biases[0]);
  TORCH_CHECK(qkv.size(-1) == qkv_width, "q|k|v blocks: (heads + 2 kv_heads) * head_dim outputs");
  auto query = torch::empty({1, heads, rows, head_dim}, hidden.options());
  auto key = torch::empty({1, kv_heads, rows, head_dim}, hidden.options());
  auto value = torch::empty({1, kv_heads, rows, head_dim}, hidden.options());
  if (dtype == torch::kBFloat16)
    rotate_rows(qkv.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(), signed_sin.data_ptr<at::BFloat16>(), rows,
                heads, kv_heads, head_dim, query.data_ptr<at::BFloat16>(), key.data_ptr<at::BFloat16>(),
                value.data_ptr<at::BFloat16>());
  else
    rotate_rows(qkv.data_ptr<float>(), cos.data_ptr<float>(), signed_sin.data_ptr<float>(), rows, heads, kv_heads,
                head_dim, query.data_ptr<float>(), key.data_ptr<float>(), value.data_ptr<float>());
  auto attended = ragged_tree_attention(query, key, value, std::move(key_buffers), std::move(value_buffers),
                                        std::move(cached), std::move(starts), std::move(masks), scale);
  auto attention_out = gguf_product(attended.view({rows, heads * head_dim}), blocks[1], formats[1], heads * head_dim,
                                    biases[1]);
  TORCH_CHECK(attention_out.size(-1) == width, "o blocks: width outputs");
  auto x = dtype == torch::kBFloat16 ? residual<at::BFloat16>(hidden, attention_out) : residual<float>(hidden, attention_out);
  auto gate_up = gguf_product(rms_norm(x, post_norm, eps), blocks[2], formats[2], width, biases[2]);
  TORCH_CHECK(gate_up.size(-1) == 2 * intermediate, "gate|up blocks: 2 intermediate outputs");
  auto gated = gate_kernel ? silu_gate(gate_up)
                           : at::silu(gate_up.narrow(-1, 0, intermediate)) * gate_up.narrow(-1, intermediate, intermediate);
  auto mlp_out = gguf_product(gated, blocks[3], formats[3], intermediate, biases[3]);
  TORCH_CHECK(mlp_out.size(-1) == width, "down blocks: width outputs");
  return dtype == torch::kBFloat16 ? residual<at::BFloat16>(x, mlp_out) : residual<float>(x, mlp_out);
}

// A forward's decoder layers in one call, layer l computed by native_decoder_layer over layer l - 1's output: per layer
// l, input_norms[l], post_norms[l], eps[l], scales[l] and gate_kernels[l] (nonzero: the SiLU gate kernel), and blocks,
// formats and biases [4 l .. 4 l + 3]; per layer l and sequence b (S = masks.size() sequences), key_buffers[l * S + b],
// value_buffers[l * S + b] and cached[l * S + b]; heads, kv_heads, intermediate, cos, signed_sin, starts and masks as
// native_decoder_layer takes them, shared by every layer. -> every layer's output [R, width], in order (the last is
// the forward's). Why one call: per layer, converting some thirty arguments and the Python between the calls cost
// about what the norms and the rotary embedding do.
std::vector<torch::Tensor> native_decoder_layers(
    torch::Tensor hidden, std::vector<torch::Tensor> input_norms, std::vector<torch::Tensor> post_norms,
    std::vector<double> eps, std::vector<torch::Tensor> blocks, std::vector<int64_t> formats,
    std::vector<c10::optional<torch::Tensor>> biases, int64_t heads, int64_t kv_heads, int64_t intermediate,
    std::vector<int64_t> gate_kernels, torch::Tensor cos, torch::Tensor signed_sin,
    std::vector<torch::Tensor> key_buffers, std::vector<torch::Tensor> value_buffers, std::vector<int64_t> cached,
    std::vector<int64_t> starts, std::vector<torch::Tensor> masks, std::vector<double> scales) {
  const size_t layers = input_norms.size(), sequences = masks.size();
  TORCH_CHECK(layers >= 1 && post_norms.size() == layers && eps.size() == layers && scales.size() == layers &&
                  gate_kernels.size() == layers && blocks.size() == 4 * layers && formats.size() == 4 * layers &&
                  biases.size() == 4 * layers,
              "per layer an input norm, a post norm, eps, scale and gate flag, and four blocks, formats and biases");
  TORCH_CHECK(sequences >= 1 && key_buffers.size() == layers * sequences &&
                  value_buffers.size() == layers * sequences && cached.size() == layers * sequences,
              "per layer and sequence a key buffer, a value buffer and a cached row count");
  std::vector<torch::Tensor> outputs;
  outputs.reserve(layers);
  for (size_t l = 0; l < layers; ++l) {
    const auto layer_part = [l](auto& all, size_t per) {  // layer l's `per` elements of a flattened vector
      using Vector = std::decay_t<decltype(all)>;
      return Vector(all.begin() + l * per, all.begin() + (l + 1) * per);
    };
    hidden = native_decoder_layer(hidden, input_norms[l], post_norms[l], eps[l], layer_part(blocks, 4),
                                  layer_part(formats, 4), layer_part(biases, 4), heads, kv_heads, intermediate,
                                  gate_kernels[l] != 0, cos, signed_sin, layer_part(key_buffers, sequences),
                                  layer_part(value_buffers, sequences), layer_part(cached, sequences), starts, masks,
                                  scales[l]);
    outputs.push_back(hidden);
  }
  return outputs;
}
