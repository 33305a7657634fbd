"""The launch sandbox through an OCI container runtime (runc, crun, youki: anything with ``RUNTIME run --bundle``).

The same sandbox as the bubblewrap one, written as an OCI bundle: a ``config.json`` and an empty read-only root
into which the runtime mounts what the harness may see. The runtime, not Gyre, makes the namespaces (pid, network,
ipc, uts, mount, cgroup) and the execution's cgroup with its pids / memory / cpu limits (``linux.resources``); a
runtime that cannot apply a limit refuses to start the container, so what is asked is what holds.

Why a runtime at all: labs already trust their container runtime (and its seccomp and capability defaults), and it
is what their clusters run. The bundle holds no image: the host's ``/usr`` and the interpreter paths are bound
read-only, exactly as under bubblewrap, so a harness sees the same files either way.

The forwarder (the container's init) asks for SIGKILL when its parent, the runtime's ``run`` process, dies: killing
the runner's child (the timeout path, or a dead controller's PDEATHSIG) then ends the container's pid namespace and
everything in it. ``delete`` (``RUNTIME delete --force``) removes the container's state and cgroup afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

__all__ = ["OciBundle", "container_id", "give_to", "oci_resources", "sweep_oci"]

_NAMESPACES = ("pid", "network", "ipc", "uts", "mount", "cgroup")
_MASKED = (
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
)
_READ_ONLY = ("/proc/asound", "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")


def container_id(name: str) -> str:
    """A runtime-safe container id for execution `name`, unique per controller process (ids repeat across runs)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "-", name)[:80]
    return f"gyre-{os.getpid()}-{safe}"


def _bind(src: str, dst: str, *, ro: bool) -> dict:
    return {
        "destination": dst,
        "type": "bind",
        "source": src,
        "options": ["rbind", "nosuid", "nodev", "ro" if ro else "rw"],
    }


class OciBundle:
    """One execution's bundle: written by `write`, run by `argv`, removed (with the container) by `delete`."""

    def __init__(self, runtime: str, name: str) -> None:
        self.runtime, self.id = runtime, container_id(name)
        self.dir = Path(tempfile.mkdtemp(prefix=f"gyre-oci-{os.getpid()}-"))  # by pid: `sweep_oci`

    def write(
        self,
        *,
        process_args: Sequence[str],
        env: Mapping[str, str],
        cwd: Path,
        uid: int,
        ro_paths: Sequence[str],
        etc_files: Sequence[str],
        rw_paths: Sequence[Path],
        relay_dir: Path,
        mount_at: Mapping[str, str] | None = None,
        inner_socket_dir: str,
        resources: Mapping[str, object],
    ) -> None:
        """config.json and the empty root (with the host's /bin, /lib... links) of the container."""
        root = self.dir / "rootfs"
        root.mkdir()
        for link in ("bin", "lib", "lib32", "lib64", "sbin"):
            if os.path.islink(f"/{link}"):
                (root / link).symlink_to(os.readlink(f"/{link}"))
        mounts: list[dict] = [
            {
                "destination": "/proc",
                "type": "proc",
                "source": "proc",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
            },
            {
                "destination": "/dev/shm",
                "type": "tmpfs",
                "source": "shm",
                "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
            },
            {
                "destination": "/tmp",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "nodev", "mode=1777"],
            },
            {
                "destination": "/run",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "nodev", "mode=755"],
            },
            _bind("/usr", "/usr", ro=True),
        ]
        for link in ("bin", "lib", "lib32", "lib64", "sbin"):
            if os.path.isdir(f"/{link}") and not os.path.islink(f"/{link}"):
                mounts.append(_bind(f"/{link}", f"/{link}", ro=True))
        mounts += [_bind(p, p, ro=True) for p in etc_files if os.path.exists(p)]
        # Later mounts lie on top of earlier ones: /tmp's tmpfs first, then what the harness needs under it.
        mounts += [
            _bind(p, p, ro=True) for p in ro_paths if p not in ("/usr", "/") and not p.startswith("/usr/")
        ]
        at = mount_at or {}  # a read-write path mounted elsewhere inside (a task's workdir)
        mounts += [_bind(str(p), at.get(str(p), str(p)), ro=False) for p in rw_paths]
        mounts.append(_bind(str(relay_dir), inner_socket_dir, ro=False))
        config = {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": uid, "gid": uid},
                "args": list(process_args),
                "env": [f"{k}={v}" for k, v in env.items()],
                "cwd": str(cwd),
                "noNewPrivileges": True,
                "capabilities": {
                    k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")
                },
            },
            "root": {"path": "rootfs", "readonly": True},
            "hostname": "gyre-execution",
            "mounts": mounts,
            "linux": {
                "namespaces": [{"type": t} for t in _NAMESPACES],
                "resources": dict(resources),
                "cgroupsPath": f"/gyre/{self.id}",
                "maskedPaths": list(_MASKED),
                "readonlyPaths": list(_READ_ONLY),
            },
        }
        (self.dir / "config.json").write_text(json.dumps(config, indent=1))

    def argv(self) -> list[str]:
        return [self.runtime, "run", "--bundle", str(self.dir), self.id]

    def delete(self) -> None:
        """Kill what is left of the container, remove its state and cgroup, then the bundle (idempotent)."""
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run([self.runtime, "delete", "--force", self.id], capture_output=True, timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


def give_to(uid: int, *trees: Path) -> None:
    """Hand the execution's own folders to the sandbox's user: under an OCI runtime (no user namespace) the harness
    runs as `uid` on the host too, unlike bubblewrap's, which maps it back to the runner's user."""
    for tree in trees:
        os.chown(tree, uid, uid)
        for parent, dirs, files in os.walk(tree):
            for entry in dirs + files:
                os.chown(os.path.join(parent, entry), uid, uid, follow_symlinks=False)


def oci_resources(
    max_processes: int | None, memory_bytes: int | None, cpu_cores: float | None
) -> tuple[dict, dict]:
    """``linux.resources`` for the limits, and what `limits_applied` reports for them."""
    resources: dict[str, object] = {}
    applied: dict[str, str] = {}
    if max_processes:
        resources["pids"] = {"limit": max_processes}
        applied["pids"] = f"oci pids.limit={max_processes}"
    if memory_bytes:
        resources["memory"] = {"limit": memory_bytes}
        applied["memory"] = f"oci memory.limit={memory_bytes}"
    if cpu_cores:
        resources["cpu"] = {"quota": int(cpu_cores * 100000), "period": 100000}
        applied["cpu"] = f"oci cpu quota {cpu_cores} cores"
    return resources, applied


def sweep_oci(runtime: str, dead: Callable[[str], bool]) -> list[Path]:
    """The containers (``gyre-PID-...``) and bundles (``gyre-oci-PID-...``) of dead controllers (`dead` says of a
    ``PID-...`` name) go: the container's state and cgroup with ``delete --force``; returns the bundles removed."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        listed = subprocess.run([runtime, "list", "-q"], capture_output=True, text=True, timeout=30).stdout
        for cid in listed.split():
            if cid.startswith("gyre-") and dead(cid.removeprefix("gyre-")):
                subprocess.run([runtime, "delete", "--force", cid], capture_output=True, timeout=30)
    gone = [
        p for p in Path(tempfile.gettempdir()).glob("gyre-oci-*") if dead(p.name.removeprefix("gyre-oci-"))
    ]
    for bundle in gone:
        shutil.rmtree(bundle, ignore_errors=True)
    return gone
