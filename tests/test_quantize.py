"""int8 drafter weights (specpipe.engine.quantize): the quantization, the kernel's product over int8 weights,
the engine's packing of them, the drafters' `weight_quantization` option, and exactness with them."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import random_prompts, run_steps
from specpipe.engine import cpu, cpuinfo
from specpipe.engine.hf import HFEngine
from specpipe.engine.onednn import OneDNNEngine, OneDNNLinear, PackedWeight
from specpipe.engine.quantize import dequantize_rows, quantize_rows
from specpipe.errors import ConfigError
from specpipe.pipelines.builder import build_pipeline, compose_config, load_model
from test_engine import needs_compiler

ISAS = ["avx2", pytest.param("avx512", marks=pytest.mark.skipif(
    "avx512f" not in cpuinfo.cpu_flags(), reason="the AVX-512 build runs on CPUs with AVX-512F")),
    pytest.param("avx512_bf16", marks=pytest.mark.skipif(
        not {"avx512f", "avx512bw", "avx512_bf16"} <= cpuinfo.cpu_flags(), reason="pair products need AVX512_BF16"))]


def test_each_weight_lands_within_half_a_step_of_its_row():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 50, generator=generator) * torch.tensor([1.0, 1e-3, 30.0, 0.0, 1.0, 1.0])[:, None]
    weight[4, 7] = -5.0  # a row whose largest magnitude is negative
    codes, scale = quantize_rows(weight)
    assert codes.dtype == torch.int8 and codes.shape == weight.shape and scale.shape == (6,)
    assert codes.abs().max() <= 127 and (codes.abs().amax(dim=1)[[0, 1, 2, 4, 5]] == 127).all()
    assert codes[4, 7] == -127  # symmetric: the largest magnitude maps to -127 as it would to 127
    assert scale[3] == 1.0 and (codes[3] == 0).all()  # an all-zero row: zero codes, no division by zero
    error = (dequantize_rows(codes, scale, torch.float32) - weight).abs()  # [6, 50]
    assert (error <= scale[:, None] / 2 * (1 + 1e-6)).all()
    assert dequantize_rows(codes, scale, torch.bfloat16).dtype == torch.bfloat16


@needs_compiler
@pytest.mark.parametrize("isa", ISAS)
def test_the_kernels_int8_product_equals_an_fp32_product_of_the_codes_times_their_scales(isa):
    from specpipe.engine import cpu_kernel_build, cpu_kernel_checks

    built = cpu_kernel_build.build_kernel(None, isa)
    cpu_kernel_checks.self_check(built.weight_product, built.quantized_product)
    product = built.quantized_product
    generator = torch.Generator().manual_seed(7)
    # a vector tail (75, 9, 600 inputs: AVX2 reads 8, AVX-512 16, pairs 32 values a step); every group size of
    # rows and rows split into groups; several tiles of weight rows; an odd number of output features
    for in_features in (9, 75, 576, 600):
        for out_features in (1, 37, 96):
            codes = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
            scale = torch.rand(out_features, generator=generator) / 100 + 1e-4  # [out]
            bias = torch.randn(out_features, generator=generator)  # [out]
            weight = codes.float() * scale[:, None]  # [out, in] what the codes stand for
            for rows in (1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 19, 25):
                x = torch.randn(rows, in_features, generator=generator)  # [rows, in]
                torch.testing.assert_close(product(x, codes, scale, None), x @ weight.t(), rtol=1e-5, atol=1e-4)
                torch.testing.assert_close(product(x, codes, scale, bias), torch.addmm(bias, x, weight.t()),
                                           rtol=1e-5, atol=1e-4)
                x = x.bfloat16()
                out = product(x, codes, scale, bias)  # bf16 rows in, bf16 out: the fp32 sum rounded once
                assert out.dtype == torch.bfloat16
                reference = (x.float() @ weight.t() + bias).bfloat16()
                torch.testing.assert_close(out.float(), reference.float(), rtol=2 ** -7, atol=1e-4)
    x = torch.randn(2, 3, 150, generator=generator)[..., ::2]  # [2, 3, 75], leading dimensions, strided
    codes = torch.randint(-127, 128, (37, 75), generator=generator, dtype=torch.int8)
    scale = torch.rand(37, generator=generator)
    out = product(x, codes, scale, None)
    assert out.shape == (2, 3, 37)
    torch.testing.assert_close(out, product(x.reshape(6, 75).contiguous(), codes, scale, None).view(2, 3, 37))
    with pytest.raises(RuntimeError, match="weight: contiguous int8"):
        product(x, codes.float(), scale, None)
    with pytest.raises(RuntimeError, match="scale: contiguous fp32"):
        product(x, codes, scale[:36], None)
    with pytest.raises(RuntimeError, match="disagree on in_features"):
        product(torch.randn(2, 74), codes, scale, None)


def fake_kernel():
    """The kernel's two products in torch (what they compute, to float rounding), counting their calls."""
    calls = {"bf16/fp32": 0, "int8": 0}

    def product(x, weight, bias):
        calls["bf16/fp32"] += 1
        out = x.float() @ weight.float().t() + (bias if bias is not None else 0)
        return out.to(x.dtype)

    def quantized_product(x, codes, scale, bias):
        calls["int8"] += 1
        out = (x.float() @ codes.float().t()) * scale + (bias if bias is not None else 0)
        return out.to(x.dtype)
    return SimpleNamespace(product=product, quantized_product=quantized_product, calls=calls)


@pytest.mark.skipif(not cpu.onednn_available(), reason="oneDNN prepacking needs torch's mkldnn ops")
def test_few_rows_run_over_the_int8_codes_and_more_rows_over_the_weights_they_stand_for():
    generator = torch.Generator().manual_seed(3)
    first, second = nn.Linear(40, 24), nn.Linear(40, 8, bias=False)
    kernel = fake_kernel()
    packed = PackedWeight([first, second], kernel=kernel.product, kernel_rows=4,
                          quantized_kernel=kernel.quantized_product)
    codes, scale = quantize_rows(torch.cat([first.weight, second.weight]).detach())
    assert torch.equal(packed.codes, codes) and torch.equal(packed.scale, scale)
    assert packed.small_weight is None  # the int8 codes stand in for a plain copy of the weights
    stands_for = dequantize_rows(codes, scale, torch.float32)  # [32, 40]
    bias = torch.cat([first.bias.detach(), torch.zeros(8)])
    with torch.inference_mode():
        for rows, path in ((1, "int8"), (4, "int8"), (5, None), (30, None)):
            before = dict(kernel.calls)
            x = torch.randn(rows, 40, generator=generator)
            torch.testing.assert_close(packed.product(x), x @ stands_for.t() + bias, rtol=1e-5, atol=1e-5)
            assert kernel.calls["int8"] - before["int8"] == (1 if path == "int8" else 0), rows
            assert kernel.calls["bf16/fp32"] == before["bf16/fp32"]
    # what a few-row product streams: 1 byte a weight and the fp32 scales and bias, against 4 bytes a weight
    assert packed.weight_bytes(4) == 32 * 40 + 4 * 32 + 4 * 32
    assert packed.weight_bytes(5) > 3.5 * 32 * 40
    unquantized = PackedWeight([first, second], kernel=kernel.product, kernel_rows=4)
    assert unquantized.codes is None and unquantized.weight_bytes(4) == 4 * 32 * 40 + 4 * 32


def fresh_tiny(dtype: str = "fp32") -> nn.Module:
    return load_model(compose_config(["model=tiny_random", f"model.dtype={dtype}"]).model).model


@needs_compiler
@pytest.mark.skipif(not cpu.onednn_available(), reason="oneDNN prepacking needs torch's mkldnn ops")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_fast_engine_quantizes_a_models_products_on_request_and_says_so(dtype):
    model, reference = fresh_tiny(dtype), fresh_tiny(dtype)
    OneDNNEngine().apply(model, quantize="int8")
    packed = [module.packed for module in model.modules() if isinstance(module, OneDNNLinear)]
    if not all(p.codes is not None for p in packed):
        pytest.skip("specpipe's CPU kernel does not serve this dtype here (tested where it does)")
    assert "int8 weights for products of up to" in model.specpipe_engine_rewrite
    # the quantized model computes what a stock model over the weights the codes stand for computes
    for module in reference.modules():
        if type(module) is nn.Linear:  # a new parameter: a tied output layer's embedding stays as it was
            codes, scale = quantize_rows(module.weight)
            module.weight = nn.Parameter(dequantize_rows(codes, scale, module.weight.dtype), requires_grad=False)
    ids = torch.tensor([random_prompts(1, seed=2)[0][:6]])
    with torch.inference_mode():
        tolerance = {"atol": 1e-3, "rtol": 1e-3} if dtype == "fp32" else {"atol": 0.1, "rtol": 0.05}
        torch.testing.assert_close(model(ids).logits.float(), reference(ids).logits.float(), **tolerance)
    plain = fresh_tiny(dtype)
    OneDNNEngine().apply(plain)
    assert all(module.packed.codes is None for module in plain.modules() if isinstance(module, OneDNNLinear))
    assert "int8" not in plain.specpipe_engine_rewrite


def test_engines_refuse_an_unknown_quantization_and_hf_says_it_keeps_the_weights(caplog):
    for engine in (OneDNNEngine(), HFEngine()):
        with pytest.raises(ConfigError, match=rf"engine={engine.name}: weight_quantization must be one of "
                                              r"\['auto', 'int8'\] or null \(the model's dtype\), got 'int4'"):
            engine.apply(fresh_tiny(), quantize="int4")
    model = fresh_tiny()
    with caplog.at_level(logging.WARNING):
        HFEngine().apply(model, quantize="auto")
    assert caplog.text == ""  # auto: int8 only where an engine's kernel serves it, nothing to say elsewhere
    with caplog.at_level(logging.WARNING):
        HFEngine().apply(model, quantize="int8")
    assert "int8 draft weights need engine=fast" in caplog.text
    assert any(type(module) is nn.Linear for module in model.modules())  # untouched


@pytest.mark.skipif(not cpu.onednn_available(), reason="oneDNN prepacking needs torch's mkldnn ops")
def test_a_fast_engine_without_its_kernel_keeps_the_weights_and_says_why(caplog):
    model = fresh_tiny()
    with caplog.at_level(logging.WARNING):
        OneDNNEngine(fp32_kernel_rows=0).apply(model, quantize="int8")
    assert "int8 weights need specpipe's CPU kernel, which does not serve here (engine.fp32_kernel_rows=0)" in caplog.text
    packed = [module.packed for module in model.modules() if isinstance(module, OneDNNLinear)]
    assert packed and all(p.codes is None for p in packed)
    caplog.clear()
    model = fresh_tiny()
    with caplog.at_level(logging.WARNING):
        OneDNNEngine(fp32_kernel_rows=0).apply(model, quantize="auto")
    assert "int8" not in caplog.text
    assert all(module.packed.codes is None for module in model.modules() if isinstance(module, OneDNNLinear))


def test_int8_off_the_cpu_says_the_weights_stay_as_loaded(monkeypatch, caplog):
    engine = OneDNNEngine()
    monkeypatch.setattr(engine, "_linear_path", lambda model: "the model is on cuda, oneDNN prepacking is for the CPU")
    model = fresh_tiny()
    with caplog.at_level(logging.WARNING):
        engine.apply(model, quantize="int8")
    assert "int8 weights need specpipe's CPU kernel: they stay as loaded" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        engine.apply(model, quantize="auto")
    assert "int8" not in caplog.text and "oneDNN prepacking is for the CPU" in caplog.text
    assert any(type(module) is nn.Linear for module in model.modules())


@pytest.mark.parametrize("pipeline,drafter", [("eagle", "eagle"), ("draft_model", "model")])
def test_a_drafter_with_an_unknown_quantization_is_refused_by_name(tiny_mixed, pipeline, drafter):
    with pytest.raises(ConfigError, match=f"weight_quantization must be one of"):
        build_pipeline(tiny_mixed.config(pipeline, f"pipeline.drafters.{drafter}.weight_quantization=int4"),
                       loaded=tiny_mixed.loaded)


@needs_compiler
@pytest.mark.parametrize("setting", ["int8", "auto"])
@pytest.mark.parametrize("pipeline,drafter", [("eagle", "eagle"), ("draft_model", "model"), ("specinfer_mix", "model"),
                                              ("medusa", "medusa")])
def test_greedy_pipelines_with_int8_drafters_equal_plain_greedy(tiny_mixed, pipeline, drafter, setting):
    """Only the draft is quantized: its products run over int8 codes, the target checks every token. The
    drafters' default, auto, is int8 where engine=fast's kernel serves (here)."""
    pipe = build_pipeline(tiny_mixed.config(pipeline, f"pipeline.drafters.{drafter}.weight_quantization={setting}"),
                          loaded=tiny_mixed.loaded)
    (stage,) = pipe.decoder.drafters
    own = [*([stage.runner.model] if stage.runner is not None else []), *getattr(stage, "engine_modules", ())]
    packed = [module.packed for model in own for module in model.modules() if isinstance(module, OneDNNLinear)]
    assert packed and all(p.codes is not None for p in packed)
    target_packed = [m.packed for m in pipe.target.model.modules() if isinstance(m, OneDNNLinear)]
    assert target_packed and all(p.codes is None for p in target_packed)  # the target keeps its weights
    vanilla = tiny_mixed.pipeline("vanilla")
    verified = 0
    for i, prompt in enumerate(random_prompts(12, seed=11)):
        expected, _ = run_steps(vanilla, prompt, 24)
        tokens, steps = run_steps(pipe, prompt, 24)
        assert tokens == expected, f"{pipeline}, prompt {i}"
        verified += sum(step.stats.tree_size for step in steps)
    assert verified > 10  # the int8 drafter really proposed nodes the target verified


@needs_compiler
@pytest.mark.embedded
def test_the_shipped_eagle_head_in_int8_stays_lossless_and_drafts_on_the_embedded_model(embedded):
    vanilla = embedded.pipeline("vanilla")
    pipe = embedded.pipeline("eagle", "pipeline.drafters.eagle.weight_quantization=int8")
    assert "int8 weights" in pipe.decoder.drafters[0].net.specpipe_engine_rewrite
    drafted = 0
    for text in ("Explain in two sentences why the sky is blue.", "What is 17 times 23? Show the steps."):
        prompt_ids = vanilla.encode(text)
        expected, _ = run_steps(vanilla, prompt_ids, 40)
        tokens, steps = run_steps(pipe, prompt_ids, 40)
        assert tokens == expected, text
        drafted += sum(step.drafted for step in steps)
    assert drafted >= 20  # the quantized head still drafts tokens the target accepts (not vacuous)


def test_null_keeps_a_drafters_weights_in_the_models_dtype(tiny_mixed):
    pipe = build_pipeline(tiny_mixed.config("eagle", "pipeline.drafters.eagle.weight_quantization=null"),
                          loaded=tiny_mixed.loaded)
    packed = [module.packed for module in pipe.decoder.drafters[0].net.modules() if isinstance(module, OneDNNLinear)]
    assert packed and all(p.codes is None for p in packed)
    assert "int8" not in pipe.decoder.drafters[0].net.specpipe_engine_rewrite
