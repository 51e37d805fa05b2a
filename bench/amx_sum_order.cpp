// Whether an AMX CPU's TDPBF16PS sums bf16 pairs as VDPBF16PS does, or in the SDM's other order (docs/BENCHMARKS.md
// run 64). Random bf16 rows of 16 pairs (values 2^-3..2^3 times a normal draw) against 16 features, one tile product,
// one chain of vdpbf16ps in the blocks' layout (the weight as loaded, and with each pair's halves swapped, x alike), and
// two emulations: each pair's high product added first, then the low one (the SDM's VDPBF16PS), and the reverse (its
// TDPBF16PS); every add rounded to fp32 (RNE). Counts how many fp32 sums agree.
//
//   g++ -O2 -fno-tree-vectorize -std=c++17 -march=sapphirerapids -ffp-contract=off bench/amx_sum_order.cpp \
//       -o /tmp/amx_sum_order && /tmp/amx_sum_order
//
// -fno-tree-vectorize: with GCC 12's loop vectorizer the scalar emulation of the high product first came out wrong
// (2 of 320,000 sums agreed at -O2, all at -O0 and with the flag); the adds must run one by one, as written.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

namespace {
struct TileConfig {  // LDTILECFG's 64 bytes, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

float widen(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

uint16_t truncated(float value) {  // an exact bf16 (its low 16 bits dropped)
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return static_cast<uint16_t>(bits >> 16);
}
}  // namespace

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16,avx512bw"))) int main() {
  constexpr int kRequestPermission = 0x1023, kTileData = 18;
  if (syscall(SYS_arch_prctl, kRequestPermission, kTileData) != 0) {
    std::puts("Linux did not grant the AMX tile state");
    return 1;
  }
  TileConfig config;
  config.rows[0] = config.rows[1] = 1, config.bytes_per_row[0] = config.bytes_per_row[1] = 64;  // C, A: one row
  config.rows[2] = 16, config.bytes_per_row[2] = 64;                                              // B: 16 pairs
  asm volatile("" : : "r"(&config) : "memory");  // GCC 12 dropped the stores before LDTILECFG without it
  _tile_loadconfig(&config);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-3, 3);
  long agree[5] = {}, sums = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    alignas(64) uint16_t x[32];
    uint16_t w[16][32];
    alignas(64) uint32_t lines[16][16];  // pair p, feature j: (w[j][2p] low half, w[j][2p + 1] high half)
    for (auto& value : x) value = truncated(std::ldexp(normal(rng), exponent(rng)));
    for (auto& row : w)
      for (auto& value : row) value = truncated(std::ldexp(normal(rng), exponent(rng)));
    for (int p = 0; p < 16; ++p)
      for (int j = 0; j < 16; ++j) lines[p][j] = w[j][2 * p] | (static_cast<uint32_t>(w[j][2 * p + 1]) << 16);
    alignas(64) float tile[16], vector[16], swapped[16];
    _tile_zero(0);
    _tile_loadd(1, x, 64);
    _tile_loadd(2, lines, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, tile, 64);
    __m512 plain_sums = _mm512_setzero_ps(), swapped_sums = _mm512_setzero_ps();
    uint32_t x_pairs[16];  // x's pairs as one broadcast reads them (copied: no uint16_t array read as uint32_t)
    std::memcpy(x_pairs, x, sizeof(x_pairs));
    for (int p = 0; p < 16; ++p) {
      const __m512i line = _mm512_load_si512(lines[p]);
      plain_sums = _mm512_dpbf16_ps(plain_sums, (__m512bh)line, (__m512bh)_mm512_set1_epi32(x_pairs[p]));
      const uint32_t x_swapped = (x_pairs[p] << 16) | (x_pairs[p] >> 16);
      swapped_sums = _mm512_dpbf16_ps(swapped_sums, (__m512bh)_mm512_rol_epi32(line, 16),
                                      (__m512bh)_mm512_set1_epi32(x_swapped));
    }
    _mm512_store_ps(vector, plain_sums);
    _mm512_store_ps(swapped, swapped_sums);
    for (int j = 0; j < 16; ++j, ++sums) {
      float high_first = 0.0f, low_first = 0.0f;
      for (int p = 0; p < 16; ++p) {
        const float low = widen(x[2 * p]) * widen(w[j][2 * p]), high = widen(x[2 * p + 1]) * widen(w[j][2 * p + 1]);
        high_first = (high_first + high) + low;
        low_first = (low_first + low) + high;
      }
      agree[0] += tile[j] == vector[j];
      agree[1] += tile[j] == swapped[j];
      agree[2] += tile[j] == low_first;
      agree[3] += vector[j] == high_first;
      agree[4] += swapped[j] == low_first;
    }
  }
  _tile_release();
  const char* what[5] = {"tiles == vdpbf16ps", "tiles == vdpbf16ps, pairs swapped", "tiles == low product first",
                         "vdpbf16ps == high product first", "vdpbf16ps, pairs swapped == low product first"};
  for (int i = 0; i < 5; ++i) std::printf("%-48s %ld of %ld fp32 sums\n", what[i], agree[i], sums);
  return 0;
}
