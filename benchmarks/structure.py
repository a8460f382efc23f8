"""The structure of the ``fxshard`` package, measured from its source (AST, no import).

    python benchmarks/structure.py [--root DIR]

Prints the import cycles between modules (function-level imports included), the files that use
private torch APIs (``torch._*`` modules, private names imported from torch, private attributes of
torch objects: any ``obj._name`` that fxshard itself never defines), functions over 120 lines,
lines over 100 characters and the share of annotated parameters.  ``tests/test_structure.py``
fails on a cycle or on a private torch API outside the modules allowed to use them.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

# the modules that may use private torch APIs (everything else goes through them)
PRIVATE_OK = ("fxshard/_torch.py", "fxshard/rules/")
# underscore attributes of the standard library / namedtuple API, not torch's
STDLIB_PRIVATE = {"_make", "_replace", "_asdict", "_fields", "_getframe"}


@dataclass
class Module:
    name: str  # dotted module name, e.g. fxshard.planner.search
    path: str  # relative to the root, e.g. fxshard/planner/search.py
    tree: ast.Module
    is_package: bool


def modules(root: str, package: str = "fxshard") -> dict[str, Module]:
    out = {}
    base = os.path.join(root, package)
    for dirpath, _dirs, files in os.walk(base):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            full = os.path.join(dirpath, f)
            rel = os.path.relpath(full, root)
            parts = rel[:-3].split(os.sep)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            with open(full, encoding="utf-8") as fh:
                tree = ast.parse(fh.read(), filename=rel)
            out[".".join(parts)] = Module(".".join(parts), rel.replace(os.sep, "/"), tree, is_pkg)
    return out


def _resolve(mod: Module, level: int, target: str | None) -> str:
    if not level:
        return target or ""
    pkg = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
    base = pkg[: len(pkg) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (annotations only: no dependency at
    run time)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def imports(mod: Module, known: dict[str, Module]) -> Iterator[tuple[str, int]]:
    """(imported fxshard module, line) for every import in ``mod``, at any depth (imports for
    annotations only, under ``if TYPE_CHECKING:``, excepted)."""
    skip = _type_only(mod.tree)
    for node in ast.walk(mod.tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, node.level, node.module)
            for a in node.names:
                sub = f"{base}.{a.name}" if base else a.name
                if sub in known:  # from pkg import submodule
                    yield sub, node.lineno
                elif base in known:
                    yield base, node.lineno


def cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {m: sorted({t for t, _ in imports(mods[m], mods) if t != m}) for m in mods}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _defined_names(mods: dict[str, Module]) -> set[str]:
    """Every underscore name fxshard defines: functions, classes, attributes it assigns,
    arguments."""
    out = set()
    for m in mods.values():
        for node in ast.walk(m.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                out.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
            elif isinstance(node, ast.arg):
                out.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                out.add(node.arg)
    return {n for n in out if n.startswith("_")}


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"] (None when the root is not a plain name)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return None


def private_uses(mod: Module, ours: set[str]) -> list[tuple[int, str]]:
    """(line, what) for every private torch API ``mod`` uses."""
    found = []
    torch_names: dict[str, str] = {}  # local name -> the torch module path it is bound to
    other_modules: set[str] = set()
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    if any(_private(p) for p in a.name.split(".")):
                        found.append((node.lineno, f"import {a.name}"))
                    torch_names[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
                else:
                    other_modules.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module == "torch" or node.module.startswith("torch."):
                if any(_private(p) for p in node.module.split(".")):
                    found.append((node.lineno, f"from {node.module} import ..."))
                for a in node.names:
                    if _private(a.name):
                        found.append((node.lineno, f"from {node.module} import {a.name}"))
                    torch_names[a.asname or a.name] = f"{node.module}.{a.name}"
            else:
                for a in node.names:
                    other_modules.add(a.asname or a.name)
    for node in ast.walk(mod.tree):  # aliases: ``aten = torch.ops.aten``
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            parts = _chain(node.value) if isinstance(node.value, ast.Attribute) else None
            if parts and parts[0] in torch_names:
                torch_names[node.targets[0].id] = ".".join(
                    torch_names[parts[0]].split(".") + parts[1:]
                )
    inner = {id(n.value) for n in ast.walk(mod.tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(mod.tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        parts = _chain(node)
        if parts is None:  # an attribute of a call result etc.: only its own name is known
            if _private(node.attr) and node.attr not in ours and node.attr not in STDLIB_PRIVATE:
                found.append((node.lineno, f"._{node.attr.lstrip('_')}"))
            continue
        root = parts[0]
        if root in torch_names:
            full = torch_names[root].split(".") + parts[1:]
            # op names (torch.ops.<namespace>.<op>) are the op interface; a private namespace is not
            cut = len(full)
            if len(full) >= 3 and full[:2] == ["torch", "ops"]:
                cut = 3
            if any(_private(p) for p in full[:cut]):
                if not any(_private(p) for p in torch_names[root].split(".")):  # reported at import
                    found.append((node.lineno, ".".join(full[:cut])))
            continue
        if root in other_modules:
            continue
        if any(_private(p) and p not in ours and p not in STDLIB_PRIVATE for p in parts[1:]):
            found.append((node.lineno, ".".join(parts)))
    # one entry per (line, what); attribute chains are visited once per prefix
    return sorted(set(found))


def long_functions(mods: dict[str, Module], limit: int = 120) -> list[tuple[int, str]]:
    out = []
    for m in mods.values():
        for node in ast.walk(m.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append((n, f"{m.path}:{node.lineno} {node.name}"))
    return sorted(out, reverse=True)


def long_lines(root: str, limit: int = 100, tops=("fxshard",)) -> int:
    n = 0
    for top in tops:
        for dirpath, _d, files in os.walk(os.path.join(root, top)):
            for f in files:
                if f.endswith(".py"):
                    with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
                        n += sum(len(line.rstrip("\n")) > limit for line in fh)
    return n


def annotated(mods: dict[str, Module]) -> tuple[int, int]:
    """(annotated parameters, parameters) over fxshard's functions (self / cls not counted)."""
    yes = total = 0
    for m in mods.values():
        for node in ast.walk(m.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
                params += [p for p in (a.vararg, a.kwarg) if p is not None]
                for p in params:
                    if p.arg in ("self", "cls"):
                        continue
                    total += 1
                    yes += p.annotation is not None
    return yes, total


def report(root: str) -> dict:
    mods = modules(root)
    ours = _defined_names(mods)
    private = {}
    for m in mods.values():
        uses = private_uses(m, ours)
        if uses:
            private[m.path] = uses
    yes, total = annotated(mods)
    return {
        "cycles": cycles(mods),
        "private": private,
        "long_functions": long_functions(mods),
        "long_lines": long_lines(root),
        "long_lines_all": long_lines(root, tops=("fxshard", "tests", "benchmarks", "examples")),
        "annotated": (yes, total),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    )
    ap.add_argument("--verbose", action="store_true", help="list every private use")
    args = ap.parse_args(argv)
    r = report(os.path.abspath(args.root))
    print(f"import cycles: {len(r['cycles'])}")
    for c in r["cycles"]:
        print("  " + " <-> ".join(c))
    outside = {p: u for p, u in r["private"].items() if not p.startswith(PRIVATE_OK)}
    print(
        f"files using private torch APIs: {len(r['private'])} ({len(outside)} outside "
        f"{', '.join(PRIVATE_OK)})"
    )
    for p, uses in sorted(r["private"].items()):
        shown = uses if args.verbose else uses[:3]
        print(f"  {p}: {len(uses)}  " + "; ".join(f"{ln}: {w}" for ln, w in shown))
    lf = r["long_functions"]
    print(
        f"functions over 120 lines: {len(lf)}"
        + (f" (longest {lf[0][0]}: {lf[0][1]})" if lf else "")
    )
    for n, where in lf[1:]:
        print(f"  {n}: {where}")
    print(
        f"lines over 100 characters: {r['long_lines']} in fxshard/, {r['long_lines_all']} with "
        "tests, "
        f"benchmarks and examples"
    )
    yes, total = r["annotated"]
    print(f"parameters annotated: {yes}/{total} ({yes / max(total, 1):.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
