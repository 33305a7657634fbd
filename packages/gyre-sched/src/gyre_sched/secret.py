"""Service tokens handed to a process by file or by inherited file descriptor, never by environment or command line.

The one token reader of every Gyre service (the proxy, gyre-eval, the cell workers). It lives here, in the lowest
package all of them depend on, and imports nothing but the standard library.

`read_secret(file=..., fd=...)` returns the token (None when neither is given); anything unusable raises
`SecretError` (a `ValueError`) whose message names the source and what is wrong:

- a file must be a regular file opened without following a symbolic link (a link could point the service at any
  file its user can read), readable or writable by its owner only (mode 600 or 400: a token others can read is no
  secret), and at most `MAX_SECRET_BYTES` long;
- an fd (a pipe the parent wrote the token into and closed) is read to its end, up to the same size, and closed;
- the content is one line: exactly one trailing newline is dropped (what `echo` and the launchers write); the rest
  must be non-empty, UTF-8, and hold no whitespace or control characters (a header value could never carry them).

Environment variables and argv are readable by every process of the same user through /proc, which is why neither
is accepted.
"""

from __future__ import annotations

import errno
import os
import stat

from gyre_sched.errors import SecretError

__all__ = ["MAX_SECRET_BYTES", "SecretError", "read_secret"]

MAX_SECRET_BYTES = 4096
"""A token is one short line; a larger source is the wrong file, not a long token."""


def read_secret(file: str | os.PathLike[str] | None = None, fd: int | None = None) -> str | None:
    """The token from `file` or `fd` (see the module docstring); None when neither is given."""
    if file is not None and fd is not None:
        raise SecretError("give a token file or a token fd, not both")
    if fd is not None:
        where = f"token fd {fd}"
        raw = _read_fd(fd, where)
    elif file is not None:
        where = f"token file {os.fspath(file)}"
        raw = _read_file(os.fspath(file), where)
    else:
        return None
    return _parse(raw, where)


def _read_fd(fd: int, where: str) -> bytes:
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := os.read(fd, 4096):
            size += len(chunk)
            if size > MAX_SECRET_BYTES:
                raise SecretError(f"{where}: more than {MAX_SECRET_BYTES} bytes; a token is one short line")
            chunks.append(chunk)
    except OSError as e:
        raise SecretError(f"{where}: {e.strerror}") from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def _read_file(path: str, where: str) -> bytes:
    # O_NOFOLLOW: a symbolic link is refused, not followed; O_NONBLOCK: opening a FIFO cannot hang the service
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SecretError(f"{where}: a symbolic link; give the token file itself") from None
        raise SecretError(f"{where}: {e.strerror}") from None
    try:
        st = os.fstat(fd)  # of what was opened: no window between the check and the read
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"{where}: not a regular file")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(f"{where}: readable by others (mode {oct(st.st_mode & 0o777)}); chmod 600 it")
        if st.st_size > MAX_SECRET_BYTES:
            raise SecretError(
                f"{where}: {st.st_size} bytes, more than {MAX_SECRET_BYTES}; a token is one short line"
            )
        chunks: list[bytes] = []
        while chunk := os.read(fd, MAX_SECRET_BYTES + 1):
            chunks.append(chunk)
            if sum(map(len, chunks)) > MAX_SECRET_BYTES:  # it grew after the fstat
                raise SecretError(f"{where}: more than {MAX_SECRET_BYTES} bytes; a token is one short line")
        return b"".join(chunks)
    except OSError as e:
        raise SecretError(f"{where}: {e.strerror}") from None
    finally:
        os.close(fd)


def _parse(raw: bytes, where: str) -> str:
    if raw.endswith(b"\n"):
        raw = raw[:-1]
    if not raw:
        raise SecretError(f"{where}: empty token")
    try:
        token = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SecretError(f"{where}: not UTF-8 text") from None
    if not token.isprintable() or any(c.isspace() for c in token):
        raise SecretError(
            f"{where}: a token is one line without spaces or control characters (only one trailing newline "
            "is dropped)"
        )
    return token
