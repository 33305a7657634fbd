"""A cgroup per check: one total memory limit (swap off) and one total process limit over every process of one check.

Per-process rlimits do not bound a check that spreads over many processes (three 150 MB processes under a 512 MB
RLIMIT_AS hold 450 MB), and a per-uid RLIMIT_NPROC does not apply when the check keeps uid 0. The check's cgroup does:
the sandbox child joins it before anything of the check exists, so every descendant is counted, and the kernel's OOM
killer and fork limit act inside it only, never on a concurrent check. Its tmpfs copy is charged to it too.

cgroup v1 (a ``memory`` and a ``pids`` hierarchy) or v2 (a unified tree with both controllers delegated) where the
service may write; otherwise ``CgroupUnavailable`` says why and the sandbox records that the limits do not hold.
Groups are nested under the service's own cgroup when it is writable (so a container's limit still covers its checks)
and named ``gyre-eval/<service pid>-<sandbox name>``: two services on one machine never share or remove each other's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from gyre_eval.errors import CgroupUnavailable

CGROUP_ROOT = Path("/sys/fs/cgroup")
_DIR = "gyre-eval"


@dataclass(frozen=True)
class CgroupUsage:
    oom_kills: int = 0
    """Processes the kernel killed because the check's total memory passed its limit."""
    pids_limit_hits: int = 0
    """Forks refused because the check's total process count was at its limit."""
    memory_peak_bytes: int | None = None


@dataclass
class CheckCgroup:
    """The cgroup directories of one check (one per v1 controller, or one v2 group) and the limits written to them."""

    paths: list[Path]
    version: int
    limits: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, name: str, memory_bytes: int | None, pids: int | None) -> CheckCgroup:
        """Make the check's cgroup with its limits; raises ``CgroupUnavailable`` (nothing left behind) if it cannot."""
        leaf = f"{os.getpid()}-{name}"
        v1 = {c: CGROUP_ROOT / c for c in ("memory", "pids") if (CGROUP_ROOT / c / "cgroup.procs").exists()}
        group = cls([], 1 if len(v1) == 2 else 2)
        try:
            if group.version == 1:
                for ctrl, mount in v1.items():
                    base = _parent(mount, ctrl) / _DIR
                    base.mkdir(parents=True, exist_ok=True)
                    _sweep(base)
                    (base / leaf).mkdir()
                    group.paths.append(base / leaf)
                group._limit_v1(memory_bytes, pids)
            else:
                base = _v2_base()
                _sweep(base)
                (base / leaf).mkdir()
                group.paths.append(base / leaf)
                group._limit_v2(memory_bytes, pids)
        except (OSError, CgroupUnavailable) as e:
            group.remove()
            raise CgroupUnavailable(str(e)) from None
        return group

    def _limit_v1(self, memory_bytes: int | None, pids: int | None) -> None:
        mem, pid = self.paths
        if memory_bytes:
            (mem / "memory.limit_in_bytes").write_text(str(memory_bytes))
            swap = mem / "memory.memsw.limit_in_bytes"  # memory + swap: equal to the limit means no swap
            if swap.exists():
                swap.write_text(str(memory_bytes))
            self.limits["memory"] = f"cgroup v1 memory.limit_in_bytes={memory_bytes}" + (
                ", memsw equal (no swap)" if swap.exists() else ", swap not accounted"
            )
        if pids:
            (pid / "pids.max").write_text(str(pids))
            self.limits["pids"] = f"cgroup v1 pids.max={pids}"

    def _limit_v2(self, memory_bytes: int | None, pids: int | None) -> None:
        (cg,) = self.paths
        if memory_bytes:
            (cg / "memory.max").write_text(str(memory_bytes))
            swap = cg / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
            self.limits["memory"] = f"cgroup v2 memory.max={memory_bytes}" + (
                ", memory.swap.max=0" if swap.exists() else ", swap not accounted"
            )
        if pids:
            (cg / "pids.max").write_text(str(pids))
            self.limits["pids"] = f"cgroup v2 pids.max={pids}"

    def procs_files(self) -> list[str]:
        """What the sandbox child writes its pid to (before unsharing, so the whole check is inside)."""
        return [str(p / "cgroup.procs") for p in self.paths]

    def usage(self) -> CgroupUsage:
        """The check's resource events, read after it ended and before ``remove``."""
        if self.version == 1:
            mem, pid = self.paths
            return CgroupUsage(
                oom_kills=_field(mem / "memory.oom_control", "oom_kill"),
                pids_limit_hits=_field(pid / "pids.events", "max"),
                memory_peak_bytes=_int(mem / "memory.max_usage_in_bytes"),
            )
        (cg,) = self.paths
        return CgroupUsage(
            oom_kills=_field(cg / "memory.events", "oom_kill"),
            pids_limit_hits=_field(cg / "pids.events", "max"),
            memory_peak_bytes=_int(cg / "memory.peak"),
        )

    def remove(self, wait_s: float = 5.0) -> None:
        """Kill whatever is left in the group (a process that left the check's process group or namespace) and
        remove it. Waits for the kills to land, at most ``wait_s``; a group still busy then is left to the sweep."""
        end = time.monotonic() + wait_s
        for cg in reversed(self.paths):
            with contextlib.suppress(OSError):
                (cg / "cgroup.kill").write_text("1")  # v2 (5.14+): one write kills them all
            while True:
                try:
                    pids = (cg / "cgroup.procs").read_text().split()
                except OSError:
                    break  # already gone
                for pid in pids:
                    with contextlib.suppress(OSError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
                try:
                    cg.rmdir()
                    break
                except OSError:
                    if time.monotonic() > end:
                        break
                    time.sleep(0.01)  # the killed processes are still exiting
        self.paths = [p for p in self.paths if p.exists()]


def _parent(mount: Path, controller: str) -> Path:
    """The service's own cgroup in a v1 hierarchy when it is visible and writable there, else the hierarchy's root."""
    own = _own_path(lambda ctrls: controller in ctrls.split(","))
    if own is not None:
        candidate = mount / own.lstrip("/")
        if candidate.is_dir() and os.access(candidate, os.W_OK):
            return candidate
    if not os.access(mount, os.W_OK):
        raise CgroupUnavailable(f"{mount} is not writable")
    return mount


def _v2_base() -> Path:
    """A v2 directory whose children get ``memory`` and ``pids``: gyre-eval/ under the service's own cgroup, else
    under the tree's root. Enabling controllers for children fails (EBUSY) where the parent holds processes and is not
    the root: the no-internal-processes rule of v2; then no total limits hold."""
    roots = [r for r in (CGROUP_ROOT, CGROUP_ROOT / "unified") if (r / "cgroup.controllers").exists()]
    if not roots:
        raise CgroupUnavailable(f"no cgroup v1 memory+pids hierarchies nor a v2 tree under {CGROUP_ROOT}")
    root = roots[0]
    available = (root / "cgroup.controllers").read_text().split()
    if not {"memory", "pids"} <= set(available):
        raise CgroupUnavailable(f"the cgroup v2 tree at {root} offers {available}, not memory and pids")
    own = _own_path(lambda ctrls: ctrls == "")
    errors = []
    for parent in dict.fromkeys([root / own.lstrip("/") if own else root, root]):
        try:
            (parent / "cgroup.subtree_control").write_text("+memory +pids")
            base = parent / _DIR
            base.mkdir(exist_ok=True)
            (base / "cgroup.subtree_control").write_text("+memory +pids")
            return base
        except OSError as e:
            errors.append(f"{parent}: {e.strerror or e}")
    raise CgroupUnavailable("cannot delegate memory and pids: " + "; ".join(errors))


def _own_path(match) -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            if match(ctrls):
                return path
    return None


def _sweep(base: Path) -> None:
    """Remove groups a dead service left behind (checks die with their service; an empty group stays until here).
    rmdir refuses a group that still holds a process, so a live check's group is never removed."""
    for cg in base.iterdir():
        pid = cg.name.split("-", 1)[0]
        if not cg.is_dir() or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                cg.rmdir()
        except OSError:
            pass  # alive under another uid


def _field(path: Path, key: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    return 0


def _int(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text())
    return None
