"""The target's weights as its GGUF file ships them (engine.target_weights=native): the CPU kernel widens Q4_0, Q4_1
and Q8_0 blocks to exactly the fp32 weights transformers dequantizes, sums each row the same way whatever rows come
with it, and the embedded model's greedy answers stay those of its dense weights."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from specpipe.engine.cpu_kernel import CpuKernel
from specpipe.engine.gguf_weights import NATIVE_FORMATS, rotary_rows
from specpipe.engine.onednn import PackedWeight
from specpipe.errors import ConfigError
from specpipe.pipelines.builder import build_pipeline, compose_config, load_model

FORMATS = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


@pytest.fixture(scope="module")
def kernel() -> CpuKernel:
    built = CpuKernel()
    if built.gguf_product is None:
        pytest.skip(f"specpipe's CPU kernel does not serve here: {built.reason}")
    return built


@pytest.mark.parametrize("kind", FORMATS, ids=[kind.name for kind in FORMATS])
def test_blocks_widen_as_gguf_py_dequantizes_and_rows_sum_alike_in_any_company(kernel, kind):
    generator = torch.Generator().manual_seed(int(kind))
    weight = (torch.randn(53, 160, generator=generator) * 0.03).numpy()  # [out, in]; odd out, 5 blocks a row
    raw = np.ascontiguousarray(quants.quantize(weight, kind))
    blocks = torch.from_numpy(raw)
    dense = torch.from_numpy(quants.dequantize(raw, kind))  # what transformers' loader holds
    assert torch.equal(kernel.gguf_widen(blocks, int(kind), 160), dense)
    bias = torch.randn(53, generator=generator)
    x = torch.randn(33, 160, generator=generator)
    out = kernel.gguf_product(x, blocks, int(kind), 160, bias)
    assert torch.allclose(out, x @ dense.t() + bias, rtol=1e-4, atol=1e-4)
    for rows in (1, 2, 7, 9, 16, 33):  # a row's output is the same with any rows beside it
        assert torch.equal(kernel.gguf_product(x[:rows], blocks, int(kind), 160, bias), out[:rows])
    assert torch.equal(kernel.gguf_product(x[5:6], blocks, int(kind), 160, bias), out[5:6])
    bf16 = kernel.gguf_product(x.bfloat16(), blocks, int(kind), 160, None)
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16, kernel.gguf_product(x.bfloat16().float(), blocks, int(kind), 160, None).bfloat16())


def test_bad_blocks_are_refused(kernel):
    blocks = torch.zeros(4, 40, dtype=torch.uint8)  # 2 Q4_1 blocks a row: 64 inputs
    with pytest.raises(RuntimeError, match="format"):
        kernel.gguf_product(torch.zeros(1, 64), blocks, 12, 64, None)
    with pytest.raises(RuntimeError, match="blocks"):
        kernel.gguf_product(torch.zeros(1, 64), blocks, 2, 64, None)  # Q4_0 rows are 36 bytes
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.gguf_product(torch.zeros(1, 48), blocks, 3, 48, None)


def test_rotary_rows_are_transformers_own_permutation():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(3 * 64)[:, None] * np.ones((1, 5))  # 3 heads of 64 rows
    expected = LlamaTensorProcessor()._reverse_permute_weights(rows, 9, 3)
    assert np.array_equal(rows[rotary_rows(3 * 64, 3)], expected)


@pytest.mark.embedded
def test_the_embedded_models_blocks_are_its_dense_weights_bit_for_bit(kernel, embedded):
    loaded = load_model(compose_config(["model=smollm2_135m"]).model)
    assert loaded.native and {weight.format for weight in loaded.native.values()} == {"Q4_1", "Q8_0"}
    modules = dict(loaded.model.named_modules())
    assert len(loaded.native) == 30 * 7 + 1  # every linear of every layer, and the tied output layer
    for name, weight in loaded.native.items():
        assert torch.equal(kernel.gguf_widen(weight.blocks, weight.type_id, weight.in_features),
                           modules[name].weight.detach()), name


@pytest.mark.embedded
def test_the_embedded_model_runs_its_file_blocks_by_default_and_says_so(kernel, embedded, caplog):
    with caplog.at_level(logging.INFO):
        pipe = build_pipeline(compose_config(["model=smollm2_135m", "pipeline=vanilla", "cost_curve=flat"]))
    assert "native Q4_1/Q8_0 weights" in caplog.text
    packed = [module for module in pipe.target.model.modules() if isinstance(module, PackedWeight)]
    assert len(packed) == 30 * 4 + 1  # q|k|v, o, gate|up and down of each layer, and the output layer
    assert all(weight.native_blocks is not None for weight in packed)
    streamed = sum(weight.weight_bytes(1) for weight in packed)
    dense = sum(4 * weight.in_features * weight.out_features for weight in packed)  # the fp32 weights
    assert streamed < dense / 5  # Q4_1 / Q8_0 against fp32: a sixth of the bytes, a quarter for the output layer
    dense_pipe = build_pipeline(compose_config(["model=smollm2_135m", "pipeline=vanilla", "cost_curve=flat",
                                                "engine.target_weights=dense"]))
    assert all(module.native_blocks is None for module in dense_pipe.target.model.modules()
               if isinstance(module, PackedWeight))


@pytest.mark.embedded
@pytest.mark.parametrize("pipeline", ["vanilla", "lookahead_trie", "eagle_mix"])
def test_native_greedy_answers_are_the_dense_weights_answers(kernel, embedded, pipeline):
    """fp32: the same weights, summed in another order: token for token the dense engine's answers (a flip would
    have to be a near-tie of the reference)."""
    native = embedded.pipeline(pipeline, cost_curve="online")
    dense = build_pipeline(embedded.config(pipeline, "engine.target_weights=dense", cost_curve="online"),
                           loaded=load_model(compose_config(["model=smollm2_135m"]).model))
    assert all(module.native_blocks is not None for module in native.target.model.modules()
               if isinstance(module, PackedWeight))
    for question in ("What does the with statement do in Python?", "Write a haiku about the sea.",
                     "Translate 'good morning' into French, German and Spanish."):
        ours, theirs = native.generate(question, max_new_tokens=48), dense.generate(question, max_new_tokens=48)
        assert ours.token_ids == theirs.token_ids, question


def test_native_weights_are_refused_where_there_are_none(tiny):
    with pytest.raises(ConfigError, match="no weights in GGUF blocks"):
        build_pipeline(compose_config(["model=tiny_random", "pipeline=vanilla", "engine.target_weights=native"]))
    with pytest.raises(ConfigError, match="target_weights must be one of"):
        build_pipeline(compose_config(["model=tiny_random", "pipeline=vanilla", "engine.target_weights=q4"]))
    assert set(NATIVE_FORMATS) == {"Q4_0", "Q4_1", "Q8_0"}
