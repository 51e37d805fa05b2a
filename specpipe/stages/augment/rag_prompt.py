"""RAG: the question retrieves the top-k chunks of a document store, and they go into the prompt
through a template. The augmented prompt is what the target answers and what the n-gram
retrievers draft from (an answer grounded in documents copies from them)."""
from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from specpipe import distributed
from specpipe.errors import InvalidRequest
from specpipe.models import resolve_device
from specpipe.stores.document_store import DocumentStore, RetrievedChunk, ensure_default_store

DEFAULT_TEMPLATE = ("Answer the question using the documentation excerpts below.\n\n{context}\n\n"
                    "Question: {question}")
DEFAULT_CHUNK_TEMPLATE = "[{rank}] {title}\n{text}"

Documents = Sequence[str] | DocumentStore | None


class RagPrompt:
    """Retrieves chunks for a question and renders the augmented prompt.

    The store is `path` (built by `task=build_store`), or the default store of Python's
    documentation when `path` is null, built on first use. It loads at the first retrieval, so
    building a pipeline stays cheap. A request may bring its own documents instead: a list of
    strings (chunked and embedded in memory) or a DocumentStore the application built or loaded.
    """

    def __init__(self, path: str | None = None, k: int = 3, draft_k: int | None = None, template: str = DEFAULT_TEMPLATE,
                 chunk_template: str = DEFAULT_CHUNK_TEMPLATE, min_score: float = -1.0,
                 embedder_path: str | None = None, embedder_device: str = "cpu", index_device: str = "cpu",
                 store: DocumentStore | None = None) -> None:
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
        """The top chunks for `question` (`draft_k` of them unless k is given): from `documents` when
        given, else the configured store. k is clamped to the size of a smaller store."""
        if not isinstance(question, str) or not question.strip():
            raise InvalidRequest("retrieval needs a non-empty question")
        k = self.draft_k if k is None else k
        if isinstance(documents, DocumentStore):
            store = documents
        elif documents is not None:
            if isinstance(documents, str) or not all(isinstance(d, str) for d in documents):
                raise InvalidRequest("documents must be a list of strings or a DocumentStore")
            store = DocumentStore.from_texts(list(documents), embedder=self.embedder)
        else:
            store = self.store
        chunks = store.search(question, min(k, len(store)))
        return [chunk for chunk in chunks if chunk.score >= self.min_score]

    def render(self, question: str, chunks: Sequence[RetrievedChunk]) -> str:
        """The user message: the template with the first k chunks (best first) and the question."""
        context = "\n\n".join(self.chunk_template.format(rank=rank, title=chunk.title, text=chunk.text.strip(),
                                                         source=chunk.source, score=chunk.score)
                              for rank, chunk in enumerate(chunks[: self.k], start=1))
        return self.template.format(context=context, question=question.strip())

