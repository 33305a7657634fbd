"""Group commit: appends that wait together share one fsync, nobody is released before it, and an acknowledged
record survives a lost log (journal replay) and a kill -9 of a real proxy under concurrent load."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import orjson
import pytest

from gyre_tito import commit
from gyre_tito.commit import JOURNAL_NAME, replay_journal
from gyre_tito.records import RecordLogConfig, RecordStore, read_log
from gyre_tito.testing.synthetic import make_record

GROUP = RecordLogConfig(fsync=True, group_commit=True)


class _GatedSync:
    """Replaces os.fdatasync in commit.py: the first sync blocks until `release` is set, so the appends submitted
    meanwhile queue up behind it (no timing involved)."""

    def __init__(self, fail: bool = False) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0
        self.fail = fail

    def __call__(self, fd: int) -> None:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            self.release.wait()
        if self.fail:
            raise OSError(28, "No space left on device")
        os.fsync(fd)


def _rec(eid: str, k: int, seq: int = 0):
    return make_record(
        execution_id=eid, call_id=f"{eid}/c{k}", seq=seq, input_ids=[1, 2, k], output_ids=[k, 7]
    )


def test_appends_waiting_together_share_one_fsync_and_none_returns_before_it(tmp_path, monkeypatch):
    gate = _GatedSync()
    monkeypatch.setattr(commit.os, "fdatasync", gate)
    store = RecordStore(tmp_path, GROUP)
    logs = [store.open(f"ex{i}") for i in range(9)]
    first = store.committer.submit(logs[0], _rec("ex0", 0))
    assert gate.entered.wait(30)  # the committer is inside the first batch's sync
    rest = [store.committer.submit(r, _rec(r.execution_id, 0)) for r in logs[1:]]
    # nothing acknowledged before its sync returns
    assert not first.done() and not any(f.done() for f in rest)
    assert len(logs[0].tree) == 0  # nor visible in the tree
    gate.release.set()
    assert [f.result(30).call_id for f in [first, *rest]] == [f"ex{i}/c0" for i in range(9)]
    assert gate.calls == 2 and store.committer.stats == {
        "batches": 2,
        "records": 9,
        "fsyncs": 2,
        "checkpoints": 0,
    }
    assert all(len(r.tree) == 1 for r in logs)
    store.close()  # a clean close checkpoints: the logs are synced and the journal is empty
    assert (tmp_path / JOURNAL_NAME).stat().st_size == 0
    assert [len(read_log(store.path(f"ex{i}")).records) for i in range(9)] == [1] * 9


def test_two_appends_of_one_log_in_a_batch_get_consecutive_seqs(tmp_path, monkeypatch):
    gate = _GatedSync()
    monkeypatch.setattr(commit.os, "fdatasync", gate)
    store = RecordStore(tmp_path, GROUP)
    a, b = store.open("a"), store.open("b")
    blocker = store.committer.submit(b, _rec("b", 0))
    assert gate.entered.wait(30)
    futs = [store.committer.submit(a, _rec("a", k)) for k in range(3)]  # all claim seq 0
    gate.release.set()
    assert [f.result(30).seq for f in futs] == [0, 1, 2] and blocker.result(30).seq == 0
    store.close()
    assert [r.seq for r in read_log(store.path("a")).records] == [0, 1, 2]


def test_a_failed_sync_fails_the_batch_and_leaves_the_logs_clean(tmp_path, monkeypatch):
    gate = _GatedSync(fail=True)
    gate.release.set()
    monkeypatch.setattr(commit.os, "fdatasync", gate)
    store = RecordStore(tmp_path, GROUP)
    log_a = store.open("a")
    with pytest.raises(OSError, match="No space"):
        store.committer.submit(log_a, _rec("a", 0)).result(30)
    assert len(log_a.tree) == 0 and store.path("a").stat().st_size == 0
    gate.fail = False
    assert store.committer.submit(log_a, _rec("a", 1)).result(30).seq == 0
    store.close()
    assert [r.call_id for r in read_log(store.path("a")).records] == ["a/c1"]


def test_replay_restores_acknowledged_records_a_log_lost(tmp_path):
    """An OS crash can lose a log's page cache but not the synced journal: the store puts the records back."""
    store = RecordStore(tmp_path, GROUP)
    a = store.open("a")
    for k in range(3):
        store.committer.submit(a, _rec("a", k)).result(30)
    lines = store.path("a").read_bytes()
    journal = (tmp_path / JOURNAL_NAME).read_bytes()
    store.close()
    # the state an OS crash could leave: the journal as synced, the log missing its last two lines
    store.path("a").write_bytes(lines[: lines.index(b"\n") + 1])
    (tmp_path / JOURNAL_NAME).write_bytes(journal + b"a.tito.jsonl\t99\t{torn")  # an unsynced, torn entry
    assert replay_journal(tmp_path) == 2
    assert store.path("a").read_bytes() == lines
    assert (tmp_path / JOURNAL_NAME).stat().st_size == 0
    again = RecordStore(tmp_path, GROUP)
    assert [n.call_id for n in again.open("a").tree.nodes] == ["a/c0", "a/c1", "a/c2"]
    again.close()


def test_checkpoint_syncs_the_logs_and_empties_the_journal(tmp_path):
    store = RecordStore(tmp_path, GROUP)
    store.committer.checkpoint_bytes = 1  # every batch ends with a checkpoint
    a = store.open("a")
    store.committer.submit(a, _rec("a", 0)).result(30)
    store.committer.submit(a, _rec("a", 1)).result(30)  # its batch starts after the first batch's checkpoint
    assert store.committer.stats["checkpoints"] >= 1
    store.close()
    assert (tmp_path / JOURNAL_NAME).stat().st_size == 0


# ---- kill -9 of a real proxy under concurrent load -----------------------------------------------------------
CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>'
TOOLS = [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}]


async def _loop(
    url: str, cred: str, acked: list[str], stop: asyncio.Event, enough: asyncio.Event, k: int
) -> None:
    history: list[dict] = [{"role": "user", "content": "go"}]
    async with httpx.AsyncClient(timeout=120) as c:
        while not stop.is_set():
            try:
                r = await c.post(
                    url + "/v1/messages",
                    headers={"x-api-key": cred},
                    content=orjson.dumps(
                        {"model": "m", "max_tokens": 64, "tools": TOOLS, "messages": history}
                    ),
                )
            except httpx.HTTPError:
                return  # the proxy is gone
            if r.status_code != 200:
                return
            body = r.json()
            acked.append(body["id"])  # counted by the client, once it holds the whole reply
            if len(acked) >= k:
                enough.set()
            use = body["content"][0]
            history += [
                {"role": "assistant", "content": [use]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "ok"}],
                },
            ]


@pytest.mark.parametrize("group_commit", [True, False])
def test_kill_9_under_load_loses_no_acknowledged_record(tmp_path, group_commit):
    from gyre_tito.proxy import Proxy, ProxyConfig
    from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig
    from gyre_tito.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(tmp_path / "tok")
    eng = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok), default_reply=CALL))
    engine_url = eng.start()
    store = tmp_path / "store"
    token = tmp_path / "admin"
    token.write_text("adm\n")
    token.chmod(0o600)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)  # connections queue here until the proxy serves: no readiness polling
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    argv = [sys.executable, "-m", "gyre_tito.cli", "serve", "--engine", engine_url, "--tokenizer", str(tok)]
    argv += ["--store", str(store), "--listen-fd", str(sock.fileno()), "--admin-token-file", str(token)]
    proc = subprocess.Popen(
        [*argv, *([] if group_commit else ["--no-group-commit"])], pass_fds=(sock.fileno(),)
    )
    sock.close()
    executions, kill_after = 16, 60
    try:
        creds = []
        for i in range(executions):
            r = httpx.post(
                url + "/admin/executions",
                json={"execution_id": f"ex{i}"},
                headers={"Authorization": "Bearer adm"},
                timeout=120,
            )
            creds.append(r.json()["credential"])
        acked: list[str] = []

        async def run() -> None:
            stop, enough = asyncio.Event(), asyncio.Event()
            tasks = [asyncio.create_task(_loop(url, c, acked, stop, enough, kill_after)) for c in creds]
            waiter = asyncio.create_task(enough.wait())
            await asyncio.wait([waiter, asyncio.gather(*tasks)], return_when=asyncio.FIRST_COMPLETED)
            os.kill(proc.pid, signal.SIGKILL)  # replies other clients are still reading may be cut off
            stop.set()
            waiter.cancel()
            await asyncio.gather(*tasks)

        asyncio.run(run())
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        eng.stop()
    assert len(acked) >= kill_after
    on_disk = {
        rec.metadata["message_id"]
        for i in range(executions)
        for rec in read_log(store / "records" / f"ex{i}.tito.jsonl").records
    }
    assert set(acked) <= on_disk
    # and the restarted proxy loads every execution with those records in its tree
    proxy = Proxy(ProxyConfig(engines=[engine_url], tokenizer=str(tok), store=str(store)))
    assert not proxy.quarantined
    assert sum(proxy.calls(f"ex{i}") for i in range(executions)) >= len(acked)
    proxy.records.close()
