// specpipe's CPU kernel, the row-by-row weight product: out = x w^T (+ bias) for the few rows of a decoding step or a
// tree verify, over weights [out, in] in bf16, fp32 or int8 (with one scale per row, specpipe.engine.quantize), summed
// in fp32, the output in x's dtype (weight_product, quantized_product).
//
// Why: on CPUs whose oneDNN has no bf16 kernel (AVX2 without AVX-512 BW/VL/DQ or AVX-NE-CONVERT) bf16 F.linear has no
// fast path for more than one row and an fp32 copy of the weights streams twice the bytes; where oneDNN's fp32 kernel
// is AVX2, it and split GEMMs read the weights well below the memory's speed for a few rows. Here the weights stream
// once, as stored: bf16 widened to fp32 in registers (or, on AVX512_BF16 builds, multiplied in pairs with bf16 rows),
// one fused multiply-add per weight and row; each thread runs every group of rows over a tile of weight rows while it
// is in cache, and asks for each weight a few rows ahead. specpipe.engine.cpu.auto_kernel_rows says for how many rows
// each CPU class takes it. Sums run in another order than oneDNN's, so outputs differ from its by float rounding.
// A part of kernel.cpp's one translation unit (see there).

#pragma once

#include "lanes.h"

namespace {

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
// widened copy of x.
struct PairStep {
  using X = uint16_t;
  static constexpr int kValues = 32;
  static __m512i weights(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static Lanes multiply_add(Lanes acc, __m512i weights, const uint16_t* x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)weights, (__m512bh)_mm512_loadu_si512(x));
  }
};

// Pairs over int8 weights: 32 of them made bf16 in registers (exact: every int8 is a bf16), then multiplied
// as PairStep's (widening bf16 x to fp32 instead was slower).
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
// the same offset that many rows on): the hardware prefetcher alone left a pass of 4-8 rows waiting on
// memory (8 fp32 rows over SmolLM2-135M's linears 26.5 -> 14.5 ms; docs/notebook/run-24.md).
constexpr int64_t kPrefetchRows = 2;
// The column blocks' prefetch (block_product): lines ahead in each block it reads. 8 and 16 measured alike.
constexpr int64_t kBlockPrefetchLines = 16;
// The lookahead (engine.block_lookahead_kb; 0 = none) of the column blocks' product and of the row-by-row one
// (product_block): from kBlockLookaheadRows rows on (engine.block_lookahead_rows), each step also asks L2 for the
// weight this many bytes on. With fewer rows the memory alone can be the limit, and a thread's last
// kBlockLookaheadBytes of each weight are then read for nothing; where a CPU's own prefetchers keep too few lines in
// flight for one row it pays from one row on (specpipe.engine.cpu_kernel.auto_block_lookahead_rows).
// 32 KiB: 8-16 bf16 rows in 11-21% less time, 16 KiB half that gain, 64-128 KiB no more (docs/notebook/run-59.md).
#ifndef SPECPIPE_BLOCK_LOOKAHEAD_BYTES
#define SPECPIPE_BLOCK_LOOKAHEAD_BYTES 32768
#endif
constexpr int64_t kBlockLookaheadBytes = SPECPIPE_BLOCK_LOOKAHEAD_BYTES;
#ifndef SPECPIPE_BLOCK_LOOKAHEAD_ROWS
#define SPECPIPE_BLOCK_LOOKAHEAD_ROWS 5
#endif
constexpr int kBlockLookaheadRows = SPECPIPE_BLOCK_LOOKAHEAD_ROWS;

// The prefetch's cache hint (set by the build's flags: engine.weight_prefetch). A weight is read once per
// forward, and _MM_HINT_T0 let the weights a forward streams evict everything else from L2 and L3: the KV
// cache, the activations, a draft head's weights, the interpreter's own data. With _MM_HINT_NTA they stay
// (decoding 2-8% faster; docs/notebook/run-28.md).
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
          // after another; past the weight's end, lines that go unused)
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
// the tile. Three features at a time made a single pass of 7-8 rows slower, and one pass of 13-16 rows was
// slower than two.
// 12 rows: 9-12 bf16 rows in 15-18% less time than in groups of up to 8 (docs/notebook/run-30.md).
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

// Row-invariant groups (invariant_weight_product, engine.batch_invariant): the same accumulators per row whatever
// the group's size (4 in 32 registers, 2 in 16), so each row's sum runs over k in the order a row alone gets; groups
// of up to 7 rows, as many as fit beside the weight vector and x. The chains come from slices of k, not from several
// output features at a time: each feature's weight row is a stream of its own, and one row's step waited on them
// (docs/notebook/run-77.md).
template <typename Step>
struct InvariantRowGroups {
  static constexpr int64_t kMaxRows = 7;
  template <int R>
  static constexpr int accumulators() { return kRegisters == 32 ? 4 : 2; }
  template <int R>
  static constexpr int outputs() { return 1; }
};

// Rows [x, x + count) of the product for output features [begin, end), count <= Groups::kMaxRows.
template <typename Step, typename Groups, int R = 1, typename W, typename Out>
void product_rows(int64_t count, const typename Step::X* x, const W* w, Epilogue epilogue, Out* out, int64_t in,
                  int64_t out_stride, int64_t begin, int64_t end) {
  if constexpr (R < Groups::kMaxRows) {
    if (count != R)
      return product_rows<Step, Groups, R + 1>(count, x, w, epilogue, out, in, out_stride, begin, end);
  }
  product_block<Step, R, Groups::template accumulators<R>(), Groups::template outputs<R>()>(
      x, w, epilogue, out, in, out_stride, begin, end);
}

constexpr int64_t kTileBytes = 32768;

// The weight streams from memory once for all rows: each thread walks its output features in tiles of
// ~32 KB of weight rows and runs every group of rows (RowGroups) over a tile while it is in L1/L2.
// Groups are balanced (AVX2, 11 rows: 6 + 5), as more rows per group means fewer passes over the tile.
template <typename Step, typename Groups = RowGroups<Step>, typename W, typename Out>
void product(const typename Step::X* xs, const W* w, Epilogue epilogue, Out* os, int64_t rows, int64_t in,
             int64_t out_features) {
  const int64_t tile = std::max<int64_t>(4, kTileBytes / (static_cast<int64_t>(sizeof(W)) * in));
  const int64_t grain = std::max<int64_t>(16, out_features / (4 * at::get_num_threads()));
  at::parallel_for(0, out_features, grain, [&](int64_t begin, int64_t end) {
    for (int64_t tile_begin = begin; tile_begin < end; tile_begin += tile) {
      const int64_t tile_end = std::min(end, tile_begin + tile);
      for (int64_t first = 0, count = 0; first < rows; first += count) {
        const int64_t left = rows - first, most = Groups::kMaxRows, groups = (left + most - 1) / most;
        count = (left + groups - 1) / groups;
        product_rows<Step, Groups>(count, xs + first * in, w, epilogue, os + first * out_features, in, out_features,
                           tile_begin, tile_end);
      }
    }
  });
}

}  // namespace

namespace {

// The rows of x as the widened steps read them: fp32 x as it is, bf16 x widened (exactly) into `widened`.
// A few rows: widening them costs nothing next to the weights. `widened` is a tensor, not a std::vector:
// torch aligns it to 64 bytes, where vector loads of x crossing cache lines made a few rows' product ~2x slower.
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
template <typename Groups, typename W>
void widened_product(const float* xs, const W* w, Epilogue epilogue, torch::Tensor& out, int64_t rows, int64_t in,
                     int64_t out_features) {
  if (out.scalar_type() == torch::kBFloat16)
    product<WidenedStep, Groups>(xs, w, epilogue, out.data_ptr<at::BFloat16>(), rows, in, out_features);
  else
    product<WidenedStep, Groups>(xs, w, epilogue, out.data_ptr<float>(), rows, in, out_features);
}

// weight_product in the row groups `Groups` picks its chains by
template <template <typename> class Groups>
torch::Tensor grouped_weight_product(torch::Tensor& x, const torch::Tensor& weight,
                                     const c10::optional<torch::Tensor>& bias) {
  const bool bf16_weight = weight.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(weight.dim() == 2 && (bf16_weight || weight.scalar_type() == torch::kFloat32) && weight.is_contiguous(),
              "weight: contiguous bf16 or fp32 [out, in]");
  const int64_t in = weight.size(1), out_features = weight.size(0);
  auto out = checked_output(x, in, out_features);
  const int64_t rows = x.numel() / in;
  const Epilogue epilogue{nullptr, checked_fp32(bias, out_features, "bias")};
#ifdef __AVX512BF16__
  if (x.scalar_type() == torch::kBFloat16 && bf16_weight) {  // pairs of bf16 values straight from both
    product<PairStep, Groups<PairStep>>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                                        reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), epilogue,
                                        out.data_ptr<at::BFloat16>(), rows, in, out_features);
    return out;
  }
#endif
  torch::Tensor widened;
  const float* xs = widened_rows(x, widened);
  if (bf16_weight)
    widened_product<Groups<WidenedStep>>(xs, reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()),
                                         epilogue, out, rows, in, out_features);
  else
    widened_product<Groups<WidenedStep>>(xs, weight.data_ptr<float>(), epilogue, out, rows, in, out_features);
  return out;
}

}  // namespace

// x [..., in] fp32 or bf16, weight [out, in] bf16 or fp32, bias [out] fp32 or None -> [..., out] in x's dtype.
// A bf16 x is widened here and the output rounded here, so a bf16 model's product is one call: the
// casts around it were two more ops per linear, ~240 per forward of SmolLM2-135M.
torch::Tensor weight_product(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  return grouped_weight_product<RowGroups>(x, weight, bias);
}

// weight_product with each row's sums in the order a row alone gets, whatever rows come with it (InvariantRowGroups):
// engine.batch_invariant's steps and verifies over dense weights outside the column blocks.
torch::Tensor invariant_weight_product(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  return grouped_weight_product<InvariantRowGroups>(x, weight, bias);
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
  widened_product<RowGroups<WidenedStep>>(widened_rows(x, widened), weight.data_ptr<int8_t>(), epilogue, out, rows,
                                          in, out_features);
  return out;
}
