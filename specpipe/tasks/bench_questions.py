"""The benchmark's prompt set: Spec-Bench question JSONL read and checked, the questions chosen from it, and the
category grouping Spec-Bench reports by. `task=bench`, `task=bench_load` and the scripts under bench/ all read their
prompts through here, so a malformed file stops every one of them with the same message.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from specpipe.errors import InvalidRequest
from specpipe.paths import CHECKOUT_ROOT
from specpipe.tasks.bench_records import Question

# Spec-Bench's evaluation reports its eight MT-bench categories as one task.
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
DEFAULT_GROUPS = {category: "mt_bench" for category in MT_BENCH_CATEGORIES}


def read_questions(path: Path) -> list[Question]:
    """Parses Spec-Bench question JSONL; a malformed line stops with its line number."""
    questions: list[Question] = []
    seen: dict[int | str, int] = {}
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise InvalidRequest(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
            questions.append(_parse_question(row, where))
            qid = questions[-1].question_id
            if qid in seen:
                raise InvalidRequest(f"{where}: question_id {qid!r} already used on line {seen[qid]}")
            seen[qid] = number
    return questions


def _parse_question(row: object, where: str) -> Question:
    if not isinstance(row, dict):
        raise InvalidRequest(f"{where}: expected a JSON object with question_id, category and turns")
    missing = [key for key in ("question_id", "category", "turns") if key not in row]
    if missing:
        raise InvalidRequest(f"{where}: missing {', '.join(missing)} (Spec-Bench format: "
                             f'{{"question_id": 1, "category": "qa", "turns": ["..."]}})')
    qid, category, turns = row["question_id"], row["category"], row["turns"]
    if isinstance(qid, bool) or not isinstance(qid, (int, str)):
        raise InvalidRequest(f"{where}: question_id must be an integer or a string, got {qid!r}")
    if not isinstance(category, str) or not category:
        raise InvalidRequest(f"{where}: category must be a non-empty string, got {category!r}")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise InvalidRequest(f"{where}: turns must be a non-empty list of non-empty strings")
    return Question(qid, category, tuple(turns))


def select_questions(questions: Sequence[Question], per_category: int,
                     categories: Sequence[str] | None = None) -> list[Question]:
    """The first `per_category` questions of each category (file order), optionally only `categories`,
    taken in turns: every category's first question, then every category's second, ... A run cut short
    by `bench.time_limit_s` (a lent GPU's minutes) has then measured every category about equally."""
    if not isinstance(per_category, int) or isinstance(per_category, bool) or per_category <= 0:
        raise InvalidRequest(f"bench.per_category must be a positive integer, got {per_category!r}")
    available = list(dict.fromkeys(q.category for q in questions))
    if categories:
        unknown = [c for c in categories if c not in available]
        if unknown:
            raise InvalidRequest(f"bench.categories: unknown categor{'y' if len(unknown) == 1 else 'ies'} "
                                 f"{', '.join(map(repr, unknown))}; the prompts file has {', '.join(available)}")
        available = [c for c in available if c in categories]
    by_category: dict[str, list[Question]] = {category: [] for category in available}
    for question in questions:
        chosen = by_category.get(question.category)
        if chosen is not None and len(chosen) < per_category:
            chosen.append(question)
    return [chosen[rank] for rank in range(per_category) for chosen in by_category.values() if rank < len(chosen)]


def resolve_prompts_path(name: str) -> Path:
    """A relative path is looked up from the working directory, then from the checkout (bench/ is not installed)."""
    path = Path(name).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, CHECKOUT_ROOT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise InvalidRequest(f"bench.prompts={name}: no such file (looked at {', '.join(map(str, candidates))}); "
                         f"give a Spec-Bench question JSONL, e.g. bench.prompts=bench/dev_prompts.jsonl")
