"""`task=bench` end to end on the tiny random model, its error messages, and the multirun merge."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from specpipe.errors import ConfigError, InvalidRequest
from specpipe.tasks.bench import run_bench
from specpipe.tasks.bench_questions import read_questions, select_questions
from specpipe.tasks.bench_records import Question, TurnOutput
from specpipe.tasks.bench_run import run_question
from specpipe.pipelines.builder import compose_config
from specpipe.pipelines.pipeline import PreparedPrompt

REPO = Path(__file__).resolve().parents[1]
METHODS = {"hf_generate", "hf_pld", "vanilla", "prompt_lookup"}
METRICS = {"speedup", "tok_s", "mean_accepted", "exact_rate"}
QUESTIONS = [
    {"question_id": 1, "category": "chat", "turns": ["Write a haiku about the sea.", "Now one about mountains."]},
    {"question_id": 2, "category": "chat", "turns": ["Name three colors."]},
    {"question_id": 3, "category": "qa", "turns": ["What is the capital of France?"]},
    {"question_id": 4, "category": "qa", "turns": ["Repeat: the cat sat on the mat, the cat sat on the mat."]},
]


def tiny_overrides(prompts: Path, *extra: str) -> list[str]:
    return ["task=bench", "model=tiny_random", "cost_curve=flat", f"bench.prompts={prompts}", *extra]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "questions.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


@pytest.fixture(scope="module")
def bench_run(prompts_file, tmp_path_factory, tiny_mixed) -> tuple[Path, dict]:
    """The bench on conftest's `tiny_mixed` (a tiny_random whose output depends on the context,
    so drafts are sometimes accepted and sometimes not; the stock one repeats its last token)."""
    out = tmp_path_factory.mktemp("bench_out")
    cfg = compose_config(tiny_overrides(prompts_file, "pipeline=prompt_lookup", "bench.per_category=2",
                                        "bench.max_new_tokens=8", "bench.relative_to=vanilla", f"bench.out={out}"))
    return out, run_bench(cfg, loaded=tiny_mixed.loaded, hf_model=tiny_mixed.reference)


def test_summary_json_has_the_documented_shape(bench_run):
    out, returned = bench_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary == json.loads(json.dumps(returned))
    assert set(summary["overall"]) == METHODS
    assert list(summary["categories"]) == ["chat", "qa"]
    groups = [summary["overall"], *summary["categories"].values()]
    for group in groups:
        assert set(group) == METHODS
        for metrics in group.values():
            assert METRICS <= set(metrics)
            assert all(isinstance(metrics[key], float) for key in METRICS)


def test_relative_to_gives_each_method_its_speed_over_one_method_with_an_interval(bench_run):
    out, summary = bench_run
    relative = summary["relative"]
    assert relative["baseline"] == "vanilla" and set(relative["overall"]) == METHODS - {"vanilla"}
    for method, cell in relative["overall"].items():
        # the ratio of mean tok/s, as the summary's own cells give it
        assert cell["ratio"] == pytest.approx(summary["overall"][method]["tok_s"] / summary["overall"]["vanilla"]["tok_s"])
        assert cell["low"] <= cell["ratio"] <= cell["high"] and cell["questions"] == 4
    assert list(relative["categories"]) == ["chat", "qa"]
    assert "## Speed over `vanilla`" in (out / "summary.md").read_text()


def test_paired_intervals_tell_a_slower_method_from_the_noise():
    import random

    from specpipe.tasks.bench_metrics import paired_speed_ratios
    from specpipe.tasks.bench_render import relative_table

    rng = random.Random(0)
    records = []
    for question in range(12):
        drift = rng.uniform(60.0, 140.0)  # the machine's speed when this question ran, shared by the methods
        swing = 0.08 if question % 2 else -0.08  # +-8% question by question, 1 on average
        for method, factor in (("base", 1.0), ("slower", 0.9 * rng.gauss(1.0, 0.02)), ("noisy", 1.0 + swing)):
            group = "a" if question < 6 else "b"
            records.append({"question_id": question, "group": group, "method": method, "tok_s": drift * factor})
    records.append({"question_id": 99, "group": "b", "method": "noisy", "tok_s": 1e6})  # base never ran it
    relative = paired_speed_ratios(records, ["base", "slower", "noisy"], "base")
    slower, noisy = relative["overall"]["slower"], relative["overall"]["noisy"]
    assert slower["high"] < 1.0 and 0.85 < slower["ratio"] < 0.95  # 10% slower: below 1 beyond the noise
    assert noisy["low"] < 1.0 < noisy["high"]  # 8% noise around 1: not shown slower
    assert noisy["questions"] == 12 and relative["categories"]["b"]["noisy"]["questions"] == 6  # pairs only
    assert slower["high"] - slower["low"] < noisy["high"] - noisy["low"]
    for group in ("a", "b"):
        cell = relative["categories"][group]["slower"]
        assert cell["low"] <= cell["ratio"] <= cell["high"]
    table = relative_table(relative)
    assert "**0." in table.splitlines()[2] and "**" not in table.splitlines()[3]  # only the slower row is bold
    assert paired_speed_ratios(records, ["base", "slower", "noisy"], "base") == relative  # seeded


def test_reference_is_one_and_greedy_methods_are_exact(bench_run):
    _, summary = bench_run
    for group in [summary["overall"], *summary["categories"].values()]:
        assert group["hf_generate"]["speedup"] == 1.0
        assert group["hf_generate"]["mean_accepted"] == 1.0
        assert group["hf_generate"]["exact_rate"] == 1.0
        assert group["prompt_lookup"]["exact_rate"] == 1.0  # greedy speculation is lossless
        assert group["vanilla"]["exact_rate"] == 1.0
        assert group["vanilla"]["speedup_vs_vanilla"] == 1.0 and group["vanilla"]["mean_accepted"] == 1.0
        assert group["prompt_lookup"]["speedup_vs_vanilla"] == pytest.approx(
            group["prompt_lookup"]["tok_s"] / group["vanilla"]["tok_s"])
        assert group["hf_pld"]["exact_rate"] == 1.0
        assert group["prompt_lookup"]["same_as_vanilla_rate"] == 1.0 and group["vanilla"]["same_as_vanilla_rate"] == 1.0
        assert group["prompt_lookup"]["mean_accepted"] >= 1.0
    assert summary["overall"]["prompt_lookup"]["mean_accepted"] > 1.0  # some drafts were accepted
    assert summary["overall"]["hf_pld"]["mean_accepted"] > 1.0


def test_answers_are_in_spec_bench_format(bench_run):
    out, _ = bench_run
    for method in METHODS:
        lines = [json.loads(line) for line in (out / "answers" / f"{method}.jsonl").read_text().splitlines()]
        assert [line["question_id"] for line in lines] == [1, 2, 3, 4]
        for line, question in zip(lines, QUESTIONS):
            assert {"question_id", "category", "model_id", "choices"} <= set(line)
            assert line["category"] == question["category"]
            (choice,) = line["choices"]
            assert {"index", "turns", "new_tokens", "wall_time", "decoding_steps", "accept_lengths"} <= set(choice)
            turns = len(question["turns"])
            assert len(choice["turns"]) == len(choice["new_tokens"]) == len(choice["wall_time"]) == turns
            assert all(isinstance(text, str) for text in choice["turns"])
            assert len(choice["accept_lengths"]) == sum(choice["decoding_steps"])
            assert sum(choice["accept_lengths"]) == sum(choice["new_tokens"])
            assert all(0 < n <= 8 for n in choice["new_tokens"])


def test_results_parquet_has_one_row_per_prompt_and_method(bench_run):
    out, _ = bench_run
    frame = pd.read_parquet(out / "results.parquet")
    assert len(frame) == len(QUESTIONS) * len(METHODS)
    assert set(frame["method"]) == METHODS
    two_turns = frame[frame["question_id"] == 1]
    assert (two_turns["turns"] == 2).all()
    for row in frame.itertuples():
        assert sum(row.accept_lengths) == row.new_tokens
        assert len(row.accept_lengths) == row.forwards
    assert (frame.loc[frame["method"] == "hf_generate", "mean_accepted"] == 1.0).all()


def test_markdown_summary_and_plot_are_written(bench_run):
    out, _ = bench_run
    text = (out / "summary.md").read_text()
    for needle in ["| method | chat | qa | overall |", "hf_pld", "prompt_lookup", "torch", "dtype: fp32"]:
        assert needle in text
    assert (out / "speedup.png").read_bytes()[:4] == b"\x89PNG"


def test_the_report_says_how_busy_other_processes_kept_the_cpus(bench_run):
    """Timings taken while another job competed are that job's as much as the method's: the report says so."""
    out, summary = bench_run
    machine = summary["meta"]["machine"]
    if not Path("/proc/stat").is_file():
        assert machine["other_processes_cpus"] is None
        return
    assert 0.0 <= machine["other_processes_cpus"] <= machine["cpus"] + 0.5
    assert f"other processes kept {machine['other_processes_cpus']:.2f} of the {machine['cpus']} CPUs busy" \
        in (out / "summary.md").read_text()


def test_each_turn_carries_the_methods_own_previous_answer():
    class StubPipeline:
        def __init__(self):
            self.seen = []

        def prepare(self, messages):
            self.seen.append([dict(m) for m in messages])
            return PreparedPrompt([5, 6, 7])

        def decode_text(self, tokens):
            return "answer " + " ".join(map(str, tokens))

    pipeline = StubPipeline()
    question = Question(9, "chat", ("first?", "second?"))
    run = run_question(pipeline, "m", lambda prompt, n: TurnOutput([1, 2], 0.5, 2, [1, 1]), question, 8)
    assert pipeline.seen[1] == [{"role": "user", "content": "first?"},
                                {"role": "assistant", "content": "answer 1 2"},
                                {"role": "user", "content": "second?"}]
    assert run.new_tokens == 4 and run.forwards == 4 and run.texts == ["answer 1 2"] * 2


def test_per_category_takes_the_first_questions_of_each_category(prompts_file):
    questions = read_questions(prompts_file)
    assert [q.question_id for q in select_questions(questions, 1)] == [1, 3]
    assert [q.question_id for q in select_questions(questions, 5, ["qa"])] == [3, 4]
    # categories take turns, so that a run stopped by its time limit has measured each about equally
    assert [q.question_id for q in select_questions(questions, 2)] == [1, 3, 2, 4]


def test_malformed_jsonl_line_is_reported_with_its_line_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(QUESTIONS[0]) + "\n{not json\n")
    with pytest.raises(InvalidRequest, match=r"bad.jsonl, line 2: not valid JSON"):
        run_bench(compose_config(tiny_overrides(path, f"bench.out={tmp_path}")))
    path.write_text(json.dumps(QUESTIONS[0]) + "\n\n" + json.dumps({"question_id": 2, "turns": ["x"]}) + "\n")
    with pytest.raises(InvalidRequest, match=r"line 3: missing category"):
        read_questions(path)


@pytest.mark.parametrize("overrides, error, message", [
    (["bench.prompts=/nonexistent/questions.jsonl"], InvalidRequest, "no such file"),
    (["bench.per_category=0"], InvalidRequest, "per_category must be a positive integer"),
    (["bench.categories=[chat,poetry]"], InvalidRequest, "unknown category 'poetry'"),
    (["model.dtype=bf16"], ConfigError, "bench.dtype=bf16"),
    (["bench.compare=[no_such_pipeline]"], ConfigError, "no_such_pipeline"),
    (["bench.compare=[vanilla]"], InvalidRequest, "'vanilla' is already a method of this run"),
    (["pipeline=prompt_lookup", "bench.compare=[prompt_lookup]"], InvalidRequest, "'prompt_lookup' is already"),
    (["bench.compare=[[prompt_lookup]]"], InvalidRequest, "bench.compare must list pipelines"),
    (["bench.time_limit_s=0"], InvalidRequest, "time_limit_s must be a positive number of seconds or null"),
    (["bench.time_limit_s=soon"], InvalidRequest, "time_limit_s must be a positive number of seconds or null"),
    (["bench.relative_to=beam"], InvalidRequest, "relative_to='beam' is not a method of this run; its methods are"),
    (["bench.relative_to=[vanilla]"], InvalidRequest, "bench.relative_to must name one method"),
])
def test_bad_settings_stop_with_a_clear_error(prompts_file, tmp_path, overrides, error, message):
    cfg = compose_config(tiny_overrides(prompts_file, f"bench.out={tmp_path}", *overrides))
    with pytest.raises(error, match=message):
        run_bench(cfg)


def test_methods_can_be_restricted_and_without_the_reference_ratios_are_null(prompts_file, tmp_path):
    cfg = compose_config(tiny_overrides(prompts_file, "pipeline=vanilla", "bench.methods=[pipeline]",
                                        "bench.per_category=1", "bench.max_new_tokens=2", "bench.warmup=0",
                                        f"bench.out={tmp_path}"))
    summary = run_bench(cfg)
    (metrics,) = summary["overall"].values()
    assert list(summary["overall"]) == ["vanilla"]
    assert metrics["speedup"] is None and metrics["exact_rate"] is None and metrics["mean_accepted"] == 1.0
    assert (tmp_path / "answers" / "vanilla.jsonl").is_file() and (tmp_path / "speedup.png").is_file()
    with pytest.raises(InvalidRequest, match="unknown method 'beam'"):
        run_bench(compose_config(tiny_overrides(prompts_file, "bench.methods=[beam]", f"bench.out={tmp_path}")))


def test_an_empty_prompts_file_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(InvalidRequest, match="holds no questions"):
        run_bench(compose_config(tiny_overrides(path, f"bench.out={tmp_path}")))


def test_bench_dtype_sets_the_model_dtype(prompts_file):
    cfg = compose_config(tiny_overrides(prompts_file, "bench.dtype=bf16"))
    assert cfg.model.dtype == "bf16"
    assert compose_config(tiny_overrides(prompts_file)).model.dtype == "fp32"


@pytest.mark.parametrize("launcher", [[], ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]], ids=["basic", "joblib"])
def test_multirun_merges_the_jobs_into_one_table_and_plot(prompts_file, tmp_path, launcher):
    """The sweep's jobs in this process one after another, or in parallel worker processes (joblib)."""
    sweep = tmp_path / "sweep"
    command = [sys.executable, "run.py", "-m", *launcher, *tiny_overrides(prompts_file), "pipeline=vanilla,prompt_lookup",
               "bench.per_category=1", "bench.max_new_tokens=4", "bench.warmup=0", f"hydra.sweep.dir={sweep}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    merged = json.loads((sweep / "summary.json").read_text())
    rows = {"pipeline=vanilla / hf_generate", "pipeline=vanilla / hf_pld", "pipeline=vanilla / vanilla",
            "pipeline=prompt_lookup / hf_generate", "pipeline=prompt_lookup / hf_pld",
            "pipeline=prompt_lookup / vanilla", "pipeline=prompt_lookup / prompt_lookup"}
    assert set(merged["overall"]) == rows
    assert set(merged["categories"]) == {"chat", "qa"}
    assert [job["pipeline"] for job in merged["jobs"]] == ["vanilla", "prompt_lookup"]
    assert merged["overall"]["pipeline=vanilla / vanilla"]["exact_rate"] == 1.0
    table = (sweep / "summary.md").read_text()
    assert "pipeline=prompt_lookup / prompt_lookup" in table
    assert (sweep / "speedup.png").read_bytes()[:4] == b"\x89PNG"


def test_hf_methods_run_transformers_forward_when_the_engine_rewrites_the_model(prompts_file, tiny_mixed, tmp_path):
    """hf_generate is the reference only if it runs the stock model, not the one engine=fast rewrote."""
    from specpipe.tasks.bench_methods import make_methods
    from specpipe.pipelines.builder import build_pipeline

    cfg = compose_config(tiny_overrides(prompts_file, "engine=fast", f"bench.out={tmp_path}"))
    pipeline = build_pipeline(cfg, loaded=tiny_mixed.loaded)
    assert pipeline.target.engine == "fast"
    methods = make_methods(["hf_generate", "hf_pld", "vanilla", "pipeline"], pipeline, 10, tiny_mixed.reference)
    assert methods["hf_generate"].model is tiny_mixed.reference and methods["hf_pld"].model is tiny_mixed.reference
    assert not any("OneDNN" in type(m).__name__ for m in tiny_mixed.reference.modules())
    assert methods["vanilla"].pipeline.target is pipeline.target and not methods["vanilla"].pipeline.decoder.proposers
    with pytest.raises(ValueError, match="needs hf_model="):
        run_bench(cfg, loaded=tiny_mixed.loaded)


# ---- mt_bench grouping ------------------------------------------------------------------------
MT_QUESTIONS = [
    {"question_id": 11, "category": "writing", "turns": ["Write a short poem about rain."]},
    {"question_id": 12, "category": "writing", "turns": ["Write a limerick about a cat."]},
    {"question_id": 13, "category": "writing", "turns": ["Write a toast for a wedding."]},
    {"question_id": 21, "category": "roleplay", "turns": ["Pretend you are a pirate. Greet me."]},
    {"question_id": 22, "category": "roleplay", "turns": ["Act as a tour guide in Rome."]},
    {"question_id": 31, "category": "qa", "turns": ["What is the capital of Spain?"]},
    {"question_id": 32, "category": "qa", "turns": ["Who wrote Hamlet?"]},
    {"question_id": 33, "category": "qa", "turns": ["How many legs has a spider?"]},
]


@pytest.fixture(scope="module")
def grouped_run(tmp_path_factory, tiny_mixed) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("grouped")
    prompts = folder / "questions.jsonl"
    prompts.write_text("".join(json.dumps(q) + "\n" for q in MT_QUESTIONS))
    cfg = compose_config(tiny_overrides(prompts, "pipeline=prompt_lookup", "bench.per_category=2",
                                        "bench.methods=[hf_generate,vanilla,pipeline]", "bench.max_new_tokens=4",
                                        "bench.warmup=0", f"bench.out={folder / 'out'}"))
    return folder / "out", run_bench(cfg, loaded=tiny_mixed.loaded, hf_model=tiny_mixed.reference)


def test_mt_bench_categories_are_reported_as_one_and_selected_per_original_category(grouped_run):
    out, summary = grouped_run
    assert list(summary["categories"]) == ["mt_bench", "qa"]
    for method in ("hf_generate", "vanilla", "prompt_lookup"):
        # per_category=2 counts writing and roleplay separately: 2 + 2 in mt_bench, 2 in qa
        assert summary["categories"]["mt_bench"][method]["prompts"] == 4
        assert summary["categories"]["qa"][method]["prompts"] == 2
        assert summary["overall"][method]["prompts"] == 6
    assert summary["meta"]["group_categories"]["humanities"] == "mt_bench"
    frame = pd.read_parquet(out / "results.parquet")
    assert sorted(set(frame["question_id"])) == [11, 12, 21, 22, 31, 32]
    by_question = frame.drop_duplicates("question_id").set_index("question_id")
    assert by_question.loc[11, "category"] == "writing" and by_question.loc[21, "category"] == "roleplay"
    assert set(by_question["group"]) == {"mt_bench", "qa"} and by_question.loc[31, "group"] == "qa"
    text = (out / "summary.md").read_text()
    assert "| method | mt_bench | qa | overall |" in text and "`mt_bench` reports the categories writing" in text


def test_group_categories_setting_is_checked():
    from specpipe.tasks.bench_questions import DEFAULT_GROUPS
    from specpipe.tasks.bench_settings import read_groups

    assert set(DEFAULT_GROUPS) == {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                                   "humanities"} and set(DEFAULT_GROUPS.values()) == {"mt_bench"}
    assert compose_config(["task=bench", "model=tiny_random"]).bench.group_categories == DEFAULT_GROUPS
    assert read_groups(None) == {}
    with pytest.raises(InvalidRequest, match="group_categories must map"):
        read_groups(["writing"])


# ---- tokens by source -------------------------------------------------------------------------
def check_source_shares(summary: dict, method: str, sources: set[str]) -> None:
    """Every group: the method's per-source shares plus its bonus share make 1; vanilla's tokens
    are all its own; the HF methods cannot tell (null)."""
    for group in [summary["overall"], *summary["categories"].values()]:
        shares = group[method]["drafted_by_source"]
        assert set(shares) == sources
        assert sum(shares.values()) + group[method]["bonus_share"] == pytest.approx(1.0, abs=1e-9)
        assert 0.0 < group[method]["bonus_share"] <= 1.0
        assert group["vanilla"]["drafted_by_source"] == {} and group["vanilla"]["bonus_share"] == 1.0
        assert group["hf_generate"]["drafted_by_source"] is None and group["hf_generate"]["bonus_share"] is None


def check_drafted_counts(frame: pd.DataFrame, method: str) -> None:
    """Per prompt, the per-source counts sum to the steps' drafted tokens, and the rest (bonus tokens)
    is one per target forward but for a final step cut by the stop condition in each turn."""
    for row in frame[frame["method"] == method].itertuples():
        assert sum(count for _, count in row.drafted_by_source) == row.drafted
        assert row.forwards - row.turns <= row.new_tokens - row.drafted <= row.forwards


def test_prompt_lookup_reports_the_share_of_tokens_from_its_proposer(bench_run):
    out, summary = bench_run
    check_source_shares(summary, "prompt_lookup", {"prompt_ngram"})
    assert summary["overall"]["prompt_lookup"]["drafted_by_source"]["prompt_ngram"] > 0  # drafts were accepted
    check_drafted_counts(pd.read_parquet(out / "results.parquet"), "prompt_lookup")
    text = (out / "summary.md").read_text()
    assert "## Tokens by source" in text and "| prompt_lookup | prompt_ngram 0." in text


def test_warm_up_answers_do_not_enter_the_store_of_past_outputs(tiny_mixed, prompts_file):
    from specpipe.tasks.bench_methods import make_methods
    from specpipe.tasks.bench_run import run_methods

    from specpipe.tasks.bench_methods import PipelineDecode

    pipeline = tiny_mixed.pipeline("lookahead_trie", "+retriever@pipeline.proposers.past=past_outputs", fresh=True)
    compared = tiny_mixed.pipeline("prompt_lookup", "+retriever@pipeline.proposers.past=past_outputs", fresh=True)
    stores = [p for pipe in (pipeline, compared) for p in pipe.decoder.proposers if p.name == "past_outputs"]
    questions = read_questions(prompts_file)
    methods = make_methods(["pipeline"], pipeline, 10) | {"prompt_lookup": PipelineDecode(compared)}  # bench.compare's
    run_methods(pipeline, methods, questions, 4, warmup=2, progress=False)
    for past in stores:
        assert len(past.store) == sum(len(q.turns) for q in questions)  # the counted answers, not the warm-up's
        assert past.learn is True


# ---- RAG: every method on the same augmented prompt --------------------------------------------
RAG_TEXT = """The with statement wraps the execution of a block with methods defined by a context manager. \
The context manager's __enter__() method is invoked before the block and its __exit__() method after it, \
even when the block raises an exception.

A list is a mutable sequence; a tuple is an immutable sequence. Lists are written with square brackets \
and tuples with parentheses.

The yield statement turns a function into a generator function: calling it returns a generator iterator \
whose __next__() method runs the body until the next yield.

Dictionaries map hashable keys to values. The get() method returns a default instead of raising KeyError \
when the key is missing.
"""
RAG_QUESTIONS = [
    {"question_id": 1, "category": "rag", "turns": ["What does the with statement call?", "And what does yield do?"]},
    {"question_id": 2, "category": "rag", "turns": ["How do I get a default value from a dict?"]},
    {"question_id": 3, "category": "rag", "turns": ["What does the with statement call?"]},  # asked again
]


@pytest.fixture(scope="module")
def rag_run(tmp_path_factory, tiny_mixed):
    """rag_lookahead over a small document store. Its n-gram proposer drafts one token only, so the
    deeper nodes come from the store of past outputs (question 3 repeats question 1): both sources
    get accepted tokens."""
    from specpipe.pipelines.builder import build_pipeline
    from specpipe.stores.document_store import DocumentStoreBuilder

    folder = tmp_path_factory.mktemp("rag_bench")
    (folder / "python.txt").write_text(RAG_TEXT)
    DocumentStoreBuilder(sources=[str(folder / "python.txt")], out=str(folder / "store"), unit="chars",
                         chunk_size=300, overlap=0, progress=False).build()
    prompts = folder / "questions.jsonl"
    prompts.write_text("".join(json.dumps(q) + "\n" for q in RAG_QUESTIONS))
    # without the token datastore (the tiny model's answers are nothing like the chat corpus): two sources
    cfg = compose_config(tiny_overrides(prompts, "pipeline=rag_lookahead", "~pipeline.proposers.rest",
                                        f"pipeline.augment.path={folder / 'store'}",
                                        "pipeline.proposers.ngram.max_length=1", "bench.max_new_tokens=16",
                                        "bench.compare=[prompt_lookup,lookahead_trie]", f"bench.out={folder / 'out'}"))
    summary = run_bench(cfg, loaded=tiny_mixed.loaded, hf_model=tiny_mixed.reference)
    return folder / "out", summary, build_pipeline(cfg, loaded=tiny_mixed.loaded)


def test_rag_methods_all_run_on_the_same_augmented_prompt(rag_run):
    out, summary, pipeline = rag_run
    frame = pd.read_parquet(out / "results.parquet")
    # bench.compare's pipelines ran as methods of their own, on the same target and augmented prompts
    assert set(frame["method"]) == {"hf_generate", "hf_pld", "vanilla", "rag_lookahead", "prompt_lookup",
                                    "lookahead_trie"}
    assert summary["meta"]["methods"][-2:] == ["prompt_lookup", "lookahead_trie"]
    for question in RAG_QUESTIONS:
        rows = frame[frame["question_id"] == question["question_id"]]
        first_turns = {tuple(row.prompt_ids[0]) for row in rows.itertuples()}
        assert len(first_turns) == 1  # every method (the compared pipelines too) saw the same ids
        (prompt,) = first_turns
        plain = pipeline.encode([{"role": "user", "content": question["turns"][0]}])
        assert len(prompt) > len(plain) + 20  # the chunks went into it
        text = pipeline.tokenizer.decode(list(prompt))
        assert f"Question: {question['turns'][0]}" in text and "documentation excerpts" in text
        assert pipeline.retrieve(question["turns"][0])[0].text.strip()[:40] in text  # the best chunk
        for row in rows.itertuples():
            assert list(row.prompt_tokens_per_turn) == [len(ids) for ids in row.prompt_ids]
            assert len(row.retrieved) == len(question["turns"])
            for turn, chunks in zip(question["turns"], row.retrieved):  # each turn retrieves with its question
                expected = pipeline.retrieve(turn)
                assert [c["chunk_id"] for c in chunks] == [c.chunk_id for c in expected]
                assert [c["score"] for c in chunks] == pytest.approx([c.score for c in expected])
                assert all(c["title"] == "python" for c in chunks)
    # hf_generate answered the augmented prompt too, or the lossless pipeline would not match it
    assert all(metrics["exact_rate"] == 1.0 for metrics in summary["overall"].values())
    assert summary["meta"]["augmented"] is True
    answers = [json.loads(line) for line in (out / "answers" / "hf_generate.jsonl").read_text().splitlines()]
    assert [len(a["retrieved"]) for a in answers] == [2, 1, 1] and answers[0]["retrieved"][0][0]["title"] == "python"
    assert "RAG: every method ran on the same augmented prompt" in (out / "summary.md").read_text()


def test_a_pipeline_with_two_proposers_reports_both_sources(rag_run):
    out, summary, _ = rag_run
    check_source_shares(summary, "rag_lookahead", {"ngram_trie", "past_outputs"})
    shares = summary["overall"]["rag_lookahead"]["drafted_by_source"]
    assert shares["ngram_trie"] > 0 and shares["past_outputs"] > 0
    check_drafted_counts(pd.read_parquet(out / "results.parquet"), "rag_lookahead")
    assert "ngram_trie 0." in (out / "summary.md").read_text()


# ---- stopping early: a time limit, Ctrl-C or SIGTERM keep the questions every method finished ----------
def test_a_time_limit_reports_the_questions_every_method_finished(prompts_file, tmp_path):
    cfg = compose_config(tiny_overrides(prompts_file, "pipeline=prompt_lookup", "bench.per_category=2",
                                        "bench.max_new_tokens=2", "bench.warmup=0", "bench.time_limit_s=1e-9",
                                        f"bench.out={tmp_path}"))
    summary = run_bench(cfg)
    meta = summary["meta"]
    assert meta["questions"] == 1 and meta["questions_selected"] == 4  # the first question always runs
    assert meta["stopped"].startswith("bench.time_limit_s=1e-09: stopped after 1 of 4 questions")
    results = pd.read_parquet(tmp_path / "results.parquet")
    assert sorted(results["method"]) == sorted(METHODS) and set(results["question_id"]) == {1}
    assert "**stopped early** (bench.time_limit_s=1e-09" in (tmp_path / "summary.md").read_text()
    unlimited = run_bench(compose_config(tiny_overrides(
        prompts_file, "pipeline=prompt_lookup", "bench.per_category=2", "bench.max_new_tokens=2", "bench.warmup=0",
        "bench.time_limit_s=3600", f"bench.out={tmp_path / 'all'}")))
    assert unlimited["meta"]["questions"] == 4 and unlimited["meta"]["stopped"] is None


def test_an_interrupt_keeps_only_the_questions_every_method_finished(tiny_mixed, prompts_file):
    from specpipe.tasks.bench_methods import make_methods
    from specpipe.tasks.bench_run import run_methods

    pipeline = tiny_mixed.pipeline("prompt_lookup")
    questions = read_questions(prompts_file)
    calls = []

    def interrupted_on(call: int):
        plain = make_methods(["vanilla"], pipeline, 10)["vanilla"]

        def method(prompt, max_new_tokens):
            calls.append(1)
            if len(calls) == call:
                raise KeyboardInterrupt
            return plain(prompt, max_new_tokens)
        return method

    # Only the flaky method counts its calls: question 1's two turns are calls 1-2, question 2 is call 3,
    # after the pipeline has already answered question 2.
    methods = make_methods(["pipeline"], pipeline, 10) | {"flaky": interrupted_on(3)}
    measured = run_methods(pipeline, methods, questions, 2, warmup=0, progress=False)
    assert measured.stopped == "interrupted: stopped after 1 of 4 questions"
    assert [(run.question.question_id, run.method) for run in measured.runs] == [(1, "prompt_lookup"), (1, "flaky")]
    calls.clear()
    methods["flaky"] = interrupted_on(2)  # within the first question: nothing to report, so it propagates
    with pytest.raises(KeyboardInterrupt):
        run_methods(pipeline, methods, questions, 2, warmup=0, progress=False)


def test_sigterm_interrupts_the_benchmark_like_ctrl_c_and_only_while_it_runs():
    import os
    import signal

    from specpipe.tasks.bench_run import stop_signals_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), stop_signals_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()  # not reached: the handler raises first
    assert signal.getsignal(signal.SIGTERM) is before


class _LlamaServerStandIn:
    """An HTTP server answering /health and /completion as llama-server does (its JSON fields), recording requests:
    what the llama_cpp method sends and reads, without llama.cpp on the machine."""

    def __init__(self, answer: list[int]) -> None:
        import http.server
        import threading

        self.requests: list[dict] = []
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self._reply({"status": "ok"} if self.path == "/health" else {"error": "not found"},
                            200 if self.path == "/health" else 404)

            def do_POST(self):
                stand_in.requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self._reply({"content": "...", "tokens": answer, "stop": True, "tokens_predicted": len(answer)}, 200)

            def _reply(self, body: dict, status: int) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_llama_cpp_method_asks_llama_server_for_greedy_tokens_of_the_same_ids():
    from specpipe.tasks.bench_methods import LlamaCppServer

    stand_in = _LlamaServerStandIn([11, 12, 13])
    try:
        method = LlamaCppServer(stand_in.url + "/")
        out = method(PreparedPrompt([1, 2, 3, 4]), 16)
    finally:
        stand_in.close()
    assert out.tokens == [11, 12, 13] and out.forwards == 4 and out.accept_lengths == [1, 1, 1] and out.seconds > 0
    (request,) = stand_in.requests
    assert request["prompt"] == [1, 2, 3, 4] and request["n_predict"] == 16
    assert request["temperature"] == 0 and request["top_k"] == 1 and request["cache_prompt"] is False


def test_the_llama_cpp_method_needs_a_running_server():
    from specpipe.tasks.bench_methods import LlamaCppServer

    with pytest.raises(InvalidRequest, match="bench.llama_cpp_url=http://HOST:PORT"):
        LlamaCppServer(None)
    stand_in = _LlamaServerStandIn([])
    url = stand_in.url
    stand_in.close()
    with pytest.raises(InvalidRequest, match="no llama-server answers there"):
        LlamaCppServer(url)
