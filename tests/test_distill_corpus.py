"""The self-distilled chat corpus: batched answers equal one-at-a-time greedy decoding, shards
resume where a run stopped, the merged file has the shipped schema, and the prompt source shares
nothing with the dev prompt sets."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from specpipe.distill.corpus import (BatchedGreedy, CorpusError, ShardFolder, chat_prompt_ids, distill,
                                     merge_shards, read_corpus_metadata)
from specpipe.distill.prompts import (SOURCE_COUNTS, ChatPrompt, build_prompt_source, dev_prompt_files,
                                      find_overlaps, load_dev_turns, prompt_id)
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
    return BatchedGreedy(tiny_mixed.reference, tiny_mixed.tokenizer, max_new_tokens=6)


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
    """Wraps a BatchedGreedy: records which prompts it answered; can fail after n batches (a kill)."""

    def __init__(self, inner: BatchedGreedy, fail_after: int | None = None) -> None:
        self.inner, self.fail_after, self.answered, self.calls = inner, fail_after, [], 0

    def encode(self, prompt):
        return self.inner.encode(prompt)

    def answer(self, prompts, encoded=None):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("killed")
        self.calls += 1
        self.answered += [p.prompt_id for p in prompts]
        return self.inner.answer(prompts, encoded)


def test_resume_skips_answered_prompts(greedy, tmp_path):
    shards = ShardFolder(tmp_path / "shards")
    killed = CountingGreedy(greedy, fail_after=2)
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
    assert table.schema.names == ["prompt_id", "category", "prompt", "answer_ids", "finished"]
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


def test_distill_task_end_to_end(tmp_path):
    """`task=distill_corpus` on the tiny model, oneDNN linears: shards, then the merged file."""
    from specpipe.tasks import TASKS
    from specpipe.tasks.distill_corpus import run_distill_corpus

    assert "distill_corpus" in TASKS
    cfg = compose_config(["task=distill_corpus", "model=tiny_random", "distill.limit=4", "distill.batch_size=2",
                          "distill.max_new_tokens=3", f"distill.shards={tmp_path / 'shards'}",
                          f"distill.out={tmp_path / 'corpus.parquet'}", "distill.progress=false"])
    info = run_distill_corpus(cfg)
    assert info["answers"] == 4 and info["answer_tokens"] <= 12 and info["linears"] == "onednn"
    assert info["prompt_source"]["limit"] == 4 and info["tokenizer"]["vocab_size"] == 49152
    assert read_corpus_metadata(tmp_path / "corpus.parquet")["answers"] == 4


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
