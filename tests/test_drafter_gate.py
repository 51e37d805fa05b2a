"""The drafter gate: a step drafter beside other sources is grown only where its nodes pay for its time."""
import pytest
import torch

from specpipe.cost import CostCurve
from specpipe.stages.tree.drafter_gate import DrafterGate
from specpipe.stages.tree.eagle2 import Eagle2TreeBuilder
from specpipe.types import DecodeState, Proposal, SamplingConfig
from specpipe.stages.base import StepDrafter


def test_the_gate_grows_through_warmup_then_where_the_drafter_pays_and_explores_where_it_does_not():
    gate = DrafterGate(buckets=5, warmup=2, explore_every=3, decay=1.0)
    # a drafter whose nodes never add a token: grown for the warmup, then every 3rd skip only
    decisions = []
    for _ in range(8):
        grow = gate.should_grow("head", 4, other_rate=0.2)
        decisions.append(grow)
        if grow:
            gate.observe("head", 4, added_tokens=0, milliseconds=1.5)
    assert decisions == [True, True, False, False, True, False, False, True]
    # tokens added per ms against the other sources' tokens per ms: 0.5 tokens in 2 ms on average
    gate.observe("head", 0, added_tokens=1, milliseconds=2.0)
    gate.observe("head", 0, added_tokens=0, milliseconds=2.0)
    assert gate.estimate("head", 0) == (2.0, 0.5, 2.0)
    assert gate.should_grow("head", 0, other_rate=0.24)
    assert not gate.should_grow("head", 0, other_rate=0.26)
    # buckets and drafters keep their own statistics
    assert gate.should_grow("other head", 0, other_rate=10.0)
    assert [gate.bucket(score) for score in (0.0, 0.19, 0.2, 0.99, 1.0)] == [0, 0, 1, 4, 4]


def test_a_step_credits_the_drafter_only_with_accepted_tokens_no_other_source_drafted():
    gate = DrafterGate(decay=1.0)
    # node: token, parent, source; the trie drafted 5 -> 6, the head continued it with 7 and drafted 9
    tokens, parents = [5, 6, 7, 9], [-1, 0, 1, -1]
    sources = ["ngram", "ngram", "head", "head"]

    def credit(committed: list[int]) -> float:
        state = DecodeState(tokens=[0, 1], prompt_length=2)
        fresh = DrafterGate(decay=1.0)
        fresh.remember_step(state, tokens, parents, sources, {"head": (3, 1.5)})
        state.tokens.extend(committed)  # the accepted nodes' tokens, then the bonus token
        fresh.learn_last_step(state)
        weight, added, milliseconds = fresh.estimate("head", 3)
        assert weight == 1.0 and milliseconds == 1.5
        fresh.learn_last_step(state)  # a step is credited once
        assert fresh.estimate("head", 3)[0] == 1.0
        return added

    assert credit([5, 6, 7, 8]) == 1  # the trie's two nodes, then the head's
    assert credit([5, 6, 2]) == 0  # only the trie's nodes
    assert credit([9, 3]) == 1  # the head's own branch
    assert credit([4]) == 0  # nothing accepted
    # a drafter skipped in the step is not credited, whatever was accepted
    state = DecodeState(tokens=[0], prompt_length=1)
    gate.remember_step(state, tokens, parents, sources, {})
    state.tokens.extend([9, 3])
    gate.learn_last_step(state)
    assert gate.estimate("head", 3) == (0.0, 0.0, 0.0)


class CountingDrafter(StepDrafter):
    """A StepDrafter that drafts `token` after the root and counts the steps it was grown in."""

    def __init__(self, name: str, token: int, vocab: int = 16) -> None:
        self.name = name
        self.token = token
        self.vocab = vocab
        self.grown_steps: list[int] = []
        self.step_index = 0

    def start(self, state):
        self.grown_steps.append(self.step_index)
        return self._logprobs()

    def step(self, state, tokens, parents, frontier):
        return torch.stack([self._logprobs() for _ in frontier])  # [m, vocab]

    def _logprobs(self):
        probs = torch.full((self.vocab,), 1e-6)
        probs[self.token] = 1.0
        return (probs / probs.sum()).log()


def decode_steps(builder: Eagle2TreeBuilder, drafter: CountingDrafter, accepted: list[int], steps: int,
                 sampling: SamplingConfig = SamplingConfig()) -> list[set[str]]:
    """`steps` builds of a tree beside a one-node trie proposal of token 3, each step committing
    `accepted` then a bonus token; returns the sources in each step's tree."""
    state = DecodeState(tokens=[0], prompt_length=1, sampling=sampling)
    sources = []
    for index in range(steps):
        drafter.step_index = index
        trie = Proposal.chain([3], [0.9], "ngram")
        tree = builder.build(state, [trie], [drafter])
        sources.append(set(tree.sources))
        state.tokens.extend([*accepted, 15])
    return sources


def test_eagle2_skips_a_drafter_whose_nodes_add_nothing_beside_the_trie_and_keeps_one_that_adds(monkeypatch):
    # the drafters take no time on this clock: what they add decides, not how busy the machine is
    monkeypatch.setattr("specpipe.stages.tree.eagle2.time.perf_counter", Clock())

    def builder() -> Eagle2TreeBuilder:
        gate = DrafterGate(warmup=2, explore_every=4, decay=1.0)
        return Eagle2TreeBuilder(CostCurve.flat(), depth=1, top_k=1, children=1, min_score=0.0, gate=gate)

    useless = CountingDrafter("head", token=7)  # the trie's token 3 is accepted, never the head's 7
    sources = decode_steps(builder(), useless, accepted=[3], steps=11)
    assert useless.grown_steps == [0, 1, 5, 9]  # the warmup, then after every 3 skips
    assert sources[2] == {"ngram"} and sources[5] == {"ngram", "head"}
    useful = CountingDrafter("head", token=7)  # the head's 7 is accepted, the trie's 3 never
    decode_steps(builder(), useful, accepted=[7], steps=11)
    assert useful.grown_steps == list(range(11))
    # without other sources' proposals, and in sampled steps, the drafter is always grown
    alone = CountingDrafter("head", token=7)
    gated = builder()
    state = DecodeState(tokens=[0], prompt_length=1)
    for index in range(6):
        alone.step_index = index
        gated.build(state, [], [alone])
        state.tokens.extend([3, 15])
    assert alone.grown_steps == list(range(6))
    sampled = CountingDrafter("head", token=7)
    decode_steps(builder(), sampled, accepted=[3], steps=8,
                 sampling=SamplingConfig(temperature=1.0, seed=0))
    assert sampled.grown_steps == list(range(8))


def test_a_growth_after_skipped_steps_is_charged_the_usual_feed_not_its_catch_up():
    gate = DrafterGate(decay=1.0)
    assert gate.charge("head", sync_ms=9.0, levels_ms=0.5, caught_up=True) == 0.5  # no feed seen yet
    assert gate.charge("head", sync_ms=1.0, levels_ms=0.5, caught_up=False) == 1.5
    assert gate.charge("head", sync_ms=3.0, levels_ms=0.5, caught_up=False) == 3.5
    assert gate.charge("head", sync_ms=40.0, levels_ms=0.5, caught_up=True) == 2.5  # the mean feed, 2 ms
    assert gate.charge("other head", sync_ms=40.0, levels_ms=0.5, caught_up=True) == 0.5


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CatchingUpDrafter(CountingDrafter):
    """Feeding the committed rows takes 10 ms where the drafter was not grown in the step before (the prompt
    or the skipped steps' rows), 1 ms otherwise; each draft level 0.5 ms, on `clock`."""

    def __init__(self, clock: Clock, **kwargs) -> None:
        super().__init__(**kwargs)
        self.clock = clock

    def start(self, state):
        caught_up = not self.grown_steps or self.grown_steps[-1] != self.step_index - 1
        self.clock.now += (10.0 if caught_up else 1.0) / 1000.0
        return super().start(state)

    def step(self, state, tokens, parents, frontier):
        self.clock.now += 0.5 / 1000.0
        return super().step(state, tokens, parents, frontier)


def test_eagle2_charges_the_gate_a_drafters_usual_feed_where_it_catches_up(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("specpipe.stages.tree.eagle2.time.perf_counter", clock)
    gate = DrafterGate(warmup=2, explore_every=4, decay=1.0)
    builder = Eagle2TreeBuilder(CostCurve.flat(), depth=1, top_k=1, children=1, min_score=0.0, gate=gate)
    useless = CatchingUpDrafter(clock, name="head", token=7)
    decode_steps(builder, useless, accepted=[3], steps=10)
    assert useless.grown_steps == [0, 1, 5, 9]
    # charged: step 0 its level only (no usual feed yet), step 1 in full, steps 5 and 9 the level and
    # step 1's feed; the catch-ups' 10 ms would make it 8.25 ms
    weight, added, milliseconds = gate.estimate("head", gate.bucket(0.9))
    assert (weight, added) == (3.0, 0.0)  # step 9 is credited at the next step
    assert milliseconds == pytest.approx((0.5 + 1.5 + 1.5) / 3)


def test_gate_settings_are_checked():
    with pytest.raises(ValueError, match="buckets, warmup and explore_every must be >= 1"):
        DrafterGate(warmup=0)
    with pytest.raises(ValueError, match="decay in"):
        DrafterGate(decay=0.0)
