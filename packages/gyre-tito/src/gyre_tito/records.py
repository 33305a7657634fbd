"""Durable per-execution call-record logs (docs/design/tito.md#proxy, docs/design/tito.md#record-and-tree).

API summary
-----------
- ``RecordLog(path, config=RecordLogConfig())``: opens (creating) an append-only log. On open it reads what is there:
  a torn last record (partial line, or a last line whose checksum or JSON is bad) is dropped with a logged warning and
  cut off the file so later appends start clean; damage anywhere before the last line raises ``RecordLogCorrupt``
  (never skipped, never merged). ``log.records`` holds the records found at open (appended records are not kept in
  memory: the tree holds them compactly); ``log.append(record)`` writes one record and fsyncs before returning;
  ``log.dropped_bytes`` says how much torn tail was removed.
- ``read_log(path) -> LogContents(records, valid_bytes, torn_bytes)`` reads without modifying the file.
- ``ExecutionRecords(directory, execution_id, config)``: the log and the ``ExecutionTree`` of one execution kept in
  step; ``append(record)`` assigns ``seq``, checks the record against the tree, makes it durable, then adds it to the
  tree (thread-safe). Reopening rebuilds the identical tree from the log.
- ``RecordStore(directory, config)``: one ``ExecutionRecords`` per execution id under a directory (``open(id)``,
  ``release(id)`` (close it and forget it), ``execution_ids()``, ``close()``). With ``group_commit`` (and fsync) on,
  ``await store.append(records, record)`` makes records that complete together durable with one shared fsync
  (``commit.py``: a journal ``_commit.wal`` next to the logs, replayed when the store opens).

File format (one file per execution, ``<quoted execution id>.tito.jsonl``): plain JSON Lines, readable by any JSONL
tool (``pandas.read_json(path, lines=True)``, ``jq``): each line is the CallRecord JSON with one more last key,
``"crc32": "<8 lowercase hex digits>"``, the CRC-32 of the line without that key (the record JSON as written, i.e.
the line with ``,"crc32":"........"`` removed). Logs written before (``<crc32 hex> <CallRecord JSON>`` per line) are
still read; an old log keeps its format when appended to.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

import orjson
import pydantic

from gyre_tito.commit import GroupCommit, fsync_dir
from gyre_tito.errors import RecordLogCorrupt
from gyre_tito.tree import ExecutionTree
from gyre_tito.types import CallRecord

__all__ = [
    "LOG_SUFFIX",
    "ExecutionRecords",
    "LogContents",
    "RecordLog",
    "RecordLogConfig",
    "RecordLogCorrupt",
    "RecordStore",
    "decode_line",
    "encode_line",
    "is_legacy_line",
    "log_path",
    "read_log",
]

log = logging.getLogger(__name__)

LOG_SUFFIX = ".tito.jsonl"


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordLogConfig:
    fsync: bool = True
    """fsync after every append (and the directory on create); turn off only for benchmarks and throwaway runs."""
    group_commit: bool = False
    """``RecordStore.append`` shares one fsync among the appends waiting at the same moment (``commit.py``)."""


@dataclass(frozen=True, slots=True)
class LogContents:
    records: list[CallRecord]
    valid_bytes: int
    """length of the intact prefix of the file"""
    torn_bytes: int
    """bytes after the intact prefix that belong to a torn last record (0 if none)"""


_CRC_KEY = b',"crc32":"'
_CRC_TAIL = len(_CRC_KEY) + 8 + 2  # ,"crc32":"xxxxxxxx"}


def encode_line(record: CallRecord, legacy: bool = False) -> bytes:
    """One log line: the record's JSON with its CRC-32 as a last ``crc32`` key (``legacy``: the old
    ``<crc32 hex> <JSON>`` form, for appending to a log written that way)."""
    body = record.model_dump_json().encode()
    if legacy:
        return b"%08x " % zlib.crc32(body) + body + b"\n"
    return body[:-1] + _CRC_KEY + b"%08x" % zlib.crc32(body) + b'"}\n'


def is_legacy_line(line: bytes) -> bool:
    return len(line) >= 10 and line[8:9] == b" " and not line.startswith(b"{")


def decode_line(line: bytes) -> CallRecord | None:
    """The record of one complete line (without newline), or None if its checksum/JSON is bad."""
    if line.startswith(b"{"):
        if len(line) < _CRC_TAIL + 2 or line[-_CRC_TAIL : -_CRC_TAIL + len(_CRC_KEY)] != _CRC_KEY:
            return None
        body = line[:-_CRC_TAIL] + b"}"
        crc_hex = line[-10:-2]
    elif is_legacy_line(line):
        body, crc_hex = line[9:], line[:8]
    else:
        return None
    try:
        crc = int(crc_hex, 16)
    except ValueError:
        return None
    if zlib.crc32(body) != crc:
        return None
    try:
        return CallRecord.model_validate(orjson.loads(body))
    except (orjson.JSONDecodeError, pydantic.ValidationError):
        return None


def read_log(path: str | os.PathLike[str]) -> LogContents:
    """Read a record log; a torn last record is reported in ``torn_bytes``; earlier damage raises."""
    data = Path(path).read_bytes()
    records: list[CallRecord] = []
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:  # a partial last line: the append never completed
            break
        record = decode_line(data[pos:nl])
        if record is None:
            if data[nl + 1 :].strip(b"\x00 \n"):
                raise RecordLogCorrupt(f"{path}: damaged record at byte {pos} followed by more records")
            break  # the last line is damaged: a torn write
        records.append(record)
        pos = nl + 1
    return LogContents(records, pos, len(data) - pos)


class RecordLog:
    """Append-only durable log of ``CallRecord``s (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], config: RecordLogConfig | None = None) -> None:
        self.path = Path(path)
        self.config = config or RecordLogConfig()
        created = not self.path.exists()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        if created and self.config.fsync:
            fsync_dir(self.path.parent)
        contents = read_log(self.path)
        self.records: list[CallRecord] = contents.records
        self.dropped_bytes = contents.torn_bytes
        self._size = contents.valid_bytes  # end of the intact prefix
        self._legacy = False  # a log written in the old "<crc> <json>" form keeps that form
        self._unsynced = False  # group commit wrote lines that only the journal holds durably
        if contents.valid_bytes:
            with open(self.path, "rb") as f:
                self._legacy = is_legacy_line(f.readline())
        if contents.torn_bytes:
            log.warning(
                "%s: dropped a torn last record (%d bytes after %d intact records)",
                self.path,
                contents.torn_bytes,
                len(contents.records),
            )
            os.ftruncate(self._fd, contents.valid_bytes)
            os.fsync(self._fd)

    def write(self, data: bytes) -> int:
        """Write one encoded line without syncing (group commit syncs the journal instead); returns its offset.
        A failed write is cut off again."""
        if self._fd < 0:
            raise ValueError(f"{self.path}: log is closed")
        offset = self._size
        try:
            line = memoryview(data)
            while line:
                line = line[os.write(self._fd, line) :]
        except BaseException:
            self.rollback(offset)
            raise
        self._size += len(data)
        self._unsynced = True
        return offset

    def rollback(self, offset: int) -> None:
        """Cut the log back to ``offset`` (a write whose batch failed to become durable)."""
        try:
            os.ftruncate(self._fd, offset)
            self._size = offset
        except OSError:
            log.exception("%s: could not cut off a failed append; the next open drops it as torn", self.path)

    def sync(self) -> None:
        """fsync what `write` left unsynced (the journal held it durable until now)."""
        if self._fd >= 0 and self._unsynced:
            os.fsync(self._fd)
            self._unsynced = False

    def append(self, record: CallRecord) -> None:
        """Write ``record``; when this returns (with fsync on) the record survives a crash."""
        offset = self.write(encode_line(record, legacy=self._legacy))
        if self.config.fsync:
            try:
                os.fsync(self._fd)
            except BaseException:
                # A failed append (disk full, interrupted) must not leave a line that later appends would bury.
                self.rollback(offset)
                raise
            self._unsynced = False

    def close(self) -> None:
        if self._fd >= 0:
            if self.config.fsync:
                self.sync()  # a closed log is durable on its own: readers of ended executions need no journal
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> RecordLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def log_path(directory: str | os.PathLike[str], execution_id: str) -> Path:
    """Where the log of ``execution_id`` lives under ``directory`` (ids are percent-quoted into a file name)."""
    return Path(directory) / (quote(execution_id, safe="") + LOG_SUFFIX)


class ExecutionRecords:
    """One execution's durable log and trajectory tree, kept in step."""

    def __init__(
        self, directory: str | os.PathLike[str], execution_id: str, config: RecordLogConfig | None = None
    ) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.execution_id = execution_id
        self.log = RecordLog(log_path(directory, execution_id), config)
        self.tree = ExecutionTree.from_records(execution_id, self.log.records)
        self.log.records = []  # the tree now holds them (4 bytes a token instead of a Python int list)
        self._lock = threading.Lock()

    def match(self, context_ids) -> tuple[str | None, int]:
        return self.tree.match(context_ids)

    def append(self, record: CallRecord) -> CallRecord:
        """Assign ``seq``, validate against the tree, write durably, add to the tree; return the stored record."""
        with self._lock:
            if record.seq != len(self.tree):
                record = record.model_copy(update={"seq": len(self.tree)})
            self.tree.check(record)
            self.log.append(record)
            self.tree.add(record)
            return record

    def write_pending(self, record: CallRecord) -> tuple[CallRecord, bytes, int]:
        """Group commit, first half: assign ``seq``, check against the tree, write the line (not yet durable, not
        yet in the tree). Returns the record, its line and its offset in the log."""
        with self._lock:
            if record.seq != len(self.tree):
                record = record.model_copy(update={"seq": len(self.tree)})
            self.tree.check(record)
            line = encode_line(record, legacy=self.log._legacy)
            return record, line, self.log.write(line)

    def commit_pending(self, record: CallRecord) -> CallRecord:
        """Group commit, second half (the journal holding the line is synced): add the record to the tree."""
        with self._lock:
            self.tree.add(record)
            return record

    def rollback(self, offset: int) -> None:
        with self._lock:
            self.log.rollback(offset)

    def sync(self) -> None:
        with self._lock:
            self.log.sync()

    def close(self) -> None:
        with self._lock:
            self.log.close()


class RecordStore:
    """Record logs of many executions under one directory (``RUN/records/``)."""

    def __init__(self, directory: str | os.PathLike[str], config: RecordLogConfig | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config = config or RecordLogConfig()
        self._open: dict[str, ExecutionRecords] = {}
        self._lock = threading.Lock()
        self.committer: GroupCommit | None = None
        self._synced_appends = 0
        if self.config.fsync and self.config.group_commit:
            self.committer = GroupCommit(self.directory)  # replays the journal before any log is opened

    async def append(self, records: ExecutionRecords, record: CallRecord) -> CallRecord:
        """Append durably without holding a thread: through the group committer when there is one, else
        ``records.append`` (its own fsync) in a worker thread."""
        if self.committer is not None:
            return await self.committer.append(records, record)
        stored = await asyncio.to_thread(records.append, record)
        self._synced_appends += self.config.fsync
        return stored

    @property
    def fsyncs(self) -> int:
        """fsyncs that made appends through `append` durable (one per record without group commit)."""
        return self.committer.stats["fsyncs"] if self.committer is not None else self._synced_appends

    def open(self, execution_id: str) -> ExecutionRecords:
        with self._lock:
            if execution_id not in self._open:
                self._open[execution_id] = ExecutionRecords(self.directory, execution_id, self.config)
            return self._open[execution_id]

    def release(self, execution_id: str) -> None:
        """Close an execution's log and drop its tree from memory (reopen with ``open`` or read with ``read_log``)."""
        with self._lock:
            records = self._open.pop(execution_id, None)
        if records is not None:
            records.close()

    def path(self, execution_id: str) -> Path:
        return log_path(self.directory, execution_id)

    def execution_ids(self) -> list[str]:
        """Ids of every execution with a log in the directory (sorted)."""
        names = (p.name[: -len(LOG_SUFFIX)] for p in self.directory.glob("*" + LOG_SUFFIX))
        return sorted(unquote(n) for n in names)

    def close(self) -> None:
        if self.committer is not None:
            self.committer.close()  # commits what is queued; the logs are then synced as they close
        with self._lock:
            for records in self._open.values():
                records.close()
            self._open.clear()
