"""`task=bench_load` end to end on the tiny model: its report's shape and what it counts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpipe.errors import InvalidRequest
from specpipe.pipelines.builder import compose_config
from specpipe.tasks.bench_load import RequestRecord, _quantile, level_metrics, run_bench_load

QUESTIONS = [
    {"question_id": 1, "category": "chat", "turns": ["Write a haiku about the sea."]},
    {"question_id": 2, "category": "chat", "turns": ["Name three colors."]},
    {"question_id": 3, "category": "qa", "turns": ["Repeat: the cat sat on the mat, the cat sat on the mat."]},
]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "questions.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def test_bench_load_reports_every_level_and_method(prompts_file, tmp_path, tiny_mixed):
    cfg = compose_config(["task=bench_load", "model=tiny_random", "cost_curve=flat", "pipeline=prompt_lookup",
                          f"bench_load.prompts={prompts_file}", "bench_load.per_category=2",
                          "bench_load.max_new_tokens=12", "bench_load.concurrency=[1,3]", "bench_load.warmup=1",
                          "bench_load.compare=[lookahead_trie]", "bench_load.rounds=2", f"bench_load.out={tmp_path}"])
    summary = run_bench_load(cfg, loaded=tiny_mixed.loaded)
    assert json.loads((tmp_path / "summary.json").read_text())["levels"] == json.loads(json.dumps(summary["levels"]))
    assert (tmp_path / "summary.md").is_file() and (tmp_path / "load.png").stat().st_size > 1000
    rows = summary["levels"]
    assert {(row["method"], row["clients"]) for row in rows} == {
        (method, clients) for method in ("prompt_lookup", "vanilla", "lookahead_trie") for clients in (1, 3)}
    for row in rows:
        assert row["requests"] == 2 * max(3, 2 * row["clients"])  # one per prompt, at least two per client, 2 rounds
        assert len(row["round_tok_s"]) == 2
        assert 0 < row["tokens"] <= 12 * row["requests"]
        assert row["ttft_p50_ms"] <= row["ttft_p90_ms"]
        assert row["batch_size"] <= row["clients"]
        if row["method"] == "vanilla":
            assert row["rows_per_request"] == 1.0 and row["mean_accepted"] == pytest.approx(1.0)
            assert row["vs_batched_vanilla"] == 1.0
    three = [row for row in rows if row["clients"] == 3]
    assert max(row["batch_size"] for row in three) > 1.0  # three clients were decoded together
    assert "| 3 | `vanilla` |" in (tmp_path / "summary.md").read_text()


def test_level_metrics_count_what_the_requests_did():
    records = [RequestRecord(0.0, 0.1, 1.0, 10, 4, [2, 3, 1, 1], [2, 2, 1, 1]),
               RequestRecord(0.5, 0.7, 2.5, 21, 5, [1] * 5, [2] * 5)]
    metrics = level_metrics(records, wall_seconds=2.5)
    assert metrics["throughput_tok_s"] == pytest.approx(31 / 2.5)
    assert metrics["request_tok_s"] == pytest.approx((10 / 1.0 + 21 / 2.0) / 2)
    assert metrics["ttft_p50_ms"] == pytest.approx(150.0) and metrics["ttft_p90_ms"] == pytest.approx(190.0)
    assert metrics["mean_accepted"] == pytest.approx((31 - 2) / 9)
    assert metrics["rows_per_request"] == pytest.approx(12 / 9)
    assert _quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5


@pytest.mark.parametrize("override,match", [("bench_load.concurrency=[0]", "concurrency"),
                                            ("bench_load.rates=[-1]", "rates"),
                                            ("bench_load.max_new_tokens=0", "max_new_tokens")])
def test_bad_settings_are_refused_before_any_work(prompts_file, tmp_path, override, match):
    cfg = compose_config(["task=bench_load", "model=tiny_random", f"bench_load.prompts={prompts_file}",
                          f"bench_load.out={tmp_path}", override])
    with pytest.raises(InvalidRequest, match=match):
        run_bench_load(cfg)
