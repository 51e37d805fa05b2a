"""A bf16-weight matrix product for CPUs whose oneDNN has no bf16 kernel (AVX2 without AVX-512 BW/VL/DQ
or AVX-NE-CONVERT): it streams the bf16 weights, widens them to fp32 in registers and accumulates in
fp32, for the few rows of a decoding step or a tree verify.

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

The kernel is C++ with AVX2/FMA intrinsics, built once per machine with torch's extension builder
(g++ and ninja) into the specpipe cache; where it cannot be built or run (no compiler, another ISA)
`Bf16Kernel.reason` says why and engine=fast keeps the paths above. Sums run in another
order than oneDNN's or ATen's, so outputs differ from theirs by float rounding, like any other GEMM.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sys
from pathlib import Path

import torch

from specpipe.engine.cpu import _first_line, cpu_flags


_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <algorithm>

namespace {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 bf16 values widened to fp32: a bf16 is the upper half of an fp32
inline __m256 load_bf16(const uint16_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// out[r, o] = sum_k x[r, k] * w[o, k] for R rows of x and output features [begin, end). Each output
// feature streams its weight row once; U accumulators per row over interleaved slices of k keep R * U
// independent FMA chains in flight (the FMA's latency, not the memory, limits one chain).
template <int R, int U>
void product_block(const float* x, const uint16_t* w, float* out, int64_t in, int64_t out_stride,
                   int64_t begin, int64_t end) {
  const int64_t unrolled_end = in - in % (8 * U);
  const int64_t vector_end = in - in % 8;
  for (int64_t o = begin; o < end; ++o) {
    const uint16_t* row = w + o * in;
    __m256 acc[U][R];
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[u][r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < unrolled_end; k += 8 * U) {
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        const __m256 weights = load_bf16(row + k + 8 * u);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          acc[u][r] = _mm256_fmadd_ps(weights, _mm256_loadu_ps(x + r * in + k + 8 * u), acc[u][r]);
      }
    }
    for (int64_t k = unrolled_end; k < vector_end; k += 8) {
      const __m256 weights = load_bf16(row + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[0][r] = _mm256_fmadd_ps(weights, _mm256_loadu_ps(x + r * in + k), acc[0][r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m256 total = acc[0][r];
#pragma GCC unroll 8
      for (int u = 1; u < U; ++u) total = _mm256_add_ps(total, acc[u][r]);
      float sum = horizontal_sum(total);
      for (int64_t k = vector_end; k < in; ++k) sum += x[r * in + k] * bf16_to_float(row[k]);
      out[r * out_stride + o] = sum;
    }
  }
}

// Rows [x, x + count) of the product for output features [begin, end): U accumulators per row where
// the row count leaves registers for them (16 ymm registers: R * U accumulators and the weights).
template <int R>
void product_group(const float* x, const uint16_t* w, float* out, int64_t in, int64_t out_stride,
                   int64_t begin, int64_t end) {
  constexpr int U = R == 1 ? 8 : (R == 2 ? 4 : (R <= 6 ? 2 : 1));
  product_block<R, U>(x, w, out, in, out_stride, begin, end);
}

void product_rows(int64_t count, const float* x, const uint16_t* w, float* out, int64_t in, int64_t out_stride,
                  int64_t begin, int64_t end) {
  switch (count) {
    case 1: product_group<1>(x, w, out, in, out_stride, begin, end); break;
    case 2: product_group<2>(x, w, out, in, out_stride, begin, end); break;
    case 3: product_group<3>(x, w, out, in, out_stride, begin, end); break;
    case 4: product_group<4>(x, w, out, in, out_stride, begin, end); break;
    case 5: product_group<5>(x, w, out, in, out_stride, begin, end); break;
    case 6: product_group<6>(x, w, out, in, out_stride, begin, end); break;
    case 7: product_group<7>(x, w, out, in, out_stride, begin, end); break;
    default: product_group<8>(x, w, out, in, out_stride, begin, end); break;
  }
}

constexpr int64_t kMaxGroupRows = 8;
constexpr int64_t kTileBytes = 32768;

}  // namespace

// x [rows, in] fp32, weight [out, in] bf16 -> [rows, out] fp32
torch::Tensor bf16_weight_product(torch::Tensor x, torch::Tensor weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous fp32 [rows, in]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16 && weight.is_contiguous(),
              "weight: contiguous bf16 [out, in]");
  TORCH_CHECK(x.size(1) == weight.size(1), "x and weight disagree on in_features");
  const int64_t rows = x.size(0), in = x.size(1), out_features = weight.size(0);
  auto out = torch::empty({rows, out_features}, x.options());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const float* xs = x.data_ptr<float>();
  float* os = out.data_ptr<float>();
  // The weight streams from memory once for all rows: each thread walks its output features in tiles
  // of ~32 KB of weight rows and runs every group of up to 8 rows over a tile while it is in L1/L2.
  // Groups are balanced (11 rows: 6 + 5), as more rows per group means fewer passes over the tile.
  const int64_t tile = std::max<int64_t>(4, kTileBytes / (2 * in));
  const int64_t grain = std::max<int64_t>(16, out_features / (4 * at::get_num_threads()));
  at::parallel_for(0, out_features, grain, [&](int64_t begin, int64_t end) {
    for (int64_t tile_begin = begin; tile_begin < end; tile_begin += tile) {
      const int64_t tile_end = std::min(end, tile_begin + tile);
      for (int64_t first = 0, count = 0; first < rows; first += count) {
        const int64_t left = rows - first, groups = (left + kMaxGroupRows - 1) / kMaxGroupRows;
        count = (left + groups - 1) / groups;
        product_rows(count, xs + first * in, w, os + first * out_features, in, out_features, tile_begin, tile_end);
      }
    }
  });
  return out;
}
"""


class Bf16Kernel:
    """Loads (building it once per machine) the bf16-weight product; `product` is None and `reason`
    says why where it is not available. One instance per engine apply: nothing is kept at module level."""

    def __init__(self, build_dir: Path | None = None) -> None:
        self.product = None
        self.reason = ""
        # which build of the source: part of the engine's description, so a cost curve measured with
        # another version of the kernel is not reused
        self.build = build_name()
        if platform.machine().lower() not in ("x86_64", "amd64"):
            self.reason = f"the bf16 kernel is for x86 CPUs, this is {platform.machine()}"
            return
        if not {"avx2", "fma"} <= cpu_flags():
            self.reason = "this CPU has no AVX2/FMA for the bf16 kernel"
            return
        try:
            module = _build(build_dir)
            self.product = module.bf16_weight_product
            _self_check(self.product)
        except Exception as error:  # a missing compiler or ninja, a failed build: engine=fast goes on without it
            self.product = None
            self.reason = f"the bf16 kernel could not be built or run ({_first_line(error)[:300]})"


def build_name() -> str:
    """The extension's name: the source's and torch's version in 12 hex digits."""
    return "specpipe_bf16_" + hashlib.sha1((_SOURCE + torch.__version__).encode()).hexdigest()[:12]


def _build(build_dir: Path | None):
    from torch.utils import cpp_extension

    from specpipe.models import cache_root

    name = build_name()
    folder = (build_dir or cache_root() / "kernels") / name
    folder.mkdir(parents=True, exist_ok=True)
    # ninja from the environment's own bin folder (the `ninja` wheel) when the shell's PATH lacks it
    # (.venv/bin/python run without activating the environment), for the build only
    path = os.environ.get("PATH", "")
    bin_folder = str(Path(sys.executable).parent)
    if bin_folder not in path.split(os.pathsep):
        os.environ["PATH"] = bin_folder + os.pathsep + path if path else bin_folder
    try:
        return cpp_extension.load_inline(
            name=name, cpp_sources=[_SOURCE], functions=["bf16_weight_product"], build_directory=str(folder),
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    finally:
        os.environ["PATH"] = path


def _self_check(product) -> None:
    """The built kernel against an fp32 product on awkward sizes (a vector tail, odd features, 1-19 rows)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 75, generator=generator).bfloat16()  # [out, in]
    for rows in (1, 3, 7, 8, 11, 19):
        x = torch.randn(rows, 75, generator=generator)  # [rows, in]
        expected = x @ weight.float().t()
        if not torch.allclose(product(x, weight), expected, rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"the bf16 kernel disagrees with an fp32 product for {rows} rows")

