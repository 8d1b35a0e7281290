"""The one way the gateway appends to its JSON Lines logs (the event log, the decision log).

`SegmentedFile` is the file side, synchronous (it runs in a worker thread): it holds the log's
lock, writes whole lines only into numbered segments (`events.jsonl` → `events.000001.jsonl`,
…: `journal/segments.py`, read back by `journal/reader.py`), and keeps the log readable
whatever the disk does:

- the lock (`flock` on `<log>.lock`, which names the holder's pid) is taken before the first
  byte is written, so a second gateway on the same log fails instead of writing into it;
- a write that fails or comes up short is cut back to the last whole line (a segment the write
  had just created is removed: a full disk makes no empty segments);
- a segment deleted or moved away (logrotate) is noticed at the next write, which starts a new
  segment;
- a new segment opens with a head line when the writer has one (the event log's checkpoint, so
  every segment can be replayed on its own), and retention (total size, age) removes the oldest
  segments whenever one is started.

`LogAppender` is the trio side: `submit` never blocks; lines are gathered for a moment and
written in batches from a worker thread. A failed batch is kept and written again later; a
failure is counted in a metric and logged once per streak (then `… write recovered`). When the
backlog is full the newest lines are dropped and counted, and the lines after such a gap start
a new segment, so every segment stays a run of consecutive lines.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import trio

from journal.segments import list_segments, segment_number, segment_path

BATCH_SECONDS = 0.1
"""How long the appender gathers lines before a write: a trip to the worker thread costs far
more than a small write."""

RETRY_SECONDS = 1.0
"""How soon a failed write is tried again when no new line comes to wake the appender."""


class Log(Protocol):
    """Where the appender says what happened to the file (the gateway's JSON log)."""

    def log(self, level: str, msg: str, **fields: object) -> None: ...


class Counter(Protocol):
    """A count the appender keeps (a Prometheus counter)."""

    def inc(self) -> None: ...


class LogInUse(OSError):
    """Another process holds the log's lock."""


def lock_path(log_path: str | os.PathLike) -> Path:
    path = Path(log_path)
    return path.with_name(path.name + ".lock")


@dataclass(frozen=True)
class Note:
    """Something the file side did that the log should say (the trio side logs it)."""

    level: str
    msg: str
    path: Path


class SegmentedFile:
    """A log's segments, written from one thread at a time (see the module docstring).

    `retain_bytes` bounds the total size of the segments, `retain_seconds` their age (by the
    time of their last write); 0 means no bound. The segment being written is never removed.
    """

    def __init__(
        self,
        log_path: str | os.PathLike,
        what: str,
        *,
        max_segment_bytes: int,
        retain_bytes: int = 0,
        retain_seconds: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_segment_bytes <= 0:
            raise ValueError("max_segment_bytes must be positive")
        self.log_path = Path(log_path)
        self.what = what
        self.max_segment_bytes = max_segment_bytes
        self.retain_bytes = retain_bytes
        self.retain_seconds = retain_seconds
        self._clock = clock
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._segment: Path | None = None
        self._size = 0
        self._next_number = 1

    @property
    def current_segment(self) -> Path | None:
        return self._segment

    def lock(self) -> None:
        """Take the log's lock unless held: LogInUse names the log and the holder's pid; any
        other OSError (an unwritable folder) is the disk's, and the next write tries again."""
        if self._lock_fd is not None:
            return
        path = lock_path(self.log_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LogInUse(
                errno.EAGAIN, f"{self.what} {self.log_path} is in use by another process (pid {holder})"
            ) from None
        except OSError:
            os.close(fd)
            raise
        try:  # the holder's pid, for the message above; the lock holds without it
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass
        self._lock_fd = fd

    def claim(self) -> None:
        """Take the lock at start-up, before anything is written: LogInUse propagates (the
        gateway must not start); any other error is left to the first write to report."""
        try:
            self.lock()
        except LogInUse:
            raise
        except OSError:
            pass

    def write(self, lines: bytes, head: Callable[[], bytes] | None = None, *, new_segment: bool = False) -> list[Note]:
        """Append whole lines; what the log should say about it. A new segment starts when none
        is open, when asked, when the current one is full or gone; it opens with `head()`.
        Raises OSError with nothing of `lines` left in the log."""
        notes: list[Note] = []
        self.lock()
        if self._segment is not None and self._segment_is_gone():
            notes.append(Note("warn", f"{self.what} segment deleted or moved; starting a new segment", self._segment))
            self.close_segment()
        full = self._size and self._size + len(lines) > self.max_segment_bytes
        if self._fd is None or new_segment or full:
            self._open_next_segment()
            if head is not None:
                lines = head() + lines
            notes += self._apply_retention()
        self._append(lines)
        return notes

    def check(self) -> list[Note]:
        """Close the segment if it was deleted or moved (SIGHUP, logrotate's signal): the next
        write starts a new one."""
        if self._segment is None or not self._segment_is_gone():
            return []
        segment = self._segment
        self.close_segment()
        return [Note("warn", f"{self.what} segment deleted or moved; the next write starts a new segment", segment)]

    def close_segment(self) -> None:
        if self._fd is not None:
            fd, self._fd, self._segment = self._fd, None, None
            os.close(fd)

    def close(self) -> None:
        """Close the segment and release the lock."""
        self.close_segment()
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)

    # --- inside a write ----------------------------------------------------------------------

    def _segment_is_gone(self) -> bool:
        try:
            on_disk = os.stat(self._segment)
        except FileNotFoundError:
            return True
        opened = os.fstat(self._fd)
        return (on_disk.st_ino, on_disk.st_dev) != (opened.st_ino, opened.st_dev)

    def _open_next_segment(self) -> None:
        self.close_segment()
        existing = list_segments(self.log_path)
        if existing:  # after the segments there are (even when the last ones were removed)
            self._next_number = max(self._next_number, segment_number(self.log_path, existing[-1]) + 1)
        path = segment_path(self.log_path, self._next_number)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self._segment = path
        self._size = 0
        self._next_number += 1

    def _append(self, data: bytes) -> None:
        """Write all of `data`, or nothing: a short or failed write is cut back to where it began."""
        view = memoryview(data)
        written = 0
        try:
            while written < len(data):
                written += os.write(self._fd, view[written:])
        except OSError:
            self._undo_append()
            raise
        self._size += len(data)

    def _undo_append(self) -> None:
        try:
            if self._size == 0:  # the segment this write created: remove it, never leave it empty
                segment = self._segment
                self.close_segment()
                os.unlink(segment)
                self._next_number -= 1
            else:
                os.ftruncate(self._fd, self._size)
        except OSError:
            # Cannot even cut back: leave the torn line last in its segment (readers skip a torn
            # last line) and start a new segment next time.
            self.close_segment()

    def _apply_retention(self) -> list[Note]:
        if not self.retain_bytes and not self.retain_seconds:
            return []
        notes: list[Note] = []
        older = [segment for segment in list_segments(self.log_path) if segment != self._segment]
        sizes = {}
        for segment in older:
            try:
                sizes[segment] = os.stat(segment)
            except FileNotFoundError:
                continue
        total = sum(stat.st_size for stat in sizes.values()) + self._size
        oldest_kept = self._clock() - self.retain_seconds
        for segment, stat in sizes.items():
            too_big = self.retain_bytes and total > self.retain_bytes
            too_old = self.retain_seconds and stat.st_mtime < oldest_kept
            if not (too_big or too_old):
                break
            try:
                os.unlink(segment)
            except FileNotFoundError:
                pass
            total -= stat.st_size
            notes.append(Note("info", f"{self.what} segment removed by retention", segment))
        return notes


def unwritable_log_reason(log_path: str | os.PathLike) -> str | None:
    """Why the gateway could not write a log at `log_path` (its folder is under a file, or not
    writable, or the path is a folder), else None. Creates nothing: the nearest folder that
    exists must be writable, so the missing ones can be created in it."""
    path = Path(log_path)
    if path.is_dir():
        return f"{path} is a directory"
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # exists() is False for a path under a file: that file stops the walk
    if not existing.is_dir():
        return f"cannot create its directory {path.parent}: {existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot create its files: {existing} is not writable"
    return None


@dataclass
class _Batch:
    """Consecutive lines to write; `base` is what the file's head is made of should they start
    a segment (the event log: the state before the first line)."""

    lines: list[bytes]
    base: Any
    new_segment: bool = False


class LogAppender:
    """Appends lines to a SegmentedFile in batches from a worker thread (module docstring).

    `head(base)` makes the first line of a new segment from the `base` given with the first line
    after it (b"" for none).
    """

    def __init__(
        self,
        file: SegmentedFile,
        *,
        log: Log,
        write_errors: Counter,
        dropped: Counter,
        backlog_limit: int,
        head: Callable[[Any], bytes] | None = None,
        batch_seconds: float = BATCH_SECONDS,
    ) -> None:
        self.file = file
        self._log = log
        self._write_errors = write_errors
        self._dropped = dropped
        self._backlog_limit = backlog_limit
        self._head = head
        self._batch_seconds = batch_seconds
        self._batches: list[_Batch] = []
        self._backlog = 0
        self._gap = False
        self._check_file = False
        self._failing = False
        self._wakeup = trio.Event()
        self._writing = trio.Lock()  # `aclose` may come while `run` writes: one write at a time

    def submit(self, line: bytes, base: Any = None) -> None:
        """Queue one encoded line; never blocks (a full backlog drops it, counted)."""
        if self._backlog >= self._backlog_limit:
            self._dropped.inc()
            self._gap = True
            return
        if self._gap or not self._batches:
            self._batches.append(_Batch([], base, new_segment=self._gap))
            self._gap = False
        self._batches[-1].lines.append(line)
        self._backlog += 1
        self._wakeup.set()

    def check_file(self) -> None:
        """Have the writer look at once whether its segment was deleted or moved (SIGHUP)."""
        self._check_file = True
        self._wakeup.set()

    async def run(self) -> None:
        while True:
            if self._failing:
                with trio.move_on_after(RETRY_SECONDS):
                    await self._wakeup.wait()
            else:
                await self._wakeup.wait()
            await trio.sleep(self._batch_seconds)
            self._wakeup = trio.Event()
            await self._write_pending()

    async def aclose(self) -> None:
        """Write what is pending (one more try) and release the file (once `run` is cancelled)."""
        await self._write_pending()
        await trio.to_thread.run_sync(self.file.close)

    async def _write_pending(self) -> None:
        async with self._writing:
            await self._write_pending_now()

    async def _write_pending_now(self) -> None:
        batches, self._batches = self._batches, []
        check, self._check_file = self._check_file, False
        if not batches and not check:
            return
        try:
            written, notes, error = await trio.to_thread.run_sync(self._write, batches, check)
        except trio.Cancelled:
            # Raised only before the thread starts (a started write is never abandoned).
            self._batches[:0] = batches
            self._check_file |= check
            raise
        self._batches[:0] = batches[written:]
        self._backlog -= sum(len(batch.lines) for batch in batches[:written])
        for note in notes:
            self._log.log(note.level, note.msg, path=str(note.path))
        what, path = self.file.what, str(self.file.log_path)
        if error is not None:
            self._write_errors.inc()
            if not self._failing:
                self._failing = True
                self._log.log("error", f"{what} write failed", path=path, error=str(error))
        elif self._failing and written:
            self._failing = False
            self._log.log("info", f"{what} write recovered", path=path)

    def _write(self, batches: list[_Batch], check: bool) -> tuple[int, list[Note], OSError | None]:
        """In the worker thread: how many batches were written, the notes, the error that
        stopped the others."""
        notes: list[Note] = []
        written = 0
        try:
            if check:
                notes += self.file.check()
            for written, batch in enumerate(batches):
                head = None if self._head is None else (lambda base=batch.base: self._head(base))
                notes += self.file.write(b"".join(batch.lines), head, new_segment=batch.new_segment)
        except OSError as error:
            return written, notes, error
        return len(batches), notes, None
