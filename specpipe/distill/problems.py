"""The problem makers of the distillation prompt source: one seeded draw each of a parametric math or
reasoning problem (its numbers and names drawn from the generator), of an extraction task over a short
synthetic document (a receipt, meeting notes, an itinerary, a message, a review, a table of
temperatures) or of a situated request (`specpipe.distill.requests`) with its slots filled. The values
they put in their slots are pools of the prompt data (`Slots`); `specpipe.distill.builders.repeat`
turns a maker into a builder of distinct prompts.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from specpipe.distill.subjects import PromptData, load_prompt_data


@dataclass(frozen=True)
class Slots:
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
    def of(cls, data: PromptData) -> Slots:
        pools = ("first_names", "last_names", "cities", "companies", "products", "months", "job_titles", "events")
        return cls(*(data.items(f"slots.{name}") for name in pools), data.items("coding.languages"))


# ---- parametric math and reasoning ----------------------------------------------------------------
def math_problem(rng: random.Random, data: PromptData) -> str:
    r = rng.randint
    name = rng.choice(Slots.of(data).first_names)
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


def reasoning_problem(rng: random.Random, data: PromptData) -> str:
    r = rng.randint
    names = rng.sample(Slots.of(data).first_names, 5)
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
def extraction_task(rng: random.Random, data: PromptData) -> str:
    r = rng.randint
    slot = Slots.of(data)
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


# ---- situated requests ---------------------------------------------------------------------------------
def fill_slots(template: str, rng: random.Random, data: PromptData | None = None) -> str:
    """A situated request with its slots ({name}, {city}, {n}, ...) drawn from the seeded generator."""
    slot = Slots.of(data or load_prompt_data())
    first, second = rng.sample(slot.first_names, 2)
    product, price = rng.choice(slot.products)
    return template.format(
        name=first, name2=second, last=rng.choice(slot.last_names), city=rng.choice(slot.cities),
        company=rng.choice(slot.companies), product=product, price=f"{price * 1.2:.2f}",
        job=rng.choice(slot.job_titles), month=rng.choice(slot.months), language=rng.choice(slot.languages),
        n=rng.randint(2, 9), m=rng.randint(2, 9), k=rng.randint(2, 5))


def situated_request(category: str) -> Callable[[random.Random, PromptData | None], str]:
    """A maker of one category's situated requests: a request of `requests.SITUATED_REQUESTS` with its slots
    filled, and one of the category's constraints (or none) after the ask, before any quoted document."""
    def make(rng: random.Random, data: PromptData | None = None) -> str:
        data = data or load_prompt_data()
        text = fill_slots(rng.choice(data.items(f"situated.{category}")), rng, data)
        constraint = rng.choice(data.items(f"constraints.{category}"))
        if not constraint:
            return text
        ask, sep, document = text.partition("\n\n")
        return f"{ask} {constraint}{sep}{document}"
    return make
