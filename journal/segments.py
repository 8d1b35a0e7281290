"""The segments a JSON Lines log is made of.

A log named `var/events.jsonl` is the segments `var/events.000001.jsonl`,
`var/events.000002.jsonl`, … in order. A log written before it was segmented (one plain file)
is read too: a path that is a file is read as it is.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path


class LogFileError(Exception):
    """A log that cannot be read: a line that is neither a valid record nor a torn last line
    (the message starts with `file:line:`), or a log that does not exist."""


def segment_path(log_path: str | os.PathLike, number: int) -> Path:
    path = Path(log_path)
    return path.with_name(f"{path.stem}.{number:06d}{path.suffix}")


def segment_number(log_path: str | os.PathLike, segment: Path) -> int | None:
    """The number of `segment` if it is one of the log's segments, else None."""
    path = Path(log_path)
    pattern = re.escape(path.stem) + r"\.(\d{6,})" + re.escape(path.suffix)
    match = re.fullmatch(pattern, segment.name)
    return int(match.group(1)) if match else None


def list_segments(log_path: str | os.PathLike) -> list[Path]:
    """The existing segments of a log, oldest first."""
    path = Path(log_path)
    folder = path.parent
    if not folder.is_dir():
        return []
    numbered = [(number, folder / name) for name in os.listdir(folder) if (number := segment_number(path, Path(name)))]
    return [segment for _, segment in sorted(numbered)]


def expand_log_paths(paths: Iterable[str | os.PathLike], what: str = "event log") -> list[Path]:
    """Each argument is a segment (or any file), or a log's name standing for all of its segments;
    `what` names the kind of log in the error for neither."""
    expanded: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            expanded.append(path)
            continue
        segments = list_segments(path)
        if not segments:
            raise LogFileError(f"{path}: no such {what} or segment")
        expanded.extend(segments)
    return expanded
