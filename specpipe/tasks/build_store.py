"""`task=build_store store=NAME`: build an on-disk store (token datastore, document store) with
progress bars. `conf/store/NAME.yaml` names a builder class (`_partial_: true`); this task hands
it what it asks for by parameter name, `tokenizer` (the target's) and/or `model` (the loaded
target, for stores built from its own generations), and calls its `build()`.
"""
from __future__ import annotations

import inspect
import sys

from hydra.utils import instantiate
from omegaconf import DictConfig

from specpipe.errors import ConfigError
from specpipe.paths import CONFIG_DIR
from specpipe.pipelines.builder import load_model
from specpipe.stores.manifest import check_output_folder, check_store_name


def store_options() -> list[str]:
    return sorted(path.stem for path in (CONFIG_DIR / "store").glob("*.yaml"))


def run_build_store(cfg: DictConfig):
    if cfg.get("store") is None:
        raise ConfigError(f"task=build_store needs a store: add store=NAME, one of {store_options()}")
    # where the store goes, checked before the model loads and the corpus is read
    if cfg.store.get("out"):
        check_output_folder(cfg.store.out)
    elif "name" in cfg.store:
        check_store_name(cfg.store.name)
    try:
        factory = instantiate(cfg.store)
    except Exception as error:
        raise ConfigError(f"cannot build store config ({cfg.store.get('_target_')}): {error}") from None
    wanted = inspect.signature(factory).parameters if callable(factory) and not hasattr(factory, "build") else {}
    kwargs = {}
    if "tokenizer" in wanted or "model" in wanted:
        loaded = load_model(cfg.model)
        if "tokenizer" in wanted:
            kwargs["tokenizer"] = loaded.tokenizer
        if "model" in wanted:
            kwargs["model"] = loaded
    builder = factory(**kwargs) if wanted or not hasattr(factory, "build") else factory
    manifest = builder.build()
    stats = ", ".join(f"{key}={value}" for key, value in manifest.stats.items())
    print(f"build_store: {manifest.kind} written to {builder.out} ({stats})", file=sys.stderr)
    return manifest
