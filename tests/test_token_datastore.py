"""The REST token datastore (suffix array over token ids) and its Retrieve stage: lookups
against brute force, document boundaries, atomic builds, refusals on load and build, corpus
formats, the proposer's trie, and `task=build_store` end to end."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import run_steps
from test_native_cache import marker_library, needs_cc
import specpipe.stores.token_datastore as token_datastore
import specpipe.stores.token_datastore_build as token_datastore_build
import specpipe.stores.token_datastore_format as token_datastore_format
from specpipe.errors import ConfigError, StoreError
from specpipe.paths import CONFIG_DIR, DATA_DIR
from specpipe.pipelines.builder import build_pipeline, compose_config
from specpipe.stages.base import Proposer
from specpipe.stages.retrieve.rest import RestRetriever
from specpipe.stores.manifest import MANIFEST, tokenizer_fingerprint
from specpipe.stores.token_corpus import corpus_files
from specpipe.stores.token_datastore import ShardedTokenDatastore, TokenDatastore
from specpipe.stores.token_datastore_build import TokenDatastoreBuilder, build_token_datastore
from specpipe.tasks.build_store import run_build_store
from specpipe.types import DecodeState, VerifyResult


class WordTokenizer:
    """Whitespace-separated words -> ids of a fixed vocabulary: small enough to reason about."""

    def __init__(self, words: list[str], name: str = "words") -> None:
        self.vocab = {word: index for index, word in enumerate(words)}
        self.name_or_path = name

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)

    def __call__(self, texts, add_special_tokens=False, verbose=True):
        return {"input_ids": [[self.vocab[word] for word in text.split()] for text in texts]}


WORDS = [f"w{i}" for i in range(40)]
TOKENIZER = WordTokenizer(WORDS)
OTHER_TOKENIZER = WordTokenizer(list(reversed(WORDS)), name="words")  # same name and size, other ids


# ---- brute force -------------------------------------------------------------------------------


def brute_ends(documents: list[list[int]], pattern: list[int]) -> list[tuple[int, int]]:
    """(document, index just after the match) of every occurrence of pattern, within documents."""
    n = len(pattern)
    return [(d, i + n) for d, doc in enumerate(documents) for i in range(len(doc) - n + 1) if doc[i:i + n] == pattern]


def brute_longest(documents, context, max_span, min_span) -> int:
    found = [span for span in range(min_span, min(max_span, len(context)) + 1) if brute_ends(documents, context[-span:])]
    return max(found, default=0)


def random_corpus(rng: random.Random, vocab: int, documents: int, length: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randrange(0, length))] for _ in range(documents)]


def repetitive_corpus(rng: random.Random, documents: int) -> list[list[int]]:
    """Few motifs repeated with small edits: long matches with thousands of occurrences."""
    motifs = [[rng.randrange(6) for _ in range(rng.randrange(3, 9))] for _ in range(3)]
    corpus = []
    for _ in range(documents):
        doc: list[int] = []
        while len(doc) < 300:
            doc += rng.choice(motifs)
            if rng.random() < 0.1:
                doc.append(rng.randrange(6))
        corpus.append(doc)
    return corpus


def probe_patterns(rng: random.Random, documents, vocab: int, count: int) -> list[list[int]]:
    """Half drawn from the corpus (they occur), half random (mostly absent)."""
    non_empty = [doc for doc in documents if doc]
    patterns = []
    for _ in range(count):
        if rng.random() < 0.5 and non_empty:
            doc = rng.choice(non_empty)
            start = rng.randrange(len(doc))
            patterns.append(doc[start:start + rng.randrange(1, 20)])
        else:
            patterns.append([rng.randrange(vocab) for _ in range(rng.randrange(1, 12))])
    return patterns


def assert_matches_brute_force(store: TokenDatastore, documents, patterns, max_length: int = 6) -> None:
    for pattern in patterns:
        assert store.count(pattern) == len(brute_ends(documents, pattern)), pattern
        for context in (pattern, [0, 1] + pattern):
            best = brute_longest(documents, context, 16, 2)
            match = store.lookup(context, max_length=max_length, max_candidates=10**6, max_occurrences=10**6)
            assert match.match_length == best, (context, match.match_length, best)
            if best == 0:
                assert match == token_datastore.DatastoreMatch.none()
                continue
            ends = brute_ends(documents, context[-best:])
            followers = Counter(tuple(documents[d][i:i + max_length]) for d, i in ends)
            assert (match.occurrences, match.sampled) == (len(ends), len(ends))
            assert {tuple(c) for c in match.continuations} == {c for c in followers if c}
            for continuation, prefix_counts in zip(match.continuations, match.prefix_counts):
                for depth in range(len(continuation)):
                    prefix = tuple(continuation[:depth + 1])
                    assert prefix_counts[depth] == sum(n for c, n in followers.items() if c[:depth + 1] == prefix)


# ---- lookups -----------------------------------------------------------------------------------

# How lookups run: in compiled C (specpipe.stores.suffix_lookup), or in numpy narrowing every range past
# the packed key by binary search (limit 0) or by one gather (limit 10**9).
LOOKUPS = ["native", "numpy-bisect", "numpy-gather"]


def store_for(documents, lookup: str, monkeypatch) -> TokenDatastore:
    if lookup != "native":
        monkeypatch.setattr(token_datastore, "GATHER_NARROW_LIMIT", 0 if lookup == "numpy-bisect" else 10**9)
    store = TokenDatastore.from_documents(documents, native=lookup == "native")
    if lookup == "native" and store.native is None:
        pytest.skip(f"the native lookup is not available here: {store.native_reason}")
    return store


@pytest.mark.parametrize("lookup", LOOKUPS)
@pytest.mark.parametrize("vocab", [2, 5, 300, 70000])  # 70000 needs 17-bit key fields (3 tokens a key)
def test_lookups_equal_brute_force_on_random_corpora(vocab, lookup, monkeypatch):
    rng = random.Random(vocab)
    for _ in range(8):
        documents = random_corpus(rng, vocab, documents=rng.randrange(1, 6), length=80)
        if not any(documents):
            continue
        store = store_for(documents, lookup, monkeypatch)
        assert len(store) == sum(map(len, documents))
        assert_matches_brute_force(store, documents, probe_patterns(rng, documents, vocab, 25))


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_lookups_equal_brute_force_on_repetitive_corpora(lookup, monkeypatch):
    rng = random.Random(7)
    documents = repetitive_corpus(rng, documents=12)
    store = store_for(documents, lookup, monkeypatch)
    patterns = probe_patterns(rng, documents, 6, 40)
    assert max(store.count(p) for p in patterns) > 300  # ranges large enough for the binary search
    assert_matches_brute_force(store, documents, patterns)


@pytest.mark.parametrize("vocab", [2, 6, 70000])
def test_the_native_lookup_equals_numpys_with_sampling_limits_and_unpackable_tokens(vocab):
    """Beyond brute force's unlimited lookups: sampled occurrences, few candidates (ties), short
    continuations and spans, and context tokens that cannot occur (negative, or past the key fields)."""
    rng = random.Random(vocab)
    if vocab == 2:
        documents = random_corpus(rng, vocab, 30, 300)
    else:  # motifs of 6 tokens; at 70000 their ids are the vocabulary's last (17-bit key fields)
        documents = [[token + vocab - 6 for token in document] for document in repetitive_corpus(rng, documents=20)]
    native, numpy_only = TokenDatastore.from_documents(documents), TokenDatastore.from_documents(documents, native=False)
    if native.native is None:
        pytest.skip(f"the native lookup is not available here: {native.native_reason}")
    assert numpy_only.native is None
    sampled = 0
    for _ in range(1500):
        document = rng.choice([d for d in documents if d])
        end = rng.randrange(len(document)) + 1
        context = document[max(0, end - 20):end]
        if rng.random() < 0.2:
            context = context + [rng.choice([-1, 1 << 20, vocab, (1 << 32) + context[-1]])]  # the last wraps in int32
        max_span = rng.randrange(1, 17)
        settings = dict(max_span=max_span, min_span=rng.randrange(1, max_span + 1), max_length=rng.randrange(1, 10),
                        max_candidates=rng.randrange(1, 9), max_occurrences=rng.choice([1, 3, 17, 256, 10**6, 1 << 40]))
        match = native.lookup(context, **settings)
        assert match == numpy_only.lookup(context, **settings), (context, settings)
        sampled += match.sampled < match.occurrences
    assert sampled > 50  # the sample of occurrences was exercised
    with pytest.raises(ValueError, match="max_length, max_candidates and max_occurrences >= 1"):
        native.lookup([1, 2], max_occurrences=0)


def test_lookups_equal_on_disk_and_in_memory(tmp_path):
    rng = random.Random(3)
    documents = repetitive_corpus(rng, documents=5)
    build_token_datastore(tmp_path / "store", documents, tokenizer_fingerprint(TOKENIZER), progress=False)
    loaded = TokenDatastore.load(tmp_path / "store", TOKENIZER)
    memory = TokenDatastore.from_documents(documents)
    for array in (loaded.tokens, loaded.suffix_array, loaded.prefix_keys):
        assert isinstance(array.base, np.memmap)  # a view of the mapped file, not a copy
    for pattern in probe_patterns(rng, documents, 6, 30):
        assert loaded.lookup(pattern) == memory.lookup(pattern)


def test_no_match_crosses_a_document_boundary():
    documents = [[1, 2, 3], [4, 5, 1, 2], [3, 9]]
    store = TokenDatastore.from_documents(documents)
    assert store.count([3, 4]) == 0 and store.count([2, 3, 9]) == 0 and store.count([2, 4]) == 0
    assert store.count([1, 2]) == 2 and store.count([3]) == 2
    # [1, 2] is followed by 3 in the first document and by a document's end in the second:
    # the continuation stops there, and that occurrence counts as one with nothing to draft.
    match = store.lookup([7, 1, 2], max_length=4)
    assert (match.match_length, match.occurrences, match.sampled) == (2, 2, 2)
    assert match.continuations == [[3]] and match.prefix_counts == [[1]]
    # The last document's continuation never runs past the end of the corpus.
    assert store.lookup([5, 3], min_span=1).continuations == [[9]]
    assert store.lookup([8, 2, 3], max_span=16, min_span=2).continuations == []


def test_longest_match_prefers_the_longest_span_and_respects_the_limits():
    documents = [[1, 2, 3, 4, 5, 6], [9, 3, 4, 7]]
    store = TokenDatastore.from_documents(documents)
    assert store.lookup([0, 2, 3, 4]).match_length == 3
    assert store.lookup([0, 2, 3, 4]).continuations == [[5, 6]]
    assert store.lookup([0, 2, 3, 4], max_span=2).match_length == 2  # [3, 4]: both documents
    assert sorted(store.lookup([0, 2, 3, 4], max_span=2).continuations) == [[5, 6], [7]]
    assert store.lookup([0, 4], min_span=2).match_length == 0
    assert store.lookup([0, 4], min_span=1).match_length == 1
    assert store.lookup([1, 2, 3, 10**6, 3]).match_length == 0  # a token outside the corpus cuts the context
    assert store.lookup([1, 2, 3, -5, 3, 4]).match_length == 2


def test_frequent_patterns_are_read_from_an_even_sample():
    # After [1, 2]: 7 x 300 times, then 8 x 700 times (order in the corpus is irrelevant).
    rng = random.Random(0)
    followers = [7] * 300 + [8] * 700
    rng.shuffle(followers)
    documents = [[1, 2, follower, 5] for follower in followers]
    store = TokenDatastore.from_documents(documents)
    match = store.lookup([1, 2], max_occurrences=100, max_length=2)
    assert (match.occurrences, match.sampled) == (1000, 100)
    counts = {c[0]: pc[0] for c, pc in zip(match.continuations, match.prefix_counts)}
    assert counts == {7: 30, 8: 70}  # the sorted range spaced evenly keeps each share


def test_candidates_are_the_most_valuable_continuations():
    # After [1, 2]: [3, 4, 5] five times, [3, 4, 6] twice, [9] four times, [8, 8] once.
    documents = [[1, 2, 3, 4, 5]] * 5 + [[1, 2, 3, 4, 6]] * 2 + [[1, 2, 9]] * 4 + [[1, 2, 8, 8]]
    store = TokenDatastore.from_documents(documents)
    match = store.lookup([1, 2], max_candidates=2, max_length=3)
    # value = sum of prefix counts: [3,4,5] 7+7+5, [3,4,6] 7+7+2, [9] 4, [8,8] 1+1; corpus order kept
    assert match.continuations == [[3, 4, 5], [3, 4, 6]]
    assert match.prefix_counts == [[7, 7, 5], [7, 7, 2]]
    assert match.sampled == 12


# ---- building and loading ----------------------------------------------------------------------


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def words(ids: list[int]) -> str:
    return " ".join(WORDS[i] for i in ids)


def build(tmp_path: Path, sources, out: str = "store", **kwargs):
    builder = TokenDatastoreBuilder(TOKENIZER, [str(s) for s in sources], out=str(tmp_path / out),
                                    progress=False, **kwargs)
    return builder, builder.build()


def test_build_writes_a_memory_mapped_store_with_a_manifest(tmp_path):
    corpus = write_text(tmp_path / "corpus" / "a.txt", words([1, 2, 3, 1, 2, 4]))
    write_text(tmp_path / "corpus" / "sub" / "b.md", words([5, 1, 2, 3]))
    builder, manifest = build(tmp_path, [corpus.parent])
    assert builder.out == tmp_path / "store"
    assert manifest.kind == "token_datastore" and manifest.format_version == token_datastore_format.FORMAT_VERSION
    assert manifest.fingerprint == tokenizer_fingerprint(TOKENIZER)
    assert manifest.stats["token_count"] == 10 and manifest.stats["documents"] == 2
    assert manifest.stats["bytes"] == sum(entry["bytes"] for entry in manifest.files.values())
    assert set(manifest.files) == {"tokens.npy", "suffix_array.npy", "prefix_keys.npy"}
    assert [Path(s).name for s in manifest.sources] == ["a.txt", "b.md"]
    store = TokenDatastore.load(builder.out, TOKENIZER, verify_checksums=True)
    assert store.tokens.dtype == np.int32 and store.tokens.tolist() == [1, 2, 3, 1, 2, 4, -1, 5, 1, 2, 3, -1]
    assert store.count([1, 2]) == 3
    assert sorted(store.lookup([0, 1, 2], max_length=1).continuations) == [[3], [4]]


def test_corpus_formats(tmp_path):
    corpus = tmp_path / "corpus"
    records = [{"text": words([1, 2])}, {"turns": [words([3]), words([4, 5])]},
               {"messages": [{"role": "user", "content": words([6])}, {"role": "assistant", "content": words([7])}]},
               {"input_ids": [8, 9, 10]}]
    write_text(corpus / "a.jsonl", "\n".join(json.dumps(r) for r in records) + "\n\n")
    pq.write_table(pa.table({"text": [words([12, 13]), None]}), corpus / "c.parquet")
    pq.write_table(pa.table({"input_ids": [[14, 15], [16]]}), corpus / "d.parquet")
    write_text(corpus / "sub" / "e.txt", words([17, 18]))
    write_text(corpus / ".hidden" / "f.txt", words([39]))  # hidden folders are skipped
    write_text(corpus / "notes.csv", "not a corpus file")  # other types in a folder are skipped
    _, manifest = build(tmp_path, [corpus])
    store = TokenDatastore.load(tmp_path / "store", TOKENIZER)
    documents = [[1, 2], [3], [4, 5], [6], [7], [8, 9, 10], [12, 13], [14, 15], [16], [17, 18]]
    assert store.tokens.tolist() == [token for doc in documents for token in doc + [-1]]
    assert manifest.stats["documents"] == len(documents)

    other = write_text(tmp_path / "other.jsonl", json.dumps({"body": words([11]), "text": None, "ignored": 1}) + "\n")
    with pytest.raises(StoreError, match=r"other.jsonl line 1: no 'text' text.*fields: \['body', 'ignored', "
                                         r"'text'\].*set store.text_field"):
        build(tmp_path, [other], out="other")
    build(tmp_path, [other], out="other", text_field="body")
    assert TokenDatastore.load(tmp_path / "other").tokens.tolist() == [11, -1]


def test_builder_tokenizes_in_batches_in_order(tmp_path):
    texts = [words([i % 40, (i * 7) % 40]) for i in range(25)]
    corpus = write_text(tmp_path / "c.jsonl", "\n".join(json.dumps({"text": t}) for t in texts)
                        + "\n" + json.dumps({"input_ids": [39, 39]}) + "\n" + json.dumps({"text": words([0])}))
    build(tmp_path, [corpus], batch_size=4)
    expected = [[i % 40, (i * 7) % 40] for i in range(25)] + [[39, 39], [0]]
    assert TokenDatastore.load(tmp_path / "store").tokens.tolist() == [t for doc in expected for t in doc + [-1]]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_a_failed_build_leaves_the_previous_store_intact(tmp_path, monkeypatch):
    corpus = write_text(tmp_path / "a.txt", words([1, 2, 3, 4]))
    builder, _ = build(tmp_path, [corpus])
    before = snapshot(builder.out)

    def documents_then_failure():
        yield [5, 6, 7]
        yield [5, 6, 8]
        raise RuntimeError("corpus reader died")

    with pytest.raises(RuntimeError, match="corpus reader died"):
        build_token_datastore(builder.out, documents_then_failure(), tokenizer_fingerprint(TOKENIZER), progress=False)

    saved = []
    real_save = np.save

    def save_then_fail(path, array, allow_pickle=False):
        if saved:
            raise OSError("disk full")
        saved.append(path)
        real_save(path, array, allow_pickle=allow_pickle)

    monkeypatch.setattr(token_datastore.np, "save", save_then_fail)
    with pytest.raises(OSError, match="disk full"):
        build_token_datastore(builder.out, [[5, 6, 7]], tokenizer_fingerprint(TOKENIZER), progress=False)
    monkeypatch.undo()
    assert saved  # the failure came after part of the new store was written
    assert snapshot(builder.out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "store"]  # no staging folder left behind
    assert TokenDatastore.load(builder.out, TOKENIZER, verify_checksums=True).count([2, 3]) == 1


@pytest.fixture
def built_store(tmp_path) -> Path:
    corpus = write_text(tmp_path / "a.txt", words([1, 2, 3, 1, 2, 4] * 20))
    builder, _ = build(tmp_path, [corpus])
    return builder.out


def test_load_refuses_a_missing_store(tmp_path):
    with pytest.raises(StoreError, match="does not exist.*task=build_store"):
        TokenDatastore.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="no manifest.json"):
        TokenDatastore.load(tmp_path / "empty")


def test_load_refuses_a_corrupt_manifest(built_store):
    (built_store / MANIFEST).write_text("{ not json")
    with pytest.raises(StoreError, match="corrupt"):
        TokenDatastore.load(built_store)


def test_load_refuses_a_manifest_of_another_kind(built_store):
    manifest = json.loads((built_store / MANIFEST).read_text())
    (built_store / MANIFEST).write_text(json.dumps({**manifest, "kind": "document_store"}))
    with pytest.raises(StoreError, match="holds a document_store"):
        TokenDatastore.load(built_store)


def test_load_refuses_truncated_or_missing_files(built_store):
    tokens = built_store / "tokens.npy"
    tokens.write_bytes(tokens.read_bytes()[:-8])
    with pytest.raises(StoreError, match="tokens.npy has .* bytes.*truncated"):
        TokenDatastore.load(built_store)
    tokens.unlink()
    with pytest.raises(StoreError, match="missing tokens.npy"):
        TokenDatastore.load(built_store)


def test_load_refuses_corrupt_content_when_checking_checksums(built_store):
    keys = built_store / "prefix_keys.npy"
    data = bytearray(keys.read_bytes())
    data[-1] ^= 0xFF  # same size: only the checksum can tell
    keys.write_bytes(bytes(data))
    TokenDatastore.load(built_store)  # sizes only: accepted
    with pytest.raises(StoreError, match="prefix_keys.npy does not match its checksum"):
        TokenDatastore.load(built_store, verify_checksums=True)


def test_load_never_unpickles(built_store, monkeypatch):
    loads = []
    real_load = np.load

    def spy(*args, **kwargs):
        loads.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(token_datastore.np, "load", spy)
    TokenDatastore.load(built_store)
    assert len(loads) == 3 and all(k["allow_pickle"] is False and k["mmap_mode"] == "r" for k in loads)
    # An object array (which only pickle can read) in place of tokens.npy, manifest updated to match.
    evil = built_store / "tokens.npy"
    np.save(evil, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    manifest = json.loads((built_store / MANIFEST).read_text())
    manifest["files"]["tokens.npy"]["bytes"] = evil.stat().st_size
    (built_store / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="cannot read tokens.npy .*Python objects"):
        TokenDatastore.load(built_store)


def test_load_refuses_a_store_of_another_tokenizer(built_store):
    with pytest.raises(StoreError, match="built for another tokenizer.*vocab_sha256"):
        TokenDatastore.load(built_store, OTHER_TOKENIZER)
    TokenDatastore.load(built_store, WordTokenizer(WORDS, name="renamed"))  # same ids, other name: accepted


def test_build_refuses_bad_corpora_and_overwrites_nothing(tmp_path, built_store):
    before = snapshot(built_store)
    empty = write_text(tmp_path / "empty" / "a.txt", "   \n")
    bad_utf8 = tmp_path / "bad.txt"
    bad_utf8.write_bytes(b"w1 w2 \xff\xfe")
    bad_json = write_text(tmp_path / "bad.jsonl", json.dumps({"text": "w1"}) + "\n{oops\n")
    bad_ids = write_text(tmp_path / "ids.jsonl", json.dumps({"input_ids": [1, 2, 999]}) + "\n")
    not_parquet = write_text(tmp_path / "fake.parquet", "this is not parquet")
    cases = [
        ([empty], StoreError, "no tokens"),
        ([empty.parent], StoreError, "no tokens"),
        ([tmp_path / "missing.txt"], ConfigError, "does not exist"),
        ([tmp_path / "empty" / "sub"], ConfigError, "does not exist"),
        ([write_text(tmp_path / "x.csv", "a")], ConfigError, "unsupported file type '.csv'"),
        ([bad_utf8], StoreError, "cannot read corpus file .*bad.txt.*UnicodeDecodeError"),
        ([bad_json], StoreError, "bad.jsonl: line 2 is not JSON"),
        ([bad_ids], StoreError, "token id 999, outside the tokenizer's 0..39"),
        ([not_parquet], StoreError, "cannot read corpus file .*fake.parquet"),
        ([], ConfigError, "needs sources"),
    ]
    for sources, error, message in cases:
        with pytest.raises(error, match=message):
            TokenDatastoreBuilder(TOKENIZER, [str(s) for s in sources], out=str(built_store), progress=False).build()
        assert snapshot(built_store) == before, sources
    write_text(tmp_path / "nothing" / "a.csv", "a")
    with pytest.raises(ConfigError, match="holds no .txt, .md, .jsonl, .parquet files"):
        corpus_files([str(tmp_path / "nothing")])


def test_build_refuses_to_replace_a_folder_that_is_not_a_store(tmp_path):
    corpus = write_text(tmp_path / "a.txt", words([1, 2]))
    precious = write_text(tmp_path / "mine" / "thesis.txt", "do not delete")
    with pytest.raises(StoreError, match="not a specpipe store"):
        build(tmp_path, [corpus], out="mine")
    assert precious.read_text() == "do not delete"


# ---- sharded stores ----------------------------------------------------------------------------

EVERYTHING = {"max_occurrences": 10**9}  # no sampling: a sharded lookup must equal the one-shard one exactly


def mixed_corpus(rng: random.Random) -> list[list[int]]:
    """Repetitive documents (long matches, thousands of occurrences, many ties) between short
    random ones and empty ones, so shard cuts fall everywhere."""
    documents: list[list[int]] = []
    for document in repetitive_corpus(rng, documents=8):
        documents.append(document[:rng.randrange(20, 300)])
        documents.extend(random_corpus(rng, 6, documents=rng.randrange(0, 4), length=30))
    return documents


def expected_shards(documents: list[list[int]], shard_tokens: int) -> list[list[int]]:
    """The tokens of each shard, by hand: whole non-empty documents, each followed by -1, a shard
    closed by the document that brings it to shard_tokens tokens."""
    shards, current, held = [], [], 0
    for document in documents:
        if document:
            current += document + [-1]
            held += len(document)
            if held >= shard_tokens:
                shards.append(current)
                current, held = [], 0
    return shards + ([current] if current else [])


def shards_holding(store: ShardedTokenDatastore, pattern: list[int]) -> int:
    return sum(hi > lo for lo, hi in store.find(pattern))


@pytest.mark.parametrize("shard_tokens", [1, 45, 300, 1000, 10**9])
def test_sharded_lookups_equal_the_one_shard_store(shard_tokens):
    rng = random.Random(shard_tokens)
    documents = mixed_corpus(rng)
    one = TokenDatastore.from_documents(documents)
    sharded = ShardedTokenDatastore.from_documents(documents, shard_tokens)
    assert [shard.tokens.tolist() for shard in sharded.shards] == expected_shards(documents, shard_tokens)
    assert len(sharded) == len(one)
    settings = [{}, {"max_candidates": 2, "max_length": 3}, {"max_candidates": 1, "max_length": 1, "min_span": 1},
                {"max_candidates": 10**6, "max_length": 8, "max_span": 5}]
    in_several = 0
    for pattern in probe_patterns(rng, documents, 6, 60):
        assert sharded.count(pattern) == one.count(pattern), pattern
        in_several += shards_holding(sharded, pattern) > 1
        for context in (pattern, [0, 1] + pattern, [5] * 3 + pattern):
            for setting in settings:
                expected = one.lookup(context, **setting, **EVERYTHING)
                assert sharded.lookup(context, **setting, **EVERYTHING) == expected, (context, setting)
            length, ranges = sharded.longest_suffix_match(context)
            assert length == one.longest_suffix_match(context)[0]
            assert sum(hi - lo for lo, hi in ranges) == (one.count(context[-length:]) if length else 0)
    if len(sharded.shards) > 2:
        assert in_several > 10  # the merge is exercised, not just shards that hold nothing


def test_sharded_ties_are_broken_by_content_as_in_one_store():
    # After [1, 2]: [4] in the first shard, [3] in the second, once each: equal value, and the
    # one-shard store's range puts [3] first. A merge that kept shard order would pick [4].
    documents = [[1, 2, 4], [1, 2, 3], [7, 1, 2, 9, 9], [1, 2, 3, 0]]
    one = TokenDatastore.from_documents(documents)
    sharded = ShardedTokenDatastore.from_documents(documents, shard_tokens=1)
    assert len(sharded.shards) == 4
    assert one.lookup([1, 2], max_candidates=1, max_length=1).continuations == [[3]]
    for candidates in (1, 2, 3):
        for length in (1, 2):
            assert sharded.lookup([1, 2], max_candidates=candidates, max_length=length) == \
                one.lookup([1, 2], max_candidates=candidates, max_length=length)
    # returned in lexicographic order, a document's end (after [3]) below every token
    assert sharded.lookup([1, 2], max_candidates=3, max_length=2).continuations == [[3], [3, 0], [9, 9]]


def test_sharded_sampling_gives_each_shard_its_share_of_the_occurrences():
    # After [1, 2]: 7 three hundred times, all in the first shard; 8 seven hundred times after it.
    documents = [[1, 2, 7, 5]] * 300 + [[1, 2, 8, 5]] * 700
    sharded = ShardedTokenDatastore.from_documents(documents, shard_tokens=4 * 300)
    assert [len(shard) for shard in sharded.shards] == [1200, 1200, 1200, 400]
    match = sharded.lookup([1, 2], max_occurrences=100, max_length=2)
    assert (match.occurrences, match.sampled) == (1000, 100)
    assert {c[0]: pc[0] for c, pc in zip(match.continuations, match.prefix_counts)} == {7: 30, 8: 70}
    assert sharded.lookup([1, 2], max_occurrences=1000) == TokenDatastore.from_documents(documents).lookup(
        [1, 2], max_occurrences=1000)
    # shuffled across many shards, each shard sampled evenly inside its own range
    rng = random.Random(0)
    shuffled = documents[:]
    rng.shuffle(shuffled)
    many = ShardedTokenDatastore.from_documents(shuffled, shard_tokens=4 * 90)
    sample = many.lookup([1, 2], max_occurrences=100, max_length=2)
    counts = {c[0]: pc[0] for c, pc in zip(sample.continuations, sample.prefix_counts)}
    assert sum(counts.values()) == 100 and abs(counts[7] - 30) <= len(many.shards) // 2


def write_ids(path: Path, documents: list[list[int]]) -> Path:
    return write_text(path, "".join(json.dumps({"input_ids": document}) + "\n" for document in documents))


@pytest.fixture
def id_corpus(tmp_path) -> tuple[Path, list[list[int]]]:
    """A corpus of ids (first file) and words (second file) the WordTokenizer can read."""
    documents = mixed_corpus(random.Random(11))
    write_ids(tmp_path / "corpus" / "a.jsonl", documents[:20])
    write_text(tmp_path / "corpus" / "b.jsonl",
               "".join(json.dumps({"text": words(document)}) + "\n" for document in documents[20:]))
    return tmp_path / "corpus", documents


def test_sharded_build_writes_whole_shards_and_loads_mapped(tmp_path, id_corpus):
    corpus, documents = id_corpus
    _, one_manifest = build(tmp_path, [corpus], out="one")
    builder, manifest = build(tmp_path, [corpus], out="sharded", shard_tokens=200)
    assert manifest.format_version == token_datastore_format.SHARDED_FORMAT_VERSION
    names = [shard["name"] for shard in manifest.stats["shards"]]
    assert names == [f"shard-{i:05d}" for i in range(len(names))] and len(names) > 4
    assert manifest.stats["token_count"] == one_manifest.stats["token_count"] == sum(map(len, documents))
    assert manifest.stats["documents"] == one_manifest.stats["documents"]
    assert set(manifest.files) == {f"{name}/{file}" for name in names
                                   for file in ("manifest.json", "tokens.npy", "suffix_array.npy", "prefix_keys.npy")}
    one = TokenDatastore.load(tmp_path / "one", TOKENIZER)
    store = TokenDatastore.load(builder.out, TOKENIZER, verify_checksums=True)
    assert isinstance(store, ShardedTokenDatastore) and len(store) == len(one)
    assert isinstance(ShardedTokenDatastore.load(builder.out), ShardedTokenDatastore)
    # shards are cut at document ends only, each closed by the document that reached 200 tokens
    cut = []
    for shard, name in zip(store.shards, names):
        assert isinstance(TokenDatastore.load(builder.out / name, TOKENIZER), TokenDatastore)  # a store of its own
        for array in (shard.tokens, shard.suffix_array, shard.prefix_keys):
            assert isinstance(array.base, np.memmap)
        shard_documents = np.split(shard.tokens, np.flatnonzero(shard.tokens == -1) + 1)[:-1]
        assert len(shard) >= 200 or name == names[-1]
        assert len(shard) - (len(shard_documents[-1]) - 1) < 200
        cut += shard.tokens.tolist()
    assert cut == one.tokens.tolist()
    rng = random.Random(5)
    for pattern in probe_patterns(rng, documents, 6, 40):
        assert store.lookup(pattern, **EVERYTHING) == one.lookup(pattern, **EVERYTHING)
        assert store.lookup([3] + pattern, max_candidates=2, **EVERYTHING) == \
            one.lookup([3] + pattern, max_candidates=2, **EVERYTHING)


def staging_of(out: Path) -> Path:
    return out.parent / f".{out.name}.building-sharded"


def count_indexing(monkeypatch, fail_at: int | None = None) -> list[int]:
    """Counts shards sorted (calls of _index); the call numbered `fail_at` is interrupted instead."""
    calls: list[int] = []
    real_index = token_datastore_build.index_tokens

    def index(tokens):
        calls.append(len(tokens))
        if len(calls) == fail_at:
            raise KeyboardInterrupt
        return real_index(tokens)

    monkeypatch.setattr(token_datastore_build, "index_tokens", index)
    return calls


def shard_arrays(path: Path) -> list[list[int]]:
    return [shard.tokens.tolist() for shard in TokenDatastore.load(path).shards]


def test_an_interrupted_sharded_build_keeps_the_old_store_and_resumes(tmp_path, id_corpus, monkeypatch):
    corpus, documents = id_corpus
    builder, _ = build(tmp_path, [corpus])  # the store in place before the sharded builds
    before = snapshot(builder.out)
    _, reference = build(tmp_path, [corpus], out="reference", shard_tokens=200)
    total = len(reference.stats["shards"])

    count_indexing(monkeypatch, fail_at=3)
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path, [corpus], shard_tokens=200)
    assert snapshot(builder.out) == before
    assert TokenDatastore.load(builder.out, TOKENIZER).count([1, 2]) == TokenDatastore.load(
        tmp_path / "reference").count([1, 2])
    staging = staging_of(builder.out)
    assert sorted(p.name for p in staging.iterdir()) == ["shard-00000", "shard-00001"]  # the third died mid-way
    assert (staging.parent / f"{staging.name}.json").is_file()

    calls = count_indexing(monkeypatch)
    _, manifest = build(tmp_path, [corpus], shard_tokens=200)
    assert len(calls) == total - 2  # the two finished shards were not sorted again
    assert manifest.stats["shards"] == reference.stats["shards"]
    assert shard_arrays(builder.out) == shard_arrays(tmp_path / "reference")
    assert not staging.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "reference", "store"]
    TokenDatastore.load(builder.out, TOKENIZER, verify_checksums=True)

    # a shard left torn on disk is built again, and so is every shard after it
    count_indexing(monkeypatch, fail_at=4)
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path, [corpus], out="other", shard_tokens=200)
    torn = staging_of(tmp_path / "other") / "shard-00001" / "suffix_array.npy"
    torn.write_bytes(torn.read_bytes()[:-4])
    calls = count_indexing(monkeypatch)
    build(tmp_path, [corpus], out="other", shard_tokens=200)
    assert len(calls) == total - 1
    assert shard_arrays(tmp_path / "other") == shard_arrays(tmp_path / "reference")

    # other sources (or settings) than the interrupted build's: nothing is reused
    count_indexing(monkeypatch, fail_at=3)
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path, [corpus], out="grown", shard_tokens=200)
    with open(corpus / "a.jsonl", "a") as handle:
        handle.write(json.dumps({"input_ids": [39, 38, 37]}) + "\n")
    calls = count_indexing(monkeypatch)
    build(tmp_path, [corpus], out="grown", shard_tokens=200)
    assert len(calls) == len(TokenDatastore.load(tmp_path / "grown").shards) >= total
    assert TokenDatastore.load(tmp_path / "grown").count([39, 38, 37]) == 1


def test_a_failed_sharded_build_from_ids_leaves_nothing_behind(tmp_path, built_store):
    before = snapshot(built_store)

    def documents_then_failure():
        for _ in range(10):
            yield [5, 6, 7, 8]
        raise RuntimeError("corpus reader died")

    with pytest.raises(RuntimeError, match="corpus reader died"):
        build_token_datastore(built_store, documents_then_failure(), tokenizer_fingerprint(TOKENIZER),
                              progress=False, shard_tokens=8)
    assert snapshot(built_store) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "store"]
    manifest = build_token_datastore(tmp_path / "ids", [[5, 6, 7, 8]] * 10, tokenizer_fingerprint(TOKENIZER),
                                     progress=False, shard_tokens=8)
    assert [shard["token_count"] for shard in manifest.stats["shards"]] == [8] * 5
    assert TokenDatastore.load(tmp_path / "ids").count([6, 7]) == 10


@pytest.fixture
def sharded_store(tmp_path, id_corpus) -> Path:
    builder, _ = build(tmp_path, [id_corpus[0]], out="sharded", shard_tokens=300)
    return builder.out


def test_sharded_load_refuses_a_missing_or_truncated_shard(sharded_store):
    keys = sharded_store / "shard-00001" / "prefix_keys.npy"
    keys.write_bytes(keys.read_bytes()[:-8])
    with pytest.raises(StoreError, match="shard-00001/prefix_keys.npy has .* bytes.*truncated"):
        TokenDatastore.load(sharded_store)
    shutil.rmtree(sharded_store / "shard-00001")
    with pytest.raises(StoreError, match="shard shard-00001 is missing"):
        TokenDatastore.load(sharded_store)


def test_sharded_load_refuses_a_shard_of_another_tokenizer(tmp_path, sharded_store, id_corpus):
    with pytest.raises(StoreError, match="built for another tokenizer.*vocab_sha256"):
        TokenDatastore.load(sharded_store, OTHER_TOKENIZER)
    # the same ids indexed for another tokenizer (same vocabulary size), slipped in as shard 1
    foreign = TokenDatastoreBuilder(OTHER_TOKENIZER, [str(id_corpus[0])], out=str(tmp_path / "foreign"),
                                    progress=False, shard_tokens=300).build()
    assert foreign.stats["shards"] == json.loads((sharded_store / MANIFEST).read_text())["stats"]["shards"]
    shutil.rmtree(sharded_store / "shard-00001")
    shutil.copytree(tmp_path / "foreign" / "shard-00001", sharded_store / "shard-00001")
    manifest = json.loads((sharded_store / MANIFEST).read_text())
    manifest["files"].update({name: entry for name, entry in foreign.files.items() if name.startswith("shard-00001/")})
    (sharded_store / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="shard shard-00001 was built for another tokenizer than the store"):
        TokenDatastore.load(sharded_store, verify_checksums=True)


@pytest.mark.parametrize("shard_tokens", [0, -5, 2.5, True, "many"])
def test_shard_tokens_must_be_a_positive_count(tmp_path, shard_tokens):
    with pytest.raises(ConfigError, match="store.shard_tokens must be a positive number"):
        TokenDatastoreBuilder(TOKENIZER, [str(tmp_path)], out=str(tmp_path / "x"), shard_tokens=shard_tokens)


def test_store_config_passes_shard_tokens(tmp_path):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    config = OmegaConf.load(CONFIG_DIR / "store" / "tokens_from_files.yaml")
    assert config.shard_tokens is None
    config.sources, config.shard_tokens = [str(tmp_path)], 1000
    assert instantiate(config)(tokenizer=TOKENIZER).shard_tokens == 1000


def test_rest_drafts_the_same_from_a_sharded_store(tmp_path, id_corpus):
    corpus, documents = id_corpus
    build(tmp_path, [corpus], out="one")
    build(tmp_path, [corpus], out="sharded", shard_tokens=150)
    options = {"tokenizer": TOKENIZER, "max_candidates": 4, "max_length": 6, "max_occurrences": 10**9}
    one = RestRetriever(path=str(tmp_path / "one"), **options)
    sharded = RestRetriever(path=str(tmp_path / "sharded"), **options)
    assert isinstance(sharded.datastore, ShardedTokenDatastore) and len(sharded.datastore.shards) > 5
    rng = random.Random(2)
    proposed = 0
    for pattern in probe_patterns(rng, documents, 6, 30):
        proposals = []
        for rest in (one, sharded):
            state = DecodeState(tokens=[0] + pattern, prompt_length=len(pattern) + 1)
            rest.reset(state)
            proposals.append(rest.propose(state))
        assert proposals[0].tokens.tolist() == proposals[1].tokens.tolist()
        assert proposals[0].parents.tolist() == proposals[1].parents.tolist()
        assert proposals[0].scores.tolist() == proposals[1].scores.tolist()
        proposed += len(proposals[0]) > 0
    assert proposed > 10


# ---- the Retrieve stage ------------------------------------------------------------------------


def rest_over(documents, **kwargs) -> RestRetriever:
    return RestRetriever(datastore=TokenDatastore.from_documents(documents), **kwargs)


def assert_proposal_well_formed(proposal) -> None:
    tokens, parents, scores = proposal.tokens.tolist(), proposal.parents.tolist(), proposal.scores.tolist()
    assert proposal.tokens.dtype == torch.long and proposal.parents.dtype == torch.long
    assert len(set(zip(parents, tokens))) == len(tokens)  # no duplicate siblings
    for node, parent in enumerate(parents):
        assert -1 <= parent < node
        assert 0.0 < scores[node] <= (scores[parent] + 1e-7 if parent >= 0 else 1.0)


def test_proposer_trie_keeps_the_most_frequent_branches():
    # After [1, 2]: [3, 4, 5] x5, [3, 4, 6] x2, [9] x4, [8, 8] x1; one occurrence ends the document.
    documents = [[1, 2, 3, 4, 5]] * 5 + [[1, 2, 3, 4, 6]] * 2 + [[1, 2, 9]] * 4 + [[1, 2, 8, 8]] + [[1, 2]]
    rest = rest_over(documents, max_candidates=3, max_length=3)
    assert isinstance(rest, Proposer)
    state = DecodeState(tokens=[7, 1, 2], prompt_length=3)
    rest.reset(state)
    proposal = rest.propose(state)
    assert proposal.source == "token_datastore"
    assert_proposal_well_formed(proposal)
    paths = {}
    for node, (token, parent) in enumerate(zip(proposal.tokens.tolist(), proposal.parents.tolist())):
        paths[node] = (paths[parent] if parent >= 0 else ()) + (token,)
    score_of = {path: float(proposal.scores[node]) for node, path in paths.items()}
    assert set(score_of) == {(3,), (3, 4), (3, 4, 5), (3, 4, 6), (9,)}  # [8, 8] was the least frequent
    prior = state.stage_state[rest].calibration.factor(2, 0)
    assert score_of[(3,)] == pytest.approx(prior * 7 / 13)  # 13 occurrences, the one at a document end included
    assert score_of[(9,)] == pytest.approx(prior * 4 / 13)
    assert score_of[(3, 4, 5)] == pytest.approx(score_of[(3, 4)] * prior * 5 / 7)


@pytest.mark.parametrize("shared_calibration", [True, False])
def test_proposer_is_empty_without_a_match_and_learns_from_commits(shared_calibration):
    rest = rest_over([[1, 2, 3, 4, 5, 6, 7, 8]] * 3, max_length=4, shared_calibration=shared_calibration)
    state = DecodeState(tokens=[30, 31], prompt_length=2)
    rest.reset(state)
    assert len(rest.propose(state)) == 0
    rest.on_commit(state, VerifyResult(accepted=[], bonus=0, logits=torch.empty(0)))  # nothing to learn from
    state = DecodeState(tokens=[1, 2], prompt_length=2)
    rest.reset(state)
    first = float(rest.propose(state).scores[0])
    for _ in range(4):  # the corpus keeps being right: the calibration learns to trust it
        proposal = rest.propose(state)
        state.tokens.extend(proposal.tokens.tolist()[:2])
        rest.on_commit(state, VerifyResult(accepted=[0], bonus=state.tokens[-1], logits=torch.empty(0)))
        state.tokens[:] = [1, 2]
    learned = float(rest.propose(state).scores[0])
    assert learned > first + 0.1
    rest.reset(state)  # a new sequence keeps what the requests before it taught, or starts from the prior
    assert float(rest.propose(state).scores[0]) == pytest.approx(learned if shared_calibration else first)



def proposal_paths(proposal) -> dict[tuple[int, ...], float]:
    paths = {}
    for node, (token, parent) in enumerate(zip(proposal.tokens.tolist(), proposal.parents.tolist())):
        paths[node] = (paths[parent] if parent >= 0 else ()) + (token,)
    return {path: float(proposal.scores[node]) for node, path in paths.items()}


def test_proposer_with_shorter_spans_adds_what_usually_follows_and_learns_from_each_span():
    # [5, 1, 2] occurs once, followed by 3; [1, 2] five times, followed by 9 four times.
    documents = [[5, 1, 2, 3]] + [[7, 1, 2, 9]] * 4
    state = DecodeState(tokens=[5, 1, 2], prompt_length=3)
    longest_alone = rest_over(documents, max_length=2)
    longest_alone.reset(state)
    assert set(proposal_paths(longest_alone.propose(state))) == {(3,)}
    too_short = rest_over(documents, max_length=2, min_span=3, shorter_spans=1)  # span 2 is below min_span
    too_short.reset(state)
    assert set(proposal_paths(too_short.propose(state))) == {(3,)}

    rest = rest_over(documents, max_length=2, shorter_spans=1)
    rest.reset(state)
    proposal = rest.propose(state)
    assert_proposal_well_formed(proposal)
    calibration = state.stage_state[rest].calibration
    prior = calibration.factor(3, 0)
    assert proposal_paths(proposal) == pytest.approx({(3,): prior * 1.0, (9,): prior * 4 / 5})  # (3,): its best score
    state.tokens.append(9)  # the target went with what usually follows
    rest.on_commit(state, VerifyResult(accepted=[1], bonus=0, logits=torch.empty(0)))
    assert calibration.factor(3, 0) < prior < calibration.factor(2, 0)  # each span learned from its own trie
    state.tokens[:] = [5, 1, 2]
    assert proposal_paths(rest.propose(state)) == pytest.approx(
        {(3,): max(calibration.factor(3, 0), calibration.factor(2, 0) / 5), (9,): calibration.factor(2, 0) * 4 / 5})

def test_proposer_validates_its_options():
    store = TokenDatastore.from_documents([[1, 2, 3]])
    for bad in ({"min_span": 0}, {"min_span": 5, "max_span": 4}, {"max_candidates": 0}, {"max_length": 0},
                {"shorter_spans": -1}):
        with pytest.raises(ValueError):
            RestRetriever(datastore=store, **bad)


# ---- from the command line ---------------------------------------------------------------------


def store_override(name: str) -> str:
    """`store=NAME` where the build_store task lists the store group in its defaults, else `+store=NAME`."""
    try:
        compose_config(["task=build_store", f"store={name}"])
        return f"store={name}"
    except ConfigError:
        return f"+store={name}"


def test_build_store_task_end_to_end(tmp_path, tiny_mixed):
    """`task=build_store store=tokens_from_files` on text and on ids, then the store drafting
    alone in a pipeline: what it proposes is the model's own greedy text, so drafts get
    accepted, and the output stays plain greedy."""
    tokenizer = tiny_mixed.tokenizer
    prompt = tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"]
    greedy = tiny_mixed.greedy_hf(prompt, 32)
    write_text(tmp_path / "docs" / "python.md",
               "The quick brown fox jumps over the lazy dog. " * 5 + "\n\nList comprehensions are fast.")
    write_text(tmp_path / "docs" / "answers.jsonl", json.dumps({"input_ids": prompt + greedy}) + "\n")
    out = tmp_path / "stores" / "python"
    overrides = ["model=tiny_random", "task=build_store", store_override("tokens_from_files")]
    with pytest.raises(ConfigError, match="store.sources"):
        run_build_store(compose_config(overrides))
    manifest = run_build_store(compose_config([*overrides, f"store.sources=[{tmp_path / 'docs'}]",
                                               f"store.out={out}", "store.progress=false"]))
    store = TokenDatastore.load(out, tokenizer)
    assert manifest.stats["token_count"] == len(store) > 50 and manifest.stats["documents"] == 2
    phrase = tokenizer("The quick brown fox jumps over", add_special_tokens=False)["input_ids"]
    match = store.lookup(phrase, max_length=4)
    assert match.continuations == [tokenizer(" the lazy dog.", add_special_tokens=False)["input_ids"][:4]]
    sharded = run_build_store(compose_config([*overrides, f"store.sources=[{tmp_path / 'docs'}]",
                                              f"store.out={tmp_path / 'stores' / 'sharded'}", "store.progress=false",
                                              "store.shard_tokens=20"]))
    assert len(sharded.stats["shards"]) == 2 and sharded.stats["token_count"] == len(store)  # one per document
    assert TokenDatastore.load(tmp_path / "stores" / "sharded", tokenizer).lookup(phrase, max_length=4) == match

    cfg = tiny_mixed.config("lookahead_trie", "~pipeline.proposers.ngram",
                            "+retriever@pipeline.proposers.rest=token_datastore", f"pipeline.proposers.rest.path={out}")
    pipeline = build_pipeline(cfg, loaded=tiny_mixed.loaded)
    assert [type(p) for p in pipeline.decoder.proposers] == [RestRetriever]
    generation = pipeline.generate(prompt, max_new_tokens=32)
    assert generation.token_ids == greedy
    assert generation.stats.mean_accepted > 2.0, generation.stats.summary()

    missing = tiny_mixed.config("lookahead_trie", "+retriever@pipeline.proposers.rest=token_datastore",
                                f"pipeline.proposers.rest.path={tmp_path / 'nowhere'}")
    with pytest.raises(StoreError, match="no token_datastore at .*nowhere: the folder does not exist"):
        build_pipeline(missing, loaded=tiny_mixed.loaded)


@pytest.mark.embedded
def test_rest_drafts_a_stored_answer_from_the_shipped_corpus(embedded):
    """pipeline=rest out of the box: its datastore is built from data/self_distill/ on first use (one
    store per corpus version). Asked a question whose answer the corpus holds, REST drafts that
    answer, long runs of it accepted, and the output is still exactly plain greedy."""
    import pyarrow.parquet as pq

    from specpipe.stores.manifest import sha256_file

    corpus = DATA_DIR / "self_distill" / "smollm2_135m_chat.parquet"
    pipe = embedded.pipeline("rest")
    assert pipe.decoder.proposers[0].datastore.path.name.endswith(sha256_file(corpus)[:12])
    row = pq.read_table(corpus, columns=["prompt", "answer_ids"]).slice(0, 1).to_pylist()[0]
    prompt_ids = pipe.encode(row["prompt"])
    tokens, steps = run_steps(pipe, prompt_ids, 48)
    assert tokens == embedded.greedy_hf(prompt_ids, 48)
    # the corpus holds the model's own greedy answer (generated in batches: a near-tie may flip there)
    assert tokens[:8] == row["answer_ids"][:8]
    assert len(tokens) / len(steps) > 3


def test_a_corpus_of_another_tokenizer_is_refused_before_its_store_is_loaded():
    """The shipped chat corpus holds SmolLM2's ids: for another tokenizer REST refuses it with one message,
    whether or not the store built from it exists already."""
    corpus = str(DATA_DIR / "self_distill" / "smollm2_135m_chat.parquet")
    with pytest.raises(StoreError, match="holds token ids of another tokenizer.*task=build_store"):
        RestRetriever(TOKENIZER, corpus=corpus, store="chat_distill")


def test_without_a_working_compiler_the_datastore_keeps_the_numpy_lookup(tmp_path, monkeypatch):
    """A compiler that fails, or none: the store still loads and answers lookups (in numpy), and says why."""
    monkeypatch.setattr(token_datastore, "cache_root", lambda: tmp_path)  # nothing built there yet
    documents = [[1, 2, 3, 1, 2, 4], [2, 3, 1, 2]]
    reference = TokenDatastore.from_documents(documents, native=False).lookup([1, 2])
    for compiler, reason in ((str(tmp_path / "no-such-cc"), "could not be built"),
                             ("false", "did not compile")):
        monkeypatch.setenv("CC", compiler)
        store = TokenDatastore.from_documents(documents)
        assert store.native is None and reason in store.native_reason
        assert store.lookup([1, 2]) == reference


# ---- the native lookup's library and a damaged store ----------------------------------------------


@needs_cc
def test_a_library_planted_where_the_native_lookup_is_built_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    """A shared library put at the lookup's path in the cache (its constructor would run on load) is not
    loaded: without the checksum recorded when specpipe built it, the lookup is built again."""
    from specpipe.native_cache import checksum_path, private_folder
    from specpipe.stores.manifest import sha256_file
    from specpipe.stores.suffix_lookup import library_name

    monkeypatch.setattr(token_datastore, "cache_root", lambda: tmp_path / "cache")
    marker = tmp_path / "planted-ran"
    planted = marker_library(private_folder(tmp_path / "cache" / "native") / library_name(), marker)
    planted_digest = sha256_file(planted)
    documents = [[1, 2, 3, 1, 2, 4], [2, 3, 1, 2]]
    store = TokenDatastore.from_documents(documents)
    assert not marker.exists()  # its constructor never ran
    assert store.native is not None, store.native_reason
    assert sha256_file(planted) != planted_digest and checksum_path(planted).read_text().strip() == sha256_file(planted)
    reference = TokenDatastore.from_documents(documents, native=False)
    assert store.lookup([1, 2]) == reference.lookup([1, 2]) and store.lookup([1, 2]).continuations
    again = TokenDatastore.from_documents(documents)  # the recorded library loads as it is
    assert again.native is not None and sha256_file(planted) == checksum_path(planted).read_text().strip()


def test_the_native_lookup_is_not_built_in_a_folder_others_can_write(tmp_path, monkeypatch):
    monkeypatch.setattr(token_datastore, "cache_root", lambda: tmp_path / "cache")
    folder = tmp_path / "cache" / "native"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    documents = [[1, 2, 3, 1, 2, 4], [2, 3, 1, 2]]
    store = TokenDatastore.from_documents(documents)
    assert store.native is None
    assert f"{folder} is writable by group/others" in store.native_reason and "chmod 700" in store.native_reason
    assert store.lookup([1, 2]) == TokenDatastore.from_documents(documents, native=False).lookup([1, 2])
    assert not list(folder.iterdir())  # nothing was built there
    folder.chmod(0o700)
    owner = folder.stat().st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)
    store = TokenDatastore.from_documents(documents)
    assert store.native is None and f"{folder} belongs to uid {owner}, not to you" in store.native_reason


def garble_middle(path: Path) -> None:
    """Overwrites bytes in the middle of `path`'s data with 0xFF.. patterns, keeping its size."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2 + 64
    data[middle:middle + 16] = b"\x7f\xff\xff\x7f" * 4
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["suffix_array.npy", "tokens.npy"])
@pytest.mark.parametrize("native", [True, False])
def test_a_store_garbled_without_changing_its_size_is_refused_naming_the_file(tmp_path, name, native):
    corpus = write_text(tmp_path / "a.txt", words([1, 2, 3, 1, 2, 4, 5, 6, 7, 8] * 20))
    builder, _ = build(tmp_path, [corpus])
    size = (builder.out / name).stat().st_size
    garble_middle(builder.out / name)
    assert (builder.out / name).stat().st_size == size
    with pytest.raises(StoreError, match=rf"{builder.out}.*{name}.*rebuild the store"):
        TokenDatastore.load(builder.out, TOKENIZER, native=native)


def test_a_store_whose_last_token_is_not_a_separator_is_refused(tmp_path):
    corpus = write_text(tmp_path / "a.txt", words([1, 2, 3, 1, 2, 4] * 20))
    builder, _ = build(tmp_path, [corpus])
    tokens = np.load(builder.out / "tokens.npy")
    tokens[-1] = 3
    np.save(builder.out / "tokens.npy", tokens)
    with pytest.raises(StoreError, match="tokens.npy is damaged: it does not end with the -1"):
        TokenDatastore.load(builder.out)


@pytest.mark.parametrize("name", ["suffix_array.npy", "tokens.npy"])
def test_a_garbled_shard_is_refused_naming_the_file(sharded_store, name):
    garble_middle(sharded_store / "shard-00001" / name)
    with pytest.raises(StoreError, match=rf"shard-00001.*{name}.*rebuild the store"):
        TokenDatastore.load(sharded_store, TOKENIZER)


@needs_cc
def test_the_native_lookup_reports_an_out_of_range_offset_instead_of_crashing(tmp_path):
    """The C lookup called on a suffix array with an offset far outside the tokens (validation bypassed):
    an error naming the store, never a signal. In a subprocess, so a crash fails this test alone."""
    script = f"""
from pathlib import Path
from specpipe.errors import StoreError
from specpipe.stores.suffix_lookup import NativeSuffixLookup
from specpipe.stores.token_datastore import TokenDatastore

# ids of 17 bits: 3 tokens a packed key, so longer contexts are narrowed by reading the tokens at each offset
a, b, c, d = 60001, 60002, 60003, 60004
store = TokenDatastore.from_documents([[a, b, c, a, b, d] * 50, [b, c, a, b]], native=False)
library, reason = NativeSuffixLookup.build(Path({str(tmp_path / "native")!r}))
assert library is not None, reason
for value in (1 << 30, -5, len(store.tokens), len(store.tokens) - 1 + (1 << 20)):
    suffix_array = store.suffix_array.copy()
    suffix_array[:] = value
    lookup = NativeSuffixLookup(library, store.tokens, suffix_array, store.prefix_keys, store.key_bits,
                                where="/stores/broken")
    try:
        for context in ([a, b, c, a, b], [b, c], [d, a, b, c, a, b, d, a], [c, a, b, d, a, b, c, a]):
            lookup.lookup(context, 16, 1, 8, 8, 256)
    except StoreError as error:
        assert "/stores/broken" in str(error), error
        print("refused", value)
    else:
        print("not detected", value)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.split("\n").count("not detected") == 0 and result.stdout.count("refused") == 4, result.stdout


# ---- where a store is written ----------------------------------------------------------------------


BAD_STORE_NAMES = ["../../../somewhere", "a/b", "..", ".", ".hidden", "", "/abs", "a\\b"]


@pytest.mark.parametrize("name", BAD_STORE_NAMES)
def test_a_store_name_that_is_not_a_plain_name_is_refused(tmp_path, monkeypatch, name):
    """store.name picks a folder inside <cache>/stores: a path there would write (or read) outside it."""
    monkeypatch.setattr(token_datastore, "cache_root", lambda: tmp_path / "cache")
    corpus = write_text(tmp_path / "a.txt", words([1, 2, 3]))
    with pytest.raises(ConfigError, match="store.name.*plain name"):
        TokenDatastoreBuilder(TOKENIZER, [str(corpus)], name=name, progress=False)
    with pytest.raises(ConfigError, match="plain name"):
        token_datastore.default_store_path(name)
    assert not (tmp_path / "cache").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
    assert token_datastore.default_store_path("chat_distill-47b7fe8633c2") == tmp_path / "cache" / "stores" / \
        "chat_distill-47b7fe8633c2"


def test_a_store_out_that_is_a_file_is_refused_before_any_work(tmp_path):
    corpus = write_text(tmp_path / "a.txt", words([1, 2, 3]))
    target = write_text(tmp_path / "notes.txt", "keep me")
    with pytest.raises(ConfigError, match=rf"store.out={target} is a file.*folder"):
        TokenDatastoreBuilder(TOKENIZER, [str(corpus)], out=str(target), progress=False)
    assert target.read_text() == "keep me"


def test_the_build_store_task_refuses_a_bad_name_or_out_before_loading_the_model(tmp_path, monkeypatch):
    import specpipe.tasks.build_store as build_store

    def no_model(cfg):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(build_store, "load_model", no_model)
    target = write_text(tmp_path / "notes.txt", "keep me")
    overrides = ["model=tiny_random", "task=build_store", store_override("tokens_from_files"),
                 f"store.sources=[{tmp_path}]"]
    with pytest.raises(ConfigError, match="store.name.*plain name"):
        run_build_store(compose_config([*overrides, "store.name=../../../somewhere"]))
    with pytest.raises(ConfigError, match="is a file"):
        run_build_store(compose_config([*overrides, f"store.out={target}"]))


def test_a_build_removes_the_staging_folders_of_killed_builds_and_keeps_live_ones(tmp_path):
    """A build killed midway leaves `.<name>.building-<pid>-<hex>` (the whole staged store) beside the store;
    the next build of that store removes those whose process is gone, and leaves a running build's alone."""
    corpus = write_text(tmp_path / "corpus" / "a.txt", words([1, 2, 3, 1, 2, 4]))
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        killed = tmp_path / f".store.building-{finished.pid}-0123abcd"
        (killed / "tokens.npy").parent.mkdir()
        (killed / "tokens.npy").write_bytes(b"\0" * 1000)
        live = tmp_path / f".store.building-{running.pid}-89abcdef"
        live.mkdir()
        mine = tmp_path / f".store.building-{os.getpid()}-fedcba98"
        mine.mkdir()
        other_store = tmp_path / f".other.building-{finished.pid}-0123abcd"
        other_store.mkdir()
        resumable = tmp_path / ".store.building-sharded"  # an interrupted sharded build's, kept to resume
        resumable.mkdir()
        build(tmp_path, [corpus])
        assert not killed.exists()
        assert live.is_dir() and mine.is_dir() and other_store.is_dir() and resumable.is_dir()
        assert TokenDatastore.load(tmp_path / "store").count([1, 2]) == 2
    finally:
        running.kill()
        running.wait()


@pytest.mark.parametrize("damage", ["no bytes", "no sha256", "files as a list", "bytes as text", "fingerprint as a list",
                                    "stats as a list", "a name outside the store"])
def test_a_manifest_of_the_wrong_shape_is_refused_naming_it(built_store, damage):
    path = built_store / MANIFEST
    manifest = json.loads(path.read_text())
    files = manifest["files"]
    if damage == "no bytes":
        del files["tokens.npy"]["bytes"]
    elif damage == "no sha256":
        del files["suffix_array.npy"]["sha256"]
    elif damage == "files as a list":
        manifest["files"] = sorted(files)
    elif damage == "bytes as text":
        files["tokens.npy"]["bytes"] = "480"
    elif damage == "fingerprint as a list":
        manifest["fingerprint"] = []
    elif damage == "stats as a list":
        manifest["stats"] = []
    else:
        files["../../outside.npy"] = files["tokens.npy"]
    path.write_text(json.dumps(manifest))
    for verify_checksums in (False, True):
        with pytest.raises(StoreError, match=rf"{path}.*rebuild the store"):
            TokenDatastore.load(built_store, TOKENIZER, verify_checksums=verify_checksums)


def test_a_cache_where_no_folder_can_be_made_keeps_the_numpy_lookup(tmp_path, monkeypatch):
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    monkeypatch.setattr(token_datastore, "cache_root", lambda: tmp_path / "cache")
    store = TokenDatastore.from_documents([[1, 2, 3, 1, 2, 4]])
    assert store.native is None and "could not be built" in store.native_reason
    assert store.lookup([1, 2]).continuations
