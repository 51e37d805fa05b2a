"""Many requests at once: every request's greedy tokens (fp32) equal its tokens decoded alone, whatever joins or
leaves the batch; seeded sampling does not depend on the batch; one request's failure or cancellation is its
own; the scheduler's limits hold; trees are priced against the whole batch's forward."""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from conftest import PIPELINES, random_prompts
from specpipe.cost import CostCurve
from specpipe.errors import InvalidRequest
from specpipe.serving import BatchScheduler, Cancelled, Overloaded, SchedulerLimits
from specpipe.stages.tree.trie import TrieTreeBuilder
from specpipe.target import VerifyRows
from specpipe.types import DecodeState, DraftTree, Proposal, StepBudget

LENGTHS = (1, 3, 9, 24, 40)


def decode_with_schedule(pipe, prompts: list, lengths: list[int], seed: int, leave: float = 0.0) -> dict:
    """Decodes `prompts` through the pipeline's decoder directly, with requests joining at random steps (0-3 at
    a time) and, with `leave` > 0, some dropped at random steps (their tokens so far are returned, marked
    left). Returns {index: (tokens, left)}."""
    rng = random.Random(seed)
    waiting = list(range(len(prompts)))
    running, tokens, left = [], {i: [] for i in waiting}, set()
    decoder = pipe.decoder
    batch_sizes = []
    while waiting or running:
        for _ in range(min(rng.randint(0 if running else 1, 3), len(waiting))):
            index = waiting.pop(0)
            request = pipe.request(prompts[index], lengths[index])
            sequence, first = decoder.start(request.prompt_ids, request.stop, request.sampling, request.document_ids)
            tokens[index] += first.tokens
            if not sequence.finished:
                running.append((index, sequence))
        if leave and running and rng.random() < leave:
            gone = running.pop(rng.randrange(len(running)))
            left.add(gone[0])
        if not running:
            continue
        batch_sizes.append(len(running))
        outputs = decoder.step([sequence for _, sequence in running])
        for (index, sequence), output in zip(running, outputs):
            assert not isinstance(output, BaseException), output
            tokens[index] += output.tokens
            assert output.stats.batch_size == len(running)
            assert output.stats.rows == output.stats.tree_size + 1 + sequence.state.lookahead_rows
        assert sum(output.stats.rows for output in outputs) == outputs[0].stats.batch_rows
        running = [(index, sequence) for index, sequence in running if not sequence.finished]
    assert max(batch_sizes, default=0) >= 2, "the schedule never batched two requests"
    return {index: (tokens[index], index in left) for index in tokens}


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_batched_greedy_equals_each_request_alone_tiny(tiny_mixed, pipeline):
    """Random joins and leaves over 14 prompts: each request's tokens are its solo greedy tokens (or a prefix of
    them, for a request that left)."""
    pipe = tiny_mixed.pipeline(pipeline)
    prompts = random_prompts(14, seed=41)
    lengths = [LENGTHS[i % len(LENGTHS)] for i in range(len(prompts))]
    for seed in (0, 1):
        results = decode_with_schedule(pipe, prompts, lengths, seed, leave=0.15 if seed else 0.0)
        for index, (tokens, left) in results.items():
            expected = tiny_mixed.greedy_hf(prompts[index], lengths[index])
            assert tokens == (expected[:len(tokens)] if left else expected), f"{pipeline}, prompt {index}"


@pytest.mark.parametrize("pipeline", ["lookahead_trie", "eagle_mix", "prompt_lookup"])
def test_batched_greedy_equals_each_request_alone_with_the_measured_curve(tiny_mixed, pipeline):
    """With the measured cost curve the batch budget shrinks and trims trees as the batch grows: still lossless."""
    pipe = tiny_mixed.pipeline(pipeline, cost_curve="online")
    prompts = random_prompts(10, seed=43)
    lengths = [(9, 40)[i % 2] for i in range(len(prompts))]
    for index, (tokens, _) in decode_with_schedule(pipe, prompts, lengths, seed=3).items():
        assert tokens == tiny_mixed.greedy_hf(prompts[index], lengths[index]), f"{pipeline}, prompt {index}"


@pytest.mark.embedded
@pytest.mark.parametrize("pipeline", ["vanilla", "lookahead_trie", "eagle_mix", "draft_model"])
def test_batched_greedy_equals_each_request_alone_embedded(embedded, pipeline):
    pipe = embedded.pipeline(pipeline, cost_curve="online")
    prompts = ["Write a haiku about the sea.", "List three prime numbers and explain why they are prime.",
               "What does the with statement do in Python?", "Translate 'good morning' into French and German.",
               "Summarize: the cat sat on the mat because the mat was warm and the sun was out.",
               "Count from one to ten in words."]
    lengths = [32, 48, 40, 24, 36, 44]
    alone = [pipe.generate(prompt, max_new_tokens=n).token_ids for prompt, n in zip(prompts, lengths)]
    results = decode_with_schedule(pipe, prompts, lengths, seed=5)
    for index, (tokens, _) in results.items():
        assert tokens == alone[index], f"{pipeline}, prompt {index}"


def test_submitted_from_threads_each_equals_its_solo_answer(tiny_mixed):
    """The scheduler thread batches requests submitted from several threads at random moments."""
    pipe = tiny_mixed.pipeline("lookahead_trie")
    prompts = random_prompts(12, seed=44)
    lengths = [LENGTHS[i % len(LENGTHS)] for i in range(len(prompts))]
    answers: dict[int, list[int]] = {}

    def client(indices: list[int]) -> None:
        for index in indices:
            time.sleep(random.Random(index).random() * 0.02)
            answers[index] = pipe.generate(prompts[index], max_new_tokens=lengths[index]).token_ids

    threads = [threading.Thread(target=client, args=(list(range(k, len(prompts), 4)),)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(answers) == len(prompts)
    for index, prompt in enumerate(prompts):
        assert answers[index] == tiny_mixed.greedy_hf(prompt, lengths[index]), f"prompt {index}"


def test_generate_many_and_async_forms_equal_generate(tiny_mixed):
    import asyncio

    pipe = tiny_mixed.pipeline("lookahead_trie")
    prompts = random_prompts(6, seed=45)
    expected = [tiny_mixed.greedy_hf(prompt, 20) for prompt in prompts]
    assert [out.token_ids for out in pipe.generate_many(prompts, max_new_tokens=20)] == expected

    async def both():
        generated = await asyncio.gather(*(pipe.agenerate(prompt, max_new_tokens=20) for prompt in prompts))
        streamed = ["".join([chunk async for chunk in pipe.astream(prompt, max_new_tokens=20)]) for prompt in prompts]
        return generated, streamed

    generated, streamed = asyncio.run(both())
    assert [out.token_ids for out in generated] == expected
    assert streamed == [out.text for out in generated]
    handle = pipe.submit(prompts[0], max_new_tokens=20)
    result = pipe.result(handle)
    assert result.token_ids == expected[0] and result.finish_reason in ("length", "eos")


@pytest.mark.parametrize("pipeline", ["lookahead_trie", "eagle_mix"])
def test_seeded_sampling_does_not_depend_on_the_batch(tiny_mixed, pipeline):
    """Each request has its own generator, and a sampled request's trees are sized as if it were alone (a tree
    of other shape would consume its generator otherwise): the same seed gives the same tokens in any batch. With
    `eagle_mix` the gates make the greedy requests' steps plain or of the proposers' trees alone every other step;
    the sampled requests in the same batch still speculate with every source."""
    if pipeline == "lookahead_trie":
        pipe = tiny_mixed.pipeline(pipeline, "verifier=rejection", cost_curve="measured")
    else:
        pipe = tiny_mixed.pipeline(pipeline, "verifier=rejection", fresh=True)
        pipe.decoder.gate, pipe.decoder.draft_gate = Alternating(), Alternating()
    prompts = random_prompts(6, seed=46)
    sampling = [{"temperature": 0.9, "seed": 100 + i} for i in range(len(prompts))]
    alone = [pipe.generate(prompt, max_new_tokens=30, sampling=s).token_ids for prompt, s in zip(prompts, sampling)]
    handles = [pipe.submit(prompt, max_new_tokens=30, sampling=s) for prompt, s in zip(prompts, sampling)]
    greedy_prompts = random_prompts(4, seed=47)
    greedy = [pipe.submit(prompt, max_new_tokens=30) for prompt in greedy_prompts]  # beside them
    assert [pipe.result(handle).token_ids for handle in handles] == alone
    for handle, prompt in zip(greedy, greedy_prompts):
        assert pipe.result(handle).token_ids == tiny_mixed.greedy_hf(prompt, 30)
    assert len(set(map(tuple, alone))) > 1


def test_one_request_failing_fails_alone(tiny_mixed):
    """A stage that raises for one request fails that request with its error; the others finish unchanged."""
    pipe = tiny_mixed.pipeline("lookahead_trie", fresh=True)
    proposer = pipe.decoder.proposers[0]
    propose = proposer.propose
    poison = 1234

    def failing_propose(state: DecodeState) -> Proposal:
        if state.tokens[0] == poison and len(state.generated) > 3:
            raise RuntimeError("this request's proposer broke")
        return propose(state)

    proposer.propose = failing_propose
    prompts = random_prompts(5, seed=48)
    bad = [poison] + prompts[0][1:]
    handles = [pipe.submit(prompt, max_new_tokens=30) for prompt in prompts[1:3]]
    broken = pipe.submit(bad, max_new_tokens=30)
    handles += [pipe.submit(prompt, max_new_tokens=30) for prompt in prompts[3:]]
    with pytest.raises(RuntimeError, match="proposer broke"):
        pipe.result(broken)
    for handle, prompt in zip(handles, prompts[1:]):
        assert pipe.result(handle).token_ids == tiny_mixed.greedy_hf(prompt, 30)


def test_cancelled_request_frees_its_place(tiny_mixed):
    pipe = tiny_mixed.pipeline("vanilla", fresh=True)
    pipe.limits = SchedulerLimits(max_sequences=1)
    prompt = random_prompts(1, seed=49)[0]
    long = pipe.submit(prompt, max_new_tokens=1500)
    steps = long.steps()
    next(steps)
    waiting = pipe.submit(prompt, max_new_tokens=5)  # waits for the one place
    long.cancel()
    with pytest.raises(Cancelled):
        list(steps)
    assert pipe.result(waiting, timeout=60).token_ids == tiny_mixed.greedy_hf(prompt, 5)
    assert pipe.scheduler.running == 0 and pipe.scheduler.queued == 0
    stream = pipe.stream(prompt, max_new_tokens=1500)  # a stream closed early cancels its request
    next(stream)
    stream.close()
    assert pipe.result(pipe.submit(prompt, max_new_tokens=5), timeout=60).token_ids == tiny_mixed.greedy_hf(prompt, 5)


def test_limits_queue_and_tokens_in_flight(tiny_mixed):
    pipe = tiny_mixed.pipeline("vanilla", fresh=True)
    started, release = threading.Event(), threading.Event()
    advance = pipe.decoder.advance

    def held_prefill(*args, **kwargs):
        started.set()
        release.wait(30)
        return advance(*args, **kwargs)

    pipe.decoder.advance = held_prefill
    scheduler = BatchScheduler(pipe.decoder, SchedulerLimits(max_sequences=1, max_queued=2, max_tokens_in_flight=300))
    stop = threading.Event()
    driver = threading.Thread(target=scheduler.run, args=(stop,))  # as the server drives it
    driver.start()
    prompt = random_prompts(1, seed=50)[0]
    first = scheduler.submit(pipe.request(prompt, 10))
    assert started.wait(30)  # admitted: its prefill holds the scheduler
    queued = [scheduler.submit(pipe.request(prompt, 10)) for _ in range(2)]
    with pytest.raises(Overloaded, match="queue is full"):
        scheduler.submit(pipe.request(prompt, 10))
    with pytest.raises(InvalidRequest, match="max_tokens_in_flight"):
        scheduler.submit(pipe.request(prompt, 300))
    release.set()
    expected = tiny_mixed.greedy_hf(prompt, 10)
    for handle in [first, *queued]:
        assert pipe.result(handle, timeout=60).token_ids == expected
    assert scheduler.shutdown(grace_seconds=5)
    with pytest.raises(Overloaded, match="shutting down"):
        scheduler.submit(pipe.request(prompt, 10))
    stop.set()
    driver.join(30)
    assert not driver.is_alive()


def test_tree_budget_shrinks_with_the_batch():
    """A node pays for its row against the whole step: beside 7 other requests' rows on a curve that turns
    steep past 8 rows, the same proposals get a smaller tree, and none where a row costs what a step does."""
    curve = CostCurve((1, 8, 16, 64), (10.0, 11.0, 20.0, 80.0))
    builder = TrieTreeBuilder(curve, max_nodes=16)
    proposals = [Proposal.chain(list(range(10, 18)), [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2], "a")]
    state = DecodeState(tokens=[1, 2, 3], prompt_length=2)
    alone = builder.build(state, proposals)
    state.budget = StepBudget(rows=7, tokens=7.0)
    beside_seven = builder.build(state, proposals)
    state.budget = StepBudget(rows=40, tokens=40.0)
    beside_forty = builder.build(state, proposals)
    assert len(alone) == 7  # 8 rows cost 11 ms: every node but the least likely pays
    assert 0 < len(beside_seven) < len(alone)
    assert len(beside_forty) == 0  # 1.2 ms a row against 41 tokens per ~60 ms: no node pays


def test_batch_trim_keeps_the_best_nodes_of_all_trees(tiny_mixed):
    """Across the batch the most likely nodes are kept, each with its path, by the whole step's rate."""
    pipe = tiny_mixed.pipeline("lookahead_trie", fresh=True)
    decoder = pipe.decoder
    decoder.tree_builder.cost_curve = CostCurve((1, 4, 64), (10.0, 10.0, 70.0))  # 4 rows free, then 1 ms a row
    from specpipe.pipelines.decoder import _Plan

    def planned(scores: list[float], parents: list[int]) -> _Plan:
        request = pipe.request(random_prompts(1, seed=51)[0], 10)
        sequence, _ = decoder.start(request.prompt_ids, request.stop, request.sampling)
        plan = _Plan(sequence)
        plan.tree = DraftTree.from_parents(torch.arange(len(scores)) + 500, torch.tensor(parents),
                                           scores=torch.tensor(scores))
        return plan

    plans = {0: planned([0.9, 0.8, 0.05], [-1, 0, 1]), 1: planned([0.6, 0.5, 0.01, 0.01], [-1, 0, -1, 2])}
    decoder._trim(plans)
    assert plans[0].tree.scores.tolist() == pytest.approx([0.9, 0.8])
    assert plans[1].tree.scores.tolist() == pytest.approx([0.6, 0.5])
    assert plans[1].tree.parents.tolist() == [-1, 0]


def test_ragged_forward_equals_each_sequence_alone(tiny_mixed):
    """One forward over several sequences' trees gives each the logits and cache its own forward gives."""
    target = tiny_mixed.pipeline("vanilla").target
    generator = torch.Generator().manual_seed(7)
    items, alone = [], []
    for length, nodes in ((30, 5), (17, 0), (50, 9), (8, 1)):
        prompt = torch.randint(100, 1000, (length,), generator=generator).tolist()
        parents = [-1] + [int(torch.randint(-1, i, (1,), generator=generator)) for i in range(nodes - 1)] \
            if nodes else []
        tree = DraftTree.from_parents(torch.randint(100, 1000, (nodes,), generator=generator),
                                      torch.tensor(parents, dtype=torch.long))
        caches = [target.new_cache(), target.new_cache()]
        for cache in caches:
            target.prefill(prompt[:-1], cache)
        items.append(VerifyRows(prompt[-1], tree, caches[0]))
        alone.append((target.forward_tree(prompt[-1], tree, caches[1]), caches[1]))
    batched = target.forward_trees(items)
    for item, out, (expected, cache) in zip(items, batched, alone):
        assert torch.allclose(out.logits, expected.logits, atol=1e-4, rtol=1e-4)
        assert torch.allclose(out.hidden, expected.hidden, atol=1e-4, rtol=1e-4)
        assert item.cache.get_seq_length() == cache.get_seq_length()
        for mine, theirs in zip(item.cache.layers, cache.layers):
            assert torch.allclose(mine.keys, theirs.keys, atol=1e-5) and torch.allclose(mine.values, theirs.values,
                                                                                       atol=1e-5)


def test_the_engine_runs_in_the_reading_thread_or_in_the_one_that_runs_it(tiny_mixed):
    """Every stage call of the engine happens in one thread at a time: the main thread that reads its own request;
    the thread that runs the engine (`run`) while others only submit and read; a background thread for asyncio
    readers that nobody else drives."""
    import asyncio

    pipe = tiny_mixed.pipeline("lookahead_trie", fresh=True)
    proposer = pipe.decoder.proposers[0]
    propose, seen = proposer.propose, []

    def recording_propose(state):
        seen.append(threading.current_thread())
        return propose(state)

    proposer.propose = recording_propose
    prompts = random_prompts(4, seed=52)
    pipe.generate(prompts[0], max_new_tokens=20)
    assert seen and set(seen) == {threading.main_thread()}

    seen.clear()
    stop, answers = threading.Event(), {}

    def reader(index: int) -> None:
        answers[index] = pipe.generate(prompts[index], max_new_tokens=20).token_ids

    readers = [threading.Thread(target=reader, args=(i,)) for i in range(len(prompts))]
    pipe.scheduler.hold()  # before the readers start, or the first of them takes the engine
    for thread in readers:
        thread.start()

    def stop_when_read() -> None:
        for thread in readers:
            thread.join()
        stop.set()

    threading.Thread(target=stop_when_read).start()
    pipe.scheduler.run(stop)
    assert set(seen) == {threading.main_thread()}  # the readers never ran the engine
    assert [answers[i] for i in range(len(prompts))] == [tiny_mixed.greedy_hf(p, 20) for p in prompts]

    seen.clear()
    asyncio.run(pipe.agenerate(prompts[1], max_new_tokens=20))
    assert len(set(seen)) == 1 and seen[0] is not threading.main_thread()


@pytest.mark.parametrize("pipeline", ["eagle", "draft_model"])
def test_batched_drafters_draft_in_one_forward_what_each_drafts_alone(tiny_mixed, pipeline):
    """A draft level for several requests is one forward of the drafter, and gives each request the log-probs its
    own forward gives it."""
    together, alone = (tiny_mixed.pipeline(pipeline, fresh=True) for _ in range(2))
    prompts = random_prompts(3, seed=53)

    def started(pipe) -> list[DecodeState]:
        states = []
        for prompt in prompts:
            request = pipe.request(prompt, 20)
            sequence, _ = pipe.decoder.start(request.prompt_ids, request.stop, request.sampling)
            states.append(sequence.state)
        return states

    drafter, solo = together.decoder.drafters[0], alone.decoder.drafters[0]
    forwards = []
    if pipeline == "eagle":
        rows = drafter.net.rows
        drafter.net.rows = lambda *args, **kwargs: forwards.append(1) or rows(*args, **kwargs)
    else:
        forward_rows = drafter.runner.forward_rows
        drafter.runner.forward_rows = lambda *args, **kwargs: forwards.append(1) or forward_rows(*args, **kwargs)
    mine, theirs = started(together), started(alone)
    roots = drafter.start_many(mine)
    assert len(forwards) == 1
    for root, state in zip(roots, theirs):
        assert torch.allclose(root, solo.start(state), atol=1e-5)
    # a level of two children under each root, then one of a child's children: each one forward for all requests
    trees = []
    for root in roots:
        top = root.topk(2).indices.tolist()
        trees.append(([int(t) for t in top], [-1, -1]))
    calls = [(state, tokens, parents, [-1]) for state, (tokens, parents) in zip(mine, trees)]
    assert all(torch.equal(level, root[None]) for level, root in zip(drafter.step_many(calls), roots))
    assert len(forwards) == 1  # the root's log-probs came with start
    calls = [(state, tokens, parents, [0, 1]) for state, (tokens, parents) in zip(mine, trees)]
    levels = drafter.step_many(calls)
    assert len(forwards) == 2
    for level, state, (tokens, parents) in zip(levels, theirs, trees):
        solo.step(state, tokens, parents, [-1])
        assert torch.allclose(level, solo.step(state, tokens, parents, [0, 1]), atol=1e-5)
    deeper = [(tokens + [int(level[0].topk(1).indices)], parents + [0]) for level, (tokens, parents) in zip(levels, trees)]
    calls = [(state, tokens, parents, [2]) for state, (tokens, parents) in zip(mine, deeper)]
    last = drafter.step_many(calls)
    assert len(forwards) == 3
    for level, state, (tokens, parents) in zip(last, theirs, deeper):
        assert torch.allclose(level, solo.step(state, tokens, parents, [2]), atol=1e-5)


class Alternating:
    """A SpeculationGate stand-in: batches speculate every other step."""

    def __init__(self) -> None:
        self.steps = 0

    def speculate(self, batch_size: int) -> bool:
        self.steps += 1
        return self.steps % 2 == 0

    def observe(self, *args) -> None:
        pass


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_plain_steps_between_speculating_ones_keep_every_stage_in_step(tiny_mixed, pipeline):
    """Where a batch takes a plain step, nothing is proposed or drafted, yet every stage learns what was
    committed (an n-gram index indexes each token once, a Jacobi window does not shift twice): still lossless,
    and the stages' own record of the text is the text."""
    pipe = tiny_mixed.pipeline(pipeline, fresh=True)
    pipe.decoder.gate = Alternating()
    prompts = random_prompts(6, seed=54)
    lengths = [LENGTHS[i % len(LENGTHS)] for i in range(len(prompts))]
    results = decode_with_schedule(pipe, prompts, lengths, seed=6)
    for index, (tokens, _) in results.items():
        assert tokens == tiny_mixed.greedy_hf(prompts[index], lengths[index]), f"{pipeline}, prompt {index}"
    sequence, _ = pipe.decoder.start(prompts[0], pipe.request(prompts[0], 30).stop)
    other, _ = pipe.decoder.start(prompts[1], pipe.request(prompts[1], 30).stop)
    while not sequence.finished and not other.finished:
        pipe.decoder.step([sequence, other])
    for stage in pipe.decoder.proposers:
        index = getattr(sequence.state.stage_state.get(stage), "index", None)
        if index is not None and getattr(stage, "text", "context") == "context":
            assert index.tokens == sequence.state.tokens


@pytest.mark.parametrize("pipeline", [name for name in PIPELINES if name in ("eagle_mix", "specinfer_mix")])
def test_steps_of_the_proposers_trees_alone_grow_no_drafter_and_stay_lossless(tiny_mixed, pipeline):
    """Where the draft gate says that growing the drafters does not pay at a batch size, a speculating step builds the
    proposers' trees alone: no drafter level runs in it (the drafters catch up at the next step that grows them),
    every request's tokens are still its solo greedy tokens, and a pipeline with both kinds of sources gets a draft
    gate from the builder."""
    assert tiny_mixed.pipeline(pipeline, cost_curve="online", fresh=True).decoder.draft_gate is not None
    assert tiny_mixed.pipeline("lookahead_trie", cost_curve="online", fresh=True).decoder.draft_gate is None
    pipe = tiny_mixed.pipeline(pipeline, fresh=True)
    assert pipe.decoder.proposers and pipe.decoder.drafters
    pipe.decoder.draft_gate = Alternating()
    drafter = pipe.decoder.drafters[0]
    grown = []
    start_many = drafter.start_many
    drafter.start_many = lambda states: grown.append(pipe.decoder.draft_gate.steps) or start_many(states)
    prompts = random_prompts(6, seed=55)
    lengths = [LENGTHS[i % len(LENGTHS)] for i in range(len(prompts))]
    results = decode_with_schedule(pipe, prompts, lengths, seed=7)
    for index, (tokens, _) in results.items():
        assert tokens == tiny_mixed.greedy_hf(prompts[index], lengths[index]), f"{pipeline}, prompt {index}"
    assert grown and all(step % 2 == 0 for step in grown)  # only in the steps the gate let draft
