"""The execution sandbox at launch: each harness runs under bubblewrap (default), or an OCI container runtime
(``runtime="oci"``: runc, crun..., see ``gyre_sched.sandbox_oci``), in its own namespaces.

``LaunchSandbox.wrap`` turns a harness argv into a ``bwrap`` command line (or a ``RUNTIME run --bundle`` one whose
bundle says the same):

- **own namespaces**: pid (a fresh ``/proc``; when the sandbox's init dies every process in it dies), network, ipc,
  uts, cgroup;
- **identity**: the harness runs as uid/gid 65534. When Gyre runs as root that is the host's nobody, with no
  capability: bubblewrap makes no user namespace (one would map 65534 back to root, who reads every root-only file on
  the mounted paths) and the forwarder drops to it, an OCI runtime starts it so. Run by another user, bubblewrap
  makes a user namespace, and the harness has that user's rights on the host;
- **filesystem**: a fresh root with ``/usr`` (and its ``/bin``, ``/lib`` links), a few files of ``/etc`` (certificates,
  passwd, hosts, ...), the execution's own workspace and private home (read-write, at their host paths), the
  interpreter / CLI paths the harness needs (read-only), a private ``/tmp``; nothing else of the host: not the host's
  home, not the proxy's store, not the run directory, not another execution's workspace;
- **no host environment**: ``--clearenv``, then only the variables the runner passes (the allow-list and the
  execution's own key);
- **network only to the proxy**: the network namespace has a loopback and nothing else; a forwarder inside listens
  on the proxy's own ``127.0.0.1:PORT`` and relays each connection over a Unix socket (bound into the sandbox) to
  the proxy, so the harness's base URL is unchanged and no other address is reachable;
- **limits**: a cgroup per execution under ``cgroup_root`` (its v1 hierarchies, or the v2 tree where it is a cgroup2
  mount: ``pids``, ``memory``, ``cpu`` quota), else the rlimits that apply; ``limits_applied`` says which held.

Requires ``bwrap`` (Debian package ``bubblewrap``), or the configured OCI runtime (Debian package ``runc``; the
runtime makes the cgroups, so it must support the host's cgroup layout: crun 1.8 refuses hybrid v1/v2 hosts).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal

from gyre_sched.sandbox_oci import OciBundle, give_to, oci_resources, sweep_oci

__all__ = ["FORWARDER", "LaunchSandbox", "ProxyRelay", "default_ro_paths"]

ETC_FILES = (
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/hosts",
    "/etc/localtime",
    "/etc/mime.types",
)

INNER_SOCKET = "/run/gyre/proxy.sock"

# Inside the sandbox: listen on the proxy's loopback port, relay to the Unix socket, run the harness, exit with it.
FORWARDER = r"""
import ctypes, os, socket, subprocess, sys, threading
path, port, uid, argv = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
libc = ctypes.CDLL(None, use_errno=True)
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port))
srv.listen(128)
if os.getuid() == 0:  # bubblewrap run by root, no user namespace: become the sandbox's user for good
    try:
        cap = 0
        while libc.prctl(24, cap, 0, 0, 0) == 0:  # PR_CAPBSET_DROP, every capability the kernel knows
            cap += 1
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # clears the permitted and effective capabilities
        if libc.prctl(38, 1, 0, 0, 0) != 0 or os.getresuid() != (uid, uid, uid):  # PR_SET_NO_NEW_PRIVS
            raise OSError("the drop did not hold")
    except OSError as e:
        print(f"sandbox: cannot become uid {uid}: {e}", file=sys.stderr)
        sys.exit(126)
# Die with the process that started the sandbox (bwrap's init, or the OCI runtime's `run`); set after the drop,
# which clears it.
libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
def pipe(a, b):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    for s in (a, b):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
def serve():
    while True:
        c, _ = srv.accept()
        u = socket.socket(socket.AF_UNIX)
        try:
            u.connect(path)
        except OSError:
            c.close()
            continue
        threading.Thread(target=pipe, args=(c, u), daemon=True).start()
        threading.Thread(target=pipe, args=(u, c), daemon=True).start()
threading.Thread(target=serve, daemon=True).start()
try:
    code = subprocess.call(argv)
except OSError as e:
    print(f"sandbox: cannot start {argv[0]}: {e}", file=sys.stderr)
    code = 127
sys.exit(code if code >= 0 else 128 - code)
"""


def default_ro_paths() -> list[str]:
    """What a Python or Claude Code harness needs read-only: this interpreter's prefixes, the import paths of the
    installed packages (site-packages, editable ``src`` folders), and the repository's ``node_modules``."""
    paths = {sys.prefix, sys.base_prefix, os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}
    for entry in sys.path:
        name = os.path.basename(entry.rstrip("/"))
        if os.path.isdir(entry) and (
            name in ("site-packages", "src", "lib-dynload") or entry.startswith(sys.base_prefix)
        ):
            paths.add(entry)
    for parent in Path(__file__).resolve().parents:
        if (parent / "node_modules").is_dir():
            paths.add(str(parent / "node_modules"))
            break
    return sorted(p for p in paths if p and os.path.exists(p))


class ProxyRelay:
    """Host side of the proxy link: a Unix socket whose connections are relayed to the proxy's TCP address."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        # Short (Unix socket names are <= 107 bytes), named by the controller's pid: `LaunchSandbox.sweep`.
        self.dir = Path(tempfile.mkdtemp(prefix=f"gyre-relay-{os.getpid()}-"))
        self.path = self.dir / "proxy.sock"
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._handle, path=str(self.path))
        os.chmod(self.dir, 0o755)
        os.chmod(self.path, 0o777)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                with contextlib.suppress(OSError, RuntimeError):
                    w.close()

        await asyncio.gather(pump(reader, up_w), pump(up_r, writer))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        shutil.rmtree(self.dir, ignore_errors=True)


LIMITED = ("pids", "memory", "cpu")
"""The controllers an execution's cgroup limits."""


def _cgroup_roots(base: Path) -> dict[str, Path]:
    """Writable cgroup trees under `base`: a cgroup2 mount (``cgroup.controllers`` at its root) as ``v2``, else the
    v1 hierarchies ``base/{pids,memory,cpu}``."""
    if (base / "cgroup.controllers").exists():
        roots = {"v2": base}
    else:
        roots = {c: base / c for c in LIMITED if (base / c / "cgroup.procs").exists()}
    return {c: p for c, p in roots.items() if os.access(p, os.W_OK)}


def _v2_enable(parent: Path) -> set[str]:
    """Delegate the limited controllers `parent` has to its children (cgroup v2: a child's ``pids.max`` etc. exist
    only when the parent lists the controller in ``cgroup.subtree_control``); returns those enabled."""
    offered = set((parent / "cgroup.controllers").read_text().split())
    enabled = set((parent / "cgroup.subtree_control").read_text().split())
    for ctrl in [c for c in LIMITED if c in offered and c not in enabled]:
        # A parent with processes of its own refuses (v2's no-internal-process rule): that controller is not limited.
        with contextlib.suppress(OSError):
            (parent / "cgroup.subtree_control").write_text(f"+{ctrl}")
            enabled.add(ctrl)
    return enabled & set(LIMITED)


def _dead(pid_prefixed: str) -> bool:
    """Whether the controller whose pid starts `pid_prefixed` (``PID-...``) is gone (a live or reused pid: kept)."""
    try:
        os.kill(int(pid_prefixed.split("-", 1)[0]), 0)
    except ProcessLookupError:
        return True
    except (ValueError, OSError):
        return False
    return False


def _open_parents(mounted: Sequence[str], links: Sequence[str]) -> list[str]:
    """bwrap's ``--chmod 0755`` for each folder it made on the way to a mount point (it makes them 0700): a
    harness that is not root inside the sandbox could not reach its own interpreter or workspace through them.
    Never a folder of a mounted host tree, nor one behind one of the root's links (``/lib`` -> ``usr/lib``)."""
    hosts = [Path(p) for p in [*mounted, *links]]
    made = {
        a
        for p in mounted
        for a in Path(p).parents
        if a != Path("/")
        and str(a) not in ("/tmp", "/run")
        and not any(a == h or h in a.parents for h in hosts)
    }
    return [arg for a in sorted(made) for arg in ("--chmod", "0755", str(a))]


RESERVED_TOP = frozenset(
    {
        "bin",
        "boot",
        "dev",
        "etc",
        "home",
        "lib",
        "lib32",
        "lib64",
        "proc",
        "root",
        "run",
        "sbin",
        "sys",
        "tmp",
        "usr",
    }
)
"""Top-level folders a task's workdir may not be (the sandbox mounts the system's, or its own, there)."""


def check_workdir(path: str) -> str:
    """A workdir the sandbox can mount a workspace at: absolute, normalized, below a top-level folder of its own."""
    p = PurePosixPath(path)
    if not p.is_absolute() or ".." in p.parts or str(p) != path.rstrip("/") or len(p.parts) < 2:
        raise ValueError(f"workdir {path!r} must be an absolute, normalized path below / (e.g. /app)")
    if p.parts[1] in RESERVED_TOP:
        raise ValueError(f"workdir {path!r} lies in /{p.parts[1]}, which the sandbox mounts itself")
    return str(p)


@dataclass
class LaunchSandbox:
    """bubblewrap (or an OCI runtime) around each harness; limits per execution."""

    cpu_cores: float | None = 2.0
    """CPU quota in cores (cgroup cpu.cfs_quota_us / cpu.max)."""
    memory_bytes: int | None = 8 << 30
    max_processes: int | None = 512
    ro_paths: Sequence[str] = field(default_factory=default_ro_paths)
    uid: int = 65534
    bwrap: str = "bwrap"
    runtime: Literal["bubblewrap", "oci"] = "bubblewrap"
    """Who makes the namespaces: bubblewrap, or the OCI container runtime `oci_runtime` (it also makes the cgroup)."""
    oci_runtime: str = "runc"
    """The OCI runtime's binary (``RUNTIME run --bundle DIR ID`` / ``RUNTIME delete --force ID``); needs root."""
    cgroup_root: Path = Path("/sys/fs/cgroup")
    """Where executions' cgroups are made: a cgroup2 mount (the v2 tree, e.g. ``/sys/fs/cgroup`` on a pure v2 host
    or ``/sys/fs/cgroup/unified`` on a hybrid one), or the folder holding the v1 hierarchies."""
    limits_applied: dict[str, str] = field(default_factory=dict)
    """The limits that held for the last execution (controller -> what was set); a controller missing here is not
    limited by a cgroup (not offered, or not writable)."""
    _bundles: dict[str, OciBundle] = field(default_factory=dict, init=False, repr=False)

    def check(self) -> None:
        if self.runtime == "oci":
            if shutil.which(self.oci_runtime) is None:
                raise RuntimeError(
                    f"the OCI execution sandbox needs its runtime ({self.oci_runtime!r} not found): apt-get install runc"
                )
            # It hands the workspace to the sandbox's own user and runs rootful containers.
            if os.geteuid() != 0:
                raise RuntimeError(
                    f"the OCI execution sandbox needs root (euid is {os.geteuid()}): run gyre as root, or use "
                    'sandbox_runtime = "bubblewrap" (unprivileged user namespaces)'
                )
            return
        if shutil.which(self.bwrap) is None:
            raise RuntimeError(
                f"the execution sandbox needs bubblewrap ({self.bwrap!r} not found): apt-get install bubblewrap"
            )

    def wrap(
        self,
        argv: Sequence[str],
        workspace: Path,
        home: Path,
        env: dict[str, str],
        proxy_port: int,
        relay_dir: Path,
        name: str = "execution",
        workdir: str | None = None,
    ) -> list[str]:
        """The command line running `argv` in the sandbox (env given explicitly, nothing inherited); `name` (the
        execution id) names its OCI container, removed by `release(name)`. `workdir`: where the harness sees its
        workspace (a task's `/app`; `check_workdir`), else at its host path."""
        python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
        inner = [python, "-I", "-S", "-c", FORWARDER, INNER_SOCKET, str(proxy_port), str(self.uid), *argv]
        inside = check_workdir(workdir) if workdir is not None else str(workspace)
        if self.runtime == "oci":
            return self._wrap_oci(inner, workspace, home, env, relay_dir, name, inside)
        if os.geteuid() == 0:
            # A user namespace would map the harness's uid back to root on the host, where it reads every root-only
            # file on the mounted paths: root's bwrap makes the other namespaces and its mounts without one, and the
            # forwarder becomes `uid` (the host's nobody), as under an OCI runtime.
            give_to(self.uid, workspace, home)
            cmd = [self.bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
            cmd += ["--unshare-cgroup-try", "--die-with-parent"]
        else:  # an operator's own user namespace: the harness has the operator's uid on the host
            cmd = [
                self.bwrap,
                "--unshare-all",
                "--die-with-parent",
                "--uid",
                str(self.uid),
                "--gid",
                str(self.uid),
            ]
        binds = [("/usr", "/usr")]  # (host path, sandbox path), read-only
        for link in ("bin", "lib", "lib64", "sbin"):
            target = os.readlink(f"/{link}") if os.path.islink(f"/{link}") else None
            if target is not None:
                cmd += ["--symlink", target, f"/{link}"]
            elif os.path.isdir(f"/{link}"):
                binds.append((f"/{link}", f"/{link}"))
        binds += [(p, p) for p in ETC_FILES if os.path.exists(p)]
        for src, dst in binds:
            cmd += ["--ro-bind", src, dst]
        cmd += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp", "--tmpfs", "/run"]
        # After the tmpfs mounts: what is bound under /tmp lies on top of them.
        ro = [
            (p, p)
            for p in self.ro_paths
            if p not in ("/usr", "/") and not p.startswith("/usr/") and os.path.exists(p)
        ]
        rw = [
            (str(workspace), inside),
            (str(home), str(home)),
            (str(relay_dir), str(Path(INNER_SOCKET).parent)),
        ]
        for src, dst in ro:
            cmd += ["--ro-bind-try", src, dst]
        for src, dst in rw:
            cmd += ["--bind", src, dst]
        cmd += _open_parents([dst for _, dst in binds + ro + rw], ["/bin", "/lib", "/lib64", "/sbin"])
        cmd += ["--chdir", inside, "--clearenv"]
        for k, v in env.items():
            cmd += ["--setenv", k, v]
        return [*cmd, "--", *inner]

    def _wrap_oci(
        self,
        inner: list[str],
        workspace: Path,
        home: Path,
        env: dict[str, str],
        relay_dir: Path,
        name: str,
        inside: str,
    ) -> list[str]:
        self.release(name)  # a container left by an earlier attempt of the same execution
        give_to(self.uid, workspace, home)
        bundle = OciBundle(self.oci_runtime, name)
        resources, self.limits_applied = oci_resources(self.max_processes, self.memory_bytes, self.cpu_cores)
        bundle.write(
            process_args=inner,
            env=env,
            cwd=Path(inside),
            uid=self.uid,
            ro_paths=self.ro_paths,
            etc_files=ETC_FILES,
            rw_paths=[workspace, home],
            mount_at={str(workspace): inside},
            relay_dir=relay_dir,
            inner_socket_dir=str(Path(INNER_SOCKET).parent),
            resources=resources,
        )
        self._bundles[name] = bundle
        return bundle.argv()

    def release(self, name: str) -> None:
        """After the execution: its OCI container (what is left of it, its state and cgroup) and bundle go."""
        bundle = self._bundles.pop(name, None)
        if bundle is not None:
            bundle.delete()

    def sweep(self) -> list[Path]:
        """Remove what the launches of a dead controller left (a SIGKILL skips every clean-up): its executions'
        cgroups (what still runs in them is killed), proxy relay folders, and OCI bundles and containers, each named
        by its controller's pid. Called as a runner starts; returns the folders it removed."""
        gone: list[Path] = []
        if self.runtime != "oci":
            for root in _cgroup_roots(Path(self.cgroup_root)).values():
                with contextlib.suppress(OSError):
                    left = [cg for cg in (root / "gyre").iterdir() if cg.is_dir() and _dead(cg.name)]
                    self.remove_cgroups(left)
                    gone += [cg for cg in left if not cg.exists()]
        for folder in Path(tempfile.gettempdir()).glob("gyre-relay-*"):
            if _dead(folder.name.removeprefix("gyre-relay-")):
                shutil.rmtree(folder, ignore_errors=True)
                gone.append(folder)
        if self.runtime == "oci":
            gone += sweep_oci(self.oci_runtime, _dead)
        return gone

    # ---- limits -------------------------------------------------------------------------------------------------
    def make_cgroup(self, name: str) -> list[Path]:
        """One cgroup per execution under each writable controller (empty when none is writable; and under an OCI
        runtime, which makes the container's own)."""
        if self.runtime == "oci":
            return []
        made: list[Path] = []
        self.limits_applied = {}
        for ctrl, root in _cgroup_roots(Path(self.cgroup_root)).items():
            # Named per controller process: two runs on one machine reuse execution ids, and removing one run's
            # cgroup kills what is in it.
            cg = root / "gyre" / f"{os.getpid()}-{name}"
            try:
                if ctrl == "v2":
                    self._make_v2(cg)
                else:
                    self._make_v1(ctrl, cg)
                made.append(cg)
            except OSError:
                continue
        return made

    def _make_v1(self, ctrl: str, cg: Path) -> None:
        cg.mkdir(parents=True, exist_ok=True)
        if ctrl == "pids" and self.max_processes:
            (cg / "pids.max").write_text(str(self.max_processes))
            self.limits_applied["pids"] = f"cgroup pids.max={self.max_processes}"
        if ctrl == "memory" and self.memory_bytes:
            (cg / "memory.limit_in_bytes").write_text(str(self.memory_bytes))
            self.limits_applied["memory"] = f"cgroup memory.limit_in_bytes={self.memory_bytes}"
        if ctrl == "cpu" and self.cpu_cores:
            (cg / "cpu.cfs_period_us").write_text("100000")
            (cg / "cpu.cfs_quota_us").write_text(str(int(self.cpu_cores * 100000)))
            self.limits_applied["cpu"] = f"cgroup cpu quota {self.cpu_cores} cores"

    def _make_v2(self, cg: Path) -> None:
        # Controllers reach a cgroup only through its ancestors' subtree_control: root -> gyre -> the execution's.
        _v2_enable(cg.parent.parent)
        cg.parent.mkdir(exist_ok=True)
        enabled = _v2_enable(cg.parent)
        cg.mkdir(exist_ok=True)
        if "pids" in enabled and self.max_processes:
            (cg / "pids.max").write_text(str(self.max_processes))
            self.limits_applied["pids"] = f"cgroup v2 pids.max={self.max_processes}"
        if "memory" in enabled and self.memory_bytes:
            (cg / "memory.max").write_text(str(self.memory_bytes))
            self.limits_applied["memory"] = f"cgroup v2 memory.max={self.memory_bytes}"
        if "cpu" in enabled and self.cpu_cores:
            (cg / "cpu.max").write_text(f"{int(self.cpu_cores * 100000)} 100000")
            self.limits_applied["cpu"] = f"cgroup v2 cpu.max {self.cpu_cores} cores"

    @staticmethod
    def enter(cgroups: Sequence[Path]) -> None:
        """In the child before exec: join the execution's cgroups."""
        for cg in cgroups:
            with contextlib.suppress(OSError):
                (cg / "cgroup.procs").write_text(str(os.getpid()))

    @staticmethod
    def remove_cgroups(cgroups: Sequence[Path]) -> None:
        """Kill whatever is left in the execution's cgroups and remove them (waits up to 2 s for the exits).

        v2 has ``cgroup.kill``: the kernel kills the whole cgroup at once, forks racing the kill included; v1 is
        killed pid by pid until the cgroup is empty."""
        import time

        for cg in cgroups:
            if (cg / "cgroup.kill").exists():
                with contextlib.suppress(OSError):
                    (cg / "cgroup.kill").write_text("1")
            for _ in range(100):
                try:
                    pids = (cg / "cgroup.procs").read_text().split()
                except OSError:
                    break
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(OSError, ValueError):
                        os.kill(int(pid), 9)
                time.sleep(0.02)
            with contextlib.suppress(OSError):
                cg.rmdir()
