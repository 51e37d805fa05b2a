// specpipe's CPU kernel: the extension module that specpipe.engine.cpu_kernel builds with torch's extension builder
// (torch.utils.cpp_extension.load) and loads, once per machine and torch installation.
//
// It computes the few-row products of a decoding step or a tree verify over bf16, fp32, int8 and GGUF weights, the
// RMSNorm, the attention and the SiLU gate of the lean forward, and a draft head's layer or whole level in one call:
// the small-batch work CPUs do in speculative decoding, where ATen and oneDNN read the weights below the memory's
// speed or spend their time in many small ops. Each part is a header of this one translation unit:
//
//   lanes.h        the fp32 vector layer (AVX-512 or AVX2) the other parts are written in
//   product.h      weight_product, invariant_weight_product, quantized_product: bf16, fp32 and int8 weights, row by
//                  row
//   gguf.h         gguf_product, gguf_widen: weights in GGUF blocks, widened in registers
//   blocks.h       pair_blocks, block_product, amx_block_product: bf16 and int8 weights in column blocks
//   norm.h         rms_norm: LlamaRMSNorm, bitwise transformers'
//   attention.h    tree_attention, ragged_tree_attention: a step's or a verify's attention over the KV cache
//                  (set_attention_tiles: bf16 heads on AMX tiles)
//   gate.h         silu_gate: the MLP's silu(gate) * up, bitwise torch's
//   draft_level.h  block_decoder_layer, block_draft_level: a draft head's layer and level in one call
//   gguf_tiles.h   gguf_tile_pack: Q4_1 and Q8_0 blocks reordered for AMX tiles, which gguf_product multiplies there
//   native_layer.h native_decoder_layer, native_decoder_layers: a target's decoder layer, or all of a forward's, over
//                  GGUF blocks in one call
//
// One translation unit, because the parts share helpers in anonymous namespaces and call into each other, and torch's
// headers are compiled once: include the parts here only. The build's flags pick the ISA (specpipe.engine.cpu_kernel
// ISA_FLAGS) and set the SPECPIPE_* macros (build_flags); the library's name hashes these files, the flags and the
// torch installation, so any change to them is a build of its own.

#include <torch/extension.h>

#include "lanes.h"
#include "product.h"
#include "gguf.h"
#include "blocks.h"
#include "norm.h"
#include "attention.h"
#include "gate.h"
#include "draft_level.h"
#include "gguf_tiles.h"
#include "native_layer.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
m.def("weight_product", torch::wrap_pybind_function(weight_product), "weight_product");
m.def("invariant_weight_product", torch::wrap_pybind_function(invariant_weight_product), "invariant_weight_product");
m.def("quantized_product", torch::wrap_pybind_function(quantized_product), "quantized_product");
m.def("pair_blocks", torch::wrap_pybind_function(pair_blocks), "pair_blocks");
m.def("int8_pair_blocks", torch::wrap_pybind_function(int8_pair_blocks), "int8_pair_blocks");
m.def("block_product", torch::wrap_pybind_function(block_product), "block_product");
m.def("rms_norm", torch::wrap_pybind_function(rms_norm), "rms_norm");
m.def("tree_attention", torch::wrap_pybind_function(tree_attention), "tree_attention");
m.def("ragged_tree_attention", torch::wrap_pybind_function(ragged_tree_attention), "ragged_tree_attention");
m.def("set_attention_tiles", torch::wrap_pybind_function(set_attention_tiles), "set_attention_tiles");
m.def("attention_tiles_on", torch::wrap_pybind_function(attention_tiles_on), "attention_tiles_on");
m.def("silu_gate", torch::wrap_pybind_function(silu_gate), "silu_gate");
m.def("gguf_product", torch::wrap_pybind_function(gguf_product), "gguf_product");
m.def("gguf_widen", torch::wrap_pybind_function(gguf_widen), "gguf_widen");
m.def("gguf_tile_pack", torch::wrap_pybind_function(gguf_tile_pack), "gguf_tile_pack");
m.def("gguf_tile_unpack", torch::wrap_pybind_function(gguf_tile_unpack), "gguf_tile_unpack");
m.def("block_decoder_layer", torch::wrap_pybind_function(block_decoder_layer), "block_decoder_layer");
m.def("block_draft_level", torch::wrap_pybind_function(block_draft_level), "block_draft_level");
m.def("native_decoder_layer", torch::wrap_pybind_function(native_decoder_layer), "native_decoder_layer");
m.def("native_decoder_layers", torch::wrap_pybind_function(native_decoder_layers), "native_decoder_layers");
m.def("amx_block_product", torch::wrap_pybind_function(amx_block_product), "amx_block_product");
m.def("amx_request", torch::wrap_pybind_function(amx_request), "amx_request");
}
