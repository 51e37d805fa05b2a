// specpipe's CPU kernel, bf16 and int8 weights in column blocks (AVX512_BF16 builds): pair_blocks and
// int8_pair_blocks repack a weight once into blocks of 16 output features by pairs of k, block_product multiplies bf16
// rows by them (one vdpbf16ps per row and 64-byte line, into 16 sums that end in place), amx_block_product does it on
// AMX tiles from a given number of rows, and amx_request asks Linux for the tiles.
//
// Why: the row-by-row product (product.h) ends every row and feature with a horizontal sum, an epilogue and loads of
// x, which made its arithmetic, not the memory, its limit from about 9 rows; the blocks keep a verify's products near
// the memory's speed (engine.kernel_blocks, engine.amx_rows). In either product a row's output does not depend on the
// rows beside it.
// A part of kernel.cpp's one translation unit (see there).

#pragma once

#include <type_traits>

#include "product.h"

// ---- bf16 weights in column blocks (AVX512_BF16): the product without horizontal sums ----
// weight_product multiplies each weight row by each x row along k and sums the 16 lanes at the end. With
// SmolLM2-135M's 576 inputs that sum, the epilogue and the load of x for every row and feature made its
// arithmetic slower than the memory from 9 rows on. Here the weight is repacked once (pair_blocks)
// into blocks of 16 output features, each stored as pairs of k: block b holds, for every pair p,
// (w[16b + j][2p], w[16b + j][2p + 1]) for j = 0..15, one 64-byte line. A step takes one line of a block,
// broadcasts x's pair p of each row, and adds one vdpbf16ps per row into a vector of 16 output features:
// the sums end in place, in the order of k, the same for any number of rows (a row's output does not depend
// on the rows beside it).

namespace {

#ifdef __AVX512BF16__
constexpr int kBlockFeatures = 16;
constexpr int64_t kBlockTileBytes = 65536;  // the blocks all row groups run over while they are in L2

// One step's line of a block: 16 features x a pair of k. Bf16Pairs: 16 bf16 pairs (64 bytes), as they are.
struct Bf16Pairs {
  using Unit = uint32_t;  // one feature's pair
  static __m512i load(const Unit* p) { return _mm512_loadu_si512(p); }
};
// Int8Pairs: 16 int8 pairs (32 bytes; a drafter's weights, specpipe.engine.quantize) made bf16 in registers
// (exact: every int8 is a bf16); the weight row's step multiplies the finished sum (Epilogue::scale).
struct Int8Pairs {
  using Unit = uint16_t;
  static __m512i load(const Unit* p) {
    const int8_t* bytes = reinterpret_cast<const int8_t*>(p);
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(high, low);
  }
};

// One block's 16 sums of a row into the output: times the scale, then plus the bias, each rounded as
// Epilogue::apply rounds; to bf16 to nearest even. Only the block's real features (the weight's last block).
struct BlockEpilogue {
  int64_t feature, valid;
  __m512 add = _mm512_setzero_ps(), times = _mm512_set1_ps(1.0f);
  bool scaled, biased;
  BlockEpilogue(const Epilogue& epilogue, int64_t block, int64_t out_features)
      : feature(block * kBlockFeatures), valid(std::min<int64_t>(kBlockFeatures, out_features - feature)),
        scaled(epilogue.scale != nullptr), biased(epilogue.bias != nullptr) {
    if (biased) add = _mm512_maskz_loadu_ps((__mmask16)((1u << valid) - 1), epilogue.bias + feature);
    if (scaled) times = _mm512_maskz_loadu_ps((__mmask16)((1u << valid) - 1), epilogue.scale + feature);
  }
  // sums: the block's 16 features of one row; row: that row of the output
  void store(__m512 sums, uint16_t* row) const {
    if (scaled) sums = _mm512_mul_ps(sums, times);
    if (biased) sums = _mm512_add_ps(sums, add);
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(sums);
    row += feature;
    if (valid == kBlockFeatures) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), rounded);
    } else {  // the weight's last block: only its real features (a masked 16-bit store needs AVX-512VL)
      alignas(32) uint16_t lanes[kBlockFeatures];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), rounded);
      std::memcpy(row, lanes, valid * sizeof(uint16_t));
    }
  }
};

// out[r, 16 (first + b) + j] for R rows and B blocks from `first`, one accumulator per row and block.
template <typename Line, int R, int B>
void block_group(const uint32_t* x, const typename Line::Unit* blocks, Epilogue epilogue, uint16_t* out,
                 int64_t pairs, int64_t out_stride, int64_t out_features, int64_t first) {
  __m512 acc[R][B];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const typename Line::Unit* lines[B];
#pragma GCC unroll 4
  for (int b = 0; b < B; ++b) lines[b] = blocks + (first + b) * pairs * kBlockFeatures;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i weights[B];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
      weights[b] = Line::load(lines[b] + p * kBlockFeatures);
      // kBlockPrefetchLines on in the same block; past its end: the next block's first lines (never a fault)
      _mm_prefetch(reinterpret_cast<const char*>(lines[b] + (p + kBlockPrefetchLines) * kBlockFeatures),
                   SPECPIPE_WEIGHT_HINT);
      // From kBlockLookaheadRows rows on, a line's arithmetic takes as long as its memory, and the near
      // prefetch above comes too late for the two to overlap: ask L2 as well for the line kBlockLookaheadBytes
      // on (the blocks lie one after another: past this block, the next ones; past the weight's end, lines
      // that go unused, never a fault)
      if constexpr (R >= kBlockLookaheadRows && kBlockLookaheadBytes > 0)
        _mm_prefetch(reinterpret_cast<const char*>(lines[b] + p * kBlockFeatures) + kBlockLookaheadBytes, _MM_HINT_T1);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512i pair = _mm512_set1_epi32(static_cast<int>(x[r * pairs + p]));
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)weights[b], (__m512bh)pair);
    }
  }
#pragma GCC unroll 4
  for (int b = 0; b < B; ++b) {
    const BlockEpilogue finish(epilogue, first + b, out_features);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) finish.store(acc[r][b], out + r * out_stride);
  }
}

// Rows per group and blocks per group: one accumulator per row and block, R * B of the 32 registers. Weights
// streamed from memory (a target's): one block up to 8 rows (a step is the line's load and R multiply-adds),
// two from 9 to 16 rows (each broadcast of x then serves two); more blocks at once for 2-6 rows read the memory
// slower. Weights in the cache: there one block's chain of multiply-adds into one accumulator waits on the
// instruction's latency, not on the memory, and few rows gain from several blocks at once (`resident`). Cold, several
// blocks were no faster, and a head's output layer, read last in a level, was slower with them; so only a head's
// decoder layer in one call (block_decoder_layer) takes them, its weights read right after the head's fc.
// The blocks' count never changes a row's sums (each block sums over k in order).
// Resident: an EAGLE head's six products at 1-4 rows in 23-39% less time, warm (docs/notebook/run-58.md).
constexpr int kBlockMaxRows = 16;
template <int R, bool Resident>
constexpr int blocks_per_group() { return Resident ? (R == 1 ? 4 : R <= 3 ? 3 : 2) : (R <= 8 ? 1 : 2); }

// Rows [x, x + count) over blocks [begin, end) of the weight, count <= kBlockMaxRows.
template <typename Line, bool Resident, int R = 1>
void block_rows(int64_t count, const uint32_t* x, const typename Line::Unit* blocks, Epilogue epilogue, uint16_t* out,
                int64_t pairs, int64_t out_stride, int64_t out_features, int64_t begin, int64_t end) {
  if constexpr (R < kBlockMaxRows) {
    if (count != R)
      return block_rows<Line, Resident, R + 1>(count, x, blocks, epilogue, out, pairs, out_stride, out_features, begin,
                                               end);
  }
  constexpr int B = blocks_per_group<R, Resident>();
  int64_t b = begin;
  for (; b + B <= end; b += B) block_group<Line, R, B>(x, blocks, epilogue, out, pairs, out_stride, out_features, b);
  for (; b < end; ++b) block_group<Line, R, 1>(x, blocks, epilogue, out, pairs, out_stride, out_features, b);
}

// All rows over all blocks, threads splitting the blocks: groups of up to kBlockMaxRows rows run, one after
// another, over each tile of blocks while it is in cache, so the weight streams from memory once (one group:
// the whole range at once, so a resident weight's several blocks at a time are not cut at tiles).
template <typename Line, bool Resident>
void block_product_rows(const uint32_t* xs, const typename Line::Unit* w, Epilogue epilogue, uint16_t* os, int64_t rows,
                        int64_t pairs, int64_t count, int64_t out_features) {
  const int64_t tile = Resident && rows <= kBlockMaxRows
      ? count : std::max<int64_t>(2, kBlockTileBytes / (pairs * kBlockFeatures * sizeof(typename Line::Unit)));
  const int64_t grain = std::max<int64_t>(2, count / (4 * at::get_num_threads()));
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t tile_begin = begin; tile_begin < end; tile_begin += tile) {
      const int64_t tile_end = std::min(end, tile_begin + tile);
      for (int64_t first = 0, group = 0; first < rows; first += group) {
        const int64_t left = rows - first, groups = (left + kBlockMaxRows - 1) / kBlockMaxRows;
        group = (left + groups - 1) / groups;
        block_rows<Line, Resident>(group, xs + first * pairs, w, epilogue, os + first * out_features, pairs,
                                   out_features, out_features, tile_begin, tile_end);
      }
    }
  });
}

// ---- the column blocks on AMX tiles (engine.amx_rows) ----
// A block's 16 lines from pair p on are, as they lie, the B tile of one TDPBF16PS (16 pairs of k x 16 features),
// and 16 pairs of k of up to 16 rows of x its A tile: one instruction does what 16 rows x 16 lines of vdpbf16ps do,
// so the product of up to 16 rows is bound by the weight's memory alone. Each C element sums its row's pairs in the
// order of k, whatever rows come with it (a row's output does not depend on the rows beside it); the tiles' sums
// are not bitwise the vdpbf16ps ones, so a product's row count alone picks one of the two.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define SPECPIPE_AMX 1
#define SPECPIPE_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
constexpr int64_t kAmxPairs = 16;  // pairs of k per step: 64 bytes of a row of x, 16 lines of a block
constexpr int kAmxBlocks = 4;      // blocks per group: C tiles 0-3; tile 4 holds x, tiles 5 and 6 the blocks' lines

// The 64-byte operand of LDTILECFG (palette 1)
struct AmxConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// The tiles' shapes for groups of `rows` rows, in the calling thread (tile state is per thread)
SPECPIPE_AMX_TARGET void amx_configure(int rows) {
  AmxConfig config;
  for (int t = 0; t <= kAmxBlocks; ++t) config.rows[t] = rows, config.bytes_per_row[t] = 64;
  for (int t = kAmxBlocks + 1; t <= kAmxBlocks + 2; ++t) config.rows[t] = kAmxPairs, config.bytes_per_row[t] = 64;
  // GCC 12 takes LDTILECFG for a reader of fewer bytes than its 64 and dropped the stores of the shapes: the
  // barrier makes it store all of them first
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

SPECPIPE_AMX_TARGET void amx_release() { _tile_release(); }

// Where a block's 16 lines from pair p on lie as the B operand of one TDPBF16PS (64 bytes a line): bf16 lines where
// they lie in the weight, int8 lines widened (Line::load, exact) into `widened` [16 lines x 64 bytes] first
template <typename Line>
inline const void* amx_lines(const typename Line::Unit* lines, uint32_t* widened) {
  if constexpr (std::is_same_v<Line, Bf16Pairs>) {
    return lines;
  } else {
#pragma GCC unroll 16
    for (int l = 0; l < kAmxPairs; ++l)
      _mm512_store_si512(widened + l * kBlockFeatures, Line::load(lines + l * kBlockFeatures));
    // GCC's TILELOADD names only the address: without this the stores above are dead to it and may be dropped
    asm volatile("" : : "r"(widened) : "memory");
    return widened;
  }
}

// out[r, 16 (first + b) + j] for the configured rows (x's, `rows` of them) and B blocks from `first`
template <typename Line, int B>
SPECPIPE_AMX_TARGET void amx_group(const uint32_t* x, int rows, const typename Line::Unit* blocks, Epilogue epilogue,
                                   uint16_t* out, int64_t pairs, int64_t out_stride, int64_t out_features,
                                   int64_t first) {
  _tile_zero(0);
  if constexpr (B > 1) _tile_zero(1);
  if constexpr (B > 2) _tile_zero(2);
  if constexpr (B > 3) _tile_zero(3);
  const typename Line::Unit* lines[B];
  for (int b = 0; b < B; ++b) lines[b] = blocks + (first + b) * pairs * kBlockFeatures;
  const int64_t x_stride = pairs * sizeof(uint32_t);
  alignas(64) uint32_t widened[2][kAmxPairs * kBlockFeatures];  // int8 lines made bf16, one buffer per B tile
  for (int64_t p = 0; p < pairs; p += kAmxPairs) {
    // the next step's lines of each block, and L2 for the lines kBlockLookaheadBytes on (at any row count: the
    // tiles serve products of several rows); past the weight's end only lines that go unused, never a fault
    for (int b = 0; b < B; ++b) {
      const char* line = reinterpret_cast<const char*>(lines[b] + p * kBlockFeatures);
#pragma GCC unroll 16
      for (int l = 0; l < kAmxPairs; ++l) {
        _mm_prefetch(line + (kAmxPairs + l) * 64, SPECPIPE_WEIGHT_HINT);
        if constexpr (kBlockLookaheadBytes > 0) _mm_prefetch(line + l * 64 + kBlockLookaheadBytes, _MM_HINT_T1);
      }
    }
    _tile_loadd(4, x + p, x_stride);
    _tile_loadd(5, amx_lines<Line>(lines[0] + p * kBlockFeatures, widened[0]), 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (B > 1) {
      _tile_loadd(6, amx_lines<Line>(lines[1] + p * kBlockFeatures, widened[1]), 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (B > 2) {
      _tile_loadd(5, amx_lines<Line>(lines[2] + p * kBlockFeatures, widened[0]), 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (B > 3) {
      _tile_loadd(6, amx_lines<Line>(lines[3] + p * kBlockFeatures, widened[1]), 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  alignas(64) float sums[kAmxBlocks][kBlockMaxRows][kBlockFeatures];
  _tile_stored(0, sums[0], 64);
  if constexpr (B > 1) _tile_stored(1, sums[1], 64);
  if constexpr (B > 2) _tile_stored(2, sums[2], 64);
  if constexpr (B > 3) _tile_stored(3, sums[3], 64);
  for (int b = 0; b < B; ++b) {
    const BlockEpilogue finish(epilogue, first + b, out_features);
    for (int r = 0; r < rows; ++r) finish.store(_mm512_load_ps(sums[b][r]), out + r * out_stride);
  }
}

// block_product_rows on the tiles: blocks whose pairs are a multiple of kAmxPairs
template <typename Line>
void amx_product_rows(const uint32_t* xs, const typename Line::Unit* w, Epilogue epilogue, uint16_t* os, int64_t rows,
                      int64_t pairs, int64_t count, int64_t out_features) {
  const int64_t tile = std::max<int64_t>(
      kAmxBlocks, kBlockTileBytes / (pairs * kBlockFeatures * static_cast<int64_t>(sizeof(typename Line::Unit))));
  const int64_t grain = std::max<int64_t>(kAmxBlocks, count / (4 * at::get_num_threads()));
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    int configured = 0;
    for (int64_t tile_begin = begin; tile_begin < end; tile_begin += tile) {
      const int64_t tile_end = std::min(end, tile_begin + tile);
      for (int64_t first = 0, group = 0; first < rows; first += group) {
        const int64_t left = rows - first, groups = (left + kBlockMaxRows - 1) / kBlockMaxRows;
        group = (left + groups - 1) / groups;
        if (group != configured) amx_configure(static_cast<int>(group)), configured = static_cast<int>(group);
        const uint32_t* x = xs + first * pairs;
        uint16_t* out = os + first * out_features;
        int64_t b = tile_begin;
        for (; b + kAmxBlocks <= tile_end; b += kAmxBlocks)
          amx_group<Line, kAmxBlocks>(x, group, w, epilogue, out, pairs, out_features, out_features, b);
        for (; b < tile_end; ++b) amx_group<Line, 1>(x, group, w, epilogue, out, pairs, out_features, out_features, b);
      }
    }
    if (configured) amx_release();
  });
}
#endif
#endif

// The column blocks of a weight [out, in] of `Value`s (2-byte bf16 or 1-byte int8), in units of `unit_type` (one
// feature's pair: int32 or int16)
template <typename Value>
torch::Tensor column_blocks(const Value* w, int64_t out_features, int64_t in, c10::ScalarType unit_type,
                            const torch::TensorOptions& options) {
  const int64_t pairs = (in + 1) / 2, count = (out_features + 15) / 16;
  auto blocks = torch::zeros({count, pairs, 16}, options.dtype(unit_type));
  Value* packed = reinterpret_cast<Value*>(blocks.data_ptr());
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t j = 0; j < 16 && 16 * b + j < out_features; ++j) {
        const Value* row = w + (16 * b + j) * in;
        for (int64_t k = 0; k < in; ++k) packed[((b * pairs + k / 2) * 16 + j) * 2 + k % 2] = row[k];
      }
  });
  return blocks;
}

}  // namespace

// weight bf16 [out, in] -> its column blocks, int32 [ceil(out / 16), ceil(in / 2), 16]: block b, pair p, lane j
// holds the bf16 pair (w[16b + j][2p], w[16b + j][2p + 1]), low half first; features past `out` and an odd
// `in`'s last value are zeros. Only the AVX512_BF16 build multiplies them (block_product).
torch::Tensor pair_blocks(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "weight: bf16 [out, in]");
  weight = weight.contiguous();
  return column_blocks(reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), weight.size(0),
                       weight.size(1), torch::kInt32, weight.options());
}

// int8 codes [out, in] (specpipe.engine.quantize) -> their column blocks, int16 [ceil(out / 16), ceil(in / 2), 16]:
// each int16 holds one feature's pair of codes, low byte first; block_product takes the codes' scale.
torch::Tensor int8_pair_blocks(torch::Tensor codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kChar, "codes: int8 [out, in]");
  codes = codes.contiguous();
  return column_blocks(codes.data_ptr<int8_t>(), codes.size(0), codes.size(1), torch::kShort, codes.options());
}

namespace {

// block_product below; `resident`: the weight is expected in the cache (a draft head's layer,
// block_decoder_layer): few rows take several blocks at a time (the same sums)
torch::Tensor blocks_times(torch::Tensor x, const torch::Tensor& blocks, int64_t out_features,
                           const c10::optional<torch::Tensor>& scale, const c10::optional<torch::Tensor>& bias,
                           bool resident, int64_t amx_rows = 0) {
#ifdef __AVX512BF16__
  const bool int8 = blocks.scalar_type() == torch::kShort;
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == 16 && (int8 || blocks.scalar_type() == torch::kInt32)
              && blocks.is_contiguous() && out_features > 16 * (blocks.size(0) - 1) && out_features <= 16 * blocks.size(0),
              "blocks: pair_blocks or int8_pair_blocks of a weight of out_features rows");
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == torch::kBFloat16, "x: bf16 [..., in]");
  const int64_t pairs = blocks.size(1), in = x.size(-1);
  TORCH_CHECK(in > 0 && (in + 1) / 2 == pairs, "x and blocks disagree on in_features");
  x = x.contiguous();
  std::vector<int64_t> out_sizes = x.sizes().vec();
  out_sizes.back() = out_features;
  auto out = torch::empty(out_sizes, x.options());
  const int64_t rows = x.numel() / in;
  torch::Tensor padded;  // an odd `in`: each row gets a zero pair partner, so pairs of x never straddle rows
  if (in % 2) {
    padded = torch::zeros({rows, 2 * pairs}, x.options());
    padded.narrow(1, 0, in).copy_(x.view({rows, in}));
    x = padded;
  }
  const Epilogue epilogue{checked_fp32(scale, out_features, "scale"), checked_fp32(bias, out_features, "bias")};
  const uint32_t* xs = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  uint16_t* os = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const uint16_t* codes = int8 ? reinterpret_cast<const uint16_t*>(blocks.data_ptr<int16_t>()) : nullptr;
  const uint32_t* pairs_of = int8 ? nullptr : reinterpret_cast<const uint32_t*>(blocks.data_ptr<int32_t>());
#ifdef SPECPIPE_AMX
  if (amx_rows > 0 && rows >= amx_rows && pairs % kAmxPairs == 0) {
    if (int8)
      amx_product_rows<Int8Pairs>(xs, codes, epilogue, os, rows, pairs, blocks.size(0), out_features);
    else
      amx_product_rows<Bf16Pairs>(xs, pairs_of, epilogue, os, rows, pairs, blocks.size(0), out_features);
    return out;
  }
#endif
  if (int8 && resident)
    block_product_rows<Int8Pairs, true>(xs, codes, epilogue, os, rows, pairs, blocks.size(0), out_features);
  else if (int8)
    block_product_rows<Int8Pairs, false>(xs, codes, epilogue, os, rows, pairs, blocks.size(0), out_features);
  else if (resident)
    block_product_rows<Bf16Pairs, true>(xs, pairs_of, epilogue, os, rows, pairs, blocks.size(0), out_features);
  else
    block_product_rows<Bf16Pairs, false>(xs, pairs_of, epilogue, os, rows, pairs, blocks.size(0), out_features);
  return out;
#else
  TORCH_CHECK(false, "block_product needs the kernel's AVX512_BF16 build");
  return x;
#endif
}

}  // namespace

// x [..., in] bf16, blocks from pair_blocks or int8_pair_blocks (of a weight [out_features, in]), scale [out] fp32 or None, bias
// [out] fp32 or None -> [..., out_features] bf16: out[r, o] = scale[o] * sum_k x[r, k] * w[o, k] + bias[o],
// summed in fp32 and rounded once. Groups of up to 16 rows run, one after another, over each tile of blocks
// while it is in cache: the weight streams from memory once for any number of rows.
torch::Tensor block_product(torch::Tensor x, torch::Tensor blocks, int64_t out_features,
                            c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> bias) {
  return blocks_times(x, blocks, out_features, scale, bias, false);
}

// block_product on AMX tiles for products of `min_rows` rows (>= 1) and more where the blocks' pairs of k are a
// multiple of 16 (else block_product itself); int8 blocks are widened to bf16 (exact) on their way to the tiles.
// Only after amx_request() granted the tiles to this process.
torch::Tensor amx_block_product(torch::Tensor x, torch::Tensor blocks, int64_t out_features,
                                c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> bias,
                                int64_t min_rows) {
  TORCH_CHECK(min_rows >= 1, "min_rows: 1 or more");
  return blocks_times(x, blocks, out_features, scale, bias, false, min_rows);
}

// Asks Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): true where it is granted
// and this build has the tiles; a process must ask before its first tile instruction.
bool amx_request() {
#ifdef SPECPIPE_AMX
  constexpr int kRequestPermission = 0x1023, kTileData = 18;
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
#else
  return false;
#endif
}
