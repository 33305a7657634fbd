"""The process that becomes a sandboxed check: ``python -m gyre_eval._sandbox_child SPEC_JSON STATUS_FD``.

Runs single-threaded (so namespace and mount calls are safe, unlike a ``preexec_fn`` in a threaded server), uses only
the standard library, and reports its setup result on STATUS_FD: ``ok`` just before ``exec`` (the fd is close-on-exec),
or ``error: ...`` when isolation could not be established, in which case the check never runs (fail closed).

It first joins the check's cgroup (when the service made one), so every process of the check is counted in its total
memory and process limits. With isolation it creates new mount, network, PID and cgroup namespaces (plus a user
namespace when not root), then: mounts a tmpfs of ``disk_bytes`` on the sandbox root (or binds it to itself), makes
every other mount read-only, mounts a fresh read-only /proc for the new PID namespace, copies the workspace into the
sandbox root (``work``, beside ``tmp``, ``home``, ``out``), and drops privileges (root: setuid to ``run_as``; otherwise
a nested user namespace that holds no capability over the mounts). The check runs under a small init (PID 1 of the
namespace): when the check ends, init reports its fatal signal, its score file and whether the tmpfs was full (the
service cannot see the tmpfs), then exits, and the kernel kills every process the check left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import resource
import shutil
import signal
import stat
import struct
import sys
import warnings  # noqa: F401  (os.execvpe imports it lazily; after dropping privileges the stdlib may be unreadable)
from functools import partial

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
# Flags a bind remount must repeat: inside a user namespace the kernel refuses to clear locked ones.
_KEEP = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}


class SetupError(Exception):
    pass


def _mount(
    libc: ctypes.CDLL, src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    def enc(s: str | None) -> bytes | None:
        return s.encode() if s is not None else None

    if libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _mountpoints() -> list[tuple[str, int]]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            # Mount points escape space, tab, newline and backslash as octal.
            point = fields[4].encode().decode("unicode_escape")
            flags = 0
            for opt in fields[5].split(","):
                flags |= _KEEP.get(opt, 0)
            points.append((point, flags))
    return points


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _isolate(spec: dict) -> None:
    """Read-only mounts and a fresh /proc; called in the namespace's PID 1."""
    libc = ctypes.CDLL(None, use_errno=True)
    root = spec["root"]
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do propagates back to the host
    if spec.get("disk_bytes"):
        # The copy, tmp, home and score file share one tmpfs: what the check writes in total, over any number of
        # files, is bounded by its size (and its inode count), and its pages are charged to the check's cgroup.
        size = int(spec["disk_bytes"])
        opts = f"size={size},nr_inodes={max(1024, size // 4096)},mode=0700"
        if spec.get("chown"):
            opts += f",uid={spec['run_as']},gid={spec['run_as']}"
        _mount(libc, "gyre-check", root, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    else:
        _mount(libc, root, root, None, MS_BIND | MS_REC)
    # Some containers forbid a new procfs; the host /proc is then made read-only below.
    with contextlib.suppress(OSError):
        _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for point, flags in _mountpoints():
        if point == root or point.startswith(root.rstrip("/") + "/"):
            continue
        try:
            _mount(libc, None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | flags)
        except OSError as e:
            if not os.path.exists(point):
                continue  # covered by a later mount on a parent; unreachable from inside
            raise SetupError(f"cannot make {point} read-only: {e}") from e


def _prepare(spec: dict) -> None:
    """The private copy of the workspace, and tmp, home and out beside it (in the tmpfs, when there is one)."""
    root = spec["root"]
    for sub in ("tmp", "home", "out"):
        os.mkdir(os.path.join(root, sub), 0o700)
    work = os.path.join(root, "work")
    if spec.get("workspace"):
        try:
            # Links stay links only where they resolve inside the workspace: a link out of it (to a sibling
            # execution's answer, or a file the check's uid may read) would be scored as this execution's work.
            shutil.copytree(
                spec["workspace"],
                work,
                symlinks=True,
                copy_function=_copy_regular,
                ignore=partial(_links_out_of, os.path.realpath(spec["workspace"])),
            )
        except (OSError, shutil.Error) as e:
            full = "No space left" in str(e)
            raise SetupError(
                f"the workspace does not fit the disk cap (disk_bytes={spec['disk_bytes']})"
                if full and spec.get("disk_bytes")
                else f"cannot copy the workspace: {str(e)[:500]}"
            ) from None
    else:
        os.mkdir(work, 0o700)
    if spec.get("chown"):
        uid = spec["run_as"]
        for dirpath, dirnames, filenames in os.walk(root):
            os.lchown(dirpath, uid, uid)
            for name in dirnames + filenames:
                os.lchown(os.path.join(dirpath, name), uid, uid)


def _links_out_of(workspace: str, directory: str, names: list[str]) -> set[str]:
    """copytree's ignore: the names in ``directory`` that are symlinks resolving outside ``workspace`` (the real path
    follows every link of a chain, so a hop through ``..`` is caught too)."""
    out = set()
    for name in names:
        path = os.path.join(directory, name)
        if os.path.islink(path):
            target = os.path.realpath(path)
            if target != workspace and not target.startswith(workspace.rstrip("/") + "/"):
                out.add(name)
    return out


def _copy_regular(src: str, dst: str) -> None:
    """Copy regular files only: opening a FIFO or device left in an artifact would block or read a device."""
    if stat.S_ISREG(os.lstat(src).st_mode):
        shutil.copy2(src, dst)


def _join_cgroups(spec: dict) -> None:
    """Enter the check's cgroup before anything of the check exists: every later process is inside it."""
    for procs in spec.get("cgroups", []):
        try:
            _write(procs, str(os.getpid()))
        except OSError as e:
            raise SetupError(f"cannot join the check's cgroup {procs}: {e}") from e


def _drop_privileges(spec: dict, in_userns: bool) -> None:
    run_as = spec.get("run_as")
    if not in_userns and run_as is not None:
        os.setgroups([])
        os.setgid(run_as)
        os.setuid(run_as)
    else:
        # A new user namespace owns no mount or network namespace: no capability in it can undo the isolation.
        os.unshare(os.CLONE_NEWUSER)


def _limits(spec: dict) -> None:
    lim = spec["limits"]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if lim.get("cpu_s"):
        resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
    if lim.get("memory_bytes"):
        resource.setrlimit(resource.RLIMIT_AS, (lim["memory_bytes"], lim["memory_bytes"]))
    if lim.get("file_bytes"):
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_bytes"], lim["file_bytes"]))
    if lim.get("nproc"):
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))


PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (the service, or the outer process for the namespace's init): a
    crashed service leaves no check running. Checked after setting, in case the parent is already gone."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(137)


# seccomp: (audit arch, socket, io_uring_setup) per machine. Other architectures fail closed (no filter: no check).
_SYSCALLS = {"x86_64": (0xC000003E, 41, 425), "aarch64": (0xC00000B7, 198, 425)}
PR_SET_SECCOMP, SECCOMP_MODE_FILTER, AF_UNIX, EACCES = 22, 2, 1, 13
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000


def _deny_unix_sockets() -> None:
    """A seccomp filter: `socket(AF_UNIX, ...)` fails with EACCES, so the check cannot connect to any filesystem (or
    abstract) unix socket of the host (a service's socket, another check's) through the read-only mounts. Anonymous
    pairs (`socketpair`) still work. io_uring (which can open sockets without the syscall) and foreign syscall ABIs
    (x32, 32-bit) are refused too: the filter could not see their socket calls."""
    arch = _SYSCALLS.get(platform.machine())
    if arch is None:
        raise SetupError(f"no unix-socket filter for {platform.machine()}")
    audit_arch, nr_socket, nr_io_uring_setup = arch
    ld_w_abs, jeq_k, jge_k, ret_k = 0x20, 0x15, 0x35, 0x06
    deny = RET_ERRNO | EACCES
    prog = [
        (ld_w_abs, 0, 0, 4),  # seccomp_data.arch
        (jeq_k, 1, 0, audit_arch),
        (ret_k, 0, 0, deny),  # another ABI
        (ld_w_abs, 0, 0, 0),  # seccomp_data.nr
        (jge_k, 0, 1, 0x40000000),  # x32 syscall numbers
        (ret_k, 0, 0, deny),
        (jeq_k, 0, 1, nr_io_uring_setup),
        (ret_k, 0, 0, deny),
        (jeq_k, 0, 3, nr_socket),
        (ld_w_abs, 0, 0, 16),  # args[0] (domain), low 32 bits (little-endian)
        (jeq_k, 0, 1, AF_UNIX),
        (ret_k, 0, 0, deny),
        (ret_k, 0, 0, RET_ALLOW),
    ]
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise SetupError(f"seccomp filter (no unix sockets): {os.strerror(err)}")


def _exec(spec: dict, status_fd: int) -> None:
    os.chdir(spec["cwd"])
    _prctl(PR_SET_NO_NEW_PRIVS, 1)  # setuid/setgid bits and file capabilities are ignored from here on
    if spec["isolate"]:
        _deny_unix_sockets()  # after no_new_privs (an unprivileged filter needs it), before the check's code
    os.set_inheritable(status_fd, False)
    os.write(status_fd, b"ok")  # exec closes the fd; if exec fails, main() appends the error
    os.execvpe(spec["argv"][0], spec["argv"], spec["env"])


def _forward_exit(pid: int) -> None:
    """The outer process mirrors the namespace's fate, so the parent sees the check's exit code."""
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # only reached if the signal's default action does not end this process
    os._exit(os.waitstatus_to_exitcode(status))


def _init(pid: int, status_fd: int, spec: dict) -> None:
    """PID 1 of the namespace: wait for the check and report on the status fd what the service cannot see once the
    namespace is gone: a fatal signal, the score file, and whether the tmpfs copy was full.

    The check is not PID 1 itself because PID 1 ignores signals it has no handler for (SIGXCPU, SIGTERM, ...).
    PID 1 cannot re-raise a signal on itself either, hence the report."""
    _, status = os.waitpid(pid, 0)
    report = []
    if os.WIFSIGNALED(status):
        report.append(f"signal:{os.WTERMSIG(status)}")
    score = _read_score(spec.get("score_path"))
    if score is not None:
        report.append(f"score:{score.hex()}")
    if spec.get("disk_bytes"):
        fs = os.statvfs(spec["root"])
        if fs.f_bavail == 0 or fs.f_favail == 0:
            report.append("disk_full")
    os.write(status_fd, "".join("\n" + line for line in report).encode())
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def _read_score(path: str | None) -> bytes | None:
    """The first 4000 bytes of the score file: as the check's uid, never through a symlink, never a FIFO."""
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, 4000) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    finally:
        os.close(fd)


def main() -> None:
    spec = json.loads(sys.argv[1])
    status_fd = int(sys.argv[2])
    service = int(spec.get("parent", os.getppid()))
    _die_with_parent(service)
    # mirroring a fatal signal must not dump this process's core
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        _join_cgroups(spec)
        if spec["isolate"]:
            in_userns = os.geteuid() != 0
            uid, gid = os.geteuid(), os.getegid()
            # A cgroup namespace rooted at the check's own cgroup (joined above): it sees no host cgroup path.
            flags = os.CLONE_NEWNS | os.CLONE_NEWNET | os.CLONE_NEWPID | os.CLONE_NEWCGROUP
            os.unshare(flags | (os.CLONE_NEWUSER if in_userns else 0))
            if in_userns:
                _write("/proc/self/setgroups", "deny")
                _write("/proc/self/uid_map", f"0 {uid} 1")
                _write("/proc/self/gid_map", f"0 {gid} 1")
            pid = os.fork()
            if pid:
                os.close(status_fd)
                _forward_exit(pid)
            outer = os.getppid()
            # the namespace's init (PID 1) dies with the outer process: so does the namespace
            _die_with_parent(outer)
            _isolate(spec)
            _prepare(spec)
            _drop_privileges(spec, in_userns)
            _die_with_parent(outer)  # a uid change clears the parent-death signal: set it again
            init = os.getpid()
            pid = os.fork()
            if pid:
                _init(pid, status_fd, spec)
            _die_with_parent(init)
        else:
            _prepare(spec)
        _limits(spec)
        _exec(spec, status_fd)
    except Exception as e:  # report, never run the check half-isolated
        try:
            os.write(status_fd, f"error: {type(e).__name__}: {e}".encode()[:4000])
        finally:
            os._exit(126)


if __name__ == "__main__":
    main()
