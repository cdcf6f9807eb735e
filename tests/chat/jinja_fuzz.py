#!/usr/bin/env python3
"""Random templates of filters, tests, operators and str methods over typed values, rendered by
Python's jinja2 in transformers' environment (render_references.environment()). Prints one JSON
line per case: {"template": ..., "text": ...} or {"template": ..., "error": ...}.
ChatTemplates.GeneratedCasesRenderAsJinja2 runs it and holds loom's engine to every line: the same
text, or an error where jinja2 raised one.

  tests/chat/jinja_fuzz.py SEED COUNT

Where loom means to differ, the reference is bent to say so: an integer past 64 bits is an error
(loom refuses it where Python has big integers). The generator writes no printf-style `%` on strings (not supported), and
no negative number to a fractional power (complex in Python, refused by
loom), and what jinja2 returns as an iterator (map, select, unique, reverse, items, range) is passed through
`list` before it is printed, as templates do (jinja2 prints an iterator's address).
"""
import functools
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import render_references  # noqa: E402
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402


def within_64_bits(value):
    if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
        raise OverflowError("integer overflow (past 64 bits, where loom stops)")
    return value


class Int64Environment(ImmutableSandboxedEnvironment):
    """transformers' environment where an integer that leaves 64 bits is an error, as in loom."""
    intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])
    intercepted_unops = frozenset(["-"])

    def call_binop(self, context, operator, left, right):
        return within_64_bits(super().call_binop(context, operator, left, right))

    def call_unop(self, context, operator, arg):
        return within_64_bits(super().call_unop(context, operator, arg))


def environment():
    env = render_references.environment(Int64Environment)
    for name in ("int", "sum", "abs", "round"):
        env.filters[name] = checked(env.filters[name])
    return env


def checked(f):
    @functools.wraps(f)  # keeps jinja2's pass_environment marks
    def within(*args, **kwargs):
        return within_64_bits(f(*args, **kwargs))
    return within

STRINGS = ["", "a", "B", "Hello World", "  padded  ", "héllo", "straße", "ǅemal", "they're", "a-b c(d [e", "x\ny\r\nz\n", "A1b2", "0x1A",
           "1_000", "-12", "3.5e2", " 42 ", "ΑΣ", "tab\there", "<b>&\"'", "日本語", "ÉCOLE", "mIxEd CaSe", "a,b,,c", "1.5", "nan", "inf",
           "___", "ab ab ab", "\u2028sep\u00a0x", "ǈ", "ﬁne"]
INTS = [0, 1, -1, 2, 3, -3, 7, -7, 10, 25, 100, 255, 1000, -1024, 123456789]
FLOATS = [0.0, 0.5, 1.5, 2.5, -2.5, 0.125, 2.675, 1e10, 1e-5, 3.14159, 1e16, -0.0, 123.456, 2.0, -7.25, 1e300, -1e300]


def lit(value):
    """A value as a Jinja literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, float) and value != value:
        return '("nan"|float)'
    if isinstance(value, (int, float)):
        text = repr(value)
        return f"({text})" if text.startswith("-") else text
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(lit(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{lit(k)}: {lit(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


class Generator:
    def __init__(self, seed):
        self.r = random.Random(seed)

    def pick(self, items):
        return self.r.choice(items)

    def s(self, depth):
        """An expression of type str."""
        r = self.r
        if depth <= 0 or r.random() < 0.3:
            return lit(self.pick(STRINGS))
        x = self.s(depth - 1)
        choice = r.randrange(24)
        if choice == 0: return f"{x}|upper"
        if choice == 1: return f"{x}|lower"
        if choice == 2: return f"{x}|title"
        if choice == 3: return f"{x}|capitalize"
        if choice == 4: return f"{x}|trim" if r.random() < 0.5 else f"{x}|trim({lit(self.pick(['a', ' x', '-_', 'é']))})"
        if choice == 5: return f"{x}|replace({lit(self.pick(['a', 'b', '', ' ', 'ab']))}, {lit(self.pick(['', 'X', '--', 'é']))}" + (f", {r.randrange(4)})" if r.random() < 0.4 else ")")
        if choice == 6: return f"{x}|indent({self.pick(['0', '2', '4', repr('> ')])}, {self.pick(['true', 'false'])}, {self.pick(['true', 'false'])})"
        if choice == 7: return f"{x}|reverse"
        if choice == 8: return f"{x}|escape"
        if choice == 9: return f"({x} ~ {self.any(depth - 1)})"
        if choice == 10: return f"({x} + {self.s(depth - 1)})" if r.random() < 0.6 else self.pick([f"({x}|escape + {self.s(depth - 1)})", f"({self.s(depth - 1)} + {x}|safe)", f"{x}|e|e", f"({x}|escape).upper()"])
        if choice == 11: return f"({x} * {r.randrange(4)})"
        if choice == 12: return f"({x}).{self.pick(['upper', 'lower', 'title', 'capitalize', 'strip', 'lstrip', 'rstrip'])}()"
        if choice == 13: return f"({x}).replace({lit(self.pick(['a', 'l', '', 'é']))}, {lit(self.pick(['', '_']))})"
        if choice == 14: return f"({x})[{self.slice()}]"
        if choice == 15: return f"{self.sl(depth - 1)}|join({lit(self.pick(['', ', ', '-']))})"
        if choice == 16: return f"{x}|string"
        if choice == 17: return f"{self.any(depth - 1)}|tojson" + self.pick(["", "(indent=2)", "(sort_keys=true)", "(true)", "(indent='\\t')"])
        if choice == 18: return f"{self.any(depth - 1)}|string"
        if choice == 19: return f"{lit(self.pick([', ', '', '/']))}.join({self.sl(depth - 1)})"
        if choice == 20: return f"{x}|default({lit('d')})"
        if choice == 21: return f"({x} if {self.b(depth - 1)} else {self.s(depth - 1)})"
        if choice == 22: return f"{self.any(depth - 1)}|string|upper"
        return f"({self.sl(depth - 1)} + ['z'])|{self.pick(['first', 'last'])}"

    def slice(self):
        r = self.r
        parts = [self.pick(["", "0", "1", "-1", "2", "-3", "10"]) for _ in range(2)]
        if r.random() < 0.4:
            return f"{parts[0]}:{parts[1]}:{self.pick(['1', '2', '-1', '-2', '3'])}"
        if r.random() < 0.3:
            return self.pick(["0", "1", "-1", "-2"])
        return f"{parts[0]}:{parts[1]}"

    def n(self, depth):
        """An expression of type int or float."""
        r = self.r
        if depth <= 0 or r.random() < 0.3:
            return lit(self.pick(INTS if r.random() < 0.6 else FLOATS))
        x = self.n(depth - 1)
        choice = r.randrange(16)
        if choice == 0: return f"({x} {self.pick(['+', '-', '*'])} {self.n(depth - 1)})"
        if choice == 1: return f"({x} {self.pick(['/', '//', '%'])} {self.n(depth - 1)})"
        if choice == 2:  # a negative base to a fractional power is complex in Python: loom refuses it
            base = self.pick([2, 3, -2, 0.5, 10])
            return f"({lit(base)} ** {self.pick(['0', '1', '2', '3', '-1'] + (['0.5'] if base > 0 else []))})"
        if choice == 3: return f"{x}|abs"
        if choice == 4: return f"{x}|round" + self.pick(["", "(1)", "(2)", "(-1)", "(1, 'floor')", "(1, 'ceil')", "(0, 'ceil')"])
        if choice == 5: return f"{x}|int"
        if choice == 6: return f"{x}|float"
        if choice == 7: return f"{self.s(depth - 1)}|int" + self.pick(["", "(7)", "(0, 16)", "(base=2)", "(0, 0)"])
        if choice == 8: return f"{self.s(depth - 1)}|float" + self.pick(["", "(1.5)"])
        if choice == 9: return f"{self.s(depth - 1)}|length"
        if choice == 10: return f"{self.s(depth - 1)}|wordcount"
        if choice == 11: return f"{self.nl(depth - 1)}|sum"
        if choice == 12: return f"{self.nl(depth - 1)}|{self.pick(['min', 'max'])}"
        if choice == 13: return f"({self.s(depth - 1)}).{self.pick(['find', 'count'])}({lit(self.pick(['a', 'l', '', 'é']))})"
        if choice == 14: return f"{self.sl(depth - 1)}|length"
        return f"(-{x})"

    def b(self, depth):
        """An expression of type bool."""
        r = self.r
        x = self.any(depth - 1)
        choice = r.randrange(9)
        if choice == 0: return f"({x} is {self.pick(['defined', 'none', 'string', 'number', 'integer', 'float', 'sequence', 'mapping', 'iterable', 'boolean', 'escaped'])})"
        if choice == 1: return f"({self.n(depth - 1)} is {self.pick(['odd', 'even', 'divisibleby 3', 'divisibleby(2)', 'divisibleby 1.5'])})"
        if choice == 2: return f"({self.s(depth - 1)} is {self.pick(['lower', 'upper'])})"
        if choice == 3: return f"({x} {self.pick(['==', '!='])} {self.any(depth - 1)})"
        if choice == 4: return f"({self.n(depth - 1)} {self.pick(['<', '<=', '>', '>='])} {self.n(depth - 1)})"
        if choice == 5: return f"({self.s(depth - 1)} {self.pick(['<', '>'])} {self.s(depth - 1)})"
        if choice == 6: return f"({self.s(depth - 1)} in {self.s(depth - 1)})"
        if choice == 7: return f"({self.s(depth - 1)}).{self.pick(['isdigit', 'isspace', 'isalpha', 'isalnum', 'isupper', 'islower', 'startswith', 'endswith'])}(" + (lit(self.pick(['a', 'H', ''])) if r.random() < 0.3 else "") + ")"
        return f"(not {self.b(depth - 1)} {self.pick(['and', 'or'])} {self.b(depth - 1)})"

    def sl(self, depth):
        """An expression of type list of str."""
        r = self.r
        if depth <= 0 or r.random() < 0.3:
            return lit(r.sample(STRINGS, r.randrange(0, 5)))
        x = self.sl(depth - 1)
        choice = r.randrange(10)
        if choice == 0: return f"{x}|sort" + self.pick(["", "(true)", "(false, true)", "(reverse=true, case_sensitive=true)"])
        if choice == 1: return f"{x}|unique" + self.pick(["", "(true)"]) + "|list"
        if choice == 2: return f"{x}|map({lit(self.pick(['upper', 'lower', 'trim', 'title', 'capitalize', 'string']))})|list"
        if choice == 3: return f"{x}|reverse|list"
        if choice == 4: return f"({self.s(depth - 1)}).split(" + self.pick(["", "','", "' '", "None, 1", "'a', 1"]) + ")"
        if choice == 5: return f"({self.s(depth - 1)}).splitlines(" + self.pick(["", "true"]) + ")"
        if choice == 6: return f"{self.s(depth - 1)}|list"
        if choice == 7: return f"{x}|select({lit(self.pick(['lower', 'upper', 'string']))})|list" if r.random() < 0.5 else f"{x}|reject|list"
        if choice == 8: return f"({x} + {self.sl(depth - 1)})"
        return f"({x})[{self.slice()}]" if r.random() < 0.7 else f"{self.dl(depth - 1)}|map(attribute='name')|list"

    def nl(self, depth):
        """An expression of type list of numbers."""
        r = self.r
        if depth <= 0 or r.random() < 0.4:
            return lit([self.pick(INTS if r.random() < 0.7 else FLOATS) for _ in range(r.randrange(0, 5))])
        x = self.nl(depth - 1)
        choice = r.randrange(6)
        if choice == 0: return f"{x}|sort" + self.pick(["", "(true)"])
        if choice == 1: return f"{x}|unique|list"
        if choice == 2: return f"{x}|select({lit(self.pick(['odd', 'even']))})|list"
        if choice == 3: return f"range({self.pick(['0', '3', '-2, 5', '10, 0, -3', '1, 9, 2'])})|list"
        if choice == 4: return f"{x}|map('abs')|list"
        return f"{self.dl(depth - 1)}|map(attribute='n')|list"

    def dl(self, depth):
        """A list of dicts with name and n."""
        r = self.r
        items = [{"name": self.pick(STRINGS[:12]), "n": self.pick(INTS[:8])} for _ in range(r.randrange(0, 4))]
        x = lit(items)
        choice = r.randrange(5)
        if choice == 0: return f"{x}|sort(attribute={lit(self.pick(['name', 'n', 'n,name']))})"
        if choice == 1: return f"{x}|selectattr('n', {lit(self.pick(['odd', 'even']))})|list"
        if choice == 2: return f"{x}|rejectattr('name', 'lower')|list"
        if choice == 3: return f"{x}|unique(attribute='n')|list"
        return x

    def d(self, depth):
        """A dict expression."""
        r = self.r
        keys = r.sample(["a", "B", "c", "name", "é", "z"], r.randrange(0, 4))
        return lit({k: self.pick(INTS + STRINGS[:6]) for k in keys})

    def any(self, depth):
        choice = self.r.randrange(7)
        if choice == 0: return self.s(depth)
        if choice == 1: return self.n(depth)
        if choice == 2: return self.b(depth)
        if choice == 3: return self.sl(depth)
        if choice == 4: return self.nl(depth)
        if choice == 5: return self.d(depth)
        return self.pick([f"{self.d(depth)}|dictsort" + self.pick(["", "(true)", "(by='value')", "(reverse=true)"]), f"{self.d(depth)}|items|list",
                          f"{self.dl(depth)}", f"{self.d(depth)}.get({lit(self.pick(['a', 'q']))}, 0)", "none"])

    def statements(self, depth):
        """Blocks around expressions: loops and their loop variables, namespaces, macros, whitespace control."""
        r = self.r
        items = self.pick([self.sl(depth), self.nl(depth), self.d(depth)])
        choice = r.randrange(7)
        if choice == 0:
            return (f"{{% for x in {items} %}}{{{{ loop.index }}}}/{{{{ loop.revindex0 }}}}:{{{{ x }}}}{{% if loop.first %}}^{{% elif loop.last %}}$"
                    f"{{% endif %}}{{{{ loop.cycle('a', 'b') }}}}{{% else %}}none{{% endfor %}}")
        if choice == 1:
            return (f"{{% set ns = namespace(acc='', n=0) %}}{{% for x in {items} if x is not none %}}{{% set ns.acc = ns.acc ~ x|string|upper %}}"
                    f"{{% set ns.n = ns.n + 1 %}}{{% endfor %}}{{{{ ns.acc }}}}#{{{{ ns.n }}}}")
        if choice == 2:
            return f"{{% macro m(a, b='d') %}}[{{{{ a }}}}|{{{{ b }}}}]{{% endmacro %}}{{{{ m({self.any(depth)}) }}}}{{{{ m({self.s(depth)}, b={self.any(depth)}) }}}}"
        if choice == 3:
            ws = lambda: self.pick(["", "-", "+"])  # noqa: E731
            return (f"  {{%{ws()} if {self.b(depth)} {ws() if ws() != '+' else ''}%}}\n  yes {{{{ {self.s(depth)} }}}}\n  {{%{ws()} elif {self.b(depth)} %}}"
                    f"\n  maybe\n{{% else -%}}\n  no\n  {{%- endif %}}\n end")
        if choice == 4:
            return f"{{% if {self.b(depth)} %}}{{{{ {self.s(depth)}|no_such_filter }}}}{{% else %}}{{{{ {self.s(depth)} is no_such_test }}}}{{% endif %}}"
        if choice == 5:
            return f"{{% for a, b in {self.d(depth)}|dictsort %}}{{{{ a }}}}={{{{ b }}}}{{{{ ',' if not loop.last }}}}{{% endfor %}}"
        return f"{{% set t %}}{{{{ {self.any(depth)} }}}} {{{{ {self.any(depth)} }}}}{{% endset %}}{{{{ t|trim|length }}}}:{{{{ t }}}}"

    def template(self):
        depth = self.r.randrange(1, 4)
        if self.r.random() < 0.25:
            return self.statements(depth)
        parts = [f"{{{{ {self.any(depth)} }}}}" for _ in range(self.r.randrange(1, 3))]
        return "|".join(parts)


def main():
    seed, count = int(sys.argv[1]), int(sys.argv[2])
    env = environment()
    gen = Generator(seed)
    printed = 0
    while printed < count:
        source = gen.template()
        case = {"template": source}
        try:
            case["text"] = env.from_string(source).render()
        except NameError:
            # jinja2 folds constant expressions when it compiles, and writes a folded inf or nan
            # into Python source as a bare name: its bug, not a behaviour to hold loom to
            continue
        except Exception as e:  # noqa: BLE001 (Python's own errors are part of the behaviour)
            case["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(case, ensure_ascii=False))
        printed += 1


if __name__ == "__main__":
    main()
