"""drafter=jacobi (Lookahead Decoding): the lookahead rows see exactly their trajectory, the pool
harvests each column's n-gram, the window shifts as the reference implementation does, bad sizes
are refused, and no lookahead row survives a commit. Losslessness: tests/test_lossless.py (every
conf/pipeline/*.yaml, pipeline=jacobi included)."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from conftest import random_prompts, run_steps
from specpipe.errors import ConfigError
from specpipe.pipelines.builder import build_pipeline
from specpipe.stages.base import LookaheadBranch, LookaheadRows, Proposer
from specpipe.stages.commit.kv_compact import KVCompactCommit
from specpipe.stages.draft.jacobi import JacobiDrafter, harvest, jacobi_update, window_rows
from specpipe.stages.verify.greedy import GreedyVerifier
from specpipe.types import DecodeState, DraftTree, VerifyResult
from test_kv_commit import SCENARIOS, assert_cache_equal, make_tree, reference_cache, start


def one_hot_logits(tokens: list[int], vocab: int = 64) -> torch.Tensor:
    """[len(tokens), vocab] logits whose argmax row i is tokens[i]."""
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return logits


def row_contexts(levels: list[list[int]], root: int) -> list[list[int]]:
    """What each lookahead row sees after the committed text, per the paper: level 0 up to its own
    column (the root is column 0), then its column in every level up to its own. Rows in
    `window_rows` order; each list ends with the row's own token."""
    span = len(levels[0])
    first_row = [root, *levels[0]]
    contexts = [first_row[:column + 1] for column in range(1, span + 1)]
    for level_index in range(1, len(levels)):
        for column in range(span + 1):
            contexts.append(first_row[:column + 1] + [levels[l][column] for l in range(1, level_index + 1)])
    return contexts


# ---- the mask ---------------------------------------------------------------------------------

def test_window_rows_layout_by_hand():
    """N = 3, W = 3: level 0 = [a1, a2] (the root is its column 0), level 1 = [b0, b1, b2]."""
    tokens, positions, mask = window_rows([[11, 12], [20, 21, 22]], root_position=100)
    assert tokens.tolist() == [11, 12, 20, 21, 22]
    assert positions.tolist() == [101, 102, 101, 102, 103]
    #                          root  a1     a2     b0     b1     b2
    expected = torch.tensor([[1, 1, 0, 0, 0, 0],   # a1: root, a1
                             [1, 1, 1, 0, 0, 0],   # a2: root, a1, a2
                             [1, 0, 0, 1, 0, 0],   # b0: root, b0
                             [1, 1, 0, 0, 1, 0],   # b1: root, a1, b1
                             [1, 1, 1, 0, 0, 1]],  # b2: root, a1, a2, b2
                            dtype=torch.bool)
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("window,ngram", [(4, 4), (3, 2), (1, 3)])
def test_lookahead_rows_equal_causal_forwards_and_leave_verify_rows_alone(tiny_mixed, window, ngram):
    """In one forward with a draft tree: each lookahead row's logits equal a plain causal forward over
    the committed text + its trajectory, and the root/tree rows equal the forward without the rows."""
    context = torch.randint(300, 1300, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    greedy = tiny_mixed.greedy_loop(context, 6, eos_token_ids=())
    tree = make_tree(SCENARIOS["non_contiguous"][0], greedy)
    generator = torch.Generator().manual_seed(4)
    levels = [torch.randint(300, 1300, (window - 1,), generator=generator).tolist()]
    levels += [torch.randint(300, 1300, (window,), generator=generator).tolist() for _ in range(ngram - 2)]
    tokens, positions, mask = window_rows(levels, root_position=len(context) - 1)
    rows = LookaheadRows(tokens, positions, mask)

    target, cache, _ = start(tiny_mixed, context)
    alone = target.forward_tree(context[-1], tree, cache)
    cache.crop(len(context) - 1)
    together = target.forward_tree(context[-1], tree, cache, [rows])
    assert cache.get_seq_length() == len(context) + len(tree) + len(rows)

    assert together.logits.shape == (len(tree) + 1, alone.logits.shape[1])  # what the verifier reads
    torch.testing.assert_close(together.logits, alone.logits, atol=1e-4, rtol=0)
    (block,) = together.lookahead_logits
    assert block.shape[0] == 1 + len(rows)
    torch.testing.assert_close(block[0], alone.logits[0], atol=1e-4, rtol=0)
    contexts = row_contexts(levels, context[-1])
    assert len(contexts) == len(rows) == window * (ngram - 1) - 1
    for row, seen in enumerate(contexts):
        assert seen[-1] == int(tokens[row])
        expected = tiny_mixed.causal_logits(context + seen[1:], engine=True)[-1]
        torch.testing.assert_close(block[row + 1], expected, atol=1e-4, rtol=0, msg=lambda m: f"row {row}: {m}")


def test_two_blocks_do_not_see_each_other(tiny_mixed):
    context = torch.randint(300, 1300, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    first = LookaheadRows(*window_rows([[401, 402, 403]], root_position=len(context) - 1))
    second = LookaheadRows(*window_rows([[501, 502], [601, 602, 603]], root_position=len(context) - 1))
    target, cache, _ = start(tiny_mixed, context)
    both = target.forward_tree(context[-1], DraftTree.empty(), cache, [first, second]).lookahead_logits
    for block, rows in zip(both, (first, second)):
        cache.crop(len(context) - 1)
        (alone,) = target.forward_tree(context[-1], DraftTree.empty(), cache, [rows]).lookahead_logits
        torch.testing.assert_close(block, alone, atol=1e-4, rtol=0)


def test_lookahead_rows_are_checked():
    with pytest.raises(ValueError, match=r"mask \[r, 1 \+ r\]"):
        LookaheadRows(torch.tensor([1, 2]), torch.tensor([5, 6]), torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="see itself"):
        LookaheadRows(torch.tensor([1]), torch.tensor([5]), torch.tensor([[True, False]]))


# ---- the pool and the window ------------------------------------------------------------------

def test_harvest_by_hand():
    """N = 3, W = 3: each column's trajectory plus its update is a 3-gram keyed by its first token."""
    pool: dict = {}
    harvest(pool, root=7, levels=[[11, 12], [20, 21, 22]], update=[30, 31, 32], per_token=2)
    assert {key: list(grams) for key, grams in pool.items()} == {7: [(20, 30)], 11: [(21, 31)], 12: [(22, 32)]}
    # Again with a new 3-gram for 11 and the old one for 7: recency order, at most 2 per first token.
    harvest(pool, root=11, levels=[[7, 99], [40, 20, 41]], update=[50, 30, 51], per_token=2)
    assert list(pool[7]) == [(20, 30)]
    assert list(pool[11]) == [(21, 31), (40, 50)]
    assert list(pool[99]) == [(41, 51)]
    harvest(pool, root=11, levels=[[99], [60, 61]], update=[70, 71], per_token=2)
    assert list(pool[11]) == [(40, 50), (60, 70)]  # (21, 31), the least recent, was forgotten


def test_jacobi_update_reads_the_last_level():
    levels = [[11, 12], [20, 21, 22]]  # rows: a1, a2, b0, b1, b2 after the root's row
    logits = one_hot_logits([1, 2, 3, 4, 5, 6])
    assert jacobi_update(levels, logits) == [4, 5, 6]
    assert jacobi_update([[11, 12]], one_hot_logits([1, 2, 3])) == [1, 2, 3]  # N = 2: the root's row too


def decode_state(prompt: list[int]) -> DecodeState:
    return DecodeState(tokens=list(prompt), prompt_length=len(prompt))


def no_result() -> VerifyResult:
    return VerifyResult(accepted=[], bonus=0, logits=torch.zeros(1, 64))


def step(drafter: JacobiDrafter, state: DecodeState, update_tokens: list[int], committed: list[int]) -> LookaheadRows:
    """One decoding step as the decoder runs it, with the target's argmax chosen by hand: row 0 (the
    root) and every lookahead row predict `update_tokens` (one per row, root first)."""
    drafter.propose(state)
    rows = drafter.lookahead_rows(state)
    drafter.on_lookahead(state, one_hot_logits(update_tokens[:1 + len(rows)]))
    state.tokens.extend(committed)
    drafter.on_commit(state, no_result())
    return rows


def test_window_fills_then_shifts_one_level_per_step():
    drafter = JacobiDrafter(window=3, ngram=4, guesses=4)
    state = decode_state(list(range(40, 52)))
    drafter.reset(state)
    sequence = state.stage_state[drafter]
    (level0,) = sequence.levels
    assert len(level0) == 3 - 1 + 2 and set(level0) <= set(range(40, 52))  # random prompt tokens
    # Fill step 1: level 0 rows only; their update (root's row first) becomes level 1.
    rows = step(drafter, state, [1, 2, 3, 4, 5], committed=[60])
    assert len(rows) == 4 and sequence.levels == [level0[1:], [2, 3, 4, 5]]
    assert not sequence.pool  # nothing harvested while filling
    # Fill step 2: the last level's rows give level 2; every level loses its first column.
    rows = step(drafter, state, [0, 0, 0, 0, 6, 7, 8, 9], committed=[61])
    assert len(rows) == 7 and sequence.levels == [level0[2:], [3, 4, 5], [7, 8, 9]]
    # Full: W (N - 1) - 1 rows; harvest the 4-grams, then every level moves up one.
    rows = step(drafter, state, [0] * 6 + [10, 11, 12], committed=[62, 63, 64])  # 3 tokens: still one level
    assert len(rows) == 3 * 3 - 1
    first = [61, *level0[2:]]
    assert {key: list(grams) for key, grams in sequence.pool.items()} == {
        first[0]: [(3, 7, 10)], first[1]: [(4, 8, 11)], first[2]: [(5, 9, 12)]}
    assert sequence.levels == [[4, 5], [7, 8, 9], [10, 11, 12]]
    # The pool proposes the n-grams starting with the root.
    state.tokens.append(first[1])
    proposal = drafter.propose(state)
    assert proposal.tokens.tolist() == [4, 8, 11] and proposal.parents.tolist() == [-1, 0, 1]
    assert 0 < proposal.scores[2] <= proposal.scores[1] <= proposal.scores[0] <= 1


def test_window_follows_accepted_tokens_when_asked():
    drafter = JacobiDrafter(window=3, ngram=3, guesses=4, follow_accepted=True)
    state = decode_state(list(range(40, 52)))
    drafter.reset(state)
    sequence = state.stage_state[drafter]
    sequence.levels = [[11, 12], [20, 21, 22]]
    step(drafter, state, [0, 0, 0, 30, 31, 32], committed=[60, 61])  # the root moved by 2
    level0, level1 = sequence.levels
    # Moving by one gives [[21, 22], [30, 31, 32]]; one more column drops each token at or before the new root.
    assert level0[:1] == [22] and level1[:2] == [31, 32]
    assert len(level0) == 2 and len(level1) == 3 and level0[1] in range(40, 52) and level1[2] in range(40, 52)


def test_plain_jacobi_keeps_one_level():
    """N = 2: level 0's own update (after the root's row) is its next guess."""
    drafter = JacobiDrafter(window=4, ngram=2, guesses=3)
    state = DecodeState(tokens=list(range(40, 52)) + [99], prompt_length=12)  # the root, 99, is no guess
    drafter.reset(state)
    sequence = state.stage_state[drafter]
    assert [len(level) for level in sequence.levels] == [3]
    guesses = list(sequence.levels[0])
    rows = step(drafter, state, [5, 6, 7, 8], committed=[5])
    assert len(rows) == 3 and sequence.levels == [[6, 7, 8]]
    expected = {99: [(5,)]}
    for guess, update in zip(guesses, [6, 7, 8]):  # random guesses may repeat: their 2-grams pile up
        expected.setdefault(guess, []).append((update,))
    assert {key: list(grams) for key, grams in sequence.pool.items()} == expected


def test_pool_from_prompt():
    drafter = JacobiDrafter(window=2, ngram=3, guesses=2, pool_from_prompt=True)
    state = decode_state([1, 2, 3, 1, 2, 4, 1, 5, 6])
    drafter.reset(state)
    pool = state.stage_state[drafter].pool
    assert list(pool[1]) == [(2, 4), (5, 6)] and list(pool[2]) == [(3, 1), (4, 1)]
    assert isinstance(pool[1], OrderedDict)


def test_protocols_and_per_request_state():
    drafter = JacobiDrafter()
    assert isinstance(drafter, Proposer) and isinstance(drafter, LookaheadBranch)
    a, b = decode_state([1, 2, 3, 4]), decode_state([9, 8, 7, 6, 5])
    drafter.reset(a)
    drafter.reset(b)
    assert a.stage_state[drafter] is not b.stage_state[drafter]
    assert a.stage_state[drafter].filler == [1, 2, 3, 4] and b.stage_state[drafter].filler == [9, 8, 7, 6, 5]
    # Only the configuration lives on the stage: concurrent requests share it.
    assert set(vars(drafter)) == {"name", "window", "ngram", "guesses", "follow_accepted", "pool_from_prompt",
                                  "seed", "prior"}


@pytest.mark.parametrize("kwargs,message", [
    ({"window": 0}, r"window \(W\) must be an integer >= 1, got 0"),
    ({"ngram": 1}, r"ngram \(N\) must be an integer >= 2, got 1"),
    ({"guesses": 0}, r"guesses \(G\) must be an integer >= 1, got 0"),
    ({"window": -3}, r"window \(W\)"),
    ({"window": 2.5}, r"window \(W\) must be an integer"),
])
def test_bad_sizes_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        JacobiDrafter(**kwargs)


def test_bad_sizes_from_the_command_line(tiny):
    with pytest.raises(ConfigError, match=r"ngram \(N\) must be an integer >= 2"):
        build_pipeline(tiny.config("jacobi", "pipeline.proposers.jacobi.ngram=1"), loaded=tiny.loaded)


# ---- the cache and the decoder ----------------------------------------------------------------

@pytest.mark.parametrize("scenario", ["non_contiguous", "partial_path", "empty_tree", "rejected_first_node"])
def test_commit_leaves_no_lookahead_row(tiny_mixed, scenario):
    """Verify a tree with the window riding along, commit: the cache equals prefilling the committed
    text from scratch, and the next step (again with rows) still verifies exactly."""
    spec, expected_accepted = SCENARIOS[scenario]
    context = torch.randint(300, 1300, (21,), generator=torch.Generator().manual_seed(6)).tolist()
    greedy = tiny_mixed.greedy_loop(context, 12, eos_token_ids=())
    target, cache, state = start(tiny_mixed, context)
    drafter = JacobiDrafter(window=4, ngram=3, guesses=4)
    drafter.reset(state)
    # While the window fills: level 0 alone (W + N - 3 = 4 rows), then levels 0 and 1 (3 + 4 rows).
    for tree, row_count in zip([make_tree(spec, greedy), None], [4, 7]):
        if tree is None:  # the second step: a right chain of 2
            done = len(state.tokens) - len(context)
            tree = DraftTree.from_parents(torch.tensor(greedy[done:done + 2]), torch.tensor([-1, 0]))
            expected_accepted = [0, 1]
        drafter.propose(state)
        rows = drafter.lookahead_rows(state)
        assert len(rows) == row_count
        forward = target.forward_tree(state.tokens[-1], tree, cache, [rows])
        assert cache.get_seq_length() == len(state.tokens) + len(tree) + len(rows)
        drafter.on_lookahead(state, forward.lookahead_logits[0])
        result = GreedyVerifier().accept(tree, forward.logits, None)
        assert result.accepted == expected_accepted
        emitted = [int(tree.tokens[i]) for i in result.accepted] + [result.bonus]
        KVCompactCommit().commit(state, cache, tree, result, emitted)
        drafter.on_commit(state, result)
        assert state.tokens == context + greedy[:len(state.tokens) - len(context)]
        assert_cache_equal(cache, reference_cache(tiny_mixed, state.tokens[:-1]), len(state.tokens) - 1)


@pytest.mark.parametrize("ngram", [2, 3, 5])
def test_jacobi_pipeline_lossless_and_drafts(tiny_mixed, ngram):
    """pipeline=jacobi with N from the command line equals plain greedy and accepts lookahead drafts."""
    pipe = tiny_mixed.pipeline("jacobi", f"pipeline.proposers.jacobi.ngram={ngram}")
    (drafter,) = pipe.decoder.proposers
    assert drafter.ngram == ngram
    drafted = 0
    for i, prompt in enumerate(random_prompts(8, seed=12)):
        tokens, steps = run_steps(pipe, prompt, 30)
        assert tokens == tiny_mixed.greedy_hf(prompt, 30), f"N={ngram}, prompt {i}"
        assert all("lookahead" in step.stats.seconds for step in steps[1:])
        drafted += sum(step.drafted for step in steps)
    assert drafted > 0
