"""Seeded synthetic arithmetic word problems: the dataset that needs nothing offline."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import datasets

from rfopt.errors import Refusal
from ._prompts import REASONING_SYSTEM_PROMPT
from ._source import Splits, check_sizes, conversation


@dataclass(frozen=True)
class _Tier:
    limit: int  # every number in a problem (given, intermediate, answer) is below this
    steps: tuple[int, ...]  # how many operations a problem may take

    @property
    def factor(self) -> int:
        """Largest multiplier / divisor, so that products stay below ``limit``."""
        return max(9, math.isqrt(self.limit) // 2)


# Tier 1 is meant for a 135M model to get right some of the time.
_TIERS = {1: _Tier(100, (1, 2)), 2: _Tier(1000, (2, 3)), 3: _Tier(10000, (3,))}


@dataclass(frozen=True)
class _Problem:
    template: str
    question: str
    steps: list[str]  # worked solution, one sentence per operation
    answer: int
    values: tuple[int, ...]  # every number involved, checked against the tier's limit


_NAMES = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "Gus", "Hana", "Ivan", "Julia",
          "Kofi", "Lena", "Mateo", "Nina", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara"]
_ITEMS = ["pencil", "notebook", "apple", "sticker", "marble", "comic", "cupcake", "ticket"]
_THINGS = ["marbles", "stickers", "cards", "shells", "beads", "stamps", "candies", "coins"]
_PLANTS = ["tulips", "tomato plants", "sunflowers", "carrots", "roses", "pepper plants"]
_VEHICLES = ["car", "train", "bus", "truck", "boat"]
_BAKED = ["cookies", "muffins", "rolls", "brownies", "tarts"]
_PURCHASES = ["book", "game", "scarf", "kite", "lamp", "backpack"]


def _shopping(rng: random.Random, n_ops: int, tier: _Tier) -> _Problem | None:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    qty, price = rng.randint(2, tier.factor), rng.randint(2, tier.factor)
    cost = qty * price
    question = f"{name} buys {qty} {item}s that cost ${price} each."
    steps = [f"The {item}s cost {qty} * {price} = {cost} dollars."]
    values = [qty, price, cost]
    if n_ops == 1:
        return _Problem("shopping", question + f" How many dollars does {name} spend?",
                        steps, cost, tuple(values))
    total = cost
    if n_ops == 3:
        extra = rng.randint(1, tier.factor)
        total = cost + extra
        question += f" {name} also buys a bottle of juice for ${extra}."
        steps.append(f"With the juice, {name} spends {cost} + {extra} = {total} dollars.")
        values += [extra, total]
    bills = [b for b in (10, 20, 50, 100, 200, 500, 1000, 2000, 5000) if total < b < tier.limit]
    if not bills:
        return None
    bill = rng.choice(bills)
    change = bill - total
    question += f" {name} pays with a ${bill} bill. How many dollars of change does {name} get?"
    steps.append(f"The change is {bill} - {total} = {change} dollars.")
    return _Problem("shopping", question, steps, change, tuple(values + [bill, change]))


def _sharing(rng: random.Random, n_ops: int, tier: _Tier) -> _Problem:
    name, things = rng.choice(_NAMES), rng.choice(_THINGS)
    friends, each = rng.randint(2, tier.factor), rng.randint(2, tier.factor)
    total = friends * each  # chosen first so the division is exact
    if n_ops == 1:
        question = f"{name} has {total} {things} and shares them equally among {friends} friends."
        steps = []
        values = [total]
    else:
        gained = rng.randint(1, total - 1)
        start = total - gained
        question = f"{name} has {start} {things}."
        values = [start, gained]
        if n_ops == 3:
            lost = rng.randint(1, tier.factor)
            start += lost
            question = f"{name} has {start} {things} and gives {lost} to a neighbour."
            steps = [f"After giving some away, {name} has {start} - {lost} = {start - lost} {things}."]
            values += [start, lost]
        else:
            steps = []
        question += f" Then {name} gets {gained} more and shares them all equally among {friends} friends."
        steps.append(f"{name} then has {total - gained} + {gained} = {total} {things}.")
        values.append(total)
    question += " How many does each friend get?"
    steps.append(f"Each friend gets {total} / {friends} = {each} {things}.")
    return _Problem("sharing", question, steps, each, tuple(values + [friends, each]))


def _ages(rng: random.Random, n_ops: int, tier: _Tier) -> _Problem:
    # People stay under 100 whatever the tier: 40 * 2 + 15 < 100, and 3x only when it fits.
    a, b, c = rng.sample(_NAMES, 3)
    age_a, older = rng.randint(2, 20), rng.randint(1, 20)
    age_b = age_a + older
    question = f"{a} is {age_a} years old. {b} is {older} years older than {a}."
    steps = [f"{b} is {age_a} + {older} = {age_b} years old."]
    values = [age_a, older, age_b]
    answer, who = age_b, b
    if n_ops >= 2:
        times = rng.choice([t for t in (2, 3) if age_b * t + 15 < 100])
        answer, who = age_b * times, c
        question += f" {c} is {'twice' if times == 2 else 'three times'} as old as {b}."
        steps.append(f"{c} is {age_b} * {times} = {answer} years old.")
        values += [times, answer]
    if n_ops == 3:
        years = rng.randint(2, 15)
        question += f" How old will {c} be in {years} years?"
        steps.append(f"In {years} years {c} will be {answer} + {years} = {answer + years}.")
        answer += years
        values += [years, answer]
    else:
        question += f" How old is {who}?"
    return _Problem("ages", question, steps, answer, tuple(values))


def _distance(rng: random.Random, n_ops: int, tier: _Tier) -> _Problem:
    vehicle = rng.choice(_VEHICLES)
    speed, hours = rng.randint(2, tier.factor), rng.randint(2, 9)
    far = speed * hours
    question = f"A {vehicle} travels {speed} km every hour for {hours} hours."
    steps = [f"In {hours} hours it travels {speed} * {hours} = {far} km."]
    values = [speed, hours, far]
    if n_ops == 1:
        return _Problem("distance", question + " How many km does it travel?", steps, far, tuple(values))
    more = rng.randint(1, tier.factor)
    question += f" Then it travels {more} km more."
    steps.append(f"In all it travels {far} + {more} = {far + more} km.")
    values += [more, far + more]
    if n_ops == 2:
        return _Problem("distance", question + " How many km does it travel in all?",
                        steps, far + more, tuple(values))
    trip = far + more + rng.randint(1, tier.factor)
    left = trip - far - more
    question = f"A trip is {trip} km long. " + question + " How many km of the trip are left?"
    steps.append(f"There are {trip} - {far + more} = {left} km left.")
    return _Problem("distance", question, steps, left, tuple(values + [trip, left]))


def _savings(rng: random.Random, n_ops: int, tier: _Tier) -> _Problem:
    name, thing = rng.choice(_NAMES), rng.choice(_PURCHASES)
    weekly, weeks = rng.randint(2, tier.factor), rng.randint(2, 9)
    saved = weekly * weeks
    question = f"{name} saves ${weekly} every week for {weeks} weeks."
    steps = [f"{name} saves {weekly} * {weeks} = {saved} dollars."]
    values = [weekly, weeks, saved]
    if n_ops == 1:
        return _Problem("savings", question + f" How many dollars does {name} save?",
                        steps, saved, tuple(values))
    total = saved
    if n_ops == 3:
        start = rng.randint(1, tier.factor)
        total = start + saved
        question = f"{name} has ${start}. " + question
        steps.append(f"With the {start} dollars from before, {name} has {start} + {saved} = {total} dollars.")
        values += [start, total]
    spent = rng.randint(1, total - 1)
    left = total - spent
    question += f" Then {name} spends ${spent} on a {thing}. How many dollars does {name} have left?"
    steps.append(f"{name} has {total} - {spent} = {left} dollars left.")
    return _Problem("savings", question, steps, left, tuple(values + [spent, left]))


def _baking(rng: random.Random, n_ops: int, tier: _Tier) -> _Problem:
    name, baked = rng.choice(_NAMES), rng.choice(_BAKED)
    trays, per_tray = rng.randint(2, 9), rng.randint(2, tier.factor)
    made = trays * per_tray
    question = f"{name} bakes {trays} trays of {baked} with {per_tray} {baked} on each tray."
    steps = [f"{name} bakes {trays} * {per_tray} = {made} {baked}."]
    values = [trays, per_tray, made]
    if n_ops == 1:
        question += f" How many {baked} does {name} bake?"
        return _Problem("baking", question, steps, made, tuple(values))
    if n_ops == 2:
        eaten = rng.randint(1, made - 1)
        question += f" The family eats {eaten} of them. How many {baked} are left?"
        steps.append(f"There are {made} - {eaten} = {made - eaten} {baked} left.")
        return _Problem("baking", question, steps, made - eaten, tuple(values + [eaten, made - eaten]))
    bag = rng.randint(2, min(9, made - 1))
    bags = max(1, (made - 1) // bag - rng.randint(0, 2))  # few eaten, most packed
    eaten = made - bag * bags  # chosen so the rest fills whole bags
    question += (f" The family eats {eaten} of them and packs the rest into bags of {bag}."
                 f" How many bags do they fill?")
    steps.append(f"There are {made} - {eaten} = {made - eaten} {baked} left.")
    steps.append(f"They fill {made - eaten} / {bag} = {bags} bags.")
    return _Problem("baking", question, steps, bags, tuple(values + [eaten, bag, bags]))


def _reading(rng: random.Random, n_ops: int, tier: _Tier) -> _Problem:
    name = rng.choice(_NAMES)
    per_day, days = rng.randint(2, tier.factor), rng.randint(2, 7)
    read = per_day * days if n_ops >= 2 else rng.randint(2, tier.limit // 2)
    extra = rng.randint(1, tier.factor) if n_ops == 3 else 0
    pages = read + extra + rng.randint(1, tier.limit // 2)
    if n_ops == 1:
        question = f"A book has {pages} pages. {name} has read {read} pages. How many pages are left?"
        steps = [f"There are {pages} - {read} = {pages - read} pages left."]
        return _Problem("reading", question, steps, pages - read, (pages, read, pages - read))
    question = f"A book has {pages} pages. {name} reads {per_day} pages a day for {days} days."
    steps = [f"{name} reads {per_day} * {days} = {read} pages."]
    values = [pages, per_day, days, read]
    if n_ops == 3:
        question += f" Then {name} reads {extra} more pages on the weekend."
        steps.append(f"In all {name} reads {read} + {extra} = {read + extra} pages.")
        values += [extra, read + extra]
    left = pages - read - extra
    question += " How many pages are left?"
    steps.append(f"There are {pages} - {read + extra} = {left} pages left.")
    return _Problem("reading", question, steps, left, tuple(values + [left]))


def _garden(rng: random.Random, n_ops: int, tier: _Tier) -> _Problem:
    name, plants = rng.choice(_NAMES), rng.choice(_PLANTS)
    rows, per_row = rng.randint(2, 9), rng.randint(2, tier.factor)
    planted = rows * per_row
    question = f"{name} plants {rows} rows of {plants} with {per_row} in each row."
    steps = [f"{name} plants {rows} * {per_row} = {planted} {plants} in rows."]
    values = [rows, per_row, planted]
    answer = planted
    if n_ops >= 2:
        fence = rng.randint(1, tier.factor)
        answer = planted + fence
        question += f" {name} also plants {fence} more by the fence."
        steps.append(f"With those by the fence there are {planted} + {fence} = {answer} {plants}.")
        values += [fence, answer]
    if n_ops == 3:
        died = rng.randint(1, answer - 1)
        question += f" {died} of them do not grow. How many {plants} grow?"
        steps.append(f"{answer} - {died} = {answer - died} {plants} grow.")
        answer -= died
        values += [died, answer]
    else:
        question += f" How many {plants} does {name} plant?"
    return _Problem("garden", question, steps, answer, tuple(values))


# A template builds a problem with the given number of operations, or returns None when the
# numbers it drew cannot make one.
_TEMPLATES: tuple[Callable[[random.Random, int, _Tier], _Problem | None], ...] = (
    _shopping, _sharing, _ages, _distance, _savings, _baking, _reading, _garden,
)


def _problems(seed: int, split: str, tier: _Tier, n: int, exclude: set[str]) -> list[_Problem]:
    """``n`` distinct problems, none whose question is in ``exclude``; same arguments, same list."""
    # A str seed is hashed with SHA-512, so the stream is the same in every process.
    rng = random.Random(f"rfopt-arithmetic:{seed}:{split}:{tier.limit}")
    found: list[_Problem] = []
    seen = set(exclude)
    for _ in range(100 * n + 1000):
        if len(found) == n:
            return found
        problem = rng.choice(_TEMPLATES)(rng, rng.choice(tier.steps), tier)
        if (
            problem is None
            or problem.question in seen
            or not all(0 <= v < tier.limit for v in problem.values)
        ):
            continue  # out of the tier's range, or a repeat: draw again
        seen.add(problem.question)
        found.append(problem)
    if len(found) < n:
        raise Refusal(f"arithmetic: could only make {len(found)} distinct {split} problems, not {n}.")
    return found


def load_arithmetic(
    n_train: int = 128,
    n_test: int = 24,
    seed: int = 0,
    system_prompt: str | None = REASONING_SYSTEM_PROMPT,
    difficulty: int = 1,
) -> Splits:
    """Seeded multi-step arithmetic word problems (shopping, sharing, ages, distances, ...).

    ``difficulty`` 1: one or two operations, every number below 100 (a 135M model solves
    some); 2: two or three operations, numbers below 1000; 3: three operations, below 10000.
    Divisions are always exact and no number is negative.

    Same arguments give the same rows in any process. The test set depends only on
    ``seed``, ``n_test`` and ``difficulty``; the training set never repeats a test question.

    Rows: ``prompt`` (system prompt, then the question), ``question``, ``answer`` (the final
    number as a string, ``"42"``), ``solution`` (a GSM8K-style worked solution ending
    ``#### 42``) and ``template`` (the kind of story: ``"shopping"``, ``"ages"``, ...).

    >>> train, test = load_arithmetic(n_train=4, n_test=2, seed=1)
    >>> train[0]["solution"].endswith("#### " + train[0]["answer"])
    True
    """
    check_sizes("arithmetic", n_train=n_train, n_test=n_test)
    if n_train is None or n_test is None:
        raise Refusal("arithmetic: n_train and n_test must be integers (the generator has no 'all').")
    if difficulty not in _TIERS:
        raise Refusal(f"arithmetic: difficulty={difficulty!r}; choose one of {sorted(_TIERS)}.")
    tier = _TIERS[difficulty]
    test = _problems(seed, "test", tier, n_test, exclude=set())
    train = _problems(seed, "train", tier, n_train, exclude={p.question for p in test})
    return Splits(_to_dataset(train, system_prompt), _to_dataset(test, system_prompt))


def _to_dataset(problems: list[_Problem], system_prompt: str | None) -> datasets.Dataset:
    features = datasets.Features(
        {
            "prompt": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
            "question": datasets.Value("string"),
            "answer": datasets.Value("string"),
            "solution": datasets.Value("string"),
            "template": datasets.Value("string"),
        }
    )
    rows = [
        {
            "prompt": conversation(system_prompt, p.question),
            "question": p.question,
            "answer": str(p.answer),
            "solution": "\n".join(p.steps) + f"\n#### {p.answer}",
            "template": p.template,
        }
        for p in problems
    ]
    # Explicit features so that an empty split still has every column.
    return datasets.Dataset.from_list(rows, features=features)
