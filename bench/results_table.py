"""bench/results/ holds the latest run of each bench, and its README.md the table of their figures.

    python -m bench.results_table [--prune] [--folder bench/results]

A bench's kind is its result's name after the UTC timestamp (`…Z-admission.json`: admission;
none for `python -m bench`); a folder of side-by-side rounds (`…Z-side-by-side-…/`, with the
README.md saying how they were run) is of the kind side-by-side. The latest run of a kind (the
names sort by time) is its current one, except for `python -m bench`, whose sections are often
run apart (`--sections paced`): there each target's figure comes from the latest run that
measured it. Older runs live in git history: `--prune` deletes them. The table is rewritten at
every call: run it after a bench's run worth keeping (tests/test_bench_smoke.py checks that
the folder holds current runs only and that the table is theirs).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from bench.report import RESULTS_FOLDER, evaluate_targets

README = "README.md"
MAIN = "bench"
"""The kind of `python -m bench`'s results, which have no kind in their name."""
SIDE_BY_SIDE = "side-by-side"
_NAME = re.compile(r"(?P<stamp>\d{4}-\d\d-\d\dT\d\d-\d\d(?:-\d\d)?Z)(?:-(?P<kind>.+?))??(?:-(?P<again>\d+))?")
"""`<UTC timestamp>[-kind][-N]`: `-N` is `write_results`' Nth file of one second."""


def _name(path: Path) -> re.Match[str]:
    match = _NAME.fullmatch(path.stem if path.suffix == ".json" else path.name)
    if match is None:
        raise ValueError(f"{path}: not a result's name (<UTC timestamp>[-kind].json)")
    return match


def kind_of(path: Path) -> str:
    """The bench a result in bench/results/ is of (`admission`, `bench`, `side-by-side`)."""
    kind = _name(path)["kind"] or MAIN
    return SIDE_BY_SIDE if kind.startswith(SIDE_BY_SIDE) else kind


def results_in(folder: Path) -> list[Path]:
    """Every result in `folder`, oldest first."""
    results = [path for path in folder.iterdir() if path.name != README and not path.name.startswith(".")]
    return sorted(results, key=lambda path: (_name(path)["stamp"], int(_name(path)["again"] or 1)))


def current_results(folder: Path) -> dict[str, list[tuple[Path, dict]]]:
    """Each kind's current results with what they hold, oldest first; for `bench`, the latest
    run measuring each target, with only those targets in its `targets`."""
    latest: dict[str, Path] = {}
    main_runs: list[tuple[Path, dict]] = []
    for path in results_in(folder):
        kind = kind_of(path)
        latest[kind] = path
        if kind == MAIN:
            main_runs.append((path, _read(path)))
    current = {kind: [(path, _read(path))] for kind, path in latest.items() if kind not in (MAIN, SIDE_BY_SIDE)}
    if SIDE_BY_SIDE in latest:
        current[SIDE_BY_SIDE] = [(latest[SIDE_BY_SIDE], {})]
    if main_runs:
        figures: dict[str, tuple[Path, dict]] = {}
        for path, results in main_runs:
            for target in results.get("targets") or evaluate_targets(results):
                if target["verdict"] != "n/a":
                    figures[target["target"]] = (path, target)
        by_run: dict[Path, list[dict]] = {}
        for path, target in figures.values():
            by_run.setdefault(path, []).append(target)
        runs = dict(main_runs)
        current[MAIN] = [(path, runs[path] | {"targets": by_run[path]}) for path in sorted(by_run)]
    return current


def stale_results(folder: Path) -> list[Path]:
    """The results of `folder` that are no kind's current one."""
    kept = {path for runs in current_results(folder).values() for path, _ in runs}
    return [path for path in results_in(folder) if path not in kept]


def render_table(folder: Path) -> str:
    """bench/results/README.md: the current figures, a row each, naming the run they come from."""
    lines = [
        "# Benchmark results",
        "",
        "The latest run of each bench; older runs are in git history. Written by",
        "`python -m bench.results_table` from the files here (do not edit by hand). Each figure is",
        "as measured on the machine its file describes (`machine`, `notes`): compare runs of one",
        "sitting, not figures across rows.",
        "",
        "| bench | figure | measured | verdict | run |",
        "|---|---|---|---|---|",
    ]
    for kind, runs in sorted(current_results(folder).items()):
        for path, results in runs:
            for figure, measured, verdict in _figures(kind, path, results):
                cells = [kind, figure, measured, verdict, f"[{path.name}]({path.name})"]
                lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _figures(kind: str, path: Path, results: dict) -> list[tuple[str, str, str]]:
    """(figure, measured, verdict) rows of one result, whatever its bench's shape."""
    if kind == SIDE_BY_SIDE:
        return _side_by_side(path)
    if targets := results.get("targets"):
        rows = []
        for target in targets:
            if "figure" in target:  # bench.fleet: a value and its bound
                bound = "" if target["target"] is None else f" (target {target['target']:g})"
                rows.append((target["figure"] + bound, target["shown"], target["verdict"]))
            else:
                figure = f"{target['run']}: {target['target']}" if "run" in target else target["target"]
                rows.append((figure, target["measured"], target["verdict"]))
        return rows
    if kind == "disaggregated":
        rounds: dict[str, list[str]] = {}
        for row in results["rows"]:
            for shape in ("whole_answer", "streamed"):
                figure = f"{row['setting']}, {shape.replace('_', ' ')}: CPU per request (each round)"
                rounds.setdefault(figure, []).append(f"{row[shape]['cpu_us_per_request']:.0f}")
        return [(figure, " / ".join(values) + " us", "") for figure, values in rounds.items()]
    if kind == "load-scrape":
        return [
            (f"control plane, {run['nodes']} nodes, load scraped every 1 s", _with_without(run["medians"]), "")
            for run in results["control_plane"]
        ] + [
            (f"parse of a /metrics body, {run['engines']} engine(s)", f"{run['microseconds']} us", "")
            for run in results["parse"]
        ]
    return [("(no figures this table knows how to show)", "see the file", "")]


def _side_by_side(folder: Path) -> list[tuple[str, str, str]]:
    """The table of a side-by-side folder's README.md: a row per figure, each column a tree."""
    table = [line for line in (folder / README).read_text().splitlines() if line.startswith("|")]
    if len(table) < 3:
        return [("side by side", f"see {folder.name}/{README}", "")]
    header, *rows = ([cell.strip() for cell in line.strip("|").split("|")] for line in table)
    return [
        (f"{row[0]} ({header[0]})", "; ".join(f"{name}: {cell}" for name, cell in zip(header[1:], row[1:])), "")
        for row in rows[1:]  # rows[0] is the |---| line
    ]


def _with_without(medians: dict) -> str:
    without, with_ = medians["without"], medians["with"]
    return f"{with_['core_percent']:.1f} % of a core (without: {without['core_percent']:.1f} %)"


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def prune(folder: Path) -> list[Path]:
    """Delete the results that are no kind's current one; the deleted paths."""
    stale = stale_results(folder)
    for path in stale:
        if path.is_dir():
            for inner in path.iterdir():
                inner.unlink()
            path.rmdir()
        else:
            path.unlink()
    return stale


def write_table(folder: Path) -> Path:
    path = folder / README
    path.write_text(render_table(folder))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=RESULTS_FOLDER, help="the results folder (default bench/results)")
    parser.add_argument("--prune", action="store_true", help="delete the runs that are not current (git keeps them)")
    args = parser.parse_args(argv)
    if args.prune:
        for path in prune(args.folder):
            print(f"deleted {path}")
    print(f"wrote {write_table(args.folder)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
