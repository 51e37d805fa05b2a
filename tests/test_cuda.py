"""Checks that need a CUDA GPU (skipped elsewhere, so on CI): the Triton tree-attention kernel compiled
for the GPU at real model sizes, and whole pipelines decoding on the GPU.

The CPU tests cover the kernel only under Triton's interpreter at toy sizes, and the pipelines only on
the CPU. Here the same kernel runs compiled (split-KV on, tf32 dots for 16-bit inputs, head_dim up to
128, caches of thousands of tokens), and the greedy pipelines run with the model on `cuda`, each
against HF `generate` on an identical reference instance.

Run on a GPU machine with the interpreter off (conftest turns it on unless told otherwise):

    TRITON_INTERPRET=0 python -m pytest tests/test_cuda.py
"""
from __future__ import annotations

import pytest
import torch

from conftest import _make, random_prompts, run_steps
from specpipe.types import SamplingConfig
from test_draft_vocab import DRAFTER_KEY, check_greedy_over_reduced_vocabulary
from test_tree_attention_kernel import TOLERANCE, Case, make_inputs, path_oracle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def compiled_kernel():
    """The kernel module, compiled for the GPU (not interpreted)."""
    pytest.importorskip("triton")
    from specpipe.kernels import tree_attention as module

    if module.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set: run with TRITON_INTERPRET=0 to compile the kernel for the GPU")
    return module


# Real attention shapes: Llama-3-8B/70B (32 or 64 heads, 8 kv heads, head_dim 128), SmolLM2-135M (9/3, 64),
# Vicuna (no GQA, 128), Qwen-like groups of 7, and an odd head_dim that pads BLOCK_D.
GPU_CASES = [
    Case("llama8b_tree16_cache1000_bf16", heads=32, kv_heads=8, head_dim=128, cache_lens=(1000,), nodes=16,
         dtype=torch.bfloat16),
    Case("llama8b_tree64_cache4100_bf16", heads=32, kv_heads=8, head_dim=128, cache_lens=(4100,), nodes=64,
         dtype=torch.bfloat16),
    Case("llama8b_tree128_cache8192_fp16", heads=32, kv_heads=8, head_dim=128, cache_lens=(8192,), nodes=128,
         dtype=torch.float16),
    Case("llama70b_chain8_cache2000_bf16", heads=64, kv_heads=8, head_dim=128, cache_lens=(2000,), nodes=8,
         shape="chain", dtype=torch.bfloat16),
    Case("llama8b_tree32_cache3000_fp32", heads=32, kv_heads=8, head_dim=128, cache_lens=(3000,), nodes=32),
    Case("smollm2_tree24_cache700_fp32", heads=9, kv_heads=3, head_dim=64, cache_lens=(700,), nodes=24),
    Case("smollm2_wide40_cache300_bf16", heads=9, kv_heads=3, head_dim=64, cache_lens=(300,), nodes=40,
         shape="wide", dtype=torch.bfloat16),
    Case("vicuna_tree20_cache1500_fp16", heads=32, kv_heads=32, head_dim=128, cache_lens=(1500,), nodes=20,
         dtype=torch.float16),
    Case("groups_of_7_tree12_bf16", heads=28, kv_heads=4, head_dim=128, cache_lens=(900,), nodes=12,
         dtype=torch.bfloat16),
    Case("head_dim_80_tree9_fp32", heads=10, kv_heads=2, head_dim=80, cache_lens=(257,), nodes=9),
    Case("one_token_cache5000_bf16", heads=32, kv_heads=8, head_dim=128, cache_lens=(5000,), nodes=1,
         dtype=torch.bfloat16),
    Case("prefill_300_fp32", heads=8, kv_heads=2, head_dim=64, cache_lens=(0,), nodes=300, shape="causal"),
    Case("prefill_200_after_cache_bf16", heads=32, kv_heads=8, head_dim=128, cache_lens=(600,), nodes=200,
         shape="causal", dtype=torch.bfloat16),
    Case("batch3_ragged_caches_bf16", heads=32, kv_heads=8, head_dim=128, cache_lens=(3000, 17, 0), nodes=16,
         padding=40, dtype=torch.bfloat16),
    Case("batch2_ragged_fp32_forced_splits", heads=8, kv_heads=2, head_dim=64, cache_lens=(2048, 333), nodes=10,
         options=(("num_splits", 7),)),
]


def on_gpu(inputs):
    query, key, value, tree_mask, cache_lens = inputs
    return (query.to(CUDA), key.to(CUDA), value.to(CUDA),
            None if tree_mask is None else tree_mask.to(CUDA), cache_lens.to(CUDA))


@pytest.mark.parametrize("upcast", [False, True], ids=["16bit_dots", "upcast"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda case: case.name)
def test_compiled_kernel_matches_path_oracle(compiled_kernel, case, upcast):
    """Every node's output equals plain attention over the cache and its own root-to-node path (computed
    on the CPU in fp32 from the same inputs, one node at a time), with 16-bit inputs upcast to fp32 for the
    dots or kept in their dtype."""
    if case.dtype == torch.float32 and not upcast:
        pytest.skip("fp32 inputs are never downcast")
    inputs = make_inputs(case, seed=5)
    expected = path_oracle(*inputs)  # [B, H, q, D] fp32, on the CPU
    out = compiled_kernel.tree_attention(*on_gpu(inputs), **dict(case.options), upcast=upcast)
    assert out.shape == inputs[0].shape and out.dtype == case.dtype and out.device.type == "cuda"
    torch.testing.assert_close(out.float().cpu(), expected, **TOLERANCE[case.dtype])


def test_compiled_kernel_splits_the_cache(compiled_kernel):
    """On a GPU a long cache is cut into splits (the flash-decoding path the interpreter never chooses);
    the merged result must not depend on how many."""
    case = Case("splits", heads=32, kv_heads=8, head_dim=128, cache_lens=(6000,), nodes=8)
    query, key, value, tree_mask, cache_lens = on_gpu(make_inputs(case, seed=6))
    one = compiled_kernel.tree_attention(query, key, value, tree_mask, cache_lens, num_splits=1)
    assert compiled_kernel._default_num_splits(CUDA, 8 * 1, 6000, 32) > 1
    for splits in (None, 3, 16):
        out = compiled_kernel.tree_attention(query, key, value, tree_mask, cache_lens, num_splits=splits)
        torch.testing.assert_close(out, one, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def gpu_mixed():
    """tiny_mixed (a random 2-layer Llama whose output depends on its context) with both instances on the GPU."""
    return _make("gpu_mixed", ("model=tiny_random", "model.device=cuda"), mix=100.0)


GREEDY_PIPELINES = ["vanilla", "prompt_lookup", "lookahead_trie", "jacobi", "draft_model", "eagle", "medusa", "hydra"]


@pytest.mark.parametrize("attention", ["triton", "sdpa"])
@pytest.mark.parametrize("pipeline", GREEDY_PIPELINES)
def test_pipeline_on_gpu_equals_greedy(gpu_mixed, pipeline, attention):
    """fp32 on the GPU: every greedy pipeline commits exactly HF `generate`'s greedy tokens."""
    if attention == "triton":
        pytest.importorskip("triton")
    pipe = gpu_mixed.pipeline(pipeline, f"attention={attention}", fresh=True)
    assert next(pipe.decoder.target.model.parameters()).device.type == "cuda"
    drafted = 0
    for i, prompt in enumerate(random_prompts(6, seed=3)):
        tokens, steps = run_steps(pipe, prompt, 24)
        assert tokens == gpu_mixed.greedy_hf(prompt, 24), f"prompt {i}"
        drafted += sum(step.drafted for step in steps)
    assert pipeline == "vanilla" or drafted > 0  # trees were verified, not only single tokens


@pytest.mark.parametrize("pipeline", sorted(DRAFTER_KEY))
def test_reduced_vocabulary_pipeline_on_gpu_equals_greedy(gpu_mixed, pipeline, tmp_path):
    """The shipped drafters score a reduced vocabulary (vocab_top_k=8192), which the random model above never
    does (it has no corpus to count): every such drafter failed on the GPU until run 36."""
    pytest.importorskip("triton")
    check_greedy_over_reduced_vocabulary(gpu_mixed, pipeline, tmp_path, "attention=triton")


@pytest.mark.parametrize("pipeline", ["draft_model", "eagle"])
def test_drafters_attend_on_gpu_without_cudnn_plans(gpu_mixed, pipeline, monkeypatch):
    """cuDNN's SDPA builds a plan for every new shape, and a drafter's keys grow each step: with it, drafting
    took 50-150 ms a step on an H100 instead of 5-10 (BENCHMARKS run 42). The drafters' SDPA calls run without
    it (the target's tree attention is the Triton kernel here), and decoding stays greedy."""
    prompt = random_prompts(6, seed=3)[0]
    expected = gpu_mixed.greedy_hf(prompt, 24)  # before the patch: HF's reference runs with torch's defaults
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cudnn_enabled_during_calls = []

    def recording_sdpa(*args, **kwargs):
        cudnn_enabled_during_calls.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    pipe = gpu_mixed.pipeline(pipeline, "attention=triton", fresh=True)
    tokens, steps = run_steps(pipe, prompt, 24)
    assert tokens == expected
    assert sum(step.drafted for step in steps) > 0
    assert cudnn_enabled_during_calls and not any(cudnn_enabled_during_calls)


SAMPLED_PIPELINES = ["draft_model", "eagle", "specinfer_mix", "eagle_mix"]  # model drafters: a random model sampled
# at any temperature is near uniform, so retrieval alone finds nothing to draft


@pytest.mark.parametrize("pipeline", SAMPLED_PIPELINES)
def test_sampled_pipeline_runs_on_gpu(gpu_mixed, pipeline):
    """Rejection sampling with the model on the GPU: drafts (with their distributions, for model drafters)
    are verified, and a seed fixes the output. Its distribution is tested on the CPU
    (tests/test_sampling.py); here the devices of the tensors it passes around are."""
    pipe = gpu_mixed.pipeline(pipeline, "attention=triton", "verifier=rejection", fresh=True)
    sampling = SamplingConfig(temperature=0.8, seed=11)
    drafted = 0
    for prompt in random_prompts(6, seed=4)[1:4]:
        tokens, steps = run_steps(pipe, prompt, 24, sampling=sampling)
        assert 0 < len(tokens) <= 24 and all(0 <= token < gpu_mixed.loaded.model.config.vocab_size for token in tokens)
        assert run_steps(pipe, prompt, 24, sampling=sampling)[0] == tokens
        drafted += sum(step.drafted for step in steps)
    assert drafted > 0
