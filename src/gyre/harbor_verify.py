"""Harbor's verifier as a gyre-eval check: run a task's ``tests/test.sh`` where it expects to run, read its reward.

Standard library only: gyre-eval runs it (``python3 -I -c SOURCE SPEC_JSON``, `gyre.harbor_tasks.verifier_config`)
inside its sandbox, in the private copy of the execution's workspace, with the task's ``tests/`` folder as
``$GYRE_CHECK_FILES``. A Harbor verifier expects absolute paths: the workspace at the task's workdir (``/app``), its
tests at ``/tests``, a writable ``/logs/verifier`` where it leaves ``reward.txt`` or ``reward.json``. No host path is
bound there (binding onto missing host paths would create them on the real root), so the verifier runs under
bubblewrap in a root of its own: ``/usr`` and a few files of ``/etc`` read-only, the copy at the workdir, the tests
read-only, a fresh ``/logs``, a private ``/tmp``, ``/proc`` and ``/dev``, no network, its own PID namespace (every
process of the verifier dies with it). Run by root, it drops to uid 65534 inside (``setpriv``, no capabilities, no new
privileges); otherwise bubblewrap's user namespace gives it the operator's rights.

The reward file is untrusted (the verifier runs the agent's code): a regular file opened without following a link at
any step below the logs folder, at most ``MAX_REWARD_BYTES``, parsed strictly (``reward.txt``: one finite number;
``reward.json``: a finite number, or an object whose ``reward`` is one, or an object holding exactly one number).
Anything else, or no reward file, is no score: the script exits ``NO_SCORE`` (neither a pass nor a fail code of the
check, so gyre-eval records a failed attempt, never a zero). The verifier's own exit status is ignored, as Harbor does.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import subprocess
import sys

MAX_REWARD_BYTES = 4096
NO_SCORE = 3
"""Exit status: the verifier left no usable reward (gyre-eval: a failed attempt, never a score)."""
SANDBOX_UID = 65534
ETC_FILES = (
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/hosts",
    "/etc/localtime",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/mime.types",
    "/etc/terminfo",
)
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class NoReward(Exception):
    """The verifier left no usable reward; ``str(err)`` says why."""


def _read_untrusted(dir_fd: int, name: str) -> bytes | None:
    """The file `name` in the folder `dir_fd`: None when absent; refused when a link, not a regular file or too big."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symlink
        raise NoReward(f"{name}: cannot be opened without following a link ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NoReward(f"{name}: not a regular file")
        if st.st_size > MAX_REWARD_BYTES:
            raise NoReward(f"{name}: {st.st_size} bytes, more than {MAX_REWARD_BYTES}")
        data = os.read(fd, MAX_REWARD_BYTES + 1)
        if len(data) > MAX_REWARD_BYTES:
            raise NoReward(f"{name}: more than {MAX_REWARD_BYTES} bytes")
        return data
    finally:
        os.close(fd)


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise NoReward(f"{what}: not a finite number")
    return float(value)


def parse_reward_json(data: bytes) -> float:
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise NoReward("reward.json: not valid JSON") from None
    if isinstance(value, dict):
        if "reward" in value:
            return _number(value["reward"], "reward.json: reward")
        numbers = [v for v in value.values() if isinstance(v, int | float) and not isinstance(v, bool)]
        if len(value) != 1 or len(numbers) != 1:
            raise NoReward('reward.json: an object needs a "reward" key or exactly one number')
        return _number(numbers[0], "reward.json")
    return _number(value, "reward.json")


def parse_reward_text(data: bytes) -> float:
    try:
        text = data.decode("utf-8").strip()
        value = float(text)
    except (UnicodeDecodeError, ValueError):
        raise NoReward("reward.txt: not a number") from None
    if not text or text.lower().lstrip("+-") in ("nan", "inf", "infinity"):
        raise NoReward("reward.txt: not a finite number")
    return _number(value, "reward.txt")


def read_reward(logs_dir: str) -> float:
    """The reward the verifier left in ``logs_dir/verifier`` (``reward.json`` first, as Harbor reads it), or
    `NoReward`. ``logs_dir`` is trusted (made by this script); everything below it is not."""
    try:
        top = os.open(logs_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        raise NoReward(f"logs folder: {e.strerror}") from None
    try:
        try:
            vdir = os.open("verifier", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
        except OSError as e:
            raise NoReward(f"/logs/verifier: {e.strerror}") from None
        try:
            data = _read_untrusted(vdir, "reward.json")
            if data is not None:
                return parse_reward_json(data)
            data = _read_untrusted(vdir, "reward.txt")
            if data is not None:
                return parse_reward_text(data)
        finally:
            os.close(vdir)
    finally:
        os.close(top)
    raise NoReward("the verifier wrote neither /logs/verifier/reward.txt nor reward.json")


def _output_tail(logs: str) -> str:
    """The end of the verifier's output (test-stdout.txt), read as untrusted as the reward."""
    try:
        vdir = os.open(os.path.join(logs, "verifier"), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        fd = os.open("test-stdout.txt", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=vdir)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return ""
        os.lseek(fd, max(0, st.st_size - 1500), os.SEEK_SET)
        return os.read(fd, 1500).decode(errors="replace")
    finally:
        os.close(fd)
        os.close(vdir)


def _give(path: str, uid: int) -> None:
    """chown a tree to `uid`, never through a link (the copy is the agent's work)."""
    os.lchown(path, uid, uid)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)


def sandbox_base(root: bool) -> list[str]:
    """bubblewrap's namespaces and the read-only part of the root: ``/usr``, its links, a few files of ``/etc``,
    ``/proc`` and ``/dev`` (also gyre.harbor_env's)."""
    bwrap = shutil.which("bwrap") or "bwrap"
    if root:  # no user namespace: it would map the verifier back to root on the host; setpriv drops instead
        cmd = [
            bwrap,
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
        ]
    else:
        cmd = [bwrap, "--unshare-all"]
    cmd += ["--die-with-parent", "--ro-bind", "/usr", "/usr"]
    for link in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink(f"/{link}"):
            cmd += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
        elif os.path.isdir(f"/{link}"):
            cmd += ["--ro-bind", f"/{link}", f"/{link}"]
    for path in ETC_FILES:
        if os.path.exists(path):
            cmd += ["--ro-bind", path, path]
    return [*cmd, "--proc", "/proc", "--dev", "/dev"]


def drop_privileges() -> list[str]:
    """The argv prefix that runs a command as `SANDBOX_UID` without capabilities or new privileges (run by root)."""
    return [
        "setpriv",
        f"--reuid={SANDBOX_UID}",
        f"--regid={SANDBOX_UID}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
    ]


def bwrap_argv(spec: dict, workspace: str, tests: str, logs: str, root: bool) -> list[str]:
    """The bubblewrap command line running the task's test.sh (see the module's docstring)."""
    cmd = [*sandbox_base(root), "--new-session", "--perms", "1777", "--tmpfs", "/tmp"]
    cmd += ["--bind", workspace, spec["workdir"], "--ro-bind", tests, "/tests", "--bind", logs, "/logs"]
    cmd += ["--chdir", spec["workdir"], "--clearenv"]
    env = {"PATH": PATH, "HOME": "/tmp", "LANG": "C.UTF-8", "TMPDIR": "/tmp", **spec.get("env", {})}
    for key, value in env.items():
        cmd += ["--setenv", key, value]
    script = "/tests/test.sh"
    run = [script] if os.access(os.path.join(tests, "test.sh"), os.X_OK) else ["bash", script]
    if root:
        run = [*drop_privileges(), *run]
    shell = 'exec "$@" > /logs/verifier/test-stdout.txt 2>&1'
    return [*cmd, "--", "/bin/sh", "-c", shell, "sh", *run]


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    workspace, tests = os.environ["GYRE_WORKSPACE"], os.environ["GYRE_CHECK_FILES"]
    if shutil.which("bwrap") is None or (os.geteuid() == 0 and shutil.which("setpriv") is None):
        print(
            "harbor verifier: needs bubblewrap and, run by root, setpriv (apt-get install bubblewrap util-linux)",
            file=sys.stderr,
        )
        return NO_SCORE
    # beside the copy: in the check's own root
    logs = os.path.join(os.path.dirname(workspace), "tmp", "harbor-logs")
    root = os.geteuid() == 0
    os.makedirs(logs, mode=0o755)
    for sub in ("verifier", "agent", "artifacts"):
        os.mkdir(os.path.join(logs, sub), 0o755)
        if root:
            os.chown(os.path.join(logs, sub), SANDBOX_UID, SANDBOX_UID)
    if root:  # the logs folder itself stays root's: the verifier cannot swap "verifier" for a link
        _give(workspace, SANDBOX_UID)
    done = subprocess.run(bwrap_argv(spec, workspace, tests, logs, root), stdin=subprocess.DEVNULL)
    who = f"uid {SANDBOX_UID}, no capabilities" if root else "the operator's uid in a user namespace"
    print(
        f"harbor verifier: bubblewrap root, no network, own PID namespace, {who}; test.sh exited {done.returncode}"
    )
    sys.stdout.write(_output_tail(logs))
    try:
        reward = read_reward(logs)
    except NoReward as e:
        print(f"no score: {e} (test.sh exited {done.returncode})", file=sys.stderr)
        return NO_SCORE
    with open(os.environ["GYRE_SCORE_FILE"], "w") as f:
        f.write(repr(reward))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
