"""The `functions` task set: plain-English function-writing problems ("Write a Python function `add_five(n)`
that returns n plus 5."), each with hidden tests generated from a reference implementation.

A kind is a family of problems (adding a number, counting a letter, the largest of a list, ...); its variants
differ in their constants and names, so a kind yields up to a few dozen distinct tasks and the set several
hundred. Splits (the Task API's, served by env.py):
  train  the variants of the training kinds, less every fifth one
  eval   every fifth variant of the training kinds, and every variant of HELD_OUT kinds, whose problems are
         never seen in training: the evaluation measures skill, not memory of the training problems
The hidden tests are CASES calls of the function on inputs drawn from the task's own seed, compared with
what the reference returns; they never leave the server.
"""

from __future__ import annotations

import math
import random
import string
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

CASES = 10
WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()
EVAL_EVERY = 5  # every fifth variant of a training kind is held out for evaluation


@dataclass(frozen=True)
class Problem:
    name: str  # the function's name, the entry point
    params: str  # "n" or "a, b": the signature's parameters
    statement: str  # what it must return, after "that"
    reference: Callable
    inputs: Callable[[random.Random], tuple]  # one call's arguments


def _ints(lo=-50, hi=50):
    return lambda rng: (rng.randint(lo, hi),)


def _pair(lo=-50, hi=50):
    return lambda rng: (rng.randint(lo, hi), rng.randint(lo, hi))


def _word(rng, alphabet=string.ascii_lowercase, lo=0, hi=9):
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _text(rng):
    return (_word(rng, "abcdeio ", 0, 12),)


def _list(lo=-20, hi=20, min_len=0):
    return lambda rng: ([rng.randint(lo, hi) for _ in range(rng.randint(min_len, 8))],)


def _number_kind(verb: str, phrase: str, op: Callable):
    return lambda: [Problem(f"{verb}_{WORDS[k]}", "n", f"returns n {phrase} {k}", lambda n, k=k: op(n, k), _ints())
                    for k in range(2, 13)]


def _divisible():
    return [Problem(f"divisible_by_{WORDS[k]}", "n", f"returns True if n is divisible by {k}, and False otherwise",
                    lambda n, k=k: n % k == 0, _ints(-100, 100)) for k in range(2, 13)]  # fmt: skip


def _remainder():
    return [Problem(f"remainder_{WORDS[k]}", "n", f"returns the remainder of n divided by {k}",
                    lambda n, k=k: n % k, _ints(0, 100)) for k in range(2, 13)]  # fmt: skip


def _count_letter():
    return [Problem(f"count_{c}", "s", f"returns how many times the letter '{c}' appears in the string s",
                    lambda s, c=c: s.count(c), lambda rng, c=c: (_word(rng, f"{c}{c}bcdex", 0, 10),))
            for c in "aeiostrn"]  # fmt: skip


def _starts_with():
    return [Problem(f"starts_with_{c}", "s", f"returns True if the string s starts with the letter '{c}', and False otherwise",
                    lambda s, c=c: s.startswith(c), lambda rng, c=c: (_word(rng, f"{c}{c}xyz", 0, 6),))
            for c in "abcmpst"]  # fmt: skip


def _greet():
    return [Problem(f"say_{g.lower()}", "name", f'returns "{g}, " followed by name and "!" (for "Ann": "{g}, Ann!")',
                    lambda name, g=g: f"{g}, {name}!", lambda rng: (_word(rng, string.ascii_letters, 1, 8),))
            for g in ("Hello", "Hi", "Welcome", "Goodbye", "Thanks")]  # fmt: skip


def _repeat():
    return [Problem(f"repeat_{WORDS[k]}", "s", f"returns the string s repeated {k} times",
                    lambda s, k=k: s * k, lambda rng: (_word(rng, "abc", 0, 4),)) for k in range(2, 8)]  # fmt: skip


def _add_to_all():
    return [Problem(f"add_{WORDS[k]}_to_all", "xs", f"returns a new list with {k} added to every number of the list xs",
                    lambda xs, k=k: [x + k for x in xs], _list()) for k in range(1, 11)]  # fmt: skip


def _count_greater():
    return [Problem(f"count_above_{WORDS[k]}", "xs", f"returns how many numbers of the list xs are greater than {k}",
                    lambda xs, k=k: sum(x > k for x in xs), _list(-5, 15)) for k in range(0, 11)]  # fmt: skip


def _at_least():
    return [Problem(f"at_least_{WORDS[k]}", "n", f"returns True if n is at least {k}, and False otherwise",
                    lambda n, k=k: n >= k, _ints(-20, 30)) for k in range(0, 13)]  # fmt: skip


def _strings_of(c):
    return lambda rng: (_word(rng, f"{c}{c}xyz", 0, 6),)


def _ends_with():
    return [Problem(f"ends_with_{c}", "s", f"returns True if the string s ends with the letter '{c}', and False otherwise",
                    lambda s, c=c: s.endswith(c), _strings_of(c)) for c in "adehknrsy"]  # fmt: skip


def _contains():
    return [Problem(f"has_{c}", "s", f"returns True if the letter '{c}' appears in the string s, and False otherwise",
                    lambda s, c=c: c in s, _strings_of(c)) for c in "bfgjlquvwz"]  # fmt: skip


def _first_k():
    return [Problem(f"first_{WORDS[k]}", "s", f"returns the first {k} characters of the string s (all of s if it is shorter)",
                    lambda s, k=k: s[:k], lambda rng: (_word(rng, lo=0, hi=9),)) for k in range(1, 8)]  # fmt: skip


def _longer_than():
    return [Problem(f"longer_than_{WORDS[k]}", "s", f"returns True if the string s has more than {k} characters, and False otherwise",
                    lambda s, k=k: len(s) > k, lambda rng: (_word(rng, lo=0, hi=12),)) for k in range(1, 11)]  # fmt: skip


def _times_all():
    return [Problem(f"multiply_all_by_{WORDS[k]}", "xs", f"returns a new list with every number of the list xs multiplied by {k}",
                    lambda xs, k=k: [x * k for x in xs], _list()) for k in range(2, 11)]  # fmt: skip


def _count_of():
    return [Problem(f"count_{WORDS[k]}s", "xs", f"returns how many times the number {k} appears in the list xs",
                    lambda xs, k=k: xs.count(k), _list(k - 2, k + 2)) for k in range(0, 11)]  # fmt: skip


def _power_of():
    return [Problem(f"to_the_{WORDS[k]}", "n", f"returns n raised to the power {k}",
                    lambda n, k=k: n**k, _ints(-9, 9)) for k in range(2, 7)]  # fmt: skip


def _at_most_list():
    return [Problem(f"keep_below_{WORDS[k]}", "xs", f"returns a list of the numbers of the list xs that are less than {k}, in their order",
                    lambda xs, k=k: [x for x in xs if x < k], _list(-5, 15)) for k in range(0, 11)]  # fmt: skip


def _bigger_of():
    return [Problem(f"no_less_than_{WORDS[k]}", "n", f"returns n if n is greater than {k}, and {k} otherwise",
                    lambda n, k=k: max(n, k), _ints(-20, 20)) for k in range(0, 11)]  # fmt: skip


def _one(name, params, statement, reference, inputs):
    return lambda: [Problem(name, params, statement, reference, inputs)]


def _fizzbuzz(n):
    return "FizzBuzz" if n % 15 == 0 else "Fizz" if n % 3 == 0 else "Buzz" if n % 5 == 0 else str(n)


def _is_prime(n):
    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))


KINDS: dict[str, Callable[[], list[Problem]]] = {
    # arithmetic
    "add": _number_kind("add", "plus", lambda n, k: n + k),
    "subtract": _number_kind("subtract", "minus", lambda n, k: n - k),
    "times": _number_kind("times", "multiplied by", lambda n, k: n * k),
    "remainder": _remainder,
    "power_of": _power_of,
    "bigger_of": _bigger_of,
    "square": _one("square", "n", "returns n squared", lambda n: n * n, _ints()),
    "average": _one("average", "a, b", "returns the average of the numbers a and b", lambda a, b: (a + b) / 2, _pair()),
    "difference": _one("difference", "a, b", "returns the absolute difference between a and b", lambda a, b: abs(a - b), _pair()),
    "last_digit": _one("last_digit", "n", "returns the last digit of the non-negative integer n", lambda n: n % 10, _ints(0, 9999)),
    # conditionals
    "divisible": _divisible,
    "at_least": _at_least,
    "is_even": _one("is_even", "n", "returns True if n is even, and False otherwise", lambda n: n % 2 == 0, _ints()),
    "is_odd": _one("is_odd", "n", "returns True if n is odd, and False otherwise", lambda n: n % 2 == 1, _ints()),
    "larger": _one("larger", "a, b", "returns the larger of the two numbers a and b", max, _pair()),
    "smallest_of_three": _one("smallest_of_three", "a, b, c", "returns the smallest of the three numbers a, b and c",
                              min, lambda rng: tuple(rng.randint(-50, 50) for _ in range(3))),
    "sign": _one("sign", "n", "returns 1 if n is positive, -1 if n is negative, and 0 if n is zero",
                 lambda n: (n > 0) - (n < 0), _ints(-5, 5)),
    "clamp": _one("clamp", "n, low, high", "returns n limited to the range from low to high (low if n is below it, high if above)",
                  lambda n, lo, hi: max(lo, min(n, hi)), lambda rng: (rng.randint(-30, 30), rng.randint(-10, 0), rng.randint(1, 10))),
    # strings
    "count_letter": _count_letter,
    "starts_with": _starts_with,
    "greet": _greet,
    "repeat": _repeat,
    "ends_with": _ends_with,
    "contains": _contains,
    "first_k": _first_k,
    "longer_than": _longer_than,
    "reverse": _one("reverse", "s", "returns the string s reversed", lambda s: s[::-1], lambda rng: (_word(rng),)),
    "shout": _one("shout", "s", "returns the string s in upper case", str.upper, lambda rng: (_word(rng),)),
    "first_letter": _one("first_letter", "s", "returns the first character of the non-empty string s",
                         lambda s: s[0], lambda rng: (_word(rng, lo=1),)),
    "is_palindrome": _one("is_palindrome", "s", "returns True if the string s reads the same backwards, and False otherwise",
                          lambda s: s == s[::-1], lambda rng: (rng.choice([_word(rng, "ab", 0, 5), (w := _word(rng, "abc", 1, 3)) + w[::-1]]),)),
    "count_vowels": _one("count_vowels", "s", "returns how many vowels (a, e, i, o, u) the lower-case string s contains",
                         lambda s: sum(c in "aeiou" for c in s), lambda rng: (_word(rng),)),
    "count_words": _one("count_words", "s", "returns how many words, separated by spaces, the string s contains",
                        lambda s: len(s.split()), _text),
    "remove_spaces": _one("remove_spaces", "s", "returns the string s with every space removed",
                          lambda s: s.replace(" ", ""), _text),
    # lists
    "add_to_all": _add_to_all,
    "count_above": _count_greater,
    "multiply_all": _times_all,
    "count_of": _count_of,
    "keep_below": _at_most_list,
    "total": _one("total", "xs", "returns the sum of the numbers in the list xs", sum, _list()),
    "largest": _one("largest", "xs", "returns the largest number in the non-empty list xs", max, _list(min_len=1)),
    "count_even": _one("count_even", "xs", "returns how many even numbers the list xs contains",
                       lambda xs: sum(x % 2 == 0 for x in xs), _list()),
    "positives": _one("positives", "xs", "returns a list of the positive numbers of the list xs, in their order",
                      lambda xs: [x for x in xs if x > 0], _list()),
    "product": _one("product", "xs", "returns the product of the numbers in the list xs (1 for an empty list)",
                    math.prod, _list(-5, 5)),
    "last_item": _one("last_item", "xs", "returns the last element of the non-empty list xs", lambda xs: xs[-1], _list(min_len=1)),
    # loops and small algorithms
    "sum_to": _one("sum_to", "n", "returns the sum of the integers from 1 to n", lambda n: n * (n + 1) // 2, _ints(0, 100)),
    "factorial": _one("factorial", "n", "returns the factorial of the non-negative integer n", math.factorial, _ints(0, 12)),
    "digit_sum": _one("digit_sum", "n", "returns the sum of the digits of the non-negative integer n",
                      lambda n: sum(map(int, str(n))), _ints(0, 99999)),
    "is_prime": _one("is_prime", "n", "returns True if n is a prime number, and False otherwise", _is_prime, _ints(-5, 100)),
    "gcd": _one("gcd", "a, b", "returns the greatest common divisor of the positive integers a and b", math.gcd, _pair(1, 100)),
    "fizzbuzz": _one("fizzbuzz", "n", 'returns "Fizz" if n is divisible by 3, "Buzz" if by 5, "FizzBuzz" if by both, else n as a string',
                     _fizzbuzz, _ints(1, 100)),
    "power": _one("power", "base, exponent", "returns base raised to the non-negative integer exponent",
                  lambda b, e: b**e, lambda rng: (rng.randint(-9, 9), rng.randint(0, 6))),
}
# Kinds whose every problem is evaluation-only, one or more of each group above.
HELD_OUT = ("subtract", "clamp", "ends_with", "count_vowels", "remove_spaces", "product", "keep_below", "digit_sum", "gcd")
HELD_OUT_VARIANTS = 4  # a held-out kind's first few variants: the eval split stays spread over kinds


@dataclass(frozen=True)
class FunctionTask:
    task_id: str  # "functions/<kind>/<name>"
    kind: str
    entry_point: str
    signature: str  # "def add_five(n):"
    statement: str  # the whole problem in English, naming the function
    tests: tuple[str, ...]  # "assert add_five(3) == 8": hidden, never leaves the server


def _task(kind: str, problem: Problem) -> FunctionTask:
    rng = random.Random(f"functions:{kind}:{problem.name}")
    calls: dict[str, object] = {}
    for _ in range(CASES * 20):  # distinct calls; kinds with few possible inputs get fewer
        args = problem.inputs(rng)
        calls.setdefault(", ".join(map(repr, args)), problem.reference(*args))
        if len(calls) == CASES:
            break
    return FunctionTask(
        task_id=f"functions/{kind}/{problem.name}",
        kind=kind,
        entry_point=problem.name,
        signature=f"def {problem.name}({problem.params}):",
        statement=f"Write a Python function `{problem.name}({problem.params})` that {problem.statement}.",
        tests=tuple(f"assert {problem.name}({call}) == {value!r}" for call, value in calls.items()),
    )


@lru_cache(maxsize=1)
def splits() -> dict[str, tuple[FunctionTask, ...]]:
    """{"train": ..., "eval": ...}: fixed, the same on every server (a task's index is its place here)."""
    out: dict[str, list[FunctionTask]] = {"train": [], "eval": []}
    for kind, make in KINDS.items():
        for i, problem in enumerate(make()):
            if kind in HELD_OUT and i >= HELD_OUT_VARIANTS:
                continue
            held = kind in HELD_OUT or i % EVAL_EVERY == EVAL_EVERY - 1
            out["eval" if held else "train"].append(_task(kind, problem))
    # Shuffled once, with a fixed seed: an evaluation of the first n tasks of a split is spread over its kinds.
    return {name: tuple(random.Random(f"functions:{name}").sample(tasks, len(tasks))) for name, tasks in out.items()}
