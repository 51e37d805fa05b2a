"""The prefix cache: a prompt whose beginning was prefilled before reuses those rows, and its prefill (the first
token's logits, every prompt row's hidden states and KV rows) is bitwise a fresh one's, so every pipeline's tokens
are the same whether a prefix was reused or not; memory stays within its budget; the engine that cannot make reuse
exact gets none; a long prompt is prefilled a chunk at a time between the batch's steps."""
from __future__ import annotations

import logging

import pytest
import torch

from conftest import random_prompts
from specpipe.errors import ConfigError
from specpipe.pipelines.builder import build_pipeline, compose_config, prefix_cache
from specpipe.prefix_cache import PrefixCache
from specpipe.serving import BatchScheduler, RequestHandle, SchedulerLimits
from specpipe.serving.scheduler import SchedulerObserver

BLOCK = 8


def prefill_rows(target, cache_of_prefixes: PrefixCache, prompt: list[int]):
    """A prefill through `cache_of_prefixes`: (its output, the tokens reused, every layer's KV rows)."""
    cache = target.new_cache()
    prefilled = cache_of_prefixes.prefill(target, prompt, cache)
    rows = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    return prefilled.output, prefilled.reused_tokens, rows


def common_prefix(tokens: list[int], other: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(tokens, other)) if a != b), min(len(tokens), len(other)))


def assert_same_prefill(got, expected) -> None:
    (out, _, rows), (want, _, want_rows) = got, expected
    assert torch.equal(out.logits, want.logits)
    assert torch.equal(out.hidden, want.hidden)
    assert (out.aux_hidden is None) == (want.aux_hidden is None)
    if out.aux_hidden is not None:
        assert torch.equal(out.aux_hidden, want.aux_hidden)
    assert len(rows) == len(want_rows)
    for (keys, values), (want_keys, want_values) in zip(rows, want_rows):
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """Prompts that begin alike for 0 to 50 tokens, on and off the block boundaries, and one prompt repeated."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randint(300, 1300, (60,), generator=generator).tolist()
    prompts = [base[:41]]
    for shared in (0, 1, BLOCK - 1, BLOCK, BLOCK + 3, 3 * BLOCK, 5 * BLOCK + 2):
        tail = torch.randint(300, 1300, (13,), generator=generator).tolist()
        prompts.append(base[:shared] + tail)
    prompts += [base[:41], base[:40], base[:49], base[:3 * BLOCK + 1]]
    return prompts


@pytest.mark.parametrize("overrides", [
    ["model.dtype=fp32", "engine.target_weights=dense"],
    ["model.dtype=bf16", "engine.target_weights=dense"],
    ["model.dtype=fp32", "engine.target_weights=int4"],
    ["model.dtype=bf16", "engine.target_weights=int8"],
], ids=["dense-fp32", "dense-bf16", "int4-fp32", "int8-bf16"])
def test_a_reused_prefix_prefills_bitwise_as_a_fresh_prompt(overrides):
    """Each prompt through a cache that holds the earlier prompts' blocks equals the same prompt through an empty
    cache: logits, hidden states, the captured layers' states (an EAGLE-3 head's) and every KV row."""
    pipe = build_pipeline(compose_config(["model=tiny_random", "pipeline=vanilla", *overrides]))
    target = pipe.target
    target.capture_layers((0, 1), "test")
    warm = PrefixCache(64 << 20, block_tokens=BLOCK, chunk_tokens=16)
    reused, expected, kept = [], [], []
    for prompt in shared_prefix_prompts(seed=1):
        got = prefill_rows(target, warm, prompt)
        assert_same_prefill(got, prefill_rows(target, PrefixCache(64 << 20, BLOCK, chunk_tokens=16), prompt))
        reused.append(got[1])
        # what an earlier prompt left: its whole blocks; reused as far as they go on as this one, short of its last
        expected.append(max((min(common_prefix(prompt, rows), len(prompt) - 1) for rows in kept), default=0))
        kept.append(prompt[:len(prompt) // BLOCK * BLOCK])
    assert reused == expected
    assert reused[4:7] == [BLOCK, BLOCK + 3, 3 * BLOCK] and reused[-4:] == [40, 39, 42, 3 * BLOCK]
    assert warm.queried_tokens == sum(len(prompt) for prompt in shared_prefix_prompts(seed=1))
    assert warm.reused_tokens == sum(reused)


def test_a_prefill_in_any_chunks_is_the_one_token_steps():
    """The row-invariant prefill gives the same logits and rows in chunks of 1 (one-token decoding steps), 5 and the
    whole prompt."""
    pipe = build_pipeline(compose_config(["model=tiny_random", "pipeline=vanilla", "model.dtype=bf16",
                                          "engine.target_weights=dense"]))
    target = pipe.target
    prompt = random_prompts(1, seed=7)[0][:37]
    runs = [prefill_rows(target, PrefixCache(64 << 20, BLOCK, chunk_tokens=chunk), prompt) for chunk in (1, 5, 256)]
    for run in runs[1:]:
        assert_same_prefill(run, runs[0])


def test_memory_stays_within_the_budget_and_longer_prefixes_go_first():
    pipe = build_pipeline(compose_config(["model=tiny_random", "pipeline=vanilla", "model.dtype=fp32"]))
    target = pipe.target
    generator = torch.Generator().manual_seed(3)
    base = torch.randint(300, 1300, (4 * BLOCK + 1,), generator=generator).tolist()
    probe = PrefixCache(64 << 20, BLOCK)
    probe.prefill(target, base, target.new_cache())
    per_block = probe.bytes // len(probe)
    assert len(probe) == 4
    cache = PrefixCache(6 * per_block, BLOCK)  # six blocks
    cache.prefill(target, base, target.new_cache())  # blocks a1..a4
    other = torch.randint(300, 1300, (3 * BLOCK + 1,), generator=generator).tolist()
    cache.prefill(target, other, target.new_cache())  # b1..b3: needs a4 evicted (the only leaf to go)
    assert len(cache) == 6 and cache.bytes <= cache.max_bytes
    again = cache.prefill(target, base, target.new_cache())
    assert again.reused_tokens == 3 * BLOCK  # a1..a3 kept, a4 went first
    assert cache.bytes <= cache.max_bytes
    fresh = prefill_rows(target, PrefixCache(64 << 20, BLOCK), base)
    assert_same_prefill(prefill_rows(target, cache, base), fresh)
    tiny = PrefixCache(per_block // 2, BLOCK)  # smaller than one block: keeps nothing, still prefills
    assert_same_prefill(prefill_rows(target, tiny, base), fresh)
    assert len(tiny) == 0 and tiny.bytes == 0


@pytest.mark.parametrize("pipeline", ["vanilla", "lookahead_trie", "eagle_mix", "draft_model"])
def test_every_pipeline_decodes_the_same_tokens_with_reused_prefixes(tiny_mixed, pipeline):
    """Prompts sharing beginnings, decoded twice through one pipeline with a prefix cache (the second time from
    reused rows), and through a pipeline whose cache is fresh for every prompt: the same greedy tokens, and
    vanilla's (with its own cache)."""
    pipe = tiny_mixed.pipeline(pipeline, "prefix_cache.memory_mb=64", "prefix_cache.block_tokens=8", fresh=True)
    vanilla = pipe.without_drafting()
    assert pipe.decoder.prefix_cache is not None
    assert vanilla.decoder.prefix_cache is not None and vanilla.decoder.prefix_cache is not pipe.decoder.prefix_cache
    prompts = shared_prefix_prompts(seed=5)[:6]
    first = [pipe.generate(prompt, max_new_tokens=20).token_ids for prompt in prompts]
    again = [pipe.generate(prompt, max_new_tokens=20).token_ids for prompt in prompts]
    assert pipe.decoder.prefix_cache.reused_tokens > 0
    assert again == first
    for prompt, tokens in zip(prompts, first):
        vanilla.decoder.prefix_cache = vanilla.decoder.prefix_cache.empty_copy()
        assert vanilla.generate(prompt, max_new_tokens=20).token_ids == tokens


@pytest.mark.parametrize("pipeline", ["vanilla", "eagle_mix", "lookahead_trie", "eagle3"])
def test_a_prompt_that_goes_on_from_an_answer_reuses_the_answers_rows(tiny_mixed, pipeline):
    """A finished request's answer rows are kept too (computed row-invariant in its verify forwards, like a
    prefill's): a next turn that repeats prompt and answer reuses both, and decodes what a fresh cache decodes."""
    pipe = tiny_mixed.pipeline(pipeline, "prefix_cache.memory_mb=64", "prefix_cache.block_tokens=8", fresh=True)
    cache = pipe.decoder.prefix_cache
    first_turn = random_prompts(3, seed=11)[1][:29]
    answer = pipe.generate(first_turn, max_new_tokens=30).token_ids
    second_turn = first_turn + answer + random_prompts(1, seed=12)[0][:9]
    rows_kept = len(first_turn) + len(answer) - 1  # the answer's last token has no row yet
    reused = prefill_rows(pipe.target, cache, second_turn)
    assert reused[1] == rows_kept // BLOCK * BLOCK > len(first_turn)
    assert_same_prefill(reused, prefill_rows(pipe.target, cache.empty_copy(), second_turn))
    again = pipe.generate(second_turn, max_new_tokens=20).token_ids
    pipe.decoder.prefix_cache = cache.empty_copy()
    assert pipe.generate(second_turn, max_new_tokens=20).token_ids == again


@pytest.mark.embedded
def test_embedded_model_reuses_its_chat_prefix_exactly(embedded):
    """The embedded model on its Q4_1 blocks: chat prompts share the template's system prompt; the second round
    reuses the blocks of the first and decodes the same tokens."""
    pipe = embedded.pipeline("eagle_mix", "prefix_cache.memory_mb=256", fresh=True)
    prompts = ["Write a haiku about the sea.", "What does the with statement do in Python?",
               "Translate 'good morning' into French and German."]
    first = [pipe.generate(prompt, max_new_tokens=32).token_ids for prompt in prompts]
    reused_first = pipe.decoder.prefix_cache.reused_tokens
    assert reused_first > 0  # the template's system prompt
    again = [pipe.generate(prompt, max_new_tokens=32).token_ids for prompt in prompts]
    assert again == first
    all_but_the_last = sum(len(pipe.request(prompt, 32).prompt_ids) - 1 for prompt in prompts)
    assert pipe.decoder.prefix_cache.reused_tokens - reused_first == all_but_the_last


@pytest.mark.embedded
def test_embedded_models_next_chat_turn_reuses_the_first_turns_answer(embedded):
    """A conversation's second turn (first question, the answer, a follow-up, through the chat template) reuses the
    rows of the first turn's answer as far as its tokens repeat them, and answers as it would with nothing reused."""
    pipe = embedded.pipeline("eagle_mix", "prefix_cache.memory_mb=256", fresh=True)
    question = [{"role": "user", "content": "Name three rivers in Europe."}]
    first = pipe.generate(question, max_new_tokens=40)
    follow_up = question + [{"role": "assistant", "content": first.text},
                            {"role": "user", "content": "Which of them is the longest?"}]
    before = pipe.decoder.prefix_cache.reused_tokens
    second = pipe.generate(follow_up, max_new_tokens=40)
    # the rows kept: the whole blocks of the first prompt and answer but its last token; reused as far as the
    # follow-up's tokens repeat them (the template re-encodes the answer's text, which may split a token it generated)
    kept = first.prompt_ids + first.token_ids[:-1]
    common = next((i for i, (a, b) in enumerate(zip(kept, second.prompt_ids)) if a != b), len(kept))
    reused = pipe.decoder.prefix_cache.reused_tokens - before
    assert reused == min(common, len(kept) // 16 * 16, len(second.prompt_ids) - 1) > len(first.prompt_ids)
    pipe.decoder.prefix_cache = pipe.decoder.prefix_cache.empty_copy()
    assert pipe.generate(follow_up, max_new_tokens=40).token_ids == second.token_ids


def test_memory_auto_serves_the_server_only_and_bad_settings_are_refused(tiny, caplog):
    target = tiny.pipeline("vanilla").target
    assert prefix_cache(compose_config(["model=tiny_random"]), target) is None  # task=generate
    served = prefix_cache(compose_config(["model=tiny_random", "task=serve"]), target)
    assert served is not None and served.max_bytes == 1024 << 20
    assert prefix_cache(compose_config(["model=tiny_random", "task=serve", "prefix_cache.memory_mb=0"]), target) is None
    for bad in ("prefix_cache.memory_mb=-1", "prefix_cache.memory_mb=lots", "prefix_cache.block_tokens=0",
                "+prefix_cache.blocks=4", "prefix_cache.chunk_tokens=true"):
        with pytest.raises(ConfigError, match="prefix_cache"):
            prefix_cache(compose_config(["model=tiny_random", "prefix_cache.memory_mb=8", bad]), target)
    hf = build_pipeline(compose_config(["model=tiny_random", "engine=hf", "pipeline=vanilla"]))
    with caplog.at_level(logging.WARNING, logger="specpipe.pipelines.builder"):
        assert prefix_cache(compose_config(["model=tiny_random", "engine=hf", "prefix_cache.memory_mb=8"]),
                            hf.target) is None
    assert "prefix_cache: off" in caplog.text


def test_a_long_prompt_is_prefilled_between_the_other_requests_steps(tiny_mixed):
    """With a prefix cache the engine prefills a chunk per iteration: a request already decoding keeps getting
    its steps while a long prompt is prefilled, and both answer as they would alone."""
    pipe = tiny_mixed.pipeline("lookahead_trie", "prefix_cache.memory_mb=64", "prefix_cache.chunk_tokens=8",
                               fresh=True)
    pushed: list[RequestHandle] = []

    class Recorder(SchedulerObserver):
        def on_step(self, handle: RequestHandle, output) -> None:
            pushed.append(handle)

    scheduler = BatchScheduler(pipe.decoder, SchedulerLimits(), observer=Recorder())
    generator = torch.Generator().manual_seed(60)
    short_prompt = torch.randint(300, 1300, (12,), generator=generator).tolist()
    long_prompt = torch.randint(300, 1300, (64,), generator=generator).tolist()
    decoding = scheduler.submit(pipe.request(short_prompt, 60))
    for _ in range(3):
        scheduler.drive(decoding)
    assert pushed.count(decoding) >= 2  # started, and decoding
    submitted_at = len(pushed)
    prefilled = scheduler.submit(pipe.request(long_prompt, 10))
    while not (decoding.done and prefilled.done):
        scheduler.drive(decoding if not decoding.done else prefilled)
    during = pushed[submitted_at:pushed.index(prefilled)]
    assert during.count(decoding) >= 64 // 8 - 1  # a step after each of its chunks but the last
    assert pipe.result(decoding).token_ids == tiny_mixed.greedy_hf(short_prompt, 60)
    assert pipe.result(prefilled).token_ids == tiny_mixed.greedy_hf(long_prompt, 10)
