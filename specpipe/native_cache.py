"""Where specpipe builds native code it loads into the process, and the checks before each load.

The datastore's suffix lookup (`specpipe.stores.suffix_lookup`) and the CPU kernel
(`specpipe.engine.cpu_kernel`) are compiled once into the specpipe cache and loaded from there by
every later run. A shared library runs code the moment it is loaded (its constructors), so a library
another user could write or replace there would run inside this process. Hence:

- the folder a library is built in belongs to this user and is writable by no one else
  (`private_folder`: folders it creates get mode 0700; an existing one owned by someone else or
  writable by group/others is refused with a message that names it and the fix);
- every library's SHA-256 is recorded beside it when it is built (`<library>.sha256`,
  `record_checksum`) and compared before every load (`verified`): a library whose record is
  missing or does not match is rebuilt, never loaded.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

from specpipe.errors import SpecpipeError
from specpipe.stores.manifest import sha256_file

CHECKSUM_SUFFIX = ".sha256"


class UnsafeFolder(SpecpipeError):
    """A folder native code would be built in and loaded from that someone else could write to."""


def private_folder(folder: Path) -> Path:
    """`folder`, created where missing (each missing folder with mode 0700), after checking that this
    user owns it and that group and others cannot write to it (UnsafeFolder otherwise)."""
    folder = Path(folder).expanduser()
    missing = []
    for candidate in (folder, *folder.parents):
        if os.path.lexists(candidate):
            break
        missing.append(candidate)
    for candidate in reversed(missing):
        try:
            candidate.mkdir(mode=0o700)
        except FileExistsError:  # another process made it meanwhile: checked below like any existing folder
            pass
    check_private(folder)
    return folder


def check_private(folder: Path) -> None:
    """Refuses (UnsafeFolder) a `folder` that is not a directory of this user's that only it can write."""
    try:
        info = os.lstat(folder)
    except OSError as error:
        raise UnsafeFolder(f"cannot check the native-code folder {folder}: {error}") from None
    user = os.getuid()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        problem = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a folder"
        raise UnsafeFolder(f"the native-code folder {folder} is {problem}; specpipe builds and loads its compiled "
                           f"code only in a folder of its own. Remove it (specpipe recreates it with mode 0700) "
                           f"or set SPECPIPE_CACHE_DIR to a folder only you can write")
    if info.st_uid != user:
        raise UnsafeFolder(f"the native-code folder {folder} belongs to uid {info.st_uid}, not to you (uid {user}): "
                           f"a library its owner put there would run in this process. Remove it (specpipe recreates "
                           f"it with mode 0700) or set SPECPIPE_CACHE_DIR to a folder only you can write")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeFolder(f"the native-code folder {folder} is writable by group/others (mode "
                           f"{stat.S_IMODE(info.st_mode):04o}): a library another user put there would run in this "
                           f"process. Run `chmod 700 {folder}` or set SPECPIPE_CACHE_DIR to a folder only you can "
                           f"write")


def checksum_path(library: Path) -> Path:
    """Where the SHA-256 of `library` is recorded: `<library>.sha256` beside it."""
    return library.with_name(library.name + CHECKSUM_SUFFIX)


def record_checksum(library: Path) -> str:
    """Records the SHA-256 of the library just built at `library` (written atomically); returns it."""
    digest = sha256_file(library)
    record = checksum_path(library)
    staging = record.with_name(f".{record.name}.{os.getpid()}")
    staging.write_text(digest + "\n")
    os.replace(staging, record)
    return digest


def verified(library: Path) -> bool:
    """Whether `library` is a regular file whose SHA-256 is the one recorded when it was built; False
    where either is missing, unreadable or they differ (the caller rebuilds it)."""
    record = checksum_path(library)
    try:
        if not (stat.S_ISREG(os.lstat(library).st_mode) and stat.S_ISREG(os.lstat(record).st_mode)):
            return False
        expected = record.read_text().strip()
        return len(expected) == 64 and sha256_file(library) == expected
    except (OSError, UnicodeDecodeError):
        return False


def discard(library: Path) -> None:
    """Removes `library` and its record (before a rebuild: nothing unchecked is left to be loaded)."""
    for path in (library, checksum_path(library)):
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def exclusive(folder: Path, what: str) -> Iterator[None]:
    """Holds an flock on `folder/.build.lock` for one build-or-load: a library is not replaced while
    another process of this user checks or loads it. The lock goes away with its process."""
    with open(folder / ".build.lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            print(f"specpipe: waiting for another process's build of {what} in {folder}", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
