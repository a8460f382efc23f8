"""The package's structure, read from its source: dependencies point one way, private torch APIs
stay in the two modules made for them.  ``python benchmarks/structure.py`` prints the same
picture."""

import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import structure  # noqa: E402  (benchmarks/structure.py)

# bottom to top: a module imports only from its own layer or below (DESIGN.md's picture)
LAYERS = [
    ("fxshard._torch",),
    ("fxshard.core",),
    ("fxshard.planner", "fxshard.rules", "fxshard.ir"),
    ("fxshard.capture", "fxshard.placement", "fxshard.passes", "fxshard.report"),
    ("fxshard.runtime",),
    ("fxshard.api",),
    ("fxshard.backend", "fxshard.parallelize", "fxshard.zoo", "fxshard.__main__", "fxshard"),
]


def _layer(module: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, f"{module} belongs to no layer of tests/test_structure.py: add it"
    return best[0]


def test_no_import_cycles():
    mods = structure.modules(ROOT)
    assert structure.cycles(mods) == []


def test_imports_point_down():
    mods = structure.modules(ROOT)
    wrong = []
    for name, mod in mods.items():
        for target, line in structure.imports(mod, mods):
            if _layer(target) > _layer(name):
                wrong.append(f"{mod.path}:{line} imports {target}")
    assert wrong == []


def test_private_torch_apis_only_in_their_modules():
    r = structure.report(ROOT)
    outside = {
        p: uses for p, uses in r["private"].items() if not p.startswith(structure.PRIVATE_OK)
    }
    assert outside == {}


def test_the_checks_catch_what_they_claim(tmp_path):
    """The analyser itself: a cycle, an upward import and private torch uses in a fake package."""
    pkg = tmp_path / "fxshard"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "api.py").write_text("def f():\n    from .core import spec\n")
    (pkg / "core" / "spec.py").write_text(
        "import torch\nimport torch._dynamo\n\n\ndef g(t, m):\n    from ..api import f\n"
        "    return t._version, m._parameters, torch.ops.aten._to_copy.default\n"
    )
    mods = structure.modules(str(tmp_path))
    assert structure.cycles(mods) == [["fxshard.api", "fxshard.core.spec"]]
    uses = structure.private_uses(mods["fxshard.core.spec"], set())
    assert sorted(w for _, w in uses) == ["import torch._dynamo", "m._parameters", "t._version"]
