#!/usr/bin/env python3
"""Lists the circles among a Rust crate's files: modules that import each other, directly or round
a loop. A module's use of its own parent or child folder does not count (a folder is one unit).
Exit status 1 when there is one.

    python3 scripts/check_module_cycles.py crates/model/src
"""
import os
import re
import sys


def modules(root):
    files = {}
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(".rs"):
                path = os.path.relpath(os.path.join(folder, name), root)
                parts = path[:-3].split("/")
                if parts[-1] in ("mod", "lib"):
                    parts = parts[:-1]
                files[tuple(parts)] = open(os.path.join(folder, name)).read()
    return files


def target(mods, current, path):
    """The module a `crate::…`, `super::…` or `self::…` path names (its longest known prefix)."""
    segs = path.split("::")
    if segs[0] == "crate":
        base, segs = [], segs[1:]
    elif segs[0] == "self":
        base, segs = list(current), segs[1:]
    else:
        base = list(current)
        while segs and segs[0] == "super":
            base, segs = base[:-1], segs[1:]
    best = None
    for i in range(len(segs) + 1):
        if tuple(base + segs[:i]) in mods:
            best = tuple(base + segs[:i])
    return best


def edges(mods):
    out = {}
    for current, text in mods.items():
        code = text.split("#[cfg(test)]")[0]
        code = "\n".join(l for l in code.split("\n") if not l.strip().startswith("//"))
        for m in re.finditer(r"\b((?:crate|super|self)(?:::\w+)+)", code):
            t = target(mods, current, m.group(1))
            if t is None or t == current or t[: len(current)] == current or current[: len(t)] == t:
                continue
            out.setdefault(current, set()).add(t)
    return out


def circles(mods, graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    sys.setrecursionlimit(10000)
    for v in mods:
        if v not in index:
            visit(v)
    return found


def main():
    bad = 0
    for root in sys.argv[1:]:
        mods = modules(root)
        graph = edges(mods)
        for comp in circles(mods, graph):
            bad += 1
            name = lambda m: "::".join(m) or "lib"  # noqa: E731
            print(f"{root}: {' <-> '.join(name(m) for m in comp)}")
            for a in comp:
                for b in sorted(graph.get(a, ())):
                    if b in comp:
                        print(f"    {name(a)} uses {name(b)}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
