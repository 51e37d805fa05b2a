// specpipe's CPU kernel, Q4_1 and Q8_0 weights on AMX tiles: gguf_tile_pack reorders a weight's blocks (same bytes,
// same codes and scales) so that 16 output features' codes for 32 weights of k widen straight into the B operand of
// one TDPBF16PS, and gguf_product multiplies rows of x by them on the tiles (its format kGgufTiles + the blocks' type
// id).
//
// Why: the vector product (gguf.h) pays one fused multiply-add per weight and row, so its cost grows with the rows
// from a few on; one TDPBF16PS multiplies 16 rows by 16 features x 32 weights, so up to 16 rows cost about what one
// does (widening the codes), and a batch of requests or a tree verifies for about a one-token step's time.
// The arithmetic: a weight is d * q + m (Q4_1: fp16 step d and minimum m per 32 weights, 4-bit code q) or d * q (Q8_0:
// 8-bit code), so a row's sum over a block is d * sum(q * x) [+ m * sum(x)]. A code is exact in bf16, and an fp32 x is
// exactly the sum of three bf16 parts (hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid)), so sum(q * part)
// is the tiles' fp32 sum of exact products, and the parts' sums are added in one order (one part where x is bf16).
// Each row's block sums, their scaling and their sum over the blocks run in one order whatever rows come with it: a
// row's output does not depend on the rows beside it, nor on how many there are. They are not bitwise the vector
// product's (another order of sums), so a weight takes one of the two for all its products
// (specpipe.engine.gguf_weights.on_tiles).
// A part of kernel.cpp's one translation unit (see there).

#pragma once

#include "blocks.h"
#include "gguf.h"

namespace {

constexpr int64_t kTileFeatures = 16, kTileValues = 32;  // a tile: 16 output features x one block of 32 weights of k

// A tile of a packed weight: the 16 features' steps (fp16), [Q4_1: their 16 minimums (fp16)], then for each of the 16
// pairs p of k one line of the B operand's codes, whose word 2n + s is feature n's code for weight 2p + s (Q4_1: a
// 16-byte line whose byte j holds word j in its low nibble and word 16 + j in its high one; Q8_0: 32 bytes, word w in
// byte w).
template <int Format>
struct TileLayout;
template <>
struct TileLayout<kGgufQ4_1> {
  static constexpr int64_t kBlockBytes = 20, kBytes = 16 * kBlockBytes, kCodes = 64, kLineBytes = 16;
  static constexpr bool kMinimum = true;
  static uint8_t block_code(const uint8_t* block, int k) {
    return k < 16 ? block[4 + k] & 0x0F : block[4 + k - 16] >> 4;
  }
  static void set_block_code(uint8_t* block, int k, uint8_t code) { block[4 + k % 16] |= k < 16 ? code : code << 4; }
  static void set_line_code(uint8_t* line, int word, uint8_t code) { line[word % 16] |= word < 16 ? code : code << 4; }
  static uint8_t line_code(const uint8_t* line, int word) {
    return word < 16 ? line[word] & 0x0F : line[word - 16] >> 4;
  }
};
template <>
struct TileLayout<kGgufQ8_0> {
  static constexpr int64_t kBlockBytes = 34, kBytes = 16 * kBlockBytes, kCodes = 32, kLineBytes = 32;
  static constexpr bool kMinimum = false;
  static uint8_t block_code(const uint8_t* block, int k) { return block[2 + k]; }
  static void set_block_code(uint8_t* block, int k, uint8_t code) { block[2 + k] = code; }
  static void set_line_code(uint8_t* line, int word, uint8_t code) { line[word] = code; }
  static uint8_t line_code(const uint8_t* line, int word) { return line[word]; }
};

// blocks [out, in / 32 * block bytes] -> the same weight in tile order (same shape), the tiles of a feature group in
// the order of k (`pack`), or back (!`pack`). Needs out a multiple of 16.
template <int Format>
void reorder_tiles(const uint8_t* from, uint8_t* to, int64_t out, int64_t in, bool pack) {
  using Layout = TileLayout<Format>;
  constexpr int64_t kScales = Layout::kMinimum ? 2 : 1;
  const int64_t count = in / kTileValues, row_bytes = count * Layout::kBlockBytes;
  at::parallel_for(0, out / kTileFeatures, 1, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group)
      for (int64_t b = 0; b < count; ++b) {
        const int64_t tile_at = (group * count + b) * Layout::kBytes;
        if (pack) std::memset(to + tile_at + Layout::kCodes, 0, Layout::kBytes - Layout::kCodes);
        for (int n = 0; n < kTileFeatures; ++n) {
          const int64_t block_at = (group * kTileFeatures + n) * row_bytes + b * Layout::kBlockBytes;
          const uint8_t* block = pack ? from + block_at : to + block_at;
          uint8_t* tile = pack ? to + tile_at : const_cast<uint8_t*>(from) + tile_at;
          if (!pack) std::memset(to + block_at + 2 * kScales, 0, Layout::kBlockBytes - 2 * kScales);
          for (int64_t scale = 0; scale < kScales; ++scale) {  // d, then m
            if (pack) std::memcpy(tile + 32 * scale + 2 * n, block + 2 * scale, 2);
            else std::memcpy(to + block_at + 2 * scale, tile + 32 * scale + 2 * n, 2);
          }
          for (int k = 0; k < kTileValues; ++k) {
            uint8_t* line = tile + Layout::kCodes + Layout::kLineBytes * (k / 2);
            const int word = 2 * n + k % 2;
            if (pack) Layout::set_line_code(line, word, Layout::block_code(block, k));
            else Layout::set_block_code(to + block_at, k, Layout::line_code(line, word));
          }
        }
      }
  });
}

#ifdef SPECPIPE_AMX
constexpr int kTileMaxRows = 16;  // rows of x one TDPBF16PS takes

// Tiles for `rows` rows of parts a product and two feature groups side by side (two independent chains of tile
// products): 0-1 the feature groups' sums (rows x 16 fp32), 2-3 their codes (16 pairs x 16 features), 4 the parts
// (rows x 16 pairs)
SPECPIPE_AMX_TARGET void tiles_configure(int rows) {
  AmxConfig config;
  for (int t = 0; t <= 4; ++t) {
    config.rows[t] = static_cast<uint8_t>(t == 2 || t == 3 ? 16 : rows);
    config.bytes_per_row[t] = 64;
  }
  asm volatile("" : : "r"(&config) : "memory");  // every shape stored before LDTILECFG reads them (see amx_configure)
  _tile_loadconfig(&config);
}

// A tile's 16 code lines as the B operand: 16 pairs of k x 16 features of bf16 codes, 64 bytes a pair
template <int Format>
void widen_codes(const uint8_t* lines, uint16_t* operand);

template <>
inline void widen_codes<kGgufQ4_1>(const uint8_t* lines, uint16_t* operand) {
  // word i < 16: bf16(i), the upper half of the fp32 value (exact), looked up by each word's low 5 bits
  alignas(64) static constexpr uint16_t kCodes[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                                      0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  const __m512i bf16_codes = _mm512_load_si512(kCodes);
  const __m512i low_nibbles = _mm512_set1_epi16(0x0F);
#pragma GCC unroll 8
  for (int p = 0; p < 16; p += 2) {
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines + 16 * p)));
    const __m512i low = _mm512_permutexvar_epi16(_mm512_and_si512(bytes, low_nibbles), bf16_codes);
    const __m512i high = _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), bf16_codes);
    _mm512_store_si512(operand + 32 * p, _mm512_shuffle_i64x2(low, high, 0x44));
    _mm512_store_si512(operand + 32 * (p + 1), _mm512_shuffle_i64x2(low, high, 0xEE));
  }
}

template <>
inline void widen_codes<kGgufQ8_0>(const uint8_t* lines, uint16_t* operand) {
#pragma GCC unroll 16
  for (int p = 0; p < 16; ++p) {
    // int8 -> fp32 -> bf16: exact (8 bits)
    const __m128i* line = reinterpret_cast<const __m128i*>(lines + 32 * p);
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(line)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(line + 1)));
    const __m512bh codes = _mm512_cvtne2ps_pbh(high, low);
    _mm512_store_si512(operand + 32 * p, reinterpret_cast<const __m512i&>(codes));
  }
}

// One row's sum over a block (its parts' sums of codes times x, [part_count, 16] at `parts`, the C tiles' rows),
// scaled into its running sum `sum`: the parts' sums added in order (hi + mid + lo), sum += that * d, then [Q4_1]
// sum += m * the row's sum of x over the block (`row_sum`)
template <int Format>
inline __m512 scaled_row(const float* parts, int part_count, __m512 d, __m512 m, float row_sum, __m512 sum) {
  __m512 codes_times_x = _mm512_load_ps(parts);
  for (int s = 1; s < part_count; ++s) codes_times_x = _mm512_add_ps(codes_times_x, _mm512_load_ps(parts + 16 * s));
  sum = _mm512_fmadd_ps(codes_times_x, d, sum);
  if constexpr (TileLayout<Format>::kMinimum) sum = _mm512_fmadd_ps(m, _mm512_set1_ps(row_sum), sum);
  return sum;
}

// A tile's 16 features' steps d and [Q4_1] minimums m, fp32
template <int Format>
inline void tile_scales(const uint8_t* tile, __m512& d, __m512& m) {
  d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile)));
  m = TileLayout<Format>::kMinimum ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32)))
                                   : _mm512_setzero_ps();
}

// Block b's tile products for the G feature groups whose first tile is at `tile` (the next group's `group_bytes`
// further on): their codes widened into `operand` [G, 16 x 32] and times every tile of rows' parts (`parts` [padded,
// in] bf16), the sums stored to `block` [G, padded, 16] fp32
template <int Format, int G>
SPECPIPE_AMX_TARGET inline void block_tile_sums(const uint8_t* tile, int64_t group_bytes, const uint16_t* parts,
                                                int64_t b, int64_t in, int64_t padded, int tile_rows,
                                                uint16_t (*operand)[16 * 32], float* block) {
  using Layout = TileLayout<Format>;
  for (int g = 0; g < G; ++g) {
    const char* ahead = reinterpret_cast<const char*>(tile + g * group_bytes) + kGgufLookahead;
    for (int line = 0; line < Layout::kBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
    widen_codes<Format>(tile + g * group_bytes + Layout::kCodes, operand[g]);
  }
  _tile_loadd(2, operand[0], 64);
  if constexpr (G > 1) _tile_loadd(3, operand[1], 64);
  const int64_t stride = in * static_cast<int64_t>(sizeof(uint16_t));
  for (int64_t first = 0; first < padded; first += tile_rows) {
    _tile_zero(0);
    if constexpr (G > 1) _tile_zero(1);
    _tile_loadd(4, parts + first * in + b * kTileValues, stride);
    _tile_dpbf16ps(0, 4, 2);
    if constexpr (G > 1) _tile_dpbf16ps(1, 4, 3);
    _tile_stored(0, block + 16 * first, 64);
    if constexpr (G > 1) _tile_stored(1, block + 16 * (padded + first), 64);
  }
}

// out[r, 16 g + n] (+ bias) for the feature groups g = group, group + 1 (G of them) from their sums [G, rows, 16]
template <int G, typename Out>
inline void write_feature_groups(const float* sums, const float* bias, Out* out, int64_t rows, int64_t out_stride,
                                 int64_t group) {
  for (int g = 0; g < G; ++g)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t n = 0; n < kTileFeatures; ++n) {
        const int64_t feature = (group + g) * kTileFeatures + n;
        float value = sums[16 * (g * rows + r) + n];
        if (bias != nullptr) value += bias[feature];
        out[r * out_stride + feature] = static_cast<Out>(value);
      }
}

// The sums [G, rows, 16] of the feature groups g = group, group + 1 (G of them) for the `rows` rows of x, from their
// parts (`parts` [padded, in] bf16: row r's part s at r * part_count + s, zero rows after them), `tile_rows` of them a
// tile product, and the rows' sums over each block (`block_sums` [rows, count]). Scratch, 64-byte aligned: `sums` [G,
// rows, 16] and `block` [G, padded, 16] fp32. Each row's running sums go to memory and back at every block; see
// two_groups_in_registers for few rows.
template <int Format, int G>
SPECPIPE_AMX_TARGET void tiles_feature_groups(const uint8_t* tiles, const uint16_t* parts, int part_count,
                                              const float* block_sums, float* sums, float* block, int64_t rows,
                                              int64_t padded, int tile_rows, int64_t in, int64_t group) {
  using Layout = TileLayout<Format>;
  const int64_t count = in / kTileValues, group_bytes = count * Layout::kBytes;
  alignas(64) uint16_t operand[G][16 * 32];
  for (int64_t i = 0; i < G * rows; ++i) _mm512_store_ps(sums + 16 * i, _mm512_setzero_ps());
  const uint8_t* first_tile = tiles + group * group_bytes;
  for (int64_t b = 0; b < count; ++b) {
    const uint8_t* tile = first_tile + b * Layout::kBytes;
    block_tile_sums<Format, G>(tile, group_bytes, parts, b, in, padded, tile_rows, operand, block);
    for (int g = 0; g < G; ++g) {
      __m512 d, m;
      tile_scales<Format>(tile + g * group_bytes, d, m);
      for (int64_t r = 0; r < rows; ++r) {
        float* sum = sums + 16 * (g * rows + r);
        _mm512_store_ps(sum, scaled_row<Format>(block + 16 * (g * padded + part_count * r), part_count, d, m,
                                                block_sums[r * count + b], _mm512_load_ps(sum)));
      }
    }
  }
}

// tiles_feature_groups for two feature groups and R rows, R known when compiled: each row's running sums stay in
// registers over the blocks instead of going to memory and back at each one (the same operations in the same order,
// so the same sums bit for bit). Why: with few rows, those loads and stores are much of a block's work beside its
// tile products.
template <int Format, int R>
SPECPIPE_AMX_TARGET void two_groups_in_registers(const uint8_t* tiles, const uint16_t* parts, int part_count,
                                                 const float* block_sums, float* sums, float* block, int64_t padded,
                                                 int tile_rows, int64_t in, int64_t group) {
  using Layout = TileLayout<Format>;
  const int64_t count = in / kTileValues, group_bytes = count * Layout::kBytes;
  alignas(64) uint16_t operand[2][16 * 32];
  __m512 running[2][R];
  for (int g = 0; g < 2; ++g)
    for (int r = 0; r < R; ++r) running[g][r] = _mm512_setzero_ps();
  const uint8_t* first_tile = tiles + group * group_bytes;
  for (int64_t b = 0; b < count; ++b) {
    const uint8_t* tile = first_tile + b * Layout::kBytes;
    block_tile_sums<Format, 2>(tile, group_bytes, parts, b, in, padded, tile_rows, operand, block);
    for (int g = 0; g < 2; ++g) {
      __m512 d, m;
      tile_scales<Format>(tile + g * group_bytes, d, m);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        running[g][r] = scaled_row<Format>(block + 16 * (g * padded + part_count * r), part_count, d, m,
                                           block_sums[r * count + b], running[g][r]);
    }
  }
  for (int g = 0; g < 2; ++g)
    for (int r = 0; r < R; ++r) _mm512_store_ps(sums + 16 * (g * R + r), running[g][r]);
}

// Rows up to kRegisterRows keep their running sums in registers (two_groups_in_registers)
constexpr int64_t kRegisterRows = 8;

// tiles_feature_groups<Format, 2>, by two_groups_in_registers<Format, rows> where rows <= kRegisterRows
template <int Format, int R = 1>
SPECPIPE_AMX_TARGET void two_feature_groups(int64_t rows, const uint8_t* tiles, const uint16_t* parts, int part_count,
                                            const float* block_sums, float* sums, float* block, int64_t padded,
                                            int tile_rows, int64_t in, int64_t group) {
  if (rows > kRegisterRows)
    return tiles_feature_groups<Format, 2>(tiles, parts, part_count, block_sums, sums, block, rows, padded, tile_rows,
                                           in, group);
  if constexpr (R < kRegisterRows) {
    if (rows != R)
      return two_feature_groups<Format, R + 1>(rows, tiles, parts, part_count, block_sums, sums, block, padded,
                                               tile_rows, in, group);
  }
  two_groups_in_registers<Format, R>(tiles, parts, part_count, block_sums, sums, block, padded, tile_rows, in, group);
}

// bf16 parts of x's rows [rows, in] (three for fp32 x, one for bf16 x) as tiles_feature_groups takes them, zero rows
// up to `padded`, and each row's sums over its blocks of 32 [rows, in / 32] (fp32, in one order)
void tile_parts(const torch::Tensor& x, int part_count, int64_t rows, int64_t padded, int64_t in,
                torch::Tensor& parts, torch::Tensor& block_sums) {
  const bool wide = x.scalar_type() == torch::kFloat32;
  const int64_t count = in / kTileValues;
  parts = torch::zeros({padded, in}, x.options().dtype(torch::kBFloat16));
  block_sums = torch::empty({rows, count}, x.options().dtype(torch::kFloat32));
  uint16_t* part = reinterpret_cast<uint16_t*>(parts.data_ptr<at::BFloat16>());
  float* sums = block_sums.data_ptr<float>();
  const float* wide_rows = wide ? x.data_ptr<float>() : nullptr;
  const uint16_t* narrow_rows = wide ? nullptr : reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < count; ++b) {
      const int64_t at = r * in + b * kTileValues;
      __m512 value[2];
      for (int v = 0; v < 2; ++v)
        value[v] = wide ? lanes_load(wide_rows + at + 16 * v) : load_weights(narrow_rows + at + 16 * v);
      sums[r * count + b] = _mm512_reduce_add_ps(_mm512_add_ps(value[0], value[1]));
      for (int s = 0; s < part_count; ++s) {
        // RNE to bf16; the remainder x - part is exact in fp32, so the parts add up to x
        uint16_t* target = part + (r * part_count + s) * in + b * kTileValues;
        const __m512bh rounded = _mm512_cvtne2ps_pbh(value[1], value[0]);
        _mm512_storeu_si512(target, reinterpret_cast<const __m512i&>(rounded));
        for (int v = 0; v < 2; ++v) value[v] = _mm512_sub_ps(value[v], load_weights(target + 16 * v));
      }
    }
}

template <int Format, typename Out>
void tile_product(const torch::Tensor& x, const uint8_t* tiles, const float* bias, Out* out, int64_t rows,
                  int64_t in, int64_t out_features) {
  const int part_count = x.scalar_type() == torch::kFloat32 ? 3 : 1;
  const int tile_rows = static_cast<int>(std::min<int64_t>(rows * part_count, kTileMaxRows));
  const int64_t padded = (rows * part_count + tile_rows - 1) / tile_rows * tile_rows;
  torch::Tensor parts, block_sums;
  tile_parts(x, part_count, rows, padded, in, parts, block_sums);
  const uint16_t* part = reinterpret_cast<const uint16_t*>(parts.data_ptr<at::BFloat16>());
  const float* x_block_sums = block_sums.data_ptr<float>();
  const int64_t groups = out_features / kTileFeatures;
  const int64_t grain = std::max<int64_t>(2, groups / (4 * at::get_num_threads()));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    tiles_configure(tile_rows);
    std::vector<float> scratch(2 * 16 * (rows + padded) + 16);
    float* sums = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
    float* block = sums + 2 * 16 * rows;
    int64_t group = begin;
    for (; group + 2 <= end; group += 2) {
      two_feature_groups<Format>(rows, tiles, part, part_count, x_block_sums, sums, block, padded, tile_rows, in,
                                 group);
      write_feature_groups<2>(sums, bias, out, rows, out_features, group);
    }
    if (group < end) {
      tiles_feature_groups<Format, 1>(tiles, part, part_count, x_block_sums, sums, block, rows, padded, tile_rows,
                                      in, group);
      write_feature_groups<1>(sums, bias, out, rows, out_features, group);
    }
    amx_release();
  });
}
#endif

// Calls f(std::integral_constant<int, Format>) for Q4_1 or Q8_0 (the file's format of blocks on tiles)
template <typename F>
void with_tile_format(int64_t format, F&& f) {
  TORCH_CHECK(format == kGgufQ4_1 || format == kGgufQ8_0, "tiles: the blocks of Q4_1 (3) or Q8_0 (8)");
  if (format == kGgufQ4_1) f(std::integral_constant<int, kGgufQ4_1>{});
  else f(std::integral_constant<int, kGgufQ8_0>{});
}

// The out features of blocks (or their tiles) of Q4_1 or Q8_0, checked as gguf_product takes them, a multiple of 16
int64_t checked_tiles(const torch::Tensor& blocks, int64_t format, int64_t in_features) {
  const int64_t out_features = checked_gguf(blocks, format, in_features);
  TORCH_CHECK(out_features % kTileFeatures == 0, "tiles: out_features a multiple of 16");
  return out_features;
}

torch::Tensor reordered_tiles(const torch::Tensor& from, int64_t format, int64_t in_features, bool pack) {
  const int64_t out_features = checked_tiles(from, format, in_features);
  auto to = torch::empty_like(from);
  with_tile_format(format, [&](auto kind) {
    reorder_tiles<kind.value>(from.data_ptr<uint8_t>(), to.data_ptr<uint8_t>(), out_features, in_features, pack);
  });
  return to;
}

void gguf_tiles_into(const torch::Tensor& x, const torch::Tensor& tiles, int64_t tile_format, const float* bias,
                     torch::Tensor& out, int64_t in_features) {
  const int64_t format = tile_format - kGgufTiles;
  const int64_t out_features = checked_tiles(tiles, format, in_features);
#ifdef SPECPIPE_AMX
  const int64_t rows = x.numel() / in_features;
  if (rows == 0) return;
  const uint8_t* data = tiles.data_ptr<uint8_t>();
  with_tile_format(format, [&](auto kind) {
    if (out.scalar_type() == torch::kBFloat16)
      tile_product<kind.value>(x, data, bias, out.data_ptr<at::BFloat16>(), rows, in_features, out_features);
    else
      tile_product<kind.value>(x, data, bias, out.data_ptr<float>(), rows, in_features, out_features);
  });
#else
  TORCH_CHECK(false, "tiles: this build of the kernel has no AMX tiles");
#endif
}

}  // namespace

// blocks [out, in / 32 * block bytes] uint8 of Q4_1 (3) or Q8_0 (8) (out a multiple of 16, in of 32) -> the same
// weight in tile order, what gguf_product multiplies as the format kGgufTiles + format on CPUs with AMX (after
// amx_request).
torch::Tensor gguf_tile_pack(torch::Tensor blocks, int64_t format, int64_t in_features) {
  return reordered_tiles(blocks, format, in_features, true);
}

// gguf_tile_pack's tiles -> the blocks they were packed from
torch::Tensor gguf_tile_unpack(torch::Tensor tiles, int64_t format, int64_t in_features) {
  return reordered_tiles(tiles, format, in_features, false);
}
