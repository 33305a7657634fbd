import json
import os
import socket
import subprocess
import sys
import time

import httpx

from gyre_tito.cli import main
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer


def test_serve_rejects_bad_arguments_with_a_message(tmp_path, capsys):
    assert main(["serve", "--tokenizer", str(tmp_path), "--store", str(tmp_path / "s")]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
    tok = build_tiny_tokenizer(tmp_path / "tok")
    assert (
        main(["serve", "--tokenizer", str(tok), "--store", str(tmp_path / "s"), "--engine", "localhost:1"])
        == 2
    )
    assert "must be an http(s) URL" in capsys.readouterr().err
    with open(tok / "tokenizer.json") as not_a_socket:  # --listen-fd names an inherited bound socket
        fd = str(not_a_socket.fileno())
        assert (
            main(["serve", "--tokenizer", str(tok), "--store", str(tmp_path / "s"), "--listen-fd", fd]) == 2
        )
    assert capsys.readouterr().err == f"gyre-tito serve: --listen-fd {fd}: Socket operation on non-socket\n"


def test_serve_writes_resolved_config_and_answers(tmp_path):
    tok = build_tiny_tokenizer(tmp_path / "tok")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = tmp_path / "store"
    key = tmp_path / "engine.key"
    key.write_text("engine-secret\n")
    key.chmod(0o600)
    r, w = os.pipe()  # the admin token travels over an inherited pipe: never argv, environment or a file
    os.write(w, b"secret\n")
    os.close(w)
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gyre_tito.cli",
            "serve",
            "--engine",
            "http://127.0.0.1:9",
            "--tokenizer",
            str(tok),
            "--store",
            str(store),
            "--port",
            str(port),
            "--admin-token-fd",
            str(r),
            "--engine-api-key-file",
            str(key),
            "--export-dir",
            str(tmp_path / "traj"),
        ],
        pass_fds=(r,),
    )
    os.close(r)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        cfg = json.loads((store / "config.json").read_text())
        assert cfg["engines"] == ["http://127.0.0.1:9"] and cfg["port"] == port and "admin_token" not in cfg
        assert "engine_api_key" not in cfg and "secret" not in (store / "config.json").read_text()
        with open(f"/proc/{p.pid}/cmdline", "rb") as f:
            assert b"secret" not in f.read()
        assert cfg["export_dirs"] == [str((tmp_path / "traj").resolve())]
        r = httpx.post(
            f"http://127.0.0.1:{port}/admin/executions", json={}, headers={"Authorization": "Bearer secret"}
        )
        assert r.status_code == 200 and r.json()["credential"].startswith("tito-")
    finally:
        p.terminate()
        p.wait(timeout=20)


def test_token_sources_refuse_world_readable_files_and_mixed_sources(tmp_path, capsys):
    """The serve command refuses a token source before it builds anything (the reader: gyre-sched's test_secret)."""
    tok = build_tiny_tokenizer(tmp_path / "tok")
    f = tmp_path / "t"
    f.write_text("x\n")
    f.chmod(0o644)
    args = ["serve", "--tokenizer", str(tok), "--store", str(tmp_path / "s"), "--admin-token-file", str(f)]
    assert main(args) == 2 and "readable by others" in capsys.readouterr().err
    f.chmod(0o600)
    r, w = os.pipe()
    os.close(w)
    try:
        assert main([*args, "--admin-token-fd", str(r)]) == 2
    finally:
        os.close(r)
    assert "give a token file or a token fd, not both" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # refused before the store was made
