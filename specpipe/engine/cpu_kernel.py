"""specpipe's CPU kernel: a matrix product over bf16 or fp32 weights for the few rows of a decoding step
or a tree verify, and the RMSNorm of the lean forward.

For bf16 weights on CPUs whose oneDNN has no bf16 kernel (AVX2 without AVX-512 BW/VL/DQ or
AVX-NE-CONVERT), it streams the bf16 weights, widens them to fp32 in registers and accumulates in fp32.
For fp32 weights on CPUs whose oneDNN fp32 kernel is AVX2 it streams the weights as they are: there
oneDNN and split GEMMs read them far below the memory's speed for 2-16 rows (see
specpipe.engine.cpu.AUTO_FP32_KERNEL_ROWS for the measurements), and this kernel reads them once for all
rows.

Why: on such CPUs transformers' bf16 `F.linear` streams half the bytes of fp32 but has no fast path
for more than one row (measured on a 2-core EPYC held to AVX2, SmolLM2-135M, KV 256: 11.4 / 16.5 /
22.5 ms for 1 / 2 / 3 rows), and fp32 copies of the weights stream twice the bytes (21.5 ms for 4 rows).
The work per weight is one widening and one fused multiply-add per row, so for a few rows the product
stays at the memory's speed on the bf16 bytes (measured there over SmolLM2-135M's 121 linears: 5.9 /
6.0 / 6.6 / 6.8 / 10.5 ms for 1 / 2 / 3 / 4 / 6 rows, against bf16 `F.linear`'s 6.5 / 10.8 / 15.9 /
20.7 / 32.0 and fp32 split GEMMs' 12.5 / 14.8 / 16.6 / 14.7 / 25.7).

From ~6 rows a pass becomes compute-bound, and a verify of 8-16 tree nodes used to stream the weights
once per pass of 4 rows. Now every row group (up to 8 rows) runs over a tile of weight rows while the
tile is in cache, so the weights stream from memory once for any number of rows. Measured on a 2-core
AVX2-only EPYC (Zen 3) over SmolLM2-135M's 121 linears and its output layer (269 MB of bf16 weights,
min of 6 interleaved rounds, ms), passes of 4 then one pass over tiles:

| rows | 1 | 2 | 4 | 6 | 8 | 11 | 16 |
|---|---:|---:|---:|---:|---:|---:|---:|
| passes | 13.9 | 14.5 | 16.0 | 18.7 | 27.1 | 38.0 | 46.8 |
| tiles | 13.6 | 15.1 | 15.9 | 18.5 | 23.5 | 29.9 | 40.5 |

The kernel is C++ with AVX2/FMA intrinsics, built once per machine and torch installation with torch's
extension builder (g++ and ninja) into the specpipe cache, in a folder of this user's alone, its SHA-256
recorded beside it and checked before every load (`specpipe.native_cache`); where it cannot be built or run
(no compiler, another ISA, a cache folder other users could write) `CpuKernel.reason` says why and
engine=fast keeps the paths above. Sums run in another
order than oneDNN's or ATen's, so outputs differ from theirs by float rounding, like any other GEMM.

Where ATen runs AVX-512 the product is built with 16-lane vectors (`kernel_isa`), and there it serves
fp32 weights and bf16 weights that oneDNN runs natively too (specpipe.engine.cpu.auto_kernel_rows): on a
2-core Zen 5 EPYC oneDNN's AVX-512 kernels read SmolLM2-135M's weights at ~45 GB/s of the ~76 the memory
gives, where this kernel's 16-lane widening keeps a bf16 product of 1-6 rows at the memory's speed. Both
builds ask for each weight two rows ahead of the one they read (software prefetch): without it a pass
of 4-8 rows waited on memory. Over SmolLM2-135M's 121 linears and output layer on that CPU, min of 8
interleaved rounds, ms (run 24, docs/BENCHMARKS.md):

| weights, build | 1 | 2 | 4 | 6 | 8 | 12 | 16 |
|---|---:|---:|---:|---:|---:|---:|---:|
| fp32, AVX2 before | 10.7 | 11.1 | 13.5 | 16.4 | 25.7 | 26.8 | 37.7 |
| fp32, AVX2 with the prefetch | 10.7 | 10.7 | 11.4 | 11.6 | 14.4 | 19.3 | 27.2 |
| fp32, AVX-512 | 10.6 | 10.8 | 11.3 | 12.2 | 14.6 | 16.6 | 22.0 |
| bf16, AVX2 before | 5.8 | 5.9 | 9.2 | 14.0 | 18.3 | 25.3 | 33.4 |
| bf16, AVX2 with the prefetch | 5.5 | 5.5 | 6.5 | 9.1 | 13.4 | 17.7 | 26.5 |
| bf16, AVX-512 | 5.4 | 5.5 | 5.8 | 6.3 | 8.7 | 11.9 | 16.5 |
| bf16, AVX-512 with AVX512_BF16 pairs (another run) | 5.6 | 5.4 | 5.5 | 5.7 | 6.4 | 8.2 | 12.3 |

On CPUs with AVX512_BF16 the AVX-512 build multiplies bf16 rows by bf16 weights in pairs (`vdpbf16ps`, 32
values per instruction, no widened copy of x), which keeps a product of up to 8 rows near the memory's
speed, and takes 9-12 rows in one pass, two output features at a time (`RowGroups`): the products of an
8-12-row bf16 verify ran 10-18% faster than in passes of up to 8 rows (a whole 9-11-row verify forward
9-12%), and a bf16 forward beats oneDNN's AVX-512 bf16 kernel up to ~28 rows (run 30, docs/BENCHMARKS.md).

On those CPUs bf16 weights now run repacked once in column blocks (`pair_blocks`, `block_product`,
`engine.kernel_blocks`): 16 output features per 64-byte line of pairs of k, one `vdpbf16ps` per row into a
vector of 16 sums that end in place. The row-by-row product's horizontal sums, epilogue and loads of x per
row and feature had made its arithmetic slower than the memory from 9 rows on; over SmolLM2-135M's weights
(min of 6 interleaved rounds, ms, run 57):

| rows | 1 | 2 | 4 | 8 | 9 | 12 | 16 | 24 | 32 |
|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|
| row by row | 10.28 | 10.07 | 11.07 | 11.71 | 16.20 | 16.63 | 19.89 | 25.71 | 32.12 |
| column blocks | 8.44 | 8.47 | 8.69 | 9.55 | 10.84 | 12.04 | 13.93 | 19.64 | 23.62 |

Once the products were this fast, a one-token bf16 step spent as long again in small ops around them.
So the product takes the bf16 rows and returns bf16 (widening and rounding inside; two casts fewer per
linear), and the extension carries LlamaRMSNorm as one call, which engine=fast's lean forward uses for
fp32 and bf16 models alike (`engine.kernel_norm`): torch.rms_norm ran ~8 ops, 24-36 us per norm alone
and ~50 us inside a forward, 61 norms per SmolLM2-135M forward. The norm repeats the order in which
torch sums and rounds (ATen's cascade sum over 8-lane vectors), so its output is bitwise
transformers'; a load-time check compares the two, and where this torch sums otherwise the norm is
not used (`CpuKernel.norm_reason`). Both changes leave every output bitwise as before.

The extension also carries the attention of a decoding step or a tree verify (`tree_attention`, used by the
lean forward for up to 64 query rows, `engine.kernel_attention`): softmax(q k^T) v per query head over the
KV cache's own rows and the boolean tree mask, fp32 sums, the output in the layout the output projection
reads. SDPA took 25-29 us per layer for one bf16 token of SmolLM2-135M over 256 cached tokens, and a
verify's folded mask and transposes around it added more; the kernel takes 4.3 us (one token) and 12 us
(4 rows) per layer on a 2-core Zen 5 EPYC, and a whole forward ~10% less time in fp32 and bf16 (run 25,
docs/BENCHMARKS.md). It agrees with SDPA to float rounding, not bitwise (checked when it loads). Its multiply-adds,
not its reads, bounded it; on the AVX512_BF16 build bf16 rows of 64 or 128 dims (`attend_heads_paired`,
`engine.attention_pairs`) take 16 keys' scores from one vector reduction and multiply weights rounded to bf16 by
two value rows per vdpbf16ps: 1.4-1.7x faster per layer (run 60).

`silu_gate` is the lean MLP's silu(gate) * up in one pass over both threads (`engine.kernel_gate`), with ATen's own
vector exp (Sleef's, exported by libtorch_cpu), so bitwise torch's where ATen runs that silu in vectors on one
thread (checked over every bf16 value when the kernel loads).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from specpipe import native_cache
from specpipe.engine.cpu import _first_line, aten_capability, cpu_flags


_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>
#include <cmath>
#include <type_traits>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

// The product's vectors: 16 fp32 lanes in 32 registers where the extension is built for AVX-512, else 8
// lanes in 16 registers (AVX2). Which one is built follows the ISA ATen runs (CpuKernel.isa).
#ifdef __AVX512F__
using Lanes = __m512;
constexpr int kLanes = 16;
constexpr int kRegisters = 32;
inline Lanes lanes_zero() { return _mm512_setzero_ps(); }
inline Lanes lanes_load(const float* p) { return _mm512_loadu_ps(p); }
inline Lanes lanes_fma(Lanes a, Lanes b, Lanes c) { return _mm512_fmadd_ps(a, b, c); }
inline Lanes lanes_add(Lanes a, Lanes b) { return _mm512_add_ps(a, b); }
inline float lanes_sum(Lanes v) { return _mm512_reduce_add_ps(v); }
// 16 weights as fp32: bf16 ones widened (a bf16 is the upper half of an fp32), fp32 ones as they are
inline Lanes load_weights(const uint16_t* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline Lanes load_weights(const float* p) { return _mm512_loadu_ps(p); }
// 16 int8 weights as fp32 (exact: every int8 is an fp32); the row's scale multiplies the finished sum
inline Lanes load_weights(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Lanes lanes_set(float v) { return _mm512_set1_ps(v); }
inline Lanes lanes_mul(Lanes a, Lanes b) { return _mm512_mul_ps(a, b); }
inline Lanes lanes_sub(Lanes a, Lanes b) { return _mm512_sub_ps(a, b); }
inline Lanes lanes_min(Lanes a, Lanes b) { return _mm512_min_ps(a, b); }
inline Lanes lanes_max(Lanes a, Lanes b) { return _mm512_max_ps(a, b); }
inline Lanes lanes_floor(Lanes v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
// 2^n for integral n in [-126, 127]: the exponent field of an fp32
inline Lanes lanes_pow2(Lanes n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// v where `score` > -inf, else exactly 0 (a masked key adds nothing)
inline Lanes lanes_where_finite(Lanes v, Lanes score) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(score, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), v);
}
inline void lanes_store(float* p, Lanes v) { _mm512_storeu_ps(p, v); }
// out[0..4) = the sums of a's, b's, c's and d's lanes, in fewer shuffles than four reductions
inline void lanes_sum4(Lanes a, Lanes b, Lanes c, Lanes d, float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 blocks = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  blocks = _mm512_add_ps(blocks, _mm512_permute_ps(blocks, 0x4E));
  blocks = _mm512_add_ps(blocks, _mm512_permute_ps(blocks, 0xB1));  // every lane of block k: the k-th sum
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, blocks);
  out[0] = lanes[0], out[1] = lanes[4], out[2] = lanes[8], out[3] = lanes[12];
}
#else
using Lanes = __m256;
constexpr int kLanes = 8;
constexpr int kRegisters = 16;
inline Lanes lanes_zero() { return _mm256_setzero_ps(); }
inline Lanes lanes_load(const float* p) { return _mm256_loadu_ps(p); }
inline Lanes lanes_fma(Lanes a, Lanes b, Lanes c) { return _mm256_fmadd_ps(a, b, c); }
inline Lanes lanes_add(Lanes a, Lanes b) { return _mm256_add_ps(a, b); }
inline float lanes_sum(Lanes v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// 8 weights as fp32: bf16 ones widened (a bf16 is the upper half of an fp32), fp32 ones as they are
inline Lanes load_weights(const uint16_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline Lanes load_weights(const float* p) { return _mm256_loadu_ps(p); }
inline Lanes load_weights(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Lanes lanes_set(float v) { return _mm256_set1_ps(v); }
inline Lanes lanes_mul(Lanes a, Lanes b) { return _mm256_mul_ps(a, b); }
inline Lanes lanes_sub(Lanes a, Lanes b) { return _mm256_sub_ps(a, b); }
inline Lanes lanes_min(Lanes a, Lanes b) { return _mm256_min_ps(a, b); }
inline Lanes lanes_max(Lanes a, Lanes b) { return _mm256_max_ps(a, b); }
inline Lanes lanes_floor(Lanes v) { return _mm256_floor_ps(v); }
// 2^n for integral n in [-126, 127]: the exponent field of an fp32
inline Lanes lanes_pow2(Lanes n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
// v where `score` > -inf, else exactly 0 (a masked key adds nothing)
inline Lanes lanes_where_finite(Lanes v, Lanes score) {
  return _mm256_and_ps(v, _mm256_cmp_ps(score, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
}
inline void lanes_store(float* p, Lanes v) { _mm256_storeu_ps(p, v); }
// out[0..4) = the sums of a's, b's, c's and d's lanes, in fewer shuffles than four reductions
inline void lanes_sum4(Lanes a, Lanes b, Lanes c, Lanes d, float* out) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
}
#endif

// e^x for x <= 0 (softmax weights), within ~2 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7
// polynomial (the Taylor series' coefficients adjusted for the interval, as in Cephes' expf), times 2^n.
// Below -87.3 the result is clamped to ~2^-126 instead of denormals: weights that small vanish beside
// the row's largest, which is 1.
inline Lanes lanes_exp(Lanes x) {
  x = lanes_max(lanes_min(x, lanes_set(88.3f)), lanes_set(-87.3f));
  const Lanes n = lanes_floor(lanes_fma(x, lanes_set(1.44269504088896341f), lanes_set(0.5f)));
  // r = x - n ln2, ln2 in two parts so that n * 0.693359375 is exact
  Lanes r = lanes_sub(x, lanes_mul(n, lanes_set(0.693359375f)));
  r = lanes_sub(r, lanes_mul(n, lanes_set(-2.12194440e-4f)));
  Lanes y = lanes_set(1.9875691500e-4f);
  y = lanes_fma(y, r, lanes_set(1.3981999507e-3f));
  y = lanes_fma(y, r, lanes_set(8.3334519073e-3f));
  y = lanes_fma(y, r, lanes_set(4.1665795894e-2f));
  y = lanes_fma(y, r, lanes_set(1.6666665459e-1f));
  y = lanes_fma(y, r, lanes_set(5.0000001201e-1f));
  y = lanes_fma(y, lanes_mul(r, r), lanes_add(r, lanes_set(1.0f)));
  return lanes_mul(y, lanes_pow2(n));
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float as_float(uint16_t v) { return bf16_to_float(v); }
inline float as_float(float v) { return v; }
inline float as_float(int8_t v) { return static_cast<float>(v); }

// What is done to a finished fp32 sum of output feature o: times scale[o] (int8 weights: each weight row's
// quantization step), then plus bias[o]; either may be null.
struct Epilogue {
  const float* scale = nullptr;
  const float* bias = nullptr;
  float apply(float sum, int64_t o) const {
    if (scale != nullptr) sum *= scale[o];
    if (bias != nullptr) sum += bias[o];
    return sum;
  }
};

// One step of a dot product over k: how many values it covers, how it loads a weight row's slice, and
// how it multiplies that slice by an x row's slice into an accumulator of kLanes fp32 sums.
// Widened: fp32 x; the weights (bf16 widened, or fp32) times x, one FMA per kLanes values.
struct WidenedStep {
  using X = float;
  static constexpr int kValues = kLanes;
  template <typename W>
  static Lanes weights(const W* p) { return load_weights(p); }
  static Lanes multiply_add(Lanes acc, Lanes weights, const float* x) { return lanes_fma(weights, lanes_load(x), acc); }
};

#ifdef __AVX512BF16__
// Pairs (CPUs with AVX512_BF16): bf16 x and bf16 weights, 32 values per instruction, each fp32 lane adding
// the products of one pair (exact in fp32) to its sum. Half the instructions of widening both, and no
// widened copy of x: an 8-row bf16 product over SmolLM2-135M's linears took 8.7 ms widened.
struct PairStep {
  using X = uint16_t;
  static constexpr int kValues = 32;
  static __m512i weights(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static Lanes multiply_add(Lanes acc, __m512i weights, const uint16_t* x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)weights, (__m512bh)_mm512_loadu_si512(x));
  }
};

// Pairs over int8 weights: 32 of them made bf16 in registers (exact: every int8 is a bf16), then multiplied
// as PairStep's. Widening bf16 x to fp32 instead made an 8-row product of an EAGLE head's weights ~1.8x slower.
struct Int8PairStep {
  using X = uint16_t;
  static constexpr int kValues = 32;
  static __m512i weights(const int8_t* p) {
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(high, low);
  }
  static Lanes multiply_add(Lanes acc, __m512i weights, const uint16_t* x) { return PairStep::multiply_add(acc, weights, x); }
};
#endif

// How many weight rows ahead the product asks for the weights it reads next (a software prefetch of
// the same offset that many rows on). The hardware prefetcher alone left a pass of 4-8 rows waiting on
// memory: over SmolLM2-135M's fp32 linears on a 2-core AVX-512 EPYC (Zen 5), 8 rows took 26.5 ms
// without it and 14.5 with it (1 row: 11.0 both).
constexpr int64_t kPrefetchRows = 2;
// The column blocks' prefetch (block_product): lines ahead in each block it reads. 8 and 16 measured alike.
constexpr int64_t kBlockPrefetchLines = 16;
// The lookahead (engine.block_lookahead_kb; 0 = none) of the column blocks' product and of the row-by-row one
// (product_block): from kBlockLookaheadRows rows on (engine.block_lookahead_rows), each step also asks L2 for the
// weight this many bytes on. Over SmolLM2-135M's
// weights streamed (2-core Zen 5 EPYC, interleaved, ms) 8 / 9 / 10 / 12 / 16 rows took 8.7 / 9.4 / 9.6 / 10.4 /
// 12.7 with 32 KiB against 10.0 / 11.4 / 12.1 / 12.9 / 14.2 without; 16 KiB gained about half of that, 64 and 128
// KiB no more than 32. Below 5 rows that CPU's memory is the limit: there it made 1-4 rows 3-13% slower (a thread's
// last 32 KiB of each weight are read for nothing); on the AMX Xeon it made them 26-34% faster (see
// AUTO_AMX_BLOCK_LOOKAHEAD_ROWS).
#ifndef SPECPIPE_BLOCK_LOOKAHEAD_BYTES
#define SPECPIPE_BLOCK_LOOKAHEAD_BYTES 32768
#endif
constexpr int64_t kBlockLookaheadBytes = SPECPIPE_BLOCK_LOOKAHEAD_BYTES;
#ifndef SPECPIPE_BLOCK_LOOKAHEAD_ROWS
#define SPECPIPE_BLOCK_LOOKAHEAD_ROWS 5
#endif
constexpr int kBlockLookaheadRows = SPECPIPE_BLOCK_LOOKAHEAD_ROWS;

// The prefetch's cache hint (set by the build's flags: engine.weight_prefetch). A weight is read once per
// forward, and _MM_HINT_T0 let the ~270 MB a SmolLM2-135M forward streams evict everything else from L2
// and L3: the KV cache, the activations, a draft head's weights, the interpreter's own data. With
// _MM_HINT_NTA they stay (2-core Zen 5 EPYC, decoding interleaved with the other hint: one-token steps
// +2% in bf16, +8% in fp32; REST +2-5% and +8%).
#ifndef SPECPIPE_WEIGHT_HINT
#define SPECPIPE_WEIGHT_HINT _MM_HINT_NTA
#endif

// out[r, o] = sum_k x[r, k] * w[o, k] for R rows of x and output features [begin, end), Step::kValues
// values of k per step. Each output feature streams its weight row once; U accumulators per row over
// interleaved slices of k keep R * U independent chains in flight (the latency of a multiply-add, not the
// memory, limits one chain). O output features at a time share each load of x: with many rows the loads
// of x, not the multiply-adds, fill the cycle.
template <typename Step, int R, int U, int O, typename W, typename Out>
void product_block(const typename Step::X* x, const W* w, Epilogue epilogue, Out* out, int64_t in,
                   int64_t out_stride, int64_t begin, int64_t end) {
  constexpr int kValues = Step::kValues;
  const int64_t unrolled_end = in - in % (kValues * U);
  const int64_t vector_end = in - in % kValues;
  int64_t o = begin;
  for (; o + O <= end; o += O) {
    const W* rows = w + o * in;  // O weight rows, one after another
    // past the weight's last row near the end: a prefetch never faults, and its line is only not used
    const char* ahead = reinterpret_cast<const char*>(rows + kPrefetchRows * O * in);
    Lanes acc[O][U][R];
#pragma GCC unroll 16
    for (int p = 0; p < O; ++p)
#pragma GCC unroll 16
      for (int u = 0; u < U; ++u)
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[p][u][r] = lanes_zero();
    for (int64_t k = 0; k < unrolled_end; k += kValues * U) {
#pragma GCC unroll 16
      for (int u = 0; u < U; ++u) {
        decltype(Step::weights(rows)) weights[O];
#pragma GCC unroll 16
        for (int p = 0; p < O; ++p) {
          weights[p] = Step::weights(rows + p * in + k + kValues * u);
          _mm_prefetch(ahead + (p * in + k + kValues * u) * sizeof(W), SPECPIPE_WEIGHT_HINT);
          // the column blocks' lookahead here too: L2 asked for the weight kBlockLookaheadBytes on (the rows lie one
          // after another; past the weight's end, lines that go unused). On the AMX Xeon, from one row on, an fp32
          // forward took half the time (see AUTO_AMX_BLOCK_LOOKAHEAD_ROWS)
          if constexpr (R >= kBlockLookaheadRows && kBlockLookaheadBytes > 0)
            _mm_prefetch(reinterpret_cast<const char*>(rows + p * in + k + kValues * u) + kBlockLookaheadBytes,
                         _MM_HINT_T1);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
          for (int p = 0; p < O; ++p)
            acc[p][u][r] = Step::multiply_add(acc[p][u][r], weights[p], x + r * in + k + kValues * u);
      }
    }
#pragma GCC unroll 16
    for (int p = 0; p < O; ++p) {
      const W* row = rows + p * in;
      for (int64_t k = unrolled_end; k < vector_end; k += kValues) {
        const auto weights = Step::weights(row + k);
        _mm_prefetch(ahead + (p * in + k) * sizeof(W), SPECPIPE_WEIGHT_HINT);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[p][0][r] = Step::multiply_add(acc[p][0][r], weights, x + r * in + k);
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        Lanes total = acc[p][0][r];
#pragma GCC unroll 16
        for (int u = 1; u < U; ++u) total = lanes_add(total, acc[p][u][r]);
        float sum = lanes_sum(total);
        for (int64_t k = vector_end; k < in; ++k) sum += as_float(x[r * in + k]) * as_float(row[k]);
        // a bf16 output is the fp32 sum rounded once (c10::BFloat16: round to nearest even), as casting
        // the fp32 product afterwards would round it
        out[r * out_stride + o + p] = static_cast<Out>(epilogue.apply(sum, o + p));
      }
    }
  }
  if constexpr (O > 1) {  // the last features, fewer than O
    if (o < end) product_block<Step, R, U, 1>(x, w, epilogue, out, in, out_stride, o, end);
  }
}

// How a group of R rows runs: U accumulators per row and O output features at a time (product_block),
// and the most rows one pass over a tile takes (more rows run in balanced groups, one pass each).
// Widened steps: at least 8 independent FMA chains (two FMA units, 4 cycles of latency) where the
// registers hold them beside the U weight vectors: U = 8, 4, 2 for 1, 2, 3-6 rows and 1 from 7 in 16
// registers (AVX2); 2 up to 8 rows in 32 (AVX-512); groups of up to 8 rows (AVX-512: groups of 16
// measured slower than two of 8).
template <typename Step>
struct RowGroups {
  static constexpr int64_t kMaxRows = 8;
  template <int R>
  static constexpr int accumulators() {
    if (R == 1) return 8;
    if (R == 2) return 4;
    return R <= (kRegisters == 32 ? 8 : 6) ? 2 : 1;
  }
  template <int R>
  static constexpr int outputs() { return 1; }
};

#ifdef __AVX512BF16__
// Pairs: 9-12 rows in one pass, two output features at a time and one accumulator per row and feature
// (18-24 of the 32 registers), where two passes of 5-6 rows each loaded x once per feature and re-read
// the tile. Over SmolLM2-135M's linears and output layer (2-core Zen 5 EPYC, min of 10 interleaved rounds,
// ms), groups of up to 8 rows -> this:
//   rows   4     7     8     9     10    11    12    13    16
//        5.71  6.30  6.87  7.83  8.31  8.49  8.93  9.23  13.13
//     -> 5.74  6.19  6.15  7.07  6.97  6.95  7.51  9.27  10.67
// Three features at a time made a single pass of 7-8 rows slower (7.9 and 7.8 ms), and one pass of
// 13-16 rows slower than two.
template <>
struct RowGroups<PairStep> {
  static constexpr int64_t kMaxRows = 12;
  template <int R>
  static constexpr int accumulators() { return R == 1 ? 8 : R == 2 ? 4 : R <= 8 ? 2 : 1; }
  template <int R>
  static constexpr int outputs() { return R <= 8 ? 1 : 2; }
};
template <>
struct RowGroups<Int8PairStep> : RowGroups<PairStep> {};
#endif

// Rows [x, x + count) of the product for output features [begin, end), count <= RowGroups<Step>::kMaxRows.
template <typename Step, int R = 1, typename W, typename Out>
void product_rows(int64_t count, const typename Step::X* x, const W* w, Epilogue epilogue, Out* out, int64_t in,
                  int64_t out_stride, int64_t begin, int64_t end) {
  using Groups = RowGroups<Step>;
  if constexpr (R < Groups::kMaxRows) {
    if (count != R) return product_rows<Step, R + 1>(count, x, w, epilogue, out, in, out_stride, begin, end);
  }
  product_block<Step, R, Groups::template accumulators<R>(), Groups::template outputs<R>()>(
      x, w, epilogue, out, in, out_stride, begin, end);
}

constexpr int64_t kTileBytes = 32768;

// The weight streams from memory once for all rows: each thread walks its output features in tiles of
// ~32 KB of weight rows and runs every group of rows (RowGroups) over a tile while it is in L1/L2.
// Groups are balanced (AVX2, 11 rows: 6 + 5), as more rows per group means fewer passes over the tile.
template <typename Step, typename W, typename Out>
void product(const typename Step::X* xs, const W* w, Epilogue epilogue, Out* os, int64_t rows, int64_t in,
             int64_t out_features) {
  const int64_t tile = std::max<int64_t>(4, kTileBytes / (static_cast<int64_t>(sizeof(W)) * in));
  const int64_t grain = std::max<int64_t>(16, out_features / (4 * at::get_num_threads()));
  at::parallel_for(0, out_features, grain, [&](int64_t begin, int64_t end) {
    for (int64_t tile_begin = begin; tile_begin < end; tile_begin += tile) {
      const int64_t tile_end = std::min(end, tile_begin + tile);
      for (int64_t first = 0, count = 0; first < rows; first += count) {
        const int64_t left = rows - first, most = RowGroups<Step>::kMaxRows, groups = (left + most - 1) / most;
        count = (left + groups - 1) / groups;
        product_rows<Step>(count, xs + first * in, w, epilogue, os + first * out_features, in, out_features,
                           tile_begin, tile_end);
      }
    }
  });
}

}  // namespace

namespace {

// The rows of x as the widened steps read them: fp32 x as it is, bf16 x widened (exactly) into `widened`.
// A few rows: widening them costs nothing next to the weights. `widened` is a tensor, not a std::vector:
// torch aligns it to 64 bytes, and a vector load of x crossing cache lines measured ~2x slower for 6-8 rows.
const float* widened_rows(const torch::Tensor& x, torch::Tensor& widened) {
  if (x.scalar_type() == torch::kFloat32) return x.data_ptr<float>();
  widened = torch::empty({x.numel()}, x.options().dtype(torch::kFloat32));
  float* wide = widened.data_ptr<float>();
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < x.numel(); ++i) wide[i] = bf16_to_float(raw[i]);
  return wide;
}

// x [..., in] fp32 or bf16 checked against a weight of `in` features; the output [..., out_features] in x's dtype.
torch::Tensor checked_output(torch::Tensor& x, int64_t in, int64_t out_features) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32),
              "x: fp32 or bf16 [..., in]");
  TORCH_CHECK(x.size(-1) == in && in > 0, "x and weight disagree on in_features");
  x = x.contiguous();
  std::vector<int64_t> out_sizes = x.sizes().vec();
  out_sizes.back() = out_features;
  return torch::empty(out_sizes, x.options());
}

const float* checked_fp32(const c10::optional<torch::Tensor>& values, int64_t out_features, const char* what) {
  if (!values.has_value()) return nullptr;
  TORCH_CHECK(values->scalar_type() == torch::kFloat32 && values->is_contiguous() && values->numel() == out_features,
              what, ": contiguous fp32 [out]");
  return values->data_ptr<float>();
}

// The widened product over weights w of type W into out (x's dtype), rows of x already widened to fp32.
template <typename W>
void widened_product(const float* xs, const W* w, Epilogue epilogue, torch::Tensor& out, int64_t rows, int64_t in,
                     int64_t out_features) {
  if (out.scalar_type() == torch::kBFloat16)
    product<WidenedStep>(xs, w, epilogue, out.data_ptr<at::BFloat16>(), rows, in, out_features);
  else
    product<WidenedStep>(xs, w, epilogue, out.data_ptr<float>(), rows, in, out_features);
}

}  // namespace

// x [..., in] fp32 or bf16, weight [out, in] bf16 or fp32, bias [out] fp32 or None -> [..., out] in x's dtype.
// A bf16 x is widened here and the output rounded here, so a bf16 model's product is one call: the
// casts around it were two more ops per linear, ~240 per forward of SmolLM2-135M.
torch::Tensor weight_product(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  const bool bf16_weight = weight.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(weight.dim() == 2 && (bf16_weight || weight.scalar_type() == torch::kFloat32) && weight.is_contiguous(),
              "weight: contiguous bf16 or fp32 [out, in]");
  const int64_t in = weight.size(1), out_features = weight.size(0);
  auto out = checked_output(x, in, out_features);
  const int64_t rows = x.numel() / in;
  const Epilogue epilogue{nullptr, checked_fp32(bias, out_features, "bias")};
#ifdef __AVX512BF16__
  if (x.scalar_type() == torch::kBFloat16 && bf16_weight) {  // pairs of bf16 values straight from both
    product<PairStep>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                      reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), epilogue,
                      out.data_ptr<at::BFloat16>(), rows, in, out_features);
    return out;
  }
#endif
  torch::Tensor widened;
  const float* xs = widened_rows(x, widened);
  if (bf16_weight)
    widened_product(xs, reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), epilogue, out, rows, in,
                    out_features);
  else
    widened_product(xs, weight.data_ptr<float>(), epilogue, out, rows, in, out_features);
  return out;
}

// x [..., in] fp32 or bf16, weight [out, in] int8, scale [out] fp32, bias [out] fp32 or None -> [..., out] in
// x's dtype: out[r, o] = scale[o] * sum_k x[r, k] * weight[o, k] + bias[o], summed in fp32. A weight row is
// quantized symmetrically with one step per output feature (specpipe.engine.quantize): a quarter of fp32's
// bytes and half of bf16's for a draft whose weights are read again from memory at every draft level.
torch::Tensor quantized_product(torch::Tensor x, torch::Tensor weight, torch::Tensor scale,
                                c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kChar && weight.is_contiguous(),
              "weight: contiguous int8 [out, in]");
  const int64_t in = weight.size(1), out_features = weight.size(0);
  auto out = checked_output(x, in, out_features);
  const int64_t rows = x.numel() / in;
  const Epilogue epilogue{checked_fp32(scale, out_features, "scale"), checked_fp32(bias, out_features, "bias")};
#ifdef __AVX512BF16__
  if (x.scalar_type() == torch::kBFloat16) {
    product<Int8PairStep>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), weight.data_ptr<int8_t>(),
                          epilogue, out.data_ptr<at::BFloat16>(), rows, in, out_features);
    return out;
  }
#endif
  torch::Tensor widened;
  widened_product(widened_rows(x, widened), weight.data_ptr<int8_t>(), epilogue, out, rows, in, out_features);
  return out;
}

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
inline Lanes nibble_bit_lanes(__m128i nibbles, IntLanes high) {
  return _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_cvtepu8_epi32(nibbles), high));
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

// One block's weights, a chunk of 32 at a time: Widener<Format> w(block); w.chunk(c, out) for c < kChunks writes
// weights [32c, 32c + 32) as kChunkVectors fp32 vectors. The constructor reads what the chunks share (steps, scales).
template <int Format>
struct Widener;

#ifdef __AVX512F__
// Q4_0 and Q4_1 on AVX-512: the 16 weights a block's codes can stand for, computed once per block as each weight is
// (d * (q - 8), or d * q + m, rounded alike), and each code looked up in them (vpermps reads an index's low 4 bits):
// fewer instructions a weight than widening each code, and the same fp32 weights.
template <int Format>
struct NibbleTableWidener {
  static constexpr int kChunks = 1;
  const uint8_t* codes;
  Lanes table;
  explicit NibbleTableWidener(const uint8_t* b) : codes(b + (Format == kGgufQ4_1 ? 4 : 2)) {
    const Lanes q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const Lanes d = lanes_set(half_float(b));
    table = Format == kGgufQ4_1 ? lanes_add(lanes_mul(d, q), lanes_set(half_float(b + 2)))
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
  explicit NibbleWidener(const uint8_t* b)
      : block(b), d(lanes_set(half_float(b))), m(lanes_set(kMinimum ? half_float(b + 2) : 0.0f)) {
    if constexpr (kFifthBit) std::memcpy(&high, b + kCodes - 4, 4);
  }
  void chunk(int, Lanes* out) const {
    constexpr int kHalf = kChunkVectors / 2;  // vectors of low nibbles, then as many of high ones
    for (int v = 0; v < kChunkVectors; ++v) {
      const __m128i nibbles = nibble_bytes(lane_bytes(block + kCodes + kLanes * (v % kHalf)), v >= kHalf);
      Lanes q;
      if constexpr (kFifthBit) q = nibble_bit_lanes(nibbles, bit_lanes(high, kLanes * v));
      else q = unsigned_lanes(nibbles);
      if constexpr (kMinimum) out[v] = lanes_add(lanes_mul(d, q), m);
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

// How many weight rows gguf_rows multiplies side by side for R rows of x: with few rows of x, one weight row's sums
// are two chains of dependent FMAs, so several weight rows run together to keep the FMA units busy. Each weight row's
// sums keep their order: the outputs are the same for any number side by side.
template <int R>
constexpr int gguf_side_by_side() {
  return std::max(1, 8 / (R * kAccumulators));
}

// R rows of x [R, in] fp32 times weight rows [begin, end) of blocks [out, in / values * bytes], into out (stride
// out_stride), O weight rows at a time.
template <int Format, int R, int O = gguf_side_by_side<R>(), typename Out>
void gguf_rows(const float* x, const uint8_t* blocks, const float* bias, Out* out, int64_t in, int64_t out_stride,
               int64_t begin, int64_t end) {
  constexpr int64_t kBytes = gguf_block_bytes(Format), kValues = gguf_block_values(Format);
  const int64_t count = in / kValues, row_bytes = count * kBytes;
  int64_t o = begin;
  for (; o + O <= end; o += O) {
    const uint8_t* rows = blocks + o * row_bytes;
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
        const Widener<Format> widener(rows + at);
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
      const Widener<Format> widener(blocks + (o * count + b) * kBytes);
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

}  // namespace

// x [..., in] fp32 or bf16, blocks [out, in / block values * block bytes] uint8 in the GGUF format `format` (ggml's
// type id, see above), bias [out] fp32 or None -> [..., out] in x's dtype: each weight widened to fp32 in registers
// (as gguf-py dequantizes it), each row summed in fp32 in the same order whatever rows come with it.
torch::Tensor gguf_product(torch::Tensor x, torch::Tensor blocks, int64_t format, int64_t in_features,
                           c10::optional<torch::Tensor> bias) {
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

// ---- bf16 weights in column blocks (AVX512_BF16): the product without horizontal sums ----
// weight_product multiplies each weight row by each x row along k and sums the 16 lanes at the end. With
// SmolLM2-135M's 576 inputs that sum, the epilogue and the load of x for every row and feature made its
// arithmetic slower than the memory from 9 rows on: 17.4 ms for 9 rows over the model's weights against
// 10.7 for one (2-core Zen 5 EPYC, bench/kernel_rows.py). Here the weight is repacked once (pair_blocks)
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
// two from 9 to 16 rows (each broadcast of x then serves two). Over SmolLM2-135M's weights (2-core Zen 5 EPYC,
// ms): one block 8.5 / 8.5 / 9.6 / 12.5 / 16.4 for 1 / 4 / 8 / 12 / 16 rows, two blocks 8.8 / 9.3 / 10.4 /
// 11.5 / 12.9; more blocks at once for 2-6 rows read the memory slower (+4-11%). Weights in the cache: there one
// block's chain of multiply-adds into one accumulator waits on the instruction's latency (~6 cycles a line, 41
// GB/s a core), and few rows gain from several blocks at once (`resident`): an EAGLE head's six bf16 products at
// 1 / 2 / 4 rows, warm, 0.25 / 0.27 / 0.28 ms one block at a time against 0.15 / 0.20 / 0.21 (int8: 0.26 / 0.25 /
// 0.30 against 0.20 / 0.21 / 0.29). Cold (after 64 MB streamed) several blocks were no faster (int8 at 1 / 4 rows
// 0.29 / 0.34 ms against 0.31 / 0.40), and in the pipeline the head's output layer, read last in a level, ran
// slower with them; so only a head's decoder layer in one call (block_decoder_layer) takes them, its weights read
// right after the head's fc (in the pipeline, with and without them measured within the VM's drift: run 58).
// The blocks' count never changes a row's sums (each block sums over k in order).
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

// out[r, 16 (first + b) + j] for the configured rows (x's, `rows` of them) and B blocks from `first`
template <int B>
SPECPIPE_AMX_TARGET void amx_group(const uint32_t* x, int rows, const uint32_t* blocks, Epilogue epilogue,
                                   uint16_t* out, int64_t pairs, int64_t out_stride, int64_t out_features,
                                   int64_t first) {
  _tile_zero(0);
  if constexpr (B > 1) _tile_zero(1);
  if constexpr (B > 2) _tile_zero(2);
  if constexpr (B > 3) _tile_zero(3);
  const uint32_t* lines[B];
  for (int b = 0; b < B; ++b) lines[b] = blocks + (first + b) * pairs * kBlockFeatures;
  const int64_t x_stride = pairs * sizeof(uint32_t);
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
    _tile_loadd(5, lines[0] + p * kBlockFeatures, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (B > 1) {
      _tile_loadd(6, lines[1] + p * kBlockFeatures, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (B > 2) {
      _tile_loadd(5, lines[2] + p * kBlockFeatures, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (B > 3) {
      _tile_loadd(6, lines[3] + p * kBlockFeatures, 64);
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

// block_product_rows on the tiles: bf16 blocks whose pairs are a multiple of kAmxPairs
void amx_product_rows(const uint32_t* xs, const uint32_t* w, Epilogue epilogue, uint16_t* os, int64_t rows,
                      int64_t pairs, int64_t count, int64_t out_features) {
  const int64_t tile = std::max<int64_t>(kAmxBlocks, kBlockTileBytes / (pairs * kBlockFeatures * sizeof(uint32_t)));
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
          amx_group<kAmxBlocks>(x, group, w, epilogue, out, pairs, out_features, out_features, b);
        for (; b < tile_end; ++b) amx_group<1>(x, group, w, epilogue, out, pairs, out_features, out_features, b);
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
  if (amx_rows > 0 && rows >= amx_rows && !int8 && pairs % kAmxPairs == 0) {
    amx_product_rows(xs, pairs_of, epilogue, os, rows, pairs, blocks.size(0), out_features);
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

// block_product on AMX tiles for products of `min_rows` rows (>= 1) and more where the blocks are bf16 and their
// pairs of k a multiple of 16 (else block_product itself). Only after amx_request() granted the tiles to this process.
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

namespace {

// ATen's cascade sum (SumKernel.cpp's multi_row_sum) of `size` elements of `nrows` interleaved
// accumulators: element (i, k) is at(i * nrows + k). The same chunking, in the same order, so the
// sum is bitwise ATen's: 16 or more elements per chunk, chunk sums added level by level.
template <typename Acc, int nrows, typename At>
void cascade_sum(Acc (&out)[nrows], int64_t size, At at) {
  constexpr int num_levels = 4;
  const int64_t ceil_log2 = size <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(size - 1));
  const int64_t level_power = std::max<int64_t>(4, ceil_log2 / num_levels);
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  Acc acc[num_levels][nrows];
  for (int j = 0; j < num_levels; ++j)
    for (int k = 0; k < nrows; ++k) acc[j][k] = Acc::zero();
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < nrows; ++k) acc[0][k] = acc[0][k] + at(i * nrows + k);
    for (int j = 1; j < num_levels; ++j) {
      for (int k = 0; k < nrows; ++k) {
        acc[j][k] = acc[j][k] + acc[j - 1][k];
        acc[j - 1][k] = Acc::zero();
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < nrows; ++k) acc[0][k] = acc[0][k] + at(i * nrows + k);
  for (int j = 1; j < num_levels; ++j)
    for (int k = 0; k < nrows; ++k) acc[0][k] = acc[0][k] + acc[j][k];
  for (int k = 0; k < nrows; ++k) out[k] = acc[0][k];
}

struct Lanes8 {  // ATen's AVX2 Vectorized<float>: adds lane by lane
  __m256 v;
  static Lanes8 zero() { return {_mm256_setzero_ps()}; }
  Lanes8 operator+(const Lanes8& other) const { return {_mm256_add_ps(v, other.v)}; }
};

struct Scalar {
  float v;
  static Scalar zero() { return {0.0f}; }
  Scalar operator+(const Scalar& other) const { return {v + other.v}; }
};

// sum(square(x[0..n))) in ATen's order for a contiguous last-dimension sum of fp32 values:
// vectors of 8 lanes summed by row_sum (4 interleaved cascades), the scalar tail summed from 0, then
// the 8 lanes added to it one by one; rows shorter than 8 take the scalar row_sum. `squares` holds
// x * x already rounded to fp32, as torch's pow(2) leaves it.
float sum_of_squares(const float* squares, int64_t n) {
  if (n >= 8) {
    const int64_t vectors = n / 8, interleaved = vectors / 4;
    Lanes8 partial[4];
    cascade_sum<Lanes8, 4>(partial, interleaved, [&](int64_t v) { return Lanes8{_mm256_loadu_ps(squares + 8 * v)}; });
    for (int64_t v = interleaved * 4; v < vectors; ++v) partial[0] = partial[0] + Lanes8{_mm256_loadu_ps(squares + 8 * v)};
    for (int k = 1; k < 4; ++k) partial[0] = partial[0] + partial[k];
    float total = 0.0f;
    for (int64_t k = vectors * 8; k < n; ++k) total += squares[k];
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, partial[0].v);
    for (int k = 0; k < 8; ++k) total += lanes[k];
    return total;
  }
  const int64_t interleaved = n / 4;
  Scalar partial[4];
  cascade_sum<Scalar, 4>(partial, interleaved, [&](int64_t i) { return Scalar{squares[i]}; });
  for (int64_t i = interleaved * 4; i < n; ++i) partial[0] = partial[0] + Scalar{squares[i]};
  for (int k = 1; k < 4; ++k) partial[0] = partial[0] + partial[k];
  return partial[0].v;
}

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(n), squares(n);
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * n;
      for (int64_t k = 0; k < n; ++k) {
        widened[k] = to_float(row[k]);
        squares[k] = widened[k] * widened[k];
      }
      // mean, + eps, rsqrt: each rounded to fp32 as torch's separate ops round them
      const float mean = sum_of_squares(squares.data(), n) / static_cast<float>(n);
      const float inverse_rms = 1.0f / std::sqrt(mean + eps);
      for (int64_t k = 0; k < n; ++k) {
        const float normalized = widened[k] * inverse_rms;
        // fp32: weight * normalized; bf16: normalized rounded to bf16, then times the weight, rounded
        out[r * n + k] = static_cast<T>(to_float(weight[k]) * to_float(static_cast<T>(normalized)));
      }
    }
  });
}

}  // namespace

// LlamaRMSNorm.forward in one call: x [..., n] fp32 or bf16, weight [n] of x's dtype -> [..., n].
// The normalization runs in fp32 with torch's own order of sums and roundings (bitwise equal to
// transformers' norm, checked when the kernel loads); torch.rms_norm spent ~50 us per norm on ~8 ops
// of a few hundred values each, 61 norms per forward of SmolLM2-135M.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == torch::kFloat32, "x: fp32 or bf16 [..., n]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "weight: [n] of x's dtype");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  auto out = torch::empty_like(x);
  const float eps32 = static_cast<float>(eps);  // torch adds eps as a scalar of the tensor's dtype
  if (bf16)
    rms_norm_rows(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, n,
                  eps32);
  else
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, n, eps32);
  return out;
}

namespace {

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

// One query row of one head: softmax(q k^T * scale) v over the kv keys that `visible` ([kv], or null:
// every key) lets it see, summed in fp32, for any head_dim. Keys and values are rows of the KV cache
// (`*_stride` apart); `scores` [kv] and `sums` [head_dim] are the calling thread's scratch.
template <typename T>
void attend_row(const T* query, const T* keys, int64_t key_stride, const T* values, int64_t value_stride,
                const bool* visible, int64_t kv, int64_t head_dim, float scale, T* out, float* scores, float* sums) {
  const int64_t vector_end = head_dim - head_dim % kLanes;
  float* row = sums;  // the query row, widened, until the scores are made
  for (int64_t d = 0; d < head_dim; ++d) row[d] = as_float(query[d]);
  for (int64_t j = 0; j < kv; ++j) {
    if (visible != nullptr && !visible[j]) {
      scores[j] = -INFINITY;
      continue;
    }
    const T* key = keys + j * key_stride;
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
    if (weight == 0.0f) continue;  // masked (or vanishing): adds nothing
    const T* value = values + j * value_stride;
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
// from the caches G times, so a verify's rows over long contexts waited on those reads (fp32, 1200
// cached tokens: 182 us per layer for 8 rows). `scores` [G, kv] is scratch; `visible` [kv] or null.
template <int NV, int G, typename T>
void attend_heads(const T* const* queries, const T* keys, int64_t key_stride, const T* values, int64_t value_stride,
                  const bool* visible, int64_t kv, float scale, T* const* outs, float* scores) {
  constexpr int64_t kHeadDim = NV * kLanes;
  QueryRow<NV, T> rows[G];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) rows[g].load(queries[g]);
  int64_t j = 0;
  for (; j + 4 <= kv; j += 4) {
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      lanes_sum4(rows[g].dot(keys + j * key_stride), rows[g].dot(keys + (j + 1) * key_stride),
                 rows[g].dot(keys + (j + 2) * key_stride), rows[g].dot(keys + (j + 3) * key_stride),
                 scores + g * kv + j);
    }
  }
  for (; j < kv; ++j)
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) scores[g * kv + j] = lanes_sum(rows[g].dot(keys + j * key_stride));
  float inverse[G];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    float* head_scores = scores + g * kv;
    if (visible == nullptr) {
      for (int64_t k = 0; k < kv; ++k) head_scores[k] *= scale;
    } else {  // a select, not a branch per key: the compiler makes vectors of it
      for (int64_t k = 0; k < kv; ++k) head_scores[k] = visible[k] ? head_scores[k] * scale : -INFINITY;
    }
    const float sum = softmax_weights(head_scores, kv);
    inverse[g] = sum > 0.0f ? 1.0f / sum : 0.0f;
  }
  // a masked key's weight is exactly 0 and adds exactly nothing, so every key runs the same loop; one head
  // alone sums even and odd keys apart, which keeps as many multiply-adds in flight as G heads do
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
        const Lanes value = load_weights(values + (j + u) * value_stride + v * kLanes);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) acc[u][g][v] = lanes_fma(value, weight[g], acc[u][g][v]);
      }
    }
  }
  for (; j < kv; ++j) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const Lanes value = load_weights(values + j * value_stride + v * kLanes);
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

// sums[h][v] += the HC heads' weight pairs times the values' pairs, over the keys [0, kv): two keys per
// vdpbf16ps, each pair of value rows interleaved once for all HC heads; an odd last key pairs with zeros
template <int NV, int HC>
void accumulate_value_pairs(const uint16_t* values, int64_t value_stride, int64_t kv, const uint32_t* weight_pairs,
                            int64_t pairs_per_head, __m512* sums) {
  __m512 acc[HC][NV];
#pragma GCC unroll 4
  for (int h = 0; h < HC; ++h)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_setzero_ps();
  __m512i pairs[NV];
  const int64_t even_end = kv - kv % 2;
  for (int64_t j = 0; j < even_end; j += 2) {
    value_pairs<NV>(values + j * value_stride, values + (j + 1) * value_stride, pairs);
#pragma GCC unroll 4
    for (int h = 0; h < HC; ++h) {
      const __m512bh weight = (__m512bh)_mm512_set1_epi32(weight_pairs[h * pairs_per_head + j / 2]);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_dpbf16_ps(acc[h][v], (__m512bh)pairs[v], weight);
    }
  }
  if (even_end < kv) {
    alignas(64) uint16_t zeros[NV * 16] = {};
    value_pairs<NV>(values + even_end * value_stride, zeros, pairs);
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
void accumulate_heads(const uint16_t* values, int64_t value_stride, int64_t kv, const uint32_t* weight_pairs,
                      int64_t pairs_per_head, __m512* sums) {
  if constexpr (First < G) {
    constexpr int kAtOnce = NV <= 4 ? 4 : 2;
    constexpr int kCount = G - First < kAtOnce ? G - First : kAtOnce;
    accumulate_value_pairs<NV, kCount>(values, value_stride, kv, weight_pairs + First * pairs_per_head,
                                       pairs_per_head, sums + First * NV);
    accumulate_heads<NV, G, First + kCount>(values, value_stride, kv, weight_pairs, pairs_per_head, sums);
  }
}

// One query row of G query heads that read the same KV head, bf16 on the AVX512_BF16 build, head_dim
// NV x 16 (64 or 128): attend_heads' result to bf16 rounding, in fewer instructions. Its multiply-adds had
// bound it (one per 16 values of a value row per head, each key alone): here 16 keys' scores come out of
// one vector reduction and are scaled and masked 16 at a time, and the weights, rounded to bf16 (as
// transformers' eager attention and ATen's flash attention round them before their products with the
// values), multiply two value rows per vdpbf16ps. `scores` [G, kv] and `weight_pairs` [G, kv / 2 + 1]
// are scratch.
template <int NV, int G>
void attend_heads_paired(const uint16_t* const* queries, const uint16_t* keys, int64_t key_stride,
                         const uint16_t* values, int64_t value_stride, const bool* visible, int64_t kv, float scale,
                         uint16_t* const* outs, float* scores, uint32_t* weight_pairs) {
  constexpr int kPairRegisters = NV / 2;  // a row of head_dim bf16 values
  const __m512 scale_lanes = _mm512_set1_ps(scale), masked = _mm512_set1_ps(-INFINITY);
  // every key's score comes out of lanes_sum16 (a last, partial block padded with zero dots), so a key's
  // score has the same bits whatever keys follow it: a chain's verify rows equal its one-token steps
  for (int64_t j = 0; j < kv; j += 16) {
    const int count = static_cast<int>(std::min<int64_t>(16, kv - j));
    const __mmask16 present = static_cast<__mmask16>((1u << count) - 1);
    __mmask16 seen = present;
    if (visible != nullptr && count == 16) {
      seen = _mm512_test_epi32_mask(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(visible + j))),
                                    _mm512_set1_epi32(1));
    } else if (visible != nullptr) {
      seen = 0;
      for (int k = 0; k < count; ++k) seen |= static_cast<__mmask16>(visible[j + k] ? 1u << k : 0u);
    }
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
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(keys + (j + k) * key_stride + 32 * v),
                                   (__m512bh)row[v]);
        dots[k] = acc;
      }
      _mm512_mask_storeu_ps(scores + g * kv + j, present,
                            _mm512_mask_blend_ps(seen, masked, _mm512_mul_ps(lanes_sum16(dots), scale_lanes)));
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
  accumulate_heads<NV, G, 0>(values, value_stride, kv, weight_pairs, pairs_per_head, sums);
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

// The query heads [first, first + count) of one KV head over one row, `count` of them together where the
// head size has a vector path (count <= max_heads_together), else one at a time through attend_row. bf16
// rows of 64 or 128 dims take attend_heads_paired on the AVX512_BF16 build (SPECPIPE_ATTENTION_PAIRS=0
// builds without it); `weight_pairs` [count, kv / 2 + 1] is its scratch.
#ifndef SPECPIPE_ATTENTION_PAIRS
#define SPECPIPE_ATTENTION_PAIRS 1
#endif
template <int NV, typename T>
void attend_heads_of(int count, const T* const* queries, const T* keys, int64_t key_stride, const T* values,
                     int64_t value_stride, const bool* visible, int64_t kv, float scale, T* const* outs,
                     float* scores, uint32_t* weight_pairs) {
#if defined(__AVX512BF16__) && SPECPIPE_ATTENTION_PAIRS
  if constexpr (std::is_same_v<T, uint16_t> && (NV == 4 || NV == 8)) {
    switch (count) {
      case 4:
        return attend_heads_paired<NV, 4>(queries, keys, key_stride, values, value_stride, visible, kv, scale, outs,
                                          scores, weight_pairs);
      case 3:
        return attend_heads_paired<NV, 3>(queries, keys, key_stride, values, value_stride, visible, kv, scale, outs,
                                          scores, weight_pairs);
      case 2:
        return attend_heads_paired<NV, 2>(queries, keys, key_stride, values, value_stride, visible, kv, scale, outs,
                                          scores, weight_pairs);
    }
    for (int g = 0; g < count; ++g)
      attend_heads_paired<NV, 1>(queries + g, keys, key_stride, values, value_stride, visible, kv, scale, outs + g,
                                 scores, weight_pairs);
    return;
  }
#endif
  switch (count) {
    case 4:
      if constexpr (max_heads_together<NV, T>() >= 4)
        return attend_heads<NV, 4>(queries, keys, key_stride, values, value_stride, visible, kv, scale, outs, scores);
      break;
    case 3:
      if constexpr (max_heads_together<NV, T>() >= 3)
        return attend_heads<NV, 3>(queries, keys, key_stride, values, value_stride, visible, kv, scale, outs, scores);
      break;
    case 2:
      if constexpr (max_heads_together<NV, T>() >= 2)
        return attend_heads<NV, 2>(queries, keys, key_stride, values, value_stride, visible, kv, scale, outs, scores);
      break;
  }
  for (int g = 0; g < count; ++g)
    attend_heads<NV, 1>(queries + g, keys, key_stride, values, value_stride, visible, kv, scale, outs + g, scores);
}

// How many query heads attend together: the largest count up to the vector path's limit that divides the
// heads per KV head (so every unit of work is alike), 1 without a vector path.
template <typename T>
int heads_together(int nv, int64_t groups) {
  const int limit = nv == 4 ? max_heads_together<4, T>() : nv == 8 ? max_heads_together<8, T>()
                    : nv == 16 ? max_heads_together<16, T>() : 1;
  for (int count = std::min<int64_t>(limit, groups); count > 1; --count)
    if (groups % count == 0) return count;
  return 1;
}

// One unit of attention work: query heads [first, first + together) of one KV head over one query row
// (queries / outs: `together` row pointers), through the vector path of its head size.
template <typename Raw>
void attend_unit(int nv, int together, const Raw* const* queries, const Raw* head_keys, int64_t key_stride,
                 const Raw* head_values, int64_t value_stride, const bool* visible, int64_t kv, int64_t head_dim,
                 float scale, Raw* const* outs, float* scores, float* sums, uint32_t* weight_pairs) {
  switch (nv) {
    case 4:
      return attend_heads_of<4>(together, queries, head_keys, key_stride, head_values, value_stride, visible, kv,
                                scale, outs, scores, weight_pairs);
    case 8:
      return attend_heads_of<8>(together, queries, head_keys, key_stride, head_values, value_stride, visible, kv,
                                scale, outs, scores, weight_pairs);
    case 16:
      return attend_heads_of<16>(together, queries, head_keys, key_stride, head_values, value_stride, visible, kv,
                                 scale, outs, scores, weight_pairs);
    default:
      attend_row(queries[0], head_keys, key_stride, head_values, value_stride, visible, kv, head_dim, scale, outs[0],
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
                  value_stride, mask != nullptr ? mask + r * kv : nullptr, kv, head_dim, scale, outs, scores.data(),
                  sums.data(), weight_pairs.data());
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
  for (int64_t b = 0; b < sequences; ++b) {
    first_unit[b + 1] = first_unit[b] + kv_heads * chunks * (starts[b + 1] - starts[b]);
    longest = std::max<int64_t>(longest, keys[b].size(2));
  }
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
      const int64_t row = starts[b] + r, kv = keys[b].size(2);
      for (int i = 0; i < together; ++i) {
        queries[i] = query_data + (first + i) * query.stride(1) + row * query.stride(2);
        outs[i] = out_data + (row * heads + first + i) * head_dim;
      }
      const Raw* key_data = reinterpret_cast<const Raw*>(keys[b].data_ptr<T>());
      const Raw* value_data = reinterpret_cast<const Raw*>(values[b].data_ptr<T>());
      attend_unit(nv, together, queries, key_data + g * keys[b].stride(1), keys[b].stride(2),
                  value_data + g * values[b].stride(1), values[b].stride(2),
                  masks[b] != nullptr ? masks[b] + r * kv : nullptr, kv, head_dim, scale, outs, scores.data(),
                  sums.data(), weight_pairs.data());
    }
  });
}

}  // namespace

// Attention of a decoding step or a tree verify, batch 1: query [1, heads, q, head_dim], key and value
// [1, kv_heads, kv, head_dim] (the KV cache's rows, any strides but the last), mask [q, kv] bool (True =
// attend) or None (every row sees every key) -> [1, q, heads, head_dim] in query's dtype (the layout the
// output projection reads). Sums run in fp32. SDPA spent ~29 us per layer on the 9 heads of a one-token
// step of SmolLM2-135M, and a verify's transposes and folded masks around it cost as much again.
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
    key_buffers[b].narrow(2, cached[b], q).copy_(key.narrow(2, starts[b], q));
    value_buffers[b].narrow(2, cached[b], q).copy_(value.narrow(2, starts[b], q));
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

// ---- the MLP's SiLU gate in one call ----
namespace {

// ATen's own vector exp (Vectorized<float>::exp is Sleef's, which libtorch_cpu exports): the gate must
// round as F.silu does, bit for bit. Weak: a torch that does not export it still loads the extension, and
// silu_gate then refuses to run (the load-time check says so).
#ifdef __AVX512F__
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));
inline bool has_aten_exp() { return &Sleef_expf16_u10 != nullptr; }
inline Lanes aten_exp(Lanes x) { return Sleef_expf16_u10(x); }
inline Lanes lanes_negated(Lanes x) {  // the sign bit flipped, as Vectorized<float>::neg
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}
inline Lanes lanes_div(Lanes a, Lanes b) { return _mm512_div_ps(a, b); }
// the bf16 nearest to each lane (ties to even, NaN quiet), as c10::BFloat16 rounds: as the upper halves
// of fp32 lanes
inline __m512i bf16_bits(Lanes v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7fc0));
}
inline Lanes bf16_rounded(Lanes v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
inline void store_bf16(uint16_t* p, Lanes v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}
#else
extern "C" __m256 Sleef_expf8_u10(__m256) __attribute__((weak));
inline bool has_aten_exp() { return &Sleef_expf8_u10 != nullptr; }
inline Lanes aten_exp(Lanes x) { return Sleef_expf8_u10(x); }
inline Lanes lanes_negated(Lanes x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }
inline Lanes lanes_div(Lanes a, Lanes b) { return _mm256_div_ps(a, b); }
inline __m256i bf16_bits(Lanes v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline Lanes bf16_rounded(Lanes v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }
inline void store_bf16(uint16_t* p, Lanes v) {
  const __m256i bits = bf16_bits(v);  // each below 2^16: packing saturates nothing
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}
#endif
inline Lanes rounded_as(const uint16_t*, Lanes v) { return bf16_rounded(v); }
inline Lanes rounded_as(const float*, Lanes v) { return v; }
inline void store_lanes(uint16_t* p, Lanes v) { store_bf16(p, v); }
inline void store_lanes(float* p, Lanes v) { lanes_store(p, v); }

// out[r] = silu(gate_up[r, :n]) * gate_up[r, n:], each op rounded to T as F.silu(gate) * up rounds: silu
// as ATen's vector kernel computes it (x / (1 + e^-x)), then the product. Units of 256 values spread over
// the threads (ATen runs such a gate on one thread below 32768 values).
template <typename T>
void gate_rows(const T* gate_up, T* out, int64_t rows, int64_t n) {
  constexpr int64_t kUnit = 256;
  const int64_t units_per_row = (n + kUnit - 1) / kUnit;
  at::parallel_for(0, rows * units_per_row, 2048 / kUnit, [&](int64_t begin, int64_t end) {
    const Lanes one = lanes_set(1.0f);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t r = unit / units_per_row, start = (unit % units_per_row) * kUnit;
      const int64_t stop = std::min(n, start + kUnit);
      const T* gate = gate_up + r * 2 * n;
      const T* up = gate + n;
      for (int64_t i = start; i < stop; i += kLanes) {
        const Lanes g = load_weights(gate + i);
        const Lanes silu = rounded_as(gate, lanes_div(g, lanes_add(one, aten_exp(lanes_negated(g)))));
        store_lanes(out + r * n + i, lanes_mul(silu, load_weights(up + i)));
      }
    }
  });
}

}  // namespace

// gate_up [..., 2n] fp32 or bf16, contiguous -> silu(gate) * up [..., n] in its dtype, bitwise F.silu(gate) *
// up where ATen runs that silu wholly in vectors (n a multiple of its two-vector step; checked when the
// kernel loads): the lean MLP's two elementwise ops, ~10 us each on one thread for a 9-row verify of
// SmolLM2-135M, in one pass over both threads.
torch::Tensor silu_gate(torch::Tensor gate_up) {
  const auto dtype = gate_up.scalar_type();
  TORCH_CHECK(has_aten_exp(), "this torch does not export Sleef's vector exp, which ATen's silu uses");
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "gate_up: fp32 or bf16");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.is_contiguous() && gate_up.size(-1) % (2 * kLanes) == 0,
              "gate_up: contiguous [..., 2n], n a multiple of ", kLanes);
  const int64_t n = gate_up.size(-1) / 2, rows = n ? gate_up.numel() / (2 * n) : 0;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = n;
  auto out = torch::empty(sizes, gate_up.options());
  if (dtype == torch::kBFloat16)
    gate_rows(reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>()),
              reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), rows, n);
  else
    gate_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, n);
  return out;
}

// ---- a draft head's decoder layer in one call (AVX512_BF16, weights in column blocks) ----
// A Llama decoder layer over bf16 rows: x + attention(norm(x)), then + the SiLU-gated MLP of its norm, with
// every product over column blocks, the norms and the attention above, and the rotary embedding, the cache
// writes, the residual adds and the SiLU gate inline. Each elementwise op rounds to bf16 as torch's bf16 ops
// do; the SiLU gate is silu_gate's (ATen's vector exp) where the intermediate size is a multiple of the
// vector, else the C library's exp, which may differ from transformers' by a bf16 step now and then: this
// serves a draft head's layers (an EAGLE head), whose drafts the target verifies, never the target's own. Why: a level of the embedded model's bf16 EAGLE head spent
// ~0.3 ms of ~0.6 in ~100 small torch ops and their Python around ~0.3 ms of products and attention.
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
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() && key_cache.size(0) == 1 &&
              key_cache.size(1) == kv_heads && key_cache.size(3) == head_dim && key_cache.size(2) >= length + q &&
              key_cache.is_contiguous() && value_cache.is_contiguous() &&
              key_cache.scalar_type() == torch::kBFloat16 && value_cache.scalar_type() == torch::kBFloat16,
              "key_cache, value_cache: contiguous bf16 [1, kv_heads, capacity >= length + q, head_dim]");
  const int64_t rotated = heads + kv_heads, half = head_dim / 2;
  auto normed = input_norm.has_value() ? rms_norm(hidden, *input_norm, eps) : hidden;
  auto qkv = blocks_times(normed, blocks[0], (rotated + kv_heads) * head_dim, scales[0], biases[0], true);
  // rotary embedding of the q and k heads (x * cos + rotate_half(x) * sin: each product and the sum rounded),
  // the queries into `query` [1, heads, q, head_dim], the keys and values into the cache's rows
  auto query = torch::empty({1, heads, q, head_dim}, hidden.options());
  const at::BFloat16* qkv_data = qkv.data_ptr<at::BFloat16>();
  const at::BFloat16* cos_data = cos.data_ptr<at::BFloat16>();
  const at::BFloat16* sin_data = signed_sin.data_ptr<at::BFloat16>();
  at::BFloat16* query_data = query.data_ptr<at::BFloat16>();
  at::BFloat16* keys = key_cache.data_ptr<at::BFloat16>();
  at::BFloat16* values = value_cache.data_ptr<at::BFloat16>();
  const int64_t capacity = key_cache.size(2);
  for (int64_t r = 0; r < q; ++r) {
    const at::BFloat16* row = qkv_data + r * (rotated + kv_heads) * head_dim;
    const at::BFloat16* c = cos_data + r * head_dim;
    const at::BFloat16* s = sin_data + r * head_dim;
    for (int64_t h = 0; h < rotated; ++h) {
      const at::BFloat16* x = row + h * head_dim;
      at::BFloat16* out = h < heads ? query_data + (h * q + r) * head_dim
                                    : keys + ((h - heads) * capacity + length + r) * head_dim;
      for (int64_t i = 0; i < head_dim; ++i) {
        const float turned = widen(x[i < half ? i + half : i - half]);
        out[i] = rounded(widen(rounded(widen(x[i]) * widen(c[i]))) + widen(rounded(turned * widen(s[i]))));
      }
    }
    for (int64_t h = 0; h < kv_heads; ++h)
      std::memcpy(values + (h * capacity + length + r) * head_dim, row + (rotated + h) * head_dim,
                  head_dim * sizeof(at::BFloat16));
  }
  const bool* mask_data = nullptr;
  torch::Tensor mask_rows;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->dim() == 2 && mask->size(0) == q &&
                mask->size(1) == length + q, "mask: bool [q, length + q]");
    mask_rows = mask->contiguous();
    mask_data = mask_rows.data_ptr<bool>();
  }
  auto attended = torch::empty({1, q, heads, head_dim}, hidden.options());
  attend<at::BFloat16, uint16_t>(query, key_cache.narrow(2, 0, length + q), value_cache.narrow(2, 0, length + q),
                                 mask_data, static_cast<float>(scale), attended);
  auto x = bf16_add(hidden, blocks_times(attended.view({q, heads * head_dim}), blocks[1], width, scales[1], biases[1], true));
  auto gate_up = blocks_times(rms_norm(x, post_norm, eps), blocks[2], 2 * intermediate, scales[2], biases[2], true);
  if (intermediate % kLanes == 0 && has_aten_exp())  // ATen's vector exp, over both threads
    return bf16_add(x, blocks_times(silu_gate(gate_up), blocks[3], width, scales[3], biases[3], true));
  auto gated = torch::empty({q, intermediate}, hidden.options());
  const at::BFloat16* gate_up_data = gate_up.data_ptr<at::BFloat16>();
  at::BFloat16* gated_data = gated.data_ptr<at::BFloat16>();
  for (int64_t r = 0; r < q; ++r)
    for (int64_t i = 0; i < intermediate; ++i) {
      const float gate = widen(gate_up_data[r * 2 * intermediate + i]);
      const at::BFloat16 silu = rounded(gate / (1.0f + std::exp(-gate)));
      gated_data[r * intermediate + i] = rounded(widen(silu) * widen(gate_up_data[(r * 2 + 1) * intermediate + i]));
    }
  return bf16_add(x, blocks_times(gated, blocks[3], width, scales[3], biases[3], true));
#else
  TORCH_CHECK(false, "block_decoder_layer needs the kernel's AVX512_BF16 build");
  return hidden;
#endif
}

// One level of a draft in one call: an EAGLE head's (the rows' token embeddings beside their features through fc) or
// a draft model's (the embeddings alone), then the decoder layers (block_decoder_layer each, in order), the draft
// model's final norm, and the output layer's log-probs of the last `logprob_rows` rows.
// Why: around the layers' own calls a level still spent ~0.1-0.2 ms in small torch ops and the Python between them
// (embedding, cat, fc, the rotary lookup, the cache's bookkeeping, the head, the log-softmax; docs/BENCHMARKS.md
// run 71). Every op here is the one the op-by-op path runs (ATen's embedding, cat, index_select and log_softmax,
// rms_norm, blocks_times' sums, the same for any number of rows), so an EAGLE level's outputs are bitwise those of
// that path (BlockLayers' layer calls), and a draft model's those of BlockLayers over its layers.
// token_ids [q] int64, embedding [vocab, width] bf16; an EAGLE head: features [q, width] bf16 and fc's column
// blocks of [width, 2 width] with scale and bias [width] fp32 or None; a draft model: features and fc_blocks None.
// cos_table, signed_sin_table [n, head_dim] bf16 (rotary_tables' rows of positions 0 .. n - 1), positions [q]
// int64 < n. Per layer l: input_norms[l], post_norms[l], blocks, scales and biases [4 l .. 4 l + 3], key_caches[l],
// value_caches[l] as block_decoder_layer takes them, every layer writing rows length .. length + q - 1.
// final_norm [width] bf16 or None (eps as the layers'). head: column blocks of [head_features, width], scale and
// bias [head_features] fp32 or None. -> {hidden [q, width] bf16 (after final_norm), log-probs [logprob_rows,
// head_features] fp32}.
std::vector<torch::Tensor> block_draft_level(
    torch::Tensor token_ids, c10::optional<torch::Tensor> features, torch::Tensor embedding,
    c10::optional<torch::Tensor> fc_blocks, c10::optional<torch::Tensor> fc_scale,
    c10::optional<torch::Tensor> fc_bias, torch::Tensor cos_table, torch::Tensor signed_sin_table,
    torch::Tensor positions, std::vector<c10::optional<torch::Tensor>> input_norms,
    std::vector<torch::Tensor> post_norms, double eps, std::vector<torch::Tensor> blocks,
    std::vector<c10::optional<torch::Tensor>> scales, std::vector<c10::optional<torch::Tensor>> biases,
    int64_t heads, int64_t kv_heads, int64_t intermediate, std::vector<torch::Tensor> key_caches,
    std::vector<torch::Tensor> value_caches, int64_t length, c10::optional<torch::Tensor> mask, double scale,
    c10::optional<torch::Tensor> final_norm, torch::Tensor head_blocks, int64_t head_features,
    c10::optional<torch::Tensor> head_scale, c10::optional<torch::Tensor> head_bias, int64_t logprob_rows) {
  const size_t layers = post_norms.size();
  TORCH_CHECK(layers >= 1 && input_norms.size() == layers && blocks.size() == 4 * layers &&
              scales.size() == 4 * layers && biases.size() == 4 * layers && key_caches.size() == layers &&
              value_caches.size() == layers, "one input norm, post norm, key cache and value cache per layer, and "
              "four blocks, scales and biases per layer");
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
  TORCH_CHECK(logprob_rows >= 1 && logprob_rows <= q, "logprob_rows: from 1 to q");
  auto hidden = at::embedding(embedding, token_ids);  // [q, width]
  if (fc_blocks.has_value())
    hidden = blocks_times(torch::cat({hidden, *features}, 1), *fc_blocks, width, fc_scale, fc_bias, true);
  const auto cos = cos_table.index_select(0, positions), signed_sin = signed_sin_table.index_select(0, positions);
  for (size_t l = 0; l < layers; ++l) {
    std::vector<torch::Tensor> layer_blocks(blocks.begin() + 4 * l, blocks.begin() + 4 * l + 4);
    std::vector<c10::optional<torch::Tensor>> layer_scales(scales.begin() + 4 * l, scales.begin() + 4 * l + 4);
    std::vector<c10::optional<torch::Tensor>> layer_biases(biases.begin() + 4 * l, biases.begin() + 4 * l + 4);
    hidden = block_decoder_layer(hidden, input_norms[l], post_norms[l], eps, layer_blocks, layer_scales,
                                 layer_biases, heads, kv_heads, intermediate, cos, signed_sin, key_caches[l],
                                 value_caches[l], length, mask, scale);
  }
  if (final_norm.has_value()) hidden = rms_norm(hidden, *final_norm, eps);
  auto logits = blocks_times(hidden.narrow(0, q - logprob_rows, logprob_rows), head_blocks, head_features,
                             head_scale, head_bias, true);  // [logprob_rows, head_features] bf16
  return {hidden, at::log_softmax(logits.to(torch::kFloat), -1)};
}
"""


# What the norm serves: a single row of ATen's grain size (32768) or more is summed by ATen in two
# passes over threads, an order the norm does not repeat; every released LLM's hidden size is below this.
NORM_MAX_WIDTH = 16384
NORM_DTYPES = (torch.float32, torch.bfloat16)

# -ffp-contract=off: no multiply and add fused into one rounding behind the source's back (the norm
# rounds like torch's separate ops; the product's FMAs are written out)
_CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
# The instruction sets the product is built for: 16-lane vectors where ATen itself runs AVX-512, else
# 8-lane AVX2 (ATEN_CPU_CAPABILITY=avx2 holds both back, so one variable tests the AVX2 build on any CPU).
ISA_FLAGS = {"avx2": ("-mavx2", "-mfma", "-mf16c"), "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f"),
             "avx512_bf16": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512bf16")}
# engine.weight_prefetch: the cache hint of the product's software prefetch of the weights (see the source)
WEIGHT_PREFETCH_HINTS = {"nta": "_MM_HINT_NTA", "t0": "_MM_HINT_T0"}
# engine.block_lookahead_kb: at most half of a Zen 5 core's 1 MiB L2 ahead of the line it reads
MAX_BLOCK_LOOKAHEAD_KB = 512
# engine.block_lookahead_rows: the source's default, and the most rows a column-block pass takes (kBlockMaxRows)
DEFAULT_BLOCK_LOOKAHEAD_ROWS = 5
MAX_BLOCK_LOOKAHEAD_ROWS = 16
# engine.block_lookahead_rows=auto on AMX CPUs. On the 2-core AMX Xeon (family 6 model 207, 15-18 GB/s) SmolLM2-135M's
# bf16 forward with the lookahead from 1 row against from 5 (interleaved, 15 rounds, median ms): 1 / 2 / 3 / 4 rows
# 24.3 / 27.1 / 29.0 / 30.2 against 33.9 / 37.5 / 39.0 / 46.0, 5-8 rows alike, logits bitwise equal. Its own
# prefetchers keep too few lines in flight for a one-row pass; on the Zen 5 EPYC they keep enough and the
# lookahead made 1-4 rows 3-13% slower, so other CPUs keep the source's 5. The row-by-row product (fp32 weights) on the
# AMX Xeon, interleaved, 12 rounds: 1 / 2 / 4 / 6 / 8 rows 31.0 / 32.3 / 35.1 / 39.9 / 41.3 ms from 1 row against
# 62.6 / 60.1 / 51.9 / 58.4 / 69.3 without the lookahead (its fp32 oneDNN kernel: 72.8 / 47.6 / 54.7 at 1 / 4 / 8).
AUTO_AMX_BLOCK_LOOKAHEAD_ROWS = 1


def auto_block_lookahead_rows() -> int:
    """engine.block_lookahead_rows=auto: from 1 row on CPUs with AMX tiles, from 5 elsewhere (see the constants)."""
    return AUTO_AMX_BLOCK_LOOKAHEAD_ROWS if "amx_bf16" in cpu_flags() else DEFAULT_BLOCK_LOOKAHEAD_ROWS


# engine.amx_rows=auto on CPUs with AMX tiles: a branched tree's verify runs its column blocks' products of this many
# rows and more on the tiles (TileRows). On the 2-core AMX Xeon, SmolLM2-135M's bf16 linears alone: 1 / 2 / 4 / 8 / 12
# rows 16.2 / 14.8 / 14.8 / 15.3 / 16.4 ms on the tiles against 11.6 / 10.9 / 13.1 / 16.8 / 23.7 by the vector
# product. Its whole forward over two-branch trees, tiles from that many rows against none (bench/engine_ab.py --tree
# branched, interleaved): 6 rows 1.07x and 1.02x in two runs, 7 rows 0.97x, 8 rows 0.96x and 0.96x, 10 rows 0.91x,
# 12 rows 0.80x (docs/BENCHMARKS.md run 65).
AUTO_AMX_ROWS = 7


def auto_amx_rows() -> int:
    """engine.amx_rows=auto: AUTO_AMX_ROWS where the CPU has AMX tiles, else 0 (never, and nothing to warn about)."""
    return AUTO_AMX_ROWS if "amx_bf16" in cpu_flags() else 0


def kernel_isa() -> str:
    """Which build of the kernel this machine gets: where the CPU has AVX-512F and ATen's own kernels run
    AVX-512 (not held back by ATEN_CPU_CAPABILITY), 'avx512_bf16' if it also has AVX512_BF16 (pair products
    of bf16 values), else 'avx512'; 'avx2' elsewhere."""
    flags = cpu_flags()
    if "avx512f" not in flags or not aten_capability().startswith("AVX512"):
        return "avx2"
    return "avx512_bf16" if {"avx512bw", "avx512_bf16"} <= flags else "avx512"


class TileRows:
    """From how many rows the column blocks' products run on AMX tiles: `min_rows` inside `permitted()`, never outside.

    The tiles' fp32 sums are not bitwise the vector product's (docs/BENCHMARKS.md run 64), so a forward whose rows must
    give bitwise a one-token step's bf16 logits keeps the vector product: a chain's verify, which is how a bf16
    pipeline that drafts chains emits exactly `vanilla`'s tokens. A branched tree's verify cannot promise that anyway
    (its attention's sums depend on where a row's ancestors sit in the block, run 57), so the target permits the tiles
    there (specpipe.target.TargetModel.forward_tree). The permission is per thread: requests decoded in parallel
    threads share one model."""

    def __init__(self, min_rows: int) -> None:
        self.min_rows = min_rows
        self._local = threading.local()

    def rows(self) -> int:
        """`min_rows` where this thread's forward may take the tiles, else 0 (never)."""
        return self.min_rows if getattr(self._local, "permitted", False) else 0

    @contextlib.contextmanager
    def permitted(self) -> Iterator[None]:
        before = getattr(self._local, "permitted", False)
        self._local.permitted = True
        try:
            yield
        finally:
            self._local.permitted = before


class BlockProduct(NamedTuple):
    """The kernel's product over weights in column blocks (its AVX512_BF16 build): `pack(weight [out, in] bf16)`
    or `pack_int8(codes [out, in] int8)` -> the blocks (once per weight), `product(x [..., in] bf16, blocks, out,
    scale [out] fp32 or None, bias [out] fp32 or None)` -> [..., out] bf16 (int8 codes take their scale). Each
    row's output is the same whatever rows come with it. `decoder_layer`: a draft head's whole Llama decoder
    layer over such weights in one call (the source's block_decoder_layer; specpipe.engine.lean_model.BlockLayers).
    `draft_level`: an EAGLE head's whole level (fc, its decoder layers, its output layer's log-probs) in one call (the
    source's block_draft_level; specpipe.engine.lean_model.KernelDraftLevel)."""

    pack: Callable[[torch.Tensor], torch.Tensor]
    pack_int8: Callable[[torch.Tensor], torch.Tensor]
    product: Callable[..., torch.Tensor]
    decoder_layer: Callable[..., torch.Tensor] | None = None
    draft_level: Callable[..., list[torch.Tensor]] | None = None


class CpuKernel:
    """Loads (building it once per machine) the weight product, and the RMSNorm and the decoding
    attention beside it; `product` is None and `reason` says why where they are not available, `norm`
    is None (and `norm_reason` says why) where the norm is not bitwise torch's on this machine,
    `attention` is None (and `attention_reason` says why) where it disagrees with SDPA, `gate` is None (and
    `gate_reason` says why) where it is not bitwise F.silu(gate) * up here. One instance per engine apply:
    nothing is kept at module level."""

    def __init__(self, build_dir: Path | None = None, weight_prefetch: str = "nta", block_lookahead_kb: int = 32,
                 attention_pairs: bool = True, block_lookahead_rows: int = DEFAULT_BLOCK_LOOKAHEAD_ROWS,
                 amx_rows: int = 0) -> None:
        self.product = None
        # gguf_product(x [..., in], blocks [out, in / block values * block bytes] uint8, format, in, bias [out] fp32 or
        # None) -> [..., out]: the product over weights in GGUF blocks (gguf_weights.NATIVE_FORMATS), widened in
        # registers as gguf-py dequantizes them; gguf_widen(blocks, format, in) -> the fp32 weights [out, in]. Set and
        # cleared with `product`
        self.gguf_product = None
        self.gguf_widen = None
        # quantized_product(x [..., in], weight [out, in] int8, scale [out] fp32, bias [out] fp32 or None) ->
        # [..., out]: the product over int8 weights (specpipe.engine.quantize); set and cleared with `product`
        self.quantized_product = None
        self.blocks: BlockProduct | None = None  # bf16 weights in column blocks: the AVX512_BF16 build only
        # with `amx_rows` > 0: whether the blocks' products of that many rows and more run on AMX tiles
        # (amx_block_product) inside `tiles.permitted()`, and if not, why
        self.amx = False
        self.amx_reason = ""
        self.tiles: TileRows | None = None
        self.norm = None  # norm(x [..., n], weight [n], eps) -> [..., n], as LlamaRMSNorm computes it
        # attention(query [1, heads, q, hd], key, value [1, kv_heads, kv, hd], mask [q, kv] bool or None,
        # scale) -> [1, q, heads, hd]: a decoding step's or a tree verify's attention (fp32 sums)
        self.attention = None
        # ragged_attention(...): `attention` for several sequences' rows of one forward, each appended to and
        # attending its own cache (the C++ ragged_tree_attention; set and cleared with `attention`)
        self.ragged_attention = None
        # gate(gate_up [..., 2n]) -> [..., n]: silu(gate) * up, bitwise torch's where `serves_gate` says so
        self.gate = None
        self.reason = ""
        self.norm_reason = ""
        self.attention_reason = ""
        self.gate_reason = ""
        self.isa = kernel_isa()
        # which build of the source: part of the engine's description, so a cost curve measured with
        # another version of the kernel (or another ISA's build) is not reused
        self.build = build_name(self.isa, weight_prefetch, block_lookahead_kb, attention_pairs, block_lookahead_rows)
        if platform.machine().lower() not in ("x86_64", "amd64"):
            self.reason = f"specpipe's CPU kernel is for x86 CPUs, this is {platform.machine()}"
            return
        if not {"avx2", "fma"} <= cpu_flags():
            self.reason = "this CPU has no AVX2/FMA for specpipe's CPU kernel"
            return
        try:
            module = _build(build_dir, self.isa, weight_prefetch, block_lookahead_kb, attention_pairs,
                            block_lookahead_rows)
            self.product, self.quantized_product = module.weight_product, module.quantized_product
            self.gguf_product, self.gguf_widen = module.gguf_product, module.gguf_widen
            if self.isa == "avx512_bf16":
                self.blocks = BlockProduct(module.pair_blocks, module.int8_pair_blocks, module.block_product,
                                           module.block_decoder_layer, module.block_draft_level)
            _self_check(self.product, self.quantized_product, self.blocks)
            _gguf_check(self.gguf_product, self.gguf_widen)
            if amx_rows > 0:
                self._take_amx(module, amx_rows)
        except native_cache.UnsafeFolder as error:  # said whole: the folder and the fix
            self.product = self.quantized_product = self.blocks = None
            self.reason = f"specpipe's CPU kernel is not built or loaded: {error}"
            return
        except Exception as error:  # a missing compiler or ninja, a failed build: engine=fast goes on without it
            self.product = self.quantized_product = self.blocks = self.gguf_product = self.gguf_widen = None
            self.reason = f"specpipe's CPU kernel could not be built or run ({_first_line(error)[:300]})"
            return
        # The norm repeats torch's order of sums (ATen's AVX2 cascade sum): where this torch sums in
        # another order, it would round differently from transformers' norm, so it is checked here
        mismatch = _norm_mismatch(module.rms_norm)
        if mismatch:
            self.norm_reason = f"its RMSNorm is not bitwise torch's here ({mismatch})"
        else:
            self.norm = module.rms_norm
        mismatch = _attention_mismatch(module.tree_attention) or _ragged_mismatch(module.ragged_tree_attention,
                                                                                  module.tree_attention)
        if mismatch:
            self.attention_reason = f"its attention disagrees with SDPA here ({mismatch})"
        else:
            self.attention = module.tree_attention
            self.ragged_attention = module.ragged_tree_attention
        try:
            mismatch = _gate_mismatch(module.silu_gate)
        except RuntimeError as error:  # e.g. a torch without Sleef's exp among its symbols
            mismatch = _first_line(error)[:200]
        if mismatch:
            self.gate_reason = f"its SiLU gate is not bitwise torch's here ({mismatch})"
        else:
            self.gate = module.silu_gate


    def _take_amx(self, module, min_rows: int) -> None:
        """The blocks' products of `min_rows` rows and more on AMX tiles, inside `self.tiles.permitted()`, where this
        CPU has them, Linux grants them and they pass the check."""
        if self.blocks is None:
            self.amx_reason = f"AMX tiles multiply the column blocks, which the kernel's {self.isa} build lacks"
        elif "amx_bf16" not in cpu_flags():
            self.amx_reason = "this CPU has no AMX tiles"
        elif not module.amx_request():
            self.amx_reason = "Linux did not grant this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
        else:
            def tiles_from(rows: int):  # BlockProduct.product's signature, the tiles from `rows` rows
                return lambda x, blocks, out_features, scale, bias: module.amx_block_product(
                    x, blocks, out_features, scale, bias, rows)

            mismatch = _amx_mismatch(tiles_from(1), self.blocks)
            if mismatch:
                self.amx_reason = f"its AMX product disagrees with the column blocks' here ({mismatch})"
            else:
                tiles, vector_product = TileRows(min_rows), self.blocks.product

                def tiles_where_permitted(x, blocks, out_features, scale, bias):
                    rows = tiles.rows()
                    if rows == 0:
                        return vector_product(x, blocks, out_features, scale, bias)
                    return module.amx_block_product(x, blocks, out_features, scale, bias, rows)

                self.blocks = self.blocks._replace(product=tiles_where_permitted)
                self.tiles = tiles
                self.amx = True


def build_flags(isa: str, weight_prefetch: str = "nta", block_lookahead_kb: int = 32,
                attention_pairs: bool = True, block_lookahead_rows: int = DEFAULT_BLOCK_LOOKAHEAD_ROWS) -> list[str]:
    """The compiler flags of one build: the ISA's, the cache hint of the product's weight prefetch, how far
    ahead the column-block product asks L2 for the weight (KiB, 0 = not) and from how many rows on, and
    whether the AVX512_BF16 build's bf16 attention multiplies bf16 weights by pairs of value rows
    (attend_heads_paired)."""
    if weight_prefetch not in WEIGHT_PREFETCH_HINTS:
        raise ValueError(f"weight_prefetch must be one of {sorted(WEIGHT_PREFETCH_HINTS)}, got {weight_prefetch!r}")
    if not (type(block_lookahead_kb) is int and 0 <= block_lookahead_kb <= MAX_BLOCK_LOOKAHEAD_KB):
        raise ValueError(f"block_lookahead_kb must be an integer from 0 to {MAX_BLOCK_LOOKAHEAD_KB}, "
                         f"got {block_lookahead_kb!r}")
    if not (type(block_lookahead_rows) is int and 1 <= block_lookahead_rows <= MAX_BLOCK_LOOKAHEAD_ROWS):
        raise ValueError(f"block_lookahead_rows must be an integer from 1 to {MAX_BLOCK_LOOKAHEAD_ROWS}, "
                         f"got {block_lookahead_rows!r}")
    rows = () if block_lookahead_rows == DEFAULT_BLOCK_LOOKAHEAD_ROWS else (
        f"-DSPECPIPE_BLOCK_LOOKAHEAD_ROWS={block_lookahead_rows}",)
    return [*_CFLAGS, *ISA_FLAGS[isa], f"-DSPECPIPE_WEIGHT_HINT={WEIGHT_PREFETCH_HINTS[weight_prefetch]}",
            f"-DSPECPIPE_BLOCK_LOOKAHEAD_BYTES={1024 * block_lookahead_kb}",
            *(() if _checked_switch("attention_pairs", attention_pairs) else ("-DSPECPIPE_ATTENTION_PAIRS=0",)), *rows]


def _checked_switch(name: str, value: bool) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def build_name(isa: str | None = None, weight_prefetch: str = "nta", block_lookahead_kb: int = 32,
               attention_pairs: bool = True, block_lookahead_rows: int = DEFAULT_BLOCK_LOOKAHEAD_ROWS) -> str:
    """The extension's name: its ISA (kernel_isa() by default), then the source's, its flags', torch's version
    and torch's installation folder in 12 hex digits. The folder: the build compiles against that torch's
    headers and links its libraries, and torch's builder rebuilt a build shared by two virtualenvs (same
    version, other include paths) at every switch between them."""
    isa = isa or kernel_isa()
    flags = " ".join(build_flags(isa, weight_prefetch, block_lookahead_kb, attention_pairs, block_lookahead_rows))
    installation = os.path.dirname(os.path.abspath(torch.__file__))
    return f"specpipe_kernel_{isa}_" + hashlib.sha1(
        (_SOURCE + flags + torch.__version__ + installation).encode()).hexdigest()[:12]


def _build(build_dir: Path | None, isa: str, weight_prefetch: str = "nta", block_lookahead_kb: int = 32,
           attention_pairs: bool = True, block_lookahead_rows: int = DEFAULT_BLOCK_LOOKAHEAD_ROWS):
    from torch.utils import cpp_extension

    from specpipe.models import cache_root

    name = build_name(isa, weight_prefetch, block_lookahead_kb, attention_pairs, block_lookahead_rows)
    # a folder of this user's alone (UnsafeFolder otherwise): a library others could put there would run here
    folder = native_cache.private_folder((build_dir or cache_root() / "kernels") / name)
    library = folder / f"{name}{_library_suffix()}"
    with _one_build_at_a_time(folder):
        if native_cache.verified(library):  # the file specpipe built, byte for byte: imported as it is
            return _import_library(name, library)
        # Anything else there is not loaded, nor linked: ninja takes outputs newer than their inputs as
        # up to date, so every output is removed and torch's builder builds from the source.
        _remove_build_outputs(folder)
        versioner = getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None)
        if versioner is not None:  # torch's record of a build by this process: without it, built again too
            versioner.entries.pop(name, None)
        # ninja from the environment's own bin folder (the `ninja` wheel) when the shell's PATH lacks it
        # (.venv/bin/python run without activating the environment), for the build only
        path = os.environ.get("PATH", "")
        bin_folder = str(Path(sys.executable).parent)
        if bin_folder not in path.split(os.pathsep):
            os.environ["PATH"] = bin_folder + os.pathsep + path if path else bin_folder
        try:
            module = cpp_extension.load_inline(
                name=name, cpp_sources=[_SOURCE], functions=["weight_product", "quantized_product", "pair_blocks", "int8_pair_blocks", "block_product", "rms_norm", "tree_attention", "ragged_tree_attention", "silu_gate", "gguf_product", "gguf_widen",
                           "block_decoder_layer", "block_draft_level", "amx_block_product", "amx_request"],
                build_directory=str(folder), extra_cflags=build_flags(isa, weight_prefetch, block_lookahead_kb, attention_pairs,
                                                                      block_lookahead_rows), extra_ldflags=["-fopenmp"],
                verbose=False)
        finally:
            os.environ["PATH"] = path
        if library.is_file():
            native_cache.record_checksum(library)  # what the next run checks before it imports this file
        return module


def _library_suffix() -> str:
    """The file suffix of the extension torch's builder links ('.so' on Linux)."""
    from torch.utils import cpp_extension

    return getattr(cpp_extension, "LIB_EXT", ".so")


def _import_library(name: str, library: Path):
    """The extension module `name` from the verified file `library`, imported as torch's builder imports
    the module it built (importlib's extension loader), without asking the builder whether to rebuild."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the CPU kernel from {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _remove_build_outputs(folder: Path) -> None:
    """Everything in a kernel build folder but the flock held around this build: the library, its record,
    objects, ninja's files, torch's lock of a killed build."""
    for entry in folder.iterdir():
        if entry.name == ".build.lock":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)


@contextlib.contextmanager
def _one_build_at_a_time(folder: Path):
    """Holds an flock on `folder/.build.lock` around the check, build or load of the kernel.

    torch marks a build in progress with a plain `lock` file. A build killed midway leaves it behind, and
    every later run then waits on it forever without a word. The flock goes away with its process, so a
    `lock` found while holding it is such a leftover: it is removed."""
    with native_cache.exclusive(folder, "the CPU kernel"):
        leftover = folder / "lock"
        if leftover.exists():
            print(f"specpipe: removing {leftover}, left by a kernel build that was killed", file=sys.stderr)
            leftover.unlink(missing_ok=True)
        yield


def _self_check(product, quantized_product, blocks: BlockProduct | None = None) -> None:
    """The built kernel against an fp32 product on awkward sizes (a vector tail, odd features, 1-33 rows),
    with fp32 and bf16 inputs and a bias, over bf16, fp32 and int8 weights, and over bf16 weights in column
    blocks where given."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 75, generator=generator).bfloat16()  # [out, in]
    bias = torch.randn(37, generator=generator)  # [out]
    codes = torch.randint(-127, 128, (37, 75), generator=generator, dtype=torch.int8)  # [out, in]
    scale = torch.rand(37, generator=generator) / 64  # [out]
    for rows in (1, 3, 7, 8, 11, 16, 19, 33):
        x = torch.randn(rows, 75, generator=generator)  # [rows, in]
        for x_rows, tolerance in ((x, 1e-4), (x.bfloat16(), 2 ** -7)):
            expected = (x_rows.float() @ codes.float().t()) * scale + bias
            quantized = quantized_product(x_rows, codes, scale, bias).float()
            if not torch.allclose(quantized, expected, rtol=tolerance, atol=1e-3):
                raise RuntimeError(f"the kernel disagrees with an fp32 product of int8 weights for {rows} "
                                   f"{x_rows.dtype} rows")
            if blocks is not None and x_rows.dtype == torch.bfloat16:
                out = blocks.product(x_rows, blocks.pack_int8(codes), codes.shape[0], scale, bias).float()
                if not torch.allclose(out, expected, rtol=tolerance, atol=1e-3):
                    raise RuntimeError(f"the kernel's column blocks disagree with an fp32 product of int8 weights "
                                       f"for {rows} bf16 rows")
        expected = x @ weight.float().t()
        if not torch.allclose(product(x, weight, None), expected, rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"the kernel disagrees with an fp32 product of bf16 weights for {rows} rows")
        if not torch.allclose(product(x, weight.float(), bias), expected + bias, rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"the kernel disagrees with an fp32 product of fp32 weights for {rows} rows")
        x = x.bfloat16()
        expected = (x.float() @ weight.float().t() + bias).bfloat16()
        if not torch.allclose(product(x, weight, bias).float(), expected.float(), rtol=2 ** -7, atol=1e-4):
            raise RuntimeError(f"the kernel disagrees with an fp32 product for {rows} bf16 rows")
        if blocks is not None:
            out = blocks.product(x, blocks.pack(weight), weight.shape[0], None, bias)
            if not torch.allclose(out.float(), expected.float(), rtol=2 ** -7, atol=1e-4):
                raise RuntimeError(f"the kernel's column blocks disagree with an fp32 product for {rows} bf16 rows")



def _gguf_check(gguf_product, gguf_widen) -> None:
    """The GGUF product's weights bitwise gguf-py's dequantization (every format it reads), its sums near an fp32
    product of them, and each row's output the same with any rows beside it."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from specpipe.engine.gguf_weights import BLOCK_VALUES, NATIVE_FORMATS, random_blocks

    generator = torch.Generator().manual_seed(3)
    codes = np.random.default_rng(3)
    for name, type_id in NATIVE_FORMATS.items():
        in_features = 2 * BLOCK_VALUES[name] + (64 if BLOCK_VALUES[name] == 32 else 0)
        raw = random_blocks(name, 37, in_features, codes)  # [out, row bytes] uint8
        blocks = torch.from_numpy(raw)
        expected = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType(type_id)))
        widened = gguf_widen(blocks, type_id, in_features)
        if not torch.equal(widened, expected):
            raise RuntimeError(f"the kernel widens {name} blocks otherwise than gguf-py dequantizes them")
        bias = torch.randn(37, generator=generator)
        x = torch.randn(11, in_features, generator=generator)
        out = gguf_product(x, blocks, type_id, in_features, bias)
        if not torch.allclose(out, x @ expected.t() + bias, rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"the kernel's product over {name} blocks disagrees with an fp32 product")
        alone = torch.cat([gguf_product(x[row:row + 1], blocks, type_id, in_features, bias) for row in range(11)])
        if not torch.equal(out, alone):
            raise RuntimeError(f"the kernel's product over {name} blocks gives a row other sums beside others")


def _amx_mismatch(amx_product, blocks: BlockProduct) -> str:
    """How the AMX product disagrees with the column blocks' (fp32 sums of bf16 products both, in the order of k,
    maybe not bitwise alike) or with itself across row counts (a row's output must not depend on the rows beside
    it); '' where it agrees. Widths of 16 pairs and more (the tiles' step), odd features, 1-33 rows, int8 blocks."""
    generator = torch.Generator().manual_seed(1)
    for out_features, in_features in ((37, 96), (16, 32), (50, 576)):
        weight = torch.randn(out_features, in_features, generator=generator).bfloat16()  # [out, in]
        bias = torch.randn(out_features, generator=generator)  # [out]
        packed = blocks.pack(weight)
        x = torch.randn(33, in_features, generator=generator).bfloat16()  # [rows, in]
        alone = torch.cat([amx_product(x[row:row + 1], packed, out_features, None, bias) for row in range(33)])
        for rows in (1, 3, 16, 19, 33):
            out = amx_product(x[:rows], packed, out_features, None, bias)  # [rows, out]
            if not torch.equal(out, alone[:rows]):
                return f"{rows} rows of {in_features} inputs differ from the same rows one at a time"
            expected = blocks.product(x[:rows], packed, out_features, None, bias)
            if not torch.allclose(out.float(), expected.float(), rtol=2 ** -7, atol=1e-3):
                gap = (out.float() - expected.float()).abs().max()
                return f"{rows} rows of {in_features} inputs: off by up to {gap:.3g}"
    codes = torch.randint(-127, 128, (37, 96), generator=generator, dtype=torch.int8)  # [out, in]
    scale = torch.rand(37, generator=generator) / 64  # [out]
    x = torch.randn(5, 96, generator=generator).bfloat16()  # [rows, in]
    packed = blocks.pack_int8(codes)
    if not torch.equal(amx_product(x, packed, 37, scale, None), blocks.product(x, packed, 37, scale, None)):
        return "int8 blocks (the column blocks' own product) differ"
    return ""


def sdpa_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> torch.Tensor:
    """What the kernel's tree_attention computes, by SDPA in fp32 over repeated KV heads: query [1, heads, q,
    hd], key, value [1, kv_heads, kv, hd], mask [q, kv] bool or None -> [1, q, heads, hd] fp32."""
    groups = query.shape[1] // key.shape[1]
    keys, values = key.repeat_interleave(groups, 1).float(), value.repeat_interleave(groups, 1).float()
    out = torch.nn.functional.scaled_dot_product_attention(
        query.float(), keys, values, attn_mask=None if mask is None else mask[None, None], scale=scale)
    return out.transpose(1, 2)


def _attention_mismatch(attention) -> str:
    """'' when the built attention agrees with SDPA (fp32 and bf16; head sizes of the vector paths and
    an odd one; a tree mask; KV rows strided as in the cache), else which case did not."""
    generator = torch.Generator().manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for head_dim, q, kv in ((64, 1, 37), (128, 3, 20), (64, 5, 9), (24, 2, 17)):
            cache = torch.randn(2, 1, 2, 64, head_dim, generator=generator).to(dtype)  # K, V [1, kv_heads, 64, hd]
            key, value = cache[0, :, :, :kv], cache[1, :, :, :kv]
            query = torch.randn(1, 6, q, head_dim, generator=generator).to(dtype) * 2
            mask = None
            if q > 1:  # the committed keys, then an ancestor mask over the new ones
                mask = torch.ones(q, kv, dtype=torch.bool)
                mask[:, kv - q:] = torch.eye(q, dtype=torch.bool) | (torch.rand(q, q, generator=generator) < 0.5).tril()
            scale = head_dim ** -0.5
            error = (attention(query, key, value, mask, scale).float() - sdpa_reference(query, key, value, mask, scale))
            if not error.abs().max() <= tolerance:
                return f"{dtype} head_dim {head_dim}, {q} rows over {kv} keys: max error {error.abs().max():.3g}"
    return ""


def _ragged_mismatch(ragged, attention) -> str:
    """'' when the ragged attention gives every sequence bitwise what `attention` gives it alone (fp32, bf16; one
    row and tree rows; caches of other lengths) and appends its rows to its buffers, else what did not."""
    generator = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        rows, cached = [1, 4, 1, 3], [9, 30, 0, 17]
        total = sum(rows)
        query = torch.randn(1, 6, total, 64, generator=generator).to(dtype)
        key, value = (torch.randn(1, 2, total, 64, generator=generator).to(dtype) for _ in range(2))
        buffers = [[torch.randn(1, 2, 48, 64, generator=generator).to(dtype) for _ in range(2)] for _ in rows]
        masks, expected, start = [], [], 0
        for (key_buffer, value_buffer), q, length in zip(buffers, rows, cached):
            end = start + q
            mask = torch.ones(q, length + q, dtype=torch.bool)
            if q > 1:
                mask[:, length:] = torch.eye(q, dtype=torch.bool) | (torch.rand(q, q, generator=generator) < 0.5).tril()
            keys = torch.cat([key_buffer[:, :, :length], key[:, :, start:end]], dim=2)
            values = torch.cat([value_buffer[:, :, :length], value[:, :, start:end]], dim=2)
            expected.append(attention(query[:, :, start:end], keys, values, mask if q > 1 else None, 0.125))
            masks.append(mask if q > 1 else torch.empty(0, dtype=torch.bool))
            start = end
        starts = [0]
        for q in rows:
            starts.append(starts[-1] + q)
        out = ragged(query, key, value, [b[0] for b in buffers], [b[1] for b in buffers], cached, starts, masks, 0.125)
        if not torch.equal(out, torch.cat(expected, dim=1)):
            return f"{dtype}: the ragged rows differ from each sequence's attention alone"
        if not torch.equal(buffers[1][0][:, :, 30:34], key[:, :, 1:5]):
            return f"{dtype}: the ragged call did not append a sequence's keys to its buffer"
    return ""


# ATen runs an elementwise op of fewer values than its grain size on one thread, each row's values in
# vector steps of two vectors (64 bf16 on AVX-512): there F.silu rounds every value as the kernel's gate
# does. Over more values, a thread's share can start mid-row, and ATen's scalar tail (std::exp, not its
# vector exp) can round a value differently.
GATE_ALIGNMENT = 64
ATEN_GRAIN_SIZE = 32768


def serves_gate(rows: int, intermediate: int) -> bool:
    """Whether CpuKernel.gate is bitwise F.silu(gate) * up for `rows` rows of `intermediate` values."""
    return intermediate % GATE_ALIGNMENT == 0 and rows * intermediate < ATEN_GRAIN_SIZE


def _gate_mismatch(gate) -> str:
    """'' when `gate` equals F.silu(gate) * up bitwise (NaN for NaN) for every bf16 value as the gate, in fp32
    and bf16, in the layout the lean MLP hands it (gate and up the halves of one product's rows), else which
    case did not."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    every_bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # [65536]
    for dtype in (torch.float32, torch.bfloat16):
        values = every_bf16.to(dtype)
        if dtype == torch.float32:  # and fp32 values between the bf16 ones
            values = torch.cat((values, torch.randn(1 << 14, generator=generator) * 8))
        for intermediate in (1536, GATE_ALIGNMENT):
            rows = (ATEN_GRAIN_SIZE - 1) // intermediate
            for start in range(0, values.numel(), rows * intermediate):
                gates = values[start:start + rows * intermediate]
                gates = torch.cat((gates, torch.zeros(-gates.numel() % intermediate, dtype=dtype)))  # whole rows
                ups = (torch.randn(gates.numel(), generator=generator) * 4).to(dtype)
                gate_up = torch.cat((gates.view(-1, intermediate), ups.view(-1, intermediate)), dim=1)
                gate_part, up = gate_up.split(intermediate, dim=-1)
                expected, got = F.silu(gate_part) * up, gate(gate_up)
                if not bool(((got == expected) | (got.isnan() & expected.isnan())).all()):
                    return f"{dtype}, {gate_up.shape[0]} rows of {intermediate}"
    return ""


def _norm_mismatch(norm) -> str:
    """'' when `norm` equals transformers' RMSNorm bitwise on widths with and without a vector tail, short
    rows (the scalar sum), the widest row the lean model hands it (several cascade levels) and a
    prefill's many rows."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    generator = torch.Generator().manual_seed(0)
    for dtype in NORM_DTYPES:
        for width, rows, scale in ((576, 1, 1.0), (576, 7, 40.0), (5, 3, 1.0), (75, 2, 1e-3), (4096, 2, 3.0),
                                   (NORM_MAX_WIDTH, 1, 1.0), (64, 400, 2.0)):
            x = (torch.randn(rows, width, generator=generator) * scale).to(dtype)  # [rows, width]
            reference = LlamaRMSNorm(width, eps=1e-5)
            reference.weight.data = (torch.rand(width, generator=generator) * 2).to(dtype)  # [width]
            with torch.no_grad():
                expected = reference(x)
            if not torch.equal(norm(x, reference.weight.data, 1e-5), expected):
                return f"{dtype} width {width}, {rows} rows"
    return ""
