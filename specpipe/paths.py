"""Where a relative path from a config or a call points: the same rule for every stage that reads files."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]  # the checkout: conf/, data/, bench/


def local_path(value: str | Path) -> Path:
    """`value` as given (from the current directory) where something is there, else relative to the
    repository root, where the shipped heads, drafts and corpora live: `data/eagle/...` works from a
    script in any directory, and a user's own relative path still wins."""
    path = Path(value).expanduser()
    if path.is_absolute() or path.exists():
        return path
    shipped = REPO_ROOT / path
    return shipped if shipped.exists() else path
