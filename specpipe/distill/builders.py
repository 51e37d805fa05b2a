"""The builders of the distillation prompt source: each turns a seeded generator, a count and the prompt
data into that many distinct prompt texts, by sampling a pool of templates x subjects, of real text on
this machine (passages of Python's own documentation, `pydoc_data.topics`, and CPython standard-library
docstrings, read with `ast`) or of problems a maker draws one at a time (`repeat`). They draw by position,
so a builder's prompts depend only on its generator's seed and the pools it reads;
`specpipe.distill.prompts.BUILDERS` names each one and says which category its prompts belong to.
"""
from __future__ import annotations

import ast
import functools
import random
import re
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path

from specpipe.distill.subjects import PromptData

# A builder: (its seeded generator, how many prompts, the prompt data) -> distinct prompt texts.
Builder = Callable[[random.Random, int, PromptData], list[str]]


def sample(rng: random.Random, pool: Sequence[str], count: int) -> list[str]:
    return rng.sample(pool, min(count, len(pool)))


def _product(templates: Sequence[str], items: Sequence) -> list[str]:
    """Every template filled with every item (an item of several values fills several slots)."""
    return [template.format(*item) if isinstance(item, tuple) else template.format(item)
            for template in templates for item in items]


# ---- template x subject ------------------------------------------------------------------------------
def product_of(templates: str, items: str, gen: int = 1) -> Builder:
    """A sample of the pool `templates` x the generation `gen` of the pool `items`."""
    return lambda rng, count, data: sample(rng, _product(data.items(templates), data.items(items, gen)), count)


def asked_as_they_are(pool: str) -> Builder:
    return lambda rng, count, data: sample(rng, list(data.items(pool)), count)


def coding(rng: random.Random, count: int, data: PromptData) -> list[str]:
    pool = [template.format(language=language, task=task) for template in data.items("coding.templates")
            for language in data.items("coding.languages") for task in data.items("coding.tasks")]
    return sample(rng, pool, count)


def roleplay_situations(gen: int) -> Builder:
    """'You are {persona}. {situation}' for the personas of generation `gen`, sampled."""
    def build(rng: random.Random, count: int, data: PromptData) -> list[str]:
        pool = [f"You are {persona}. {situation}" for persona in data.items("roleplay.personas", gen)
                for situation in data.items("roleplay.situations")]
        return sample(rng, pool, count)
    return build


def repeat(make: Callable[[random.Random, PromptData], str]) -> Builder:
    """A builder drawing `count` distinct problems from a random problem maker."""
    def build(rng: random.Random, count: int, data: PromptData) -> list[str]:
        seen: dict[str, None] = {}
        for _ in range(count * 20):  # bounded: a small pool can run dry before `count`
            seen.setdefault(make(rng, data), None)
            if len(seen) == count:
                break
        return list(seen)
    return build


# ---- real text on this machine ------------------------------------------------------------------------
def _pydoc_passages(min_chars: int = 400, max_chars: int = 1200) -> list[str]:
    """Paragraph-aligned passages of Python's reference documentation, in topic order."""
    from pydoc_data.topics import topics

    passages = []
    for name in sorted(topics):
        current = ""
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            paragraph = paragraph.strip()
            if not paragraph:
                continue
            if current and len(current) + len(paragraph) > max_chars:
                if len(current) >= min_chars:
                    passages.append(current)
                current = ""
            current = f"{current}\n\n{paragraph}" if current else paragraph
        if len(current) >= min_chars:
            passages.append(current[: max_chars * 2])
    return passages


def pydoc(rng: random.Random, count: int, data: PromptData) -> list[str]:
    passages = _pydoc_passages()
    pool = [template.format(passage) for passage in passages for template in data.items("pydoc.templates")]
    return sample(rng, pool, count)


SKIP_MODULES = ("test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "venv", "distutils",
                "antigravity", "this", "__phello__", "pydoc_data", "site-packages", "config-")


@functools.lru_cache(maxsize=1)
def _stdlib_docstrings() -> dict[str, list[tuple[str, str]]]:
    """{"module": [(module, first docstring paragraph)], "function": [(module.function, first paragraph)]}
    for public CPython stdlib modules, read with `ast` (importing them all would run their side effects)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    modules, functions = [], []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/__init__.py")):
        name = path.stem if path.name != "__init__.py" else path.parent.name
        if name.startswith("_") or name.startswith(SKIP_MODULES):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        doc = _first_paragraph(ast.get_docstring(tree))
        if doc:
            modules.append((name, doc))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = _first_paragraph(ast.get_docstring(node))
                if doc:
                    functions.append((f"{name}.{node.name}", doc))
    return {"module": modules, "function": functions}


def _first_paragraph(doc: str | None, min_chars: int = 30, max_chars: int = 600) -> str | None:
    if not doc:
        return None
    paragraph = re.split(r"\n\s*\n", doc.strip())[0].strip()
    return paragraph[:max_chars] if len(paragraph) >= min_chars else None


def stdlib_docstrings(kind: str) -> Builder:
    """Questions on the docstrings of the stdlib's modules (`kind` "module") or of their public functions
    ("function"), from the templates of the pool `stdlib_<kind>.templates`."""
    def build(rng: random.Random, count: int, data: PromptData) -> list[str]:
        templates = data.items(f"stdlib_{kind}.templates")
        return sample(rng, [t.format(name, doc) for name, doc in _stdlib_docstrings()[kind] for t in templates],
                      count)
    return build
