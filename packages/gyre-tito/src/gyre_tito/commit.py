"""Group commit of record appends: calls that complete together share one fsync, and none is acknowledged early.

Every execution has its own record log (`records.py`), so one fsync per call was one fsync per file: with 64
executions finishing at once that is 64 journal commits of the filesystem, each a few milliseconds, serialised behind
the default thread pool. Here one committer thread takes every append waiting at that moment, writes each record line
to its own log (page cache only), writes the same lines into one shared journal (``_commit.wal`` next to the logs) and
fdatasyncs the journal once. Only then are the records added to their trees and their callers released, so no reply
leaves before its record is durable, and a batch is as large as the calls that completed while the previous one was
being synced (the usual group commit: the busier the proxy, the fewer fsyncs per call).

Journal line: ``<log file name>\\t<byte offset in that log>\\t<record line>`` (the record line carries its own CRC-32;
JSON never holds a raw tab or newline). Recovery (`replay_journal`, run when a store opens, before any log is read):
each intact journal entry is put back at its offset in its log if the log lacks it (an OS crash lost the log's page
cache but not the synced journal), the touched logs are fsynced and the journal emptied. A torn last journal entry
belongs to a batch whose sync never returned, so nobody was told it was recorded. The journal is emptied the same way
(fsync of every log written since) once it exceeds `checkpoint_bytes`, and a log is fsynced when it is closed, so a
closed log is durable on its own (readers of ended executions never need the journal).

A process crash (kill -9) loses nothing either way: the log lines are in the page cache before the journal is written.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gyre_tito.types import CallRecord

if TYPE_CHECKING:
    from gyre_tito.records import ExecutionRecords

__all__ = ["JOURNAL_NAME", "GroupCommit", "fsync_dir", "replay_journal"]

log = logging.getLogger(__name__)

JOURNAL_NAME = "_commit.wal"  # not `*.tito.jsonl`: never listed as an execution's log


@dataclass(slots=True)
class _Entry:
    records: ExecutionRecords
    record: CallRecord
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(directory: Path) -> None:
    """Make a file creation in `directory` durable (the new name lives in the directory)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replay_journal(directory: str | os.PathLike[str]) -> int:
    """Put every intact journal entry back into its log where the log lacks it, fsync those logs, empty the journal.

    Returns how many entries had to be rewritten (0 after a clean shutdown or a process crash; only an OS crash or
    power loss can leave logs behind their journal)."""
    from gyre_tito.records import decode_line

    directory = Path(directory)
    path = directory / JOURNAL_NAME
    if not path.is_file() or path.stat().st_size == 0:
        return 0
    data = path.read_bytes()
    fixed = 0
    touched: dict[str, int] = {}
    try:
        pos = 0
        while (nl := data.find(b"\n", pos)) >= 0:
            entry, pos = data[pos : nl + 1], nl + 1
            name, _, rest = entry.partition(b"\t")
            offset_b, _, line = rest.partition(b"\t")
            if not offset_b.isdigit() or decode_line(line[:-1]) is None or b"/" in name:
                log.warning("%s: damaged entry at byte %d; the entries after it are skipped", path, pos)
                break  # torn: its batch was never synced, so never acknowledged
            target, offset = name.decode(), int(offset_b)
            if target not in touched:
                touched[target] = os.open(directory / target, os.O_RDWR | os.O_CREAT, 0o644)
            fd = touched[target]
            if os.pread(fd, len(line), offset) != line:
                if os.fstat(fd).st_size < offset:
                    log.error(
                        "%s: bytes before offset %d are missing; the log will read as damaged", target, offset
                    )
                os.pwrite(fd, line, offset)
                fixed += 1
        for fd in touched.values():
            os.fsync(fd)
        if fixed:
            log.warning("%s: restored %d acknowledged records into their logs", path, fixed)
    finally:
        for fd in touched.values():
            os.close(fd)
    with open(path, "r+b") as f:  # every entry is now durable in its own log
        f.truncate(0)
        os.fsync(f.fileno())
    return fixed


class GroupCommit:
    """The committer of one record store (see the module docstring). `submit` from any thread, or `await append`."""

    def __init__(self, directory: str | os.PathLike[str], checkpoint_bytes: int = 64 << 20) -> None:
        self.directory = Path(directory)
        self.checkpoint_bytes = checkpoint_bytes
        replay_journal(self.directory)  # before any log is opened and read
        self.path = self.directory / JOURNAL_NAME
        created = not self.path.exists()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if created:
            fsync_dir(self.directory)
        self._journal_bytes = os.fstat(self._fd).st_size
        self._queue: list[_Entry] = []
        self._cv = threading.Condition()
        self._closing = False
        self._dirty: dict[int, ExecutionRecords] = {}  # logs written since the journal was last emptied
        self.stats = {"batches": 0, "records": 0, "fsyncs": 0, "checkpoints": 0}
        self._thread = threading.Thread(target=self._run, name="gyre-tito-commit", daemon=True)
        self._thread.start()

    def submit(self, records: ExecutionRecords, record: CallRecord) -> concurrent.futures.Future:
        """Queue `record` for `records`; the future resolves to the stored record once it is durable and in the
        tree (or raises what the write or the tree check raised)."""
        entry = _Entry(records, record)
        with self._cv:
            if self._closing:
                raise ValueError("record store is closed")
            self._queue.append(entry)
            self._cv.notify()
        return entry.future

    async def append(self, records: ExecutionRecords, record: CallRecord) -> CallRecord:
        return await asyncio.wrap_future(self.submit(records, record))

    def _take(self) -> list[_Entry] | None:
        """The next batch: every queued append, but at most one per log (a second one for the same log waits for the
        next batch, so each record's seq is simply its tree's length and a failed write rolls back one line)."""
        with self._cv:
            while not self._queue and not self._closing:
                self._cv.wait()
            if not self._queue:
                return None
            batch: list[_Entry] = []
            rest: list[_Entry] = []
            seen: set[int] = set()
            for e in self._queue:
                (rest if id(e.records) in seen else batch).append(e)
                seen.add(id(e.records))
            self._queue = rest
            return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            try:
                self._commit(batch)
            except BaseException as e:  # never leave a caller waiting
                for entry in batch:
                    if not entry.future.done():
                        entry.future.set_exception(e)

    def _commit(self, batch: list[_Entry]) -> None:
        written: list[tuple[_Entry, CallRecord, int]] = []
        journal: list[bytes] = []
        for entry in batch:
            try:
                rec, line, offset = entry.records.write_pending(entry.record)
            except BaseException as e:  # this record does not fit its tree, or its log is closed
                entry.future.set_exception(e)
                continue
            written.append((entry, rec, offset))
            journal.append(entry.records.log.path.name.encode() + b"\t%d\t" % offset + line)
        if not written:
            return
        blob = b"".join(journal)
        try:
            _write_all(self._fd, blob)
            os.fdatasync(self._fd)
        except BaseException as e:
            # not durable: cut every line off again (nothing else writes these logs meanwhile) and fail the batch
            for entry, _rec, offset in reversed(written):
                entry.records.rollback(offset)
                entry.future.set_exception(e)
            try:
                os.ftruncate(self._fd, self._journal_bytes)
            except OSError:
                log.exception("%s: could not cut off a failed batch; replay skips it as torn", self.path)
            return
        self._journal_bytes += len(blob)
        self.stats["batches"] += 1
        self.stats["fsyncs"] += 1
        self.stats["records"] += len(written)
        for entry, rec, _offset in written:
            self._dirty[id(entry.records)] = entry.records
            entry.future.set_result(entry.records.commit_pending(rec))
        if self._journal_bytes > self.checkpoint_bytes:
            self.checkpoint()

    def checkpoint(self) -> None:
        """Make every log written since the last checkpoint durable on its own, then empty the journal (committer
        thread, or after `close`)."""
        for records in self._dirty.values():
            records.sync()
        self._dirty.clear()
        os.ftruncate(self._fd, 0)
        os.fsync(self._fd)
        self._journal_bytes = 0
        self.stats["checkpoints"] += 1

    def close(self) -> None:
        """Commit what is queued, stop the thread, then checkpoint (a clean shutdown leaves an empty journal)."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            self._cv.notify()
        self._thread.join()
        try:
            self.checkpoint()
        finally:
            os.close(self._fd)
