"""The hand-written pieces of the self-distillation prompt source: task templates and subjects, slot
values, situated requests and follow-ups, kept as data (`data/*.json`) and loaded here.

Everything in `data/` was written for specpipe. Each category pairs a few task templates (with a `{}`
slot) with a pool of subjects; `specpipe.distill.builders` samples the product. The subjects are
deliberately broad and everyday: the corpus should look like what people ask a small chat model, so
that the target's own answers to it resemble its answers at benchmark time.

An item of a pool has a stable id and a generation (`gen`); a builder draws from the generations it
names, in file order. The builders draw by position with seeded generators, so an item added to a
generation already drawn would change every prompt drawn from it; new items come in a generation of
their own, with a builder of their own (data/README.md).
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

DATA_DIR = Path(__file__).with_name("data")

Value = str | tuple[str | float, ...]  # a text, or what fills several slots (a pair, a product and its price)


@dataclass(frozen=True)
class Item:
    id: int  # unique in its pool, never changed or reused: `<pool>/<id>` names the item
    gen: int  # its generation: which builders draw it
    value: Value


@dataclass(frozen=True)
class PromptData:
    """The pools of every data file, each a tuple of items in file order."""

    pools: Mapping[str, tuple[Item, ...]]

    def items(self, pool: str, gen: int = 1) -> tuple[Value, ...]:
        """The values of a pool's items of one generation, in file order."""
        return tuple(item.value for item in self.pools[pool] if item.gen == gen)

    def by_category(self, prefix: str, gen: int = 1) -> Mapping[str, tuple[Value, ...]]:
        """{category: values} of the pools named `<prefix>.<category>`, in file order."""
        return MappingProxyType({name.split(".", 1)[1]: self.items(name, gen) for name in self.pools
                                 if name.startswith(f"{prefix}.")})


@functools.cache
def load_prompt_data(folder: Path = DATA_DIR) -> PromptData:
    """Every pool of the folder's JSON files (their names unique across files), checked."""
    pools: dict[str, tuple[Item, ...]] = {}
    for path in sorted(Path(folder).glob("*.json")):
        for name, pool in json.loads(path.read_text(encoding="utf-8"))["pools"].items():
            where = f"{path.name}: pool {name!r}"
            if name in pools:
                raise ValueError(f"{where} is also defined in another file")
            items = tuple(Item(int(raw["id"]), int(raw["gen"]),
                               tuple(raw["text"]) if isinstance(raw["text"], list) else raw["text"])
                          for raw in pool["items"])
            ids = [item.id for item in items]
            if ids != sorted(set(ids)):
                raise ValueError(f"{where}: item ids must be unique and increase down the list, got {ids}")
            if any(item.gen < 1 for item in items):
                raise ValueError(f"{where}: generations start at 1")
            pools[name] = items
    return PromptData(MappingProxyType(pools))


# Generic follow-up requests, by the first turn's category: a chat's second turn asks the model to
# rework, extend or check its own first answer, so the corpus also holds answers written with an
# earlier answer in the context (half of a two-turn chat benchmark's tokens are such answers).
FOLLOW_UPS: Mapping[str, tuple[str, ...]] = load_prompt_data().by_category("follow_ups")
