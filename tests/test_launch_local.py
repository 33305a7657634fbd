"""Launchers without a cluster: the interface, the config, the address exchange of the ray launcher (no Ray)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.config import ConfigError, load_config
from gyre.launch import make_launcher
from gyre.launch.base import cell_configs
from gyre.launch.local import LocalLauncher

ROOT = Path(__file__).resolve().parents[1]


def test_local_is_the_default_and_needs_no_ray_nor_torch():
    """The controller of a local run imports neither Ray nor torch nor transformers: its cells do (forked from the
    zygote), and a torch import in the controller cost every `gyre run` ~2.5 s of CPU before its zygote started."""
    code = (
        "import sys; from gyre.config import load_config; from gyre.launch import make_launcher;"
        "from gyre import cli; from gyre.run import pipeline, controller, resume; from gyre.observe import report;"
        "l = make_launcher(load_config(None));"
        "print(l.kind, *sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'torch', 'transformers'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["local"]


def test_ray_kind_from_config_and_cli_flag(tmp_path):
    cfg = load_config(None, {"launcher.kind": "ray", "launcher.address": "10.0.0.1:6379"})
    launcher = make_launcher(cfg, tmp_path)
    assert (launcher.kind, launcher.launcher.address, launcher.run_dir) == ("ray", "10.0.0.1:6379", tmp_path)
    from gyre.cli import _parser, _resolve

    args = _parser().parse_args(["run", str(ROOT / "configs" / "demo.toml"), "--ray", "auto"])
    assert (_resolve(args).launcher.kind, _resolve(args).launcher.address) == ("ray", "auto")
    args = _parser().parse_args(["demo", "--ray", "local"])
    assert (_resolve(args).launcher.kind, _resolve(args).launcher.address) == ("ray", None)
    assert isinstance(make_launcher(load_config(None), tmp_path), LocalLauncher)
    with pytest.raises(ConfigError, match=r"launcher\.kind"):
        load_config(None, {"launcher.kind": "slurm"})
    # Placing a service is Ray's: on the local launcher it is one line naming the field, not a silent no-op.
    with pytest.raises(ConfigError, match=r"eval_resources places a process on a Ray cluster"):
        load_config(None, {"launcher.eval_resources": {"node_b": 1}})
    with pytest.raises(ConfigError, match=r"controller_resources places a process on a Ray cluster"):
        load_config(None, {"launcher.controller_resources": {}})
    args = _parser().parse_args(["demo", "--ray", "local", "--set", 'launcher.proxy_resources={"node_b":1}'])
    assert _resolve(args).launcher.proxy_resources == {"node_b": 1.0}


def test_a_placed_controller_never_writes_into_a_finished_run(tmp_path, capsys):
    """With `controller_resources`, the run directory is checked before anything is placed or written there."""
    from gyre.cli import main

    (tmp_path / "trace.jsonl").write_text("{}\n")
    code = main(
        ["demo", "--ray", "local", "--run-dir", str(tmp_path), "--set", "launcher.controller_resources={}"]
    )
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"gyre demo: {tmp_path} already holds a run (trace.jsonl); choose another --run-dir"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.jsonl"]
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_a_local_run_refused_at_launch_leaves_no_zygote_behind(tmp_path, capsys):
    """`gyre run` starts the cells' zygote before the run directory is checked; a refused run ends it too."""
    from gyre.cli import main

    (tmp_path / "trace.jsonl").write_text("{}\n")
    assert main(["demo", "--run-dir", str(tmp_path)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _child_of_this(p, b"gyre_cell.zygote")]
    assert left == []


def _child_of_this(proc: Path, needle: bytes) -> bool:
    import os

    try:
        ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        return ppid == os.getpid() and needle in (proc / "cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return False


def test_ray_placement_binds_each_worker_to_its_node_and_the_rendezvous_to_the_core(tmp_path):
    from gyre.launch.ray import place

    cfg = load_config(
        None, {"cluster.cells": 2, "cluster.standalone_engines": 1, "cluster.standalone_capacity": 2}
    )
    configs = cell_configs(cfg, tmp_path, tmp_path / "model")
    assert all(c.host == "127.0.0.1" and c.mooncake.local_hostname == "127.0.0.1" for c in configs)
    nodes = [
        {"ip": "10.77.0.1", "ports": [41001, 41002, 41003, 41004]},
        {"ip": "10.77.0.2", "ports": [42001, 42002, 42003, 42004]},
        {"ip": "10.77.0.2", "ports": [43001, 43002, 43003, 43004]},
    ]
    placed = place(configs, nodes)
    assert [(c.kind, c.cell, c.host, c.port, c.mooncake.local_hostname) for c in placed] == [
        ("elastic", 0, "10.77.0.1", 41001, "10.77.0.1"),
        ("elastic", 1, "10.77.0.2", 42001, "10.77.0.2"),
        ("standalone", 0, "10.77.0.2", 43001, "10.77.0.2"),
    ]
    # KV migration's transfer engine too: a destination on another node reads pinned blocks at this address
    assert [c.engine.kv_transfer.local_hostname for c in placed] == ["10.77.0.1", "10.77.0.2", "10.77.0.2"]
    # Every elastic cell meets at the core's node: gloo master and coordinator ports chosen there.
    assert {
        (c.training.master_host, c.training.master_port, c.training.coordinator_port) for c in placed[:2]
    } == {("10.77.0.1", 41002, 41003)}
    assert placed[2].training is None
    # Nothing else changes between launchers.
    strip = {"host": True, "port": True, "mooncake": True, "training": True, "engine": {"kv_transfer"}}
    assert [c.model_dump(exclude=strip) for c in placed] == [c.model_dump(exclude=strip) for c in configs]
    assert all(c.sglang is None for c in placed)  # the torch engine: no server to place


def test_sglang_servers_get_their_own_ports_and_bind_their_workers_node(tmp_path):
    """`[rollout] engine = "sglang"`: each worker's server gets a port drawn with every other (distinct), the run's
    policy, seed and settings; the ray placement binds it to the worker's node, on that node's fourth free port."""
    from gyre.launch.ray import place

    cfg = load_config(
        None,
        {
            "cluster.cells": 2,
            "cluster.standalone_engines": 1,
            "cluster.standalone_capacity": 2,
            "rollout.engine": "sglang",
            "rollout.sglang.tp_size": 2,
            "rollout.sglang.mem_fraction_static": 0.6,
        },
    )
    configs = cell_configs(cfg, tmp_path, tmp_path / "model")
    ports = [c.port for c in configs] + [c.sglang.port for c in configs]
    ports += [configs[0].training.master_port, configs[0].training.coordinator_port]
    assert len(set(ports)) == len(ports) == 8
    assert {
        (
            c.sglang.model_path,
            c.sglang.host,
            c.sglang.tp_size,
            c.sglang.mem_fraction_static,
            c.sglang.weight_version,
            c.sglang.module,
        )
        for c in configs
    } == {(str(tmp_path / "model"), "127.0.0.1", 2, 0.6, "0", "sglang.launch_server")}
    assert [c.sglang.random_seed for c in configs] == [0, 1, 2]
    nodes = [
        {"ip": f"10.77.0.{i}", "ports": [41001 + 10 * i, 41002 + 10 * i, 41003 + 10 * i, 41004 + 10 * i]}
        for i in range(3)
    ]
    placed = place(configs, nodes)
    assert [(c.sglang.host, c.sglang.port) for c in placed] == [
        ("10.77.0.0", 41004),
        ("10.77.0.1", 41014),
        ("10.77.0.2", 41024),
    ]


def test_ray_bundles_per_cell(tmp_path):
    from gyre.launch.ray import RayLauncher

    cfg = load_config(
        None,
        {
            "launcher.kind": "ray",
            "launcher.gpus_per_cell": 8,
            "launcher.cell_resources": [{"node_a": 1}, {"node_b": 1}],
        },
    )
    launcher = RayLauncher(tmp_path, launcher=cfg.launcher)
    cells = cell_configs(cfg, tmp_path, tmp_path / "model")
    one, two = (cells[0].model_copy(update={"cpu_threads": n}) for n in (1, 2))
    assert launcher._bundles(0, one) == [{"CPU": 1.0, "GPU": 8, "node_a": 1}]
    assert launcher._bundles(1, two) == [{"CPU": 2.0, "GPU": 8, "node_b": 1}]
    assert launcher._bundles(2, one) == [{"CPU": 1.0, "GPU": 8}]
    assert cells[0].kind == "elastic"


def test_a_cell_spread_over_bundles(tmp_path):
    """`bundles_per_cell`: a Megatron cell's placement group has n bundles sharing its GPUs, the worker's bundle
    pinned by `cell_resources`; a standalone engine keeps one. Refused where no ranks could fill them."""
    from gyre.launch.ray import RayLauncher

    sets = {
        "launcher.kind": "ray",
        "launcher.gpus_per_cell": 8,
        "launcher.bundles_per_cell": 2,
        "launcher.cell_resources": [{"node_a": 1}],
        "train.backend": "megatron",
        "train.pipeline_parallel": 2,
        "train.lr_warmup_steps": 0,
        "cluster.standalone_engines": 1,
        "cluster.standalone_capacity": 2,
    }
    cfg = load_config(None, sets)
    launcher = RayLauncher(tmp_path, launcher=cfg.launcher)
    configs = cell_configs(cfg, tmp_path, tmp_path / "model")
    cell, standalone = configs[0], configs[2]
    assert (cell.kind, standalone.kind) == ("elastic", "standalone")
    assert launcher._bundles(0, cell) == [{"CPU": 1.0, "GPU": 4.0, "node_a": 1}, {"CPU": 1.0, "GPU": 4.0}]
    assert launcher._bundles(2, standalone) == [{"CPU": 1.0, "GPU": 8}]
    for bad, field in [
        ({"launcher.kind": "local"}, "needs kind = 'ray'"),
        ({"train.pipeline_parallel": 1}, "it has 1 (train.backend = 'megatron'"),
        ({"train.backend": "torch", "train.pipeline_parallel": 1}, "train.backend = 'torch'"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(field)):
            load_config(None, {**sets, **bad})


def test_the_lr_warmup_reaches_every_training_cell_and_megatron_refuses_it(tmp_path):
    cfg = load_config(None, {"train.lr_warmup_steps": 6})
    configs = cell_configs(cfg, tmp_path, tmp_path / "model")
    assert [c.training.lr_warmup_steps for c in configs if c.training is not None] == [6, 6]
    with pytest.raises(ConfigError, match=r"train\.lr_warmup_steps = 6: the megatron backend"):
        load_config(None, {"train.lr_warmup_steps": 6, "train.backend": "megatron"})


def test_the_local_launcher_gives_each_worker_its_own_gpus(tmp_path, monkeypatch):
    """`cluster.device = "cuda"`: whole GPUs in order (cells, then standalone engines) from this process's
    CUDA_VISIBLE_DEVICES; engine and trainer on CUDA; Ray sets its actors' own, so the configs name none there."""
    over = {
        "cluster.device": "cuda",
        "launcher.gpus_per_cell": 2,
        "cluster.standalone_engines": 1,
        "cluster.standalone_capacity": 2,
    }
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4, 5,6,GPU-7a,9")
    configs = cell_configs(load_config(None, over), tmp_path, tmp_path / "model")
    assert [c.visible_gpus for c in configs] == [["3", "4"], ["5", "6"], ["GPU-7a", "9"]]
    assert [c.engine.device for c in configs] == ["cuda"] * 3
    assert [c.training.device for c in configs if c.training is not None] == ["cuda", "cuda"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    configs = cell_configs(load_config(None, over), tmp_path, tmp_path / "model")
    assert [c.visible_gpus for c in configs] == [["0", "1"], ["2", "3"], ["4", "5"]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(ConfigError, match=r"needs 6 GPUs; CUDA_VISIBLE_DEVICES lists 3 \('0,1,2'\)"):
        cell_configs(load_config(None, over), tmp_path, tmp_path / "model")
    ray = cell_configs(load_config(None, {**over, "launcher.kind": "ray"}), tmp_path, tmp_path / "model")
    assert [c.visible_gpus for c in ray] == [None] * 3 and ray[0].engine.device == "cuda"
    default = cell_configs(load_config(None), tmp_path, tmp_path / "model")  # CPU: nothing handed out
    assert {(c.visible_gpus, c.engine.device, c.training.device) for c in default} == {(None, "cpu", "cpu")}
    # SGLang servers inherit their worker's GPUs whatever the torch device: gpus_per_cell alone hands them out
    sglang = cell_configs(
        load_config(None, {"rollout.engine": "sglang", "launcher.gpus_per_cell": 1}),
        tmp_path,
        tmp_path / "model",
    )
    assert [c.visible_gpus for c in sglang] == [["0"], ["1"]] and sglang[0].engine.device == "cpu"
    # A share: two workers in a row on one GPU (a one-GPU machine runs the K=2 demo on CUDA)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")
    shared = cell_configs(
        load_config(None, {**over, "launcher.gpus_per_cell": 0.5}), tmp_path, tmp_path / "m"
    )
    assert [c.visible_gpus for c in shared] == [["5"], ["5"], ["6"]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    with pytest.raises(ConfigError, match=r"gpus_per_cell = 0.5 for 3 worker\(s\) needs 2 GPUs"):
        cell_configs(load_config(None, {**over, "launcher.gpus_per_cell": 0.5}), tmp_path, tmp_path / "m")


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"cluster.device": "cuda"}, "cluster.device = 'cuda' needs launcher.gpus_per_cell > 0"),
        (
            {"launcher.gpus_per_cell": 1.5},
            "launcher.gpus_per_cell = 1.5: the local launcher hands out whole GPUs",
        ),
        ({"launcher.gpus_per_cell": 0.3}, "equal shares of one (1/2, 1/3, ...)"),
        ({"cluster.device": "tpu"}, "cluster.device"),
    ],
)
def test_gpu_settings_that_cannot_work_are_config_errors(override, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, override)


def test_ray_may_share_a_gpu_between_cells():
    cfg = load_config(None, {"launcher.kind": "ray", "launcher.gpus_per_cell": 0.5, "cluster.device": "cuda"})
    assert (cfg.launcher.gpus_per_cell, cfg.cluster.device) == (0.5, "cuda")
