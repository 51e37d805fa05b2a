"""Reading the user's corpus files into documents for a token datastore build: which files a list of
sources names (files, or folders searched recursively for .jsonl, .parquet, .txt and .md), and the documents
each file holds, as text to tokenize or as token ids the file carries. The supported formats, and the errors
that name the file and line a corpus cannot be read at, live here apart from the sorting and writing of
`specpipe.stores.token_datastore_build`.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from specpipe.errors import ConfigError, StoreError

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
CORPUS_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES


def corpus_files(sources: Sequence[str]) -> list[Path]:
    """The corpus files named by `sources` (files, or folders searched recursively), in order."""
    files: list[Path] = []
    for source in sources:
        path = Path(source).expanduser()
        if not path.exists():
            raise ConfigError(f"corpus source {source} does not exist")
        if path.is_dir():
            found = sorted(candidate for candidate in path.rglob("*")
                           if candidate.is_file() and candidate.suffix.lower() in CORPUS_SUFFIXES
                           and not any(part.startswith(".") for part in candidate.relative_to(path).parts))
            if not found:
                raise ConfigError(f"corpus folder {source} holds no {', '.join(CORPUS_SUFFIXES)} files")
            files.extend(found)
        elif path.suffix.lower() in CORPUS_SUFFIXES:
            files.append(path)
        else:
            raise ConfigError(f"corpus source {source}: unsupported file type {path.suffix!r}; "
                              f"use {', '.join(CORPUS_SUFFIXES)} files or a folder of them")
    return files


def read_documents(path: Path, text_field: str = "text", ids_field: str = "input_ids") -> Iterator[str | list[int]]:
    """The documents of one corpus file: text, or token ids when the file carries them."""
    suffix = path.suffix.lower()
    try:
        if suffix in TEXT_SUFFIXES:
            yield path.read_text(encoding="utf-8")
        elif suffix in JSONL_SUFFIXES:
            yield from _jsonl_documents(path, text_field, ids_field)
        else:
            yield from _parquet_documents(path, text_field, ids_field)
    except StoreError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as error:  # pyarrow's errors are OSError/ValueError kinds
        raise StoreError(f"cannot read corpus file {path}: {type(error).__name__}: {error}") from None


def _jsonl_documents(path: Path, text_field: str, ids_field: str) -> Iterator[str | list[int]]:
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise StoreError(f"cannot read corpus file {path}: line {line_number} is not JSON ({error})") from None
            yield from _record_documents(record, text_field, ids_field, f"{path} line {line_number}")


def _record_documents(record, text_field: str, ids_field: str, where: str) -> Iterator[str | list[int]]:
    if isinstance(record, str):
        yield record
        return
    if not isinstance(record, dict):
        raise StoreError(f"{where}: expected a JSON object or string, got {type(record).__name__}")
    if record.get(ids_field) is not None:
        ids = record[ids_field]
        if not isinstance(ids, list) or not all(isinstance(token, int) for token in ids):
            raise StoreError(f"{where}: {ids_field!r} must be a list of token ids")
        yield ids
    elif isinstance(record.get(text_field), str):
        yield record[text_field]
    elif isinstance(record.get("turns"), list):
        yield from (turn for turn in record["turns"] if isinstance(turn, str))
    elif isinstance(record.get("messages"), list):
        for message in record["messages"]:
            content = message.get("content") if isinstance(message, dict) else message
            if isinstance(content, str):
                yield content
    else:
        raise StoreError(f"{where}: no {text_field!r} text, {ids_field!r} ids, 'turns' or 'messages' "
                         f"(fields: {sorted(record)}); set store.text_field=NAME")


def _parquet_documents(path: Path, text_field: str, ids_field: str) -> Iterator[str | list[int]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    names = parquet.schema_arrow.names
    column = ids_field if ids_field in names else text_field if text_field in names else None
    if column is None:
        raise StoreError(f"cannot read corpus file {path}: no {text_field!r} (text) or {ids_field!r} (token ids) "
                         f"column (columns: {names}); set store.text_field=NAME")
    for batch in parquet.iter_batches(columns=[column], batch_size=1024):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield value
