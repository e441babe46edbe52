#!/usr/bin/env python3
"""The library's layer rules, checked: `scripts/check-layers.py` (from the repository root).

Reads which file of dblock/src is in which layer from the ```layers block of ARCHITECTURE.md
(the one place that says so), reads every file's references to the crate's own modules
(`use` lines and paths: `crate::…`, `super::…`, `self::…`, a child module's name, and names the
crate root re-exports), and fails when

- a file of dblock/src is in no layer (a new file must be placed on the map);
- a file imports from a layer its own may not import from (ARCHITECTURE.md's rules, below);
- a backend imports another backend;
- the files import each other in a cycle.

Layers and what each may import (besides itself):

    friendly  → friendly, selector, raw
    selector  → raw, backend           (target.rs: the one place that names the backends)
    raw       → raw                    (the interface the backends implement, and leaves)
    backend   → raw, and its own files

Comments, string and character literals are ignored; so are `mod NAME;` declarations (a
parent declaring a child is no import), and a directory module's `mod.rs` using its own
children (the facade re-exporting its parts), as in the cycle count. Exit status 1 on any
violation, each printed on a line of its own; 0 and one summary line otherwise.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "dblock", "src")
MAP = os.path.join(ROOT, "ARCHITECTURE.md")

MAY_IMPORT = {
    "friendly": {"friendly", "selector", "raw"},
    "selector": {"raw", "backend"},
    "raw": {"raw"},
    "backend": {"raw", "backend"},
}


def read_layers():
    """{pattern: layer} from ARCHITECTURE.md's ```layers block: `LAYER  PATTERN …` lines."""
    text = open(MAP, encoding="utf-8").read()
    m = re.search(r"^```layers\n(.*?)^```", text, re.M | re.S)
    if not m:
        sys.exit(f"check-layers: no ```layers block in {os.path.relpath(MAP, ROOT)}")
    patterns = {}
    for line in m.group(1).splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        layer, pats = words[0], words[1:]
        if layer not in MAY_IMPORT:
            sys.exit(f"check-layers: unknown layer {layer!r} in ARCHITECTURE.md")
        for p in pats:
            if p in patterns:
                sys.exit(f"check-layers: {p} is placed twice in ARCHITECTURE.md")
            patterns[p] = layer
    return patterns


def layer_of(rel, patterns):
    """The layer of a file (path relative to dblock/src): the file itself if listed, else its
    nearest listed directory."""
    if rel in patterns:
        return patterns[rel], rel
    parts = rel.split("/")
    for i in range(len(parts) - 1, 0, -1):
        d = "/".join(parts[:i]) + "/"
        if d in patterns:
            return patterns[d], d
    return None, None


def strip(src):
    """The source without comments and literals (so a doc link or a message names nothing)."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if src.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif src.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == "r" and re.match(r'r#*"', src[i:]) and not (i and (src[i - 1].isalnum() or src[i - 1] == "_")):
            hashes = re.match(r"r(#*)\"", src[i:]).group(1)
            end = src.find('"' + hashes, i + 2 + len(hashes))
            i = n if end < 0 else end + 1 + len(hashes)
            out.append('""')
        elif c == '"':
            i += 1
            while i < n and src[i] != '"':
                i += 2 if src[i] == "\\" else 1
            i += 1
            out.append('""')
        elif c == "'" and re.match(r"'(?:[^'\\]|\\[^']+|\\')'", src[i:]):
            i += len(re.match(r"'(?:[^'\\]|\\[^']+|\\')'", src[i:]).group(0))
            out.append("' '")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def drop_tests(src):
    """The source without its `#[cfg(test)]` modules: a test may use the whole crate, and is no
    part of the library's layering. Returns (source, names of test modules in files of their own)."""
    test_files = set()
    attr = re.compile(r"#\[cfg\([^\]]*\btest\b[^\]]*\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*([;{])")
    while True:
        m = attr.search(src)
        if not m:
            return src, test_files
        if m.group(2) == ";":
            test_files.add(m.group(1))
            src = src[:m.start()] + src[m.end():]
            continue
        depth, i = 1, m.end()
        while i < len(src) and depth:
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            i += 1
        src = src[:m.start()] + src[i:]


def flatten_groups(src):
    """`use a::{b::C, d::{E, F}}` → `a::b::C a::d::E a::d::F` (and likewise in paths)."""
    pat = re.compile(r"\b((?:crate|super|self|\w+)(?:::\w+)*)::\{([^{}]*)\}")
    for _ in range(6):
        new = pat.sub(
            lambda m: " ".join(m.group(1) + "::" + item.strip() for item in m.group(2).split(",") if item.strip()) + " ",
            src,
        )
        if new == src:
            break
        src = new
    return src


def inline_modules(src):
    """The inline `mod NAME { … }` blocks of a file: (start, end, NAME)."""
    spans = []
    for m in re.finditer(r"\bmod\s+(\w+)\s*\{", src):
        depth, i = 1, m.end()
        while i < len(src) and depth:
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            i += 1
        spans.append((m.end(), i, m.group(1)))
    return spans


def scope_at(spans, pos):
    """The inline modules enclosing `pos`, outermost first."""
    return [name for start, end, name in sorted(spans) if start <= pos < end]


def shortest_cycle(comp, edges, files):
    """One shortest cycle through the first file (by path) of a strongly connected component,
    each step with the path that makes it."""
    members = set(comp)
    start = min(comp, key=lambda m: files[m])
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w not in members:
                    continue
                if w == start:
                    steps, x = [], v
                    while x is not None:
                        steps.append(x)
                        x = prev[x]
                    steps.reverse()
                    hops = [f"{files[a]} (`{edges[a][b]}`)" for a, b in zip(steps, steps[1:] + [start])]
                    return hops + [files[start]]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [files[m] for m in sorted(comp)]


def main():
    patterns = read_layers()
    files = {}  # module path (tuple) -> path relative to SRC
    for dp, _, fs in os.walk(SRC):
        for f in fs:
            if f.endswith(".rs"):
                rel = os.path.relpath(os.path.join(dp, f), SRC).replace(os.sep, "/")
                parts = rel[:-3].split("/")
                if parts[-1] in ("mod", "lib"):
                    parts = parts[:-1]
                files[tuple(parts)] = rel

    sources, test_files = {}, set()
    for mod, rel in files.items():
        src, tests = drop_tests(strip(open(os.path.join(SRC, rel), encoding="utf-8").read()))
        sources[mod] = flatten_groups(src)
        test_files |= {mod + (t,) for t in tests}
    for t in test_files:
        files.pop(t, None)
        sources.pop(t, None)

    problems = []
    for p in sorted(patterns):
        if not any(rel == p or (p.endswith("/") and rel.startswith(p)) for rel in files.values()):
            problems.append(f"ARCHITECTURE.md places {p}, which is not a file or directory of dblock/src")
    layers = {}
    for mod, rel in files.items():
        layer, _ = layer_of(rel, patterns)
        if layer is None:
            problems.append(f"{rel}: in no layer (place it in ARCHITECTURE.md's layers block)")
        layers[mod] = layer

    # Where each reference lands: paths are made absolute (inline `mod x { … }` blocks
    # included), then followed through re-exports (`pub use tls::Connector` in postgres/mod.rs
    # makes `crate::postgres::Connector` tls.rs) to the file that defines the name.
    scopes = {mod: inline_modules(src) for mod, src in sources.items()}
    children = {mod: set(re.findall(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", src, re.M))
                for mod, src in sources.items()}

    def absolute(mod, pos, segs):
        here = list(mod) + scope_at(scopes[mod], pos)
        if segs[0] == "crate":
            return segs[1:]
        if segs[0] == "super":
            i = 0
            while i < len(segs) and segs[i] == "super":
                here, i = here[:-1], i + 1
            return here + segs[i:]
        if segs[0] == "self":
            return here + segs[1:]
        if len(here) == len(mod) and segs[0] in children[mod]:
            return list(mod) + segs
        return None

    reexports = {mod: {} for mod in files}  # module file -> {name: absolute path}
    for mod, src in sources.items():
        for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", src):
            for item in m.group(1).split():
                item = item.strip(",")
                if not item or item == "as":
                    continue
                segs = item.split("::")
                path = absolute(mod, m.start(), segs)
                if path is not None and path[-1] != "*":
                    reexports[mod][path[-1]] = path
        # Only what renames (`pub use a::B as C`) needs the new name: handled by the last word.
        for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([\w:]+)\s+as\s+(\w+)\s*;", src):
            path = absolute(mod, m.start(), m.group(1).split("::"))
            if path is not None:
                reexports[mod][m.group(2)] = path

    def resolve(path, seen=0):
        for i in range(len(path), -1, -1):
            prefix = tuple(path[:i])
            if prefix in files:
                rest = path[i:]
                if rest and rest[0] in reexports[prefix] and seen < 8:
                    via = reexports[prefix][rest[0]] + rest[1:]
                    if via != path:
                        return resolve(via, seen + 1)
                return prefix
        return None

    edges = {mod: {} for mod in files}  # importer -> {imported: the path as written}
    for mod, src in sources.items():
        rel = files[mod]
        is_dir = rel.endswith("mod.rs") or rel == "lib.rs"
        # A re-export is a pass-through, not a use: references are followed through it.
        body = re.sub(r"\bpub(?:\([^)]*\))?\s+use\s+[^;]+;", lambda m: " " * len(m.group(0)), src)
        for m in re.finditer(r"(?<![\w:])((?:crate|super|self|\w+)(?:::\w+)+)", body):
            written = m.group(1)
            path = absolute(mod, m.start(), written.split("::"))
            if path is None:
                continue
            target = resolve(path)
            if target is None or target == mod or target == ():
                continue
            if is_dir and target[:-1] == mod:
                continue  # a directory module's own children (its facade), as the cycle count has it
            edges[mod].setdefault(target, written)

    def backend_of(mod):
        return mod[0] if layers.get(mod) == "backend" else None

    for mod in sorted(edges):
        for target, written in sorted(edges[mod].items()):
            a, b = layers.get(mod), layers.get(target)
            if a is None or b is None:
                continue
            if b not in MAY_IMPORT[a]:
                problems.append(f"{files[mod]} ({a}) imports {files[target]} ({b}): `{written}`")
            elif a == "backend" and b == "backend" and backend_of(mod) != backend_of(target):
                problems.append(f"{files[mod]} (backend {mod[0]}) imports another backend's "
                                f"{files[target]}: `{written}`")

    # Import cycles (Tarjan's strongly connected components).
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
                cycles.append(comp)

    for v in files:
        if v not in index:
            visit(v)
    for comp in cycles:
        problems.append("import cycle: " + " → ".join(shortest_cycle(comp, edges, files)))

    for p in problems:
        print(f"check-layers: {p}")
    if problems:
        print(f"check-layers: {len(problems)} problem(s); the rules are in ARCHITECTURE.md")
        return 1
    n = sum(len(e) for e in edges.values())
    print(f"check-layers: {len(files)} files, {n} imports between them: layers hold, no cycles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
