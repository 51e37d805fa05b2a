"""Tree verification oracle at the target level: every node's logits from one tree forward equal
the logits of a plain causal forward (no cache) over context + that node's root-to-node path.

The causal forward runs on the same model instance (so through the same engine's products): the
oracle checks masks, positions and cache, not the engine's rounding (tests/test_engine.py does)."""
from __future__ import annotations

import math

import pytest
import torch

from specpipe.target import TargetModel
from specpipe.types import DraftTree


def tree_parents(shape: str, generator: torch.Generator) -> list[int]:
    if shape == "single":
        return [-1]
    if shape == "chain":
        return list(range(-1, 7))
    if shape == "wide":
        return [-1] * 8
    if shape == "deep":  # a long chain with a side branch half-way
        return list(range(-1, 11)) + [4, 11, 12]
    if shape == "mixed":  # random parents: any earlier node or the root
        return [int(torch.randint(-1, i, (1,), generator=generator)) if i else -1 for i in range(16)]
    if shape == "two_level":  # 3 root children with 3 children each
        return [-1, -1, -1] + [p for p in range(3) for _ in range(3)]
    raise ValueError(shape)


SHAPES = ["single", "chain", "wide", "deep", "mixed", "two_level"]


def paths(parents: list[int]) -> list[list[int]]:
    """Root-to-node node index paths."""
    result = []
    for i, p in enumerate(parents):
        result.append((result[p] if p >= 0 else []) + [i])
    return result


def check_tree(model, context: list[int], parents: list[int], tokens: list[int], atol: float) -> None:
    target = TargetModel(model.loaded.model, name=model.name)
    cache = target.new_cache()
    target.prefill(context[:-1], cache)
    assert cache.get_seq_length() == len(context) - 1
    tree = DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents))
    out = target.forward_tree(context[-1], tree, cache)
    assert out.logits.shape == (len(tokens) + 1, target.vocab_size)
    assert cache.get_seq_length() == len(context) + len(tokens)  # committed + root + nodes appended

    root = model.causal_logits(context, engine=True)[-1]
    torch.testing.assert_close(out.logits[0], root, atol=atol, rtol=0)
    assert int(out.logits[0].argmax()) == int(root.argmax())
    for node, path in enumerate(paths(parents)):
        expected = model.causal_logits(context + [tokens[i] for i in path], engine=True)[-1]
        torch.testing.assert_close(out.logits[node + 1], expected, atol=atol, rtol=0,
                                   msg=lambda m: f"node {node} (path {path}): {m}")
        assert int(out.logits[node + 1].argmax()) == int(expected.argmax())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("context_length", [2, 37])
def test_tree_forward_matches_causal_tiny(tiny_chaotic, shape, context_length):
    generator = torch.Generator().manual_seed(100 * SHAPES.index(shape) + context_length)
    parents = tree_parents(shape, generator)
    context = torch.randint(300, 5000, (context_length,), generator=generator).tolist()
    tokens = torch.randint(300, 5000, (len(parents),), generator=generator).tolist()
    if shape == "wide":
        tokens[3] = tokens[5]  # the same token in two sibling branches
    check_tree(tiny_chaotic, context, parents, tokens, atol=1e-5)


def test_tree_forward_matches_causal_stock_tiny(tiny):
    generator = torch.Generator().manual_seed(3)
    parents = tree_parents("mixed", generator)
    context = torch.randint(300, 5000, (20,), generator=generator).tolist()
    tokens = torch.randint(300, 5000, (len(parents),), generator=generator).tolist()
    check_tree(tiny, context, parents, tokens, atol=1e-5)


@pytest.mark.embedded
@pytest.mark.parametrize("shape", ["single", "chain", "mixed", "two_level"])
def test_tree_forward_matches_causal_embedded(embedded, shape):
    generator = torch.Generator().manual_seed(SHAPES.index(shape))
    parents = tree_parents(shape, generator)
    context = embedded.tokenizer("The quick brown fox jumps over the lazy dog. The quick brown")["input_ids"]
    tokens = torch.randint(300, 20000, (len(parents),), generator=generator).tolist()
    # fp32 sums in other orders: the tree's rows and each recomputed path (14-29 rows) run products of other row
    # counts, for which the BLAS picks other kernels (8-wide accumulators on AVX2, 16-wide on AVX-512). A sum of n
    # terms rounds ~2**-24 * sqrt(n) relative; 2 products a layer (n up to the MLP's 1536) over 30 layers add up
    # in the residual stream: ~6e-4 at logits of ~32 (1.4e-4 seen on an AVX2 CPU). A wrong mask or position
    # moves logits by whole units, and the argmax is checked exactly.
    config = embedded.loaded.model.config
    scale = float(embedded.causal_logits(context, engine=True).abs().max())
    atol = scale * 2**-24 * math.sqrt(config.intermediate_size) * math.sqrt(2 * config.num_hidden_layers)
    check_tree(embedded, context, parents, tokens, atol=atol)


def test_empty_tree_is_a_plain_decoding_step(tiny_chaotic):
    target = TargetModel(tiny_chaotic.loaded.model, name="t")
    context = list(range(400, 430))
    cache = target.new_cache()
    target.prefill(context[:-1], cache)
    out = target.forward_tree(context[-1], DraftTree.empty(), cache)
    assert out.logits.shape[0] == 1
    torch.testing.assert_close(out.logits[0], tiny_chaotic.causal_logits(context, engine=True)[-1], atol=1e-5, rtol=0)


def test_prefill_logits_match_causal(tiny_chaotic):
    target = TargetModel(tiny_chaotic.loaded.model, name="t")
    context = list(range(700, 760))
    out = target.prefill(context, target.new_cache())
    torch.testing.assert_close(out.logits[-1], tiny_chaotic.causal_logits(context, engine=True)[-1], atol=1e-5, rtol=0)


def test_draft_tree_mask_and_depth():
    parents = [-1, 0, 0, -1, 2, 4]
    tree = DraftTree.from_parents(torch.arange(6), torch.tensor(parents))
    assert tree.depth.tolist() == [0, 1, 1, 0, 2, 3]
    for i, path in enumerate(paths(parents)):
        assert tree.mask[i].nonzero().flatten().tolist() == path
    assert tree.children()[-1] == [0, 3] and tree.children()[0] == [1, 2]
    with pytest.raises(ValueError):
        DraftTree.from_parents(torch.arange(2), torch.tensor([1, -1]))


class _Attention:  # what transformers' SDPA attention reads from the attention module
    is_causal = True
    training = False

    def __init__(self, groups: int) -> None:
        self.num_key_value_groups = groups


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("q,masked", [(1, False), (1, True), (6, True), (7, False)])
def test_folded_gqa_attention_equals_transformers_sdpa(dtype, atol, heads, kv_heads, q, masked):
    """specpipe's SDPA attention (query heads folded per KV head) returns what transformers' does,
    for decode steps, masked trees and the causal prefill it hands back to transformers."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from specpipe.target import tree_attention_forward

    generator = torch.Generator().manual_seed(heads * 100 + q)
    kv = q + 11 if masked or q == 1 else q  # a mask-free q > 1 call is a prefill: no cache before it
    query = torch.randn(2, heads, q, 16, generator=generator).to(dtype)  # [batch, heads, q, head_dim]
    key, value = (torch.randn(2, kv_heads, kv, 16, generator=generator).to(dtype) for _ in range(2))
    mask = None
    if masked:  # [batch, 1, q, kv]: the cache visible, a random ancestor pattern over the tree
        mask = torch.ones(2, 1, q, kv, dtype=torch.bool)
        mask[..., kv - q:] = torch.rand(2, 1, q, q, generator=generator) < 0.5
        mask[..., kv - q:] |= torch.eye(q, dtype=torch.bool)
    module = _Attention(heads // kv_heads)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    out, weights = tree_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert weights is None and out.shape == expected.shape == (2, q, heads, 16) and out.is_contiguous()
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)


def test_masked_sdpa_off_the_cpu_runs_without_cudnn_plans(monkeypatch):
    """Off the CPU, specpipe's SDPA attentions (tree verification with attention=sdpa, and the drafters' own
    layers) run with cuDNN's attention switched off: it builds a plan per new shape, which made drafting
    10-20x slower on an H100 (BENCHMARKS run 42). On the CPU nothing is switched, and the setting is
    restored after each call. Meta tensors stand in for a GPU's: only the device type is read."""
    from transformers import AttentionInterface, LlamaConfig

    import specpipe.target as target_module
    from specpipe.stages.draft.eagle_net import EagleNet
    from specpipe.stages.draft.eagle3 import Eagle3Net
    from specpipe.target import SDPA_ATTENTION, TREE_ATTENTION

    cudnn_enabled_during_calls = []

    def recording_sdpa(module, query, key, value, attention_mask, **kwargs):
        cudnn_enabled_during_calls.append(torch.backends.cuda.cudnn_sdp_enabled())
        return query.transpose(1, 2), None

    monkeypatch.setattr(target_module, "sdpa_attention_forward", recording_sdpa)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # torch's default, which the check below relies on
    attentions = AttentionInterface()
    for device in ("meta", "cpu"):
        query = torch.zeros(1, 4, 3, 8, device=device)  # [batch, heads, q, head_dim]
        key = value = torch.zeros(1, 2, 5, 8, device=device)  # [batch, kv_heads, kv, head_dim]
        mask = torch.ones(1, 1, 3, 5, dtype=torch.bool, device=device)  # [batch, 1, q, kv]
        attentions[SDPA_ATTENTION](None, query, key, value, mask)
        attentions[TREE_ATTENTION](None, query, key, value, None)  # a mask-free prefill: transformers' path
    assert cudnn_enabled_during_calls == [False, False, True, True]
    assert torch.backends.cuda.cudnn_sdp_enabled()
    # The EAGLE layer and EAGLE-3's midlayer attend through it.
    def config() -> LlamaConfig:
        return LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                           num_hidden_layers=1, vocab_size=32)

    assert EagleNet(config()).layers[0].self_attn.config._attn_implementation == SDPA_ATTENTION
    assert Eagle3Net(config(), (0, 1, 2), 8).midlayer.self_attn.config._attn_implementation == SDPA_ATTENTION
