"""The import rule of ARCHITECTURE.md, checked on every module: each package imports only the
packages below it (and itself), never upward, at module level or inside a function."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

MAY_IMPORT = {
    "journal": {"journal"},
    "events": {"events", "journal"},
    "transport": {"transport"},
    "controlplane": {"controlplane", "events", "journal", "transport"},
    "kvcache": {"kvcache", "controlplane", "events", "journal", "transport"},
    "dataplane": {"dataplane", "kvcache", "controlplane", "events", "journal", "transport"},
    "fleet": {"fleet", "controlplane", "events", "journal", "transport"},
    "interlock": {
        "interlock", "fleet", "dataplane", "kvcache", "controlplane", "events", "journal", "transport", "fixtures",
    },  # fmt: skip
    "fixtures": {"fixtures"},
}
PROJECT_PACKAGES = set(MAY_IMPORT) | {"bench", "tests"}


def top_level_imports(path: Path) -> set[str]:
    """The top-level modules a module imports absolutely anywhere in its body."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        imported.update(name.split(".")[0] for name in names)
    return imported


def project_imports(path: Path) -> set[str]:
    """The top-level project packages a module imports anywhere in its body."""
    return top_level_imports(path) & PROJECT_PACKAGES


MODULES = sorted((package, path) for package in MAY_IMPORT for path in (REPO_ROOT / package).rglob("*.py"))


@pytest.mark.parametrize(("package", "path"), MODULES, ids=[str(path.relative_to(REPO_ROOT)) for _, path in MODULES])
def test_imports_only_run_downward(package: str, path: Path) -> None:
    forbidden = project_imports(path) - MAY_IMPORT[package]
    assert not forbidden, f"{path.relative_to(REPO_ROOT)} ({package}) imports {sorted(forbidden)}"


def test_every_package_is_covered() -> None:
    packages = {path.parent.name for path in REPO_ROOT.glob("*/__init__.py")} - {"bench", "tests"}
    assert packages == set(MAY_IMPORT)


CONTROLPLANE_MAY_IMPORT = {
    "rules": {"rules"},
    "infrastructure": {"infrastructure", "rules"},
    "effects": {"effects", "infrastructure", "rules"},
}
"""Inside `controlplane/`: the pure rules, the infrastructure (config, key and TLS files, logs,
journals) over them, the effects (the runtime, probes, follower, metrics, replay) over both."""
CONTROLPLANE_MODULES = sorted(
    (part, path) for part in CONTROLPLANE_MAY_IMPORT for path in (REPO_ROOT / "controlplane" / part).rglob("*.py")
)


def controlplane_parts_imported(path: Path) -> set[str]:
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        imported.update(name.split(".")[1] for name in names if name.startswith("controlplane."))
    return imported


def test_controlplane_holds_only_its_three_parts() -> None:
    assert {path.name for path in (REPO_ROOT / "controlplane").glob("*.py")} == {"__init__.py"}
    parts = {path.name for path in (REPO_ROOT / "controlplane").glob("*/")} - {"__pycache__"}
    assert parts == set(CONTROLPLANE_MAY_IMPORT)


@pytest.mark.parametrize(
    ("part", "path"), CONTROLPLANE_MODULES, ids=[str(path.relative_to(REPO_ROOT)) for _, path in CONTROLPLANE_MODULES]
)
def test_controlplane_parts_import_only_downward(part: str, path: Path) -> None:
    forbidden = controlplane_parts_imported(path) - CONTROLPLANE_MAY_IMPORT[part]
    assert not forbidden, f"{path.relative_to(REPO_ROOT)} (controlplane.{part}) imports {sorted(forbidden)}"


def test_the_wheel_lists_every_package() -> None:
    """pyproject.toml names each package of the wheel, subpackages included: one it leaves out
    is missing from the installed gateway (`fixtures` runs from the checkout only)."""
    listed = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    found = {
        ".".join(init.parent.relative_to(REPO_ROOT).parts)
        for package in set(MAY_IMPORT) - {"fixtures"}
        for init in (REPO_ROOT / package).rglob("__init__.py")
    }
    assert sorted(listed) == sorted(found)


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "upward.py"
    module.write_text("def late():\n    from dataplane.proxy import Proxy\n    return Proxy\n")
    assert project_imports(module) - MAY_IMPORT["controlplane"] == {"dataplane"}


# --- the pure rules ---------------------------------------------------------------------------
# `controlplane/rules/` is sealed as trio seals `_core`: its modules import only themselves, the
# events' vocabulary, msgspec (the data library the vocabulary is written in) and the pure
# modules of the standard library; no I/O, clock, randomness, logging or another package's
# effects. Of the two stdlib modules that also reach a clock or the system's entropy, only their
# pure names: a `random.Random` is seeded (the same seed, the same draw), a `datetime` converts a
# time it is given.

RULES = REPO_ROOT / "controlplane" / "rules"
RULES_MAY_IMPORT = {
    "controlplane.rules", "events.config", "events.state", "events.types", "events.decisions", "msgspec",
}  # fmt: skip
PURE_STDLIB = {
    "__future__", "bisect", "collections", "dataclasses", "enum", "functools", "hashlib", "heapq", "itertools",
    "math", "operator", "re", "typing",
}  # fmt: skip
PURE_NAMES_OF = {"random": {"Random"}, "datetime": {"datetime.fromtimestamp", "UTC"}}
"""Modules with both pure and impure names: the names of each a rule may use."""
IMPURE_BUILTINS = {"open", "print", "input", "breakpoint", "exec", "eval", "compile", "__import__"}


def imported_modules(tree: ast.AST) -> dict[str, str]:
    """Every module a tree imports (absolutely or relatively) → the name it is bound to."""
    modules = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update((alias.name, alias.asname or alias.name.split(".")[0]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (f"{node.module}." if node.module else "")
            modules.update((module + alias.name, alias.asname or alias.name) for alias in node.names)
    return modules


def attribute_path(node: ast.Attribute) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join(reversed(parts))


def impurities(path: Path) -> list[str]:
    """What in a module breaks the rules package's seal: an import outside what it may import,
    an impure name of a partly pure module, an I/O builtin."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for module, bound in imported_modules(tree).items():
        if module.startswith("."):
            found.append(f"relative import {module}")
            continue
        top = module.split(".")[0]
        if top in PURE_NAMES_OF:
            if module != top and module.removeprefix(top + ".") not in PURE_NAMES_OF[top]:
                found.append(f"imports {module}")
            continue
        if top in PURE_STDLIB or any(module == name or module.startswith(name + ".") for name in RULES_MAY_IMPORT):
            continue
        found.append(f"imports {module}")
    partly_pure = {bound: module for module, bound in imported_modules(tree).items() if module in PURE_NAMES_OF}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute | ast.Name):
            root = node
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in partly_pure:
                used = attribute_path(node)
                if not any(used == name or used.startswith(name + ".") or name.startswith(used + ".")
                           for name in PURE_NAMES_OF[partly_pure[root.id]]):  # fmt: skip
                    found.append(f"uses {partly_pure[root.id]}.{used}")
        elif isinstance(node, ast.Name) and node.id in IMPURE_BUILTINS:
            found.append(f"calls {node.id}")
    for node in ast.walk(tree):  # a Random is seeded
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "Random":
            if not node.args:
                found.append("an unseeded random.Random()")
    return found


RULE_MODULES = sorted(RULES.rglob("*.py"))


def test_the_rules_package_holds_the_pure_rules() -> None:
    names = {path.stem for path in RULE_MODULES} - {"__init__"}
    assert {"reducer", "transitions", "health", "discovery", "load", "adapters", "routing", "policies"} <= names
    assert {"saturation", "prefix", "balancer"} <= names


@pytest.mark.parametrize("path", RULE_MODULES, ids=[str(path.relative_to(REPO_ROOT)) for path in RULE_MODULES])
def test_a_rule_module_is_pure(path: Path) -> None:
    assert impurities(path) == [], f"{path.relative_to(REPO_ROOT)} is not pure"


@pytest.mark.parametrize(
    ("source", "impurity"),
    [
        ("import time\n", "imports time"),
        ("def late():\n    import trio\n", "imports trio"),
        ("from controlplane.infrastructure.logs import JsonLog\n", "imports controlplane.infrastructure.logs.JsonLog"),
        ("from events.log import read_events\n", "imports events.log.read_events"),
        ("import logging\n", "imports logging"),
        ("import os.path\n", "imports os.path"),
        ("import random\nrandom.random()\n", "uses random.random"),
        ("import random\nrandom.Random()\n", "an unseeded random.Random()"),
        ("from random import shuffle\n", "imports random.shuffle"),
        ("import datetime\ndatetime.datetime.now()\n", "uses datetime.datetime.now"),
        ("def f(path):\n    return open(path)\n", "calls open"),
        ("from . import sibling\n", "relative import .sibling"),
    ],
)
def test_the_seal_catches(tmp_path: Path, source: str, impurity: str) -> None:
    module = tmp_path / "impure.py"
    module.write_text(source)
    assert impurity in impurities(module)
