"""Q4_1 and Q8_0 weights on AMX tiles (engine.native_tiles): the reordered blocks hold the file's weights, the tile
product is as close to an fp64 product of them as fp32 sums are, each row's output does not depend on the rows beside
it, and the embedded model takes the tiles by default where the CPU has them."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from specpipe.engine import cpu_kernel
from specpipe.engine.cpu_kernel import CpuKernel
from specpipe.engine.gguf_weights import NATIVE_FORMATS, TILE_FORMATS, random_blocks
from specpipe.engine.onednn import PackedWeight
from specpipe.errors import ConfigError
from specpipe.pipelines.builder import build_pipeline, compose_config

FORMATS = ("Q4_1", "Q8_0")


@pytest.fixture(scope="module")
def kernel() -> CpuKernel:
    built = CpuKernel()
    if built.gguf_tile_pack is None:
        pytest.skip(f"the kernel's AMX tile product does not serve here: {built.reason or built.gguf_tiles_reason}")
    return built


@pytest.mark.parametrize("name", FORMATS)
def test_tiles_hold_the_blocks_weights(kernel, name):
    raw = torch.from_numpy(random_blocks(name, 48, 160, np.random.default_rng(1)))  # 3 feature groups, 5 blocks
    tiles = kernel.gguf_tile_pack(raw, NATIVE_FORMATS[name], 160)
    assert tiles.shape == raw.shape and not torch.equal(tiles, raw)  # the same bytes, reordered
    assert torch.equal(kernel.gguf_widen(tiles, TILE_FORMATS[f"{name}_TILES"], 160),
                       kernel.gguf_widen(raw, NATIVE_FORMATS[name], 160))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_product_is_an_fp32_product_and_rows_sum_alike_in_any_company(kernel, name, dtype):
    out_features, in_features = 64, 576
    raw = torch.from_numpy(random_blocks(name, out_features, in_features, np.random.default_rng(2)))
    tiles_id = TILE_FORMATS[f"{name}_TILES"]
    tiles = kernel.gguf_tile_pack(raw, NATIVE_FORMATS[name], in_features)
    weight = kernel.gguf_widen(raw, NATIVE_FORMATS[name], in_features).double()  # [out, in]
    generator = torch.Generator().manual_seed(2)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(40, in_features, generator=generator).to(dtype)  # [rows, in]
    out = kernel.gguf_product(x, tiles, tiles_id, in_features, bias)  # [rows, out]
    reference = x.double() @ weight.t() + bias.double()
    gap = float((out.double() - reference).abs().max())
    scale = float((x.double().abs() @ weight.abs().t()).max())  # the size of the largest sum's terms
    if dtype == torch.float32:
        # fp32 sums of exact products: within a few hundred ulps of the terms' size (one bf16 part of x alone is
        # off by ~2^-9 of it)
        assert gap < 2 ** -16 * scale, gap
    else:
        assert gap <= float(reference.abs().max()) * 2 ** -8 + 2 ** -16 * scale  # the output's bf16 rounding
    for rows in (1, 2, 3, 5, 6, 16, 17, 33, 40):  # groups of tile rows of every size: the same sums per row
        assert torch.equal(kernel.gguf_product(x[:rows], tiles, tiles_id, in_features, bias), out[:rows]), rows
    for row in (0, 21, 39):
        assert torch.equal(kernel.gguf_product(x[row:row + 1], tiles, tiles_id, in_features, bias), out[row:row + 1])


@pytest.mark.embedded
def test_the_embedded_model_takes_the_tiles_by_default_and_says_so(kernel, embedded, caplog):
    with caplog.at_level(logging.INFO):
        pipe = build_pipeline(compose_config(["model=smollm2_135m", "pipeline=vanilla", "cost_curve=flat"]))
    assert "Q4_1 (on AMX tiles)/Q8_0 (on AMX tiles)" in caplog.text
    formats = [module.native_format for module in pipe.target.model.modules() if isinstance(module, PackedWeight)]
    # the layers' Q4_1 blocks, the output layer's Q8_0 ones
    assert formats.count(TILE_FORMATS["Q4_1_TILES"]) == 30 * 4 and formats.count(TILE_FORMATS["Q8_0_TILES"]) == 1


def test_native_tiles_true_without_the_tiles_says_why(monkeypatch):
    if CpuKernel().gguf_product is None:
        pytest.skip("specpipe's CPU kernel does not serve here")
    monkeypatch.setattr(cpu_kernel, "cpu_flags", lambda: frozenset({"avx2", "fma"}))  # a CPU without AMX
    with pytest.raises(ConfigError, match="native_tiles=true.*(no AMX tiles|does not serve|no AMX tile product)"):
        build_pipeline(compose_config(["model=tiny_random", "pipeline=vanilla", "cost_curve=flat",
                                       "engine.target_weights=int4", "engine.native_tiles=true"]))


def test_native_tiles_takes_only_auto_true_false():
    with pytest.raises(ConfigError, match="engine.native_tiles must be auto, true or false"):
        build_pipeline(compose_config(["model=tiny_random", "pipeline=vanilla", "engine.native_tiles=sometimes"]))
