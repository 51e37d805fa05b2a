"""Document collections for the dense store and the chunker that cuts them into passages.

A collection is a list of sources: `pydoc` (Python's own documentation, `pydoc_data.topics`,
shipped with every Python), a JSONL file (one object per line, a text field plus optional title
and metadata fields), a Parquet file (a text column), a .txt/.md file, or a folder of any of these
(searched recursively). Any unreadable input is an error naming the file (and line): a store
silently missing part of its collection answers questions wrongly with no sign why.

Chunks are spans of one document's text: paragraphs and sentences packed up to `chunk_size`
(characters, or tokens of the embedding model, which cuts its input at 256 tokens), consecutive
chunks sharing up to `overlap` of trailing text so an answer that straddles a boundary is whole
in one of them.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specpipe.errors import ConfigError, StoreError

PYDOC_SOURCE = "pydoc"
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES

# Blank lines end paragraphs; a newline or sentence-ending punctuation followed by space ends a piece.
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n\s*")
_PIECE_BREAK = re.compile(r"(?<=[.!?])\s+|\s*\n\s*")
# An RST/pydoc heading: a line underlined by a row of *, = or -.
_UNDERLINED_HEADING = re.compile(r"^\s*(\S[^\n]*)\n[*=\-]{3,}\s*$", re.MULTILINE)
_MARKDOWN_HEADING = re.compile(r"^#{1,6}\s+(\S[^\n]*)$", re.MULTILINE)


@dataclass(frozen=True)
class Document:
    source: str  # the file it came from, or "pydoc"
    title: str  # what a reader would call it: heading, title field, topic name, file name
    text: str
    metadata: dict = field(default_factory=dict)  # JSON-serialisable extra fields


@dataclass(frozen=True)
class Chunk:
    source: str
    title: str
    start: int  # character offsets of the chunk in its document's text: text == document.text[start:end]
    end: int
    text: str
    metadata: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------- collections


@dataclass(frozen=True)
class CollectionFormat:
    """Which fields of JSONL objects / Parquet columns hold what."""

    text_field: str = "text"
    title_field: str = "title"  # optional in the data: the title falls back to file name and line
    metadata_fields: tuple[str, ...] = ()  # copied into each chunk's metadata when present


def read_collection(sources: list[str], fmt: CollectionFormat = CollectionFormat()) -> Iterator[Document]:
    """Every document of every source, in a stable order (folders sorted)."""
    if not sources:
        raise StoreError("the document collection names no sources; give at least one file, folder or `pydoc`")
    for source in sources:
        source = str(source)
        if source == PYDOC_SOURCE:
            yield from read_pydoc()
            continue
        path = Path(source).expanduser()
        if not path.exists():
            raise StoreError(f"document source {source} does not exist")
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUPPORTED_SUFFIXES
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            for file in files:
                yield from read_file(file, fmt)
        else:
            yield from read_file(path, fmt)


def read_pydoc() -> Iterator[Document]:
    """Python's own documentation: `pydoc_data.topics.topics`, topic name -> plain text."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise StoreError("this Python has no pydoc_data package (some distributions strip it); build the "
                         "store from your own files instead") from None
    for topic in sorted(topics):
        text = topics[topic]
        heading = _UNDERLINED_HEADING.search(text[:400])
        yield Document(PYDOC_SOURCE, heading.group(1).strip() if heading else topic, text, {"topic": topic})


def read_file(path: Path, fmt: CollectionFormat) -> Iterator[Document]:
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        yield _read_text_file(path)
    elif suffix in JSONL_SUFFIXES:
        yield from _read_jsonl(path, fmt)
    elif suffix in PARQUET_SUFFIXES:
        yield from _read_parquet(path, fmt)
    else:
        raise StoreError(f"cannot read document {path}: unsupported file type {suffix or '(none)'}; "
                         f"supported: {', '.join(SUPPORTED_SUFFIXES)}")


def _read_utf8(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise StoreError(f"cannot read document {path}: not UTF-8 text (byte {error.start}: "
                         f"{error.reason}); convert it to UTF-8 or leave it out") from None
    except OSError as error:
        raise StoreError(f"cannot read document {path}: {error.strerror or error}") from None


def _read_text_file(path: Path) -> Document:
    text = _read_utf8(path)
    heading = _MARKDOWN_HEADING.search(text) or _UNDERLINED_HEADING.search(text)
    return Document(str(path), heading.group(1).strip() if heading else path.stem, text)


def _read_jsonl(path: Path, fmt: CollectionFormat) -> Iterator[Document]:
    for number, line in enumerate(_read_utf8(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise StoreError(f"cannot read document {where}: invalid JSON "
                             f"({error.msg}, column {error.colno})") from None
        if not isinstance(record, dict):
            raise StoreError(f"cannot read document {where}: expected a JSON object, got {type(record).__name__}")
        yield _record_document(record, str(path), where, fmt)


def _read_parquet(path: Path, fmt: CollectionFormat) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as error:
        raise StoreError(f"cannot read document collection {path}: not a readable Parquet file ({error})") from None
    if fmt.text_field not in table.column_names:
        raise StoreError(f"{path} has no text column {fmt.text_field!r} (columns: {table.column_names}); "
                         f"set text_field to the column holding the text")
    for number, record in enumerate(table.to_pylist()):
        yield _record_document(record, str(path), f"{path} row {number}", fmt)


def _record_document(record: dict, source: str, where: str, fmt: CollectionFormat) -> Document:
    text = record.get(fmt.text_field)
    if not isinstance(text, str):
        found = "missing" if text is None else f"a {type(text).__name__}"
        raise StoreError(f"cannot read document {where}: its text field {fmt.text_field!r} is {found} "
                         f"(fields: {sorted(record)}); set text_field to the field holding the text")
    title = record.get(fmt.title_field)
    metadata = {name: record[name] for name in fmt.metadata_fields if name in record}
    try:
        json.dumps(metadata)
    except TypeError as error:
        raise StoreError(f"cannot read document {where}: metadata is not JSON-serialisable ({error})") from None
    return Document(source, str(title) if title not in (None, "") else where.rsplit("/", 1)[-1], text, metadata)


# ------------------------------------------------------------------------------------ chunking


@dataclass(frozen=True)
class _Piece:
    start: int
    end: int
    opens_paragraph: bool


class Chunker:
    """Packs paragraphs and sentences of a document into chunks of at most `chunk_size`.

    `measure(texts) -> sizes` is the unit: `len` per text for characters, the embedding model's
    token counts for tokens. The text is cut into pieces (sentences and lines; a piece longer than
    a chunk is split at spaces, a word longer than a chunk at characters), and chunks are runs of
    consecutive pieces: a chunk ends early at a paragraph break once it is half full, and the next
    chunk restarts at the latest pieces that total at most `overlap`, so consecutive chunks share
    whole sentences rather than cut words. In tokens, a chunk's size is the sum of its pieces'
    (exact for tokenizers that split at whitespace, such as BERT's).
    """

    def __init__(self, chunk_size: int, overlap: int, measure: Callable[[list[str]], list[int]],
                 in_characters: bool):
        if chunk_size < 1:
            raise ConfigError(f"chunk_size must be at least 1, got {chunk_size}")
        if not 0 <= overlap < chunk_size:
            raise ConfigError(f"overlap must be in [0, chunk_size={chunk_size}), got {overlap}")
        self.chunk_size = int(chunk_size)
        self.overlap = int(overlap)
        self.measure = measure
        self.in_characters = in_characters

    @classmethod
    def characters(cls, chunk_size: int, overlap: int) -> "Chunker":
        return cls(chunk_size, overlap, lambda texts: [len(text) for text in texts], in_characters=True)

    def chunk(self, document: Document) -> list[Chunk]:
        text = document.text
        pieces, sizes = self._pieces(text)
        if not pieces:
            return []
        # In characters the whitespace between two pieces belongs to the chunk holding both.
        gaps = [0] + [pieces[k].start - pieces[k - 1].end if self.in_characters else 0 for k in range(1, len(pieces))]
        prefix = np.concatenate([[0], np.cumsum(np.add(sizes, gaps))])  # [n + 1]

        def span_size(first: int, stop: int) -> int:  # pieces first .. stop-1
            return int(prefix[stop] - prefix[first] - gaps[first])

        chunks, first = [], 0
        while first < len(pieces):
            stop = first + 1
            while stop < len(pieces) and span_size(first, stop + 1) <= self.chunk_size:
                stop += 1
            if stop < len(pieces):  # not the document's end: prefer ending at a paragraph break
                breaks = [k for k in range(first + 1, stop) if pieces[k].opens_paragraph
                          and span_size(first, k) * 2 >= self.chunk_size]
                stop = breaks[-1] if breaks else stop
            start, end = pieces[first].start, pieces[stop - 1].end
            chunks.append(Chunk(document.source, document.title, start, end, text[start:end],
                                {**document.metadata, "chunk": len(chunks)}))
            if stop == len(pieces):
                break
            # The next chunk restarts at the earliest piece from which the overlap fits, and must
            # still have room for the piece after this chunk (else it would not move forward).
            following = first + 1
            while following < stop and (span_size(following, stop) > self.overlap
                                        or span_size(following, stop + 1) > self.chunk_size):
                following += 1
            first = following
        return chunks

    def _pieces(self, text: str) -> tuple[list[_Piece], list[int]]:
        """Sentences and lines of `text`, each no larger than a chunk, with their sizes."""
        spans = []
        for para_start, para_end in _spans_between(_PARAGRAPH_BREAK, text, 0, len(text)):
            for index, (start, end) in enumerate(_spans_between(_PIECE_BREAK, text, para_start, para_end)):
                spans.append(_Piece(start, end, opens_paragraph=index == 0))
        sizes = self.measure([text[p.start:p.end] for p in spans]) if spans else []
        pieces, fitted_sizes = [], []
        for piece, size in zip(spans, sizes):
            if size <= self.chunk_size:
                pieces.append(piece)
                fitted_sizes.append(size)
                continue
            for k, (start, end, part_size) in enumerate(self._split_oversized(text, piece.start, piece.end)):
                pieces.append(_Piece(start, end, opens_paragraph=piece.opens_paragraph and k == 0))
                fitted_sizes.append(part_size)
        return pieces, fitted_sizes

    def _split_oversized(self, text: str, start: int, end: int) -> list[tuple[int, int, int]]:
        """(start, end, size) spans covering text[start:end]: groups of words (half an overlap each,
        so consecutive chunks still share text inside one long sentence), and a word larger than a
        chunk cut by characters."""
        limit = self.chunk_size if self.overlap == 0 else max(1, self.overlap // 2)
        words = [(start + m.start(), start + m.end()) for m in re.finditer(r"\S+", text[start:end])]
        sizes = self.measure([text[a:b] for a, b in words])
        spans: list[tuple[int, int, int]] = []
        group: list[int] = []  # [start, end, size] of the group being filled
        for (a, b), size in zip(words, sizes):
            if size > self.chunk_size:
                if group:
                    spans.append(tuple(group))
                    group = []
                # A token covers at least one character, so chunk_size characters fit in any unit.
                for s in range(a, b, self.chunk_size):
                    part = (s, min(s + self.chunk_size, b))
                    spans.append((*part, self.measure([text[part[0]:part[1]]])[0]))
                continue
            added = size + (a - group[1] if self.in_characters and group else 0)
            if group and group[2] + added <= limit:
                group[1], group[2] = b, group[2] + added
            else:
                if group:
                    spans.append(tuple(group))
                group = [a, b, size]
        if group:
            spans.append(tuple(group))
        return spans


def _spans_between(separator: re.Pattern, text: str, start: int, end: int) -> list[tuple[int, int]]:
    """The non-blank spans of text[start:end] between matches of `separator`, stripped of whitespace."""
    spans, cursor = [], start
    for match in separator.finditer(text, start, end):
        spans.append((cursor, match.start()))
        cursor = match.end()
    spans.append((cursor, end))
    stripped = []
    for a, b in spans:
        while a < b and text[a].isspace():
            a += 1
        while b > a and text[b - 1].isspace():
            b -= 1
        if a < b:
            stripped.append((a, b))
    return stripped
