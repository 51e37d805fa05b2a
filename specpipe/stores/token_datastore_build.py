"""Writing a token datastore's folder: `build_token_datastore` from token-id documents, and
`TokenDatastoreBuilder` (`task=build_store store=tokens_from_files`) from the user's files, each written
atomically through `specpipe.stores.manifest.write_store` so nothing at the destination changes unless the
whole build succeeds. A corpus whose suffix sort would not fit in memory is cut at document boundaries into
shards of about `shard_tokens` tokens, each sorted and written before the next is read (a build holds one
shard at a time); an interrupted sharded build of `TokenDatastoreBuilder` keeps its finished shards in
`.<name>.building-sharded/` next to the store, and a rerun with the same sources and settings resumes after them.
"""
from __future__ import annotations

import fcntl
import itertools
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from specpipe.errors import ConfigError, StoreError
from specpipe.stores.manifest import (MANIFEST, StoreManifest, check_output_folder, check_store_name, read_manifest,
                                      tokenizer_fingerprint, verify_files, write_store)
from specpipe.stores.token_corpus import corpus_files, read_documents
from specpipe.stores.token_datastore import default_store_path
from specpipe.stores.token_datastore_format import (FORMAT_VERSION, KIND, PREFIX_KEYS_FILE, SHARDED_FORMAT_VERSION,
                                                    SUFFIX_ARRAY_FILE, TOKENS_FILE)
from specpipe.stores.token_datastore_index import concatenate_documents, index_tokens, shards_of


def build_token_datastore(out: str | Path, documents: Iterable[Sequence[int]], fingerprint: dict,
                          sources: Sequence[str] = (), progress: bool = True,
                          shard_tokens: int | None = None) -> StoreManifest:
    """Builds a token datastore from token-id documents (e.g. a corpus shipped as ids).

    `fingerprint` is the tokenizer's (`tokenizer_fingerprint`); ids at or above its vocab_size
    are refused. `shard_tokens`: cut into shards of about that many tokens (None: one suffix
    array). Nothing at `out` changes unless the whole build succeeds; an interrupted build starts
    over (an iterable cannot be checked to be the same again: `TokenDatastoreBuilder` resumes).
    """
    started = time.perf_counter()
    if shard_tokens is None:
        tokens, document_count = concatenate_documents(documents, fingerprint.get("vocab_size"))
        return _write(Path(out), tokens, document_count, fingerprint, list(sources), started, progress)
    _check_shard_tokens(shard_tokens)
    numbered = enumerate(documents)  # read once: without a resume key the build always starts at document 0
    return _write_sharded(Path(out), lambda resume_at: numbered, fingerprint, list(sources), shard_tokens, started,
                          progress, resume_key=None)


def _check_shard_tokens(shard_tokens) -> None:
    if shard_tokens is not None and (isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int)
                                     or shard_tokens < 1):
        raise ConfigError(f"store.shard_tokens must be a positive number of tokens per shard, or null for one "
                          f"suffix array; got {shard_tokens!r}")


def _write(out: Path, tokens: np.ndarray, document_count: int, fingerprint: dict, sources: list[str],
           started: float, progress: bool, extra_stats: dict | None = None) -> StoreManifest:
    def write_files(staging: Path) -> dict:
        if progress:
            tqdm.write(f"token_datastore: sorting the suffixes of {len(tokens) - document_count:,} tokens"
                       f"{f' ({out.name})' if extra_stats else ''}", file=sys.stderr)
        suffix_array, prefix_keys, key_bits = index_tokens(tokens)
        for name, array in ((TOKENS_FILE, tokens), (SUFFIX_ARRAY_FILE, suffix_array), (PREFIX_KEYS_FILE, prefix_keys)):
            np.save(staging / name, array, allow_pickle=False)
        return {"token_count": int(len(suffix_array)), "documents": document_count, "key_bits": key_bits,
                "build_seconds": round(time.perf_counter() - started, 3),
                "bytes": sum(path.stat().st_size for path in staging.iterdir()), **(extra_stats or {})}

    return write_store(out, KIND, FORMAT_VERSION, fingerprint, write_files, sources)


def _shard_name(number: int) -> str:
    return f"shard-{number:05d}"


def _write_sharded(out: Path, documents_from: Callable[[int], Iterable[tuple[int, Sequence[int]]]],
                   fingerprint: dict, sources: list[str], shard_tokens: int, started: float, progress: bool,
                   resume_key: dict | None) -> StoreManifest:
    """Builds a sharded store at `out`: `documents_from(n)` gives the (number, ids) documents from
    number n on; each shard is indexed and written (a complete store, atomically) before the next
    is read, and the folder of shards is swapped in whole at the end.

    With a `resume_key` (what identifies the corpus and the settings), the shards are staged in
    `.<name>.building-sharded/`, which outlives a failed run: a rerun with the same key skips the
    documents of the shards it finds finished there. Without one, a failure discards them.
    """
    def write_files(staging: Path) -> dict:
        finished = _finished_shards(staging, fingerprint)
        resume_at = finished[-1].stats["source_end"] if finished else 0
        if finished and progress:
            tqdm.write(f"token_datastore: resuming the build of {out}: {len(finished)} shards done, from "
                       f"document {resume_at:,}", file=sys.stderr)
        for tokens, document_count, source_end in shards_of(documents_from(resume_at), shard_tokens,
                                                            fingerprint.get("vocab_size")):
            finished.append(_write(staging / _shard_name(len(finished)), tokens, document_count, fingerprint, [],
                                   time.perf_counter(), progress, {"source_end": source_end}))
            del tokens  # let the next shard's tokens take its place rather than sit beside it
        if not finished:
            raise StoreError("the corpus holds no tokens: every source is empty, so there is nothing to index")
        shards = [{"name": _shard_name(number), "token_count": manifest.stats["token_count"],
                   "documents": manifest.stats["documents"]} for number, manifest in enumerate(finished)]
        return {"token_count": sum(shard["token_count"] for shard in shards),
                "documents": sum(shard["documents"] for shard in shards), "shards": shards,
                "shard_tokens": shard_tokens, "build_seconds": round(time.perf_counter() - started, 3),
                "bytes": sum(path.stat().st_size for path in staging.rglob("*") if path.is_file())}

    if resume_key is None:
        return write_store(out, KIND, SHARDED_FORMAT_VERSION, fingerprint, write_files, sources)
    staging = out.parent / f".{out.name}.building-sharded"
    with _resumable(staging, resume_key, out):
        return write_store(out, KIND, SHARDED_FORMAT_VERSION, fingerprint, write_files, sources, staging=staging)


@contextmanager
def _resumable(staging: Path, key: dict, out: Path) -> Iterator[None]:
    """Holds the lock of the staging folder `staging` (a sibling `.json` file recording `key`) for
    one build; empties the folder when it was started for another key. The record is removed when
    the build succeeds and kept, with the folder, when it fails."""
    staging.parent.mkdir(parents=True, exist_ok=True)
    record = staging.parent / f"{staging.name}.json"
    with open(record, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreError(f"another build of {out} is running (it holds {record}); wait for it to finish or "
                             f"stop it") from None
        handle.seek(0)
        try:
            previous = json.loads(handle.read() or "null")
        except json.JSONDecodeError:
            previous = None
        if previous != key:  # other sources or settings: its shards would be other cuts of other text
            shutil.rmtree(staging, ignore_errors=True)
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps(key, sort_keys=True))
            handle.flush()
        yield
        record.unlink(missing_ok=True)  # still locked by this handle until it closes


def _finished_shards(staging: Path, fingerprint: dict) -> list[StoreManifest]:
    """The manifests of the shards a previous run completed in `staging` (consecutive from the
    first, each whole); everything else there is removed: a shard cut off mid-write, one after a
    gap, a stray file."""
    finished: list[StoreManifest] = []
    while (staging / _shard_name(len(finished)) / MANIFEST).is_file():
        folder = staging / _shard_name(len(finished))
        try:
            manifest = read_manifest(folder, KIND, FORMAT_VERSION)
            verify_files(folder, manifest, checksums=False)
        except StoreError:
            break
        if manifest.fingerprint != fingerprint or not isinstance(manifest.stats.get("source_end"), int):
            break
        finished.append(manifest)
    keep = {_shard_name(number) for number in range(len(finished))}
    for entry in list(staging.iterdir()):
        if entry.name in keep:
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return finished


class TokenDatastoreBuilder:
    """`task=build_store store=tokens_from_files`: a token datastore over the user's files.

    Sources are files or folders (searched recursively for .jsonl, .parquet, .txt, .md).
    A JSONL record or Parquet row gives token ids (`ids_field`, taken as they are), text
    (`text_field`), or a chat: `turns` (strings) or `messages` ({role, content}), one
    document per turn. A text or markdown file is one document.

    `shard_tokens`: None builds one suffix array (the whole corpus in memory while it sorts, ~55
    bytes per token at peak); a number streams the corpus into shards of about that many tokens,
    each sorted and written before the next is read, so memory is bounded by one shard. A sharded
    build that is interrupted resumes from its finished shards when rerun with the same sources
    (same paths, sizes and modification times) and settings.
    """

    def __init__(self, tokenizer, sources: Sequence[str] | str | None = None, out: str | None = None,
                 name: str = "tokens_from_files", text_field: str = "text", ids_field: str = "input_ids",
                 batch_size: int = 64, progress: bool = True, shard_tokens: int | None = None) -> None:
        if isinstance(sources, str):
            sources = [sources]
        self.sources = [str(source) for source in sources or ()]
        if not self.sources:  # `sources: ???` left unset in the config arrives here as None
            raise ConfigError("a token datastore needs sources: add store.sources=[FILE_OR_FOLDER,...] "
                              "(.jsonl, .parquet, .txt, .md files, or folders of them)")
        if batch_size < 1:
            raise ConfigError(f"store.batch_size must be >= 1, got {batch_size}")
        _check_shard_tokens(shard_tokens)
        self.tokenizer = tokenizer
        self.out = check_output_folder(out) if out else default_store_path(check_store_name(name))
        self.text_field = text_field
        self.ids_field = ids_field
        self.batch_size = batch_size
        self.progress = progress
        self.shard_tokens = shard_tokens

    def build(self) -> StoreManifest:
        started = time.perf_counter()
        files = corpus_files(self.sources)  # every path checked before anything is read or written
        fingerprint = tokenizer_fingerprint(self.tokenizer)
        sources = [str(path) for path in files]
        bar = tqdm(desc="token_datastore: tokenizing", unit=" doc", file=sys.stderr, disable=not self.progress)
        try:
            if self.shard_tokens is not None:
                return _write_sharded(self.out, lambda resume_at: self._tokenized(files, bar, resume_at), fingerprint,
                                      sources, self.shard_tokens, started, self.progress,
                                      self._resume_key(files, fingerprint))
            tokens, document_count = concatenate_documents((ids for _, ids in self._tokenized(files, bar)),
                                                           len(self.tokenizer))
        finally:
            bar.close()
        return _write(self.out, tokens, document_count, fingerprint, sources, started, self.progress)

    def _resume_key(self, files: list[Path], fingerprint: dict) -> dict:
        """What an interrupted sharded build must share with its rerun: the same documents cut the same way."""
        sources = []
        for path in files:
            stat = path.stat()
            sources.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
        return {"format_version": SHARDED_FORMAT_VERSION, "fingerprint": fingerprint, "shard_tokens": self.shard_tokens,
                "text_field": self.text_field, "ids_field": self.ids_field, "sources": sources}

    def _tokenized(self, files: list[Path], bar, first: int = 0) -> Iterator[tuple[int, Sequence[int]]]:
        """(number, token ids) per document, in file order from document `first` on (those before
        are read, not tokenized), counted on the progress bar."""
        token_total, number = 0, first
        bar.update(first)
        for batch in self._batches(files, first):
            token_total += sum(len(ids) for ids in batch)
            bar.update(len(batch))
            bar.set_postfix(tokens=f"{token_total:,}", refresh=False)
            for ids in batch:
                yield number, ids
                number += 1

    def _batches(self, files: list[Path], first: int = 0) -> Iterator[list[Sequence[int]]]:
        """Texts are tokenized `batch_size` at a time; documents given as ids pass through."""
        texts: list[str] = []
        documents = (document for path in files for document in read_documents(path, self.text_field, self.ids_field))
        for document in itertools.islice(documents, first, None):
            if isinstance(document, str):
                texts.append(document)
                if len(texts) == self.batch_size:
                    yield self._encode(texts)
                    texts = []
                continue
            if texts:  # keep file order: the texts read before these ids go first
                yield self._encode(texts)
                texts = []
            yield [document]
        if texts:
            yield self._encode(texts)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        # verbose=False: long documents are fine here (no model sees them whole); no length warning
        return self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
