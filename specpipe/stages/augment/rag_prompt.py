"""RAG: the question retrieves the top-k chunks of a document store, and they go into the prompt
through a template. The augmented prompt is what the target answers and what the n-gram
retrievers draft from (an answer grounded in documents copies from them)."""
from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from specpipe import distributed
from specpipe.errors import InvalidRequest
from specpipe.models import resolve_device
from specpipe.stores.document_store import DocumentStore, RetrievedChunk, ensure_default_store
from specpipe.stores.embedder import DEFAULT_CACHE_CHUNKS, CachedEmbedder, EmbeddingCache

DEFAULT_TEMPLATE = ("Answer the question using the documentation excerpts below.\n\n{context}\n\n"
                    "Question: {question}")
DEFAULT_CHUNK_TEMPLATE = "[{rank}] {title}\n{text}"

Documents = Iterable[str] | DocumentStore | None


class RagPrompt:
    """Retrieves chunks for a question and renders the augmented prompt.

    The store is `path` (built by `task=build_store`), or the default store of Python's
    documentation when `path` is null, built on first use. It loads at the first retrieval, so
    building a pipeline stays cheap. A request may bring its own documents instead: a list of
    strings (chunked and embedded in memory) or a DocumentStore the application built or loaded.
    The embeddings of documents' chunks are kept for later requests (`embedding_cache_chunks` of
    them at most, the least recently used dropped first; 0 keeps none): an application that sends the
    same documents with every question has them embedded once.
    """

    def __init__(self, path: str | None = None, k: int = 3, draft_k: int | None = None, template: str = DEFAULT_TEMPLATE,
                 chunk_template: str = DEFAULT_CHUNK_TEMPLATE, min_score: float = -1.0,
                 embedder_path: str | None = None, embedder_device: str = "cpu", index_device: str = "cpu",
                 store: DocumentStore | None = None, embedding_cache_chunks: int = DEFAULT_CACHE_CHUNKS) -> None:
        if k < 1 or (draft_k is not None and draft_k < k):
            raise ValueError(f"augment: need 1 <= k <= draft_k, got k={k}, draft_k={draft_k}")
        for field in ("{context}", "{question}"):
            if field not in template:
                raise ValueError(f"augment.template must contain {field}, got {template!r}")
        try:
            template.format(context="", question="")
        except (KeyError, IndexError) as error:
            raise ValueError(f"augment.template has an unknown field {error}; use {{context}} and {{question}}") \
                from None
        self.path = Path(path).expanduser() if path else None
        self.k = k  # chunks written into the prompt
        self.draft_k = draft_k or k  # chunks retrieved: the first k go into the prompt, all are drafted from
        self.template = template
        self.chunk_template = chunk_template
        self.min_score = min_score  # chunks scoring below it are left out of the prompt
        self.embedder_path = embedder_path
        self.embedder_device = embedder_device
        self.index_device = index_device
        self._store = store
        self._embedder = store.embedder if store is not None else None
        self._loading = threading.Lock()
        try:
            self.embedding_cache = EmbeddingCache(embedding_cache_chunks)
        except ValueError as error:
            raise ValueError(f"augment.embedding_cache_chunks: {error}") from None

    @property
    def embedder(self):
        """The embedding model (loaded once, at first use): questions and in-memory documents."""
        with self._loading:
            if self._embedder is None:
                from specpipe.stores.embedder import SentenceEmbedder

                device = resolve_device(self.embedder_device)  # `auto`: a GPU when there is one
                self._embedder = SentenceEmbedder(self.embedder_path, device=str(device))
            return self._embedder

    @property
    def store(self) -> DocumentStore:
        embedder = self.embedder
        with self._loading:
            if self._store is None:
                with distributed.main_process_first():  # under torchrun one rank builds the default store
                    self._store = DocumentStore.load(self.path, embedder, index_device=self.index_device) \
                        if self.path else ensure_default_store(embedder, index_device=self.index_device)
            return self._store

    def retrieve(self, question: str, documents: Documents = None, k: int | None = None) -> list[RetrievedChunk]:
        """The top chunks for `question` (`draft_k` of them unless k is given, a positive int): from
        `documents` when given, else the configured store. k is clamped to the size of a smaller store.

        `documents`: a list or tuple of strings, or any other iterable of strings (a generator, an
        iterator), which is read once into a list; or a DocumentStore. A string, bytes or a mapping
        is refused (InvalidRequest), as is any item that is not a string."""
        if not isinstance(question, str) or not question.strip():
            raise InvalidRequest("retrieval needs a non-empty question")
        k = self.draft_k if k is None else k
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise InvalidRequest(f"k must be a positive integer, got {k!r}")
        if isinstance(documents, DocumentStore):
            store = documents
        elif documents is not None:
            embedder = CachedEmbedder(self.embedder, self.embedding_cache)
            store = DocumentStore.from_texts(document_texts(documents), embedder=embedder)
        else:
            store = self.store
        chunks = store.search(question, min(int(k), len(store)))
        return [chunk for chunk in chunks if chunk.score >= self.min_score]

    def render(self, question: str, chunks: Sequence[RetrievedChunk]) -> str:
        """The user message: the template with the first k chunks (best first) and the question."""
        context = "\n\n".join(self.chunk_template.format(rank=rank, title=chunk.title, text=chunk.text.strip(),
                                                         source=chunk.source, score=chunk.score)
                              for rank, chunk in enumerate(chunks[: self.k], start=1))
        return self.template.format(context=context, question=question.strip())



def document_texts(documents) -> list[str]:
    """`documents` of a request as the list of strings it holds (an iterator is read once), or an
    InvalidRequest that names what was given."""
    expected = ("documents must be a list of strings or a DocumentStore (a tuple or another iterable of strings "
                "is read once as a list)")
    if isinstance(documents, str):
        raise InvalidRequest(f"{expected}; got a str: pass [text] for one document")
    if isinstance(documents, (bytes, bytearray, memoryview, Mapping)) or not isinstance(documents, Iterable):
        raise InvalidRequest(f"{expected}; got a {type(documents).__name__}")
    texts = list(documents)
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidRequest(f"{expected}; documents[{index}] is a {type(text).__name__}, not a string")
    return texts
