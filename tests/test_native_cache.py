"""The folder native code is built in and the checksum checked before each load (specpipe.native_cache),
which the datastore's suffix lookup and the CPU kernel share (their own tests: test_token_datastore.py,
test_engine.py)."""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from specpipe import native_cache
from specpipe.native_cache import UnsafeFolder

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="needs a C compiler")


def marker_library(path: Path, marker: Path) -> Path:
    """A real shared library at `path` whose constructor writes `marker` the moment it is loaded: what
    someone could plant where specpipe loads its compiled code from."""
    source = path.with_name(path.name + ".planted.c")
    source.write_text('#include <stdio.h>\n'
                      '__attribute__((constructor)) static void planted(void) {\n'
                      f'    FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran", f); fclose(f); }}\n'
                      '}\n'
                      'long rest_lookup(void) { return 0; }\n')
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([os.environ.get("CC") or "cc", "-shared", "-fPIC", "-o", str(path), str(source)], check=True)
    source.unlink()
    return path


def test_missing_folders_are_created_for_this_user_alone(tmp_path):
    folder = native_cache.private_folder(tmp_path / "cache" / "native" / "build")
    for created in (folder, folder.parent, folder.parent.parent):
        info = created.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid(), created
    assert native_cache.private_folder(folder) == folder  # an existing private folder is taken as it is


def test_a_folder_others_can_write_is_refused_with_the_fix(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(UnsafeFolder, match=re.escape(f"{folder} is writable by group/others (mode 0777)") + ".*" + re.escape(f"chmod 700 {folder}")):
        native_cache.private_folder(folder)
    folder.chmod(0o775)
    with pytest.raises(UnsafeFolder, match="writable by group/others"):
        native_cache.private_folder(folder)
    folder.chmod(0o755)  # readable by others is fine: only writing lets them plant a library
    native_cache.private_folder(folder)


def test_a_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    owner = folder.stat().st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)  # as if another user ran specpipe here
    with pytest.raises(UnsafeFolder, match=re.escape(f"{folder} belongs to uid {owner}, not to you") + ".*SPECPIPE_CACHE_DIR"):
        native_cache.private_folder(folder)


def test_a_symlinked_folder_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeFolder, match="symbolic link"):
        native_cache.private_folder(tmp_path / "link")


@needs_cc
def test_a_planted_library_is_not_verified_and_a_recorded_one_is(tmp_path):
    marker = tmp_path / "marker"
    library = marker_library(native_cache.private_folder(tmp_path / "native") / "lib.so", marker)
    assert not native_cache.verified(library)  # no record: never loaded
    native_cache.checksum_path(library).write_text("0" * 64)
    assert not native_cache.verified(library)  # a record that does not match
    digest = native_cache.record_checksum(library)
    assert native_cache.checksum_path(library).read_text().strip() == digest
    assert native_cache.verified(library)
    with open(library, "ab") as handle:  # replaced after it was recorded
        handle.write(b"\0")
    assert not native_cache.verified(library)
    native_cache.discard(library)
    assert not library.exists() and not native_cache.checksum_path(library).exists()
    assert not marker.exists()  # nothing here loaded it
