"""The drafter gate (tree=eagle2 beside other sources): what it credits a drafter with, when it skips
one, and that it keeps drafting a bucket every so often. Lossless runs of the gated pipelines
(eagle_mix, specinfer_mix under a measured cost curve) are in test_lossless.py; the EAGLE head's cache
across skipped steps is in test_eagle.py."""
from __future__ import annotations

import time

import pytest
import torch

from specpipe.cost import CostCurve
from specpipe.stages.tree.drafter_gate import DrafterGate
from specpipe.stages.tree.eagle2 import Eagle2TreeBuilder
from specpipe.types import DecodeState, DraftTree, Proposal


def tree(tokens, parents, sources):
    return DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents), sources=tuple(sources))


def cost_with(nodes, ms):
    return 10.0 + 0.5 * nodes + ms


def test_credits_only_the_accepted_nodes_the_drafter_alone_proposed():
    """Root children: 5 (ngram), 6 (eagle); 5's children 7 (ngram), 8 (eagle); 6's child 9 (eagle).
    Committed 5, 8, then a token no node has: 5 is the n-gram's, 8 the drafter's, nothing else counts."""
    gate = DrafterGate(prior_tokens=0.0, prior_weight=1.0, memory=1e9)
    state = DecodeState(tokens=[1, 2, 3], prompt_length=2)
    drafted = tree([5, 6, 7, 8, 9], [-1, -1, 0, 0, 1], ["ngram", "eagle", "ngram", "eagle", "eagle"])
    gate.remember(state, drafted, {"eagle": (3, 0.7)})
    state.tokens += [5, 8, 4]
    gate.learn(state)
    estimate = gate._estimates[("eagle", 3)]
    assert estimate.gained / estimate.weight == pytest.approx(0.5)  # 1 token over the prior's weight 1 + 1 step
    assert estimate.nodes / estimate.weight == pytest.approx(3)  # its three nodes in the tree
    assert estimate.ms / estimate.weight == pytest.approx(0.7)
    assert state.stage_state.get(gate) is None  # learned once


def test_skips_a_drafter_that_brings_nothing_but_drafts_every_so_often():
    gate = DrafterGate(prior_tokens=1.0, prior_weight=1.0, memory=1e9, explore_every=4)
    rate, expected = 2.0 / 10.0, 2.0  # the other sources alone: 2 tokens per 10 ms
    assert gate.should_draft("eagle", 9, rate, expected, cost_with)  # the prior drafts a new bucket
    for _ in range(20):
        gate.observe("eagle", 9, gained=0, nodes=2, ms=1.0)
    decisions = [gate.should_draft("eagle", 9, rate, expected, cost_with) for _ in range(12)]
    assert decisions == [False, False, False, True] * 3
    assert gate.should_draft("eagle", 0, rate, expected, cost_with)  # another bucket keeps its own estimate


def test_drafts_where_the_drafter_pays_for_its_time():
    gate = DrafterGate(prior_tokens=0.0, prior_weight=1.0, memory=1e9)
    for _ in range(20):
        gate.observe("eagle", 2, gained=1, nodes=2, ms=1.0)  # +1 token for 2 ms: 3 / 12 > 2 / 10
    assert all(gate.should_draft("eagle", 2, 0.2, 2.0, cost_with) for _ in range(10))
    for _ in range(200):
        gate.observe("eagle", 2, gained=0, nodes=2, ms=1.0)  # the text changed: it stops paying
    assert not gate.should_draft("eagle", 2, 0.2, 2.0, cost_with)


@pytest.mark.parametrize("settings", [dict(buckets=0), dict(prior_weight=0.0), dict(memory=0.5),
                                      dict(explore_every=0)])
def test_bad_settings_are_refused(settings):
    with pytest.raises(ValueError, match="drafter gate"):
        DrafterGate(**settings)


class CountingDrafter:
    """A StepDrafter whose every draft is token 11 with probability 0.5, priced 2 ms a level; counts its starts.
    The gate weighs a drafter's wall time: its start takes 2 ms."""

    name = "counting"
    draft_vocab = None

    def __init__(self) -> None:
        self.cost_curve = CostCurve((1, 64), (2.0, 2.0))
        self.starts = 0

    @staticmethod
    def logprobs():
        return torch.full((16,), -10.0).index_fill_(0, torch.tensor([11]), float(torch.tensor(0.5).log()))

    def start(self, state):
        self.starts += 1
        time.sleep(0.002)
        return self.logprobs()

    def step(self, state, tokens, parents, frontier):
        return torch.stack([self.logprobs() for _ in frontier])


def test_the_builder_skips_the_drafter_where_the_other_source_is_sure():
    """Beside a proposal scored 0.99 the gate learns that the drafter adds nothing (it only ever credits
    the first source of a node, here the proposal) and skips it, but for its exploring steps."""
    builder = Eagle2TreeBuilder(CostCurve((1, 64), (10.0, 42.0)), depth=1, top_k=1, children=1, min_score=0.0)
    builder.gate = DrafterGate(prior_weight=1.0)  # the default prior (4 steps' worth) takes ~30 steps to unlearn
    drafter = CountingDrafter()
    state = DecodeState(tokens=[1, 2, 3], prompt_length=2)
    sure = Proposal.chain([11, 12], [0.99, 0.98], "ngram")
    for _ in range(40):
        built = builder.build(state, [sure], [drafter])
        assert built.tokens.tolist()[:2] == [11, 12]
        state.tokens += [11, 12, 13]  # the proposal was right twice, then the bonus token
    # a few steps to learn that its expected tokens (1 / (1 + steps)) do not pay for 2 ms, then one in 8
    assert drafter.starts <= 8 + 40 // builder.gate.explore_every
    without_other = drafter.starts
    builder.build(state, [], [drafter])  # alone, the drafter is never gated
    assert drafter.starts == without_other + 1
