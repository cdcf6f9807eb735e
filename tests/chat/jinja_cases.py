#!/usr/bin/env python3
"""Jinja's behaviour on what real chat templates rarely show (macros, namespaces, loop variables,
filters, tests, slicing, Python's printing of values, whitespace control), as Python's jinja2
renders it in transformers' environment. Its output is tests/fixtures/chat/jinja_cases.jsonl,
which ChatTemplates.JinjaAsPythonRendersIt holds loom's engine to.

  tests/chat/jinja_cases.py > tests/fixtures/chat/jinja_cases.jsonl
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import render_references  # noqa: E402

env = render_references.environment()
cases = [
 ("{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('a') }} {{ greet('b', punct='?') }} {{ greet(name='c') }}", {}),
 ("{% set ns = namespace(n=0, seen=[]) %}{% for m in xs %}{% set ns.n = ns.n + m %}{% endfor %}{{ ns.n }}", {"xs": [1, 2, 3]}),
 ("{% for x in xs %}{{ loop.index }}/{{ loop.length }}{{ '' if loop.last else ',' }}{% endfor %}", {"xs": ["a", "b", "c"]}),
 ("{% for x in xs if x > 1 %}{{ loop.index0 }}:{{ x }} {% else %}none{% endfor %}|{% for x in [] %}x{% else %}empty{% endfor %}", {"xs": [1, 2, 3]}),
 ("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{{ d.keys()|list }} {{ d.get('z', 'dflt') }} {{ d['a'] }}", {"d": {"b": 2, "a": 1}}),
 ("{{ xs[1:] }} {{ xs[:-1] }} {{ xs[::-1] }} {{ 'héllo'[1:3] }} {{ xs[-1] }} {{ 'abc'[::2] }}", {"xs": [1, 2, 3]}),
 ("{{ xs|selectattr('role', 'equalto', 'user')|map(attribute='c')|join(', ') }} {{ xs|rejectattr('role', 'eq', 'user')|list|length }}", {"xs": [{"role": "user", "c": "u1"}, {"role": "bot", "c": "b"}, {"role": "user", "c": "u2"}]}),
 ("{{ none|default('d') }} {{ missing|default('d') }} {{ ''|default('e', true) }} {{ [3,1,2]|sort|list }} {{ [1,1,2]|unique|list }} {{ [1,2]|first }}{{ [1,2]|last }}", {}),
 ("{{ 'a\nb'|indent(2) }}|{{ 'a\nb'|indent(2, true) }}|{{ '  x  '|trim }}|{{ 'xxhixx'|trim('x') }}|{{ 'Hello World'|lower|upper }}|{{ 'a-b'|replace('-', '+') }}", {}),
 ("{{ 7 / 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 1e20 }} {{ 0.1 + 0.2 }} {{ 1e-5 }} {{ 3.0 }} {{ 1 == 1.0 }} {{ true + 1 }}", {}),
 ("{{ [1, 'a', none, true, 1.5, {'k': 'v'}, (1,)] }} {{ \"it's\" }} {{ ['it\\'s', 'x\\ny'] }}", {}),
 ("{{ x is defined }} {{ y is none }} {{ x is string }} {{ 3 is odd }} {{ 4 is divisibleby 2 }} {{ d is mapping }} {{ xs is iterable }} {{ 1 is number }} {{ true is boolean }} {{ x is not none }}", {"x": "s", "y": None, "d": {}, "xs": []}),
 ("{{ 'a' ~ 1 ~ none }} {{ 'ab' in 'xaby' }} {{ 2 not in [1, 3] }} {{ 'k' in {'k': 1} }} {{ 1 < 2 < 3 }} {{ 'b' > 'a' }} {{ not false and (0 or 'z') }}", {}),
 ("{{ '  a  b '.strip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'x.y.z'.split('.', 1) }}|{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x', 'c')) }}|{{ 'hello world'.title() }}|{{ 'hELLO'.capitalize() }}|{{ '<think>x</think>ans'.split('</think>')[-1] }}", {}),
 ("{%- if true -%}\n  a  \n{%- endif -%}\n b", {}),
 ("  {% if true %}\n  x\n  {% endif %}\nend\n", {}),
 ("a {%+ if true %}b{% endif +%}\nc", {}),
 ("{% raw %}{{ not rendered }}{% endraw %} {# a comment #}done", {}),
 ("{% set block %}inner {{ 1 + 1 }}{% endset %}[{{ block }}]{% filter upper %}shout {{ 'x' }}{% endfilter %}", {}),
 ("{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}", {"xs": [1, 2, 3, 4, 5]}),
 ("{% for x in xs %}{% set y = x * 2 %}{{ y }}{% endfor %}[{{ y }}]{% set z = 1 %}{% if true %}{% set z = 2 %}{% endif %}{{ z }}", {"xs": [1, 2]}),
 ("{{ {'b': 1, 'a': [1.0, 2, 'é\"\\n', none, true]}|tojson }} {{ {'a': {'b': []}}|tojson(indent=2) }} {{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}", {}),
 ("{{ range(3)|list }} {{ range(1, 7, 2)|list }} {{ [1, 2, 3]|sum }} {{ [3, 1]|min }}{{ [3, 1]|max }} {{ 'x'|length }} {{ 2.7|int }} {{ '5'|int + 1 }} {{ 3|float }} {{ -3|abs }}", {}),
 ("{{ 'a' if x else 'b' }} {{ 'c' if not x }}|{{ (1, 2)[0] }} {{ [[1, 2], [3]]|map('length')|list }} {{ {'a': 1}|items|list }} {{ 'héllo'|reverse }}", {"x": False}),
 ("{% for m in messages %}{{ loop.previtem.role if loop.previtem is defined else 'start' }}>{{ m.role }} {% endfor %}", {"messages": [{"role": "a"}, {"role": "b"}]}),
 # Python's rounding (half to even, of the exact binary value), splitlines, Unicode case and the filters that differ from str's methods
 ("{{ 2.5|round }} {{ 0.125|round(2) }} {{ 3.5|round }} {{ -2.5|round }} {{ 1234.5|round(-2) }} {{ 1250|round(-2) }} {{ 5|round }} {{ 2.675|round(2) }} {{ 2.5|round(0, 'floor') }} {{ 1.05|round(1, 'ceil') }} {{ 0.5|round(-1) }} {{ 51|round(-2) }}", {}),
 ("{{ 'a\r\nb\rc\x0bd\x1ce'.splitlines() }} {{ 'a\n\nb\n'.splitlines() }} {{ ''.splitlines() }} {{ 'a\nb'.splitlines(true) }}", {}),
 ("{{ \"they're\"|title }} {{ \"they're\".title() }} {{ 'a-b (c [d <e {f'|title }} {{ 'hELLo wORLD'|title }} {{ 'é'|upper }} {{ 'ÉA'|lower }} {{ 'straße'|upper }} {{ 'ǆemal'|capitalize }} {{ 'ßa'.title() }}", {}),
 ("{{ ['a', 'B']|max }} {{ ['a', 'B']|min }} {{ ['b', 'A']|sort }} {{ ['a', 'A', 'b']|unique|list }} {{ ['a', 'A']|unique(true)|list }} {{ [{'n': 'b'}, {'n': 'A'}]|max(attribute='n') }} {{ ['B', 'a']|sort(case_sensitive=true) }}", {}),
 ("{{ '1' is lower }} {{ 'a1' is lower }} {{ '' is lower }} {{ 'A1' is upper }} {{ 'É' is upper }} {{ 'Ab' is upper }}", {}),
 ("[{{ ''|indent(2, true) }}] [{{ 'a\n'|indent }}] [{{ 'a\n\nb'|indent(2) }}] [{{ 'a\n\nb'|indent(2, blank=true) }}] [{{ 'a\r\nb'|indent(1) }}] [{{ 'x\ny'|indent('> ', true) }}]", {}),
 ("{{ '0x10'|int }} {{ '1_000'|int }} {{ ' 12 '|int }} {{ '1.9'|int }} {{ '-1e3'|int }} {{ 'inf'|int }} {{ 'nan'|float }} {{ '1_0.5'|float }} {{ '0x10'|int(base=16) }} {{ '0x10'|int(0, 16) }} {{ '10'|int(base=2) }} {{ '1__0'|int }} {{ 'x'|int(7) }} {{ '0b11'|int(0, 0) }} {{ ' -4.5e1 '|float }}", {}),
 ("{{ 2.0 is even }} {{ 3.0 is odd }} {{ 2.5 is odd }} {{ 4.0 is divisibleby 2 }} {{ 4 is divisibleby 1.5 }} {{ -3 is odd }}", {}),
 ("{{ 1 ** 999999999999999999 }} {{ ('' * 999999999999999999)|length }} {{ ([] * 999999999999999999)|length }} {{ range(100000)|unique|list|length }} {{ (-1) ** 999999999999999999 }}", {}),
 ("{% set ns = namespace(a=1) %}{% set ns.me = ns %}{{ ns }}", {}),
 ("{% set ns = namespace(a=1) %}{% set d = {'n': ns} %}{% set ns.d = d %}{{ d }}|{{ ns }}", {}),
 ("{% set ns = namespace(a=1) %}{% set ns.l = [ns, 2] %}{{ ns.l }}|{{ ns.l[0].l[1] }}", {}),
 ("{{ 'a,b c_d'|wordcount }} {{ 'abc'.replace('', '-') }} {{ 'ab'|replace('', '.', 2) }} {{ {'é': [1]}|tojson(true) }} {{ [1, {'a': 2}]|tojson(indent='\t') }} {{ [1]|tojson(indent=-1) }} {{ [1, 2]|tojson(separators=(',', ':')) }}", {}),
 ("{{ [{'a': 2, 'b': 1}, {'a': 1, 'b': 2}, {'a': 1, 'b': 1}]|sort(attribute='a,b')|map(attribute='b')|list }} {{ {'b': 1, 'A': 2}|dictsort }} {{ {'b': 1, 'a': 2}|dictsort(by='value', reverse=true) }}", {}),
 ("{{ 'ab'[-1] }} {{ 'héllo'[-4] }} {{ 'abc'[5] is defined }} {{ 9007199254740993 == 9007199254740992.0 }} {{ [1, 2, 3][::-2] }} {{ 'abcdef'[-100:100:2] }}", {}),
 ("{{ 2.0 ** -24 }} {{ 123456789012345678.0 }} {{ 'abc'.find('', 2, 1) }} {{ 'abc'.count('', 2, 1) }} {{ 'abc'.startswith('', 2, 1) }} {{ ['\U000e0067', '\u0600', '\u00ad', 'x\u3000'] }}", {}),
 ("{{ [1, [2]]|unique|list }}", {}),
 ("{{ 2.0 ** 10000 }}", {}),
]
for source, context in cases:
    case = {"template": source, "context": context}
    try:
        case["text"] = env.from_string(source).render(**context)
    except Exception as e:  # noqa: BLE001 (Python's own errors are part of the behaviour)
        case["error"] = str(e)
    print(json.dumps(case, ensure_ascii=False))
