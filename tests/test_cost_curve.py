"""The cost curve decoding sizes its trees by: the measured one, and its online correction."""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from specpipe import distributed
from specpipe.cost import (CostCurve, OnlineCostCurve, OtherProcessesLoad, cached_cost_curve, cost_curve_path,
                           measure_cost_curve)

# a CPU curve shaped like the embedded model's in fp32 (ms per forward of q query rows)
BASE = CostCurve((1, 2, 3, 4, 6, 8, 16, 64), (11.0, 11.5, 12.1, 12.8, 15.0, 18.0, 24.0, 62.0))


# token ids whose repeats give prompt lookup drafts to verify (steps of several rows)
REPEATING_PROMPT = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 901, 77, 310]


def moment(alpha: float, beta: float):
    """The costs of a machine whose one-row forward takes `alpha` ms and whose extra rows cost `beta`
    times what BASE says."""
    return lambda queries: alpha + beta * (BASE(queries) - BASE(1))


def test_an_online_curve_that_has_seen_nothing_is_the_measured_one():
    online = OnlineCostCurve(BASE)
    assert [online(q) for q in range(1, 70)] == pytest.approx([BASE(q) for q in range(1, 70)])


@pytest.mark.parametrize("alpha, beta", [(14.4, 0.55), (9.0, 1.4), (11.0, 1.0)])
def test_the_online_curve_learns_the_moments_costs_from_noisy_forwards(alpha, beta):
    """Decoding's tree sizes (mostly 1-5 rows, with 2% noise) teach it the whole curve within 3%."""
    truth, rng = moment(alpha, beta), random.Random(0)
    online = OnlineCostCurve(BASE)
    for _ in range(400):
        queries = rng.choice((1, 2, 2, 3, 4, 4, 4, 5))
        online.observe(queries, truth(queries) * rng.gauss(1.0, 0.02))
    for queries in (1, 2, 4, 6, 8, 16):
        assert online(queries) == pytest.approx(truth(queries), rel=0.03), queries
    # the old curve would misprice what 4 rows cost over one by more than the tolerance above
    assert abs(BASE(4) / BASE(1) - truth(4) / truth(1)) > 0.03 or beta == 1.0


def test_the_online_curve_follows_a_change_of_the_machine_within_its_memory():
    online = OnlineCostCurve(BASE, memory=64)
    slow, fast = moment(15.0, 0.6), moment(10.0, 1.2)
    for step in range(300):
        queries = 1 + step % 5
        online.observe(queries, slow(queries))
    assert online(4) == pytest.approx(slow(4), rel=0.02)
    for step in range(300):  # ~5 memories later the slow moment is forgotten
        queries = 1 + step % 5
        online.observe(queries, fast(queries))
    assert online(1) == pytest.approx(fast(1), rel=0.02) and online(4) == pytest.approx(fast(4), rel=0.02)


def test_one_tree_size_alone_scales_the_measured_curve_as_a_whole():
    """Vanilla steps (one row each) say nothing about extra rows: the measured shape is kept, scaled."""
    online = OnlineCostCurve(BASE)
    for _ in range(200):
        online.observe(1, 13.0)
    assert online(1) == pytest.approx(13.0, rel=0.01)
    for queries in (2, 4, 8, 16, 64):
        assert online(queries) == pytest.approx(BASE(queries) * 13.0 / 11.0, rel=0.01), queries


def test_steps_of_one_larger_size_do_not_make_extra_rows_look_free():
    """A static tree verifies about the same rows every step, which cannot tell the level from the cost of
    extra rows. Against an fp32 curve measured under OMP_WAIT_POLICY=PASSIVE (33% slow), 12-row steps once
    taught the curve that extra rows cost a fifth of what they do, and Medusa's trees grew to 11 nodes
    (run 38). Both curves as measured there (ms)."""
    queries = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64)
    passive = CostCurve(queries, (20.4, 21.4, 21.5, 22.6, 23.3, 24.5, 27.8, 30.5, 32.8, 48.8, 86.3))
    truth = CostCurve(queries, (15.4, 15.7, 16.1, 16.3, 17.0, 17.1, 19.2, 22.4, 24.9, 35.8, 60.1))
    online = OnlineCostCurve(passive)
    for _ in range(200):
        online.observe(12, truth(12))
    for size in range(1, 17):
        assert online(size) == pytest.approx(truth(size), rel=0.07), size


def test_a_stall_counts_at_most_clip_times_the_estimate():
    online = OnlineCostCurve(BASE, memory=256, clip=1.5)
    truth = moment(11.0, 1.0)
    for step in range(200):
        online.observe(1 + step % 4, truth(1 + step % 4))
    before = online(1)
    online.observe(1, 5000.0)  # the VM paused for five seconds
    assert before < online(1) < before * 1.01
    online.observe(1, 0.001)  # a clock that jumped back
    assert online(1) > before * 0.99


def test_the_online_curve_never_prices_a_larger_tree_below_a_smaller_one():
    online = OnlineCostCurve(BASE)
    for _ in range(300):  # forwards that cost less with more rows (a noisy, impossible machine)
        online.observe(1, 12.0)
        online.observe(8, 6.0)
    costs = [online(q) for q in range(1, 65)]
    assert all(later >= earlier for earlier, later in zip(costs, costs[1:]))
    assert costs[0] > 0


@pytest.mark.parametrize("settings", [dict(memory=0.5), dict(prior_weight=0.0), dict(clip=1.0)])
def test_online_curve_refuses_bad_settings(settings):
    with pytest.raises(ValueError, match="online cost curve"):
        OnlineCostCurve(BASE, **settings)


def test_a_measured_curve_never_falls_with_more_rows(tiny):
    """A dip between two sizes is noise; kept, it would pin every tree at the cheaper size."""
    target = tiny.pipeline("vanilla").decoder.target
    curve = measure_cost_curve(target, queries=(1, 2, 3, 4, 5, 6), kv_length=8, rounds=1)
    assert list(curve.milliseconds) == sorted(curve.milliseconds)


def test_cost_curve_online_teaches_the_tree_builders_curve_each_verify_forward(tiny):
    pipe = tiny.pipeline("prompt_lookup", cost_curve="online", fresh=True)
    online = pipe.decoder.observer.forward_costs
    assert isinstance(online, OnlineCostCurve) and pipe.decoder.tree_builder.cost_curve is online
    steps = list(pipe.steps(REPEATING_PROMPT, max_new_tokens=40))
    assert len(steps) > 3 and online.observations == len(steps) - 2  # every step but the prefill and the first
    assert online.alpha != online.base(1)  # the tiny model's forwards are not exactly the measured median


def test_cost_curve_online_also_corrects_each_drafters_own_curve(tiny_mixed, monkeypatch):
    """Under cost_curve=online each drafter's cached curve is wrapped to be corrected by its levels' times (the tree
    builder observes them: test_draft_model.py); `measured` keeps it fixed."""
    from specpipe.pipelines import builder

    curves = {}  # each runner's own curve: told apart by their times, whatever this machine measures

    def measured_for(runner):
        return curves.setdefault(id(runner), CostCurve((1, 64), (1.0 + len(curves), 2.0 + len(curves))))

    monkeypatch.setattr(builder, "cached_cost_curve", measured_for)
    online = tiny_mixed.pipeline("specinfer_mix", cost_curve="online", fresh=True)
    drafter = online.decoder.drafters[0]
    assert isinstance(drafter.cost_curve, OnlineCostCurve)
    # measured the way the drafter runs its levels (its cost runner), not through its model's runner
    assert drafter.cost_curve.base is curves[id(drafter.cost_runner)] and drafter.cost_curve.observations == 0
    assert id(getattr(drafter, "runner", None)) not in curves
    measured = tiny_mixed.pipeline("specinfer_mix", cost_curve="measured", fresh=True)
    assert measured.decoder.drafters[0].cost_curve is curves[id(measured.decoder.drafters[0].cost_runner)]


def _observed_steps(pipe) -> list[tuple[int, float]]:
    """Records what the decoder teaches its online curve: (query rows, ms) per step."""
    online = pipe.decoder.observer.forward_costs
    seen = []
    observe = online.observe

    def recording(queries: int, milliseconds: float) -> None:
        seen.append((queries, milliseconds))
        observe(queries, milliseconds)

    online.observe = recording
    return seen


def test_cost_curve_online_prices_the_whole_step_not_only_its_forward(tiny):
    """A tree pays for the whole step, its proposers, verify and commit too, not only its verify forward."""
    pipe = tiny.pipeline("prompt_lookup", cost_curve="online", fresh=True)
    seen = _observed_steps(pipe)
    proposer = pipe.decoder.proposers[0]
    propose = proposer.propose

    def slow_propose(state):
        time.sleep(0.02)
        return propose(state)

    proposer.propose = slow_propose
    # 64 tokens: where the tiny model's answer falls into a loop (as under AMX's sums) steps take 16 tokens each
    steps = list(pipe.steps(REPEATING_PROMPT, max_new_tokens=64))
    priced = steps[2:]  # every step but the prefill and the first
    assert len(seen) == len(priced) > 2
    for (queries, milliseconds), step in zip(seen, priced):
        assert queries == step.stats.tree_size + 1
        parts = 1000.0 * sum(step.stats.seconds.values())  # propose (>= 20 ms), tree, forward, verify, commit
        assert milliseconds >= parts >= 20.0 + 1000.0 * step.stats.seconds["forward"]


def test_cost_curve_online_leaves_out_the_draft_levels_the_builder_priced(tiny):
    """An EAGLE-2 builder prices its draft levels with the drafter's own curve: counted again in the
    step's price, they would be paid twice."""
    pipe = tiny.pipeline("eagle", cost_curve="online", fresh=True)
    seen = _observed_steps(pipe)
    builder = pipe.decoder.tree_builder
    build = builder.build

    def build_priced_at_a_second(*args, **kwargs):
        return dataclasses.replace(build(*args, **kwargs), drafting_ms=1000.0)  # as if the levels took a second

    builder.build = build_priced_at_a_second
    walls = []  # ms of each decoder step, timed around it: the step's own clock runs inside that
    decoder_step = pipe.decoder.step

    def timed_step(batch):
        started = time.perf_counter()
        try:
            return decoder_step(batch)
        finally:
            walls.append(1000.0 * (time.perf_counter() - started))

    pipe.decoder.step = timed_step
    steps = list(pipe.steps(REPEATING_PROMPT, max_new_tokens=12))
    assert len(seen) == len(steps) - 2 == len(walls) - 1 > 2
    for (_, milliseconds), step, wall in zip(seen, steps[2:], walls[1:]):
        # the step's parts run inside its clock, its clock inside `wall`: however long this machine took
        assert 1000.0 * sum(step.stats.seconds.values()) - 1000.0 - 1e-6 <= milliseconds <= wall - 1000.0


def test_cost_curve_online_keeps_the_measured_curve_under_tensor_parallel(tiny, monkeypatch):
    """Each rank would time its own forwards and size its trees apart from the others."""
    from specpipe import distributed
    from specpipe.pipelines import builder

    monkeypatch.setattr(builder, "cached_cost_curve", lambda target: BASE)  # rank 0's curve, as broadcast
    monkeypatch.setattr(distributed, "active", lambda: True)
    pipe = tiny.pipeline("prompt_lookup", cost_curve="online", fresh=True)
    assert pipe.decoder.observer.forward_costs is None and pipe.decoder.tree_builder.cost_curve is BASE


def test_requests_in_parallel_threads_update_the_shared_curve_one_at_a_time():
    """An update reads the decayed sums and the fit, then writes both: two at once would lose one."""
    shared = OnlineCostCurve(BASE)
    inside, overlaps = [], []
    update = shared._observe

    def slow_update(x: float, milliseconds: float) -> None:  # an update long enough for threads to meet in it
        overlaps.extend(inside)
        inside.append(threading.get_ident())
        time.sleep(0.002)
        update(x, milliseconds)
        inside.remove(threading.get_ident())

    shared._observe = slow_update

    def decode() -> None:
        for queries in (1, 2, 3, 4, 5):
            shared.observe(queries, BASE(queries) * 1.2)

    workers = [threading.Thread(target=decode) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not overlaps and shared.observations == 20
    assert shared(1) > BASE(1)  # the slower forwards were learned


def stat_lines(busy_ticks: dict[int, int]) -> str:
    """/proc/stat with these busy ticks per CPU, split over user, nice, system, irq, softirq and steal."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    for cpu, ticks in sorted(busy_ticks.items()):
        share = ticks // 6
        user = ticks - 5 * share
        lines.append(f"cpu{cpu} {user} {share} {share} 1000 7 {share} {share} {share} 0 0")
    return "\n".join(lines + ["intr 1 2 3", "ctxt 99"]) + "\n"


TICKS = os.sysconf("SC_CLK_TCK")  # /proc/stat's ticks a second


class Clocks:
    """The wall clock and this process's CPU time as OtherProcessesLoad reads them, moved by the test alone: the
    load it computes from the ticks in the stat file does not depend on how busy this machine is."""

    def __init__(self, monkeypatch) -> None:
        self.wall, self.own = 1000.0, 5.0  # seconds
        monkeypatch.setattr("specpipe.cost.time", SimpleNamespace(monotonic=lambda: self.wall))
        monkeypatch.setattr(os, "times", lambda: SimpleNamespace(user=self.own, system=0.0))

    def advance(self, wall: float, own: float = 0.0) -> None:
        self.wall += wall
        self.own += own


def test_the_load_counts_other_processes_busy_time_on_this_process_cpus_only(tmp_path, monkeypatch):
    clocks = Clocks(monkeypatch)
    stat = tmp_path / "stat"
    stat.write_text(stat_lines({0: 500, 1: 500, 5: 500}))
    with OtherProcessesLoad(stat, cpus={0, 1}) as load:
        clocks.advance(wall=0.4)
        stat.write_text(stat_lines({0: 560, 1: 540, 5: 5000}))  # +1 CPU-second on ours; cpu5 is not ours
    assert load.cpus == 2
    assert load.cores == pytest.approx(100 / TICKS / 0.4)  # one CPU-second over a block of 0.4 s
    assert load.competed(threads=2) and load.competed(threads=1)
    with monkeypatch.context() as tensor_parallel:  # the other ranks are the other processes there
        tensor_parallel.setattr(distributed, "active", lambda: True)
        assert not load.competed(threads=2)

    with OtherProcessesLoad(stat, cpus={0, 1}) as quiet:
        clocks.advance(wall=0.05)
        stat.write_text(stat_lines({0: 560, 1: 541, 5: 9000}))  # one tick on ours, everything else elsewhere
    assert quiet.cores == pytest.approx(1 / TICKS / 0.05) and not quiet.competed(threads=2)


def test_this_process_own_busy_time_is_not_the_others_load(tmp_path, monkeypatch):
    """The block itself keeps a CPU busy (a measurement does): that is not competition; others beside it are."""
    clocks = Clocks(monkeypatch)
    stat = tmp_path / "stat"
    stat.write_text(stat_lines({0: 0}))
    with OtherProcessesLoad(stat, cpus={0}) as load:
        clocks.advance(wall=0.3, own=0.3)  # busy here, in this process, the whole block
        stat.write_text(stat_lines({0: round(0.3 * TICKS)}))  # all the CPU's busy time was ours
    assert load.cores == pytest.approx(0.0, abs=1e-9) and not load.competed(threads=1)
    with OtherProcessesLoad(stat, cpus={0}) as shared:
        clocks.advance(wall=0.3, own=0.15)  # half the block ours, the other half another process's
        stat.write_text(stat_lines({0: round(0.6 * TICKS)}))
    assert shared.cores == pytest.approx(0.5) and shared.competed(threads=1)


def test_a_load_that_leaves_the_blocks_threads_their_cpus_is_no_competition(tmp_path, monkeypatch):
    clocks = Clocks(monkeypatch)
    stat = tmp_path / "stat"
    stat.write_text(stat_lines({cpu: 0 for cpu in range(8)}))
    with OtherProcessesLoad(stat, cpus=set(range(8))) as load:
        clocks.advance(wall=0.1)
        stat.write_text(stat_lines({cpu: 10 if cpu < 3 else 0 for cpu in range(8)}))  # 0.3 CPU-s: 3 CPUs busy
    assert load.cores == pytest.approx(30 / TICKS / 0.1)
    assert not load.competed(threads=4)  # 4 of 8 CPUs were left to others
    assert load.competed(threads=6)


def test_an_unreadable_stat_file_measures_no_load(tmp_path):
    with OtherProcessesLoad(tmp_path / "missing", cpus={0}) as load:
        pass
    assert load.cores is None and not load.competed(threads=1)
    (tmp_path / "odd").write_text("cpu0 1 2 three\n")
    with OtherProcessesLoad(tmp_path / "odd", cpus={0}) as odd:
        pass
    assert odd.cores is None and not odd.competed(threads=1)


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="the load is read from Linux's /proc/stat")
def test_a_busy_process_beside_the_block_is_seen():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started and spinning
        with OtherProcessesLoad() as load:
            time.sleep(1.0)
    finally:
        spinner.kill()
        spinner.wait()
    assert load.cores > 0.5, load.cores  # one spinning process keeps about one CPU busy
    assert load.competed(threads=load.cpus)


def test_a_curve_is_cached_per_openmp_wait_policy(tiny, tmp_path, monkeypatch):
    """Sleeping OpenMP threads make every forward slower: the test suite's PASSIVE curves once sized the
    trees of later runs without it (run 38)."""
    target = tiny.pipeline("vanilla").decoder.target
    paths = {}
    for policy in ("PASSIVE", "ACTIVE", "passive"):
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
        paths[policy] = cost_curve_path(target, kv_length=8, cache_dir=tmp_path)
    monkeypatch.delenv("OMP_WAIT_POLICY")
    paths["unset"] = cost_curve_path(target, kv_length=8, cache_dir=tmp_path)
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000000")
    paths["long spins"] = cost_curve_path(target, kv_length=8, cache_dir=tmp_path)
    assert paths["PASSIVE"] == paths["passive"]
    assert len({paths[key] for key in ("PASSIVE", "ACTIVE", "unset", "long spins")}) == 4


def test_a_benchmark_records_the_openmp_wait_policy(monkeypatch):
    from specpipe.tasks.bench_machine import machine_info, machine_line

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert "OMP_WAIT_POLICY" not in machine_line(machine_info())
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert machine_info()["omp_wait_policy"] == "PASSIVE"
    assert "OMP_WAIT_POLICY PASSIVE" in machine_line(machine_info())


@pytest.mark.parametrize("competed", [True, False])
def test_a_curve_measured_on_a_busy_machine_is_not_cached(tiny, tmp_path, monkeypatch, caplog, competed):
    target = tiny.pipeline("vanilla").target
    monkeypatch.setattr(OtherProcessesLoad, "competed", lambda self, threads=None: competed)
    with caplog.at_level(logging.WARNING):
        curve = cached_cost_curve(target, kv_length=8, cache_dir=tmp_path)
    assert isinstance(curve, CostCurve) and min(curve.milliseconds) > 0  # the run goes on with it
    assert cost_curve_path(target, kv_length=8, cache_dir=tmp_path).is_file() is not competed
    assert ("is not cached: other processes kept" in caplog.text) is competed


@pytest.mark.parametrize("runtime, policy, throttled", [(950000, "SCHED_FIFO", True), (-1, "SCHED_FIFO", False),
                                                         (950000, "SCHED_OTHER", False)])
def test_a_benchmark_records_real_time_throttling(tmp_path, monkeypatch, runtime, policy, throttled):
    """`chrt -f 1` with the kernel's real-time cap stalls a busy decode ~50 ms a second: the report says so."""
    import os

    from specpipe.tasks import bench_machine

    (tmp_path / "sched_rt_runtime_us").write_text(f"{runtime}\n")
    (tmp_path / "sched_rt_period_us").write_text("1000000\n")
    monkeypatch.setattr(os, "sched_getscheduler", lambda pid: getattr(os, policy))
    found = bench_machine.realtime_throttling(tmp_path)
    assert found == ("SCHED_FIFO, throttled to 950000 of every 1000000 us" if throttled else "")
    machine = {**bench_machine.machine_info(), "realtime_throttling": found or "none"}
    assert ("real-time SCHED_FIFO" in bench_machine.machine_line(machine)) == throttled
