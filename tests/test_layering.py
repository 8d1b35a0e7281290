"""The import rule of ARCHITECTURE.md, checked on every module: each package imports only the
packages below it (and itself), never upward, at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

MAY_IMPORT = {
    "journal": {"journal"},
    "events": {"events", "journal"},
    "transport": {"transport"},
    "controlplane": {"controlplane", "events", "journal", "transport"},
    "dataplane": {"dataplane", "controlplane", "events", "journal", "transport"},
    "fleet": {"fleet", "controlplane", "events", "journal", "transport"},
    "interlock": {"interlock", "fleet", "dataplane", "controlplane", "events", "journal", "transport", "fixtures"},
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


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "upward.py"
    module.write_text("def late():\n    from dataplane.proxy import Proxy\n    return Proxy\n")
    assert project_imports(module) - MAY_IMPORT["controlplane"] == {"dataplane"}
