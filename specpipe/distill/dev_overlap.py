"""Keeping the distillation prompt sources off the dev prompt sets: the dev turns (every turn of the
Spec-Bench-format `bench/*.jsonl` files) and the rule that finds a prompt that is an exact or near
duplicate of one of them, on normalised text so that formatting never hides a duplicate. Both prompt
sources (the template x subject one of `specpipe.distill.prompts` and the target-written one of
`specpipe.distill.magpie`) drop what `find_overlaps` finds, so no dev prompt is trained on; their
metadata names the dev files by `specpipe.paths.display_path`, independent of where the checkout lies.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from specpipe.paths import CHECKOUT_ROOT

DEV_PROMPT_GLOB = "bench/*.jsonl"

# Near-duplicate rule (on normalised text): a shared run of this many words, or a word-trigram
# Jaccard similarity at least this high, or a whole dev turn (of at least MIN_CONTAINED words)
# appearing inside the prompt.
SHARED_RUN_WORDS = 12
TRIGRAM_JACCARD = 0.5
MIN_CONTAINED = 5


def normalise(text: str) -> str:
    """Lower case, every run of non-alphanumerics one space: formatting never hides a duplicate."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def _ngrams(words: Sequence[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def find_overlaps(texts: Iterable[str], dev_texts: Iterable[str]) -> list[tuple[str, str, str]]:
    """(text, dev text, reason) for every text that is an exact or near duplicate of a dev text."""
    dev = [(raw, normalise(raw)) for raw in dev_texts]
    exact = {norm: raw for raw, norm in dev}
    runs: dict[tuple[str, ...], str] = {}
    trigram_index: dict[tuple[str, ...], list[int]] = defaultdict(list)
    dev_trigrams = []
    for index, (raw, norm) in enumerate(dev):
        words = norm.split()
        for run in _ngrams(words, SHARED_RUN_WORDS):
            runs.setdefault(run, raw)
        grams = _ngrams(words, 3)
        dev_trigrams.append(grams)
        for gram in grams:
            trigram_index[gram].append(index)
    contained = [(f" {norm} ", raw) for raw, norm in dev if len(norm.split()) >= MIN_CONTAINED]
    found = []
    for text in texts:
        norm = normalise(text)
        words = norm.split()
        if norm in exact:
            found.append((text, exact[norm], "exact"))
            continue
        run = next((r for r in _ngrams(words, SHARED_RUN_WORDS) if r in runs), None)
        if run is not None:
            found.append((text, runs[run], f"shares {SHARED_RUN_WORDS} words: {' '.join(run)!r}"))
            continue
        grams = _ngrams(words, 3)
        shared: dict[int, int] = defaultdict(int)
        for gram in grams:
            for index in trigram_index.get(gram, ()):
                shared[index] += 1
        similar = [(count / len(grams | dev_trigrams[i]), i) for i, count in shared.items()]
        best = max(similar, default=(0.0, -1))
        if best[0] >= TRIGRAM_JACCARD:
            found.append((text, dev[best[1]][0], f"trigram Jaccard {best[0]:.2f}"))
            continue
        padded = f" {norm} "
        inside = next((raw for needle, raw in contained if needle in padded), None)
        if inside is not None:
            found.append((text, inside, "contains a dev turn"))
    return found


def dev_prompt_files(root: Path = CHECKOUT_ROOT) -> list[Path]:
    return sorted(root.glob(DEV_PROMPT_GLOB))


def load_dev_turns(paths: Iterable[Path]) -> list[str]:
    """Every turn of every question in Spec-Bench-format JSONL files."""
    turns = []
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                turns.extend(str(turn) for turn in json.loads(line).get("turns", []))
    return turns
