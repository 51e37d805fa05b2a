"""The prompt source of the self-distilled chat corpus: several thousand varied chat prompts,
built offline and deterministically (seeded), disjoint from every dev prompt file.

Where the prompts come from (`SOURCE_COUNTS` says how many of each are drawn):
- hand-written task templates x subjects in the eight MT-bench categories plus everyday advice
  (data files under `specpipe/distill/data/`, loaded by `specpipe.distill.subjects`);
- parametric math and reasoning problems whose numbers and names are drawn from the seed;
- extraction tasks over short synthetic documents (receipts, meeting notes, itineraries);
- real text on this machine: passages of Python's own documentation (`pydoc_data.topics`) to
  explain, summarise or illustrate, and CPython standard-library docstrings (module and function)
  for "what does this do / show an example" questions.

Benchmark prompts never enter: nothing here reads Spec-Bench or MT-bench, and every prompt that
is an exact or near duplicate of a dev prompt (bench/*.jsonl) is dropped (`find_overlaps`). The
result depends only on the seed, the Python version (docs and stdlib text) and the dev files.
A prompt's id is a hash of its text, so resuming a generation run keys on content, not position.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import random
import re
import sys
import sysconfig
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specpipe.distill.subjects import PromptData, load_prompt_data
from specpipe.paths import CHECKOUT_ROOT

DEFAULT_SEED = 20240611
DEV_PROMPT_GLOB = "bench/*.jsonl"

# How many prompts each builder contributes (fewer where its pool is smaller).
SOURCE_COUNTS: dict[str, int] = {
    "writing": 715, "review": 32, "email": 78, "advice": 90, "roleplay": 300, "roleplay_situation": 500,
    "coding": 1770, "coding_concept": 150, "sql": 10, "stem": 600, "stem_compare": 40,
    "humanities": 444, "humanities_question": 22, "math": 1600, "reasoning": 1200, "extraction": 1000,
    "pydoc": 500, "stdlib_module": 400, "stdlib_function": 400,
    "writing_2": 660, "roleplay_2": 240, "roleplay_situation_2": 400, "stem_2": 420, "humanities_2": 360,
    "advice_2": 120,
    "writing_situated": 120, "roleplay_situated": 120, "reasoning_situated": 120, "math_situated": 120,
    "coding_situated": 120, "extraction_situated": 100, "stem_situated": 120, "humanities_situated": 120,
    "advice_situated": 60,
}
# A larger count extends a builder's seeded draw (its first prompts stay the same; tests/test_distill_corpus.py
# checks that a smaller source is a subset). The `*_2` builders draw the second generation of their subjects;
# the `*_situated` builders draw requests that carry the asker's situation (`specpipe.distill.requests`).
# New data items come with a generation and a builder of their own (specpipe/distill/data/README.md).

# Near-duplicate rule (on normalised text): a shared run of this many words, or a word-trigram
# Jaccard similarity at least this high, or a whole dev turn (of at least MIN_CONTAINED words)
# appearing inside the prompt.
SHARED_RUN_WORDS = 12
TRIGRAM_JACCARD = 0.5
MIN_CONTAINED = 5


@dataclass(frozen=True)
class ChatPrompt:
    prompt_id: str  # first 16 hex digits of the SHA-1 of `text` (of a second turn: see follow_up_prompts)
    category: str   # one of the MT-bench categories, or "advice"
    source: str     # which builder made it (a SOURCE_COUNTS key, or "follow_up")
    text: str
    # The conversation before `text`: user and assistant turns alternating, ending with an answer
    # (empty for a first turn).
    history: tuple[str, ...] = ()


def prompt_id(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


# ---- normalisation and overlap with dev prompts -------------------------------------------------
def normalise(text: str) -> str:
    """Lower case, every run of non-alphanumerics one space: formatting never hides a duplicate."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def _ngrams(words: Sequence[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def find_overlaps(texts: Iterable[str], dev_texts: Iterable[str]) -> list[tuple[str, str, str]]:
    """(text, dev text, reason) for every text that is an exact or near duplicate of a dev text."""
    dev = [(raw, normalise(raw)) for raw in dev_texts]
    exact = {norm: raw for raw, norm in dev}
    runs: dict[tuple[str, ...], str] = {}
    trigram_index: dict[tuple[str, ...], list[int]] = defaultdict(list)
    dev_trigrams = []
    for index, (raw, norm) in enumerate(dev):
        words = norm.split()
        for run in _ngrams(words, SHARED_RUN_WORDS):
            runs.setdefault(run, raw)
        grams = _ngrams(words, 3)
        dev_trigrams.append(grams)
        for gram in grams:
            trigram_index[gram].append(index)
    contained = [(f" {norm} ", raw) for raw, norm in dev if len(norm.split()) >= MIN_CONTAINED]
    found = []
    for text in texts:
        norm = normalise(text)
        words = norm.split()
        if norm in exact:
            found.append((text, exact[norm], "exact"))
            continue
        run = next((r for r in _ngrams(words, SHARED_RUN_WORDS) if r in runs), None)
        if run is not None:
            found.append((text, runs[run], f"shares {SHARED_RUN_WORDS} words: {' '.join(run)!r}"))
            continue
        grams = _ngrams(words, 3)
        shared: dict[int, int] = defaultdict(int)
        for gram in grams:
            for index in trigram_index.get(gram, ()):
                shared[index] += 1
        similar = [(count / len(grams | dev_trigrams[i]), i) for i, count in shared.items()]
        best = max(similar, default=(0.0, -1))
        if best[0] >= TRIGRAM_JACCARD:
            found.append((text, dev[best[1]][0], f"trigram Jaccard {best[0]:.2f}"))
            continue
        padded = f" {norm} "
        inside = next((raw for needle, raw in contained if needle in padded), None)
        if inside is not None:
            found.append((text, inside, "contains a dev turn"))
    return found


def dev_prompt_files(root: Path = CHECKOUT_ROOT) -> list[Path]:
    return sorted(root.glob(DEV_PROMPT_GLOB))


def load_dev_turns(paths: Iterable[Path]) -> list[str]:
    """Every turn of every question in Spec-Bench-format JSONL files."""
    turns = []
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                turns.extend(str(turn) for turn in json.loads(line).get("turns", []))
    return turns


# ---- template x subject builders ----------------------------------------------------------------
# A builder: (its seeded generator, how many prompts, the prompt data) -> distinct prompt texts.
Builder = Callable[[random.Random, int, PromptData], list[str]]


def _sample(rng: random.Random, pool: Sequence[str], count: int) -> list[str]:
    return rng.sample(pool, min(count, len(pool)))


def _product(templates: Sequence[str], items: Sequence) -> list[str]:
    """Every template filled with every item (an item of several values fills several slots)."""
    return [template.format(*item) if isinstance(item, tuple) else template.format(item)
            for template in templates for item in items]


def _product_of(templates: str, items: str, gen: int = 1) -> Builder:
    """A sample of the pool `templates` x the generation `gen` of the pool `items`."""
    return lambda rng, count, data: _sample(rng, _product(data.items(templates), data.items(items, gen)), count)


def _asked_as_they_are(pool: str) -> Builder:
    return lambda rng, count, data: _sample(rng, list(data.items(pool)), count)


def _coding(rng: random.Random, count: int, data: PromptData) -> list[str]:
    pool = [template.format(language=language, task=task) for template in data.items("coding.templates")
            for language in data.items("coding.languages") for task in data.items("coding.tasks")]
    return _sample(rng, pool, count)


def _roleplay_situations(gen: int) -> Builder:
    """'You are {persona}. {situation}' for the personas of generation `gen`, sampled."""
    def build(rng: random.Random, count: int, data: PromptData) -> list[str]:
        pool = [f"You are {persona}. {situation}" for persona in data.items("roleplay.personas", gen)
                for situation in data.items("roleplay.situations")]
        return _sample(rng, pool, count)
    return build


@dataclass(frozen=True)
class _Slots:
    """The values parametric problems, synthetic documents and situated requests put in their slots."""

    first_names: tuple[str, ...]
    last_names: tuple[str, ...]
    cities: tuple[str, ...]
    companies: tuple[str, ...]
    products: tuple[tuple[str, float], ...]  # (name, price)
    months: tuple[str, ...]
    job_titles: tuple[str, ...]
    events: tuple[str, ...]
    languages: tuple[str, ...]

    @classmethod
    def of(cls, data: PromptData) -> _Slots:
        pools = ("first_names", "last_names", "cities", "companies", "products", "months", "job_titles", "events")
        return cls(*(data.items(f"slots.{name}") for name in pools), data.items("coding.languages"))


# ---- parametric math and reasoning ----------------------------------------------------------------
def _math_problem(rng: random.Random, data: PromptData) -> str:
    r = rng.randint
    name = rng.choice(_Slots.of(data).first_names)
    kind = r(0, 19)
    if kind == 0:
        return f"What is {r(5, 95)}% of {r(20, 2000)}? Show how you calculate it."
    if kind == 1:
        a, x, b = r(2, 12), r(-10, 15), r(1, 40)
        return f"Solve for x: {a}x + {b} = {a * x + b}."
    if kind == 2:
        w, h = r(3, 30), r(3, 30)
        return f"A rectangle is {w} cm wide and {h} cm tall. What are its area and its perimeter?"
    if kind == 3:
        speed, hours = r(30, 120), r(2, 9)
        return (f"A car travels at {speed} km/h for {hours} hours and then at {speed // 2} km/h for one more "
                f"hour. How far does it travel in total, and what is its average speed?")
    if kind == 4:
        price, discount = r(20, 400), rng.choice([10, 15, 20, 25, 30, 40, 50])
        return (f"A jacket costs {price} dollars and is on sale for {discount}% off. {name} also has a "
                f"coupon for 5 dollars off the sale price. How much does {name} pay?")
    if kind == 5:
        a, c = r(1, 8), r(1, 8)
        b, d = r(a + 1, 12), r(c + 1, 12)  # proper fractions
        op = rng.choice(["+", "-", "*"])
        return f"Calculate {a}/{b} {op} {c}/{d} and simplify the result."
    if kind == 6:
        n = r(3, 12)
        return f"What is the sum of the first {n * 10} positive integers? Explain the shortcut you use."
    if kind == 7:
        a, b = r(12, 180), r(12, 180)
        return f"Find the greatest common divisor and the least common multiple of {a} and {b}."
    if kind == 8:
        n = r(60, 999)
        return f"Write {n} as a product of prime factors."
    if kind == 9:
        p, rate, years = r(5, 50) * 100, rng.choice([2, 3, 4, 5, 6]), r(2, 10)
        return (f"{name} puts {p} dollars in a savings account that pays {rate}% interest per year, "
                f"compounded yearly. How much money is in the account after {years} years?")
    if kind == 10:
        x1, x2 = r(-9, 9), r(-9, 9)
        return f"Solve the quadratic equation x^2 {-(x1 + x2):+d}x {x1 * x2:+d} = 0 and check your answers."
    if kind == 11:
        a, b, c = r(1, 9), r(1, 9), r(1, 9)
        return f"Find the derivative of f(x) = {a}x^3 - {b}x^2 + {c}x - 7 and evaluate it at x = 2."
    if kind == 12:
        total, parts = r(3, 30) * 10, rng.choice([(2, 3), (1, 4), (3, 5), (2, 5), (1, 2)])
        return (f"{name} and a friend share {total} sweets in the ratio {parts[0]}:{parts[1]}. How many does "
                f"each of them get?")
    if kind == 13:
        red, blue = r(2, 10), r(2, 10)
        return (f"A bag holds {red} red balls and {blue} blue balls. Two balls are drawn without "
                f"replacement. What is the probability that both are red?")
    if kind == 14:
        scores = [r(40, 100) for _ in range(r(4, 7))]
        return (f"{name}'s test scores are {', '.join(map(str, scores))}. What are the mean, the median and "
                f"the range of the scores?")
    if kind == 15:
        km = r(2, 60)
        return f"Convert {km} kilometres to miles and to metres, and explain the conversion factors."
    if kind == 16:
        radius = r(2, 25)
        return f"What are the area and the circumference of a circle with a radius of {radius} m?"
    if kind == 17:
        workers, days = r(2, 8), r(3, 15)
        more = workers + r(1, 6)
        return (f"{workers} painters can paint a house in {days} days. How long would {more} painters take, "
                f"working at the same rate?")
    if kind == 18:
        start, step = r(1, 20), r(2, 9)
        return (f"An arithmetic sequence starts at {start} and goes up by {step} each time. What is the "
                f"{r(10, 60)}th term, and what is the sum of the first 20 terms?")
    a, b = r(2, 9), r(1, 9)
    return f"Integrate {a}x^2 + {b} with respect to x from 0 to {r(1, 5)}."


def _reasoning_problem(rng: random.Random, data: PromptData) -> str:
    r = rng.randint
    names = rng.sample(_Slots.of(data).first_names, 5)
    kind = r(0, 11)
    if kind == 0:
        a, b, c = names[:3]
        return (f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Is {a} taller "
                f"than {c}? Explain.")
    if kind == 1:
        age, gap = r(4, 15), r(2, 30)
        return (f"{names[0]} is {gap} years older than {names[1]}. In {r(2, 10)} years, {names[0]} will be "
                f"twice as old as {names[1]} was {age} years ago. Is this possible? Work out their ages if so.")
    if kind == 2:
        start, step = r(1, 9), r(2, 5)
        seq = [start * step ** i for i in range(5)] if rng.random() < 0.5 else \
            [start + i * i * step for i in range(5)]
        return f"What number comes next in the sequence {', '.join(map(str, seq))}? Explain the pattern."
    if kind == 3:
        animal, trait, group = rng.choice([
            ("cats", "have whiskers", "mammals"), ("roses", "need water", "plants"),
            ("robins", "lay eggs", "birds"), ("sharks", "can swim", "fish"),
            ("oaks", "have roots", "trees"), ("violins", "make sound", "instruments")])
        return (f"All {group} {trait}. All {animal} are {group}. Does it follow that all {animal} {trait}? "
                f"What if we only knew that some {group} {trait}?")
    if kind == 4:
        day = rng.choice(["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"])
        n = r(10, 400)
        return f"If today is {day}, what day of the week will it be in {n} days? Show your reasoning."
    if kind == 5:
        n = r(4, 30)
        return f"{n} people meet and every person shakes hands with every other person once. How many handshakes are there?"
    if kind == 6:
        a, b, c = names[:3]
        pets = rng.sample(["a dog", "a cat", "a rabbit", "a parrot", "a turtle", "a hamster"], 3)
        return (f"{a}, {b} and {c} each have one pet: {pets[0]}, {pets[1]} or {pets[2]}. {a} does not have "
                f"{pets[0]}. {b} has {pets[1]}. Who has which pet? Explain step by step.")
    if kind == 7:
        coins = r(6, 12)
        return (f"You have {coins} coins and one of them is slightly heavier than the others. Using a balance "
                f"scale, what is the smallest number of weighings that always finds the heavy coin? How?")
    if kind == 8:
        socks = r(3, 6)
        return (f"A drawer holds socks of {socks} different colours, many of each. In the dark, how many socks "
                f"must you take to be sure of a matching pair? Explain why.")
    if kind == 9:
        x, y = r(2, 6), r(2, 6)
        return (f"A snail climbs {x + y} metres up a wall during the day and slides back {y} metres at night. "
                f"The wall is {r(10, 30)} metres high. On which day does it reach the top?")
    if kind == 10:
        a, b, c, d = names[:4]
        return (f"In a race, {a} finished ahead of {b}, {c} finished behind {d}, and {b} finished ahead of "
                f"{d}. Who came last? Can we know who won?")
    claim = rng.choice([
        "it rained, so the street is wet", "the alarm did not ring, so I was late",
        "the shop is open, so the lights are on", "the plant was watered, so it grew"])
    return (f"Someone argues: 'If {claim.split(', so ')[0]}, then {claim.split(', so ')[1]}. "
            f"{claim.split(', so ')[1].capitalize()}, so {claim.split(', so ')[0]}.' Is this reasoning valid? "
            f"Name the logical error if there is one.")


# ---- extraction over synthetic documents --------------------------------------------------------------
def _extraction_task(rng: random.Random, data: PromptData) -> str:
    r = rng.randint
    slot = _Slots.of(data)
    person = f"{rng.choice(slot.first_names)} {rng.choice(slot.last_names)}"
    date = f"{r(1, 28)} {rng.choice(slot.months)} {r(2015, 2025)}"
    kind = r(0, 5)
    if kind == 0:
        items = rng.sample(slot.products, r(2, 5))
        lines = "\n".join(f"{r(1, 4)} x {name} ... {price:.2f}" for name, price in items)
        doc = f"{rng.choice(slot.companies)}\nReceipt, {date}\n{lines}\nPaid by card."
        ask = rng.choice([
            "Extract every item with its quantity and unit price as JSON, and compute the total.",
            "List the items on this receipt in a table with the columns item, quantity and price.",
            "What was bought, on which date, and in which shop? Answer in one sentence per item."])
    elif kind == 1:
        people = [(f"{rng.choice(slot.first_names)} {rng.choice(slot.last_names)}", rng.choice(slot.job_titles))
                  for _ in range(r(2, 4))]
        roles = ", ".join(f"{name} ({title})" for name, title in people)
        doc = (f"Notes from {rng.choice(slot.events)} at {rng.choice(slot.companies)}, {date}. Present: {roles}. "
               f"{people[0][0]} opened the meeting and asked {people[-1][0]} to report on progress. The group "
               f"agreed to meet again in {r(2, 6)} weeks in {rng.choice(slot.cities)}.")
        ask = rng.choice([
            "Extract the names and job titles of everyone present as JSON.",
            "When and where is the next meeting? Quote the part of the notes that says so.",
            "Summarise these notes in two bullet points and list the people mentioned."])
    elif kind == 2:
        stops = rng.sample(slot.cities, r(3, 5))
        arrivals = [1]
        for _ in stops[1:]:
            arrivals.append(arrivals[-1] + r(1, 4))
        legs = "; ".join(f"day {day}: {city}" for day, city in zip(arrivals, stops))
        doc = f"Travel plan for {person}, starting {date}: {legs}. Return flight from {stops[-1]}."
        ask = rng.choice([
            "List the cities in the order they are visited, with the day of arrival, as a table.",
            "Extract the traveller's name, the start date and the cities as JSON.",
            "How many cities does the trip include, and which is the last one?"])
    elif kind == 3:
        phone = f"+{r(1, 49)} {r(100, 999)} {r(1000, 9999)} {r(100, 999)}"
        email = f"{person.split()[0].lower()}.{person.split()[1].lower()}@example.org"
        doc = (f"Hi, this is {person} from {rng.choice(slot.companies)}. I'm the new {rng.choice(slot.job_titles)} "
               f"and I'll be in {rng.choice(slot.cities)} until {date}. Reach me at {email} or on {phone}.")
        ask = rng.choice([
            "Extract the name, company, job title, email and phone number as JSON.",
            "Turn this message into a contact card with one field per line."])
    elif kind == 4:
        product, _ = rng.choice(slot.products)
        good = rng.choice(["the battery lasts for days", "it looks great", "setup took two minutes",
                           "it is very light", "the price was fair"])
        bad = rng.choice(["the instructions are confusing", "it arrived scratched", "it is a bit loud",
                          "the colour is not as pictured", "delivery took three weeks"])
        doc = (f"Review by {person}, {date}: I bought this {product} last month. Honestly, {good}, but "
               f"{bad}. I would give it {r(2, 5)} stars.")
        ask = rng.choice([
            "Extract the product, the rating, one positive point and one negative point as JSON.",
            "Is this review mostly positive or negative? Quote the phrases that support your answer."])
    else:
        values = {city: r(-5, 35) for city in rng.sample(slot.cities, r(3, 6))}
        doc = "Noon temperatures on " + date + ": " + ", ".join(f"{c} {t} C" for c, t in values.items()) + "."
        ask = rng.choice([
            "Put this data into a table sorted from warmest to coldest.",
            "Which city was the warmest and which the coldest? What is the difference between them?",
            "Convert every temperature to Fahrenheit and return the result as JSON."])
    return f"{ask}\n\n{doc}"


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


def _pydoc(rng: random.Random, count: int, data: PromptData) -> list[str]:
    passages = _pydoc_passages()
    pool = [template.format(passage) for passage in passages for template in data.items("pydoc.templates")]
    return _sample(rng, pool, count)


SKIP_MODULES = ("test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "venv", "distutils",
                "antigravity", "this", "__phello__", "pydoc_data", "site-packages", "config-")


@functools.lru_cache(maxsize=1)
def _stdlib_docstrings() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(module, first docstring paragraph) and (module.function, first paragraph) for public
    CPython stdlib modules, read with `ast` (importing them all would run their side effects)."""
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
    return modules, functions


def _first_paragraph(doc: str | None, min_chars: int = 30, max_chars: int = 600) -> str | None:
    if not doc:
        return None
    paragraph = re.split(r"\n\s*\n", doc.strip())[0].strip()
    return paragraph[:max_chars] if len(paragraph) >= min_chars else None


def _stdlib_module(rng: random.Random, count: int, data: PromptData) -> list[str]:
    modules, _ = _stdlib_docstrings()
    templates = data.items("stdlib_module.templates")
    return _sample(rng, [t.format(name, doc) for name, doc in modules for t in templates], count)


def _stdlib_function(rng: random.Random, count: int, data: PromptData) -> list[str]:
    _, functions = _stdlib_docstrings()
    templates = data.items("stdlib_function.templates")
    return _sample(rng, [t.format(name, doc) for name, doc in functions for t in templates], count)


# ---- situated requests ---------------------------------------------------------------------------------
def _fill_slots(template: str, rng: random.Random, data: PromptData | None = None) -> str:
    """A situated request with its slots ({name}, {city}, {n}, ...) drawn from the seeded generator."""
    slot = _Slots.of(data or load_prompt_data())
    first, second = rng.sample(slot.first_names, 2)
    product, price = rng.choice(slot.products)
    return template.format(
        name=first, name2=second, last=rng.choice(slot.last_names), city=rng.choice(slot.cities),
        company=rng.choice(slot.companies), product=product, price=f"{price * 1.2:.2f}",
        job=rng.choice(slot.job_titles), month=rng.choice(slot.months), language=rng.choice(slot.languages),
        n=rng.randint(2, 9), m=rng.randint(2, 9), k=rng.randint(2, 5))


def _situated_request(category: str) -> Callable[[random.Random, PromptData | None], str]:
    """A maker of one category's situated requests: a request of `requests.SITUATED_REQUESTS` with its slots
    filled, and one of the category's constraints (or none) after the ask, before any quoted document."""
    def make(rng: random.Random, data: PromptData | None = None) -> str:
        data = data or load_prompt_data()
        text = _fill_slots(rng.choice(data.items(f"situated.{category}")), rng, data)
        constraint = rng.choice(data.items(f"constraints.{category}"))
        if not constraint:
            return text
        ask, sep, document = text.partition("\n\n")
        return f"{ask} {constraint}{sep}{document}"
    return make


# ---- assembly ---------------------------------------------------------------------------------------
def _repeat(make: Callable[[random.Random, PromptData], str]) -> Builder:
    """A builder drawing `count` distinct problems from a random problem maker."""
    def build(rng: random.Random, count: int, data: PromptData) -> list[str]:
        seen: dict[str, None] = {}
        for _ in range(count * 20):  # bounded: a small pool can run dry before `count`
            seen.setdefault(make(rng, data), None)
            if len(seen) == count:
                break
        return list(seen)
    return build


BUILDERS: dict[str, tuple[str, Builder]] = {
    "writing": ("writing", _product_of("writing.templates", "writing.subjects")),
    "review": ("writing", _product_of("review.templates", "review.subjects")),
    "email": ("writing", _product_of("email.templates", "email.subjects")),
    "advice": ("advice", _product_of("advice.templates", "advice.topics")),
    "roleplay": ("roleplay", _product_of("roleplay.templates", "roleplay.personas")),
    "roleplay_situation": ("roleplay", _roleplay_situations(gen=1)),
    "coding": ("coding", _coding),
    "coding_concept": ("coding", _product_of("coding_concept.templates", "coding_concept.concepts")),
    "sql": ("coding", _product_of("sql.templates", "sql.tasks")),
    "stem": ("stem", _product_of("stem.templates", "stem.concepts")),
    "stem_compare": ("stem", _product_of("stem_compare.templates", "stem_compare.pairs")),
    "humanities": ("humanities", _product_of("humanities.templates", "humanities.topics")),
    "humanities_question": ("humanities", _asked_as_they_are("humanities_question.questions")),
    "math": ("math", _repeat(_math_problem)),
    "reasoning": ("reasoning", _repeat(_reasoning_problem)),
    "extraction": ("extraction", _repeat(_extraction_task)),
    "pydoc": ("coding", _pydoc),
    "stdlib_module": ("coding", _stdlib_module),
    "stdlib_function": ("coding", _stdlib_function),
    "writing_2": ("writing", _product_of("writing.templates", "writing.subjects", gen=2)),
    "roleplay_2": ("roleplay", _product_of("roleplay.templates", "roleplay.personas", gen=2)),
    "roleplay_situation_2": ("roleplay", _roleplay_situations(gen=2)),
    "stem_2": ("stem", _product_of("stem.templates", "stem.concepts", gen=2)),
    "humanities_2": ("humanities", _product_of("humanities.templates", "humanities.topics", gen=2)),
    "advice_2": ("advice", _product_of("advice.templates", "advice.topics", gen=2)),
    **{f"{category}_situated": (category, _repeat(_situated_request(category)))
       for category in load_prompt_data().by_category("situated")},
}


@dataclass(frozen=True)
class PromptSource:
    """The prompts in generation order, and what was dropped to keep them off the dev sets."""

    prompts: list[ChatPrompt]
    dropped: list[tuple[str, str, str]]  # (prompt, dev turn, reason)
    dev_files: list[str]
    seed: int

    def describe(self) -> dict:
        counts: dict[str, int] = defaultdict(int)
        for prompt in self.prompts:
            counts[prompt.source] += 1
        return {"seed": self.seed, "prompts": len(self.prompts), "per_source": dict(sorted(counts.items())),
                "dropped_as_dev_overlap": len(self.dropped), "dev_files": self.dev_files,
                "python": sys.version.split()[0]}


def build_prompt_source(seed: int = DEFAULT_SEED, dev_files: Sequence[Path] | None = None,
                        counts: dict[str, int] | None = None, data: PromptData | None = None) -> PromptSource:
    """All distillation prompts, deduplicated, without dev overlaps, shuffled (seeded) so that
    any prefix of the list is a balanced mix of categories. `data`: the pools drawn from (the
    package's data files by default)."""
    dev_files = dev_prompt_files() if dev_files is None else list(dev_files)
    counts = SOURCE_COUNTS if counts is None else counts
    data = load_prompt_data() if data is None else data
    candidates: list[ChatPrompt] = []
    seen: set[str] = set()
    for source, count in counts.items():
        category, build = BUILDERS[source]
        # One generator per builder, seeded by name: changing one source's count leaves the others as they are.
        rng = random.Random(f"{seed}:{source}")
        for text in build(rng, count, data):
            key = normalise(text)
            if key not in seen:
                seen.add(key)
                candidates.append(ChatPrompt(prompt_id(text), category, source, text))
    dropped = find_overlaps([p.text for p in candidates], load_dev_turns(dev_files))
    dropped_texts = {text for text, _, _ in dropped}
    prompts = [p for p in candidates if p.text not in dropped_texts]
    random.Random(f"{seed}:order").shuffle(prompts)
    return PromptSource(prompts, dropped, [display_path(Path(f)) for f in dev_files], seed)


FOLLOW_UP_SOURCE = "follow_up"


def follow_up_prompts(first_turns: Sequence[tuple[ChatPrompt, str]], seed: int = DEFAULT_SEED,
                      dev_files: Sequence[Path] | None = None, data: PromptData | None = None) -> list[ChatPrompt]:
    """A second turn for each (first-turn prompt, the target's answer to it): a follow-up request
    of the prompt's category (`subjects.FOLLOW_UPS`), drawn by a generator seeded by the prompt's
    id, with the first turn and its answer as history. Its id hashes the first turn's id and the
    request, so it is stable whatever else is answered. Requests that overlap a dev prompt are
    never used (`find_overlaps`)."""
    dev_files = dev_prompt_files() if dev_files is None else list(dev_files)
    requests = (load_prompt_data() if data is None else data).by_category("follow_ups")
    overlapping = {text for text, _, _ in find_overlaps([t for texts in requests.values() for t in texts],
                                                        load_dev_turns(dev_files))}
    usable = {category: [text for text in texts if text not in overlapping] for category, texts in requests.items()}
    follow_ups = []
    for first, answer in first_turns:
        if first.history or not usable.get(first.category):
            continue  # follow-ups of follow-ups are not made; a category without requests gets none
        text = random.Random(f"{seed}:follow_up:{first.prompt_id}").choice(usable[first.category])
        follow_ups.append(ChatPrompt(prompt_id(f"{first.prompt_id}\n{text}"), first.category, FOLLOW_UP_SOURCE,
                                     text, (first.text, answer)))
    return follow_ups


def display_path(path: Path) -> str:
    """Repository files by their relative path (metadata must not depend on the checkout's location)."""
    path = path.resolve()
    return str(path.relative_to(CHECKOUT_ROOT)) if path.is_relative_to(CHECKOUT_ROOT) else str(path)


def main() -> None:
    """`python -m specpipe.distill.prompts [OUT.jsonl]`: print the composition (and write the prompts)."""
    source = build_prompt_source()
    print(json.dumps(source.describe(), indent=1))
    for text, dev, reason in source.dropped[:20]:
        print(f"dropped ({reason}): {text[:80]!r} ~ dev {dev[:60]!r}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w", encoding="utf-8") as out:
            for p in source.prompts:
                out.write(json.dumps({"prompt_id": p.prompt_id, "category": p.category, "source": p.source,
                                      "text": p.text}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
