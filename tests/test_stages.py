"""Unit tests of the stages: n-gram index, prompt n-gram retriever, trie tree builder, greedy
verifier, stop condition, cost curve."""
from __future__ import annotations

import math

import pytest
import torch

from specpipe.cost import CostCurve
from specpipe.pipelines.stopping import StopCondition
from specpipe.stages.retrieve.ngram_index import NgramIndex
from specpipe.stages.retrieve.prompt_ngram import PromptNgram
from specpipe.stages.tree.trie import TrieTreeBuilder
from specpipe.stages.verify.greedy import GreedyVerifier
from specpipe.types import DecodeState, DraftTree, Proposal, VerifyResult, merge_by_prefix

# ---- NgramIndex --------------------------------------------------------------------------------


def index_of(tokens, min_n=1, max_n=4) -> NgramIndex:
    index = NgramIndex(min_n, max_n)
    index.reset(tokens)
    return index


def test_ngram_no_self_match():
    # [1, 2] occurs at the end (itself, nothing after it) and once before; that match is
    # three tokens back, so the text is read as repeating with period 3.
    assert index_of([1, 2, 3, 1, 2]).continuations(8, 16) == [(2, ([3, 1, 2] * 6)[:16])]
    assert index_of([7, 8, 9]).continuations(8, 16) == []
    assert index_of([5]).continuations(8, 16) == []


def test_ngram_most_recent_first_within_a_length():
    tokens = [5, 1, 7, 5, 1, 8, 5, 1]
    assert index_of(tokens).continuations(8, 16) == [(2, ([8, 5, 1] * 6)[:16]),
                                                      (2, ([7, 5, 1, 8, 5, 1] * 3)[:16])]
    assert index_of(tokens).continuations(1, 16) == [(2, ([8, 5, 1] * 6)[:16])]


def test_ngram_longest_match_first():
    # The 3-gram [9, 5, 1] matches early on; the 1-gram [1] also matches more recently.
    tokens = [9, 5, 1, 7, 3, 1, 4, 9, 5, 1]
    period7 = ([7, 3, 1, 4, 9, 5, 1] * 3)[:16]
    assert index_of(tokens).continuations(8, 16) == [(3, period7), (1, ([4, 9, 5, 1] * 4)[:16])]
    assert index_of(tokens).continuations(1, 16) == [(3, period7)]
    assert index_of(tokens, max_n=2).continuations(8, 16)[0] == (2, period7)
    assert index_of(tokens, min_n=2).continuations(8, 16) == [(3, period7)]
    # A match far enough back is copied as it stands, not repeated.
    assert index_of(tokens).continuations(1, 5) == [(3, [7, 3, 1, 4, 9])]


def test_ngram_max_length_and_each_start_once():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert index_of(tokens).continuations(8, 3) == [(2, [3, 4, 5])]  # 1-gram [2] would reuse the same start


def test_ngram_extend_equals_reset():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (80,), generator=generator).tolist()
    incremental = index_of(tokens[:10])
    for i in range(10, 80, 7):
        incremental.extend(tokens[i:i + 7])
        assert incremental.continuations(8, 5) == index_of(tokens[:i + 7]).continuations(8, 5)


def test_ngram_sizes_validated():
    with pytest.raises(ValueError):
        NgramIndex(0, 3)
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


# ---- PromptNgram -------------------------------------------------------------------------------


def state_of(tokens) -> DecodeState:
    return DecodeState(tokens=list(tokens), prompt_length=len(tokens))


def proposer(tokens, **kwargs) -> tuple[PromptNgram, DecodeState]:
    ngram = PromptNgram(**kwargs)
    state = state_of(tokens)
    ngram.reset(state)
    return ngram, state


def assert_scores_valid(proposal: Proposal) -> None:
    scores, parents = proposal.scores.tolist(), proposal.parents.tolist()
    assert all(0.0 < s <= 1.0 for s in scores), scores
    for i, p in enumerate(parents):
        assert p < i
        if p >= 0:
            assert scores[i] <= scores[p] + 1e-7, (i, scores)


def test_prompt_lookup_proposes_one_chain():
    tokens = [4, 5, 6, 7, 8, 9, 4, 5, 10, 11, 4, 5]
    ngram, state = proposer(tokens, max_matches=1, max_length=5)
    proposal = ngram.propose(state)
    # The most recent match of [4, 5], four tokens back: the period repeats to max_length.
    assert proposal.tokens.tolist() == [10, 11, 4, 5, 10]
    assert proposal.parents.tolist() == [-1, 0, 1, 2, 3]
    assert proposal.source == "prompt_ngram"
    assert_scores_valid(proposal)


def test_prompt_ngram_empty_when_nothing_matches():
    ngram, state = proposer([1, 2, 3, 4], max_matches=4)
    assert len(ngram.propose(state)) == 0


def test_trie_merges_shared_prefixes_with_counts():
    # The suffix [1, 2] continues with 3 twice (then 9 or 1) and with 4 once.
    tokens = [1, 2, 3, 9, 1, 2, 4, 1, 2, 3, 1, 1, 2]
    ngram, state = proposer(tokens, name="ngram_trie", max_matches=8, max_length=2)
    proposal = ngram.propose(state)
    tokens_, parents, scores = proposal.tokens.tolist(), proposal.parents.tolist(), proposal.scores.tolist()
    roots = {tokens_[i]: i for i, p in enumerate(parents) if p == -1}
    assert set(roots) == {3, 4}
    children_of_3 = sorted(tokens_[i] for i, p in enumerate(parents) if p == roots[3])
    assert children_of_3 == [1, 9]
    assert len(tokens_) == 5  # 3, 4 and three children; the two [3, ...] continuations share node 3
    assert len(set(zip(tokens_, parents))) == len(tokens_)  # no duplicate siblings
    # Fresh calibration: every factor is the prior, so scores are prior * frequency ratio.
    prior = state.stage_state[ngram].calibration.factor(2, 0)
    assert scores[roots[3]] == pytest.approx(prior * 2 / 3)
    assert scores[roots[4]] == pytest.approx(prior * 1 / 3)
    for i, p in enumerate(parents):
        if p == roots[3]:
            assert scores[i] == pytest.approx(scores[roots[3]] * state.stage_state[ngram].calibration.factor(2, 1) * 1 / 2)
    assert_scores_valid(proposal)


def test_scores_valid_on_random_text():
    generator = torch.Generator().manual_seed(1)
    for seed in range(5):
        tokens = torch.randint(0, 5, (200,), generator=generator).tolist()
        ngram, state = proposer(tokens, max_matches=8, max_length=8)
        proposal = ngram.propose(state)
        assert len(proposal) > 0
        assert_scores_valid(proposal)


def run_commits(ngram: PromptNgram, state: DecodeState, right: bool, steps: int) -> list[float]:
    """Proposes, then commits either the proposed chain (drafts right) or other tokens (wrong);
    returns the first node's score at every step."""
    first_scores = []
    for step in range(steps):
        proposal = ngram.propose(state)
        assert len(proposal) > 0
        first_scores.append(float(proposal.scores[0]))
        drafted = proposal.tokens.tolist()
        emitted = drafted if right else [1000 + 2 * step, 1001 + 2 * step]  # the periodic text goes on, or not
        state.tokens.extend(emitted)
        ngram.on_commit(state, VerifyResult(accepted=list(range(len(drafted) - 1)) if right else [],
                                            bonus=emitted[-1], logits=torch.empty(0)))
    return first_scores


def test_calibration_learns_up_when_drafts_are_right():
    tokens = [1, 2, 3, 4, 5] * 6
    ngram, state = proposer(tokens, max_matches=1, max_length=8)
    scores = run_commits(ngram, state, right=True, steps=6)
    assert scores[-1] > scores[0] + 0.1, scores
    assert all(b >= a - 1e-7 for a, b in zip(scores, scores[1:])), scores


def test_calibration_learns_down_when_drafts_are_wrong():
    # A long text where the last token recurs often: there is always a match to propose.
    tokens = [7, 1, 2, 7, 3, 4, 7, 5, 6, 7] * 3 + [7]
    ngram, state = proposer(tokens, max_matches=1, max_length=4, min_ngram=1, max_ngram=1)
    first = float(ngram.propose(state).scores[0])
    for step in range(6):
        proposal = ngram.propose(state)
        wrong = [t + 500 for t in proposal.tokens.tolist()[:1]] + [7]  # first draft token wrong, then 7 again
        state.tokens.extend(wrong)
        ngram.on_commit(state, VerifyResult(accepted=[], bonus=wrong[0], logits=torch.empty(0)))
    last = float(ngram.propose(state).scores[0])
    assert last < first - 0.1, (first, last)


def test_each_sequence_keeps_its_own_state():
    """One stage serves concurrent requests: a second sequence neither sees nor disturbs the first."""
    ngram, state = proposer([1, 2, 3, 1, 2], max_matches=1, max_length=4)
    assert ngram.propose(state).tokens.tolist() == [3, 1, 2, 3]
    other = state_of([9, 8, 9])
    ngram.reset(other)
    assert ngram.propose(other).tokens.tolist() == [8, 9, 8, 9]
    assert ngram.propose(state).tokens.tolist() == [3, 1, 2, 3]
    assert state.stage_state[ngram] is not other.stage_state[ngram]


# ---- TrieTreeBuilder ---------------------------------------------------------------------------

FLAT = CostCurve.flat()


def chain(tokens, scores, source="s") -> Proposal:
    return Proposal.chain(tokens, scores, source)


def assert_tree_valid(tree: DraftTree) -> None:
    parents = tree.parents.tolist()
    for i, p in enumerate(parents):
        assert -1 <= p < i
        ancestors, node = {i}, p
        while node >= 0:
            ancestors.add(node)
            node = parents[node]
        assert set(tree.mask[i].nonzero().flatten().tolist()) == ancestors
        assert int(tree.depth[i]) == len(ancestors) - 1


def test_trie_builder_dedupes_shared_prefix():
    builder = TrieTreeBuilder(FLAT, max_nodes=32)
    tree = builder.build(state_of([1]), [chain([5, 6, 7], [0.9, 0.8, 0.7], "a"),
                                         chain([5, 6, 8], [0.5, 0.4, 0.3], "b")])
    assert tree.tokens.tolist() == [5, 6, 7, 8]
    assert tree.parents.tolist() == [-1, 0, 1, 1]
    assert tree.sources == ("a", "a", "a", "b")
    assert_tree_valid(tree)
    assert tree.expected_tokens == pytest.approx(1 + 0.9 + 0.8 + 0.7 + 0.3)


def test_trie_builder_same_token_under_different_parents_is_not_merged():
    tree = TrieTreeBuilder(FLAT).build(state_of([1]), [chain([5, 6], [0.9, 0.8]), chain([6, 5], [0.7, 0.6])])
    assert tree.tokens.tolist() == [5, 6, 6, 5] and tree.parents.tolist() == [-1, 0, -1, 2]


def test_trie_builder_respects_max_nodes_and_keeps_the_best():
    generator = torch.Generator().manual_seed(0)
    proposals = []
    for k in range(6):
        scores = sorted(torch.rand(8, generator=generator).tolist(), reverse=True)
        proposals.append(chain(torch.randint(0, 4, (8,), generator=generator).tolist(), scores, f"p{k}"))
    merged_tokens, merged_parents, merged_scores, _ = merge_by_prefix(proposals)
    assert len(merged_tokens) > 10
    tree = TrieTreeBuilder(FLAT, max_nodes=10).build(state_of([1]), proposals)
    assert len(tree) == 10
    assert_tree_valid(tree)
    # The kept nodes are the 10 best-scored merged nodes.
    best = sorted(range(len(merged_scores)), key=lambda i: (-merged_scores[i], i))[:10]
    kept_paths = set()
    for i in range(len(tree)):
        path, node = [], i
        while node >= 0:
            path.append(int(tree.tokens[node]))
            node = int(tree.parents[node])
        kept_paths.add(tuple(reversed(path)))

    def merged_path(i):
        path = []
        while i >= 0:
            path.append(merged_tokens[i])
            i = merged_parents[i]
        return tuple(reversed(path))

    assert kept_paths == {merged_path(i) for i in best}


def test_trie_builder_flat_curve_keeps_everything_up_to_max_nodes():
    proposals = [chain(list(range(10, 30)), [0.01] * 20)]
    assert len(TrieTreeBuilder(FLAT, max_nodes=32).build(state_of([1]), proposals)) == 20
    assert len(TrieTreeBuilder(FLAT, max_nodes=7).build(state_of([1]), proposals)) == 7
    assert len(TrieTreeBuilder(FLAT, max_nodes=1).build(state_of([1]), proposals)) == 1


def test_trie_builder_drafts_nothing_when_trees_cost_10x():
    expensive = CostCurve((1, 2, 64), (1.0, 10.0, 10.0))  # any tree costs 10 plain steps
    builder = TrieTreeBuilder(expensive, max_nodes=8)
    proposals = [chain(list(range(10, 18)), [0.99] * 8), chain([50, 51], [0.99, 0.99])]
    tree = builder.build(state_of([1]), proposals)
    assert len(tree) == 0 and tree.mask.shape == (0, 0)
    assert tree.expected_tokens == 1.0


def test_trie_builder_sizes_by_expected_tokens_per_cost():
    curve = CostCurve((1, 2, 4, 8, 16, 32), (44.0, 72.0, 72.0, 72.0, 87.0, 150.0))
    for scores in ([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2], [0.3, 0.1, 0.05], [0.95] * 20,
                   [0.7, 0.6, 0.1, 0.05, 0.01]):
        tree = TrieTreeBuilder(curve, max_nodes=32).build(state_of([1]), [chain(list(range(len(scores))), scores)])
        scores = torch.tensor(scores).tolist()  # as the proposal stores them (float32)
        rates = [(1 + sum(scores[:size])) / curve(size + 1) for size in range(len(scores) + 1)]
        best = max(range(len(rates)), key=lambda size: (rates[size], -size))
        assert len(tree) == best, (scores, rates)


def test_trie_builder_counts_lookahead_rows_in_the_forwards_cost():
    """Rows a lookahead branch adds to the same forward shift every size along the curve: a node that
    does not pay for the jump from 1 to 2 queries pays once 9 rows are verified anyway."""
    curve = CostCurve((1, 2, 64), (10.0, 20.0, 26.2))  # +10 ms for the second query, +0.1 ms per query after
    proposals = [chain([7, 8], [0.5, 0.3])]
    assert len(TrieTreeBuilder(curve, max_nodes=8).build(state_of([1]), proposals)) == 0
    riding = DecodeState(tokens=[1], prompt_length=1, lookahead_rows=9)
    builder = TrieTreeBuilder(curve, max_nodes=8)
    assert builder.build(riding, proposals).tokens.tolist() == [7, 8]
    assert builder.best_cut([0.5, 0.3], extra_rows=9) == (2, 1.8, 1.8 / curve(12))


def test_trie_builder_no_proposals():
    assert len(TrieTreeBuilder(FLAT).build(state_of([1]), [])) == 0
    assert len(TrieTreeBuilder(FLAT).build(state_of([1]), [Proposal.empty("x")])) == 0


def test_trie_builder_child_never_outscores_parent_after_merge():
    # "b" scores its child above its parent; merged scores are clamped so every best-first prefix is a tree.
    proposals = [Proposal(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 0]), torch.tensor([0.2, 0.9, 0.1]), "b")]
    tree = TrieTreeBuilder(FLAT, max_nodes=1).build(state_of([1]), proposals)
    assert tree.tokens.tolist() == [1] and tree.parents.tolist() == [-1]
    tree = TrieTreeBuilder(FLAT, max_nodes=2).build(state_of([1]), proposals)
    assert tree.tokens.tolist() == [1, 2] and tree.parents.tolist() == [-1, 0]


# ---- GreedyVerifier ----------------------------------------------------------------------------

VOCAB = 10


def logits_with_argmax(best: list[int]) -> torch.Tensor:
    """[len(best), VOCAB] rows whose argmax are `best`."""
    logits = torch.randn(len(best), VOCAB, generator=torch.Generator().manual_seed(0)) * 0.1
    for row, token in enumerate(best):
        logits[row, token] = 5.0
    return logits


def verify(tokens, parents, best):
    tree = DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents)) if tokens else DraftTree.empty()
    return GreedyVerifier().accept(tree, logits_with_argmax(best), None)


def test_greedy_root_mismatch():
    result = verify([3, 4], [-1, 0], best=[7, 4, 1])
    assert result.accepted == [] and result.bonus == 7


def test_greedy_empty_tree():
    result = verify([], [], best=[6])
    assert result.accepted == [] and result.bonus == 6


def test_greedy_partial_path():
    result = verify([3, 4, 5], [-1, 0, 1], best=[3, 4, 9, 0])
    assert result.accepted == [0, 1] and result.bonus == 9


def test_greedy_full_path():
    result = verify([3, 4, 5], [-1, 0, 1], best=[3, 4, 5, 8])
    assert result.accepted == [0, 1, 2] and result.bonus == 8


def test_greedy_second_child_matches():
    # root -> {0: 3, 1: 6}; 1 -> {2: 2, 3: 4}; rows: root, 0, 1, 2, 3
    result = verify([3, 6, 2, 4], [-1, -1, 1, 1], best=[6, 3, 4, 1, 9])
    assert result.accepted == [1, 3] and result.bonus == 9


def test_greedy_follows_the_argmax_not_the_first_branch():
    # The first branch's child would match row 2's argmax, but the root's argmax picks the second branch.
    result = verify([3, 5, 1, 2], [-1, -1, 0, 1], best=[5, 1, 2, 7, 8])
    assert result.accepted == [1, 3] and result.bonus == 8
    assert GreedyVerifier.lossless and not GreedyVerifier.supports_sampling


# ---- StopCondition -----------------------------------------------------------------------------


def test_stop_max_tokens_across_steps():
    stop = StopCondition(max_new_tokens=5)
    assert stop.cut([1, 2]) == ([1, 2], False)
    assert stop.cut([3, 4, 5, 6]) == ([3, 4, 5], True)


def test_stop_max_tokens_exact_boundary():
    stop = StopCondition(max_new_tokens=3)
    assert stop.cut([1, 2, 3]) == ([1, 2, 3], True)


def test_stop_eos_kept_and_stops_mid_step():
    stop = StopCondition(max_new_tokens=100, eos_token_ids=frozenset({2, 9}))
    assert stop.cut([5, 6]) == ([5, 6], False)
    assert stop.cut([7, 9, 8, 2]) == ([7, 9], True)


def test_stop_string_across_tokens(tiny):
    tokenizer = tiny.tokenizer
    ids = tokenizer("Hello world, this is a test of stopping.", add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    # A stop string made of the end of one token and the start of the next.
    k = next(k for k in range(1, len(ids)) if len(pieces[k - 1]) >= 2 and len(pieces[k]) >= 2)
    stop_string = pieces[k - 1][-2:] + pieces[k][:2]
    stop = StopCondition(max_new_tokens=100, stop_strings=(stop_string,), tokenizer=tokenizer)
    # Fed in chunks that split right before the completing token.
    kept, finished = stop.cut(ids[:k])
    assert (kept, finished) == (ids[:k], False)
    kept, finished = stop.cut(ids[k:])
    assert kept == [ids[k]] and finished
    text = tokenizer.decode(ids[:k + 1])
    assert stop_string in text and stop_string not in tokenizer.decode(ids[:k])


def test_stop_string_inside_one_step(tiny):
    tokenizer = tiny.tokenizer
    ids = tokenizer("alpha beta gamma delta epsilon", add_special_tokens=False)["input_ids"]
    stop = StopCondition(max_new_tokens=100, stop_strings=("nothing", "gamma d"), tokenizer=tokenizer)
    kept, finished = stop.cut(ids)
    assert finished
    assert "gamma d" in tokenizer.decode(kept) and "gamma d" not in tokenizer.decode(kept[:-1])


@pytest.mark.parametrize("text,stop_string", [("x 語 y z w", "語"), ("日本語です, and more", "語で"),
                                              ("ok 🙂 fine then", "🙂"), ("a → b c d e", "→")])
def test_stop_string_split_over_byte_tokens(tiny, text, stop_string):
    """Byte-level BPE splits one character over several tokens (語 = 3 byte tokens): the stop
    check must look back far enough in tokens, not in characters."""
    tokenizer = tiny.tokenizer
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    first = next(m for m in range(1, len(ids) + 1) if stop_string in tokenizer.decode(ids[:m]))
    assert first < len(ids)
    stop = StopCondition(max_new_tokens=100, stop_strings=(stop_string,), tokenizer=tokenizer)
    kept, finished = [], False
    for token in ids:  # one token per step
        step, finished = stop.cut([token])
        kept += step
        if finished:
            break
    assert finished and kept == ids[:first]


def test_stop_string_needs_a_tokenizer():
    with pytest.raises(ValueError):
        StopCondition(max_new_tokens=5, stop_strings=("x",))


# ---- CostCurve ---------------------------------------------------------------------------------


def test_cost_curve_interpolates_and_extrapolates():
    curve = CostCurve((1, 2, 4), (10.0, 20.0, 24.0))
    assert curve(1) == 10.0 and curve(2) == 20.0 and curve(4) == 24.0
    assert curve(3) == pytest.approx(22.0)
    assert curve(0) == 10.0  # below the first point: the first value
    assert curve(8) == pytest.approx(24.0 + 2.0 * 4)  # beyond the last: the last segment's slope
    assert curve(1.5) == pytest.approx(15.0)


def test_cost_curve_flat_and_single_point():
    assert all(CostCurve.flat()(q) == 1.0 for q in (1, 2, 33, 1000))
    assert CostCurve((4,), (7.0,))(100) == 7.0


def test_cost_curve_validation():
    with pytest.raises(ValueError):
        CostCurve((1, 2), (1.0,))
    with pytest.raises(ValueError):
        CostCurve((), ())
    with pytest.raises(ValueError):
        CostCurve((2, 1), (1.0, 2.0))
    with pytest.raises(ValueError):
        CostCurve((1, 1), (1.0, 2.0))


def test_cost_curve_json_round_trip():
    curve = CostCurve((1, 2, 8), (3.0, 4.5, 9.0))
    data = curve.to_json()
    assert CostCurve(tuple(data["queries"]), tuple(data["milliseconds"])) == curve
    assert not math.isnan(curve(5))


def test_measured_cost_curve_shape(tiny):
    from specpipe.cost import measure_cost_curve
    from specpipe.target import TargetModel

    target = TargetModel(tiny.loaded.model, name="tiny")
    curve = measure_cost_curve(target, queries=(1, 2, 4), kv_length=32, rounds=2)
    assert curve.queries == (1, 2, 4) and all(ms > 0 for ms in curve.milliseconds)
