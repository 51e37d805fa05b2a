"""The prompt source of the self-distilled chat corpus: several thousand varied chat prompts, built offline
and deterministically (seeded) by the builders of `specpipe.distill.builders` (hand-written task
templates x subjects in the eight MT-bench categories plus everyday advice, Python's documentation and
stdlib docstrings) and the problem makers of `specpipe.distill.problems` (parametric math and reasoning,
extraction over synthetic documents, situated requests), `SOURCE_COUNTS` of each, and without any prompt
that is an exact or near duplicate of a dev prompt (`specpipe.distill.dev_overlap`): no benchmark prompt
enters, so the corpus never trains on what the benchmarks measure. The result depends only on the seed,
the Python version (docs and stdlib text) and the dev files; a prompt's id is a hash of its text, so
resuming a generation run keys on content, not position.
"""
from __future__ import annotations

import hashlib
import json
import random
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specpipe.distill.builders import (Builder, asked_as_they_are, coding, product_of, pydoc, repeat,
                                       roleplay_situations, stdlib_docstrings)
from specpipe.distill.dev_overlap import dev_prompt_files, find_overlaps, load_dev_turns, normalise
from specpipe.paths import display_path
from specpipe.distill.problems import extraction_task, math_problem, reasoning_problem, situated_request
from specpipe.distill.subjects import PromptData, load_prompt_data

DEFAULT_SEED = 20240611

# How many prompts each builder contributes (fewer where its pool is smaller).
SOURCE_COUNTS: dict[str, int] = {
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
# A larger count extends a builder's seeded draw (its first prompts stay the same; tests/test_distill_corpus.py
# checks that a smaller source is a subset). The `*_2` builders draw the second generation of their subjects;
# the `*_situated` builders draw requests that carry the asker's situation (`specpipe.distill.requests`).
# New data items come with a generation and a builder of their own (specpipe/distill/data/README.md).


@dataclass(frozen=True)
class ChatPrompt:
    prompt_id: str  # first 16 hex digits of the SHA-1 of `text` (of a second turn: see follow_up_prompts)
    category: str   # one of the MT-bench categories, or "advice"
    source: str     # which builder made it (a SOURCE_COUNTS key, or "follow_up")
    text: str
    # The conversation before `text`: user and assistant turns alternating, ending with an answer
    # (empty for a first turn).
    history: tuple[str, ...] = ()


def prompt_id(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


# Each source's category and builder: a SOURCE_COUNTS key names one.
BUILDERS: dict[str, tuple[str, Builder]] = {
    "writing": ("writing", product_of("writing.templates", "writing.subjects")),
    "review": ("writing", product_of("review.templates", "review.subjects")),
    "email": ("writing", product_of("email.templates", "email.subjects")),
    "advice": ("advice", product_of("advice.templates", "advice.topics")),
    "roleplay": ("roleplay", product_of("roleplay.templates", "roleplay.personas")),
    "roleplay_situation": ("roleplay", roleplay_situations(gen=1)),
    "coding": ("coding", coding),
    "coding_concept": ("coding", product_of("coding_concept.templates", "coding_concept.concepts")),
    "sql": ("coding", product_of("sql.templates", "sql.tasks")),
    "stem": ("stem", product_of("stem.templates", "stem.concepts")),
    "stem_compare": ("stem", product_of("stem_compare.templates", "stem_compare.pairs")),
    "humanities": ("humanities", product_of("humanities.templates", "humanities.topics")),
    "humanities_question": ("humanities", asked_as_they_are("humanities_question.questions")),
    "math": ("math", repeat(math_problem)),
    "reasoning": ("reasoning", repeat(reasoning_problem)),
    "extraction": ("extraction", repeat(extraction_task)),
    "pydoc": ("coding", pydoc),
    "stdlib_module": ("coding", stdlib_docstrings("module")),
    "stdlib_function": ("coding", stdlib_docstrings("function")),
    "writing_2": ("writing", product_of("writing.templates", "writing.subjects", gen=2)),
    "roleplay_2": ("roleplay", product_of("roleplay.templates", "roleplay.personas", gen=2)),
    "roleplay_situation_2": ("roleplay", roleplay_situations(gen=2)),
    "stem_2": ("stem", product_of("stem.templates", "stem.concepts", gen=2)),
    "humanities_2": ("humanities", product_of("humanities.templates", "humanities.topics", gen=2)),
    "advice_2": ("advice", product_of("advice.templates", "advice.topics", gen=2)),
    **{f"{category}_situated": (category, repeat(situated_request(category)))
       for category in load_prompt_data().by_category("situated")},
}


@dataclass(frozen=True)
class PromptSource:
    """The prompts in generation order, and what was dropped to keep them off the dev sets."""

    prompts: list[ChatPrompt]
    dropped: list[tuple[str, str, str]]  # (prompt, dev turn, reason)
    dev_files: list[str]
    seed: int

    def describe(self) -> dict:
        counts: dict[str, int] = defaultdict(int)
        for prompt in self.prompts:
            counts[prompt.source] += 1
        return {"seed": self.seed, "prompts": len(self.prompts), "per_source": dict(sorted(counts.items())),
                "dropped_as_dev_overlap": len(self.dropped), "dev_files": self.dev_files,
                "python": sys.version.split()[0]}


def build_prompt_source(seed: int = DEFAULT_SEED, dev_files: Sequence[Path] | None = None,
                        counts: dict[str, int] | None = None, data: PromptData | None = None) -> PromptSource:
    """All distillation prompts, deduplicated, without dev overlaps, shuffled (seeded) so that
    any prefix of the list is a balanced mix of categories. `data`: the pools drawn from (the
    package's data files by default)."""
    dev_files = dev_prompt_files() if dev_files is None else list(dev_files)
    counts = SOURCE_COUNTS if counts is None else counts
    data = load_prompt_data() if data is None else data
    candidates: list[ChatPrompt] = []
    seen: set[str] = set()
    for source, count in counts.items():
        category, build = BUILDERS[source]
        # One generator per builder, seeded by name: changing one source's count leaves the others as they are.
        rng = random.Random(f"{seed}:{source}")
        for text in build(rng, count, data):
            key = normalise(text)
            if key not in seen:
                seen.add(key)
                candidates.append(ChatPrompt(prompt_id(text), category, source, text))
    dropped = find_overlaps([p.text for p in candidates], load_dev_turns(dev_files))
    dropped_texts = {text for text, _, _ in dropped}
    prompts = [p for p in candidates if p.text not in dropped_texts]
    random.Random(f"{seed}:order").shuffle(prompts)
    return PromptSource(prompts, dropped, [display_path(Path(f)) for f in dev_files], seed)


FOLLOW_UP_SOURCE = "follow_up"


def follow_up_prompts(first_turns: Sequence[tuple[ChatPrompt, str]], seed: int = DEFAULT_SEED,
                      dev_files: Sequence[Path] | None = None, data: PromptData | None = None) -> list[ChatPrompt]:
    """A second turn for each (first-turn prompt, the target's answer to it): a follow-up request
    of the prompt's category (`subjects.FOLLOW_UPS`), drawn by a generator seeded by the prompt's
    id, with the first turn and its answer as history. Its id hashes the first turn's id and the
    request, so it is stable whatever else is answered. Requests that overlap a dev prompt are
    never used (`find_overlaps`)."""
    dev_files = dev_prompt_files() if dev_files is None else list(dev_files)
    requests = (load_prompt_data() if data is None else data).by_category("follow_ups")
    overlapping = {text for text, _, _ in find_overlaps([t for texts in requests.values() for t in texts],
                                                        load_dev_turns(dev_files))}
    usable = {category: [text for text in texts if text not in overlapping] for category, texts in requests.items()}
    follow_ups = []
    for first, answer in first_turns:
        if first.history or not usable.get(first.category):
            continue  # follow-ups of follow-ups are not made; a category without requests gets none
        text = random.Random(f"{seed}:follow_up:{first.prompt_id}").choice(usable[first.category])
        follow_ups.append(ChatPrompt(prompt_id(f"{first.prompt_id}\n{text}"), first.category, FOLLOW_UP_SOURCE,
                                     text, (first.text, answer)))
    return follow_ups


def main() -> None:
    """`python -m specpipe.distill.prompts [OUT.jsonl]`: print the composition (and write the prompts)."""
    source = build_prompt_source()
    print(json.dumps(source.describe(), indent=1))
    for text, dev, reason in source.dropped[:20]:
        print(f"dropped ({reason}): {text[:80]!r} ~ dev {dev[:60]!r}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w", encoding="utf-8") as out:
            for p in source.prompts:
                out.write(json.dumps({"prompt_id": p.prompt_id, "category": p.category, "source": p.source,
                                      "text": p.text}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
