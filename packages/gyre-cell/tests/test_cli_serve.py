import subprocess
import sys
import time

import httpx
import pytest

from gyre_cell.cli import main


@pytest.mark.slow
def test_engine_serve_subprocess(tiny_model, port_factory):
    port = port_factory()
    cmd = [
        sys.executable,
        "-m",
        "gyre_cell.cli",
        "engine",
        "serve",
        "--model",
        str(tiny_model),
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        r = httpx.post(
            f"http://127.0.0.1:{port}/generate",
            timeout=30,
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}},
        )
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_serve_rejects_missing_model_dir(tmp_path, capsys):
    assert main(["engine", "serve", "--model", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
