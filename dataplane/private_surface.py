"""What the fence modules (`hypercorn_private.py`, `prometheus_private.py`) share: the check, when
one is imported, that the installed package still has the private surface the fence relies on."""

from __future__ import annotations

from importlib.metadata import version


def untested(package: str, missing: list[str]) -> str:
    """The error saying that the installed `package` lacks what a fence relies on (`missing`)."""
    return (
        f"{package} {version(package)} is not the {package} Interlock was tested on (see pyproject.toml): "
        f"expected {'; '.join(missing)}"
    )


def require_surface(package: str, expected: list[tuple[bool, str]], changed: type[Exception]) -> None:
    """Raise `changed` (`untested`) unless every expectation holds: each a pair of whether it
    holds and what it is."""
    missing = [what for present, what in expected if not present]
    if missing:
        raise changed(untested(package, missing))
