// specpipe's CPU kernel, the product over weights in GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K):
// gguf_product multiplies rows of x by a weight as the GGUF file ships it, each block widened to fp32 in registers
// with gguf-py's own arithmetic, and gguf_widen returns those fp32 weights (bitwise what gguf-py's dequantization,
// and so transformers' loader, gives).
//
// Why: a GGUF model then runs from its quantized bytes, a fraction of a dense copy's, with the very weights the dense
// model would hold (specpipe.engine.gguf_weights).
// A part of kernel.cpp's one translation unit (see there).

#pragma once

#include "product.h"

// ---- weights in GGUF blocks, as the file ships them ----
// Formats (ggml's type ids): Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8): blocks of 32 weights of a row with an
// fp16 step d (Q4_1, Q5_1: and an fp16 minimum m); Q4_K (12), Q5_K (13), Q6_K (14): super-blocks of 256 weights whose
// 32- or 16-weight sub-blocks have 6- or 8-bit scales under the super-block's fp16 steps. A weight is widened in
// registers with the arithmetic gguf-py's dequantize uses (and so transformers' loader), each product and sum rounded
// to fp32 as numpy rounds it (-ffp-contract=off keeps them apart): the fp32 weights are bitwise those the dense model
// holds.
//
// A row's dot product runs over chunks of 32 weights in the order of k, a chunk's vector v into accumulator v % 2, and
// the two are added at the end: the same sums, in the same order, whatever rows come with it (a row's output does not
// depend on the rows beside it, nor on how many there are).

namespace {

constexpr int kChunk = 32;  // weights a widening step yields
constexpr int kChunkVectors = kChunk / kLanes;  // 2 (AVX-512) or 4 (AVX2)
constexpr int kAccumulators = 2;  // per row: AVX2's 16 registers then hold 4 rows' sums and a chunk
constexpr int kGgufQ4_0 = 2, kGgufQ4_1 = 3, kGgufQ5_0 = 6, kGgufQ5_1 = 7, kGgufQ8_0 = 8, kGgufQ4_K = 12,
              kGgufQ5_K = 13, kGgufQ6_K = 14;

constexpr int64_t gguf_block_bytes(int format) {
  switch (format) {
    case kGgufQ4_0: return 18;
    case kGgufQ4_1: return 20;
    case kGgufQ5_0: return 22;
    case kGgufQ5_1: return 24;
    case kGgufQ8_0: return 34;
    case kGgufQ4_K: return 144;
    case kGgufQ5_K: return 176;
    case kGgufQ6_K: return 210;
    default: return 0;
  }
}
constexpr int64_t gguf_block_values(int format) { return format >= kGgufQ4_K ? 256 : 32; }

inline float half_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _cvtsh_ss(bits);  // exact: every fp16 is an fp32
}

// kLanes bytes, and their kLanes integer values widened to 32 bits, as fp32 (exact).
#ifdef __AVX512F__
using IntLanes = __m512i;
inline __m128i lane_bytes(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline Lanes unsigned_lanes(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)); }
inline Lanes signed_lanes(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)); }
// bit `first + i` of `bits` as lane i's value 16 (or 0)
inline IntLanes bit_lanes(uint32_t bits, int first) {
  const __m512i shifts = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(first));
  return _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(bits)), shifts),
                                            _mm512_set1_epi32(1)), 4);
}
inline Lanes nibble_bit_lanes(__m128i nibbles, IntLanes high) {
  return _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_cvtepu8_epi32(nibbles), high));
}
#else
using IntLanes = __m256i;
inline __m128i lane_bytes(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline Lanes unsigned_lanes(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }
inline Lanes signed_lanes(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }
inline IntLanes bit_lanes(uint32_t bits, int first) {
  const __m256i shifts = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(first));
  return _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(bits)), shifts),
                                            _mm256_set1_epi32(1)), 4);
}
// 16 bytes in both 128-bit halves, for byte_lanes
inline __m256i both_halves(const uint8_t* p) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// bytes [8 * half, 8 * half + 8) of `bytes` (both_halves), byte j alone in lane j: an in-lane byte shuffle, where
// widening the bytes across the halves (vpmovzxbd) costs AMD's Zen cores more
inline __m256i byte_lanes(__m256i bytes, int half) {
  const __m256i first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                         4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  return _mm256_shuffle_epi8(bytes, half == 0 ? first : _mm256_add_epi32(first, _mm256_set1_epi32(8)));
}
#endif
// the low (or high) 4 bits of each byte
inline __m128i nibble_bytes(__m128i bytes, bool high) {
  if (high) bytes = _mm_srli_epi16(bytes, 4);
  return _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
}
// bits [shift, shift + width) of each byte
inline __m128i bit_field_bytes(__m128i bytes, int shift, int mask) {
  return _mm_and_si128(_mm_srl_epi16(bytes, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(static_cast<char>(mask)));
}

// One block's weights, a chunk of 32 at a time: widener_at<Format>(block, ...).chunk(c, out) for c < kChunks writes
// weights [32c, 32c + 32) as kChunkVectors fp32 vectors. The constructor reads what the chunks share (steps, scales).
template <int Format>
struct Widener;

// Blocks whose widener takes the fp16 step (and minimum) widened ahead (block_scales), gguf_rows for a whole weight
// row ahead of its products: the wideners then load them with the vector broadcasts, without the conversions' and
// broadcasts' shuffles, which share one port with the widening's own.
template <int Format>
constexpr bool kScalesAhead = Format == kGgufQ4_0 || Format == kGgufQ4_1 || Format == kGgufQ5_0 || Format == kGgufQ5_1;

// the two fp16 values at the start of a block (Q4_1, Q5_1: the step and the minimum; Q4_0, Q5_0: the step and what
// follows it, unused) widened to fp32 into scales[0], scales[1]: one conversion from memory for both
inline void block_scales(const uint8_t* block, float* scales) {
  _mm_storel_pi(reinterpret_cast<__m64*>(scales), _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block))));
}

#ifdef __AVX512F__
// Q4_0 and Q4_1 on AVX-512: the 16 weights a block's codes can stand for, computed once per block as each weight is
// (d * (q - 8), or d * q + m, rounded alike), and each code looked up in them (vpermps reads an index's low 4 bits):
// fewer instructions a weight than widening each code, and the same fp32 weights.
template <int Format>
struct NibbleTableWidener {
  static constexpr int kChunks = 1;
  const uint8_t* codes;
  Lanes table;
  // The block's step and minimum come widened (block_scales) in memory, from where the vector broadcasts load them:
  // no conversions' and broadcasts' shuffles, which share one port with the lookups.
  NibbleTableWidener(const uint8_t* b, const float* scales) : codes(b + (Format == kGgufQ4_1 ? 4 : 2)) {
    const Lanes q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const Lanes d = lanes_set(scales[0]);
    table = Format == kGgufQ4_1 ? lanes_add(lanes_mul(d, q), lanes_set(scales[1]))
                                : lanes_mul(d, lanes_sub(q, lanes_set(8.0f)));
  }
  void chunk(int, Lanes* out) const {
    const __m512i bytes = _mm512_cvtepu8_epi32(lane_bytes(codes));  // weight j's code in byte j's low nibble
    out[0] = _mm512_permutexvar_ps(bytes, table);
    out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);  // weight 16 + j: byte j's high nibble
  }
};
template <>
struct Widener<kGgufQ4_0> : NibbleTableWidener<kGgufQ4_0> {
  using NibbleTableWidener::NibbleTableWidener;
};
template <>
struct Widener<kGgufQ4_1> : NibbleTableWidener<kGgufQ4_1> {
  using NibbleTableWidener::NibbleTableWidener;
};
#endif

// Q4_0, Q4_1, Q5_0, Q5_1: an fp16 step d, [Q4_1, Q5_1: an fp16 minimum m], [Q5_0, Q5_1: a 32-bit word of fifth bits,
// bit i for weight i], then 16 bytes of low nibbles (weight j < 16 the low nibble of byte j, weight 16 + j its high
// one). A weight is d * (q - 8) (Q4_0), d * (q - 16) (Q5_0), or d * q + m (Q4_1, Q5_1).
template <int Format>
struct NibbleWidener {
  static constexpr int kChunks = 1;
  static constexpr bool kMinimum = Format == kGgufQ4_1 || Format == kGgufQ5_1;
  static constexpr bool kFifthBit = Format == kGgufQ5_0 || Format == kGgufQ5_1;
  static constexpr int kCodes = 2 + (kMinimum ? 2 : 0) + (kFifthBit ? 4 : 0);  // where the nibbles start
  const uint8_t* block;
  Lanes d, m;
  uint32_t high = 0;
  // scales: the block's step and minimum as block_scales widens them
  NibbleWidener(const uint8_t* b, const float* scales)
      : block(b), d(lanes_set(scales[0])), m(lanes_set(kMinimum ? scales[1] : 0.0f)) {
    if constexpr (kFifthBit) std::memcpy(&high, b + kCodes - 4, 4);
  }
  void chunk(int, Lanes* out) const {
    constexpr int kHalf = kChunkVectors / 2;  // vectors of low nibbles, then as many of high ones
#ifndef __AVX512F__
    const __m256i codes = both_halves(block + kCodes);
#endif
    for (int v = 0; v < kChunkVectors; ++v) {
#ifdef __AVX512F__
      const __m128i nibbles = nibble_bytes(lane_bytes(block + kCodes + kLanes * (v % kHalf)), v >= kHalf);
      Lanes q;
      if constexpr (kFifthBit) q = nibble_bit_lanes(nibbles, bit_lanes(high, kLanes * v));
      else q = unsigned_lanes(nibbles);
#else
      const __m256i bytes = byte_lanes(codes, v % kHalf);
      // a lane holds its byte alone, so the high nibble needs no mask after the shift
      __m256i codes_32 = v >= kHalf ? _mm256_srli_epi32(bytes, 4) : _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F));
      if constexpr (kFifthBit) codes_32 = _mm256_or_si256(codes_32, bit_lanes(high, kLanes * v));
      const Lanes q = _mm256_cvtepi32_ps(codes_32);
#endif
      // d * q is exact (an fp16 step's 11 bits times a code's 4 or 5), so one fused multiply-add rounds as the
      // product and the sum rounded apart do
      if constexpr (kMinimum) out[v] = lanes_fma(d, q, m);
      else out[v] = lanes_mul(d, lanes_sub(q, lanes_set(kFifthBit ? 16.0f : 8.0f)));  // q - 8, q - 16: exact
    }
  }
};
#ifndef __AVX512F__
template <>
struct Widener<kGgufQ4_0> : NibbleWidener<kGgufQ4_0> {
  using NibbleWidener::NibbleWidener;
};
template <>
struct Widener<kGgufQ4_1> : NibbleWidener<kGgufQ4_1> {
  using NibbleWidener::NibbleWidener;
};
#endif
template <>
struct Widener<kGgufQ5_0> : NibbleWidener<kGgufQ5_0> {
  using NibbleWidener::NibbleWidener;
};
template <>
struct Widener<kGgufQ5_1> : NibbleWidener<kGgufQ5_1> {
  using NibbleWidener::NibbleWidener;
};

template <>
struct Widener<kGgufQ8_0> {
  static constexpr int kChunks = 1;
  const uint8_t* block;
  Lanes d;
  explicit Widener(const uint8_t* b) : block(b), d(lanes_set(half_float(b))) {}
  void chunk(int, Lanes* out) const {
    for (int v = 0; v < kChunkVectors; ++v) out[v] = lanes_mul(signed_lanes(lane_bytes(block + 2 + kLanes * v)), d);
  }
};

// Q4_K and Q5_K: d and dmin (fp16), 12 bytes of eight 6-bit scales and minimums, [Q5_K: 32 bytes of fifth bits, bit c
// of byte l for weight l of chunk c], 128 bytes of nibbles (chunk 2p in the low, 2p + 1 in the high nibbles of bytes
// [32p, 32p + 32)). A weight is (d * scale) * q - dmin * minimum, each product rounded to fp32.
template <int Format>
struct SuperWidener {
  static constexpr int kChunks = 8;
  static constexpr int kNibbles = Format == kGgufQ5_K ? 48 : 16;  // offset of the nibbles
  const uint8_t* block;
  float step[8], low[8];
  explicit SuperWidener(const uint8_t* b) : block(b) {
    const float d = half_float(b), dmin = half_float(b + 2);
    const uint8_t* s = b + 4;
    for (int c = 0; c < 8; ++c) {
      const int scale = c < 4 ? s[c] & 63 : (s[c + 4] & 0x0F) | ((s[c - 4] >> 6) << 4);
      const int minimum = c < 4 ? s[c + 4] & 63 : (s[c + 4] >> 4) | ((s[c] >> 6) << 4);
      step[c] = d * static_cast<float>(scale);
      low[c] = dmin * static_cast<float>(minimum);
    }
  }
  void chunk(int c, Lanes* out) const {
    const Lanes d = lanes_set(step[c]), m = lanes_set(low[c]);
    for (int v = 0; v < kChunkVectors; ++v) {
      __m128i q = nibble_bytes(lane_bytes(block + kNibbles + 32 * (c / 2) + kLanes * v), c % 2 == 1);
      if constexpr (Format == kGgufQ5_K)
        q = _mm_or_si128(q, _mm_slli_epi16(bit_field_bytes(lane_bytes(block + 16 + kLanes * v), c, 1), 4));
      out[v] = lanes_sub(lanes_mul(d, unsigned_lanes(q)), m);
    }
  }
};
template <>
struct Widener<kGgufQ4_K> : SuperWidener<kGgufQ4_K> {
  using SuperWidener::SuperWidener;
};
template <>
struct Widener<kGgufQ5_K> : SuperWidener<kGgufQ5_K> {
  using SuperWidener::SuperWidener;
};

// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, sixteen int8 scales (one per 16 weights), d (fp16).
// Chunk c = 4h + t: its weight l has the low (t < 2) or high nibble of byte 64h + 32(t % 2) + l and bits [2t, 2t + 2)
// of byte 128 + 32h + l; the weight is (d * scale) * (q - 32).
template <>
struct Widener<kGgufQ6_K> {
  static constexpr int kChunks = 8;
  const uint8_t* block;
  float step[16];
  explicit Widener(const uint8_t* b) : block(b) {
    const float d = half_float(b + 208);
    for (int s = 0; s < 16; ++s) step[s] = d * static_cast<float>(static_cast<int8_t>(b[192 + s]));
  }
  void chunk(int c, Lanes* out) const {
    const int h = c / 4, t = c % 4;
    for (int v = 0; v < kChunkVectors; ++v) {
      const int l = kLanes * v;
      const __m128i q = _mm_or_si128(nibble_bytes(lane_bytes(block + 64 * h + 32 * (t % 2) + l), t >= 2),
                                     _mm_slli_epi16(bit_field_bytes(lane_bytes(block + 128 + 32 * h + l), 2 * t, 3), 4));
      out[v] = lanes_mul(lanes_set(step[2 * c + l / 16]), lanes_sub(unsigned_lanes(q), lanes_set(32.0f)));
    }
  }
};

constexpr int64_t kGgufLookahead = 16384;

// The widener of the block at `block`, from its scales[2 * index], [2 * index + 1] where gguf_rows widened them ahead
// (kScalesAhead)
template <int Format>
inline Widener<Format> widener_at(const uint8_t* block, const float* scales, int64_t index) {
  if constexpr (kScalesAhead<Format>) return Widener<Format>(block, scales + 2 * index);
  else return Widener<Format>(block);
}

// How many weight rows gguf_rows multiplies side by side for R rows of x: with few rows of x, one weight row's sums
// are two chains of dependent FMAs, so several weight rows run together to keep the FMA units busy. Each weight row's
// sums keep their order: the outputs are the same for any number side by side. Half as many with AVX2's 16
// registers, where twice as many spill the accumulators of a row pair to the stack.
template <int R>
constexpr int gguf_side_by_side() {
  return std::max(1, (kRegisters == 32 ? 8 : 4) / (R * kAccumulators));
}

// R rows of x [R, in] fp32 times weight rows [begin, end) of blocks [out, in / values * bytes], into out (stride
// out_stride), O weight rows at a time.
template <int Format, int R, int O = gguf_side_by_side<R>(), typename Out>
void gguf_rows(const float* x, const uint8_t* blocks, const float* bias, Out* out, int64_t in, int64_t out_stride,
               int64_t begin, int64_t end) {
  constexpr int64_t kBytes = gguf_block_bytes(Format), kValues = gguf_block_values(Format);
  const int64_t count = in / kValues, row_bytes = count * kBytes;
  int64_t o = begin;
  float* scales = kScalesAhead<Format> ? static_cast<float*>(__builtin_alloca(O * count * 2 * sizeof(float))) : nullptr;
  for (; o + O <= end; o += O) {
    const uint8_t* rows = blocks + o * row_bytes;
    if constexpr (kScalesAhead<Format>)
      for (int64_t block = 0; block < O * count; ++block) block_scales(rows + block * kBytes, scales + 2 * block);
    // Blocks are prefetched into L2, kGgufLookahead bytes ahead: a few-row product over blocks reads far more bytes a
    // cycle than the bf16 one, and prefetches into L1 (NTA) cap a core at its line-fill buffers' ~10 GB/s.
    const char* ahead = reinterpret_cast<const char*>(rows) + std::max<int64_t>(2 * O * row_bytes, kGgufLookahead);
    Lanes acc[O][kAccumulators][R];
#pragma GCC unroll 16
    for (int p = 0; p < O; ++p)
#pragma GCC unroll 16
      for (int a = 0; a < kAccumulators; ++a)
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[p][a][r] = lanes_zero();
    for (int64_t b = 0; b < count; ++b) {
#pragma GCC unroll 8
      for (int p = 0; p < O; ++p) {
        const int64_t at = p * row_bytes + b * kBytes;
        if constexpr (kBytes >= 64) {
          for (int64_t line = 0; line < kBytes; line += 64) _mm_prefetch(ahead + at + line, _MM_HINT_T1);
        } else {
          if (at % 64 < kBytes) _mm_prefetch(ahead + at, _MM_HINT_T1);  // about once a cache line
        }
        const Widener<Format> widener = widener_at<Format>(rows + at, scales, p * count + b);
#pragma GCC unroll 8
        for (int c = 0; c < Widener<Format>::kChunks; ++c) {
          Lanes weights[kChunkVectors];
          widener.chunk(c, weights);
          const float* xk = x + b * kValues + kChunk * c;
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
            for (int v = 0; v < kChunkVectors; ++v)
              acc[p][v % kAccumulators][r] =
                  lanes_fma(weights[v], lanes_load(xk + r * in + kLanes * v), acc[p][v % kAccumulators][r]);
        }
      }
    }
#pragma GCC unroll 8
    for (int p = 0; p < O; ++p)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        float sum = lanes_sum(lanes_add(acc[p][0][r], acc[p][1][r]));
        if (bias != nullptr) sum += bias[o + p];
        out[r * out_stride + o + p] = static_cast<Out>(sum);
      }
  }
  if constexpr (O > 1) {
    if (o < end) gguf_rows<Format, R, 1>(x, blocks, bias, out, in, out_stride, o, end);
  }
}

// The most rows one pass over a tile of blocks takes: their accumulators and a chunk's vectors in the registers.
constexpr int64_t kGgufMaxRows = kRegisters == 32 ? 8 : 4;

template <int Format, int R = 1, typename Out>
void gguf_group(int64_t rows, const float* x, const uint8_t* blocks, const float* bias, Out* out, int64_t in,
                int64_t out_stride, int64_t begin, int64_t end) {
  if constexpr (R < kGgufMaxRows) {
    if (rows != R) return gguf_group<Format, R + 1>(rows, x, blocks, bias, out, in, out_stride, begin, end);
  }
  gguf_rows<Format, R>(x, blocks, bias, out, in, out_stride, begin, end);
}

// Every row group over each tile of ~32 KB of blocks while it is in L1/L2, the tiles spread over the threads.
template <int Format, typename Out>
void gguf_product_all(const float* xs, const uint8_t* blocks, const float* bias, Out* os, int64_t rows, int64_t in,
                      int64_t out_features) {
  const int64_t row_bytes = in / gguf_block_values(Format) * gguf_block_bytes(Format);
  const int64_t tile = std::max<int64_t>(4, kTileBytes / row_bytes);
  const int64_t grain = std::max<int64_t>(16, out_features / (4 * at::get_num_threads()));
  at::parallel_for(0, out_features, grain, [&](int64_t begin, int64_t end) {
    for (int64_t tile_begin = begin; tile_begin < end; tile_begin += tile) {
      const int64_t tile_end = std::min(end, tile_begin + tile);
      for (int64_t first = 0, count = 0; first < rows; first += count) {
        const int64_t left = rows - first, groups = (left + kGgufMaxRows - 1) / kGgufMaxRows;
        count = (left + groups - 1) / groups;
        gguf_group<Format>(count, xs + first * in, blocks, bias, os + first * out_features, in, out_features,
                           tile_begin, tile_end);
      }
    }
  });
}

template <int Format>
void gguf_widen_rows(const uint8_t* blocks, float* out, int64_t in, int64_t begin, int64_t end) {
  constexpr int64_t kBytes = gguf_block_bytes(Format), kValues = gguf_block_values(Format);
  const int64_t count = in / kValues;
  for (int64_t o = begin; o < end; ++o)
    for (int64_t b = 0; b < count; ++b) {
      const uint8_t* block = blocks + (o * count + b) * kBytes;
      float scales[2];
      if constexpr (kScalesAhead<Format>) block_scales(block, scales);
      const Widener<Format> widener = widener_at<Format>(block, scales, 0);
      for (int c = 0; c < Widener<Format>::kChunks; ++c) {
        Lanes weights[kChunkVectors];
        widener.chunk(c, weights);
        for (int v = 0; v < kChunkVectors; ++v)
          lanes_store(out + o * in + b * kValues + kChunk * c + kLanes * v, weights[v]);
      }
    }
}

// F(std::integral_constant<int, Format>) for the runtime `format`
template <typename F>
void with_gguf_format(int format, F&& f) {
  switch (format) {
    case kGgufQ4_0: return f(std::integral_constant<int, kGgufQ4_0>{});
    case kGgufQ4_1: return f(std::integral_constant<int, kGgufQ4_1>{});
    case kGgufQ5_0: return f(std::integral_constant<int, kGgufQ5_0>{});
    case kGgufQ5_1: return f(std::integral_constant<int, kGgufQ5_1>{});
    case kGgufQ8_0: return f(std::integral_constant<int, kGgufQ8_0>{});
    case kGgufQ4_K: return f(std::integral_constant<int, kGgufQ4_K>{});
    case kGgufQ5_K: return f(std::integral_constant<int, kGgufQ5_K>{});
    default: return f(std::integral_constant<int, kGgufQ6_K>{});
  }
}

int64_t checked_gguf(const torch::Tensor& blocks, int64_t format, int64_t in_features) {
  const int kind = static_cast<int>(format);
  TORCH_CHECK(gguf_block_bytes(kind) > 0,
              "format: the GGUF type id of Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13) or "
              "Q6_K (14)");
  TORCH_CHECK(in_features > 0 && in_features % gguf_block_values(kind) == 0, "in_features: a multiple of ",
              gguf_block_values(kind), " (the format's block)");
  TORCH_CHECK(blocks.scalar_type() == torch::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) == in_features / gguf_block_values(kind) * gguf_block_bytes(kind),
              "blocks: contiguous uint8 [out, in / block values * block bytes]");
  return blocks.size(0);
}

// gguf_product's format for blocks of Q4_1 or Q8_0 reordered for AMX tiles (gguf_tiles.h): kGgufTiles + the blocks'
// ggml type id (not ggml type ids themselves)
constexpr int kGgufTiles = 0x100;
// gguf_product over tiles: x [..., in] fp32 or bf16 (contiguous) into out [..., out] of x's dtype (gguf_tiles.h)
void gguf_tiles_into(const torch::Tensor& x, const torch::Tensor& tiles, int64_t tile_format, const float* bias,
                     torch::Tensor& out, int64_t in_features);

}  // namespace

torch::Tensor gguf_tile_unpack(torch::Tensor tiles, int64_t format, int64_t in_features);

// x [..., in] fp32 or bf16, blocks [out, in / block values * block bytes] uint8 in the GGUF format `format` (ggml's
// type id, see above), bias [out] fp32 or None -> [..., out] in x's dtype: each weight widened to fp32 in registers
// (as gguf-py dequantizes it), each row summed in fp32 in the same order whatever rows come with it.
torch::Tensor gguf_product(torch::Tensor x, torch::Tensor blocks, int64_t format, int64_t in_features,
                           c10::optional<torch::Tensor> bias) {
  if (format > kGgufTiles) {
    auto out = checked_output(x, in_features, blocks.size(0));
    gguf_tiles_into(x, blocks, format, checked_fp32(bias, blocks.size(0), "bias"), out, in_features);
    return out;
  }
  const int64_t out_features = checked_gguf(blocks, format, in_features);
  auto out = checked_output(x, in_features, out_features);
  const int64_t rows = x.numel() / in_features;
  const float* bias_data = checked_fp32(bias, out_features, "bias");
  torch::Tensor widened;
  const float* xs = widened_rows(x, widened);
  const uint8_t* data = blocks.data_ptr<uint8_t>();
  with_gguf_format(static_cast<int>(format), [&](auto kind) {
    if (out.scalar_type() == torch::kBFloat16)
      gguf_product_all<kind.value>(xs, data, bias_data, out.data_ptr<at::BFloat16>(), rows, in_features, out_features);
    else
      gguf_product_all<kind.value>(xs, data, bias_data, out.data_ptr<float>(), rows, in_features, out_features);
  });
  return out;
}

// blocks as gguf_product takes them -> the fp32 weights [out, in] they hold (what the product multiplies).
torch::Tensor gguf_widen(torch::Tensor blocks, int64_t format, int64_t in_features) {
  if (format > kGgufTiles)
    return gguf_widen(gguf_tile_unpack(blocks, format - kGgufTiles, in_features), format - kGgufTiles, in_features);
  const int64_t out_features = checked_gguf(blocks, format, in_features);
  auto out = torch::empty({out_features, in_features}, blocks.options().dtype(torch::kFloat32));
  const uint8_t* data = blocks.data_ptr<uint8_t>();
  float* weights = out.data_ptr<float>();
  with_gguf_format(static_cast<int>(format), [&](auto kind) {
    at::parallel_for(0, out_features, 64, [&](int64_t begin, int64_t end) {
      gguf_widen_rows<kind.value>(data, weights, in_features, begin, end);
    });
  });
  return out;
}
