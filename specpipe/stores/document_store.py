"""The dense document store behind RAG: chunks of a collection embedded with all-MiniLM-L6-v2 and
indexed with FAISS (inner product on unit vectors = cosine similarity).

On disk a store is a folder written atomically by `write_store`: `index.faiss` (FAISS's own
format: `faiss.write_index` / `faiss.read_index`), `chunks.parquet` (text, source, title,
offsets and metadata of every chunk; row i is vector i) and `manifest.json`, whose fingerprint is
the embedding model's: a store is only searched with the model that embedded it. Nothing here
unpickles.

Build one with `python run.py task=build_store store=pydoc_docs` (the default: Python's own
documentation) or `store=documents store.sources=[...]`; in code, `DocumentStore.load(path)`,
`DocumentStore.from_texts([...])` (in memory) or `ensure_default_store()`.

Index kinds (`IndexSettings`): flat (exact), ivf, hnsw, and ivfpq for collections past ~10M chunks:
product-quantized codes of pq_m bytes per vector (plus FAISS's 8-byte id) instead of 1536 bytes of
float32, approximate scores. IVF indexes are trained (and filled) on a GPU when FAISS has one
(`faiss-gpu`, `index_device`), and always written as CPU indexes; `DocumentStore.load` can move a
loaded index to the GPU for search.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

# faiss' loader logs at INFO every optimized build it could not import before the one it uses:
# noise under Hydra's INFO logging, not a problem.
logging.getLogger("faiss.loader").setLevel(logging.WARNING)
import faiss  # noqa: E402
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from specpipe.errors import ConfigError, InvalidRequest, StoreError
from specpipe.stores.chunking import Chunk, Chunker, CollectionFormat, Document, read_collection
from specpipe.stores.embedder import SentenceEmbedder, TextEmbedder
from specpipe.stores.manifest import (StoreManifest, check_fingerprint, check_output_folder, check_store_name,
                                      read_manifest, verify_files, write_store)

KIND = "document_store"
FORMAT_VERSION = 1
INDEX_FILE = "index.faiss"
CHUNKS_FILE = "chunks.parquet"
DEFAULT_STORE_NAME = "pydoc_docs"
INDEX_KINDS = ("flat", "ivf", "ivfpq", "hnsw")
INDEX_DEVICES = ("auto", "cpu", "cuda")
# What a GPU speeds up: the k-means of IVF (and PQ) training and filling the lists. A flat index
# has nothing to train; FAISS has no GPU HNSW.
GPU_BUILT_KINDS = ("ivf", "ivfpq")
GPU_INSTALL = ('this FAISS has no GPU support (the faiss-cpu package, or no CUDA device visible). On a CUDA '
               'machine: pip uninstall faiss-cpu && pip install -e ".[gpu]" (faiss-gpu); or set index_device=auto '
               '(GPU when there is one) or cpu')
logger = logging.getLogger(__name__)


def faiss_gpus() -> int:
    """GPUs FAISS can use: none under faiss-cpu, which lacks the GPU classes altogether."""
    if not hasattr(faiss, "StandardGpuResources"):
        return 0
    try:
        return int(faiss.get_num_gpus())
    except RuntimeError:  # a CUDA build on a machine whose driver is missing or broken
        return 0


def check_index_device(device: str, kind: str | None = None) -> None:
    """Refuses an `index_device` this FAISS cannot serve: unknown names, cuda without GPU FAISS, a
    GPU asked for an index kind FAISS has no GPU version of (hnsw)."""
    if device not in INDEX_DEVICES:
        raise ConfigError(f"index_device={device!r}: choose one of {INDEX_DEVICES}")
    if device != "cuda":
        return
    if kind == "hnsw":
        raise ConfigError("index_device=cuda: FAISS has no GPU HNSW index; use index_device=cpu, or index=ivf / "
                          "ivfpq on the GPU")
    if faiss_gpus() == 0:
        raise ConfigError(f"index_device=cuda: {GPU_INSTALL}")


def onto_gpu(index: faiss.Index, device: str, purpose: str) -> tuple[faiss.Index, object | None]:
    """(the index to use for `purpose`, the GPU resources it runs on or None): a GPU copy of the CPU
    `index` when `device` (auto, cuda) asks for one and FAISS can make it, else `index` itself.
    auto says in one log line why it stays on the CPU; cuda raises a ConfigError instead. The
    resources must outlive the copy."""
    if device == "cpu":
        return index, None
    if hasattr(index, "hnsw"):
        check_index_device(device, "hnsw")  # cuda: refused; auto: the CPU, FAISS has no GPU HNSW
        return index, None
    check_index_device(device)
    if faiss_gpus() == 0:
        logger.info("document store: FAISS has no GPU here (faiss-cpu, or no CUDA device); %s on the CPU", purpose)
        return index, None
    options = faiss.GpuClonerOptions()
    # IVF-PQ's distance tables in half precision, which lets large pq_m fit in the GPU's shared
    # memory; for a flat or IVF-flat index the same switch would store the vectors in half precision.
    options.useFloat16 = isinstance(index, faiss.IndexIVFPQ)
    try:
        resources = faiss.StandardGpuResources()
        return faiss.index_cpu_to_gpu(resources, 0, index, options), resources
    except RuntimeError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if device == "cuda":
            raise ConfigError(f"index_device=cuda: FAISS cannot put this index on the GPU for {purpose} "
                              f"({first_line}); use index_device=cpu or auto, or other index settings") from None
        logger.info("document store: FAISS cannot put this index on the GPU (%s); %s on the CPU", first_line, purpose)
        return index, None


@contextmanager
def faiss_threads(threads: int) -> Iterator[None]:
    """FAISS runs on `threads` OpenMP threads inside the block; the count before is restored after.

    Why restore: faiss-cpu and torch load one shared OpenMP runtime (the same libgomp soname), so
    FAISS's thread count is torch's too. Setting it to 1 once at import, as this module did, left
    every target forward of a RAG pipeline on one of this machine's two cores (measured: the
    products of a one-token step 49 ms instead of 25). Searches run on one thread: after a parallel
    search the runtime's workers spin and starve the next embedding or forward (question embedding
    + search measured 280 ms with FAISS's default threads, 35 ms with one, under load). OpenMP keeps
    the count per calling thread, so searches from several request threads each restore their own.
    """
    previous = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(threads)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(previous)


_CHUNK_SCHEMA = pa.schema([("chunk_id", pa.int64()), ("source", pa.string()), ("title", pa.string()),
                           ("start", pa.int64()), ("end", pa.int64()), ("text", pa.string()),
                           ("metadata", pa.string())])  # metadata: a JSON object


@dataclass(frozen=True)
class RetrievedChunk:
    chunk_id: int  # row of the chunk in the store
    text: str
    score: float  # cosine similarity to the query, in [-1, 1]
    source: str  # file the chunk came from, or "pydoc"
    title: str
    start: int  # character offsets of the chunk in its document
    end: int
    metadata: dict = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class IndexSettings:
    """Which FAISS index to build over unit vectors, and how hard it searches.

    flat: exact search. ivf: `nlist` k-means cells, `nprobe` of them searched per query
    (defaults: nlist = 4 sqrt(n), capped so each cell has >= 39 training points as FAISS asks;
    nprobe = nlist / 4). ivfpq: the same cells, each vector stored as `pq_m` codes of `pq_bits`
    bits (FAISS's IndexIVFPQ: pq_m * pq_bits / 8 bytes a vector, 48 for the default 48 x 8 on
    MiniLM's 384 dimensions instead of 1536); pq_m must divide the dimension, and the collection
    needs at least 2**pq_bits chunks to train the codebooks. For collections past ~10M chunks,
    where float vectors no longer fit in memory. hnsw: a graph with `hnsw_m` links per node,
    built with `ef_construction` and searched with `ef_search` candidates.

    `device`: where ivf / ivfpq are trained and filled. auto: a GPU when FAISS has one
    (faiss-gpu), else the CPU (said in one log line); cuda: a GPU or a ConfigError; cpu. The index
    built is a CPU index either way.
    """

    kind: str = "flat"
    nlist: int | None = None
    nprobe: int | None = None
    hnsw_m: int = 32
    ef_construction: int = 80
    ef_search: int = 128
    pq_m: int = 48
    pq_bits: int = 8
    device: str = "auto"

    def __post_init__(self):
        if self.kind not in INDEX_KINDS:
            raise ConfigError(f"index={self.kind!r} is not a document-store index; choose one of {INDEX_KINDS}")
        if self.kind == "ivfpq":
            for name, value, low, high in (("pq_m", self.pq_m, 1, None), ("pq_bits", self.pq_bits, 1, 12)):
                if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                    raise ConfigError(f"index=ivfpq: {name} must be an integer from {low}"
                                      f"{f' to {high}' if high else ''}, got {value!r}")
        check_index_device(self.device, self.kind)

    def cells(self, count: int) -> int:
        wanted = self.nlist or max(1, round(4 * math.sqrt(count)))
        return max(1, min(wanted, count // 39))

    def check_dimension(self, dim: int) -> None:
        """Refuses settings that cannot index `dim`-d vectors (before any text is embedded)."""
        if self.kind == "ivfpq" and dim % self.pq_m:
            divisors = [m for m in (8, 12, 16, 24, 32, 48, 64, 96, 128) if dim % m == 0 and m < dim]
            raise ConfigError(f"index=ivfpq: pq_m={self.pq_m} must divide the embedding dimension {dim} (each of the "
                              f"pq_m sub-quantizers codes dim / pq_m dimensions); try one of {divisors}")

    def check_count(self, count: int) -> None:
        """Refuses settings that cannot be trained on `count` vectors (before they are embedded)."""
        if self.kind == "ivfpq" and count < 2 ** self.pq_bits:
            raise ConfigError(f"index=ivfpq with pq_bits={self.pq_bits} trains {2 ** self.pq_bits} centroids per "
                              f"sub-quantizer and needs at least as many chunks; the collection has {count}. Use "
                              f"index=flat or ivf for a collection this small (IVF-PQ pays past ~10M chunks)")

    def build(self, vectors: np.ndarray, progress: bool = False) -> tuple[faiss.Index, dict]:
        """vectors [n, dim] float32 unit rows -> (CPU index holding them in row order, its parameters)."""
        count, dim = vectors.shape
        self.check_dimension(dim)
        self.check_count(count)
        with faiss_threads(os.cpu_count() or 1):
            return self._build(vectors, progress)

    def _build(self, vectors: np.ndarray, progress: bool) -> tuple[faiss.Index, dict]:
        count, dim = vectors.shape
        if self.kind == "flat":
            index, params = faiss.IndexFlatIP(dim), {}
        elif self.kind in GPU_BUILT_KINDS:
            nlist = self.cells(count)
            if self.kind == "ivf":
                index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
                params = {"nlist": nlist}
            else:
                index = faiss.IndexIVFPQ(faiss.IndexFlatIP(dim), dim, nlist, self.pq_m, self.pq_bits,
                                         faiss.METRIC_INNER_PRODUCT)
                params = {"nlist": nlist, "pq_m": self.pq_m, "pq_bits": self.pq_bits}
        else:
            index = faiss.IndexHNSWFlat(dim, self.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = self.ef_construction
            index.hnsw.efSearch = self.ef_search
            params = {"hnsw_m": self.hnsw_m, "ef_construction": self.ef_construction, "ef_search": self.ef_search}
        working, resources = index, None
        if self.kind in GPU_BUILT_KINDS:
            working, resources = onto_gpu(index, self.device, f"building the {self.kind} index")
        if not working.is_trained:
            working.train(vectors)
        step = 16384  # adding in slices only to show progress; the index is the same
        for begin in tqdm(range(0, count, step), desc=f"indexing ({self.kind})", disable=not progress or count <= step):
            working.add(vectors[begin:begin + step])
        built_on = "cpu" if resources is None else "cuda"
        if resources is not None:
            index = faiss.index_gpu_to_cpu(working)  # the stored index is a CPU one, whatever built it
        del working, resources  # frees the GPU copy
        if self.kind in GPU_BUILT_KINDS:
            index.nprobe = min(params["nlist"], self.nprobe or max(1, params["nlist"] // 4))
            params.update(nprobe=int(index.nprobe), built_on=built_on)
        return index, {"index": self.kind, **params}


class DocumentStore:
    """Chunks, their FAISS index and the embedder that maps questions into the same space."""

    def __init__(self, index: faiss.Index, chunks: pa.Table, embedder: TextEmbedder, path: Path | None = None,
                 gpu_resources: object | None = None):
        # gpu_resources: the StandardGpuResources a GPU `index` runs on (they must outlive it)
        if index.ntotal != chunks.num_rows:
            raise StoreError(f"document store{f' at {path}' if path else ''}: the index holds {index.ntotal} "
                             f"vectors for {chunks.num_rows} chunks; rebuild it")
        if index.d != embedder.dim:
            raise StoreError(f"document store{f' at {path}' if path else ''} holds {index.d}-d vectors, the "
                             f"embedder makes {embedder.dim}-d ones; rebuild it with this embedder")
        self.index = index
        self.chunks = chunks
        self.embedder = embedder
        self.path = path
        self._gpu_resources = gpu_resources
        # FAISS's GPU resources are not safe to use from several threads at once; CPU searches are.
        self._search_lock = threading.Lock() if gpu_resources is not None else nullcontext()

    def __len__(self) -> int:
        return self.chunks.num_rows

    # ------------------------------------------------------------------------------- loading

    @classmethod
    def load(cls, path: str | Path, embedder: TextEmbedder | None = None, verify_checksums: bool = True,
             nprobe: int | None = None, ef_search: int | None = None, index_device: str = "cpu") -> "DocumentStore":
        """Opens a store built by `task=build_store`. `embedder` defaults to all-MiniLM-L6-v2 and
        must be the model the store was built with. `nprobe` / `ef_search` override the
        search effort an IVF / HNSW index was saved with. `index_device`: cpu, cuda (search on
        the GPU: flat, ivf, ivfpq) or auto (the GPU when FAISS has one and the index kind runs there)."""
        check_index_device(index_device)
        path = Path(path).expanduser()
        manifest = read_manifest(path, KIND, FORMAT_VERSION)
        embedder = embedder if embedder is not None else SentenceEmbedder()
        check_fingerprint(path, manifest, embedder.fingerprint, "embedding model")
        verify_files(path, manifest, checksums=verify_checksums)
        chunks = _read_chunks(path / CHUNKS_FILE)
        index = _read_index(path / INDEX_FILE)
        if nprobe is not None and hasattr(index, "nprobe"):
            index.nprobe = int(nprobe)
        if ef_search is not None and hasattr(index, "hnsw"):
            index.hnsw.efSearch = int(ef_search)
        index, resources = onto_gpu(index, index_device, f"searching {path}")
        return cls(index, chunks, embedder, path, resources)

    @classmethod
    def from_texts(cls, texts: Sequence[str], embedder: TextEmbedder | None = None, chunk_size: int = 160,
                   overlap: int = 32, unit: str = "tokens", titles: Sequence[str] | None = None) -> "DocumentStore":
        """An in-memory store over an application's own documents (chunked like a built store,
        exact search). Titles default to "document 1", "document 2", ..."""
        texts = list(texts)
        if titles is not None and len(titles) != len(texts):
            raise InvalidRequest(f"{len(titles)} titles for {len(texts)} documents")
        embedder = embedder if embedder is not None else SentenceEmbedder()
        documents = [Document("documents", str(titles[i]) if titles else f"document {i + 1}", text, {"document": i})
                     for i, text in enumerate(texts)]
        chunks = _chunk_documents(documents, _make_chunker(chunk_size, overlap, unit, embedder), progress=False)
        if not chunks:
            raise InvalidRequest(f"no text to search: the {len(texts)} documents given are all empty")
        vectors = embedder.encode(_embedding_inputs(chunks, with_titles=titles is not None))  # [n, dim]
        index, _ = IndexSettings("flat").build(vectors)
        return cls(index, _chunk_table(chunks), embedder)

    # ------------------------------------------------------------------------------- search

    def search(self, query: str, k: int) -> list[RetrievedChunk]:
        """The k chunks most similar to `query`, best first."""
        return self.search_batch([query], k)[0]

    def search_batch(self, queries: Sequence[str], k: int) -> list[list[RetrievedChunk]]:
        """For each query, its k best chunks. k must be in [1, len(store)]: asking for more chunks
        than the store holds is an error rather than a silent shorter list (use
        `min(k, len(store))` to clamp). An IVF/HNSW index may still return fewer than k when its
        search effort finds fewer candidates."""
        self._check_k(k)
        queries = list(queries)
        if not queries or any(not isinstance(query, str) or not query.strip() for query in queries):
            raise InvalidRequest("document search needs non-empty query strings")
        vectors = self.embedder.encode(queries)  # [q, dim]
        with faiss_threads(1), self._search_lock:
            scores, ids = self.index.search(np.ascontiguousarray(vectors, dtype=np.float32), k)  # [q, k] each
        return [[self._retrieved(int(i), float(s)) for s, i in zip(row_scores, row_ids) if i >= 0]
                for row_scores, row_ids in zip(scores, ids)]

    def _check_k(self, k: int) -> None:
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
            raise InvalidRequest(f"k must be a positive integer, got {k!r}")
        if k > len(self):
            where = f"at {self.path}" if self.path else "in memory"
            raise InvalidRequest(f"asked for k={k} chunks but the document store {where} holds only "
                                 f"{len(self)}; ask for at most {len(self)}")

    def _retrieved(self, row: int, score: float) -> RetrievedChunk:
        record = self.chunks.slice(row, 1).to_pylist()[0]
        return RetrievedChunk(row, record["text"], score, record["source"], record["title"], record["start"],
                              record["end"], json.loads(record["metadata"]))


# ----------------------------------------------------------------------------------- building


class DocumentStoreBuilder:
    """Builds a document store for `task=build_store`: read the sources, chunk, embed, index,
    write atomically to `out` (default: `<cache>/stores/<name>`).

    `sources`: file paths, folders and/or "pydoc". `unit`: "tokens" (of the embedding model) or
    "chars" for `chunk_size` and `overlap`. `embed_titles` prefixes each chunk's title to the
    text that is embedded (not to the stored text): later chunks of a long document rarely
    repeat what it is about.
    """

    def __init__(self, sources: Sequence[str], out: str | None = None, name: str = "documents",
                 index: str = "flat", chunk_size: int = 160, overlap: int = 32, unit: str = "tokens",
                 text_field: str = "text", title_field: str = "title", metadata_fields: Sequence[str] = (),
                 embed_titles: bool = True, nlist: int | None = None, nprobe: int | None = None,
                 hnsw_m: int = 32, ef_construction: int = 80, ef_search: int = 128, pq_m: int = 48,
                 pq_bits: int = 8, index_device: str = "auto", embedder_path: str | None = None,
                 batch_size: int = 32, progress: bool = True, embedder: TextEmbedder | None = None):
        from specpipe.models import cache_root

        self.sources = [str(source) for source in sources]
        self.out = check_output_folder(out) if out else cache_root() / "stores" / check_store_name(name)
        self.index_settings = IndexSettings(index, nlist, nprobe, hnsw_m, ef_construction, ef_search, pq_m, pq_bits,
                                            index_device)
        self.chunk_size, self.overlap, self.unit = int(chunk_size), int(overlap), unit
        _make_chunker(self.chunk_size, self.overlap, unit, None)  # bad sizes or unit fail before any work
        self.collection_format = CollectionFormat(text_field, title_field, tuple(metadata_fields))
        self.embed_titles = embed_titles
        self.embedder_path, self.batch_size = embedder_path, int(batch_size)
        self.progress = progress
        self._embedder = embedder

    @property
    def embedder(self) -> TextEmbedder:
        if self._embedder is None:
            self._embedder = SentenceEmbedder(self.embedder_path, batch_size=self.batch_size)
        return self._embedder

    def build(self) -> StoreManifest:
        started = time.perf_counter()
        embedder = self.embedder
        self.index_settings.check_dimension(embedder.dim)  # settings that cannot work fail before any reading
        documents = list(read_collection(self.sources, self.collection_format))
        chunker = _make_chunker(self.chunk_size, self.overlap, self.unit, embedder)
        chunks = _chunk_documents(documents, chunker, self.progress)
        if not chunks:
            raise StoreError(f"the document collection {self.sources} holds no text ({len(documents)} documents, "
                             f"all empty); nothing to index, {self.out} left as it was")
        self.index_settings.check_count(len(chunks))  # before hours of embedding, not after
        embed_started = time.perf_counter()
        vectors = embedder.encode(_embedding_inputs(chunks, self.embed_titles), progress=self.progress)  # [n, dim]
        embed_seconds = time.perf_counter() - embed_started
        index, index_params = self.index_settings.build(vectors, self.progress)
        table = _chunk_table(chunks)

        def write_files(staging: Path) -> dict:
            pq.write_table(table, staging / CHUNKS_FILE, compression="zstd")
            faiss.write_index(index, str(staging / INDEX_FILE))
            return {"chunks": len(chunks), "documents": len(documents),
                    "characters": int(sum(len(document.text) for document in documents)),
                    "dim": int(vectors.shape[1]), **index_params, "chunk_size": self.chunk_size,
                    "overlap": self.overlap, "unit": self.unit, "embed_titles": self.embed_titles,
                    "embed_seconds": round(embed_seconds, 2),
                    "build_seconds": round(time.perf_counter() - started, 2)}

        return write_store(self.out, KIND, FORMAT_VERSION, embedder.fingerprint, write_files, self.sources)


def default_store_path() -> Path:
    from specpipe.models import cache_root

    return cache_root() / "stores" / DEFAULT_STORE_NAME


def ensure_default_store(embedder: TextEmbedder | None = None, path: str | Path | None = None,
                         index_device: str = "cpu") -> DocumentStore:
    """The default store (Python's documentation, as `conf/store/pydoc_docs.yaml` describes it),
    built on first use with progress bars (a few minutes on a laptop CPU). An existing store is
    loaded as it is: a corrupt one or one of another embedder is an error, never rebuilt silently."""
    path = Path(path).expanduser() if path else default_store_path()
    if not path.exists():
        print(f"specpipe: building the default document store (Python documentation) at {path}; "
              f"this happens once", file=sys.stderr)
        _default_builder(path, embedder).build()
    return DocumentStore.load(path, embedder=embedder, index_device=index_device)


def _default_builder(path: Path, embedder: TextEmbedder | None) -> DocumentStoreBuilder:
    """The builder `conf/store/pydoc_docs.yaml` configures: one source of truth for its settings."""
    from omegaconf import OmegaConf

    from specpipe.paths import CONFIG_DIR

    settings = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "store" / f"{DEFAULT_STORE_NAME}.yaml"))
    settings = {key: value for key, value in settings.items() if not key.startswith("_")}
    return DocumentStoreBuilder(**{**settings, "out": str(path)}, embedder=embedder)


# ------------------------------------------------------------------------------------ helpers


def _make_chunker(chunk_size: int, overlap: int, unit: str, embedder: TextEmbedder | None) -> Chunker:
    if unit in ("chars", "characters"):
        return Chunker.characters(chunk_size, overlap)
    if unit == "tokens":
        measure = embedder.count_tokens if embedder is not None else (lambda texts: [len(t) for t in texts])
        return Chunker(chunk_size, overlap, measure, in_characters=False)
    raise ConfigError(f"unit={unit!r}: chunk sizes are measured in 'tokens' (of the embedding model) or 'chars'")


def _chunk_documents(documents: list[Document], chunker: Chunker, progress: bool) -> list[Chunk]:
    chunks = []
    for document in tqdm(documents, desc="chunking", unit="doc", disable=not progress):
        chunks.extend(chunker.chunk(document))
    return chunks


def _embedding_inputs(chunks: list[Chunk], with_titles: bool) -> list[str]:
    return [f"{chunk.title}\n{chunk.text}" if with_titles else chunk.text for chunk in chunks]


def _chunk_table(chunks: list[Chunk]) -> pa.Table:
    return pa.table({"chunk_id": list(range(len(chunks))), "source": [c.source for c in chunks],
                     "title": [c.title for c in chunks], "start": [c.start for c in chunks],
                     "end": [c.end for c in chunks], "text": [c.text for c in chunks],
                     "metadata": [json.dumps(c.metadata, sort_keys=True) for c in chunks]}, schema=_CHUNK_SCHEMA)


def _read_chunks(path: Path) -> pa.Table:
    try:
        table = pq.read_table(path, memory_map=True)
    except (pa.ArrowException, OSError) as error:
        raise StoreError(f"document store chunks {path} are unreadable ({error}); rebuild the store") from None
    if not table.schema.equals(_CHUNK_SCHEMA):
        raise StoreError(f"document store chunks {path} have columns {table.schema.names}, expected "
                         f"{_CHUNK_SCHEMA.names}; rebuild the store")
    return table


def _read_index(path: Path) -> faiss.Index:
    try:
        return faiss.read_index(str(path))
    except RuntimeError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise StoreError(f"document store index {path} is unreadable ({first_line}); rebuild the store") from None

