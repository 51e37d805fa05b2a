"""REST's lookup in a one-suffix-array token datastore, compiled: the same answer as
`specpipe.stores.token_datastore.merged_lookup` over one shard, in one call.

Why: a REST step looks the context up twice (its longest suffix, then the next shorter one), and in numpy
each lookup is dozens of small array operations, slow right after a verify forward has streamed the
model's weights through the caches. The C function (specpipe/kernels/native/suffix_lookup.c, shipped with
the package) touches only the suffix-array rows and tokens it reads.

It is plain C (no Python or torch headers) built once per machine with the system's C compiler into
the specpipe cache (a fraction of a second) and called through ctypes. Where it cannot be built (no
compiler, a cache folder other users could write: `specpipe.native_cache`) the datastore keeps the
numpy lookup: `NativeSuffixLookup.build()` returns None and a reason. The library's SHA-256 is recorded
when it is built and checked before every load; one that does not match (or has no record) is built
again, never loaded. Sharded stores keep the numpy lookup, which merges the shards.

Every suffix-array entry the C code reads is checked against the tokens' bounds: a damaged store that
got past the load's validation makes the lookup raise a StoreError naming the store, never read outside
its arrays.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from specpipe import native_cache
from specpipe.errors import StoreError

# The C source, a file of the package (pyproject.toml's package-data ships it)
SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "native" / "suffix_lookup.c"
_CFLAGS = ("-O2", "-shared", "-fPIC", "-std=c99")
INT32_LIMIT = 1 << 31


def library_name(source: bytes | None = None) -> str:
    """The shared library's file name: the hash of the source's contents (`source`, else SOURCE's) and the flags,
    so an edited source is built anew."""
    source = SOURCE.read_bytes() if source is None else source
    return "suffix_lookup_" + hashlib.sha256(source + b"\0" + " ".join(_CFLAGS).encode()).hexdigest()[:12] + ".so"


class NativeSuffixLookup:
    """The compiled `rest_lookup`, bound to one suffix array's arrays (kept alive by the datastore)."""

    def __init__(self, library: ctypes.CDLL, tokens: np.ndarray, suffix_array: np.ndarray,
                 prefix_keys: np.ndarray, key_bits: int, where: str | Path | None = None) -> None:
        self._function = library.rest_lookup
        self._function.restype = ctypes.c_int64
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        self._function.argtypes = [pointer, i64, pointer, i32, i64, pointer, i32,
                                   pointer, i32, i32, i32, i32, i32, i32, pointer, pointer, pointer, pointer]
        # the arrays' addresses once: the datastore holds the arrays (memory-mapped) for its lifetime
        self._store_arguments = (tokens.ctypes.data, len(tokens), suffix_array.ctypes.data,
                                 int(suffix_array.dtype == np.int64), len(suffix_array), prefix_keys.ctypes.data,
                                 key_bits)
        self.where = f"at {where}" if where is not None else "in memory"  # the store's folder, for messages

    @staticmethod
    def build(build_dir: Path) -> tuple[ctypes.CDLL | None, str]:
        """(the library, '') built once into `build_dir` (a folder of this user's alone), or (None, why
        not). Loaded only where its SHA-256 is the one recorded when it was built; else built again."""
        try:
            native_cache.private_folder(build_dir)
        except native_cache.UnsafeFolder as error:
            return None, f"the datastore's native lookup is not built or loaded: {error}"
        except OSError as error:  # a read-only cache, a file where a folder should be
            return None, f"the datastore's native lookup could not be built in {build_dir}: {error}"
        try:
            source = SOURCE.read_bytes()  # what is hashed into the name is what is compiled
        except OSError as error:  # an installation without the package's data files
            return None, f"the datastore's native lookup has no source to build: {error}"
        path = build_dir / library_name(source)
        try:
            with native_cache.exclusive(build_dir, "the datastore's native lookup"):
                if not native_cache.verified(path):
                    native_cache.discard(path)  # nothing unchecked stays at the path that is loaded
                    failure = _compile(build_dir, path, source)
                    if failure:
                        return None, failure
                    if not native_cache.verified(path):
                        return None, f"the datastore's native lookup at {path} changed while it was built"
                return ctypes.CDLL(str(path)), ""
        except OSError as error:  # a read-only cache, a compiler that cannot run, a library that does not load
            return None, f"the datastore's native lookup could not be built or loaded in {build_dir}: {error}"

    def lookup(self, context: list[int], max_span: int, min_span: int, max_length: int, max_candidates: int,
               max_occurrences: int) -> tuple[int, int, int, list[list[int]], list[list[int]]]:
        """(match length, occurrences, sampled, continuations, prefix counts): merged_lookup's answer."""
        # ids past int32 would wrap in a C array; like any id the store cannot hold, they cut the match
        window = [token if 0 <= token < INT32_LIMIT else -1 for token in context[-max_span:]]
        tokens = (ctypes.c_int32 * len(window))(*window)
        max_occurrences = min(max_occurrences, INT32_LIMIT - 1)  # no range holds more in a C int anyway
        header = (ctypes.c_int64 * 4)()
        continuations = (ctypes.c_int32 * (max_candidates * max_length))()
        counts = (ctypes.c_int32 * (max_candidates * max_length))()
        lengths = (ctypes.c_int32 * max_candidates)()
        status = self._function(*self._store_arguments, tokens, len(window), max_span, min_span, max_length,
                                max_candidates, max_occurrences, header, continuations, counts, lengths)
        if status == -2:
            raise StoreError(f"the token datastore {self.where} is damaged: its suffix array points outside its "
                             f"tokens (or its arrays cannot be a store's); rebuild the store")
        if status != 0:
            raise MemoryError(f"the datastore's native lookup could not allocate its {max_occurrences} x "
                              f"{max_length} continuation rows")
        length, occurrences, sampled, chosen = header
        rows = [(i * max_length, i * max_length + lengths[i]) for i in range(chosen)]
        return (length, occurrences, sampled, [continuations[start:end] for start, end in rows],
                [counts[start:end] for start, end in rows])


def _compile(build_dir: Path, path: Path, source: bytes) -> str:
    """Compiles the lookup (`source`, the C file's contents) to `path` and records its checksum; '' or why it could
    not."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return "no C compiler (cc or gcc) to build the datastore's native lookup"
    with tempfile.TemporaryDirectory(dir=build_dir) as staging:
        staged = Path(staging) / SOURCE.name
        staged.write_bytes(source)
        built = Path(staging) / path.name
        result = subprocess.run([compiler, *_CFLAGS, "-o", str(built), str(staged)], capture_output=True, text=True)
        if result.returncode != 0:
            return f"the datastore's native lookup did not compile: {result.stderr.strip()[:300]}"
        os.replace(built, path)
    native_cache.record_checksum(path)
    return ""
