"""engine.native_layers: the target's decoder layers over GGUF blocks run in one kernel call a forward, and compute
bit for bit what the op-by-op lean loop computes: the logits, the hidden states every layer records and the cache rows
of a prefill, of one-token steps, of a tree verify and of a ragged batch of several sequences' rows."""
from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from specpipe.engine.lean_model import LeanLlamaModel
from specpipe.pipelines.builder import build_pipeline, compose_config
from specpipe.target import VerifyRows
from specpipe.types import DraftTree

TREE_PARENTS = [-1, -1, 0, 0, 1, 2, 2, 4, 5, -1, 9, 10]  # 12 nodes: branches, a chain of four, a lone side child


def lean_model(pipe) -> LeanLlamaModel:
    (model,) = [module for module in pipe.target.model.modules() if isinstance(module, LeanLlamaModel)]
    return model


def counted(model: LeanLlamaModel) -> list[list[torch.Tensor]]:
    """The kernel layers' calls on `model`: per call, the layers' outputs it returned."""
    calls, kernel = [], model.native_layer_kernel

    def counting(*args):
        outputs = kernel(*args)
        calls.append(outputs)
        return outputs
    model.native_layer_kernel = counting
    return calls


def run_forwards(pipe, prompts: list[list[int]], generator: torch.Generator) -> list[torch.Tensor]:
    """What is compared: the logits and all hidden states of a prefill, two one-token steps, a tree verify and a
    ragged batch (a step, a tree and a chain of three sequences), and every cache's rows after them."""
    target = pipe.target
    outputs, caches = [], []
    for prompt in prompts:
        cache = target.new_cache()
        first = target.prefill(prompt, cache)
        outputs += [first.logits, first.hidden]
        caches.append(cache)
    for token in (411, 977):
        step = target.forward_tree(token, DraftTree.empty(), caches[0])
        outputs += [step.logits, step.hidden]
    tokens = torch.randint(300, 1300, (len(TREE_PARENTS),), generator=generator)
    tree = DraftTree.from_parents(tokens, torch.tensor(TREE_PARENTS))
    before = caches[1].get_seq_length()
    verified = target.forward_tree(523, tree, caches[1])
    outputs += [verified.logits, verified.hidden]
    caches[1].crop(before)
    chain = DraftTree.from_parents(tokens[:3], torch.tensor([-1, 0, 1]))
    batch = [VerifyRows(640, DraftTree.empty(), caches[0]), VerifyRows(641, tree, caches[1]),
             VerifyRows(642, chain, caches[2])]
    for out in target.forward_trees(batch):
        outputs += [out.logits, out.hidden] + ([out.aux_hidden] if out.aux_hidden is not None else [])
    for cache in caches:
        for layer in cache.layers:
            outputs += [layer.keys.clone(), layer.values.clone()]
    return outputs


@pytest.mark.parametrize("overrides", [
    ["model=tiny_random", "model.dtype=fp32", "engine.target_weights=int4"],
    ["model=tiny_random", "model.dtype=bf16", "engine.target_weights=int8"],
    ["model=tiny_random", "model.dtype=bf16", "engine.target_weights=int4", "engine.batch_invariant=false"],
    pytest.param(["model=smollm2_135m", "model.dtype=bf16"], marks=pytest.mark.embedded),
    pytest.param(["model=smollm2_135m", "model.dtype=fp32"], marks=pytest.mark.embedded),
], ids=["tiny-int4-fp32", "tiny-int8-bf16", "tiny-int4-bf16-not-invariant", "embedded-q4_1-bf16",
        "embedded-q4_1-fp32"])
def test_the_kernel_layer_computes_the_lean_loop_bit_for_bit(overrides):
    prompts = [prompt[:length] for prompt, length in zip(random_prompts(3, seed=5), (40, 23, 31))]
    results, calls = {}, {}
    for native in (True, False):
        pipe = build_pipeline(compose_config(["pipeline=vanilla", f"engine.native_layers={str(native).lower()}",
                                              *overrides]))
        model = lean_model(pipe)
        assert (model.native_layer_kernel is not None) == native
        calls[native] = counted(model) if native else []
        results[native] = run_forwards(pipe, prompts, torch.Generator().manual_seed(7))
    layers = lean_model(pipe).config.num_hidden_layers
    # the prefills (up to 40 rows, within native_rows), both steps, the verify and the batch ran the kernel's layers,
    # all of a forward's in one call
    assert len(calls[True]) == 7
    assert all(len(outputs) == layers for outputs in calls[True])
    assert len(results[True]) == len(results[False])
    for index, (fused, op_by_op) in enumerate(zip(results[True], results[False])):
        assert fused.dtype == op_by_op.dtype and fused.shape == op_by_op.shape, index
        assert torch.equal(bits(fused), bits(op_by_op)), index


def bits(values: torch.Tensor) -> torch.Tensor:
    """The values' bit patterns (NaN equal to itself, -0 unlike +0)."""
    return values.contiguous().view(torch.int16 if values.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("weights, native", [("int8", True), ("dense", False)])
def test_the_engine_line_says_where_the_layers_run_in_one_call(weights, native):
    """Blocks (int8 quantized at load) get the kernel's layers and the line says so; dense weights keep the loop."""
    pipe = build_pipeline(compose_config(["pipeline=vanilla", "model=tiny_random", "model.dtype=fp32",
                                          f"engine.target_weights={weights}"]))
    assert (lean_model(pipe).native_layer_kernel is not None) == native
    line = pipe.target.model.specpipe_engine_rewrite
    assert ("the decoder layers over native blocks one kernel call a forward in steps and verifies" in line) == native
