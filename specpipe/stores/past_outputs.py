"""The store of past outputs: every finished answer's token ids, indexed by n-gram, so a later
request (the next turn of a conversation, a repeated or similar question) drafts from what the
model already said. Alibaba Lookahead's warm pool; suffix decoding's global tree.

Bounded in tokens (the oldest answers are dropped first), safe to share between threads (one
lock), and saved/loaded as an on-disk store (`tokens.npy` + `offsets.npy` + manifest; no pickle).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from specpipe.stores.manifest import check_fingerprint, read_manifest, verify_files, write_store

KIND = "past_outputs"
FORMAT_VERSION = 1


class PastOutputs:
    """Answers as token lists; `continuations(context)` finds the context's longest suffix
    (max_ngram down to min_ngram tokens) in them and returns what followed, newest first."""

    def __init__(self, max_tokens: int = 100_000, min_ngram: int = 2, max_ngram: int = 4,
                 fingerprint: dict | None = None) -> None:
        if max_tokens < 1:
            raise ValueError(f"past outputs: max_tokens must be >= 1, got {max_tokens}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"past outputs: n-gram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}, "
                             f"{max_ngram}")
        self.max_tokens, self.min_ngram, self.max_ngram = max_tokens, min_ngram, max_ngram
        self.fingerprint = fingerprint or {}  # the tokenizer the ids belong to, checked on load
        self._lock = threading.Lock()
        self._answers: OrderedDict[int, list[int]] = OrderedDict()  # answer id -> tokens, oldest first
        self._next_id = 0
        self._tokens = 0
        # n-gram -> [(answer id, position after the n-gram)]; entries of dropped answers are
        # skipped at lookup and purged when they make up half the index.
        self._starts: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self._stale = 0
        self._entries = 0

    def __len__(self) -> int:
        return len(self._answers)

    @property
    def token_count(self) -> int:
        return self._tokens

    def insert(self, answer: list[int]) -> None:
        """Adds a finished answer; drops the oldest ones beyond `max_tokens`."""
        answer = [int(token) for token in answer[-self.max_tokens:]]
        if len(answer) < 2:
            return
        with self._lock:
            answer_id = self._next_id
            self._next_id += 1
            self._answers[answer_id] = answer
            self._tokens += len(answer)
            self._index(answer_id, answer)
            while self._tokens > self.max_tokens:
                _, dropped = self._answers.popitem(last=False)
                self._tokens -= len(dropped)
                self._stale += self._entry_count(len(dropped))
            if self._stale * 2 > self._entries:
                self._reindex()

    def continuations(self, context: list[int], max_matches: int, max_length: int) -> list[tuple[int, list[int]]]:
        """Up to `max_matches` (match length, continuation) pairs: longer matches first, newest
        answer first within a length, each continuation start used once."""
        found: list[tuple[int, list[int]]] = []
        used: set[tuple[int, int]] = set()
        with self._lock:
            for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
                for answer_id, start in reversed(self._starts.get(tuple(context[-n:]), ())):
                    answer = self._answers.get(answer_id)
                    if answer is None or start >= len(answer) or (answer_id, start) in used:
                        continue
                    used.add((answer_id, start))
                    found.append((n, answer[start:start + max_length]))
                    if len(found) >= max_matches:
                        return found
        return found

    def _entry_count(self, length: int) -> int:
        return sum(max(0, length - n + 1) for n in range(self.min_ngram, self.max_ngram + 1))

    def _index(self, answer_id: int, answer: list[int]) -> None:
        for end in range(1, len(answer) + 1):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._starts.setdefault(tuple(answer[end - n:end]), []).append((answer_id, end))
        self._entries += self._entry_count(len(answer))

    def _reindex(self) -> None:
        self._starts, self._stale, self._entries = {}, 0, 0
        for answer_id, answer in self._answers.items():
            self._index(answer_id, answer)

    # ---- on disk ----------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Writes the answers as a store folder (atomically: a crash keeps the previous save)."""
        with self._lock:
            answers = [list(answer) for answer in self._answers.values()]

        def write(folder: Path) -> dict:
            lengths = np.array([len(answer) for answer in answers], dtype=np.int64)
            flat = np.array([t for answer in answers for t in answer], dtype=np.int32)  # [tokens]
            np.save(folder / "tokens.npy", flat)
            np.save(folder / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
            return {"answers": len(answers), "token_count": int(flat.size), "max_tokens": self.max_tokens,
                    "min_ngram": self.min_ngram, "max_ngram": self.max_ngram}

        write_store(Path(path), KIND, FORMAT_VERSION, self.fingerprint, write)

    @classmethod
    def load(cls, path: str | Path, fingerprint: dict | None = None, max_tokens: int | None = None,
             what: str = "tokenizer") -> "PastOutputs":
        """Reads a saved store; `fingerprint` (the tokenizer's) must match the one it was saved with."""
        path = Path(path)
        manifest = read_manifest(path, KIND, FORMAT_VERSION)
        verify_files(path, manifest)
        if fingerprint:
            check_fingerprint(path, manifest, fingerprint, what)
        flat = np.load(path / "tokens.npy", allow_pickle=False)  # [tokens] int32
        offsets = np.load(path / "offsets.npy", allow_pickle=False)  # [answers + 1] int64
        stats = manifest.stats
        store = cls(max_tokens or int(stats["max_tokens"]), int(stats["min_ngram"]), int(stats["max_ngram"]),
                    fingerprint=manifest.fingerprint)
        for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            store.insert(flat[start:end].tolist())
        return store
