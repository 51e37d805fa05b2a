"""The file `task=search_layers` writes and `drafter=layer_skip` (`drafter.layers=searched`) reads: the
layer sets a backward elimination found for one model, one per number of layers kept.

It lives beside the stage that reads it, so that the stage does not import the search
(specpipe.distill.layer_search), which builds on the stage's own modules.
"""
from __future__ import annotations

import json
from pathlib import Path

from specpipe.errors import ConfigError
from specpipe.paths import DATA_DIR

FORMAT = "specpipe.layer_search"


def searched_layers_path(model_name: str) -> Path:
    """Where `task=search_layers` writes, by default, the search for model `model_name`."""
    return DATA_DIR / "layer_skip" / f"{model_name}_layers.json"


def read_searched_layers(path: str | Path, model_name: str, vocab_sha256: str, keep: int) -> list[int]:
    """The layer set of `keep` layers that a `task=search_layers` file holds for this model."""
    source = Path(path).expanduser()
    if not source.is_file():
        raise ConfigError(f"drafter.layers=searched: no layer search at {source}; run `python run.py "
                          f"task=search_layers model={model_name}` first, or give drafter.layers as a list")
    try:
        search = json.loads(source.read_text())
        if search.get("format") != FORMAT:
            raise ValueError(f"format {search.get('format')!r}, not {FORMAT!r}")
        rows = {int(row["kept"]): [int(layer) for layer in row["layers"]] for row in search["rows"]}
        recorded_vocab = search["tokenizer"]["vocab_sha256"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"drafter.layers=searched: {source} is not a readable layer search ({error}); run "
                          f"`python run.py task=search_layers` again") from None
    if search.get("model") != model_name or recorded_vocab != vocab_sha256:
        raise ConfigError(f"drafter.layers=searched: {source} was searched for model={search.get('model')}, "
                          f"not {model_name}; run `python run.py task=search_layers model={model_name}`")
    if keep not in rows:
        raise ConfigError(f"drafter.keep={keep}: the layer search in {source} holds sets of "
                          f"{min(rows)}..{max(rows)} layers")
    return rows[keep]
