"""The speculation gate: a batch speculates unless plain steps of its size commit more tokens per ms."""
import pytest

from specpipe.pipelines.speculation_gate import SpeculationGate


def run(gate: SpeculationGate, batch: int, speculating_rate: float, plain_rate: float, steps: int) -> list[bool]:
    chosen = []
    for _ in range(steps):
        speculate = gate.speculate(batch)
        chosen.append(speculate)
        gate.observe(batch, speculate, 10, 10 / (speculating_rate if speculate else plain_rate))
    return chosen


def test_a_batch_stops_speculating_where_plain_steps_are_faster_and_explores_now_and_then():
    gate = SpeculationGate(explore_every=8, first_steps=2)
    chosen = run(gate, 4, speculating_rate=0.8, plain_rate=1.0, steps=200)
    assert chosen[:2] == [True, True] and chosen[2:4] == [False, False]  # a first measure of each kind
    later = chosen[20:]
    assert 0 < sum(later) <= len(later) / 8 + 1  # mostly plain, speculating now and then to look again
    assert gate.rates(4) == pytest.approx((0.8, 1.0), rel=1e-6)


def test_a_batch_keeps_speculating_where_it_pays_and_a_batch_of_one_always_does():
    gate = SpeculationGate()
    chosen = run(gate, 3, speculating_rate=1.5, plain_rate=1.0, steps=200)
    # 1.5x ahead: 3 plain steps (an exploration) every 64th step, and every 128th after two that changed nothing
    assert 0 < sum(not speculate for speculate in chosen[20:]) <= 3 * (180 // 64 + 1)
    assert all(run(gate, 1, speculating_rate=0.1, plain_rate=1.0, steps=50))  # the cost curve decides alone


def test_the_gate_follows_a_change_of_load_and_keeps_batch_sizes_apart():
    gate = SpeculationGate(explore_every=4, memory=8.0)
    run(gate, 8, speculating_rate=0.5, plain_rate=1.0, steps=100)
    assert not gate.speculate(8) or not gate.speculate(8)  # plain at 8 (a speculating step may be exploring)
    assert run(gate, 2, speculating_rate=2.0, plain_rate=1.0, steps=30)[-1]  # size 2 has its own measure
    chosen = run(gate, 8, speculating_rate=2.0, plain_rate=1.0, steps=200)  # the text became easy to draft
    assert all(chosen[-20:]) or sum(chosen[-40:]) >= 36


def test_the_gate_compares_kinds_measured_close_together_while_the_machine_speed_drifts():
    """A virtual machine's speed drifts by tens of percent within a minute. Speculating here always commits 1.15x
    plain's tokens per ms, but the machine runs at full speed for 60 steps, then at half speed for 60: the gate must
    keep speculating (a comparison of rates from different minutes would turn it off in every slow spell, where the
    plain steps are fresh and the speculating ones old)."""
    gate = SpeculationGate()
    chosen = []
    for step in range(1200):
        speed = 1.0 if (step // 60) % 2 == 0 else 0.5
        speculate = gate.speculate(4)
        chosen.append(speculate)
        gate.observe(4, speculate, 10, 10 / (speed * (1.15 if speculate else 1.0)))
    assert sum(chosen[100:]) >= 0.95 * len(chosen[100:])
    assert gate.ratio(4) == pytest.approx(1.15, rel=0.02)


def test_explorations_grow_rarer_while_they_change_nothing():
    """Plain steps are 2x faster at this size: each exploration (3 speculating steps after a catch-up) costs, so
    after the first three pairs (every 8th step: one pair says little) they come every 64th step, and two, four and
    eight times as seldom after two, four and six explorations in a row that agreed with the decision."""
    gate = SpeculationGate(explore_every=8)
    chosen = run(gate, 8, speculating_rate=0.5, plain_rate=1.0, steps=3000)
    starts = [step + 1 for step in range(1, len(chosen)) if chosen[step] and not chosen[step - 1]]  # the gate's steps
    assert starts == [8, 16, 128, 256, 512, 768, 1024, 1536, 2048, 2560]
    assert all(chosen[start - 1:start + 3] == [True] * 4 for start in starts)  # a catch-up, then 3 measured


def test_a_larger_batch_starts_plain_where_a_smaller_one_lost_by_speculating():
    """Speculation pays less as the batch grows: where 3-4 sequences found plain steps 2x faster, a first batch of 8
    starts plain (no first speculating measures, no try for 128 steps); where 3-4 found speculating faster, 8 measures
    for itself from its first step."""
    gate = SpeculationGate(explore_every=8)
    run(gate, 4, speculating_rate=0.5, plain_rate=1.0, steps=200)
    chosen = run(gate, 8, speculating_rate=0.5, plain_rate=1.0, steps=300)
    assert [step + 1 for step, speculate in enumerate(chosen) if speculate] == [128, 129, 130, 131, 256, 257, 258, 259]
    gate = SpeculationGate(explore_every=8)
    run(gate, 4, speculating_rate=1.5, plain_rate=1.0, steps=200)
    assert run(gate, 8, speculating_rate=0.5, plain_rate=1.0, steps=2) == [True, True]


@pytest.mark.parametrize("settings", [dict(explore_every=1), dict(first_steps=0), dict(memory=0.5), dict(margin=1.0),
                                      dict(window=0), dict(pair_memory=0.5)])
def test_bad_gate_settings_are_refused(settings):
    with pytest.raises(ValueError, match="speculation gate"):
        SpeculationGate(**settings)


def test_a_speculating_step_right_after_plain_ones_is_not_measured_and_exploration_takes_two():
    """The first speculating step after plain ones pays for its drafters' catch-up: measured, it would keep
    speculation off where it pays."""
    gate = SpeculationGate(explore_every=2, first_steps=1)
    catch_up = []

    def step() -> None:
        speculate = gate.speculate(4)
        after_plain = speculate and bool(catch_up) and not catch_up[-1]
        catch_up.append(speculate)
        # speculating pays (10 tokens in 5 ms), but a first step after plain ones takes 50 ms
        gate.observe(4, speculate, 10, 50.0 if after_plain else 5.0 if speculate else 8.0)

    for _ in range(40):
        step()
    assert gate.rates(4)[0] == pytest.approx(2.0)  # the 50 ms catch-ups were never measured
    assert sum(catch_up[10:]) > len(catch_up[10:]) / 2  # so it speculates


def test_neighbouring_batch_sizes_share_a_measure():
    """A batch under load moves between sizes as requests end and join: 5 to 8 are measured together."""
    assert [SpeculationGate.bucket(size) for size in (2, 3, 4, 5, 7, 8, 9, 16, 17)] == [2, 4, 4, 8, 8, 8, 16, 16, 32]
    gate = SpeculationGate(explore_every=8, first_steps=2)
    chosen = [gate.speculate(size) for size in (6, 7)]  # the bucket's first measures
    for size, speculate in zip((6, 7), chosen):
        gate.observe(size, speculate, 10, 20.0)
    assert gate.speculate(8) is False  # plain's first measure, wherever in the bucket it is taken


def test_a_catch_up_is_not_measured_when_the_batch_size_changed_since_the_plain_steps():
    """Plain steps at 4 requests, then 2 are left: the first speculating step at 2 feeds the drafters what the plain
    steps at 4 committed. It belongs to no batch size's measure."""
    gate = SpeculationGate(explore_every=8, first_steps=2)
    last = [True]

    def step(batch: int, speculating_ms: float) -> None:
        speculate = gate.speculate(batch)
        after_plain = speculate and not last[-1]
        last.append(speculate)
        gate.observe(batch, speculate, 10, 50.0 if after_plain else speculating_ms if speculate else 8.0)

    for _ in range(60):
        step(4, speculating_ms=20.0)  # plain wins at 4
    assert not last[-1]
    for _ in range(3):
        step(2, speculating_ms=5.0)
    assert gate.rates(2)[0] == pytest.approx(2.0)  # 10 tokens in 5 ms: the 50 ms catch-up was left out
