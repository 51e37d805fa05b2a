"""`task=generate` (what `make demo` runs): the answer, then with `task.compare_plain` the same prompt decoded
without speculation, the speed-up and whether the two answers are the same."""
from __future__ import annotations

import io
import re

from specpipe.pipelines.builder import compose_config
from specpipe.pipelines.pipeline import Pipeline
from specpipe.tasks import generate

BASE = ["model=tiny_random", "pipeline=prompt_lookup", "cost_curve=flat", "chat_template=false",
        "prompt=one two three one two three one two three", "max_new_tokens=12"]


def test_compare_plain_decodes_the_prompt_again_without_drafts_and_reports_the_same_answer(monkeypatch):
    plain_runs = []
    without_drafting = Pipeline.without_drafting

    def recording(self, name="vanilla"):
        plain = without_drafting(self, name)
        plain_runs.append(plain)
        return plain

    monkeypatch.setattr(Pipeline, "without_drafting", recording)
    out = io.StringIO()
    stats = generate.run_generate(compose_config([*BASE, "task.compare_plain=true"]), out=out)
    text = out.getvalue()
    assert len(plain_runs) == 1 and plain_runs[0].decoder.proposers == [] and plain_runs[0].decoder.drafters == []
    assert stats.mean_accepted > 1.0  # the repeated prompt is drafted from, so the comparison compares something
    line = next(line for line in text.splitlines() if line.startswith("speculation:"))
    assert re.search(r"\d+\.\d\dx plain decoding, \d+\.\d\d tokens per target forward; the same answer: yes$", line)
    assert "[plain] 12 tokens at" in text


def test_compare_plain_says_so_when_the_answers_differ(monkeypatch):
    """The comparison reads the two answers' tokens: a plain answer that differs is reported, not hidden."""
    generate_plain = Pipeline.generate

    def different(self, *args, **kwargs):
        result = generate_plain(self, *args, **kwargs)
        if self.name == "vanilla":
            result.token_ids = [*result.token_ids[:-1], result.token_ids[-1] + 1]
        return result

    monkeypatch.setattr(Pipeline, "generate", different)
    out = io.StringIO()
    generate.run_generate(compose_config([*BASE, "task.compare_plain=true"]), out=out)
    assert "the same answer: NO" in out.getvalue()


def test_without_compare_plain_nothing_is_decoded_twice(monkeypatch):
    monkeypatch.setattr(Pipeline, "without_drafting", lambda *a, **k: (_ for _ in ()).throw(AssertionError("called")))
    out = io.StringIO()
    generate.run_generate(compose_config(BASE), out=out)
    assert "speculation:" not in out.getvalue()
