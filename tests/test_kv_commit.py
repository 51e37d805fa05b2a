"""After verify + greedy accept + KVCompactCommit, the KV cache equals the cache of prefilling the
committed text from scratch; the position-indexed cache keeps its content when it grows."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from specpipe.kv_cache import PositionIndexedCache, PositionIndexedLayer
from specpipe.pipelines.stopping import StopCondition
from specpipe.stages.commit.kv_compact import KVCompactCommit
from specpipe.stages.verify.greedy import GreedyVerifier
from specpipe.target import TargetModel
from specpipe.types import DecodeState, DraftTree

# Trees as (parent, token) specs over the greedy continuation g of the context:
# ("g", k) = g[k] (right at depth k), ("w", k) = a token that is not g[k] (wrong).
# expected = the accepted node indices.
SCENARIOS = {
    "rejected_first_node": ([(-1, ("w", 0)), (0, ("g", 1)), (-1, ("w2", 0))], []),
    "full_branch": ([(-1, ("g", 0)), (0, ("g", 1)), (1, ("g", 2)), (2, ("g", 3))], [0, 1, 2, 3]),
    "partial_path": ([(-1, ("g", 0)), (0, ("g", 1)), (1, ("w", 2)), (2, ("g", 3))], [0, 1]),
    "second_child_matches": ([(-1, ("w", 0)), (-1, ("g", 0)), (1, ("g", 1))], [1, 2]),
    # The accepted path 2 -> 5 -> 7 skips nodes of rejected branches: rows 3, 6, 8 are kept.
    "non_contiguous": ([(-1, ("w", 0)), (0, ("g", 1)), (-1, ("g", 0)), (2, ("w", 1)), (3, ("g", 2)),
                        (2, ("g", 1)), (-1, ("w2", 0)), (5, ("g", 2)), (4, ("g", 3))], [2, 5, 7]),
    "single_node_accepted": ([(-1, ("g", 0))], [0]),
    "empty_tree": ([], []),
}


def make_tree(spec, greedy: list[int]) -> DraftTree:
    tokens = []
    for _, (kind, k) in spec:
        tokens.append({"g": greedy[k], "w": greedy[k] + 1, "w2": greedy[k] + 2}[kind])
    if not spec:
        return DraftTree.empty()
    return DraftTree.from_parents(torch.tensor(tokens), torch.tensor([p for p, _ in spec]))


def reference_cache(model, tokens: list[int]) -> DynamicCache:
    """The cache of prefilling `tokens` from scratch on the reference instance (stock HF cache)."""
    cache = DynamicCache()
    with torch.inference_mode():
        model.reference(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def assert_cache_equal(cache: PositionIndexedCache, expected: DynamicCache, length: int, atol: float = 1e-5) -> None:
    assert cache.get_seq_length() == length == expected.get_seq_length()
    assert len(cache.layers) == len(expected.layers)
    for i, (layer, ref) in enumerate(zip(cache.layers, expected.layers)):
        torch.testing.assert_close(layer.keys, ref.keys, atol=atol, rtol=0, msg=lambda m: f"layer {i} keys: {m}")
        torch.testing.assert_close(layer.values, ref.values, atol=atol, rtol=0, msg=lambda m: f"layer {i} values: {m}")


def verify_and_commit(target, cache, state, tree, stop: StopCondition | None = None):
    forward = target.forward_tree(state.tokens[-1], tree, cache)
    result = GreedyVerifier().accept(tree, forward.logits, None)
    result = dataclasses.replace(result, hidden=forward.hidden)
    emitted = [int(tree.tokens[i]) for i in result.accepted] + [result.bonus]
    if stop is not None:
        emitted, _ = stop.cut(emitted)
    KVCompactCommit().commit(state, cache, tree, result, emitted)
    return result, emitted


def start(model, context: list[int]):
    target = TargetModel(model.loaded.model, name=model.name)
    cache = target.new_cache()
    target.prefill(context[:-1], cache)
    return target, cache, DecodeState(tokens=list(context), prompt_length=len(context))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_commit_equals_prefill_from_scratch(tiny_mixed, scenario):
    spec, expected_accepted = SCENARIOS[scenario]
    context = torch.randint(300, 1300, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    greedy = tiny_mixed.greedy_loop(context, 12, eos_token_ids=())
    target, cache, state = start(tiny_mixed, context)
    tree = make_tree(spec, greedy)

    result, emitted = verify_and_commit(target, cache, state, tree)
    assert result.accepted == expected_accepted
    assert result.bonus == greedy[len(expected_accepted)]
    assert emitted == greedy[:len(expected_accepted) + 1]
    assert state.tokens == context + emitted
    assert_cache_equal(cache, reference_cache(tiny_mixed, state.tokens[:-1]), len(state.tokens) - 1)
    # state.logits / state.hidden belong to tokens[-2], whose logits chose the new root.
    with torch.inference_mode():
        out = tiny_mixed.reference(input_ids=torch.tensor([state.tokens[:-1]]), output_hidden_states=True)
    torch.testing.assert_close(state.logits, out.logits[0, -1], atol=1e-5, rtol=0)
    torch.testing.assert_close(state.hidden, out.hidden_states[-1][0, -1])

    # The compacted cache keeps working: a second step (a right chain of 3) verifies and commits exactly.
    done = len(emitted)
    second = DraftTree.from_parents(torch.tensor(greedy[done:done + 3]), torch.tensor([-1, 0, 1]))
    result, emitted2 = verify_and_commit(target, cache, state, second)
    assert result.accepted == [0, 1, 2] and emitted2 == greedy[done:done + 4]
    assert state.tokens == context + greedy[:done + 4]
    assert_cache_equal(cache, reference_cache(tiny_mixed, state.tokens[:-1]), len(state.tokens) - 1)


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_commit_cut_by_stop_condition(tiny_mixed, keep):
    """A step accepting 4 + bonus but cut to `keep` tokens keeps only the cut path's entries."""
    context = torch.randint(300, 1300, (17,), generator=torch.Generator().manual_seed(2)).tolist()
    greedy = tiny_mixed.greedy_loop(context, 8, eos_token_ids=())
    target, cache, state = start(tiny_mixed, context)
    tree = make_tree(SCENARIOS["full_branch"][0], greedy)
    result, emitted = verify_and_commit(target, cache, state, tree, StopCondition(max_new_tokens=keep))
    assert result.accepted == [0, 1, 2, 3] and emitted == greedy[:keep]
    assert state.tokens == context + greedy[:keep]
    assert_cache_equal(cache, reference_cache(tiny_mixed, state.tokens[:-1]), len(state.tokens) - 1)


def test_commit_many_steps_embedded(embedded):
    """Real model, several mixed steps in a row."""
    context = embedded.tokenizer("One, two, three, four, five, six, seven, eight")["input_ids"]
    greedy = embedded.greedy_loop(context, 10, eos_token_ids=())
    target, cache, state = start(embedded, context)
    done = 0
    for name in ("non_contiguous", "rejected_first_node", "partial_path"):
        spec, accepted = SCENARIOS[name]
        result, emitted = verify_and_commit(target, cache, state, make_tree(spec, greedy[done:]))
        assert result.accepted == accepted
        done += len(emitted)
    assert state.tokens == context + greedy[:done]
    assert_cache_equal(cache, reference_cache(embedded, state.tokens[:-1]), len(state.tokens) - 1, atol=1e-4)


def test_commit_across_capacity_growth(tiny_mixed):
    """Prefill 500 tokens, then verify 16-node trees: the cache grows past 512 mid-verify and the
    committed content still equals a from-scratch prefill."""
    generator = torch.Generator().manual_seed(3)
    context = torch.randint(300, 1300, (500,), generator=generator).tolist()
    greedy = tiny_mixed.greedy_loop(context, 30, eos_token_ids=())
    target, cache, state = start(tiny_mixed, context)
    assert cache.layers[0]._key_buffer.shape[2] == PositionIndexedLayer.initial_capacity == 512
    done = 0
    while done < 20:
        # A chain with 3 right tokens then wrong ones, plus a wide fan of wrong siblings.
        tokens = greedy[done:done + 3] + [greedy[done + 3] + 1] + [greedy[done] + 7 + j for j in range(12)]
        parents = [-1, 0, 1, 2] + [-1] * 12
        result, emitted = verify_and_commit(target, cache, state, DraftTree.from_parents(torch.tensor(tokens),
                                                                                        torch.tensor(parents)))
        assert emitted == greedy[done:done + 4]
        done += 4
    assert cache.layers[0]._key_buffer.shape[2] > 512
    assert state.tokens == context + greedy[:done]
    assert_cache_equal(cache, reference_cache(tiny_mixed, state.tokens[:-1]), len(state.tokens) - 1)


def test_position_indexed_layer_growth_keeps_content():
    layer = PositionIndexedLayer()
    generator = torch.Generator().manual_seed(0)
    chunks = [torch.randn(1, 2, n, 8, generator=generator) for n in (300, 200, 100, 700)]
    for i, chunk in enumerate(chunks):
        keys, values = layer.update(chunk, -chunk)
        expected = torch.cat(chunks[:i + 1], dim=2)
        assert torch.equal(keys, expected) and torch.equal(values, -expected)
        assert layer.get_seq_length() == expected.shape[2]
    assert layer._key_buffer.shape[2] >= 1300
    # keep() after growth: rows start + [0, 5, 900] move down to start.
    layer.keep(100, torch.tensor([0, 5, 900]))
    full = torch.cat(chunks, dim=2)
    expected = torch.cat([full[:, :, :100], full[:, :, [100, 105, 1000]]], dim=2)
    assert torch.equal(layer.keys, expected) and torch.equal(layer.values, -expected)
    layer.crop(50)
    assert layer.get_seq_length() == 50 and torch.equal(layer.keys, full[:, :, :50])
    layer.crop(-10)
    assert layer.get_seq_length() == 40


def test_position_indexed_cache_keep_and_crop():
    cache = PositionIndexedCache()
    generator = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 2, 10, 4, generator=generator)
    cache.update(keys, keys * 2, 0)
    cache.update(-keys, keys, 1)
    assert cache.get_seq_length() == 10
    cache.keep(6, [1, 3])
    assert cache.get_seq_length() == 8
    assert torch.equal(cache.layers[0].keys, keys[:, :, [0, 1, 2, 3, 4, 5, 7, 9]])
    assert torch.equal(cache.layers[0].values, 2 * keys[:, :, [0, 1, 2, 3, 4, 5, 7, 9]])
    assert torch.equal(cache.layers[1].keys, -keys[:, :, [0, 1, 2, 3, 4, 5, 7, 9]])
    cache.keep(5, [0, 1])  # a chain's prefix: rows stay where they are
    assert cache.get_seq_length() == 7
    assert torch.equal(cache.layers[0].keys, keys[:, :, [0, 1, 2, 3, 4, 5, 7]])
    cache.keep(2, [0])
    assert torch.equal(cache.layers[0].keys, keys[:, :, :3]) and cache.get_seq_length() == 3
    cache.crop(2)
    assert cache.get_seq_length() == 2 and cache.layers[0].keys.shape[2] == 2
