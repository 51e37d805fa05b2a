"""Where specpipe's own files are, and where a relative path from a config or a call points.

The configs (`specpipe/conf/`) and the shipped heads, drafts and corpora (`specpipe/data/`) are package data:
they are found beside this module in a checkout, an editable install and an installed wheel alike.
"""
from __future__ import annotations

from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent  # holds conf/ and data/
CONFIG_DIR = PACKAGE_ROOT / "conf"
DATA_DIR = PACKAGE_ROOT / "data"
# The checkout's root when running from one: bench/ (the development prompt sets and the benchmark scripts)
# lives there and is not installed.
CHECKOUT_ROOT = PACKAGE_ROOT.parent


def local_path(value: str | Path) -> Path:
    """`value` as given (from the current directory) where something is there, else relative to the
    package folder, where the shipped heads, drafts and corpora live: `data/eagle/...` works from a
    script in any directory and from an installed wheel, and a user's own relative path still wins."""
    path = Path(value).expanduser()
    if path.is_absolute() or path.exists():
        return path
    shipped = PACKAGE_ROOT / path
    return shipped if shipped.exists() else path


def package_path(value: str | Path) -> Path:
    """Where a task writes a relative output path: under the package folder, so that a head or draft trained
    to `data/<kind>/<model>` is the one the pipelines load by default. An absolute path is kept as it is
    (the way to write somewhere else, e.g. from an installed wheel whose folder is read-only)."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else PACKAGE_ROOT / path


def display_path(path: Path) -> str:
    """A checkout's file by its path from the checkout's root, any other by its whole path: what recorded metadata
    names, so that it does not depend on where the checkout lies."""
    path = path.resolve()
    return str(path.relative_to(CHECKOUT_ROOT)) if path.is_relative_to(CHECKOUT_ROOT) else str(path)
