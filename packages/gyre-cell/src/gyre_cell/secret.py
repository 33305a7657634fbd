"""Service tokens handed to a process by file or by file descriptor, never by environment or command line.

`read_secret(file=..., fd=...)` returns the stripped first line (None when neither is given). A file must not be
readable by group or others (a token in a world-readable file is no secret); an fd (a pipe the parent wrote the token
into and closed) is read to its end and closed. Environment variables and argv are readable by every process of the
same user through /proc, which is why neither is accepted.
"""

from __future__ import annotations

import os
import stat

__all__ = ["SecretError", "read_secret"]


class SecretError(ValueError):
    """A token source that cannot be used (missing, empty, or readable by others)."""


def read_secret(file: str | os.PathLike[str] | None = None, fd: int | None = None) -> str | None:
    if file is not None and fd is not None:
        raise SecretError("give a token file or a token fd, not both")
    if fd is not None:
        chunks = []
        try:
            while chunk := os.read(fd, 4096):
                chunks.append(chunk)
        except OSError as e:
            raise SecretError(f"token fd {fd}: {e.strerror}") from None
        finally:
            os.close(fd)
        raw = b"".join(chunks)
    elif file is not None:
        try:
            mode = os.stat(file).st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise SecretError(
                    f"token file {file}: readable by others (mode {oct(mode & 0o777)}); chmod 600 it"
                )
            with open(file, "rb") as f:
                raw = f.read(4096)
        except OSError as e:
            raise SecretError(f"token file {file}: {e.strerror}") from None
    else:
        return None
    token = raw.decode("utf-8", "replace").strip().splitlines()[0].strip() if raw.strip() else ""
    if not token:
        raise SecretError("empty token")
    return token
