"""engine.batch_invariant: every row of the target's decoding steps and verifies is computed as the one-row forward
of its own path would compute it, bit for bit, in bf16, fp32 and the native quantized formats, on both CPU classes
(run these under ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 for the AVX2 one). So speculation emits exactly
the engine's own `vanilla` tokens in every dtype, whatever the trees, the cost curve or the batch around a request."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from conftest import PIPELINES, _make, random_prompts
from specpipe.pipelines.builder import build_pipeline, compose_config

TREE_SIZES = (1, 5, 17, 40, 64)
ROOT = Path(__file__).resolve().parents[1]


def _probe() -> ModuleType:
    """bench/tree_row_invariance.py: the trees, their paths and the row-by-row comparison these tests share."""
    spec = importlib.util.spec_from_file_location("tree_row_invariance", ROOT / "bench" / "tree_row_invariance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probe = _probe()


def trees_rows_differing(overrides: list[str], sizes=TREE_SIZES, seed: int = 3) -> dict[int, list[int]]:
    pipe = build_pipeline(compose_config(["pipeline=vanilla", "cost_curve=flat", *overrides]))
    generator = torch.Generator().manual_seed(seed)
    context = random_prompts(1, seed=seed)[0][:40]
    result = {}
    for size in sizes:
        parents = probe.random_parents(size, generator)
        tokens = torch.randint(300, 1300, (size,), generator=generator).tolist()
        result[size] = [row for row, _, _ in probe.differing_rows(pipe.target, context, parents, tokens)]
    return result


@pytest.mark.parametrize("overrides", [
    ["model=tiny_random", "model.dtype=fp32", "engine.target_weights=int4"],
    ["model=tiny_random", "model.dtype=bf16", "engine.target_weights=int8"],
    ["model=tiny_random", "model.dtype=bf16", "engine.target_weights=int4"],
    ["model=tiny_random", "model.dtype=bf16", "engine.target_weights=dense"],
    ["model=tiny_random", "model.dtype=fp32", "engine.target_weights=dense"],
    ["model=tiny_random", "model.dtype=bf16", "engine.target_weights=dense", "engine.kernel_blocks=false"],
    pytest.param(["model=smollm2_135m", "model.dtype=bf16"], marks=pytest.mark.embedded),
    pytest.param(["model=smollm2_135m", "model.dtype=fp32"], marks=pytest.mark.embedded),
], ids=["tiny-int4-fp32", "tiny-int8-bf16", "tiny-int4-bf16", "tiny-dense-bf16", "tiny-dense-fp32",
        "tiny-dense-bf16-row-by-row", "embedded-q4_1-bf16", "embedded-q4_1-fp32"])
def test_every_verify_row_is_bitwise_its_paths_one_token_step(overrides):
    """Random trees of 1-64 nodes (65 verify rows: past engine.native_rows, the kernel attention's row limit on
    AVX2, the AMX tiles' threshold, the kernel's rows before oneDNN): every node's logits equal those of the
    one-token steps over its own path. Weights in GGUF blocks (quantized at load, or the embedded model's file),
    dense bf16 (column blocks on AVX512_BF16 builds, else row by row) and dense fp32 (row by row)."""
    differing = trees_rows_differing(overrides)
    assert differing == {size: [] for size in TREE_SIZES}


@pytest.mark.embedded
def test_without_batch_invariance_a_large_verify_takes_other_paths_and_differs():
    """What the switch buys: off, a 65-row verify of the native weights runs the dense products (past
    native_rows), whose rows are not their one-token steps' (so the test above can fail)."""
    differing = trees_rows_differing(["model=smollm2_135m", "model.dtype=bf16", "engine.batch_invariant=false"],
                                     sizes=(64,))
    assert len(differing[64]) > 0


PROMPTS = ["Write a haiku about the sea.", "What does the with statement do in Python?",
           "Summarize: the cat sat on the mat because the mat was warm and the sun was out.",
           "List three prime numbers and explain why they are prime."]


@pytest.fixture(scope="module")
def embedded_bf16():
    """The embedded SmolLM2-135M-Instruct in bf16 on its Q4_1 blocks, its shipped heads and draft."""
    return _make("embedded", ("model=smollm2_135m", "model.dtype=bf16"))


@pytest.mark.embedded
def test_every_greedy_pipeline_emits_vanilla_tokens_in_bf16(embedded_bf16):
    """Every pipeline config, flat cost curve (its largest trees), on two chat prompts: the engine's own bf16
    vanilla tokens for the prompt the pipeline decoded (a RAG pipeline's holds the chunks it retrieved)."""
    prompts = ["Write a haiku about the sea.", "Explain what a hash table is, in two sentences."]
    vanilla = embedded_bf16.pipeline("vanilla")
    plain: dict[tuple[int, ...], list[int]] = {}
    for name in PIPELINES:
        pipe = embedded_bf16.pipeline(name)
        for prompt in prompts:
            generation = pipe.generate(prompt, max_new_tokens=24)
            key = tuple(generation.prompt_ids)
            if key not in plain:
                plain[key] = vanilla.generate(list(key), max_new_tokens=24).token_ids
            assert generation.token_ids == plain[key], (name, prompt)


@pytest.mark.embedded
def test_bf16_pipelines_emit_vanilla_tokens_alone_and_in_a_batch():
    """The embedded model in bf16 on its Q4_1 blocks: every greedy pipeline's answer is the engine's own
    vanilla answer, with the flat and the online cost curve (other trees), and decoded together as a batch."""
    vanilla = build_pipeline(compose_config(["model=smollm2_135m", "model.dtype=bf16", "pipeline=vanilla"]))
    expected = [vanilla.generate(prompt, max_new_tokens=40).token_ids for prompt in PROMPTS]
    for pipeline in ("lookahead_trie", "eagle_mix", "prompt_lookup"):
        for curve in ("flat", "online"):
            pipe = build_pipeline(compose_config(["model=smollm2_135m", "model.dtype=bf16", f"pipeline={pipeline}",
                                                  f"cost_curve={curve}"]))
            alone = [pipe.generate(prompt, max_new_tokens=40).token_ids for prompt in PROMPTS]
            assert alone == expected, (pipeline, curve)
        together = [generation.token_ids for generation in pipe.generate_many(PROMPTS, max_new_tokens=40)]
        assert together == expected, pipeline


def test_the_engine_line_says_whether_the_rows_are_invariant():
    on = build_pipeline(compose_config(["model=tiny_random", "model.dtype=fp32", "engine.target_weights=int4",
                                        "pipeline=vanilla"]))
    assert "row-invariant (batch_invariant" in on.target.model.specpipe_engine_rewrite
    dense = build_pipeline(compose_config(["model=tiny_random", "model.dtype=fp32", "pipeline=vanilla"]))
    assert "row-invariant (batch_invariant" in dense.target.model.specpipe_engine_rewrite
    without_kernel = build_pipeline(compose_config(["model=tiny_random", "model.dtype=fp32", "pipeline=vanilla",
                                                    "engine.fp32_kernel_rows=0"]))
    assert "batch_invariant asked, not held (some products have no row-invariant kernel path" in (
        without_kernel.target.model.specpipe_engine_rewrite)
    off = build_pipeline(compose_config(["model=tiny_random", "model.dtype=fp32", "engine.target_weights=int4",
                                         "engine.batch_invariant=false", "pipeline=vanilla"]))
    assert "batch_invariant" not in off.target.model.specpipe_engine_rewrite
