#!/usr/bin/env python3
"""The classes of namespace loom with virtual functions in an abidw dump, one qualified name a
line: scripts/check-abi.sh compares those of the probe's whole dump (--load-all-types) with those
its exported functions reach, so that none goes without its virtuals compared.
    python3 scripts/abi_classes.py DUMP.abi"""
import sys
import xml.etree.ElementTree as ET


def walk(node, scope, found):
    for child in node:
        name = child.get("name")
        if child.tag == "namespace-decl":
            walk(child, scope + [name], found)
        elif child.tag == "class-decl" and child.get("is-declaration-only") != "yes":
            qualified = "::".join(scope + [name])
            if qualified.startswith("loom::") and any(m.tag == "member-function" and m.get("vtable-offset") is not None for m in child):
                found.add(qualified)
            walk(child, scope + [name], found)


found = set()
for unit in ET.parse(sys.argv[1]).getroot().iter("abi-instr"):
    walk(unit, [], found)
print("\n".join(sorted(found)))
