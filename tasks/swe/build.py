"""Writes the SWE suite (tasks.jsonl, repos/, checks/, solutions/) from the definitions below.

Each task is a small Python repository with a bug: a module, visible tests the agent may run (tests/), hidden tests
kept outside the workspace (checks/<name>/test_hidden.py), and a reference solution (solutions/<name>/, files that
replace the repo's). Run `python tasks/swe/build.py && uv run ruff format tasks/swe` after editing a definition; the files are
committed.
"""

import json
import shutil
from pathlib import Path
from textwrap import dedent

HERE = Path(__file__).resolve().parent

TASKS = {
    "fizzbuzz": dict(
        prompt="fizzbuzz(n) in fizzbuzz.py returns the wrong word for multiples of 15. Fix it.",
        buggy="""
        def fizzbuzz(n):
            if n % 3 == 0:
                return "Fizz"
            if n % 5 == 0:
                return "Buzz"
            if n % 15 == 0:
                return "FizzBuzz"
            return str(n)
        """,
        fixed="""
        def fizzbuzz(n):
            if n % 15 == 0:
                return "FizzBuzz"
            if n % 3 == 0:
                return "Fizz"
            if n % 5 == 0:
                return "Buzz"
            return str(n)
        """,
        visible=["self.assertEqual(m.fizzbuzz(3), 'Fizz')", "self.assertEqual(m.fizzbuzz(15), 'FizzBuzz')"],
        hidden=[
            "self.assertEqual(m.fizzbuzz(1), '1')",
            "self.assertEqual(m.fizzbuzz(10), 'Buzz')",
            "self.assertEqual(m.fizzbuzz(30), 'FizzBuzz')",
            "self.assertEqual(m.fizzbuzz(45), 'FizzBuzz')",
        ],
    ),
    "slugify": dict(
        prompt="slugify(text) in slugify.py must lower-case and join words with single dashes. Fix it.",
        buggy="""
        def slugify(text):
            return "-".join(text.split(" "))
        """,
        fixed="""
        import re


        def slugify(text):
            return "-".join(re.findall(r"[a-z0-9]+", text.lower()))
        """,
        visible=["self.assertEqual(m.slugify('Hello World'), 'hello-world')"],
        hidden=[
            "self.assertEqual(m.slugify('a b'), 'a-b')",
            "self.assertEqual(m.slugify('A  B'), 'a-b')",
            "self.assertEqual(m.slugify('Rust, Go!'), 'rust-go')",
        ],
    ),
    "roman": dict(
        prompt="to_roman(n) in roman.py gets 4, 9, 40, 90, 400 and 900 wrong. Fix it.",
        buggy="""
        VALUES = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I")]


        def to_roman(n):
            out = ""
            for value, sym in VALUES:
                while n >= value:
                    out += sym
                    n -= value
            return out
        """,
        fixed="""
        VALUES = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"), (40, "XL"),
                  (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]


        def to_roman(n):
            out = ""
            for value, sym in VALUES:
                while n >= value:
                    out += sym
                    n -= value
            return out
        """,
        visible=["self.assertEqual(m.to_roman(4), 'IV')"],
        hidden=[
            "self.assertEqual(m.to_roman(3), 'III')",
            "self.assertEqual(m.to_roman(1994), 'MCMXCIV')",
            "self.assertEqual(m.to_roman(2024), 'MMXXIV')",
            "self.assertEqual(m.to_roman(49), 'XLIX')",
        ],
    ),
    "stack": dict(
        prompt="Stack.pop in stack.py must raise IndexError on an empty stack, and Stack.peek must return the top "
        "without removing it. Fix it.",
        buggy="""
        class Stack:
            def __init__(self):
                self.items = []

            def push(self, x):
                self.items.append(x)

            def pop(self):
                if not self.items:
                    return None
                return self.items.pop()

            def peek(self):
                return self.items.pop()
        """,
        fixed="""
        class Stack:
            def __init__(self):
                self.items = []

            def push(self, x):
                self.items.append(x)

            def pop(self):
                if not self.items:
                    raise IndexError("pop from an empty stack")
                return self.items.pop()

            def peek(self):
                if not self.items:
                    raise IndexError("peek at an empty stack")
                return self.items[-1]
        """,
        visible=["s = m.Stack(); s.push(1); self.assertEqual(s.pop(), 1)"],
        hidden=[
            "s = m.Stack()\n        with self.assertRaises(IndexError):\n            s.pop()",
            "s = m.Stack(); s.push(1); s.push(2); self.assertEqual(s.peek(), 2); self.assertEqual(s.pop(), 2)",
            "s = m.Stack(); s.push(5); self.assertEqual(s.pop(), 5)",
        ],
    ),
    "wordcount": dict(
        prompt="count_words(text) in wordcount.py must count words case-insensitively, ignoring punctuation. Fix it.",
        buggy="""
        def count_words(text):
            counts = {}
            for word in text.split(" "):
                counts[word] = counts.get(word, 0) + 1
            return counts
        """,
        fixed="""
        import re


        def count_words(text):
            counts = {}
            for word in re.findall(r"[a-z']+", text.lower()):
                counts[word] = counts.get(word, 0) + 1
            return counts
        """,
        visible=["self.assertEqual(m.count_words('a b a'), {'a': 2, 'b': 1})"],
        hidden=[
            "self.assertEqual(m.count_words('x'), {'x': 1})",
            "self.assertEqual(m.count_words('The the THE'), {'the': 3})",
            "self.assertEqual(m.count_words('go, go!\\nstop.'), {'go': 2, 'stop': 1})",
        ],
    ),
    "transpose": dict(
        prompt="transpose(rows) in transpose.py fails for non-square matrices. Fix it.",
        buggy="""
        def transpose(rows):
            n = len(rows)
            return [[rows[j][i] for j in range(n)] for i in range(n)]
        """,
        fixed="""
        def transpose(rows):
            if not rows:
                return []
            return [[row[i] for row in rows] for i in range(len(rows[0]))]
        """,
        visible=["self.assertEqual(m.transpose([[1, 2], [3, 4]]), [[1, 3], [2, 4]])"],
        hidden=[
            "self.assertEqual(m.transpose([[1, 2, 3]]), [[1], [2], [3]])",
            "self.assertEqual(m.transpose([[1], [2]]), [[1, 2]])",
            "self.assertEqual(m.transpose([[5]]), [[5]])",
        ],
    ),
    "leapyear": dict(
        prompt="is_leap(year) in leapyear.py is wrong for century years. Fix it (Gregorian rules).",
        buggy="""
        def is_leap(year):
            return year % 4 == 0
        """,
        fixed="""
        def is_leap(year):
            return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
        """,
        visible=["self.assertTrue(m.is_leap(2024))"],
        hidden=[
            "self.assertFalse(m.is_leap(1900))",
            "self.assertTrue(m.is_leap(2000))",
            "self.assertFalse(m.is_leap(2023))",
            "self.assertFalse(m.is_leap(2100))",
        ],
    ),
    "bsearch": dict(
        prompt="search(items, x) in bsearch.py (binary search in a sorted list, -1 when absent) misses the last "
        "element. Fix it.",
        buggy="""
        def search(items, x):
            lo, hi = 0, len(items) - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if items[mid] == x:
                    return mid
                if items[mid] < x:
                    lo = mid + 1
                else:
                    hi = mid - 1
            return -1
        """,
        fixed="""
        def search(items, x):
            lo, hi = 0, len(items) - 1
            while lo <= hi:
                mid = (lo + hi) // 2
                if items[mid] == x:
                    return mid
                if items[mid] < x:
                    lo = mid + 1
                else:
                    hi = mid - 1
            return -1
        """,
        visible=["self.assertEqual(m.search([1, 3, 5, 7], 3), 1)"],
        hidden=[
            "self.assertEqual(m.search([1, 3, 5, 7], 7), 3)",
            "self.assertEqual(m.search([2], 2), 0)",
            "self.assertEqual(m.search([1, 3, 5], 4), -1)",
            "self.assertEqual(m.search([1, 2, 3, 4, 5], 1), 0)",
        ],
    ),
    "csvline": dict(
        prompt="split_csv(line) in csvline.py must keep commas inside double quotes and drop the quotes. Fix it.",
        buggy="""
        def split_csv(line):
            return line.split(",")
        """,
        fixed="""
        def split_csv(line):
            fields, cur, quoted = [], "", False
            for ch in line:
                if ch == '"':
                    quoted = not quoted
                elif ch == "," and not quoted:
                    fields.append(cur)
                    cur = ""
                else:
                    cur += ch
            fields.append(cur)
            return fields
        """,
        visible=["self.assertEqual(m.split_csv('a,\"b,c\"'), ['a', 'b,c'])"],
        hidden=[
            "self.assertEqual(m.split_csv('a,b'), ['a', 'b'])",
            "self.assertEqual(m.split_csv('\"x,y\",z'), ['x,y', 'z'])",
            "self.assertEqual(m.split_csv('1,,2'), ['1', '', '2'])",
        ],
    ),
    "celsius": dict(
        prompt="c_to_f and f_to_c in celsius.py convert temperatures with the wrong formula. Fix them.",
        buggy="""
        def c_to_f(c):
            return c * 5 / 9 + 32


        def f_to_c(f):
            return (f - 32) * 9 / 5
        """,
        fixed="""
        def c_to_f(c):
            return c * 9 / 5 + 32


        def f_to_c(f):
            return (f - 32) * 5 / 9
        """,
        visible=["self.assertAlmostEqual(m.c_to_f(100), 212)"],
        hidden=[
            "self.assertAlmostEqual(m.c_to_f(0), 32)",
            "self.assertAlmostEqual(m.f_to_c(212), 100)",
            "self.assertAlmostEqual(m.f_to_c(32), 0)",
            "self.assertAlmostEqual(m.c_to_f(-40), -40)",
        ],
    ),
    "median": dict(
        prompt="median(values) in median.py is wrong for lists of even length and must not reorder its input. "
        "Fix it.",
        buggy="""
        def median(values):
            values.sort()
            return values[len(values) // 2]
        """,
        fixed="""
        def median(values):
            s = sorted(values)
            n = len(s)
            return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
        """,
        visible=["self.assertEqual(m.median([1, 2, 3, 4]), 2.5)"],
        hidden=[
            "self.assertEqual(m.median([3, 1, 2]), 2)",
            "self.assertEqual(m.median([4, 1]), 2.5)",
            "v = [3, 1, 2]; m.median(v); self.assertEqual(v, [3, 1, 2])",
        ],
    ),
}


def _tests(name: str, bodies: list[str]) -> str:
    lines = [
        "import unittest",
        "",
        f"import {name} as m",
        "",
        "",
        f"class Test{name.title()}(unittest.TestCase):",
    ]
    for i, body in enumerate(bodies):
        lines += [f"    def test_{i}(self):", *(f"        {stmt}" for stmt in body.split("; ")), ""]
    return "\n".join(lines).rstrip() + "\n"


def build() -> None:
    for sub in ("repos", "solutions"):
        shutil.rmtree(HERE / sub, ignore_errors=True)
    for name in TASKS:
        shutil.rmtree(HERE / "checks" / name, ignore_errors=True)  # checks/check.py is the checker itself
    rows = []
    for name, t in TASKS.items():
        repo = HERE / "repos" / name
        (repo / "tests").mkdir(parents=True)
        (repo / f"{name}.py").write_text(dedent(t["buggy"]).lstrip())
        visible = _tests(name, t["visible"])
        (repo / "tests" / f"test_{name}.py").write_text(visible)
        (repo / "tests" / "__init__.py").write_text("")
        check = HERE / "checks" / name
        (check / "protected" / "tests").mkdir(parents=True)
        (check / "protected" / "tests" / f"test_{name}.py").write_text(
            visible
        )  # what the agent must not edit
        (check / "test_hidden.py").write_text(_tests(name, t["visible"] + t["hidden"]))
        sol = HERE / "solutions" / name
        sol.mkdir(parents=True)
        (sol / f"{name}.py").write_text(dedent(t["fixed"]).lstrip())
        rows.append({
            "query_id": f"swe-{name}",
            "prompt": t["prompt"] + " Run the tests with: python3 -m unittest discover -s tests -t .",
            "workspace": {"dir": f"repos/{name}"},
            "scoring": {"kind": "exec", "command": ["/usr/bin/python3", "-I", "{files}/../check.py", "{files}"],
                        "files": f"checks/{name}", "score_from": "score_file", "timeout_s": 120},
            "harness_timeout_s": 900,
            "overall_budget_s": 1800,
            "metadata": {"suite": "swe", "hidden_tests": len(t["visible"]) + len(t["hidden"])},
        })  # fmt: skip
    (HERE / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    build()
