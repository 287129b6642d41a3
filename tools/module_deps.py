#!/usr/bin/env python3
"""Module dependency edges and cycles.

Rust: `python3 tools/module_deps.py CRATE_SRC_DIR [--tests]`: a crate's `crate::`/`super::`
paths (`use` or inline) and a parent naming its child module `child::`. Test modules
(`#[cfg(test)] mod ... {}`) are left out unless --tests. A textual scan, not a parser:
comments and strings are stripped first, and `super` inside inline modules (`mod x { ... }`)
is resolved by nesting.

Python: `python3 tools/module_deps.py python --python`: the package's module-level imports.

Prints `a -> b` edges, then every cycle (strongly connected component), or `cycles: none`.
"""

import ast
import os
import re
import sys

# Comments, strings (raw ones with their own quotes inside) and char literals, in one pass so
# that each is recognised where it starts: "//" inside a string is not a comment, a quote
# inside r#"..."# does not end it.
_NOISE = re.compile(
    r"(?P<comment>//[^\n]*|/\*.*?\*/)"
    r"|(?P<raw>b?r(?P<hashes>#*)\".*?\"(?P=hashes))"
    r"|(?P<string>b?\"(?:\\.|[^\"\\])*\")"
    r"|(?P<char>b?'(?:\\.|[^'\\])')",
    re.S,
)


def strip(src):
    def blank(m):
        if m.group("comment"):
            return ""
        return "' '" if m.group("char") else '""'

    return _NOISE.sub(blank, src)


def drop_test_mods(src):
    out, i = [], 0
    pat = re.compile(
        r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{"
    )
    while True:
        m = pat.search(src, i)
        if not m:
            out.append(src[i:])
            break
        out.append(src[i : m.start()])
        depth, j = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(src[j], 0)
            j += 1
        i = j
    return "".join(out)


def modules(root):
    mods = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(d, f), root)[:-3]
            name = {"lib": "crate", "main": "crate"}.get(rel, rel)
            name = name[:-4] if name.endswith("/mod") else name
            mods[name] = os.path.join(d, f)
    return mods


def expand(tail):
    """`a::b::{c, d::e}` -> [[a,b,c],[a,b,d,e]] (first levels only)."""
    tail = tail.strip()
    if tail.startswith("{"):
        depth, items, cur = 0, [], ""
        for ch in tail[1:-1]:
            if ch == "," and depth == 0:
                items.append(cur)
                cur = ""
                continue
            depth += {"{": 1, "}": -1}.get(ch, 0)
            cur += ch
        items.append(cur)
        return [p for it in items if it.strip() for p in expand(it)]
    m = re.match(r"(\w+)(?:::(.*))?$", tail, re.S)
    if not m:
        return [[]]
    head, rest = m.group(1), m.group(2)
    return [[head] + r for r in expand(rest)] if rest else [[head]]


def path_ends(src, at):
    """The path tail after `crate::`/`super::` at `at`: an ident chain, maybe ending in a group."""
    j, depth = at, 0
    while j < len(src):
        ch = src[j]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                j += 1
                break
        elif depth == 0 and not (ch.isalnum() or ch in "_:"):
            break
        j += 1
    return src[at:j]


def resolve(mods, reexports, base, segs):
    cur = base
    for s in segs:
        nxt = s if cur == "crate" else f"{cur}/{s}"
        if nxt in mods:
            cur = nxt
        else:
            if cur == "crate" and s in reexports:
                return reexports[s]
            break
    return cur


def inline_depth(src, pos):
    depth, stack = 0, []
    for m in re.finditer(r"\bmod\s+\$?\w+\s*\{|\{|\}", src[:pos]):
        t = m.group(0)
        if t == "}":
            if stack and stack.pop():
                depth -= 1
        else:
            is_mod = t.startswith("mod")
            stack.append(is_mod)
            depth += is_mod
    return depth


def rust_edges(root, tests):
    """(modules, edges) of the crate whose sources are under `root`."""
    mods = modules(root)
    lib = strip(open(mods["crate"]).read())
    reexports = {}
    for m in re.finditer(r"pub use (\w+)::([^;]+);", lib):
        for p in expand(m.group(2)):
            if p:
                reexports[p[-1]] = m.group(1)
    edges = set()
    for name, path in mods.items():
        src = strip(open(path).read())
        if not tests:
            src = drop_test_mods(src)
        for m in re.finditer(r"\b(crate|super)((?:::super)*)::", src):
            if m.group(1) == "crate":
                base = "crate"
            else:
                up = 1 + m.group(2).count("super") - inline_depth(src, m.start())
                if up <= 0:
                    continue  # `super` of an inline module: this file
                base = name
                for _ in range(up):
                    base = base.rsplit("/", 1)[0] if "/" in base else "crate"
            for segs in expand(path_ends(src, m.end())):
                t = resolve(mods, reexports, base, segs)
                if t not in (name, "crate"):
                    edges.add((name, t))
        # A parent using its own child module by a bare path (`avx2::kernels`, `pub use x8::`).
        for child in re.findall(r"\bmod\s+(\w+)\s*;", src):
            full = child if name == "crate" else f"{name}/{child}"
            body = re.sub(r"\bmod\s+\w+\s*;", "", src)
            if full in mods and re.search(rf"(?<![\w:]){child}::", body):
                edges.add((name, full))
    return mods, edges


def python_edges(root):
    """(modules, edges) of the Python package(s) under `root`, from module-level imports (those
    run at import time). Importing a child through its parent package is not counted: the
    parent's __init__ re-exporting its children is no loop."""
    mods = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            if f.endswith(".py"):
                parts = os.path.relpath(os.path.join(d, f), root)[:-3].split(os.sep)
                mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(
                    d, f
                )
    edges = set()
    for name, path in mods.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.parse(open(path).read()).body:
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + [node.module or ""]).strip(".") if node.level else node.module
                children = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods]
                targets = children or [mod]
            else:
                continue
            for t in targets:
                if t in mods and t != name and not name.startswith(t + "."):
                    edges.add((name, t))
    return mods, edges


def cycles(mods, edges):
    """Tarjan's strongly connected components of more than one module."""
    graph = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
    index, low, stack, on, sccs, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, []):
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
                sccs.append(sorted(comp))

    for v in sorted(mods):
        if v not in index:
            visit(v)
    return sccs


def main():
    root = sys.argv[1]
    if "--python" in sys.argv:
        mods, edges = python_edges(root)
    else:
        mods, edges = rust_edges(root, "--tests" in sys.argv)
    for a, b in sorted(edges):
        print(f"{a} -> {b}")
    found = cycles(mods, edges)
    print("cycles:", "; ".join(" <-> ".join(c) for c in found) if found else "none")


if __name__ == "__main__":
    main()
