"""engine=fast (prepacked oneDNN linears): the rewrite itself, its fallbacks, and exactness.

Exactness contract: greedy pipelines equal specpipe's own vanilla token for token (same engine);
against transformers' stock forward an output may differ only where the reference's top-2
logit gap at the first divergence is below 1e-3 (a near-tie flipped by reordered float sums).
"""
from __future__ import annotations

import copy
import logging
import os
import platform
import re
import shutil
import sysconfig
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaModel, LlamaRMSNorm

from conftest import DRAFTING_PIPELINES, HEAD_PIPELINES, near_tie_divergence, random_prompts, run_steps
from specpipe.engine import cpu, cpuinfo, onednn, packed_weight
from specpipe.engine.base import REWRITE_ATTRIBUTE, TILES_ATTRIBUTE, tiles_permitted
from specpipe.engine.blocks import FusedGatedMLP, FusedQKVAttention
from specpipe.engine.hf import HFEngine
from specpipe.engine.lean_model import LeanLlamaModel, rms_norm
from specpipe.engine.onednn import OneDNNEngine, OneDNNLinear
from specpipe.errors import ConfigError
from specpipe.models import LoadedModel
from specpipe.pipelines.builder import build_pipeline, compose_config, load_model
from specpipe.target import TargetModel, folded_attention_bias, tree_attention_forward
from specpipe.types import DraftTree

NEAR_TIE = 1e-3
EMBEDDED_PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about autumn leaves.",
    "List three uses of a hash table and give one sentence on each.",
    "Translate to French: The library opens at nine and closes at six.",
    "What is 17 times 23? Show the steps.",
    "Summarize: Python's `with` statement wraps a block with methods defined by a context manager, so that "
    "setup and cleanup run even when the block raises.",
]


def fresh_tiny(dtype: str = "fp32") -> nn.Module:
    return load_model(compose_config(["model=tiny_random", f"model.dtype={dtype}"]).model).model


def linears(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if type(module) is nn.Linear]


# ---- the rewrite -------------------------------------------------------------------------
def test_fast_engine_swaps_every_linear_and_fuses_shared_inputs():
    model = fresh_tiny()
    assert linears(model)
    OneDNNEngine(lean_blocks=False).apply(model)
    assert linears(model) == []
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attention.q_proj.packed is attention.k_proj.packed is attention.v_proj.packed
    assert mlp.gate_proj.packed is mlp.up_proj.packed
    assert attention.o_proj.packed is not attention.q_proj.packed and isinstance(model.lm_head, OneDNNLinear)
    assert model.specpipe_engine == "fast"


def test_fast_engine_swaps_llama_blocks_for_lean_ones_over_the_fused_products():
    model = fresh_tiny()
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    OneDNNEngine().apply(model)
    assert linears(model) == []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        assert isinstance(attention, FusedQKVAttention) and isinstance(mlp, FusedGatedMLP)
        assert attention.qkv.splits == [config.num_attention_heads * head_dim,
                                        config.num_key_value_heads * head_dim, config.num_key_value_heads * head_dim]
        assert mlp.gate_up.splits == [config.intermediate_size] * 2
        assert isinstance(attention.o_proj, OneDNNLinear) and isinstance(mlp.down_proj, OneDNNLinear)


def test_blocks_whose_forward_is_not_llamas_keep_transformers_forward():
    """A subclass that overrides forward (or an MLP with another activation) must not be replaced."""
    class OtherAttention(LlamaAttention):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model = fresh_tiny()
    first = model.model.layers[0]
    first.self_attn.__class__ = OtherAttention
    first.mlp.act_fn = nn.GELU()
    OneDNNEngine().apply(model)
    assert type(first.self_attn) is OtherAttention and type(first.mlp) is LlamaMLP
    assert first.self_attn.q_proj.packed is first.self_attn.v_proj.packed  # linears still prepacked and fused
    assert isinstance(model.model.layers[1].self_attn, FusedQKVAttention)


def assert_same_forwards(stock: nn.Module, lean: nn.Module, rows: int) -> None:
    """A prefill, a verify of a `rows`-node tree and a one-token step through both models: bitwise
    equal logits, last hidden states and cache."""
    prompt = random_prompts(1, seed=rows)[0]
    tree = DraftTree.from_parents(torch.arange(300, 300 + rows), torch.tensor([-1, 0, 0, 1, 2][:rows]))
    outputs, caches = [], []
    for model in (stock, lean):
        target = TargetModel(model, engine="fast")
        cache = target.new_cache()
        prefill = target.prefill(prompt, cache)
        verify = target.forward_tree(prompt[-1], tree, cache)
        cache.crop(len(prompt))
        step = target.forward_tree(prompt[-1], DraftTree.empty(), cache)
        outputs.append((prefill.logits, prefill.hidden, verify.logits, verify.hidden, step.logits, step.hidden))
        caches.append(cache)
    for expected, got in zip(*outputs):
        assert torch.equal(expected, got)
    for expected, got in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(expected.keys, got.keys) and torch.equal(expected.values, got.values)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5])
def test_lean_blocks_compute_what_the_stock_blocks_compute(dtype, rows):
    """The same fused products through the lean and the stock blocks: bitwise equal outputs and cache."""
    stock, lean = fresh_tiny(dtype), fresh_tiny(dtype)
    OneDNNEngine(lean_blocks=False).apply(stock)
    OneDNNEngine(kernel_attention=False).apply(lean)  # SDPA on both sides: the blocks alone compared
    assert_same_forwards(stock, lean, rows)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("kernel_norm", [True, False])
def test_lean_model_forward_computes_what_transformers_forward_computes(dtype, rows, kernel_norm):
    """The lean LlamaModel loop (its norms in specpipe's C++ kernel where it builds, or in torch) against
    transformers' own over the same rewritten modules."""
    stock, lean = fresh_tiny(dtype), fresh_tiny(dtype)
    OneDNNEngine(lean_forward=False).apply(stock)
    OneDNNEngine(kernel_norm=kernel_norm, kernel_attention=False).apply(lean)
    assert type(stock.model) is LlamaModel and type(lean.model) is LeanLlamaModel
    if not kernel_norm:
        assert lean.model.norm_kernel is None
    assert_same_forwards(stock, lean, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_folded_attention_bias_gives_what_the_boolean_mask_gives(dtype):
    """tree_attention_forward with the bias made once per forward against folding the boolean mask
    itself: bitwise equal, a fully visible row and rows that see only a few entries included."""
    generator = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, q, kv, head_dim = 1, 6, 2, 5, 40, 16
    query = torch.randn(batch, heads, q, head_dim, generator=generator).to(dtype)
    key, value = (torch.randn(batch, kv_heads, kv, head_dim, generator=generator).to(dtype) for _ in range(2))
    mask = torch.rand(batch, 1, q, kv, generator=generator) > 0.5  # [batch, 1, q, kv]
    mask[..., 0] = True
    mask[:, :, 1] = True
    bias = folded_attention_bias(mask, heads // kv_heads, dtype)  # [batch, 1, groups * q, kv]
    assert bias.shape == (batch, 1, 3 * q, kv) and bias.dtype == dtype
    expected, _ = tree_attention_forward(None, query, key, value, mask, scaling=0.25)
    got, _ = tree_attention_forward(None, query, key, value, mask, scaling=0.25, attention_bias=bias)
    assert torch.equal(got, expected)


def test_the_lean_forward_makes_the_attention_bias_once_per_masked_forward(monkeypatch):
    from specpipe.engine import lean_model

    made = []
    monkeypatch.setattr(lean_model, "folded_attention_bias",
                        lambda *args: made.append(args[0].shape) or folded_attention_bias(*args))
    model = fresh_tiny()
    OneDNNEngine(kernel_attention=False).apply(model)  # SDPA's path: the kernel takes the boolean mask
    target = TargetModel(model, engine="fast")
    cache = target.new_cache()
    target.prefill([5, 6, 7, 8], cache)  # causal prefill: no mask, no bias
    target.forward_tree(8, DraftTree.empty(), cache)  # one token: no mask
    tree = DraftTree.from_parents(torch.tensor([9, 10, 11]), torch.tensor([-1, 0, 0]))
    target.forward_tree(9, tree, cache)
    assert made == [(1, 1, 4, 9)]  # one bias for the verify's 4 rows over 5 + 4 entries


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lean_rms_norm_is_bitwise_transformers_rms_norm(dtype):
    """The lean forward's norm (torch.rms_norm, the weight applied after its rounding in bf16/fp16)
    against LlamaRMSNorm itself, over widths with and without a vector tail and values of every scale."""
    generator = torch.Generator().manual_seed(3)
    for width, rows, scale, eps in [(576, 1, 1.0, 1e-5), (576, 8, 30.0, 1e-5), (960, 3, 1e-2, 1e-6),
                                    (4096, 2, 5.0, 1e-5), (17, 33, 100.0, 1e-6)]:
        norm = LlamaRMSNorm(width, eps=eps)
        norm.weight.data = (torch.rand(width, generator=generator) * 2).to(dtype)
        hidden = (torch.randn(2, rows, width, generator=generator) * scale).to(dtype)  # [batch, rows, width]
        assert torch.equal(rms_norm(norm, hidden), norm(hidden))


def test_lean_model_serves_plain_calls_and_leaves_the_rest_to_transformers():
    """Every hidden state, padded batches through generate, and the calls it hands back (attention
    weights, training) give what transformers' forward gives."""
    stock, lean = fresh_tiny(), fresh_tiny()
    OneDNNEngine(lean_forward=False).apply(stock)
    OneDNNEngine().apply(lean)
    input_ids = torch.tensor([prompt[:30] for prompt in random_prompts(2, seed=5)])  # [2, 30]
    padding = torch.ones_like(input_ids)
    padding[1, :3] = 0  # left padding on the second row
    with torch.inference_mode():
        expected, got = (model(input_ids=input_ids, attention_mask=padding, output_hidden_states=True)
                         for model in (stock, lean))
        assert len(got.hidden_states) == stock.config.num_hidden_layers + 1
        for a, b in zip((expected.logits, *expected.hidden_states), (got.logits, *got.hidden_states)):
            assert torch.equal(a, b)
        generated = [model.generate(input_ids, attention_mask=padding, max_new_tokens=6, do_sample=False)
                     for model in (stock, lean)]
        assert torch.equal(*generated)
    # attention weights: transformers' own blocks return them (the lean blocks do not)
    stock_blocks, lean_loop = fresh_tiny(), fresh_tiny()
    OneDNNEngine(lean_blocks=False, lean_forward=False).apply(stock_blocks)
    OneDNNEngine(lean_blocks=False).apply(lean_loop)
    assert type(lean_loop.model) is LeanLlamaModel
    with torch.inference_mode():
        for model in (stock_blocks, lean_loop):
            model.set_attn_implementation("eager")
        expected, got = (model(input_ids=input_ids, output_attentions=True) for model in (stock_blocks, lean_loop))
    assert len(got.attentions) == len(expected.attentions) == stock.config.num_hidden_layers
    assert all(torch.equal(a, b) for a, b in zip(expected.attentions, got.attentions))
    lean.train()
    assert torch.equal(lean(input_ids=input_ids).logits, stock.train()(input_ids=input_ids).logits)


def test_a_model_with_forward_hooks_keeps_transformers_forward():
    """A user's hook on a layer would be skipped by the lean loop, so that model is not swapped."""
    model = fresh_tiny()
    seen = []
    model.model.layers[1].register_forward_hook(lambda module, args, output: seen.append(1))
    OneDNNEngine().apply(model)
    assert type(model.model) is LlamaModel
    with torch.inference_mode():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert seen == [1]


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_lean_blocks_serve_transformers_own_attention_implementations(implementation):
    """Outside TargetModel (plain model call, transformers' cache and attention): still the stock result."""
    stock, lean = fresh_tiny(), fresh_tiny()
    OneDNNEngine(lean_blocks=False).apply(stock)
    OneDNNEngine().apply(lean)
    input_ids = torch.tensor(random_prompts(2, seed=3)[:1])  # [1, L]
    logits = []
    for model in (stock, lean):
        model.set_attn_implementation(implementation)
        with torch.inference_mode():
            logits.append(model(input_ids=input_ids).logits)
    assert torch.equal(*logits)


@pytest.mark.parametrize("split_rows", [0, 3])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 3, 16, 33])
def test_onednn_linear_matches_nn_linear(dtype, atol, rows, split_rows):
    generator = torch.Generator().manual_seed(rows)
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = (nn.Linear(40, out, bias=bias).to(dtype)
                                                   for out, bias in ((40, True), (24, False), (24, True)))
    parent.o_proj = nn.Linear(40, 40, bias=False).to(dtype)
    for parameter in parent.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator).to(dtype)
    x = torch.randn(2, rows, 40, generator=generator).to(dtype)  # [batch, rows, in]
    expected = {name: getattr(parent, name)(x) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    OneDNNEngine(fp32_split_rows=split_rows).apply(parent)
    assert parent.q_proj.packed is parent.v_proj.packed  # fused although only some have a bias
    for name in ("v_proj", "q_proj", "k_proj", "o_proj"):  # any call order
        out = getattr(parent, name)(x)
        assert out.shape == expected[name].shape and out.dtype == dtype
        torch.testing.assert_close(out.float(), expected[name].float(), atol=atol * 40 ** 0.5, rtol=atol)


def test_fused_member_with_another_input_computes_its_own_product():
    """The shared product is reused only for the very tensor that produced it."""
    parent = nn.Module()
    parent.gate_proj, parent.up_proj = nn.Linear(16, 8, bias=False), nn.Linear(16, 8, bias=False)
    x, y = torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    expected_gate, expected_up = parent.gate_proj(x), parent.up_proj(y)
    OneDNNEngine().apply(parent)
    torch.testing.assert_close(parent.gate_proj(x), expected_gate, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(parent.up_proj(y), expected_up, atol=1e-5, rtol=1e-5)
    y.add_(0)  # the same tensor again (in place, same object) is still y's product
    torch.testing.assert_close(parent.up_proj(y), expected_up, atol=1e-5, rtol=1e-5)


def test_engines_refuse_a_model_another_engine_rewrote_and_reapplying_is_a_no_op():
    model = fresh_tiny()
    OneDNNEngine().apply(model)
    packed = model.lm_head.packed
    OneDNNEngine().apply(model)  # pipelines sharing one model: nothing happens twice
    assert model.lm_head.packed is packed
    with pytest.raises(ConfigError, match="already rewritten for engine=fast.*load a fresh instance"):
        HFEngine().apply(model)
    HFEngine().apply(fresh_tiny())  # a stock model is fine


def test_fast_engine_falls_back_with_a_warning(monkeypatch, caplog):
    fp16 = fresh_tiny(dtype="fp16")
    with caplog.at_level(logging.WARNING):
        OneDNNEngine().apply(fp16)
    assert linears(fp16) and "no prepacked oneDNN path" in caplog.text
    monkeypatch.setattr(cpu, "onednn_available", lambda: False)
    model = fresh_tiny()
    with caplog.at_level(logging.WARNING):
        OneDNNEngine().apply(model)
    assert linears(model) and "has no oneDNN linear" in caplog.text
    assert getattr(model, "specpipe_engine", "hf") == "hf"  # still free for any engine


@pytest.mark.parametrize("engine", ["hf", "fast", "fast_prepacked"])
def test_every_engine_option_builds_and_decodes_like_greedy(engine, tiny_mixed):
    cfg = compose_config([*tiny_mixed.overrides, "pipeline=lookahead_trie", "cost_curve=flat", f"engine={engine}"])
    model = copy.deepcopy(tiny_mixed.reference)  # a stock instance with tiny_mixed's weights
    pipe = build_pipeline(cfg, loaded=LoadedModel(model, tiny_mixed.tokenizer, "tiny_mixed"))
    assert pipe.target.engine == engine
    assert bool(linears(model)) == (engine == "hf")
    prompt = [400, 401, 402, 403, 404] * 4
    assert pipe.generate(prompt, max_new_tokens=16).token_ids == tiny_mixed.greedy_hf(prompt, 16)


# ---- exactness ---------------------------------------------------------------------------
@pytest.mark.parametrize("pipeline", DRAFTING_PIPELINES)
def test_greedy_pipelines_equal_our_vanilla_tiny(tiny_mixed, pipeline):
    vanilla, pipe = tiny_mixed.pipeline("vanilla"), tiny_mixed.pipeline(pipeline)
    assert pipe.target.engine == vanilla.target.engine == "fast"
    drafted = 0
    for i, prompt in enumerate(random_prompts(24, seed=5)):
        expected, _ = run_steps(vanilla, prompt, 32)
        tokens, steps = run_steps(pipe, prompt, 32)
        assert tokens == expected, f"{pipeline}, prompt {i}"
        drafted += sum(step.drafted for step in steps)
    if pipeline not in HEAD_PIPELINES:  # its identity heads draft repeats, which tiny_mixed rarely makes
        assert drafted > 20  # not vacuous: the pipelines really verified drafts


@pytest.mark.embedded
def test_greedy_pipelines_equal_our_vanilla_embedded(embedded):
    vanilla = embedded.pipeline("vanilla")
    assert vanilla.target.engine == "fast"
    for text in EMBEDDED_PROMPTS[-2:]:
        prompt_ids = vanilla.encode(text)
        expected, _ = run_steps(vanilla, prompt_ids, 40)
        for name in DRAFTING_PIPELINES:
            tokens, _ = run_steps(embedded.pipeline(name), prompt_ids, 40)
            assert tokens == expected, f"{name} on {text[:30]!r}"


@pytest.mark.parametrize("model_name", ["tiny_mixed", "tiny_chaotic"])
def test_fast_vanilla_differs_from_transformers_only_at_near_ties_tiny(request, model_name):
    model = request.getfixturevalue(model_name)
    vanilla = model.pipeline("vanilla")
    for i, prompt in enumerate(random_prompts(30, seed=9)):
        tokens, _ = run_steps(vanilla, prompt, 24)
        divergence = near_tie_divergence(model, prompt, tokens, model.greedy_hf(prompt, 24))
        assert divergence is None or divergence[1] < NEAR_TIE, f"prompt {i}: diverged at {divergence}"


@pytest.mark.embedded
def test_fast_vanilla_differs_from_transformers_only_at_near_ties_embedded(embedded):
    """The real model over several kinds of prompts, 48 tokens each."""
    vanilla = embedded.pipeline("vanilla")
    diverged = []
    for text in EMBEDDED_PROMPTS:
        prompt_ids = vanilla.encode(text)
        tokens, _ = run_steps(vanilla, prompt_ids, 48)
        divergence = near_tie_divergence(embedded, prompt_ids, tokens, embedded.greedy_hf(prompt_ids, 48))
        if divergence is not None:
            diverged.append((text[:30], *divergence))
    assert all(gap < NEAR_TIE for _, _, gap in diverged), diverged


def test_near_tie_check_fails_on_a_real_divergence(tiny_mixed):
    """The check is not vacuous: a decoder that takes the second-best token at a clear gap fails it."""
    prompt = random_prompts(1, seed=9)[0]
    expected = tiny_mixed.greedy_hf(prompt, 8)
    gaps = [float(-tiny_mixed.causal_logits(prompt + expected[:i])[-1].topk(2).values.diff()) for i in range(8)]
    position = max(range(8), key=gaps.__getitem__)
    assert gaps[position] > 10 * NEAR_TIE
    logits = tiny_mixed.causal_logits(prompt + expected[:position])[-1]
    second = int(logits.topk(2).indices[1])
    ours = expected[:position] + [second]
    divergence = near_tie_divergence(tiny_mixed, prompt, ours, expected[: position + 1])
    assert divergence == (position, pytest.approx(gaps[position]))


# ---- what this CPU can run -----------------------------------------------------------------
AVX2_BF16_ERROR = ("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, "
                   "avx512vl and avx512dq")


def without_native_bf16(monkeypatch) -> None:
    """Simulates a CPU whose oneDNN has no bf16 kernel (an AVX2 CPU), whatever this one has."""
    real_probe = cpu._run_probe

    def probe(dtype: torch.dtype) -> str:
        if dtype == torch.bfloat16:
            raise RuntimeError(AVX2_BF16_ERROR)
        return real_probe(dtype)

    monkeypatch.setattr(cpu, "_run_probe", probe)


def test_the_probe_names_the_onednn_kernel_each_dtype_gets_here():
    fp32 = cpu.probe_linear_path(torch.float32)
    bf16 = cpu.probe_linear_path(torch.bfloat16)
    assert isinstance(fp32, cpu.LinearPath) and fp32.compute_dtype == torch.float32
    assert fp32.kernel != "unknown" and not fp32.kernel.startswith("ref")  # read from oneDNN's own verbose log
    assert isinstance(bf16, cpu.LinearPath) and not bf16.kernel.startswith("ref")
    # native bf16 only where the CPU has the instructions oneDNN's bf16 kernels need
    flags = cpu.cpu_description()["isa_flags"]
    if bf16.compute_dtype == torch.bfloat16:
        assert "avx512bw" in flags or "avx_ne_convert" in flags
    assert cpu.probe_linear_path(torch.bfloat16, prefer_fp32_compute=True).compute_dtype == torch.float32
    assert "no prepacked oneDNN path" in cpu.probe_linear_path(torch.float16)


def test_bf16_without_a_native_kernel_packs_fp32_weights_and_says_so(monkeypatch, caplog):
    without_native_bf16(monkeypatch)
    model, stock = fresh_tiny("bf16"), fresh_tiny("bf16")
    with caplog.at_level(logging.DEBUG):
        OneDNNEngine(bf16_small_rows=2, fp32_split_rows=3, bf16_kernel_rows=0).apply(model)  # no AVX2 kernel
    assert linears(model) == [] and model.specpipe_engine == "fast"
    packed = model.lm_head.packed
    assert packed.compute_dtype == torch.float32 and packed.packed.dtype == torch.float32
    assert packed.split_rows == 3 and packed.plain.dtype == torch.float32  # fp32 split GEMMs for the 3rd row
    line = [record.message for record in caplog.records if "bf16 linears" in record.message]
    assert len(line) == 1 and "avx512bw" in line[0]
    assert ("bf16 F.linear for up to 2 rows, fp32 GEMMs split over the threads by weight rows for up to 3 rows, "
            "prepacked fp32 oneDNN (inputs upcast from bf16) above") in line[0]
    calls = []
    monkeypatch.setattr(packed_weight, "split_linear", lambda *args: calls.append("split") or cpu.split_linear(*args))
    monkeypatch.setattr(packed_weight, "packed_linear", lambda *args: calls.append("onednn") or cpu.packed_linear(*args))
    # up to small_rows rows: transformers' own bf16 product on the untouched weight, bitwise
    hidden = model.config.hidden_size
    for rows in (1, 2):
        x = torch.randn(1, rows, hidden).bfloat16()  # [batch, rows, hidden]
        assert torch.equal(model.lm_head(x), stock.lm_head(x))
    assert calls == []
    # more rows (split GEMMs for 3, oneDNN for 4): the fp32 product of the bf16 values rounded to bf16,
    # as a bf16 GEMM's (which accumulates in fp32): only the order of the sums may differ, i.e. at
    # most one bf16 rounding step
    for rows in (3, 4):
        x = torch.randn(rows, hidden).bfloat16()  # [rows, hidden]
        out = model.lm_head(x)
        expected = torch.nn.functional.linear(x.float(), stock.lm_head.weight.float()).bfloat16()
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -7, atol=1e-5)
    assert calls == ["split", "onednn"]
    # a one-token step streams the bf16 weights, a verify the fp32 packing
    from specpipe.cost import streamed_weight_bytes

    stock_bytes = streamed_weight_bytes(stock)
    assert streamed_weight_bytes(model, rows=1) == stock_bytes
    assert streamed_weight_bytes(model, rows=3) > 1.9 * stock_bytes
    assert streamed_weight_bytes(model, rows=4) > 1.9 * stock_bytes


# ---- specpipe's CPU kernel (bf16 weights where oneDNN has no bf16 kernel; fp32 weights on AVX2) ----
# What building the kernel needs besides specpipe's own dependencies (ninja is one): where all of it is
# here, the kernel must build and run.
needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None
    or not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    or platform.machine().lower() not in ("x86_64", "amd64")
    or not {"avx2", "fma"} <= cpuinfo.cpu_flags(),
    reason="the CPU kernel is built with a C++ compiler and Python's headers for x86 CPUs with AVX2")


@needs_compiler
@pytest.mark.parametrize("isa", ["avx2", pytest.param("avx512", marks=pytest.mark.skipif(
    "avx512f" not in cpuinfo.cpu_flags(), reason="the AVX-512 build runs on CPUs with AVX-512F")),
    pytest.param("avx512_bf16", marks=pytest.mark.skipif(
        not {"avx512f", "avx512bw", "avx512_bf16"} <= cpuinfo.cpu_flags(), reason="pair products need AVX512_BF16"))])
def test_the_kernel_builds_and_equals_an_fp32_product_of_bf16_and_fp32_weights(isa):
    from specpipe.engine import cpu_kernel_build, cpu_kernel_checks

    built = cpu_kernel_build.build_kernel(None, isa)  # each build, whichever this CPU's engine uses
    cpu_kernel_checks.self_check(built.weight_product, built.quantized_product)
    product = built.weight_product
    kernel = SimpleNamespace(product=product)
    generator = torch.Generator().manual_seed(5)
    # a vector tail (75, 9, 600); every group size (1-8 rows, and 9-12 for bf16 pairs, two output features at
    # a time) and rows split into groups (up to 8: 9 = 5 + 4, 13 = 7 + 6, 19 = 7 + 6 + 6; pairs, up to 12:
    # 13 = 7 + 6, 19 = 10 + 9, 25 = 9 + 8 + 8); output features spanning several tiles of weight rows (96 at
    # 576 inputs is 4 tiles of up to 28), an odd count (37, 1: a last feature outside the pairs of features),
    # the last rows' prefetches past the weight's end
    for in_features in (9, 75, 576, 600):
        for out_features in (1, 37, 96):
            weight = torch.randn(out_features, in_features, generator=generator).bfloat16()  # [out, in]
            for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 19, 25):
                x = torch.randn(rows, in_features, generator=generator)  # [rows, in]
                fp32_out = kernel.product(x, weight, None)  # [rows, out] fp32
                torch.testing.assert_close(fp32_out, x @ weight.float().t(), rtol=1e-5, atol=1e-4)
                # fp32 weights: the same sums over the weights as they are, the bias added once
                fp32_weight = torch.randn(out_features, in_features, generator=generator)  # [out, in]
                bias = torch.randn(out_features, generator=generator)  # [out]
                torch.testing.assert_close(kernel.product(x, fp32_weight, bias),
                                           torch.addmm(bias, x, fp32_weight.t()), rtol=1e-5, atol=1e-4)
                # bf16 rows in, bf16 out, with the fp32 bias added before rounding
                bias = torch.randn(out_features, generator=generator)  # [out]
                x = x.bfloat16()
                out = kernel.product(x, weight, bias)
                assert out.dtype == torch.bfloat16
                if isa == "avx512_bf16":  # bf16 pairs multiplied by the CPU: the fp32 sum in another order
                    reference = (x.float() @ weight.float().t() + bias).bfloat16()
                    torch.testing.assert_close(out.float(), reference.float(), rtol=2 ** -7, atol=1e-4)
                else:  # widened and rounded inside: bitwise what casting around the fp32 product gives
                    assert torch.equal(out, (kernel.product(x.float(), weight, None) + bias).bfloat16())
    # leading dimensions and a non-contiguous input
    x = torch.randn(2, 3, 75 * 2, generator=generator).bfloat16()[..., ::2]  # [2, 3, 75], strided
    weight = torch.randn(37, 75, generator=generator).bfloat16()
    out = kernel.product(x, weight, None)
    assert out.shape == (2, 3, 37) and out.dtype == torch.bfloat16
    assert torch.equal(out, kernel.product(x.reshape(6, 75).contiguous(), weight, None).view(2, 3, 37))
    with pytest.raises(RuntimeError, match="x: fp32 or bf16"):
        kernel.product(torch.randn(2, 75).half(), weight, None)
    with pytest.raises(RuntimeError, match="disagree on in_features"):
        kernel.product(torch.randn(2, 74), weight, None)
    with pytest.raises(RuntimeError, match="bias: contiguous fp32"):
        kernel.product(torch.randn(2, 75), weight, torch.randn(36))
    with pytest.raises(RuntimeError, match="weight: contiguous bf16 or fp32"):
        kernel.product(torch.randn(2, 75), weight.half(), None)


@needs_compiler
@pytest.mark.parametrize("isa", ["avx2", pytest.param("avx512", marks=pytest.mark.skipif(
    "avx512f" not in cpuinfo.cpu_flags(), reason="the AVX-512 build runs on CPUs with AVX-512F")),
    pytest.param("avx512_bf16", marks=pytest.mark.skipif(
        not {"avx512f", "avx512bw", "avx512_bf16"} <= cpuinfo.cpu_flags(), reason="pair products need AVX512_BF16"))])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tiles", [False, True], ids=["vectors", "tiles"])
def test_the_kernels_attention_equals_sdpa_over_tree_masks_and_cache_rows(isa, dtype, tolerance, tiles):
    """The decoding attention of each build against SDPA in fp32: head sizes of its register paths (64 and
    128, and 32 on the AVX2 build; bf16 keys times bf16 queries in pairs on the AVX512_BF16 build, and with `tiles`
    bf16 heads of 64 dims on AMX tiles where the CPU has them) and odd ones, 1-13 query rows under ancestor masks, keys
    and values read as strided rows of a larger cache, 1, 3, 4 and 8 query heads per KV head."""
    from specpipe.engine import cpu_kernel_build

    module = cpu_kernel_build.build_kernel(None, isa)
    if tiles and (isa != "avx512_bf16" or "amx_bf16" not in cpuinfo.cpu_flags() or not module.amx_request()):
        pytest.skip("bf16 heads attend on AMX tiles on the AVX512_BF16 build, where the CPU has them and Linux grants "
                    "them")
    before = module.attention_tiles_on()
    assert module.set_attention_tiles(tiles) == tiles  # the process-wide setting, for this test alone
    try:
        check_the_kernels_attention(module.tree_attention, dtype, tolerance)
    finally:
        module.set_attention_tiles(before)


def check_the_kernels_attention(attention, dtype: torch.dtype, tolerance: float) -> None:
    from specpipe.engine import cpu_kernel_checks

    generator = torch.Generator().manual_seed(11)
    for head_dim in (64, 128, 32, 24, 72):
        for q, kv in ((1, 1), (1, 300), (2, 19), (5, 64), (13, 77)):
            cache = torch.randn(2, 1, 3, 320, head_dim, generator=generator).to(dtype)  # [K|V, 1, kv_heads, 320, hd]
            key, value = cache[0, :, :, :kv], cache[1, :, :, :kv]  # [1, 3, kv, hd]: the cache's strides
            fused = torch.randn(1, q, 12, head_dim, generator=generator).to(dtype) * 3  # q|k|v heads of a step
            query = fused[:, :, :9].transpose(1, 2)  # [1, 9, q, hd], as the lean block hands it over
            mask = None
            if q > 1:
                mask = torch.ones(q, kv, dtype=torch.bool)
                mask[:, kv - q:] = torch.eye(q, dtype=torch.bool) | (torch.rand(q, q, generator=generator) < 0.4).tril()
            expected = cpu_kernel_checks.sdpa_reference(query, key, value, mask, head_dim ** -0.5)
            got = attention(query, key, value, mask, head_dim ** -0.5)
            assert got.shape == (1, q, 9, head_dim) and got.dtype == dtype and got.is_contiguous()
            torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=0,
                                       msg=lambda m: f"head_dim {head_dim}, {q} rows, {kv} keys: {m}")
            if (q, kv) not in ((1, 300), (5, 64)):
                continue
            # other numbers of query heads per KV head: one (no grouping), and 4 and 8, which attend in
            # chunks of 4, 2 or 1 heads together depending on the head size and the build
            for groups in (1, 4, 8):
                query = torch.randn(1, 3 * groups, q, head_dim, generator=generator).to(dtype) * 3
                expected = cpu_kernel_checks.sdpa_reference(query, key, value, mask, head_dim ** -0.5)
                got = attention(query, key, value, mask, head_dim ** -0.5)
                torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=0,
                                           msg=lambda m: f"head_dim {head_dim}, {groups} heads per KV head, {q} rows: {m}")
    # a masked key adds exactly nothing, however large its value
    key, value = torch.randn(2, 1, 1, 40, 64, generator=generator).to(dtype)
    value[:, :, -1] = 1e30
    query = torch.randn(1, 2, 2, 64, generator=generator).to(dtype)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, -1] = False
    got = attention(query, key, value, mask, 0.125)
    assert torch.isfinite(got[0, 0]).all()
    torch.testing.assert_close(got[0, 0].float(), cpu_kernel_checks.sdpa_reference(
        query[:, :, :1], key[:, :, :-1], value[:, :, :-1], None, 0.125)[0, 0], atol=tolerance, rtol=0)
    with pytest.raises(RuntimeError, match="key and value: query's dtype"):
        attention(query.float() if dtype == torch.bfloat16 else query.bfloat16(), key, value, None, 0.125)
    with pytest.raises(RuntimeError, match="divide its heads"):
        attention(torch.randn(1, 3, 1, 64).to(dtype), torch.randn(1, 2, 5, 64).to(dtype),
                  torch.randn(1, 2, 5, 64).to(dtype), None, 0.125)
    with pytest.raises(RuntimeError, match=r"mask: bool \[q, kv\]"):
        attention(query, key, value, torch.ones(2, 39, dtype=torch.bool), 0.125)
    # every build: a row gets, bit for bit, what one row gets over the keys it sees stored one after another (a
    # tree node's verify row is then its path's one-token step), whether its unseen keys trail, sit between the
    # ones it sees (a side branch's ancestors), or none are hidden, for every path's head size and grouping (on
    # the tiles: rows in groups of up to 16 query vectors, keys in blocks of 16 and chunks of 32 a row's run ends in)
    for head_dim in (64, 128, 24):
        for kv in (1, 5, 16, 17, 40, 47, 70, 100):
            for groups in (1, 3, 4):
                cache = torch.randn(2, 1, 2, kv + 9, head_dim, generator=generator).to(dtype)  # [K|V, 1, 2, kv + 9, hd]
                query = torch.randn(1, 2 * groups, 6, head_dim, generator=generator).to(dtype)
                mask = torch.rand(6, kv + 9, generator=generator) < 0.6
                mask[:, :kv] = True  # a committed prefix, then tree rows seen or not
                mask[0, kv:] = False
                got = attention(query, cache[0], cache[1], mask, 0.125)
                for row in range(6):
                    seen = mask[row].nonzero().flatten()
                    alone = attention(query[:, :, row:row + 1], cache[0][:, :, seen], cache[1][:, :, seen], None,
                                      0.125)
                    assert torch.equal(got[:, row:row + 1], alone), (head_dim, kv, groups, row)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_avx2_build_a_query_head_gets_the_same_bits_however_many_heads_share_its_kv_head(dtype):
    """The AVX2 build's registers hold one head's query row, so the heads of one KV head are streamed over each
    key and value row together (attend_heads_streamed), each summed exactly as one head alone is: a head's output
    is bitwise its own call's with one query head per KV head, for 2, 3, 4 and 8 heads per KV head, tree rows and
    odd key counts."""
    from specpipe.engine import cpu_kernel_build

    attention = cpu_kernel_build.build_kernel(None, "avx2").tree_attention
    generator = torch.Generator().manual_seed(5)
    for head_dim in (64, 128):
        for groups in (2, 3, 4, 8):
            for q, kv in ((1, 1), (1, 7), (1, 130), (4, 33)):
                cache = torch.randn(2, 1, 2, kv + 4, head_dim, generator=generator).to(dtype)
                key, value = cache[0, :, :, :kv], cache[1, :, :, :kv]  # [1, 2, kv, hd], the cache's strides
                query = torch.randn(1, 2 * groups, q, head_dim, generator=generator).to(dtype)
                mask = None
                if q > 1:
                    mask = torch.ones(q, kv, dtype=torch.bool)
                    mask[:, kv - q:] = torch.eye(q, dtype=torch.bool) | (torch.rand(q, q, generator=generator) < 0.5).tril()
                together = attention(query, key, value, mask, head_dim ** -0.5)  # [1, q, heads, hd]
                for head in range(2 * groups):
                    kv_head = head // groups
                    alone = attention(query[:, head:head + 1], key[:, kv_head:kv_head + 1],
                                      value[:, kv_head:kv_head + 1], mask, head_dim ** -0.5)
                    assert torch.equal(together[:, :, head:head + 1], alone), (head_dim, groups, q, kv, head)


@needs_compiler
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_lean_forward_runs_prompts_steps_and_tree_verifies_through_the_kernels_attention(dtype):
    """A prompt (causal, no mask given), one token and a tree verify go through the kernel's attention (a
    block above KERNEL_ATTENTION_MAX_ROWS does not), and give the hidden states and logits SDPA's path
    gives: fp32 to float rounding with the same argmax in every row."""
    from specpipe.engine import cpu_kernel_build, lean_model

    with_kernel, with_sdpa = fresh_tiny(dtype), fresh_tiny(dtype)
    OneDNNEngine().apply(with_kernel)
    OneDNNEngine(kernel_attention=False).apply(with_sdpa)
    assert with_kernel.model.attention_kernel is not None and with_sdpa.model.attention_kernel is None
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    isa = cpu_kernel_build.kernel_isa()
    on_tiles = torch_dtype == torch.bfloat16 and "amx" in cpu.probe_linear_path(torch.bfloat16).kernel
    assert with_kernel.model.attention_max_rows == lean_model.kernel_attention_max_rows(isa, on_tiles)
    assert with_kernel.model.attention_max_rows[torch_dtype] == (
        min(lean_model.KERNEL_ATTENTION_MAX_ROWS[isa][torch_dtype], lean_model.AMX_BF16_ATTENTION_MAX_ROWS) if on_tiles
        else lean_model.KERNEL_ATTENTION_MAX_ROWS[isa][torch_dtype])
    prompt = random_prompts(1, seed=4)[0]
    limit = max(len(prompt), 8)  # the prompt's rows are the most the kernel serves here
    with_kernel.model.attention_max_rows = {torch_dtype: limit}
    rows_seen = []
    kernel = with_kernel.model.attention_kernel
    with_kernel.model.attention_kernel = lambda query, *rest: rows_seen.append(query.shape[2]) or kernel(query, *rest)
    tree = DraftTree.from_parents(torch.arange(300, 305), torch.tensor([-1, 0, 0, 1, 3]))
    long_tree = DraftTree.from_parents(torch.arange(300, 300 + limit), torch.arange(-1, limit - 1))
    outputs, prompt_hidden = [], []
    for model in (with_kernel, with_sdpa):
        target = TargetModel(model, engine="fast")
        cache = target.new_cache()
        prefill = target.prefill(prompt, cache)
        step = target.forward_tree(prompt[-1], DraftTree.empty(), cache)
        verify = target.forward_tree(300, tree, cache)
        long_verify = target.forward_tree(301, long_tree, cache)  # 1 + limit rows: SDPA's
        outputs.append((prefill.logits, step.logits, verify.logits, long_verify.logits))
        prompt_hidden.append(prefill.hidden)  # [len(prompt), hidden]: every row's causal attention
    layers = with_kernel.config.num_hidden_layers
    assert rows_seen == [len(prompt)] * layers + [1] * layers + [6] * layers
    tolerance = 1e-4 if dtype == "fp32" else 0.1
    torch.testing.assert_close(*prompt_hidden, atol=tolerance, rtol=0)
    for got, expected in zip(*outputs):
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=0)
        if dtype == "fp32":
            assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_the_kernel_is_built_for_the_isa_aten_runs(monkeypatch):
    from specpipe.engine import cpu_kernel_build

    monkeypatch.setattr(cpu_kernel_build, "cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"})
    monkeypatch.setattr(cpu_kernel_build, "aten_capability", lambda: "AVX512")
    assert cpu_kernel_build.kernel_isa() == "avx512_bf16"
    assert cpu_kernel_build.build_name().startswith("specpipe_kernel_avx512_bf16_")
    monkeypatch.setattr(cpu_kernel_build, "cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    assert cpu_kernel_build.kernel_isa() == "avx512" and cpu_kernel_build.build_name().startswith("specpipe_kernel_avx512_")
    monkeypatch.setattr(cpu_kernel_build, "aten_capability", lambda: "AVX2")  # ATEN_CPU_CAPABILITY=avx2 holds it back
    assert cpu_kernel_build.kernel_isa() == "avx2" and cpu_kernel_build.build_name().startswith("specpipe_kernel_avx2_")
    monkeypatch.setattr(cpu_kernel_build, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(cpu_kernel_build, "aten_capability", lambda: "AVX512")
    assert cpu_kernel_build.kernel_isa() == "avx2"
    assert len({cpu_kernel_build.build_name(isa) for isa in cpu_kernel_build.ISA_FLAGS}) == 3


@needs_compiler
def test_the_weight_prefetch_hint_is_a_build_of_its_own_that_computes_the_same(monkeypatch):
    """engine.weight_prefetch only changes where the streamed weights are cached: each hint is its own build
    (its own name, so cost curves are measured apart), and their products are bitwise equal."""
    from specpipe.engine import cpu_kernel, cpu_kernel_build

    assert cpu_kernel_build.build_name(weight_prefetch="nta") != cpu_kernel_build.build_name(weight_prefetch="t0")
    kernels = {hint: cpu_kernel.CpuKernel(weight_prefetch=hint) for hint in cpu_kernel_build.WEIGHT_PREFETCH_HINTS}
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(300, 96, generator=generator).bfloat16()  # [out, in]
    for rows in (1, 4, 13):
        x = torch.randn(rows, 96, generator=generator)  # [rows, in]
        products = [kernel.product(x, weight, None) for kernel in kernels.values()]
        assert all(kernel.product is not None for kernel in kernels.values())
        assert torch.equal(products[0], products[1])
    built = []
    monkeypatch.setattr(cpu_kernel, "CpuKernel", lambda weight_prefetch="nta", **_: built.append(weight_prefetch)
                        or kernels[weight_prefetch])
    OneDNNEngine(weight_prefetch="t0").apply(fresh_tiny().to(torch.bfloat16))
    assert built and set(built) == {"t0"}
    with pytest.raises(ConfigError, match="engine.weight_prefetch must be one of"):
        OneDNNEngine(weight_prefetch="l2")
    with pytest.raises(ValueError, match="weight_prefetch must be one of"):
        cpu_kernel_build.build_name(weight_prefetch="T0")


@needs_compiler
def test_the_kernels_rms_norm_is_bitwise_transformers_and_the_check_catches_another_order():
    from specpipe.engine import cpu_kernel, cpu_kernel_checks

    kernel = cpu_kernel.CpuKernel()
    assert kernel.product is not None, kernel.reason
    if kernel.norm is None:  # this torch sums in another order than ATen's AVX2 cascade: said, not used
        assert kernel.norm_reason.startswith("its RMSNorm is not bitwise torch's here")
        pytest.skip(kernel.norm_reason)
    generator = torch.Generator().manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16):
        for width, rows in ((576, 1), (576, 16), (960, 3), (7, 2), (4100, 1), (128, 300)):
            for scale in (1e-3, 1.0, 50.0):
                norm = LlamaRMSNorm(width, eps=1e-6)
                norm.weight.data = (torch.rand(width, generator=generator) * 2).to(dtype)
                hidden = (torch.randn(1, rows, width, generator=generator) * scale).to(dtype)  # [1, rows, width]
                assert torch.equal(kernel.norm(hidden, norm.weight, norm.variance_epsilon), norm(hidden))
    # a norm summing in another order (float64, then rounded) is caught by the load-time check
    assert cpu_kernel_checks.norm_mismatch(
        lambda x, weight, eps: weight * (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
                                         ).float().to(x.dtype))
    with pytest.raises(RuntimeError, match="weight: \\[n\\] of x's dtype"):
        kernel.norm(torch.randn(2, 8), torch.ones(8).bfloat16(), 1e-6)


@needs_compiler
def test_the_kernels_silu_gate_is_bitwise_torchs_where_it_serves_and_the_check_catches_another_exp():
    """CpuKernel.gate against F.silu(gate) * up over the halves of one product's rows (the lean MLP's layout), fp32
    and bf16, one row to the most rows it serves; where ATen's silu would run over threads or with a scalar tail
    the kernel does not serve; a gate whose exp rounds otherwise is caught by the load-time check; bad input is
    refused by name."""
    import torch.nn.functional as F

    from specpipe.engine import cpu_kernel, cpu_kernel_checks

    kernel = cpu_kernel.CpuKernel()
    assert kernel.product is not None, kernel.reason
    if kernel.gate is None:  # this torch's silu rounds otherwise: said, and torch's ops serve
        assert kernel.gate_reason.startswith("its SiLU gate is not bitwise torch's here")
        pytest.skip(kernel.gate_reason)
    generator = torch.Generator().manual_seed(12)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, intermediate in ((1, 1536), (9, 1536), (21, 1536), (3, 64), (1, 28672)):
            assert cpu_kernel_checks.serves_gate(rows, intermediate)
            gate_up = (torch.randn(1, rows, 2 * intermediate, generator=generator) * 6).to(dtype)  # [1, rows, 2n]
            gate, up = gate_up.split(intermediate, dim=-1)
            got = kernel.gate(gate_up)
            assert got.shape == (1, rows, intermediate) and torch.equal(got, F.silu(gate) * up), (dtype, rows)
    assert not cpu_kernel_checks.serves_gate(22, 1536)  # 33792 values: ATen splits them over its threads
    assert not cpu_kernel_checks.serves_gate(1, 1000)  # not whole vector steps: ATen's scalar tail
    # silu computed in fp64 and rounded once rounds some value otherwise than ATen's fp32 vector exp
    assert cpu_kernel_checks.gate_mismatch(lambda gate_up: (
        F.silu(gate_up.double()[..., :gate_up.shape[-1] // 2]) * gate_up.double()[..., gate_up.shape[-1] // 2:]
    ).to(gate_up.dtype))
    with pytest.raises(RuntimeError, match="a multiple of"):
        kernel.gate(torch.randn(2, 30))
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        kernel.gate(torch.randn(2, 64).half())


@needs_compiler
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_lean_mlp_gates_through_the_kernel_where_it_serves_and_computes_the_same(dtype):
    """engine=fast's MLP blocks hand steps' and verifies' gates to CpuKernel.gate and a long prompt's to torch;
    the logits equal, bit for bit, those of engine.kernel_gate=false."""
    with_gate, without = fresh_tiny(dtype), fresh_tiny(dtype)
    OneDNNEngine().apply(with_gate)
    OneDNNEngine(kernel_gate=False).apply(without)
    mlps = [module for module in with_gate.modules() if isinstance(module, FusedGatedMLP)]
    assert mlps and all(module._gate_kernel is None for module in without.modules() if isinstance(module, FusedGatedMLP))
    if mlps[0]._gate_kernel is None:
        pytest.skip("the kernel's gate does not serve here: " + getattr(with_gate, REWRITE_ATTRIBUTE))
    calls = []
    for module in mlps:
        kernel = module._gate_kernel
        module._gate_kernel = lambda gate_up, kernel=kernel: calls.append(gate_up.shape[1]) or kernel(gate_up)
    intermediate = mlps[0].intermediate_size
    long_prompt = 32768 // intermediate + 1  # rows whose gate ATen would spread over threads
    generator = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for rows in (1, 5, long_prompt):
            tokens = torch.randint(0, with_gate.config.vocab_size, (1, rows), generator=generator)
            calls.clear()
            assert torch.equal(with_gate(tokens).logits, without(tokens).logits), rows
            assert calls == ([rows] * len(mlps) if rows < long_prompt else []), rows


@needs_compiler
@pytest.mark.parametrize("rows", [1, 5])
def test_lean_forward_with_the_kernels_norm_computes_what_transformers_forward_computes(monkeypatch, caplog, rows):
    """A CPU without a oneDNN bf16 kernel: the bf16 products and norms in specpipe's kernel, the lean
    forward against transformers' own over the same products, bitwise."""
    without_native_bf16(monkeypatch)
    stock, lean = fresh_tiny("bf16"), fresh_tiny("bf16")
    OneDNNEngine(lean_forward=False).apply(stock)
    with caplog.at_level(logging.DEBUG):
        OneDNNEngine(kernel_attention=False).apply(lean)
    from specpipe.engine.cpu_kernel import auto_block_lookahead_rows
    from specpipe.engine.cpu_kernel_build import build_name

    engine_build = build_name(block_lookahead_rows=auto_block_lookahead_rows())  # the build engine=fast loads here
    if lean.model.norm_kernel is None:
        assert "1 model forward lean (RMSNorm in torch: its RMSNorm is not bitwise torch's here" in caplog.text
    else:
        assert f"1 model forward lean (RMSNorm in specpipe's kernel {engine_build}" in caplog.text
    assert_same_forwards(stock, lean, rows)
    # a norm cast to another dtype than the hidden states after the swap: torch's norm serves them all
    # (the kernel would refuse the mixed dtypes)
    for model in (stock, lean):
        model.model.norm.weight.data = model.model.norm.weight.data.float()
    tokens = torch.tensor([[5, 6, 7]])
    assert torch.equal(lean(input_ids=tokens).logits, stock(input_ids=tokens).logits)


@needs_compiler
def test_bf16_without_a_native_kernel_runs_few_rows_through_the_bf16_kernel(monkeypatch, caplog):
    without_native_bf16(monkeypatch)
    model, stock = fresh_tiny("bf16"), fresh_tiny("bf16")
    with caplog.at_level(logging.DEBUG):  # the row-by-row product, which an AVX2 CPU's kernel has (no column blocks)
        OneDNNEngine(bf16_kernel_rows=5, kernel_blocks=False).apply(model)
    from specpipe.engine.cpu_kernel import auto_block_lookahead_rows
    from specpipe.engine.cpu_kernel_build import build_name

    engine_build = build_name(block_lookahead_rows=auto_block_lookahead_rows())  # the build engine=fast loads here

    # the kernel's build is named: a cost curve measured with another version of it is not reused
    assert (f"bf16 weights summed in fp32 (specpipe's CPU kernel {engine_build}) for up to 5 rows"
            in caplog.text)
    packed = model.lm_head.packed
    assert packed.kernel_rows == 5 and packed.small_weight.dtype == torch.bfloat16 and packed.split_rows == 0
    calls = []
    kernel = packed.kernel
    monkeypatch.setattr(packed, "kernel", lambda *args: calls.append("kernel") or kernel(*args))
    monkeypatch.setattr(packed_weight, "packed_linear", lambda *args: calls.append("onednn") or cpu.packed_linear(*args))
    hidden = model.config.hidden_size
    for rows in (1, 5, 6):
        x = torch.randn(1, rows, hidden).bfloat16()  # [batch, rows, hidden]
        out = model.lm_head(x)
        # the fp32 product of the bf16 values rounded once to bf16, as a bf16 GEMM's
        expected = torch.nn.functional.linear(x.float(), stock.lm_head.weight.float()).bfloat16()
        assert out.dtype == torch.bfloat16 and out.shape == expected.shape
        torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -7, atol=1e-5)
    assert calls == ["kernel", "kernel", "onednn"]
    from specpipe.cost import streamed_weight_bytes

    assert streamed_weight_bytes(model, rows=5) == streamed_weight_bytes(stock)  # the bf16 bytes
    assert streamed_weight_bytes(model, rows=6) > 1.9 * streamed_weight_bytes(stock)
    for bad in ("all", -1, 1.5):
        with pytest.raises(ConfigError, match="engine.bf16_kernel_rows must be 'auto' or a row count"):
            OneDNNEngine(bf16_kernel_rows=bad)


@needs_compiler
def test_fp32_products_of_few_rows_run_the_kernel_on_the_fp32_weights(monkeypatch, caplog):
    model, stock = fresh_tiny(), fresh_tiny()
    with caplog.at_level(logging.DEBUG):
        OneDNNEngine(fp32_kernel_rows=5, fp32_split_rows=2).apply(model)
    from specpipe.engine.cpu_kernel import auto_block_lookahead_rows
    from specpipe.engine.cpu_kernel_build import build_name

    engine_build = build_name(block_lookahead_rows=auto_block_lookahead_rows())  # the build engine=fast loads here

    assert (f"fp32 weights streamed once for all rows (specpipe's CPU kernel {engine_build}) for up to 5 rows"
            in caplog.text and "engine.fp32_kernel_rows=5" in caplog.text)
    packed = model.lm_head.packed
    # the kernel serves the rows split GEMMs would have: no plain copy for them
    assert packed.kernel_rows == 5 and packed.small_weight.dtype == torch.float32 and packed.split_rows == 0
    assert packed.plain is None
    calls = []
    kernel = packed.kernel
    monkeypatch.setattr(packed, "kernel", lambda *args: calls.append("kernel") or kernel(*args))
    monkeypatch.setattr(packed_weight, "packed_linear", lambda *args: calls.append("onednn") or cpu.packed_linear(*args))
    for rows in (1, 5, 6):
        x = torch.randn(1, rows, model.config.hidden_size)  # [batch, rows, hidden]
        torch.testing.assert_close(model.lm_head(x), stock.lm_head(x), rtol=1e-5, atol=1e-5)
    assert calls == ["kernel", "kernel", "onednn"]
    from specpipe.cost import streamed_weight_bytes

    assert streamed_weight_bytes(model, rows=5) == streamed_weight_bytes(stock)
    for bad in ("all", -1, 1.5):
        with pytest.raises(ConfigError, match="engine.fp32_kernel_rows must be 'auto' or a row count"):
            OneDNNEngine(fp32_kernel_rows=bad)


def test_auto_kernel_rows_follow_what_was_measured_against_onednn(monkeypatch):
    """auto: the kernel where it outran oneDNN (AVX2 fp32, bf16 packed in fp32, AVX-512 up to 8 rows, 24 bf16
    rows with pair products, 64 in column blocks; 12 in column blocks on AMX CPUs), not AMX's other cases, under
    oneDNN's other bf16 kernels or off x86."""
    def rows(dtype, compute, kernel, isa="avx512"):
        return cpu.auto_kernel_rows(cpu.LinearPath(dtype, compute, kernel, ""), isa)

    fp32, bf16 = torch.float32, torch.bfloat16
    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    assert rows(fp32, fp32, "brg_matmul:avx2", "avx2") == cpu.AUTO_FP32_KERNEL_ROWS == 16
    assert rows(bf16, fp32, "brg_matmul:avx2", "avx2") == cpu.AUTO_BF16_UPCAST_KERNEL_ROWS == 32
    assert rows(fp32, fp32, "brg_matmul:avx512_core") == cpu.AUTO_KERNEL_ROWS_AVX512 == 8
    assert rows(fp32, fp32, "brg_matmul:avx512_core", "avx512_bf16") == 8  # pairs are for bf16 weights
    assert rows(bf16, bf16, "brg_matmul:avx512_core_bf16") == 8
    assert rows(bf16, bf16, "brg_matmul:avx512_core_bf16", "avx512_bf16") == cpu.AUTO_BF16_PAIR_KERNEL_ROWS == 24
    blocks = cpu.LinearPath(bf16, bf16, "brg_matmul:avx512_core_bf16", "", kernel_blocks=True)
    assert cpu.auto_kernel_rows(blocks, "avx512_bf16") == cpu.AUTO_BF16_BLOCK_KERNEL_ROWS == 64
    assert rows(fp32, fp32, "brgemm:avx512_core_amx") == 0
    assert rows(bf16, bf16, "brgemm:avx512_core_amx_bf16", "avx512_bf16") == 0  # pairs, not column blocks
    amx_blocks = cpu.LinearPath(bf16, bf16, "brg_matmul:avx10_1_512_amx", "", kernel_blocks=True)
    assert cpu.auto_kernel_rows(amx_blocks, "avx512_bf16") == cpu.AUTO_BF16_AMX_KERNEL_ROWS == 12
    assert cpu.auto_kernel_rows(amx_blocks, "avx512") == 0  # no pair products: not measured on AMX
    assert rows(bf16, bf16, "brg_matmul:avx2_vnni_2", "avx2") == 0
    monkeypatch.setattr(cpu.platform, "machine", lambda: "aarch64")
    assert rows(fp32, fp32, "gemm:acl", "avx2") == 0


def test_on_amx_cpus_auto_runs_the_kernel_only_in_column_blocks(monkeypatch):
    """On a CPU whose oneDNN bf16 kernel is AMX, engine.bf16_kernel_rows=auto serves 12 rows where the kernel loads
    with column blocks (12 too where branched trees take AMX tiles: chains keep the vector product, which would lose to
    oneDNN from 13 rows), and leaves every product to oneDNN, saying
    why, where it loads without them or blocks are off. The kernel is a stand-in, so the test runs alike on every
    machine."""
    import specpipe.engine.cpu_kernel as cpu_kernel
    import specpipe.engine.cpu_kernel_build as cpu_kernel_build

    def stand_in(blocks, amx=False):
        return lambda **_: SimpleNamespace(product=lambda *args: None, blocks=blocks, isa="avx512_bf16" if blocks
                                           else "avx512", build="stand-in", reason="", amx=amx,
                                           amx_reason="" if amx else "a stand-in")

    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_kernel_build, "kernel_isa", lambda: "avx512_bf16")
    amx = cpu.LinearPath(torch.bfloat16, torch.bfloat16, "brg_matmul:avx10_1_512_amx", "probed")
    monkeypatch.setattr(cpu_kernel, "CpuKernel", stand_in(blocks=object()))
    path, kernel = OneDNNEngine()._with_kernel(amx)
    assert kernel is not None and path.kernel_blocks and path.kernel_rows == cpu.AUTO_BF16_AMX_KERNEL_ROWS == 12
    assert "outran oneDNN's brg_matmul:avx10_1_512_amx for up to 12 rows" in path.reason
    monkeypatch.setattr(cpu_kernel, "CpuKernel", stand_in(blocks=object(), amx=True))
    path, kernel = OneDNNEngine(amx_rows=6)._with_kernel(amx)
    assert path.kernel_rows == cpu.AUTO_BF16_AMX_KERNEL_ROWS == 12 and path.kernel_amx_rows == 6
    assert "in column blocks (on AMX tiles from 6 rows in branched trees)" in path.describe()
    monkeypatch.setattr(cpu_kernel, "CpuKernel", stand_in(blocks=object()))
    path, kernel = OneDNNEngine(kernel_blocks=False)._with_kernel(amx)
    assert kernel is None and path.kernel_rows == 0
    assert "outruns it on such CPUs" in OneDNNEngine(kernel_blocks=False)._no_kernel_reason(amx)
    monkeypatch.setattr(cpu_kernel, "CpuKernel", stand_in(blocks=None))
    path, kernel = OneDNNEngine()._with_kernel(amx)
    assert kernel is None and path.kernel_rows == 0
    assert "only in column blocks, which its avx512 build lacks" in path.reason


def assert_output_layer_rounds_once(model: nn.Module, stock: nn.Module, rows: tuple[int, ...]) -> None:
    """`model`'s rewritten bf16 output layer gives the fp32 product of the bf16 values rounded once to bf16, as a bf16
    GEMM's, for products of each number of `rows`."""
    for count in rows:
        x = torch.randn(1, count, model.config.hidden_size).bfloat16()  # [batch, rows, hidden]
        expected = torch.nn.functional.linear(x.float(), stock.lm_head.weight.float()).bfloat16()
        out = model.lm_head(x)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -7, atol=1e-5)


@needs_compiler
@pytest.mark.skipif(cpu.probe_linear_path(torch.bfloat16).compute_dtype != torch.bfloat16,
                    reason="oneDNN runs bf16 natively only on CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT")
def test_native_bf16_products_of_few_rows_run_the_kernel_with_the_bias_in_fp32(monkeypatch, caplog):
    """Where oneDNN has a bf16 kernel, the kernel serves the few rows (bf16 in, bf16 out) and oneDNN's bf16
    packing the rest; a bf16 bias is widened for the kernel, and both round one fp32 sum once."""
    model, stock = fresh_tiny("bf16"), fresh_tiny("bf16")
    with caplog.at_level(logging.DEBUG):  # the row-by-row product (the column blocks: the test after this one)
        OneDNNEngine(bf16_kernel_rows=5, kernel_blocks=False).apply(model)
    assert "bf16 weights summed in fp32" in caplog.text and "prepacked bf16 oneDNN above" in caplog.text
    packed = model.lm_head.packed
    assert packed.compute_dtype == torch.bfloat16 and packed.packed.dtype == torch.bfloat16 and packed.kernel_rows == 5
    calls = []
    kernel = packed.kernel
    monkeypatch.setattr(packed, "kernel", lambda *args: calls.append("kernel") or kernel(*args))
    monkeypatch.setattr(packed_weight, "packed_linear", lambda *args: calls.append("onednn") or cpu.packed_linear(*args))
    assert_output_layer_rounds_once(model, stock, rows=(1, 5, 6))
    assert calls == ["kernel", "kernel", "onednn"]
    linear = nn.Linear(75, 37).bfloat16()  # [out, in] with a bias [out]
    with_bias = onednn.PackedWeight([linear], torch.bfloat16, kernel=kernel, kernel_rows=4)
    assert with_bias.kernel_bias.dtype == torch.float32
    x = torch.randn(3, 75).bfloat16()  # [rows, in]
    # fp32 sums plus the widened bias, rounded once (the sums' order is the kernel build's own)
    expected = (x.float() @ linear.weight.detach().float().t() + linear.bias.float()).bfloat16()
    torch.testing.assert_close(with_bias.product(x).float(), expected.float(), rtol=2 ** -7, atol=1e-4)


needs_pairs = pytest.mark.skipif(not {"avx512f", "avx512bw", "avx512_bf16"} <= cpuinfo.cpu_flags(),
                                 reason="the column blocks are the kernel's AVX512_BF16 build")


@needs_compiler
@needs_pairs
def test_the_column_blocks_equal_an_fp32_product_and_each_row_is_its_own():
    """block_product over pair_blocks (bf16 weights) and int8_pair_blocks (int8 codes): the fp32 sum of bf16 products
    rounded once to bf16 (scale, then bias),
    for a vector tail and an odd `in` (9, 75, 601), a last block of fewer than 16 features (1, 37), blocks past one
    tile of the cache (3072 x 576 is 192 blocks of 18 KB), every group size up to 16 rows (one block at a time up
    to 8, two from 9) and rows split into groups (17 = 9 + 8, 40 = 14 + 13 + 13); and each row's output is
    bitwise the one it gets alone (the sums run in the order of k whatever rows come with it)."""
    from specpipe.engine import cpu_kernel_build

    built = cpu_kernel_build.build_kernel(None, "avx512_bf16")
    generator = torch.Generator().manual_seed(11)
    for in_features, out_features in ((9, 37), (75, 1), (601, 37), (576, 96), (576, 3072)):
        weight = torch.randn(out_features, in_features, generator=generator).bfloat16()  # [out, in]
        blocks = built.pair_blocks(weight)
        assert blocks.shape == ((out_features + 15) // 16, (in_features + 1) // 2, 16)
        bias = torch.randn(out_features, generator=generator)  # [out]
        scale = torch.rand(out_features, generator=generator) + 0.5  # [out]
        codes = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
        code_blocks = built.int8_pair_blocks(codes)
        assert code_blocks.dtype == torch.int16 and code_blocks.shape == blocks.shape
        code_scale = torch.rand(out_features, generator=generator) / 64  # [out]
        for rows in (1, 2, 3, 7, 8, 9, 12, 16, 17, 40):
            x = torch.randn(rows, in_features, generator=generator).bfloat16()  # [rows, in]
            out = built.block_product(x, blocks, out_features, None, bias)
            assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
            sums = x.float() @ weight.float().t()  # [rows, out]
            torch.testing.assert_close(out.float(), (sums + bias).bfloat16().float(), rtol=2 ** -7, atol=1e-3)
            alone = torch.cat([built.block_product(x[r:r + 1], blocks, out_features, None, bias) for r in range(rows)])
            assert torch.equal(out, alone)
            scaled = built.block_product(x, blocks, out_features, scale, None)
            torch.testing.assert_close(scaled.float(), (sums * scale).bfloat16().float(), rtol=2 ** -7, atol=1e-3)
            # int8 codes (a drafter's weights): their blocks with the rows' steps, bias after the scale
            out = built.block_product(x, code_blocks, out_features, code_scale, bias)
            expected = ((x.float() @ codes.float().t()) * code_scale + bias).bfloat16()
            torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -7, atol=1e-3)
            alone = torch.cat([built.block_product(x[r:r + 1], code_blocks, out_features, code_scale, bias)
                               for r in range(rows)])
            assert torch.equal(out, alone)
    # leading dimensions and a strided input
    x = torch.randn(2, 3, 150, generator=generator).bfloat16()[..., ::2]  # [2, 3, 75], strided
    weight = torch.randn(37, 75, generator=generator).bfloat16()
    blocks = built.pair_blocks(weight)
    out = built.block_product(x, blocks, 37, None, None)
    assert out.shape == (2, 3, 37)
    assert torch.equal(out, built.block_product(x.reshape(6, 75).contiguous(), blocks, 37, None, None).view(2, 3, 37))
    with pytest.raises(RuntimeError, match="x: bf16"):
        built.block_product(x.float(), blocks, 37, None, None)
    with pytest.raises(RuntimeError, match="disagree on in_features"):
        built.block_product(torch.randn(2, 77).bfloat16(), blocks, 37, None, None)
    with pytest.raises(RuntimeError, match="codes: int8"):
        built.int8_pair_blocks(weight)
    with pytest.raises(RuntimeError, match="blocks: pair_blocks or int8_pair_blocks of a weight of out_features rows"):
        built.block_product(x, blocks, 60, None, None)
    with pytest.raises(RuntimeError, match="bias: contiguous fp32"):
        built.block_product(x, blocks, 37, None, torch.randn(36))
    with pytest.raises(RuntimeError, match="weight: bf16"):
        built.pair_blocks(weight.float())
    # the other builds have no column blocks, and say so
    with pytest.raises(RuntimeError, match="block_product needs the kernel's AVX512_BF16 build"):
        cpu_kernel_build.build_kernel(None, "avx512").block_product(x, blocks, 37, None, None)


@needs_compiler
@needs_pairs
def test_bf16_weights_run_in_column_blocks_where_the_kernel_has_them(monkeypatch, caplog):
    """engine.kernel_blocks (default true): on the AVX512_BF16 build a bf16 model's kernel products run over the
    column blocks, with the fp32 bias, and no copy of the weight as loaded is kept for the kernel; the log line
    (and so the cost curve's key) says so; the output matches the row-by-row product within one bf16 rounding;
    false keeps the weights as loaded."""
    from specpipe.engine import cpu_kernel_build

    monkeypatch.setattr(cpu_kernel_build, "aten_capability", lambda: "AVX512")
    model, rows_model, stock = fresh_tiny("bf16"), fresh_tiny("bf16"), fresh_tiny("bf16")
    with caplog.at_level(logging.DEBUG):
        OneDNNEngine(bf16_kernel_rows=5).apply(model)
    assert re.search(r"bf16 weights in column blocks( \(on AMX tiles from \d+ rows in branched trees\))?, summed in fp32",
                     caplog.text)
    OneDNNEngine(bf16_kernel_rows=5, kernel_blocks=False).apply(rows_model)
    assert "column blocks" not in getattr(rows_model, REWRITE_ATTRIBUTE)
    packed, rows_packed = model.lm_head.packed, rows_model.lm_head.packed
    assert packed.blocks is not None and packed.small_weight is None
    assert rows_packed.blocks is None and rows_packed.small_weight is not None
    from specpipe.cost import streamed_weight_bytes

    assert streamed_weight_bytes(model, rows=1) >= streamed_weight_bytes(stock)  # the blocks, padded to 16 features
    calls = []
    block_product = packed.block_product
    monkeypatch.setattr(packed, "block_product", lambda *args: calls.append("blocks") or block_product(*args))
    assert_output_layer_rounds_once(model, stock, rows=(1, 5, 6))
    assert calls == ["blocks", "blocks"]  # 6 rows: above the kernel's rows
    linear = nn.Linear(75, 37).bfloat16()  # [out, in] with a bias [out]
    built = cpu_kernel_build.build_kernel(None, "avx512_bf16")
    with_bias = onednn.PackedWeight([linear], packed.compute_dtype, kernel=packed.kernel, kernel_rows=4,
                                    block_kernel=cpu_kernel_build.BlockProduct(built.pair_blocks,
                                                                               built.int8_pair_blocks, block_product))
    x = torch.randn(3, 75).bfloat16()  # [rows, in]
    expected = (x.float() @ linear.weight.detach().float().t() + linear.bias.float()).bfloat16()
    torch.testing.assert_close(with_bias.product(x).float(), expected.float(), rtol=2 ** -7, atol=1e-5)


@needs_compiler
def test_fp32_kernel_rows_are_part_of_the_cost_curve_key(tmp_path):
    from specpipe.cost import cost_curve_path

    paths = set()
    for kernel_rows in (0, 3):
        model = fresh_tiny()
        OneDNNEngine(fp32_kernel_rows=kernel_rows).apply(model)
        paths.add(cost_curve_path(TargetModel(model, name="tiny", engine="fast"), cache_dir=tmp_path))
    assert len(paths) == 2


@needs_pairs
def test_the_block_lookahead_is_a_build_of_its_own_that_computes_the_same(monkeypatch):
    """engine.block_lookahead_kb only asks the cache for lines earlier: each distance is its own build (cost curves
    measured apart), the column-block products are bitwise equal with and without it at every group size (it
    starts at 5 rows), and the engine passes the config's value to the kernel; bad values are refused by name."""
    from specpipe.engine import cpu_kernel, cpu_kernel_build

    names = {cpu_kernel_build.build_name("avx512_bf16", block_lookahead_kb=kb) for kb in (0, 32, 64)}
    assert len(names) == 3 and cpu_kernel_build.build_name("avx512_bf16") in names
    builds = [cpu_kernel_build.build_kernel(None, "avx512_bf16", "nta", kb) for kb in (0, 32)]  # whatever ISA ATen runs
    generator = torch.Generator().manual_seed(12)
    weight = torch.randn(1200, 576, generator=generator).bfloat16()  # [out, in]: 75 blocks of 18 KB
    blocks = builds[0].pair_blocks(weight)
    for rows in (1, 4, 5, 8, 9, 16, 21):
        x = torch.randn(rows, 576, generator=generator).bfloat16()  # [rows, in]
        near, far = (build.block_product(x, blocks, 1200, None, None) for build in builds)
        assert torch.equal(near, far), rows
    kernels = {kb: cpu_kernel.CpuKernel(block_lookahead_kb=kb) for kb in (0, 32)}  # this machine's build
    built = []
    monkeypatch.setattr(cpu_kernel, "CpuKernel", lambda block_lookahead_kb=32, **_: built.append(block_lookahead_kb)
                        or kernels[block_lookahead_kb])
    OneDNNEngine(block_lookahead_kb=0).apply(fresh_tiny().to(torch.bfloat16))
    assert built and set(built) == {0}
    for bad in (-1, 513, 1.5, "32", True):
        with pytest.raises(ConfigError, match="engine.block_lookahead_kb must be an integer from 0 to 512"):
            OneDNNEngine(block_lookahead_kb=bad)
        with pytest.raises(ValueError, match="block_lookahead_kb must be an integer from 0 to 512"):
            cpu_kernel_build.build_flags("avx512_bf16", block_lookahead_kb=bad)


@needs_compiler
def test_the_row_by_row_product_asks_l2_ahead_too_and_computes_the_same():
    """The lookahead also serves the product over fp32 and bf16 weights row by row (weight_product) and over int8 ones
    (quantized_product): with it from 1 row, from 5 (1-4 rows without) or not at all (this CPU's own build only: one
    build fewer to compile for the AVX2 one), every group size gives bitwise the same outputs."""
    from specpipe.engine import cpu_kernel_build

    generator = torch.Generator().manual_seed(15)
    weight = torch.randn(1200, 576, generator=generator)  # [out, in]: 2.6 MB in fp32, past any lookahead
    bias = torch.randn(1200, generator=generator)  # [out]
    codes = torch.randint(-127, 128, (1200, 576), generator=generator, dtype=torch.int8)  # [out, in]
    scale = torch.rand(1200, generator=generator) / 64  # [out]
    for isa in sorted({"avx2", cpu_kernel_build.kernel_isa()}):
        settings = ((32, 5), (32, 1)) + (((0, 5),) if isa != "avx2" else ())  # (lookahead KiB, from rows)
        builds = [cpu_kernel_build.build_kernel(None, isa, "nta", kb, True, rows) for kb, rows in settings]
        for rows in (1, 2, 5, 8, 13):
            x = torch.randn(rows, 576, generator=generator)  # [rows, in]
            for w, values in ((weight, x), (weight.bfloat16(), x.bfloat16())):
                outputs = [build.weight_product(values, w, bias) for build in builds]
                assert all(torch.equal(outputs[0], out) for out in outputs[1:]), (isa, rows, w.dtype)
            outputs = [build.quantized_product(x, codes, scale, bias) for build in builds]
            assert all(torch.equal(outputs[0], out) for out in outputs[1:]), (isa, rows, "int8")


@needs_pairs
def test_the_lookahead_rows_are_a_build_of_their_own_that_computes_the_same(monkeypatch):
    """engine.block_lookahead_rows moves where the lookahead starts: 1 row is its own build, 5 (the source's
    default) keeps the default build's name, the products are bitwise equal either way at every group size, auto is
    1 on CPUs with AMX and 5 elsewhere, the engine hands the resolved value to the kernel, bad values are refused."""
    from specpipe.engine import cpu_kernel, cpu_kernel_build

    assert cpu_kernel_build.build_name("avx512_bf16", block_lookahead_rows=5) == cpu_kernel_build.build_name("avx512_bf16")
    assert cpu_kernel_build.build_name("avx512_bf16", block_lookahead_rows=1) != cpu_kernel_build.build_name("avx512_bf16")
    builds = [cpu_kernel_build.build_kernel(None, "avx512_bf16", "nta", 32, True, rows) for rows in (5, 1)]
    generator = torch.Generator().manual_seed(13)
    weight = torch.randn(1200, 576, generator=generator).bfloat16()  # [out, in]
    blocks = builds[0].pair_blocks(weight)
    for rows in (1, 2, 4, 5, 8, 16, 21):
        x = torch.randn(rows, 576, generator=generator).bfloat16()  # [rows, in]
        late, early = (build.block_product(x, blocks, 1200, None, None) for build in builds)
        assert torch.equal(late, early), rows
    for flags, expected in (({"avx512f", "amx_bf16", "amx_tile"}, 1), ({"avx512f", "avx512_bf16"}, 5)):
        monkeypatch.setattr(cpu_kernel, "cpu_flags", lambda flags=flags: flags)
        assert OneDNNEngine()._lookahead_rows() == expected
        assert OneDNNEngine(block_lookahead_rows=3)._lookahead_rows() == 3
    monkeypatch.undo()
    kernel = cpu_kernel.CpuKernel()
    built = []
    monkeypatch.setattr(cpu_kernel, "CpuKernel", lambda block_lookahead_rows=5, **_: built.append(block_lookahead_rows)
                        or kernel)
    OneDNNEngine(block_lookahead_rows=2).apply(fresh_tiny().to(torch.bfloat16))
    assert built and set(built) == {2}
    for bad in (0, 17, 1.5, "5", True, None):
        with pytest.raises(ConfigError, match="engine.block_lookahead_rows must be 'auto' or an integer from 1 to 16"):
            OneDNNEngine(block_lookahead_rows=bad)
        with pytest.raises(ValueError, match="block_lookahead_rows must be an integer from 1 to 16"):
            cpu_kernel_build.build_flags("avx512_bf16", block_lookahead_rows=bad)


needs_amx = pytest.mark.skipif(not {"avx512f", "avx512bw", "avx512_bf16", "amx_bf16"} <= cpuinfo.cpu_flags(),
                               reason="needs a CPU with AMX tiles")


@needs_amx
def test_the_column_blocks_on_amx_tiles_agree_with_the_vector_product_and_keep_each_row_alone(monkeypatch, caplog):
    """engine.amx_rows: on an AMX CPU the blocks' products run on the tiles where a forward permits them (a branched
    tree's verify) and by the vector product elsewhere; over a SmolLM2-sized weight the tiles are within a bf16
    rounding of the vdpbf16ps product, each row's output is bitwise that row's alone, and the engine's log says which
    product serves (its cost curves apart); auto takes the tiles from 7 rows on such a CPU."""
    from specpipe.engine import cpu_kernel, cpu_kernel_build

    monkeypatch.setattr(cpu_kernel_build, "aten_capability", lambda: "AVX512")  # the AVX512_BF16 build, as ATen may be held
    kernel, vector = cpu_kernel.CpuKernel(amx_rows=1), cpu_kernel.CpuKernel()
    assert kernel.isa == "avx512_bf16"
    assert kernel.amx and kernel.blocks.product is not vector.blocks.product, kernel.amx_reason
    generator = torch.Generator().manual_seed(14)
    weight = torch.randn(1000, 576, generator=generator).bfloat16()  # [out, in]
    bias = torch.randn(1000, generator=generator)  # [out]
    packed = kernel.blocks.pack(weight)
    x = torch.randn(21, 576, generator=generator).bfloat16()  # [rows, in]
    with kernel.tiles.permitted():
        tiles = kernel.blocks.product(x, packed, 1000, None, bias)  # [rows, out]
    vectors = vector.blocks.product(x, packed, 1000, None, bias)
    assert torch.equal(kernel.blocks.product(x, packed, 1000, None, bias), vectors)  # not permitted: the vectors
    assert not torch.equal(tiles, vectors)
    expected = x.float() @ weight.float().t() + bias
    assert torch.allclose(tiles.float(), expected, rtol=2 ** -7, atol=1e-2)
    assert torch.allclose(tiles.float(), vectors.float(), rtol=2 ** -7, atol=1e-2)
    with kernel.tiles.permitted():
        for rows in (1, 2, 7, 16):
            assert torch.equal(kernel.blocks.product(x[:rows], packed, 1000, None, bias), tiles[:rows]), rows
    from_three = cpu_kernel.CpuKernel(amx_rows=3)
    with from_three.tiles.permitted():  # fewer rows: the vector product, bitwise
        assert torch.equal(from_three.blocks.product(x[:2], packed, 1000, None, bias), vectors[:2])
        assert torch.equal(from_three.blocks.product(x[:3], packed, 1000, None, bias), tiles[:3])
    lines = {}
    for setting in (0, 4):
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            OneDNNEngine(amx_rows=setting).apply(fresh_tiny().to(torch.bfloat16))
        lines[setting] = caplog.text
    assert "in column blocks (on AMX tiles from 4 rows in branched trees)," in lines[4]
    assert "in column blocks," in lines[0] and "in column blocks (on AMX tiles" not in lines[0]
    assert OneDNNEngine()._amx_rows() == cpu_kernel.AUTO_AMX_ROWS == 7


def chain_verified_and_stepped(target: TargetModel, context_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits [8, V] of a random chain of 7 drafted tokens after a random context, verified in one forward, and
    the logits [8, V] of the same 8 tokens fed as one-token steps."""
    generator = torch.Generator().manual_seed(2)
    context = torch.randint(0, target.vocab_size, (context_length,), generator=generator).tolist()
    chain = torch.randint(0, target.vocab_size, (7,), generator=generator)  # [7] drafted tokens
    cache = target.new_cache()
    target.prefill(context, cache)
    verify = target.forward_tree(context[-1], DraftTree.from_parents(chain, torch.arange(-1, 6)), cache).logits  # [8, V]
    cache = target.new_cache()
    target.prefill(context, cache)
    steps = [target.forward_tree(token, DraftTree.empty(), cache).logits[0] for token in [context[-1], *chain.tolist()]]
    return verify, torch.stack(steps)


@needs_amx
def test_a_bf16_chain_verify_keeps_the_vector_product_on_amx_cpus_as_the_tiles_are_not_bitwise(monkeypatch):
    """Why only branched trees take the tiles: with them from 4 rows, a chain of 7 drafted tokens verified in one
    forward still gives bitwise the logits of 8 one-token steps, because the target does not permit the tiles for a
    chain; permitted, the tiles would not (while each row's tile product is still its own and close to the vector
    one). If a CPU's tiles summed as its vectors do, the second check fails, and chains could take them too."""
    from specpipe.engine import cpu_kernel_build

    monkeypatch.setattr(cpu_kernel_build, "aten_capability", lambda: "AVX512")
    model = fresh_tiny().to(torch.bfloat16)
    OneDNNEngine(amx_rows=4).apply(model)
    assert "on AMX tiles from 4 rows" in getattr(model, REWRITE_ATTRIBUTE)
    target = TargetModel(model, engine="fast")
    verify, steps = chain_verified_and_stepped(target, context_length=40)
    assert torch.equal(verify, steps)
    with tiles_permitted(model, True):
        verify, steps = chain_verified_and_stepped(target, context_length=40)
    assert not torch.equal(verify, steps)
    assert torch.allclose(verify.float(), steps.float(), atol=0.1)


def test_the_target_permits_the_amx_tiles_for_branched_trees_only():
    """TargetModel.forward_tree runs a branched tree's verify inside its model's tile permission, and a chain's, a
    one-token step's and a prefill outside it, so chains stay bitwise one-token steps on AMX CPUs. The permission is
    per thread and nests. A TileRows stands in for an AMX engine's, so this runs on every CPU."""
    from specpipe.engine.cpu_kernel import TileRows

    model = fresh_tiny()
    tiles = TileRows(6)
    setattr(model, TILES_ATTRIBUTE, tiles)
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(tiles.rows()))
    target = TargetModel(model)
    cache = target.new_cache()
    target.prefill([5, 6, 7, 8], cache)
    tokens = torch.tensor([11, 12, 13, 14])
    trees = {"empty": DraftTree.empty(), "chain": DraftTree.from_parents(tokens, torch.tensor([-1, 0, 1, 2])),
             "branched": DraftTree.from_parents(tokens, torch.tensor([-1, 0, 0, 2])),
             "two roots": DraftTree.from_parents(tokens[:2], torch.tensor([-1, -1]))}
    for tree in trees.values():
        target.forward_tree(9, tree, cache)
        cache.crop(4)
    assert seen == [0, 0, 0, 6, 6]
    assert [tree.is_chain() for tree in trees.values()] == [True, True, False, False]
    other_thread = []
    with tiles.permitted():
        with tiles.permitted():
            pass
        assert tiles.rows() == 6  # the inner exit restores the outer permission
        worker = threading.Thread(target=lambda: other_thread.append(tiles.rows()))
        worker.start()
        worker.join()
    assert other_thread == [0] and tiles.rows() == 0


@needs_pairs
def test_amx_tiles_are_left_with_the_reason_where_the_cpu_linux_or_the_check_refuses(monkeypatch, caplog):
    """No AMX tiles on the CPU, Linux refusing the tile state, or a tile product that disagrees with the vector one:
    the column blocks keep their vector product and the kernel says why; a row count asked for in engine.amx_rows
    warns with that reason (0 and auto, the default, do not); a bad value is refused by name."""
    from types import SimpleNamespace

    from specpipe.engine import cpu_kernel, cpu_kernel_build

    monkeypatch.setattr(cpu_kernel_build, "aten_capability", lambda: "AVX512")  # the AVX512_BF16 build, as ATen may be held
    kernel = cpu_kernel.CpuKernel()
    vector_product = kernel.blocks.product

    def wrong(x, blocks, out_features, scale, bias, min_rows):  # a tile product off by one in every output
        return vector_product(x, blocks, out_features, scale, bias) + 1

    def right(x, blocks, out_features, scale, bias, min_rows):
        return vector_product(x, blocks, out_features, scale, bias)

    cases = [({"avx512_bf16"}, SimpleNamespace(amx_request=lambda: True, amx_block_product=right),
              "this CPU has no AMX tiles"),
             ({"amx_bf16"}, SimpleNamespace(amx_request=lambda: False, amx_block_product=right),
              "Linux did not grant this process the AMX tile state"),
             ({"amx_bf16"}, SimpleNamespace(amx_request=lambda: True, amx_block_product=wrong),
              "its AMX product disagrees with the column blocks' here (1 rows of 96 inputs: off by up to")]
    for flags, module, reason in cases:
        monkeypatch.setattr(cpu_kernel, "cpu_flags", lambda flags=flags: flags)
        kernel.amx, kernel.amx_reason = False, ""
        kernel._take_amx(module, 6)
        assert not kernel.amx and kernel.tiles is None and kernel.blocks.product is vector_product, flags
        assert reason in kernel.amx_reason, flags
    monkeypatch.setattr(cpu_kernel, "cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"})
    for setting, warned in ((0, False), ("auto", False), (8, True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            OneDNNEngine(amx_rows=setting).apply(fresh_tiny().to(torch.bfloat16))
        assert ("engine.amx_rows=8, but the column blocks run without AMX tiles: this CPU has no AMX tiles"
                in caplog.text) == warned, setting
    assert OneDNNEngine()._amx_rows() == 0  # auto: no tiles on a CPU without them
    for bad in ("always", -1, 1.5, None, True):
        with pytest.raises(ConfigError, match="engine.amx_rows must be 'auto' or a row count >= 0"):
            OneDNNEngine(amx_rows=bad)


@needs_pairs
def test_the_paired_bf16_attention_is_a_build_switch_and_both_builds_agree_with_sdpa(monkeypatch):
    """engine.attention_pairs: its own build; the paired attention (bf16 weights, two value rows per vdpbf16ps) and
    the unpaired one both pass the load-time check against SDPA, differ in the last bits (the switch is real) and
    leave fp32 alone; the engine hands the config's value to the kernel; a non-bool is refused by name."""
    from specpipe.engine import cpu_kernel, cpu_kernel_build, cpu_kernel_checks

    assert cpu_kernel_build.build_name("avx512_bf16", attention_pairs=False) != cpu_kernel_build.build_name("avx512_bf16")
    paired, unpaired = (cpu_kernel_build.build_kernel(None, "avx512_bf16", "nta", 32, pairs).tree_attention
                        for pairs in (True, False))
    assert cpu_kernel_checks.attention_mismatch(paired) == "" and cpu_kernel_checks.attention_mismatch(unpaired) == ""
    generator = torch.Generator().manual_seed(21)
    for dtype in (torch.bfloat16, torch.float32):
        query = torch.randn(1, 9, 4, 64, generator=generator).to(dtype)
        key, value = torch.randn(2, 1, 3, 200, 64, generator=generator).to(dtype)
        outputs = [attention(query, key, value, None, 0.125) for attention in (paired, unpaired)]
        assert torch.equal(*outputs) == (dtype == torch.float32)
    kernels = {pairs: cpu_kernel.CpuKernel(attention_pairs=pairs) for pairs in (True, False)}
    built = []
    monkeypatch.setattr(cpu_kernel, "CpuKernel", lambda attention_pairs=True, **_: built.append(attention_pairs)
                        or kernels[attention_pairs])
    OneDNNEngine(attention_pairs=False).apply(fresh_tiny().to(torch.bfloat16))
    assert built and set(built) == {False}
    for bad in (0, "true", None):
        with pytest.raises(ConfigError, match="engine.attention_pairs must be true or false"):
            OneDNNEngine(attention_pairs=bad)
        with pytest.raises(ValueError, match="attention_pairs must be true or false"):
            cpu_kernel_build.build_flags("avx512_bf16", attention_pairs=bad)


def test_a_bf16_kernel_that_cannot_be_built_leaves_the_other_paths(monkeypatch, caplog):
    from specpipe.engine import cpu_kernel, cpu_kernel_build

    without_native_bf16(monkeypatch)

    def no_ninja(build_dir, isa, weight_prefetch, block_lookahead_kb, attention_pairs, block_lookahead_rows):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpu_kernel, "build_kernel", no_ninja)
    for module in (cpu_kernel, cpu_kernel_build):  # the CPU check before the build, and its ISA
        monkeypatch.setattr(module, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(cpu_kernel.platform, "machine", lambda: "x86_64")
    model, stock = fresh_tiny("bf16"), fresh_tiny("bf16")
    with caplog.at_level(logging.DEBUG):
        OneDNNEngine().apply(model)
    assert "specpipe's CPU kernel could not be built or run (Ninja is required to load C++ extensions)" in caplog.text
    packed = model.lm_head.packed
    assert packed.kernel is None and packed.kernel_rows == 0 and packed.small_rows == 3
    x = torch.randn(1, 1, model.config.hidden_size).bfloat16()  # one row: transformers' own bf16 product
    assert torch.equal(model.lm_head(x), stock.lm_head(x))


def test_a_lock_left_by_a_killed_kernel_build_is_removed(monkeypatch, tmp_path, capsys):
    """torch's build waits forever, silently, on a `lock` file a killed build left; under specpipe's own
    flock (released when its process dies) such a file is a leftover and goes."""
    import fcntl

    from torch.utils import cpp_extension

    from specpipe.engine import cpu_kernel_build

    folder = tmp_path / cpu_kernel_build.build_name("avx2")
    folder.mkdir()
    (folder / "lock").write_text("")
    seen = {}

    def load(**kwargs):
        seen["lock"] = (folder / "lock").exists()
        with open(folder / ".build.lock") as other:  # a second process's try is refused while this one builds
            with pytest.raises(OSError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "module"

    monkeypatch.setattr(cpp_extension, "load", load)
    assert cpu_kernel_build.build_kernel(tmp_path, "avx2") == "module"
    assert seen == {"lock": False} and "left by a kernel build that was killed" in capsys.readouterr().err
    assert cpu_kernel_build.build_kernel(tmp_path, "avx2") == "module"  # nothing left over: nothing said
    assert capsys.readouterr().err == ""


def test_the_kernels_build_is_per_torch_installation(monkeypatch):
    """Two virtualenvs with the same torch version sharing one cache each get a build of their own: torch's
    builder compares the include paths, so one shared build was rebuilt at every switch."""
    from specpipe.engine import cpu_kernel_build

    here = cpu_kernel_build.build_name("avx2")
    monkeypatch.setattr(torch, "__file__", "/elsewhere/.venv/lib/python3.11/site-packages/torch/__init__.py")
    assert cpu_kernel_build.build_name("avx2") != here
    monkeypatch.undo()
    assert cpu_kernel_build.build_name("avx2") == here


def tiny_extension(path, name: str) -> None:
    """A real Python extension module `name` at `path` (its function answer() returns 42), compiled in a
    fraction of a second: what the kernel's build leaves, without the minute the kernel takes."""
    import subprocess

    source = path.with_name(f"{name}.c")
    source.write_text("#include <Python.h>\n"
                      "static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }\n"
                      "static PyMethodDef methods[] = {{\"answer\", answer, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};\n"
                      f"static struct PyModuleDef module = {{PyModuleDef_HEAD_INIT, \"{name}\", NULL, -1, methods}};\n"
                      f"PyMODINIT_FUNC PyInit_{name}(void) {{ return PyModule_Create(&module); }}\n")
    subprocess.run([os.environ.get("CC") or "cc", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", "-o",
                    str(path), str(source)], check=True)
    source.unlink()


@needs_compiler
def test_a_kernel_library_planted_in_the_cache_is_rebuilt_not_loaded(monkeypatch, tmp_path):
    """A library at the kernel's path without the checksum specpipe recorded when it built it is never loaded
    (its constructor would run in the process): it is removed and the kernel built again. A recorded build
    is imported by specpipe itself, without asking torch's builder, and a changed one is built again."""
    from torch.utils import cpp_extension

    from specpipe import native_cache
    from specpipe.engine import cpu_kernel_build
    from test_native_cache import marker_library

    name = cpu_kernel_build.build_name("avx2")
    folder = native_cache.private_folder(tmp_path / name)
    library = folder / f"{name}.so"
    marker = tmp_path / "planted-ran"
    marker_library(library, marker)
    (folder / "kernel.o").write_bytes(b"planted object")  # ninja would link a newer object as it is
    builds = []

    def load(**kwargs):  # torch's builder, without the compiler: leaves a real module where it would
        builds.append((library.exists(), (folder / "kernel.o").exists()))
        assert kwargs["name"] == name and kwargs["build_directory"] == str(folder)
        tiny_extension(library, name)
        return SimpleNamespace(__file__=str(library), built=True)

    monkeypatch.setattr(cpp_extension, "load", load)
    assert cpu_kernel_build.build_kernel(tmp_path, "avx2").built
    assert builds == [(False, False)] and not marker.exists()  # removed before the build, never loaded
    assert native_cache.verified(library)
    module = cpu_kernel_build.build_kernel(tmp_path, "avx2")  # recorded: imported from the file, no build
    assert len(builds) == 1 and module.__name__ == name and module.answer() == 42
    with open(library, "ab") as handle:  # changed after it was recorded
        handle.write(b"\0")
    assert cpu_kernel_build.build_kernel(tmp_path, "avx2").built and len(builds) == 2
    native_cache.checksum_path(library).unlink()  # no record
    assert cpu_kernel_build.build_kernel(tmp_path, "avx2").built and len(builds) == 3
    assert not marker.exists()


def test_the_kernel_is_not_built_in_a_folder_others_can_write(monkeypatch, tmp_path, caplog):
    from torch.utils import cpp_extension

    from specpipe.engine import cpu_kernel, cpu_kernel_build

    def load(**kwargs):
        raise AssertionError("built in a folder others can write")

    monkeypatch.setattr(cpp_extension, "load", load)
    for module in (cpu_kernel, cpu_kernel_build):  # the CPU check before the build, and its ISA
        monkeypatch.setattr(module, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(cpu_kernel.platform, "machine", lambda: "x86_64")
    folder = tmp_path / cpu_kernel_build.build_name("avx2")
    folder.mkdir(mode=0o700)
    folder.chmod(0o777)
    kernel = cpu_kernel.CpuKernel(build_dir=tmp_path)
    assert kernel.product is None
    assert f"{folder} is writable by group/others (mode 0777)" in kernel.reason
    assert f"chmod 700 {folder}" in kernel.reason
    folder.chmod(0o700)
    owner = folder.stat().st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)
    kernel = cpu_kernel.CpuKernel(build_dir=tmp_path)
    assert kernel.product is None and f"{folder} belongs to uid {owner}, not to you" in kernel.reason


def test_bf16_fallback_decodes_as_transformers_bf16_does(monkeypatch):
    """Greedy tokens of the fallback path against the stock bf16 model, recomputed from scratch each
    step: they may part only at a near-tie of the stock logits (bf16 keeps 8 bits of mantissa)."""
    without_native_bf16(monkeypatch)
    model, stock = fresh_tiny("bf16"), fresh_tiny("bf16")
    cfg = compose_config(["model=tiny_random", "model.dtype=bf16", "pipeline=lookahead_trie", "cost_curve=flat"])
    pipe = build_pipeline(cfg, loaded=LoadedModel(model, load_model(cfg.model).tokenizer, "tiny_bf16"))
    assert pipe.target.engine == "fast" and model.lm_head.packed.compute_dtype == torch.float32
    agreed = 0
    for prompt in random_prompts(8, seed=11):
        tokens = pipe.generate(prompt, max_new_tokens=16).token_ids
        for i, token in enumerate(tokens):
            with torch.inference_mode():
                logits = stock(input_ids=torch.tensor([prompt + tokens[:i]])).logits[0, -1].float()
            top = logits.topk(2)
            if token != int(top.indices[0]):
                assert token == int(top.indices[1]) and float(top.values[0] - top.values[1]) <= 2 ** -6 * float(
                    top.values[0].abs()), f"token {i} differs at a clear gap"
                break
            agreed += 1
    assert agreed >= 8 * 16 * 3 // 4  # mostly identical, not a vacuous pass


def test_no_prepacked_path_leaves_the_model_untouched(monkeypatch, caplog):
    def no_kernel(dtype):
        raise RuntimeError("simulated: no oneDNN kernel for this CPU")

    monkeypatch.setattr(cpu, "_run_probe", no_kernel)
    for dtype in ("fp32", "bf16"):
        model = fresh_tiny(dtype)
        before = linears(model)
        with caplog.at_level(logging.WARNING):
            OneDNNEngine().apply(model)
        assert linears(model) == before and getattr(model, "specpipe_engine", "hf") == "hf"
        assert "simulated: no oneDNN kernel" in caplog.text and "transformers' own forward" in caplog.text


def test_a_packing_failure_part_way_leaves_the_model_untouched(monkeypatch, caplog):
    """Replacements are all built before any is swapped in: no half-rewritten model."""
    real_pack, calls = cpu.pack_weight, []

    def pack_then_fail(weight):
        calls.append(weight.shape)
        if len(calls) > 3:
            raise RuntimeError("simulated packing failure")
        return real_pack(weight)

    monkeypatch.setattr(packed_weight, "pack_weight", pack_then_fail)
    model = fresh_tiny()
    before = linears(model)
    with caplog.at_level(logging.WARNING):
        OneDNNEngine(fp32_split_rows=0).apply(model)
    assert len(calls) == 4 and linears(model) == before and getattr(model, "specpipe_engine", "hf") == "hf"
    assert "simulated packing failure" in caplog.text
    HFEngine().apply(model)  # still free for any engine


# ---- split GEMMs (fp32 products on AVX2 CPUs) ----------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("out_features", [96, 97, 1])
@pytest.mark.parametrize("rows", [1, 2, 7])
def test_split_linear_equals_f_linear(threads, out_features, rows):
    """Any thread count, an output size no thread count divides (prime), with and without bias."""
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, 48, generator=generator)  # [out, in]
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(2, rows, 48, generator=generator)  # [batch, rows, in]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b in (None, bias):
            out = cpu.split_linear(x, cpu.row_blocks(weight, threads), b)
            assert out.shape == (2, rows, out_features) and out.is_contiguous()
            torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b), atol=1e-5, rtol=1e-5)
            # [1, 1, in]: the one-token step's shape, which views its one row in a single op (one at an
            # offset into its storage too): bit for bit the product of the transposed-and-expanded view
            # the general path makes; the same values not contiguous take the general path
            blocked = cpu.row_blocks(weight, threads)  # [blocks, out / blocks, in]
            for one_row in (x[:1, :1], x[1:, -1:]):
                fast = cpu.split_linear(one_row, blocked, b)
                columns = one_row.reshape(1, 48).t().expand(blocked.shape[0], 48, 1)  # [blocks, in, 1]
                general = torch.bmm(blocked, columns).view(1, 1, out_features)
                assert torch.equal(fast, general if b is None else general + b)
                torch.testing.assert_close(fast, torch.nn.functional.linear(one_row, weight, b), atol=1e-5, rtol=1e-5)
                spread = torch.zeros(1, 1, 96)
                spread[..., ::2] = one_row
                assert not spread[..., ::2].is_contiguous()
                torch.testing.assert_close(cpu.split_linear(spread[..., ::2], blocked, b), fast, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(saved)


def test_weight_row_blocks_divide_the_rows_evenly_up_to_one_per_thread():
    assert cpu.weight_row_blocks(960, 2) == 2 and cpu.weight_row_blocks(960, 7) == 6
    assert cpu.weight_row_blocks(97, 8) == 1 and cpu.weight_row_blocks(3, 16) == 3
    assert cpu.weight_row_blocks(576, 1) == 1


def test_fp32_split_rows_auto_follows_the_measured_cpu_class(monkeypatch, caplog):
    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    assert cpu.auto_split_rows("brg_matmul:avx2") == cpu.auto_split_rows("x64:gemm:jit") == cpu.AUTO_SPLIT_ROWS
    assert cpu.auto_split_rows("brg_matmul:avx512_core") == cpu.AUTO_SPLIT_ROWS_AVX512
    assert cpu.auto_split_rows("brgemm:avx512_core_amx") == 0  # not measured there
    monkeypatch.setattr(cpu.platform, "machine", lambda: "aarch64")
    assert cpu.auto_split_rows("gemm:acl") == 0
    monkeypatch.undo()
    auto = cpu.probe_linear_path(torch.float32)
    assert auto.split_rows == cpu.auto_split_rows(auto.kernel)
    # an explicit count holds whatever the CPU
    assert cpu.probe_linear_path(torch.float32, split_rows=4).split_rows == 4
    assert cpu.probe_linear_path(torch.float32, split_rows=0).split_rows == 0
    # bf16 weights packed in fp32 split only the rows above those bf16 F.linear serves; native bf16 never
    upcast = cpu.probe_linear_path(torch.bfloat16, prefer_fp32_compute=True, small_rows=3, split_rows=4)
    assert (upcast.small_rows, upcast.split_rows) == (3, 4)
    assert cpu.probe_linear_path(torch.bfloat16, prefer_fp32_compute=True, small_rows=3, split_rows=3).split_rows == 0
    native = cpu.probe_linear_path(torch.bfloat16, split_rows=4)
    assert native.compute_dtype == torch.float32 or native.split_rows == 0
    model = fresh_tiny()
    with caplog.at_level(logging.DEBUG):
        OneDNNEngine(fp32_split_rows=2, fp32_kernel_rows=0).apply(model)  # the kernel would serve those rows
    packed = model.lm_head.packed
    assert packed.split_rows == 2 and packed.plain.dtype == torch.float32 and packed.packed is not None
    assert "fp32 GEMMs split over the threads by weight rows for up to 2 rows" in caplog.text
    assert "engine.fp32_split_rows=2" in caplog.text and "split GEMMs up to 2 rows" in repr(model.lm_head)
    # which kernel serves a product: split GEMMs up to split_rows rows, oneDNN above
    calls = []
    monkeypatch.setattr(packed_weight, "split_linear", lambda *args: calls.append("split") or cpu.split_linear(*args))
    monkeypatch.setattr(packed_weight, "packed_linear", lambda *args: calls.append("onednn") or cpu.packed_linear(*args))
    hidden = model.config.hidden_size
    for rows in (1, 2, 3):
        model.lm_head(torch.randn(1, rows, hidden))
    assert calls == ["split", "split", "onednn"]
    assert packed.weight_bytes(2) == packed.plain.numel() * 4
    for bad in ("all", -1, 1.5):
        with pytest.raises(ConfigError, match="engine.fp32_split_rows must be 'auto' or a row count"):
            OneDNNEngine(fp32_split_rows=bad)


def test_split_rows_and_the_lean_forward_are_part_of_the_cost_curve_key(tmp_path):
    from specpipe.cost import cost_curve_path

    paths = set()
    for split_rows, lean_forward in ((0, True), (1, True), (1, False)):
        model = fresh_tiny()
        OneDNNEngine(fp32_split_rows=split_rows, lean_forward=lean_forward, fp32_kernel_rows=0).apply(model)
        paths.add(cost_curve_path(TargetModel(model, name="tiny", engine="fast"), cache_dir=tmp_path))
    assert len(paths) == 3


def test_an_mkl_isa_cap_is_part_of_the_cost_curve_key_and_the_machine_line(tmp_path, monkeypatch):
    """Split GEMMs run on MKL, which ONEDNN_MAX_CPU_ISA and ATEN_CPU_CAPABILITY do not hold back."""
    from specpipe.cost import cost_curve_path
    from specpipe.tasks.bench_machine import machine_info, machine_line

    model = fresh_tiny()
    OneDNNEngine().apply(model)
    target = TargetModel(model, name="tiny", engine="fast")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    uncapped, line = cost_curve_path(target, cache_dir=tmp_path), machine_line(machine_info())
    assert "MKL cap" not in line
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert cost_curve_path(target, cache_dir=tmp_path) != uncapped
    assert "MKL cap AVX2" in machine_line(machine_info())


@needs_compiler
@needs_pairs
@pytest.mark.parametrize("model_name", ["tiny_random", "smollm2_135m"])
def test_a_bf16_chain_verified_in_column_blocks_equals_one_token_steps_bitwise(monkeypatch, model_name):
    """With bf16 weights in column blocks every row of a verify forward is computed as it would be alone (the products'
    sums run in the order of k, the norm and the elementwise ops are per row, a chain's keys sit where one-token steps
    put them): the logits of a chain of 7 drafted tokens equal, bit for bit, those of 8 one-token steps over the same
    text, so a bf16 pipeline that drafts chains emits exactly `vanilla`'s tokens."""
    from specpipe.engine import cpu_kernel_build

    monkeypatch.setattr(cpu_kernel_build, "aten_capability", lambda: "AVX512")
    cfg = compose_config([f"model={model_name}", "model.dtype=bf16", "engine=fast"])
    loaded = load_model(cfg.model)
    OneDNNEngine().apply(loaded.model)
    assert "column blocks" in getattr(loaded.model, REWRITE_ATTRIBUTE)
    verify, steps = chain_verified_and_stepped(TargetModel(loaded.model, engine="fast"), context_length=120)
    assert torch.equal(verify, steps)


# ---- the rotary tables -------------------------------------------------------------------------
def test_the_rotary_tables_give_bitwise_the_modules_cos_and_sin_and_the_engine_hands_them_out(monkeypatch):
    """RotaryTables (engine=fast's lookup of each position's cos/sin) against LlamaRotaryEmbedding itself: any
    positions in any order, one row or many, bf16 and fp32, across a growth of the table; dynamic RoPE is left
    to the module; a module whose rows depended on their neighbours is noticed and then runs itself."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from specpipe.engine.rotary import RotaryTables

    model = fresh_tiny()
    rotary = model.model.rotary_emb
    tables = RotaryTables(rotary)
    generator = torch.Generator().manual_seed(13)
    for dtype in (torch.bfloat16, torch.float32):
        hidden = torch.zeros(1, 1, model.config.hidden_size, dtype=dtype)
        for limit in (40, 700, 3000):  # the second and third grow the table
            for q in (1, 2, 9, 64):
                positions = torch.randint(0, limit, (1, q), generator=generator)  # [1, q]
                expected, looked_up = rotary(hidden, positions), tables(hidden, positions)
                assert looked_up[0].dtype == dtype
                assert torch.equal(expected[0], looked_up[0]) and torch.equal(expected[1], looked_up[1]), (dtype, q)
    assert tables.exact and next(iter(tables.tables.values()))[0].shape[0] >= 3000

    dynamic = copy.deepcopy(rotary)
    dynamic.rope_type = "dynamic"
    assert not RotaryTables.serves(dynamic)
    with pytest.raises(ValueError, match="RotaryTables serves LlamaRotaryEmbedding"):
        RotaryTables(dynamic)

    class Neighbourly(LlamaRotaryEmbedding):  # rows that shift with the positions around them
        def forward(self, x, position_ids):
            cos, sin = super().forward(x, position_ids)
            return cos + position_ids.shape[-1] * 1e-3, sin
    odd = Neighbourly(model.config)
    with monkeypatch.context() as patched:
        patched.setattr(RotaryTables, "serves", staticmethod(lambda module: True))
        odd_tables = RotaryTables(odd)
    positions = torch.tensor([[3, 5]])
    assert torch.equal(odd_tables(torch.zeros(1, 1, 4), positions)[0], odd(torch.zeros(1, 1, 4), positions)[0])
    assert not odd_tables.exact

    OneDNNEngine().apply(model)
    assert isinstance(model.model.rotary_lookup, RotaryTables) and model.model.rotary_lookup.rotary is rotary
