"""The self-distilled chat corpus: batched answers equal one-at-a-time greedy decoding, shards
resume where a run stopped, the merged file has the shipped schema, and the prompt source shares
nothing with the dev prompt sets."""
from __future__ import annotations

import hashlib
import json
import platform
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from specpipe.distill.corpus import (BatchedGreedy, CorpusError, ShardFolder, chat_prompt_ids, distill,
                                     merge_shards, read_corpus, read_corpus_metadata)
from specpipe.distill.builders import product_of
from specpipe.distill.dev_overlap import dev_prompt_files, find_overlaps, load_dev_turns
from specpipe.distill.problems import fill_slots, situated_request
from specpipe.distill.prompts import (BUILDERS, DEFAULT_SEED, SOURCE_COUNTS, ChatPrompt, build_prompt_source,
                                      follow_up_prompts, prompt_id)
from specpipe.distill.requests import CONSTRAINTS, SITUATED_REQUESTS
from specpipe.distill.subjects import DATA_DIR, PromptData, load_prompt_data
from specpipe.paths import PACKAGE_ROOT
from specpipe.pipelines.builder import build_pipeline, compose_config, load_model
from specpipe.stores.manifest import sha256_file

REPO = Path(__file__).resolve().parents[1]
MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def make_prompt(text: str, category: str = "writing") -> ChatPrompt:
    return ChatPrompt(prompt_id(text), category, "test", text)


# Prompt lengths differ a lot, so batches of two are left-padded by many positions.
PROMPTS = [make_prompt(text) for text in [
    "Hi.",
    "Write a short poem about a lighthouse on a rocky island during a long winter night.",
    "What is 2 + 2?",
    "Explain, in a few sentences, why bread goes stale faster in the fridge than on the counter, "
    "and what a baker would recommend instead.",
    "Name a colour.",
    "List three rivers in Europe.",
]]


@pytest.fixture(scope="module")
def source():
    return build_prompt_source()


@pytest.fixture()
def greedy(tiny_mixed) -> BatchedGreedy:
    """The context-dependent tiny model (stock attention instance): its output changes with the
    prompt, so a padding mistake would show."""
    return BatchedGreedy(tiny_mixed.reference, tiny_mixed.tokenizer, max_new_tokens=6, batch_size=2)


def unbatched_greedy(model, tokenizer, prompt: ChatPrompt, max_new_tokens: int, eos: list[int]) -> list[int]:
    """HF greedy `generate` on the prompt alone: no padding, no batch."""
    ids = torch.tensor([chat_prompt_ids(tokenizer, prompt.text)])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, temperature=None, top_p=None,
                             top_k=None)
    return out[0, ids.shape[1]:].tolist()


def test_batched_shards_equal_unbatched_greedy(tiny_mixed, greedy, tmp_path):
    """fp32, left padding, batch 2: every shard row is exactly what the prompt alone decodes to.
    (Exact here: the tiny model has no near-ties the wider batch products could flip. The corpus
    does not need bit-equality; the 135M model in a batch of 32 can flip a rare near-tie.)"""
    shards = ShardFolder(tmp_path / "shards")
    stats = distill(greedy, PROMPTS, shards, batch_size=2, progress=False)
    assert stats.new_prompts == len(PROMPTS) and len(shards.shard_paths()) == 3
    rows = shards.read().to_pylist()
    assert sorted(row["prompt_id"] for row in rows) == sorted(p.prompt_id for p in PROMPTS)
    by_id = {p.prompt_id: p for p in PROMPTS}
    outputs = set()
    for row in rows:
        expected = unbatched_greedy(tiny_mixed.reference, tiny_mixed.tokenizer, by_id[row["prompt_id"]], 6,
                                    greedy.eos_token_ids)
        assert row["answer_ids"] == expected, row["prompt"]
        assert row["prompt"] == by_id[row["prompt_id"]].text
        assert row["answer"] == tiny_mixed.tokenizer.decode(expected, skip_special_tokens=True)
        assert row["finished"] == any(t in greedy.eos_token_ids for t in expected)
        outputs.add(tuple(expected))
    assert len(outputs) > 1, "the tiny model answers every prompt alike: the test would not see padding errors"


class ScriptedModel:
    """Stands in for a model whose `generate` returns fixed new tokens after the prompt."""

    def __init__(self, new_tokens: list[list[int]], eos: int) -> None:
        self.new_tokens = torch.tensor(new_tokens)  # [batch, steps]
        self.generation_config = type("GenerationConfig", (), {"eos_token_id": eos})()

    def eval(self):
        return self

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        return torch.cat([input_ids, self.new_tokens[:, :max_new_tokens]], dim=1)


def test_answers_stop_at_eos(tiny_mixed):
    """A row that ends early keeps its EOS token and none of the padding after it."""
    eos = tiny_mixed.tokenizer.eos_token_id
    model = ScriptedModel([[500, eos, eos, eos], [700, 800, 900, 1000]], eos)
    first, second = BatchedGreedy(model, tiny_mixed.tokenizer, max_new_tokens=4).answer(PROMPTS[:2])
    assert (first.answer_ids, first.finished) == ([500, eos], True)
    assert (second.answer_ids, second.finished) == ([700, 800, 900, 1000], False)
    assert second.answer == tiny_mixed.tokenizer.decode([700, 800, 900, 1000]) != ""


class CountingGreedy:
    """Wraps an answer stream: records which prompts it answered; can fail after n answers (a kill)."""

    def __init__(self, inner: BatchedGreedy, fail_after: int | None = None) -> None:
        self.inner, self.fail_after, self.answered, self.calls = inner, fail_after, [], 0

    def encode(self, prompt):
        return self.inner.encode(prompt)

    def stream(self, prompts, encoded):
        self.calls += 1
        for answer in self.inner.stream(prompts, encoded):
            if self.fail_after is not None and len(self.answered) >= self.fail_after:
                raise KeyboardInterrupt("killed")
            self.answered.append(answer.prompt.prompt_id)
            yield answer


def test_resume_skips_answered_prompts(greedy, tmp_path):
    shards = ShardFolder(tmp_path / "shards")
    killed = CountingGreedy(greedy, fail_after=4)
    with pytest.raises(KeyboardInterrupt):
        distill(killed, PROMPTS, shards, batch_size=2, progress=False)
    assert len(shards.shard_paths()) == 2 and len(killed.answered) == 4
    (shards.folder / ".tmp-123-abc-shard-000002.parquet").write_bytes(b"half a file")  # killed mid-write
    resumed = CountingGreedy(greedy)
    stats = distill(resumed, PROMPTS, shards, batch_size=2, progress=False)
    assert sorted(resumed.answered) == sorted(set(p.prompt_id for p in PROMPTS) - set(killed.answered))
    assert (stats.new_prompts, stats.prompts_done) == (2, 6)
    assert not list(shards.folder.glob(".tmp-*"))
    ids = shards.read(["prompt_id"]).column("prompt_id").to_pylist()
    assert sorted(ids) == sorted(p.prompt_id for p in PROMPTS)  # each prompt exactly once
    again = CountingGreedy(greedy)
    assert distill(again, PROMPTS, shards, batch_size=2, progress=False).new_prompts == 0 and not again.calls
    # A prompt the source no longer holds (its text changed) does not count as done.
    rows = shards.read().to_pylist()
    stats = distill(again, PROMPTS[1:], shards, batch_size=2, progress=False)
    assert stats.prompts_done == 5 and not again.calls
    assert stats.tokens_done == sum(len(r["answer_ids"]) for r in rows if r["prompt_id"] != PROMPTS[0].prompt_id)


def test_token_budget_stops_generation(greedy, tmp_path):
    shards = ShardFolder(tmp_path / "shards")
    stats = distill(greedy, PROMPTS, shards, batch_size=2, token_budget=7, progress=False)
    assert stats.tokens_done >= 7 and stats.new_prompts == 2  # one batch of 2 x 6 tokens reaches it
    assert distill(greedy, PROMPTS, shards, batch_size=2, token_budget=7, progress=False).new_prompts == 0


def test_resume_with_other_settings_is_refused(tmp_path):
    shards = ShardFolder(tmp_path / "shards")
    shards.pin_settings({"model": "a", "max_new_tokens": 256})
    shards.pin_settings({"model": "b", "max_new_tokens": 256})  # no shards yet: nothing to mix
    shards.write([])
    shards.pin_settings({"model": "b", "max_new_tokens": 256})
    with pytest.raises(CorpusError, match="max_new_tokens"):
        shards.pin_settings({"model": "b", "max_new_tokens": 128})


def test_merged_corpus_schema_order_and_metadata(greedy, tmp_path):
    shards = ShardFolder(tmp_path / "shards")
    distill(greedy, PROMPTS, shards, batch_size=2, progress=False)
    current = PROMPTS[::-1][:5]  # a source that no longer holds PROMPTS[0], in another order
    out = tmp_path / "corpus.parquet"
    sidecar = merge_shards(shards, out, current, {"model": "tiny", "command": "python run.py task=distill_corpus"})
    table = pq.read_table(out)
    assert table.schema.names == ["prompt_id", "category", "prompt", "answer_ids", "finished", "history"]
    assert table.column("history").to_pylist() == [[]] * 5  # first turns
    assert table.schema.field("answer_ids").type == pa.list_(pa.int32())
    assert table.schema.field("prompt_id").type == pa.string()
    assert table.column("prompt_id").to_pylist() == [p.prompt_id for p in current]
    assert pq.ParquetFile(out).metadata.row_group(0).column(3).compression == "ZSTD"
    metadata = read_corpus_metadata(out)
    tokens = sum(len(ids) for ids in table.column("answer_ids").to_pylist())
    assert metadata["answer_tokens"] == tokens and metadata["answers"] == 5 and metadata["model"] == "tiny"
    on_disk = json.loads(out.with_suffix(".json").read_text())
    assert on_disk == sidecar and on_disk["sha256"] == sha256_file(out) and on_disk["answer_tokens"] == tokens
    with pytest.raises(CorpusError, match="nothing to merge"):
        merge_shards(shards, tmp_path / "none.parquet", [make_prompt("not generated")], {})


def test_chat_prompt_ids_match_the_pipeline(tiny_mixed):
    """The corpus answers the prompt the benchmark sends: Pipeline.encode's chat formatting."""
    cfg = compose_config(["model=tiny_random", "pipeline=vanilla", "cost_curve=flat"])
    pipeline = build_pipeline(cfg, loaded=load_model(cfg.model))
    for prompt in PROMPTS:
        assert chat_prompt_ids(pipeline.tokenizer, prompt.text) == pipeline.encode(prompt.text)
    # A second turn: the first turn and its answer's text come first, as the benchmark sends them.
    history = (PROMPTS[1].text, "The lighthouse keeper lit the lamp.")
    messages = [{"role": "user", "content": history[0]}, {"role": "assistant", "content": history[1]},
                {"role": "user", "content": "Make it rhyme."}]
    assert chat_prompt_ids(pipeline.tokenizer, "Make it rhyme.", history=history) == pipeline.encode(messages)
    assert chat_prompt_ids(pipeline.tokenizer, "Make it rhyme.", history=history) != pipeline.encode("Make it rhyme.")


def test_follow_ups_continue_each_answered_first_turn():
    from specpipe.distill import subjects as S
    from specpipe.distill.prompts import follow_up_prompts

    firsts = [make_prompt(text, category) for text, category in
              [("Write a haiku.", "writing"), ("What is 3 x 7?", "math"), ("Explain DNS.", "stem")]]
    pairs = [(prompt, f"answer {i}") for i, prompt in enumerate(firsts)]
    follow_ups = follow_up_prompts(pairs)
    assert [f.history for f in follow_ups] == [(p.text, a) for p, a in pairs]
    assert all(f.text in S.FOLLOW_UPS[p.category] and f.category == p.category and f.source == "follow_up"
               for f, p in zip(follow_ups, firsts))
    assert follow_up_prompts(pairs[::-1]) == follow_ups[::-1]  # each drawn from its own first turn
    assert len({f.prompt_id for f in follow_ups} | {p.prompt_id for p in firsts}) == 6
    assert follow_up_prompts([(follow_ups[0], "answer")]) == []  # no third turns
    # Over many first turns every category's requests are used, and none repeats a dev prompt.
    many = [(make_prompt(f"question {i}", category), "answer") for category in S.FOLLOW_UPS for i in range(60)]
    used = {f.text for f in follow_up_prompts(many)}
    assert used == {text for texts in S.FOLLOW_UPS.values() for text in texts}
    assert find_overlaps(sorted(used), load_dev_turns(dev_prompt_files())) == []


# ---- continuous batching ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chaotic_pair():
    """(a stock tiny model whose greedy output is nearly random in its context, the same weights under
    engine=fast): a slot reading another slot's or a stale KV entry changes its answer."""
    from conftest import _rescale
    from specpipe.engine.onednn import OneDNNEngine

    cfg = compose_config(["model=tiny_random"])
    reference, fast = load_model(cfg.model), load_model(cfg.model)
    for loaded in (reference, fast):
        _rescale(loaded.model, 20.0, 10.0)
    OneDNNEngine().apply(fast.model)
    return reference, fast


def test_continuous_answers_equal_each_prompt_alone(chaotic_pair):
    """Slots refilled as answers end (at an EOS or the length cap), prompts of 1-60 tokens: every
    answer equals HF greedy `generate` on its prompt alone, through the fast engine and through
    transformers' own forward."""
    from conftest import hf_greedy, random_prompts
    from specpipe.distill.continuous import ContinuousGreedy

    reference, fast = chaotic_pair
    encoded = [ids[:n] for ids, n in zip(random_prompts(10, 3), [3, 40, 7, 25, 60, 1, 12, 33, 5, 18])]
    prompts = [make_prompt(f"prompt {i}") for i in range(len(encoded))]
    tokenizer = reference.tokenizer
    uncapped = [hf_greedy(reference.model, ids, 12, [tokenizer.eos_token_id], tokenizer.pad_token_id) for ids in encoded]
    # EOS tokens that some answers reach early, at different steps, so slots free up out of step.
    stops = sorted({uncapped[0][3], uncapped[2][7], uncapped[4][5], uncapped[6][9]})
    for model in (fast.model, load_model(compose_config(["model=tiny_random"]).model).model):
        if model is not fast.model:
            from conftest import _rescale

            _rescale(model, 20.0, 10.0)
        generator = ContinuousGreedy(model, reference.tokenizer, max_new_tokens=12, slots=3)
        generator.eos_token_ids = stops
        answers = list(generator.stream(prompts, encoded))
        assert sorted(a.prompt.prompt_id for a in answers) == sorted(p.prompt_id for p in prompts)
        by_id = {a.prompt.prompt_id: a for a in answers}
        lengths = set()
        for prompt, ids in zip(prompts, encoded):
            expected = hf_greedy(reference.model, ids, 12, stops, tokenizer.pad_token_id)
            answer = by_id[prompt.prompt_id]
            assert answer.answer_ids == expected, prompt.text
            assert answer.finished == (expected[-1] in stops)
            lengths.add(len(expected))
        assert len(lengths) >= 3, "answers of one length would not exercise the refill"
        assert [a.prompt.prompt_id for a in answers] != [p.prompt_id for p in prompts]  # finished out of order


def test_continuous_generator_refuses_what_it_cannot_hold(chaotic_pair):
    from specpipe.distill.continuous import ContinuousGreedy, SlotCache

    _, fast = chaotic_pair
    with pytest.raises(CorpusError, match="must be >= 1"):
        ContinuousGreedy(fast.model, fast.tokenizer, max_new_tokens=4, slots=0)
    cache = SlotCache(slots=2, layers=1, kv_heads=1, head_dim=4, capacity=8, dtype=torch.float32)
    with pytest.raises(CorpusError, match="one new token per slot"):
        cache.update(torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), 0)
    cache.lengths[1] = 8
    with pytest.raises(CorpusError, match="outgrew its KV cache of 8 positions"):
        cache.step_mask()


def test_an_empty_shard_folder_extends_the_merged_corpus(greedy, tmp_path, tiny_mixed):
    """The repository ships the merged file, not the shards: a run starts from its answers (and
    their provenance), answers only the rest, and the new merge holds both."""
    from specpipe.distill.corpus import shards_from_corpus

    settings = {"model": "tiny", "dtype": "fp32", "seed": 7}
    first = ShardFolder(tmp_path / "first")
    first.pin_settings(settings)
    first.log_run({"event": "start", "overrides": ["first run"]})
    distill(greedy, PROMPTS[:4], first, batch_size=2, progress=False)
    merged = tmp_path / "corpus.parquet"
    merge_shards(first, merged, PROMPTS[:4], {"model": "tiny", "dtype": "fp32", "prompt_source": {"seed": 7},
                                              "runs": first.runs()})
    shards = ShardFolder(tmp_path / "again")
    assert shards_from_corpus(shards, merged, {**settings, "dtype": "bf16"}, tiny_mixed.tokenizer) == 0
    assert not shards.shard_paths()  # made with other settings: left alone
    assert shards_from_corpus(shards, merged, settings, tiny_mixed.tokenizer) == 4
    assert shards.settings() == settings and shards.runs()[0]["overrides"] == ["first run"]
    def rows(folder):
        return sorted(folder.read().to_pylist(), key=lambda row: row["prompt_id"])

    assert rows(shards) == rows(first)
    counting = CountingGreedy(greedy)
    stats = distill(counting, PROMPTS, shards, batch_size=2, progress=False)
    assert sorted(counting.answered) == sorted(p.prompt_id for p in PROMPTS[4:]) and stats.prompts_done == 6
    assert shards_from_corpus(shards, merged, settings, tiny_mixed.tokenizer) == 0  # only into an empty folder
    info = merge_shards(shards, merged, PROMPTS, {"model": "tiny", "dtype": "fp32"})
    assert info["answers"] == 6


def test_a_merge_never_silently_replaces_a_corpus_it_would_lose_answers_of(tiny_mixed, tmp_path):
    """A QA pass replaced a 60-answer corpus by 3 answers of another model without a word (the shards
    could not start from it, so the merge wrote over it), and a smaller distill.limit shrank one."""
    greedy = BatchedGreedy(tiny_mixed.loaded.model, tiny_mixed.tokenizer, max_new_tokens=4)
    shards = ShardFolder(tmp_path / "shards")
    distill(greedy, PROMPTS, shards, batch_size=2, progress=False)
    out = tmp_path / "corpus.parquet"
    made = {"model": "tiny", "dtype": "fp32", "max_new_tokens": 4}
    assert merge_shards(shards, out, PROMPTS, made)["answers"] == 6
    with pytest.raises(CorpusError, match="made with other settings .*model='tiny' there, 'other' here"):
        merge_shards(shards, out, PROMPTS, {**made, "model": "other"})
    with pytest.raises(CorpusError, match="holds 6 answers; the shards give 3"):
        merge_shards(shards, out, PROMPTS[:3], made)
    assert read_corpus_metadata(out)["answers"] == 6  # both refusals left the file as it was
    assert merge_shards(shards, out, PROMPTS[:3], made, replace=True)["answers"] == 3
    out.with_suffix(".txt").write_text("not a corpus")
    with pytest.raises(CorpusError, match="not a self-distilled corpus"):
        merge_shards(shards, out.with_suffix(".txt"), PROMPTS, made)


def test_unreadable_corpora_are_corpus_errors(tmp_path):
    text = tmp_path / "text.parquet"
    text.write_text("prompt,answer\n")
    with pytest.raises(CorpusError, match="not a readable Parquet file"):
        read_corpus_metadata(text)
    with pytest.raises(CorpusError, match="not a readable Parquet file"):
        read_corpus(text)
    columns = tmp_path / "columns.parquet"
    pq.write_table(pa.table({"prompt_id": ["a"], "prompt": ["hi"]}), columns)
    with pytest.raises(CorpusError, match=r"lacks the column\(s\) \['category', 'answer_ids', 'finished'\]"):
        read_corpus(columns)
    strings = tmp_path / "strings.parquet"
    pq.write_table(pa.table({"prompt_id": ["a"], "category": ["c"], "prompt": ["hi"], "answer_ids": [["x"]],
                             "finished": [True]}), strings)
    with pytest.raises(CorpusError, match="answer_ids must be lists of token ids"):
        read_corpus(strings)


def test_distill_task_end_to_end(tmp_path):
    """`task=distill_corpus` on the tiny model, oneDNN linears: shards, then the merged file."""
    from specpipe.tasks import TASKS
    from specpipe.tasks.distill_corpus import run_distill_corpus

    assert "distill_corpus" in TASKS
    cfg = compose_config(["task=distill_corpus", "model=tiny_random", "distill.limit=4", "distill.batch_size=2",
                          "distill.max_new_tokens=3", f"distill.shards={tmp_path / 'shards'}",
                          f"distill.out={tmp_path / 'corpus.parquet'}", "distill.progress=false"])
    info = run_distill_corpus(cfg)
    # Four first turns, then a second turn for each: 8 answers of at most 3 tokens.
    assert info["answers"] == 8 and info["answer_tokens"] <= 24 and info["linears"] == "onednn"
    assert info["prompt_source"]["limit"] == 4 and info["prompt_source"]["follow_ups"] == 4
    assert info["tokenizer"]["vocab_size"] == 49152
    assert read_corpus_metadata(tmp_path / "corpus.parquet")["answers"] == 8
    rows = pq.read_table(tmp_path / "corpus.parquet").to_pylist()
    firsts = {row["prompt"]: row for row in rows if not row["history"]}
    seconds = [row for row in rows if row["history"]]
    assert len(firsts) == len(seconds) == 4
    tokenizer = load_model(cfg.model).tokenizer
    for row in seconds:
        first = firsts[row["history"][0]]
        assert row["history"][1] == tokenizer.decode(first["answer_ids"], skip_special_tokens=True)


# ---- the prompt source ----------------------------------------------------------------------------
def test_prompt_source_is_large_varied_and_deterministic(source):
    prompts = source.prompts
    assert len(prompts) >= 5000
    assert len({p.prompt_id for p in prompts}) == len(prompts)
    assert all(p.prompt_id == prompt_id(p.text) for p in prompts)
    assert MT_BENCH_CATEGORIES <= {p.category for p in prompts}
    assert set(source.describe()["per_source"]) == set(SOURCE_COUNTS)
    first = prompts[:200]  # any prefix (what a budgeted run answers) mixes categories
    assert MT_BENCH_CATEGORIES <= {p.category for p in first}
    assert [p.prompt_id for p in build_prompt_source().prompts] == [p.prompt_id for p in prompts]
    assert [p.prompt_id for p in build_prompt_source(seed=1).prompts] != [p.prompt_id for p in prompts]


def test_growing_the_source_keeps_every_prompt_already_answered(source):
    """Raising builders' counts and adding the `*_2` builders grew the source: a larger count extends a
    builder's seeded draw, so the source before (its counts below) is a subset of today's, and every
    first turn the shipped corpus answered is still a prompt of the source (nothing answered is orphaned)."""
    import pyarrow.parquet as pq

    before = {"writing": 700, "review": 32, "email": 78, "advice": 90, "roleplay": 300, "roleplay_situation": 400,
              "coding": 700, "coding_concept": 150, "sql": 10, "stem": 500, "stem_compare": 40, "humanities": 400,
              "humanities_question": 22, "math": 800, "reasoning": 600, "extraction": 500, "pydoc": 500,
              "stdlib_module": 400, "stdlib_function": 400}
    now = {p.prompt_id for p in source.prompts}
    earlier = {p.prompt_id for p in build_prompt_source(counts=before).prompts}
    assert len(earlier) == 6453 and earlier < now
    rows = pq.read_table(PACKAGE_ROOT / "data" / "self_distill" / "smollm2_135m_chat.parquet",
                         columns=["prompt_id", "history"]).to_pylist()
    answered = {row["prompt_id"] for row in rows if not row["history"]}
    assert answered and answered <= now


# ---- the pinned prompt source ---------------------------------------------------------------------
# The shipped corpora, heads and drafts were built from this source, and their reproduction commands rebuild
# it, so it is pinned: the prompts of the builders and counts below, in order, and their follow-ups.
PINNED_COUNTS = {
    "writing": 715, "review": 32, "email": 78, "advice": 90, "roleplay": 300, "roleplay_situation": 500,
    "coding": 1770, "coding_concept": 150, "sql": 10, "stem": 600, "stem_compare": 40,
    "humanities": 444, "humanities_question": 22, "math": 1600, "reasoning": 1200, "extraction": 1000,
    "pydoc": 500, "stdlib_module": 400, "stdlib_function": 400,
    "writing_2": 660, "roleplay_2": 240, "roleplay_situation_2": 400, "stem_2": 420, "humanities_2": 360,
    "advice_2": 120,
    "writing_situated": 120, "roleplay_situated": 120, "reasoning_situated": 120, "math_situated": 120,
    "coding_situated": 120, "extraction_situated": 100, "stem_situated": 120, "humanities_situated": 120,
    "advice_situated": 60,
}
PYTHON_TEXT_BUILDERS = ("pydoc", "stdlib_module", "stdlib_function")  # their text comes with the Python version
# build_prompt_source(counts=PINNED_COUNTS), then a follow-up of each first turn (answer "answer"), on this Python:
SOURCE_SHA256, SOURCE_PYTHON = "54a3f0e8b99d8ee55ce047d1b499eb3131890bea9dc36cad37019b1b747aa343", "3.11.7"
# The raw seeded draw of every other builder, then a follow-up of each (any Python version):
DRAWS_SHA256 = "51256dbeb1bf7c70b250fd01f77a315cc46174e24c1e64f113dba790f3ce22c9"
CHANGED_SOURCE = ("the prompt source changed, and with it what the shipped corpora, heads and drafts were built from. "
                  "Never edit, reorder or insert items of a generation already drawn: append new items with a new "
                  "generation and give it a builder of its own (specpipe/distill/data/README.md).")


def source_sha256(prompts) -> str:
    digest = hashlib.sha256()
    for p in prompts:
        row = [p.prompt_id, p.category, p.source, p.text, list(p.history)]
        digest.update(json.dumps(row, ensure_ascii=False).encode() + b"\n")
    return digest.hexdigest()


def with_follow_ups(firsts: list[ChatPrompt], data: PromptData | None = None) -> list[ChatPrompt]:
    return firsts + follow_up_prompts([(p, "answer") for p in firsts], data=data)


def draws_sha256(data: PromptData) -> str:
    firsts = []
    for source, count in PINNED_COUNTS.items():
        if source not in PYTHON_TEXT_BUILDERS:
            category, build = BUILDERS[source]
            texts = build(random.Random(f"{DEFAULT_SEED}:{source}"), count, data)
            firsts += [ChatPrompt(prompt_id(text), category, source, text) for text in texts]
    return source_sha256(with_follow_ups(firsts, data))


def test_the_prompt_source_is_pinned(source):
    assert all(SOURCE_COUNTS.get(name, 0) >= count for name, count in PINNED_COUNTS.items()), CHANGED_SOURCE
    assert draws_sha256(load_prompt_data()) == DRAWS_SHA256, CHANGED_SOURCE
    if platform.python_version() != SOURCE_PYTHON:
        pytest.skip(f"the whole source is pinned on Python {SOURCE_PYTHON} (its docs and stdlib text)")
    pinned = source if SOURCE_COUNTS == PINNED_COUNTS else build_prompt_source(counts=PINNED_COUNTS)
    assert source_sha256(with_follow_ups(pinned.prompts)) == SOURCE_SHA256, CHANGED_SOURCE


# How many items each pool held when the source was pinned: those items (ids, generations, texts) never change.
PINNED_POOL_SIZES = {
    "advice.templates": 3, "advice.topics": 70, "coding.languages": 10, "coding.tasks": 59, "coding.templates": 3,
    "coding_concept.concepts": 50, "coding_concept.templates": 3, "constraints.advice": 5, "constraints.coding": 5,
    "constraints.extraction": 5, "constraints.humanities": 5, "constraints.math": 5, "constraints.reasoning": 5,
    "constraints.roleplay": 5, "constraints.stem": 5, "constraints.writing": 7, "email.subjects": 26,
    "email.templates": 3, "follow_ups.advice": 6, "follow_ups.coding": 10, "follow_ups.extraction": 8,
    "follow_ups.humanities": 8, "follow_ups.math": 8, "follow_ups.reasoning": 8, "follow_ups.roleplay": 10,
    "follow_ups.stem": 8, "follow_ups.writing": 12, "humanities.templates": 6, "humanities.topics": 134,
    "humanities_question.questions": 22, "pydoc.templates": 4, "review.subjects": 16, "review.templates": 2,
    "roleplay.personas": 90, "roleplay.situations": 10, "roleplay.templates": 6, "situated.advice": 12,
    "situated.coding": 20, "situated.extraction": 15, "situated.humanities": 20, "situated.math": 20,
    "situated.reasoning": 20, "situated.roleplay": 20, "situated.stem": 20, "situated.writing": 22,
    "slots.cities": 27, "slots.companies": 15, "slots.events": 10, "slots.first_names": 32, "slots.job_titles": 12,
    "slots.last_names": 25, "slots.months": 12, "slots.products": 16, "sql.tasks": 10, "sql.templates": 1,
    "stdlib_function.templates": 2, "stdlib_module.templates": 3, "stem.concepts": 170, "stem.templates": 6,
    "stem_compare.pairs": 20, "stem_compare.templates": 2, "writing.subjects": 125, "writing.templates": 11,
}
PINNED_ITEMS_SHA256 = "f4e758d166da943f3e42d4b21c37bbe148d188e049e0d34b10fa1dd51a7fdb15"


def test_prompt_data_items_are_append_only(tmp_path):
    """Every item the pinned source could draw keeps its id, generation and text (a pool only grows at
    its end), and the loader refuses a pool whose ids repeat or go down."""
    pools = load_prompt_data().pools
    digest = hashlib.sha256()
    for name, size in PINNED_POOL_SIZES.items():
        assert len(pools.get(name, ())) >= size, f"pool {name!r} lost items: {CHANGED_SOURCE}"
        for item in pools[name][:size]:
            digest.update(json.dumps([name, item.id, item.gen, item.value], ensure_ascii=False).encode() + b"\n")
    assert digest.hexdigest() == PINNED_ITEMS_SHA256, CHANGED_SOURCE
    (tmp_path / "pools.json").write_text(json.dumps({"pools": {"a.b": {"items": [
        {"id": 2, "gen": 1, "text": "x"}, {"id": 1, "gen": 2, "text": "y"}]}}}))
    with pytest.raises(ValueError, match="pool 'a.b'.* ids must be unique and increase"):
        load_prompt_data(tmp_path)


def test_adding_a_generation_keeps_every_earlier_prompt(source, tmp_path, monkeypatch):
    """The rule of specpipe/distill/data/README.md, on a copy of the data: an item appended to every pool
    in a new generation changes no builder's draw; a builder of that generation adds its prompts to the
    source, which keeps every earlier one. The same item appended to generation 1 would reshuffle a draw."""
    def copy_with_new_items(folder: Path, gen_of) -> Path:
        shutil.copytree(DATA_DIR, folder)
        for path in folder.glob("*.json"):
            content = json.loads(path.read_text(encoding="utf-8"))
            for name, pool in content["pools"].items():
                last = pool["items"][-1]
                text = "a subject of a new generation" if name == "writing.subjects" else last["text"]
                pool["items"].append({"id": last["id"] + 1, "gen": gen_of(pool), "text": text})
            path.write_text(json.dumps(content), encoding="utf-8")
        return folder

    grown = load_prompt_data(copy_with_new_items(tmp_path / "new_gen",
                                                 lambda pool: max(item["gen"] for item in pool["items"]) + 1))
    assert draws_sha256(grown) == DRAWS_SHA256
    monkeypatch.setitem(BUILDERS, "writing_3", ("writing", product_of("writing.templates", "writing.subjects", gen=3)))
    larger = build_prompt_source(counts={**SOURCE_COUNTS, "writing_3": 50}, data=grown)
    added = set(larger.prompts) - set(source.prompts)
    assert set(source.prompts) <= set(larger.prompts)
    assert len(added) == 11 and all(p.source == "writing_3" and "a new generation" in p.text for p in added)

    appended = load_prompt_data(copy_with_new_items(tmp_path / "gen_1", lambda pool: 1))
    writing = BUILDERS["writing"][1]
    assert writing(random.Random(0), 715, appended) != writing(random.Random(0), 715, load_prompt_data())
    assert draws_sha256(appended) != DRAWS_SHA256  # and the pin sees it


def test_situated_requests_fill_every_slot_and_keep_the_constraint_with_the_ask(source):
    """Every situated request formats with the slots the builder fills (a misspelt slot raises KeyError),
    and a constraint goes after the ask, never after the document an extraction request quotes."""
    rng = random.Random(0)
    for category, requests in SITUATED_REQUESTS.items():
        assert category in CONSTRAINTS and CONSTRAINTS[category][0] == ""  # the first entry: no constraint
        for request in requests:
            filled = fill_slots(request, rng)
            assert "{" not in filled.replace("{2}", "").replace("{4}", ""), filled  # only the regex's own braces
    make = situated_request("extraction")
    made = [make(rng) for _ in range(200)]
    constrained = [(text, c) for text in made for c in CONSTRAINTS["extraction"][1:] if c in text]
    assert len(constrained) > 100
    assert all(c in text.split("\n\n")[0] for text, c in constrained)
    situated = {p.source for p in source.prompts if p.source.endswith("_situated")}
    assert situated == {f"{category}_situated" for category in SITUATED_REQUESTS}


def test_prompt_source_shares_nothing_with_dev_prompts(source):
    files = dev_prompt_files()
    assert {path.name for path in files} >= {"dev_prompts.jsonl", "dev_chat_prompts.jsonl"}
    assert source.dev_files == [str(path.relative_to(REPO)) for path in files]
    assert find_overlaps([p.text for p in source.prompts], load_dev_turns(files)) == []


def test_dev_chat_prompts_cover_the_mt_bench_categories():
    rows = [json.loads(line) for line in (REPO / "bench" / "dev_chat_prompts.jsonl").read_text().splitlines()]
    assert {row["category"] for row in rows} == MT_BENCH_CATEGORIES
    assert all(sum(row["category"] == c for row in rows) == 6 for c in MT_BENCH_CATEGORIES)
    assert all(len(row["turns"]) == 2 for row in rows)
    old = {json.loads(line)["question_id"] for line in (REPO / "bench" / "dev_prompts.jsonl").read_text().splitlines()}
    assert not old & {row["question_id"] for row in rows}


def test_overlap_rule_catches_near_duplicates():
    dev = ["Write a poem about the sea at night, in the style of a sailor's song, with four short verses."]
    cases = {
        "write a POEM about the sea at night -- in the style of a sailor's song, with four short verses!": "exact",
        "Please write a poem about the sea at night, in the style of a sailor's song, with four verses.": "shares",
        "Write a poem about the sea at dawn, in the style of a sailor's song, with four brief verses.": "Jaccard",
        "Consider this: Write a poem about the sea at night. Then explain your word choices.": None,
        "Write a poem about autumn leaves.": None,
    }
    found = {text: reason for text, _, reason in find_overlaps(cases, dev)}
    for text, expected in cases.items():
        if expected is None:
            assert text not in found
        else:
            assert expected in found[text], (text, found.get(text))
    short_dev = ["Summarise your answer as a table."]
    assert find_overlaps(
        ["Explain photosynthesis step by step for a school project, then summarise your answer as a table."], short_dev)[0][2] == \
        "contains a dev turn"
