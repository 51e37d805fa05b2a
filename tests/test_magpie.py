"""The Magpie prompt source: user turns sampled from the target after its chat template's user header."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from specpipe.distill.magpie import QUERIES_FILE, MagpieSampler, MagpieSettings, user_header_ids
from specpipe.distill.dev_overlap import dev_prompt_files, load_dev_turns
from specpipe.errors import ConfigError
from specpipe.pipelines.builder import compose_config


def write_turns(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_user_header_is_the_chat_up_to_the_users_text(tiny):
    tokenizer = tiny.tokenizer
    for system in (None, "Answer briefly."):
        header = user_header_ids(tokenizer, system)
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": "How do tides work?"}]
        full = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        full = full["input_ids"] if isinstance(full, dict) or hasattr(full, "keys") else full
        assert full[:len(header)] == header
        assert tokenizer.decode(full[len(header):]).startswith("How do tides work?")
    assert "Answer briefly." in tokenizer.decode(user_header_ids(tokenizer, "Answer briefly."))


def test_sampling_is_seeded_per_batch_and_resumes(tiny, tmp_path):
    settings = MagpieSettings(batches=2, batch_size=3, max_new_tokens=4)
    first = MagpieSampler(tiny.reference, tiny.tokenizer, None, settings, tmp_path / "a" / QUERIES_FILE)
    first.sample(progress=False)
    rows = [json.loads(line) for line in first.path.read_text().splitlines()]
    assert [row["batch"] for row in rows] == [0, 0, 0, 1, 1, 1]
    assert len({row["text"] for row in rows}) > 1  # sampled, not one greedy turn repeated
    # a resume samples nothing again
    before = first.path.read_text()
    first.sample(progress=False)
    assert first.path.read_text() == before
    # batch 1 alone, in another file, draws the same turns: each batch has its own seed
    second = MagpieSampler(tiny.reference, tiny.tokenizer, None, settings, tmp_path / "b" / QUERIES_FILE)
    write_turns(second.path, rows[:3])
    second.sample(progress=False)
    assert second.path.read_text() == before
    # a file sampled otherwise is refused, not extended or read
    for other in (MagpieSettings(batches=3, batch_size=3, max_new_tokens=4, temperature=0.7),
                  MagpieSettings(batches=2, batch_size=3, max_new_tokens=4, seed=1)):
        changed = MagpieSampler(tiny.reference, tiny.tokenizer, None, other, first.path)
        with pytest.raises(ConfigError, match="was sampled with other settings \\((temperature|seed) differ"):
            changed.sample(progress=False)
        with pytest.raises(ConfigError, match="sampled with other settings"):
            changed.source()
    with pytest.raises(ConfigError, match="the system prompt or chat template differ"):
        MagpieSampler(tiny.reference, tiny.tokenizer, "Be brief.", settings, first.path).sample(progress=False)
    assert first.path.read_text() == before
    # a larger setting extends the file; the smaller one still reads only its batches
    more = MagpieSampler(tiny.reference, tiny.tokenizer, None, MagpieSettings(batches=3, batch_size=3, max_new_tokens=4),
                         first.path)
    more.sample(progress=False)
    assert [json.loads(line)["batch"] for line in first.path.read_text().splitlines()] == [0] * 3 + [1] * 3 + [2] * 3


def test_kept_turns_ended_are_long_enough_distinct_and_off_the_dev_prompts(tiny, tmp_path):
    dev_turn = load_dev_turns(dev_prompt_files())[0]
    rows = [
        {"batch": 0, "finished": True, "text": "Can you suggest three ways to keep basil fresh for a week?"},
        {"batch": 0, "finished": False, "text": "I am writing a long story about a lighthouse keeper who"},
        {"batch": 0, "finished": True, "text": "Hi there, help?"},  # under min_words
        {"batch": 1, "finished": True, "text": "can you suggest three ways to keep BASIL fresh for a week"},  # duplicate
        {"batch": 1, "finished": True, "text": dev_turn},  # a dev prompt
        {"batch": 1, "finished": True, "text": "What makes a sourdough starter go sluggish in winter kitchens?"},
        {"batch": 2, "finished": True, "text": "A turn of a batch beyond this setting's two batches."},
    ]
    sampler = MagpieSampler(tiny.reference, tiny.tokenizer, None, MagpieSettings(batches=2), tmp_path / QUERIES_FILE)
    write_turns(sampler.path, rows)
    source = sampler.source()
    assert [p.text for p in source.prompts] == [rows[0]["text"], rows[5]["text"]]
    assert {p.category for p in source.prompts} == {"magpie"} and all(not p.history for p in source.prompts)
    assert [text for text, _, _ in source.dropped] == [dev_turn]
    assert source.describe()["per_source"] == {"magpie": 2}


def test_a_damaged_queries_file_and_bad_settings_are_refused(tiny, tmp_path):
    sampler = MagpieSampler(tiny.reference, tiny.tokenizer, None, MagpieSettings(batches=1), tmp_path / QUERIES_FILE)
    sampler.path.write_text('{"batch": 0, "finished": true, "text": "ok"}\nnot json\n')
    for read in (lambda: sampler.sample(progress=False), sampler.source):
        with pytest.raises(ConfigError, match=f"{QUERIES_FILE}:2: not a sampled user turn.*delete the file"):
            read()
    for key, value in (("batches", 0), ("batch_size", -1), ("max_new_tokens", 0), ("min_words", 0)):
        with pytest.raises(ConfigError, match=f"distill.magpie.{key} must be >= 1"):
            MagpieSettings(**{key: value})
    with pytest.raises(ConfigError, match="temperature must be > 0"):
        MagpieSettings(temperature=0.0)


def test_distill_task_answers_the_sampled_turns(tmp_path):
    """`task=distill_corpus distill.prompt_source=magpie` on the tiny model, with the turns already sampled
    (a random model rarely ends a turn): the corpus holds one first-turn answer per kept turn."""
    from specpipe.tasks.distill_corpus import run_distill_corpus

    shards = tmp_path / "shards"
    turns = ["Can you suggest three ways to keep basil fresh for a week?",
             "What makes a sourdough starter go sluggish in winter kitchens?",
             "How should I plan a two-day walk along a river with small children?"]
    write_turns(shards / QUERIES_FILE, [{"batch": b, "finished": True, "text": text} for b, text in enumerate(turns)])
    cfg_overrides = ["task=distill_corpus", "model=tiny_random", "distill.prompt_source=magpie",
                     "distill.magpie.batches=3", "distill.batch_size=2", "distill.max_new_tokens=3",
                     f"distill.shards={shards}", f"distill.out={tmp_path / 'corpus.parquet'}", "distill.progress=false"]
    info = run_distill_corpus(compose_config(cfg_overrides))
    assert info["answers"] == 3 and info["prompt_source"]["module"] == "specpipe.distill.magpie"
    assert info["prompt_source"]["per_source"] == {"magpie": 3} and info["prompt_source"]["follow_ups"] == 0
    rows = pq.read_table(tmp_path / "corpus.parquet").to_pylist()
    assert [row["prompt"] for row in rows] == turns and all(row["category"] == "magpie" for row in rows)
    # more batches extend the same shards: only the new turn is answered
    more = "Which houseplants cope with a dark north-facing bathroom all year?"
    with (shards / QUERIES_FILE).open("a") as out:
        out.write(json.dumps({"batch": 3, "finished": True, "text": more}) + "\n")
    grown = compose_config([*(o for o in cfg_overrides if "magpie.batches" not in o), "distill.magpie.batches=4"])
    info = run_distill_corpus(grown)
    assert info["answers"] == 4 and pq.read_table(tmp_path / "corpus.parquet").column("prompt").to_pylist() == [*turns, more]


@pytest.mark.parametrize("override, message", [
    ("distill.prompt_source=web", "distill.prompt_source must be one of"),
    ("+distill.magpie.topk=5", "distill.magpie has no key\\(s\\) topk"),
    ("distill.magpie.temperature=0", "temperature must be > 0"),
])
def test_bad_magpie_options_are_refused_before_the_model_loads(tmp_path, override, message):
    from specpipe.tasks.distill_corpus import run_distill_corpus

    cfg = compose_config(["task=distill_corpus", "model=tiny_random", "distill.prompt_source=magpie", override,
                          f"distill.shards={tmp_path / 'shards'}", f"distill.out={tmp_path / 'corpus.parquet'}"])
    with pytest.raises(ConfigError, match=message):
        run_distill_corpus(cfg)
