"""pyproject.toml declares every package the code imports, each with the upper bound it was
tested on, and the installed versions are within the bounds: the project's packages import
only declared dependencies, the tests and benches also the `test` extra."""

from __future__ import annotations

import re
import sys
import tomllib
from importlib.metadata import packages_distributions, version
from pathlib import Path

from test_layering import PROJECT_PACKAGES, top_level_imports

REPO_ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
OWN = PROJECT_PACKAGES
REQUIREMENT = re.compile(r"(?P<name>[A-Za-z0-9_.-]+)>=(?P<lowest>[0-9.]+),<(?P<below>[0-9.]+)$")


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def bounds(requirements: list[str]) -> dict[str, tuple[str, str]]:
    """Each requirement's distribution and its bounds; a requirement without both fails here."""
    parsed = {}
    for requirement in requirements:
        match = REQUIREMENT.match(requirement)
        assert match, f"{requirement!r}: a requirement is NAME>=LOWEST,<BELOW (tested bounds)"
        parsed[normalized(match["name"])] = (match["lowest"], match["below"])
    return parsed


DEPENDENCIES = bounds(PROJECT["dependencies"])
TEST_DEPENDENCIES = bounds(PROJECT["optional-dependencies"]["test"])


def imported_distributions(packages: set[str]) -> dict[str, set[str]]:
    """The distributions imported by the modules of `packages`, each with the modules importing it."""
    local = {path.stem for path in (REPO_ROOT / "tests").glob("*.py")}
    distributions = packages_distributions()
    found: dict[str, set[str]] = {}
    for package in packages:
        for path in (REPO_ROOT / package).rglob("*.py"):
            for top in top_level_imports(path):
                if top in sys.stdlib_module_names or top in OWN or top in local or top == "__future__":
                    continue
                for distribution in distributions.get(top, [top]):
                    found.setdefault(normalized(distribution), set()).add(str(path.relative_to(REPO_ROOT)))
    return found


def test_the_code_imports_only_declared_dependencies():
    code = imported_distributions(OWN - {"bench", "tests"})
    undeclared = {name: sorted(paths) for name, paths in code.items() if name not in DEPENDENCIES}
    assert not undeclared, f"imported but not in pyproject.toml's dependencies: {undeclared}"


def test_the_tests_and_benches_import_only_dependencies_and_the_test_extra():
    declared = DEPENDENCIES | TEST_DEPENDENCIES
    used = imported_distributions({"bench", "tests"})
    undeclared = {name: sorted(paths) for name, paths in used.items() if name not in declared}
    assert not undeclared, f"imported but neither a dependency nor in the test extra: {undeclared}"


def release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.match(r"[0-9]+(\.[0-9]+)*", text)[0].split("."))


def test_the_installed_versions_are_within_the_tested_bounds():
    for name, (lowest, below) in (DEPENDENCIES | TEST_DEPENDENCIES).items():
        installed = version(name)
        assert release(lowest) <= release(installed) < release(below), f"{name} {installed} is not >={lowest},<{below}"
