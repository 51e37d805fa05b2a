"""The manifest every on-disk store carries, and the atomic folder write all stores share.

A store is a folder: data files (npy, Parquet, a FAISS index) plus `manifest.json` naming its
kind, format version, the fingerprint of what it was built for (tokenizer or embedding model),
statistics, sources and a SHA-256 per file. A build writes a sibling temporary folder and swaps
it in by rename, so an interrupted build leaves the previous store intact and usable. Loading
checks the manifest before any data file is opened; nothing on a load path unpickles.

A store may hold stores: the sharded token datastore keeps one complete store per shard in a
subfolder. The top-level manifest then lists every file under its folder by relative path
(`shard-00000/tokens.npy`), each with its size and SHA-256.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specpipe.errors import ConfigError, StoreError

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class StoreManifest:
    kind: str  # "token_datastore" | "document_store" | "past_outputs"
    format_version: int
    fingerprint: dict  # what the store was built for: tokenizer or embedder identity, compared on load
    files: dict[str, dict]  # file name -> {"sha256": hex, "bytes": int}
    stats: dict = field(default_factory=dict)  # token_count, chunks, build_seconds, ...
    sources: list[str] = field(default_factory=list)
    created: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer) -> dict:
    """Identity of a tokenizer by content: the id of every token string, hashed (names can lie)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    digest = hashlib.sha256("\n".join(f"{token}\t{index}" for token, index in vocab).encode()).hexdigest()
    return {"tokenizer": str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
            "vocab_size": len(tokenizer), "vocab_sha256": digest[:32]}


def check_store_name(name, option: str = "store.name") -> str:
    """`name` where it is a plain folder name for `<cache>/stores/NAME`; a ConfigError otherwise (a path,
    `..`, empty, a leading dot): such a name would put the store (or read one) outside the cache, or in
    a hidden folder that builds use for their staging."""
    if isinstance(name, int) and not isinstance(name, bool):  # `store.name=2024` arrives from Hydra as an int
        name = str(name)
    if not isinstance(name, str) or not name or name.startswith(".") or "\0" in name \
            or any(separator in name for separator in ("/", "\\", os.sep, os.altsep) if separator):
        raise ConfigError(f"{option}={name!r} must be a plain name (letters, digits, '-', '_', '.', not starting "
                          f"with a dot, no path separators): it names a folder in the cache's stores/. To write "
                          f"a store elsewhere, set store.out=FOLDER")
    return name


def check_output_folder(out, option: str = "store.out") -> Path:
    """`out` as a path, refused (ConfigError) where something other than a folder is there already: a
    build would run for minutes or hours and then fail to put the store in its place."""
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option}={path} is a file, not a folder: a store is a folder. Choose another "
                          f"store.out (a new or existing store's folder)")
    return path


def write_store(directory: Path, kind: str, format_version: int, fingerprint: dict,
                write_files: Callable[[Path], dict], sources: list[str] | None = None,
                staging: Path | None = None) -> StoreManifest:
    """Builds a store atomically: `write_files(staging)` writes the data files into a fresh
    staging folder and returns the stats; the manifest is added and the folder renamed into place.

    The previous store at `directory` stays in place until the new one is complete; on any
    failure (or an interrupt) the staging folder is removed and the old store is untouched.
    A caller that gives its own `staging` folder keeps it on failure: a rerun can resume from
    what it holds (the finished shards of a sharded token datastore). A build that was killed cannot
    remove its staging folder: the next build of the same store does (`remove_abandoned_staging`).
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_staging(directory)
    keep_on_failure = staging is not None
    if staging is None:
        staging = directory.parent / f".{directory.name}.building-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
    else:
        staging.mkdir(exist_ok=True)
    try:
        stats = write_files(staging) or {}
        files = _file_entries(staging)
        if not files:
            raise StoreError(f"building {kind} at {directory}: nothing was written")
        manifest = StoreManifest(kind, format_version, fingerprint, files, stats, list(sources or []),
                                 time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        (staging / MANIFEST).write_text(manifest.to_json())
        _swap_in(staging, directory)
    except BaseException:
        if not keep_on_failure:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def remove_abandoned_staging(directory: Path) -> list[Path]:
    """Removes the staging folders (`.<name>.building-<pid>-<hex>`) that builds of the store at `directory`
    left when they were killed (a failure removes its own): a whole staged store each, tens of MB or more.
    Those of processes that still run are other builds at work and stay. Returns what was removed."""
    pattern = re.compile(rf"^\.{re.escape(directory.name)}\.building-(\d+)-[0-9a-f]{{8}}$")
    removed = []
    try:
        entries = list(directory.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        found = pattern.match(entry.name)
        if found is None or not entry.is_dir() or entry.is_symlink() or _process_runs(int(found.group(1))):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _process_runs(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user's counts: it may be building)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _file_entries(folder: Path) -> dict[str, dict]:
    """Size and SHA-256 of every file under `folder`, by relative path. A file of a nested store
    takes the checksum that store's manifest recorded when the file was written, if its size still
    matches: hashing a sharded store's every byte again at the end would double its build's reads."""
    recorded: dict[str, dict] = {}
    for nested in sorted(folder.glob(f"*/{MANIFEST}")):
        try:
            entries = json.loads(nested.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a store's manifest: its folder's files are hashed like any other
        for name, entry in entries.items():
            recorded[f"{nested.parent.name}/{name}"] = entry
    files = {}
    for path in sorted(candidate for candidate in folder.rglob("*") if candidate.is_file()):
        name = path.relative_to(folder).as_posix()
        size = path.stat().st_size
        entry = recorded.get(name)
        if not (isinstance(entry, dict) and entry.get("bytes") == size and isinstance(entry.get("sha256"), str)):
            entry = {"sha256": sha256_file(path), "bytes": size}
        files[name] = {"sha256": entry["sha256"], "bytes": size}
    return files


def _swap_in(staging: Path, directory: Path) -> None:
    """Replaces `directory` by `staging`: two renames, so a reader sees the old or the new store."""
    if not directory.exists():
        staging.rename(directory)
        return
    if not (directory / MANIFEST).is_file() and any(directory.iterdir()):
        raise StoreError(f"{directory} exists and is not a specpipe store (no {MANIFEST}); refusing to replace "
                         f"it. Choose another output folder or remove it yourself")
    retired = directory.parent / f".{directory.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    directory.rename(retired)
    try:
        staging.rename(directory)
    except BaseException:
        retired.rename(directory)
        raise
    shutil.rmtree(retired, ignore_errors=True)


def read_manifest(directory: Path, kind: str, format_version: int | Collection[int]) -> StoreManifest:
    """The manifest of the store at `directory`, with clear errors for every way it can be wrong.
    `format_version`: the version this reader reads, or every version it reads."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise StoreError(f"no {kind} at {directory}: the folder does not exist. Build it with "
                         f"`python run.py task=build_store ...` or point the path option at an existing store")
    if not path.is_file():
        raise StoreError(f"{directory} is not a specpipe {kind}: it has no {MANIFEST} (an interrupted or "
                         f"foreign build?). Rebuild it with `python run.py task=build_store ...`")
    try:
        data = json.loads(path.read_text())
        manifest = StoreManifest(**data)
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as error:
        raise StoreError(f"{path} is corrupt ({type(error).__name__}: {error}); rebuild the store") from None
    problem = _shape_problem(manifest)
    if problem:
        raise StoreError(f"{path} is corrupt: {problem}; rebuild the store")
    if manifest.kind != kind:
        raise StoreError(f"{directory} holds a {manifest.kind}, not a {kind}")
    readable = sorted({format_version} if isinstance(format_version, int) else set(format_version))
    if manifest.format_version not in readable:
        raise StoreError(f"{directory} was written in {kind} format {manifest.format_version}; this specpipe "
                         f"reads format {' or '.join(map(str, readable))}. Rebuild the store")
    return manifest


def _shape_problem(manifest: StoreManifest) -> str:
    """What makes a parsed manifest unusable ('' for nothing): fields of the wrong type, a file entry
    without its size or checksum, a file name that leads out of the store's folder."""
    def integer(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not isinstance(manifest.kind, str) or not integer(manifest.format_version):
        return f"kind {manifest.kind!r} and format_version {manifest.format_version!r} must be a name and an integer"
    for field_name, wanted in (("fingerprint", dict), ("stats", dict), ("sources", list), ("files", dict)):
        value = getattr(manifest, field_name)
        if not isinstance(value, wanted):
            return f"its {field_name!r} is a {type(value).__name__}, not a {wanted.__name__}"
    for name, entry in manifest.files.items():
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts or "\\" in name:
            return f"it lists the file {name!r}, which is not a path inside the store"
        if not (isinstance(entry, dict) and integer(entry.get("bytes")) and entry["bytes"] >= 0
                and isinstance(entry.get("sha256"), str)):
            return f"its entry for {name} is {entry!r}, not {{'sha256': hex, 'bytes': size}}"
    return ""


def verify_files(directory: Path, manifest: StoreManifest, checksums: bool = True) -> None:
    """Every file the manifest lists exists with its size (and, by default, its SHA-256)."""
    for name, entry in manifest.files.items():
        path = Path(directory) / name
        if not path.is_file():
            raise StoreError(f"{manifest.kind} at {directory} is missing {name}; rebuild the store")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise StoreError(f"{manifest.kind} at {directory}: {name} has {size} bytes, the manifest says "
                             f"{entry['bytes']} (truncated or replaced); rebuild the store")
        if checksums and sha256_file(path) != entry["sha256"]:
            raise StoreError(f"{manifest.kind} at {directory}: {name} does not match its checksum (corrupt); "
                             f"rebuild the store")


def check_fingerprint(directory: Path, manifest: StoreManifest, expected: dict, what: str) -> None:
    """Refuses a store built for another tokenizer / embedding model, naming the fields that differ."""
    differing = [f"{key}: store has {manifest.fingerprint.get(key)!r}, {what} has {value!r}"
                 for key, value in expected.items() if manifest.fingerprint.get(key) != value]
    if differing:
        raise StoreError(f"the {manifest.kind} at {directory} was built for another {what}; its ids would mean "
                         f"other text. Rebuild it for this one. ({'; '.join(differing)})")
