"""The one token reader of every service (`gyre_sched.secret`): what it accepts and each source it refuses."""

from __future__ import annotations

import os

import pytest

from gyre_sched.errors import SecretError
from gyre_sched.secret import MAX_SECRET_BYTES, read_secret


def _file(tmp_path, content: bytes, mode: int = 0o600, name: str = "token"):
    f = tmp_path / name
    f.write_bytes(content)
    f.chmod(mode)
    return f


def _pipe(content: bytes) -> int:
    r, w = os.pipe()
    os.write(w, content)
    os.close(w)
    return r


def test_a_private_file_and_a_pipe_give_the_token_without_its_one_newline(tmp_path):
    assert read_secret(_file(tmp_path, b"tok-1\n")) == "tok-1"
    assert read_secret(str(_file(tmp_path, b"tok-2", mode=0o400))) == "tok-2"
    r = _pipe(b"tok-3\n")
    assert read_secret(fd=r) == "tok-3"
    with pytest.raises(OSError):  # the reader closed the pipe's read end
        os.fstat(r)
    assert read_secret() is None


def test_a_symbolic_link_is_refused_not_followed(tmp_path):
    target = _file(tmp_path, b"tok\n")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(SecretError, match=r"token file .*link: a symbolic link"):
        read_secret(link)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_file_others_can_read_or_write_is_refused(tmp_path, mode):
    with pytest.raises(SecretError, match=rf"readable by others \(mode {oct(mode)}\); chmod 600 it"):
        read_secret(_file(tmp_path, b"tok\n", mode=mode))


@pytest.mark.parametrize("content", [b"", b"\n"])
def test_an_empty_file_or_pipe_is_refused(tmp_path, content):
    with pytest.raises(SecretError, match=r"token file .*: empty token"):
        read_secret(_file(tmp_path, content))
    with pytest.raises(SecretError, match=r"token fd \d+: empty token"):
        read_secret(fd=_pipe(content))


def test_a_source_over_the_size_cap_is_refused(tmp_path):
    big = b"x" * MAX_SECRET_BYTES + b"\n"
    with pytest.raises(SecretError, match=f"{MAX_SECRET_BYTES + 1} bytes, more than {MAX_SECRET_BYTES}"):
        read_secret(_file(tmp_path, big))
    with pytest.raises(SecretError, match=f"more than {MAX_SECRET_BYTES} bytes"):
        read_secret(fd=_pipe(big))
    assert read_secret(_file(tmp_path, b"y" * MAX_SECRET_BYTES)) == "y" * MAX_SECRET_BYTES  # the cap itself


@pytest.mark.parametrize("content", [b"a\nb\n", b"tok\n\n", b" tok\n", b"to k", b"tok\r\n", b"\xff\xfe"])
def test_only_one_line_without_whitespace_is_a_token(tmp_path, content):
    with pytest.raises(SecretError, match=r"one line without spaces|not UTF-8"):
        read_secret(_file(tmp_path, content))


def test_not_a_regular_file_missing_or_both_sources(tmp_path):
    d = tmp_path / "dir"
    d.mkdir(mode=0o700)
    with pytest.raises(SecretError, match="dir: not a regular file"):
        read_secret(d)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(SecretError, match="fifo: not a regular file"):  # refused at once, no writer awaited
        read_secret(fifo)
    with pytest.raises(SecretError, match="missing: No such file"):
        read_secret(tmp_path / "missing")
    r = _pipe(b"tok\n")
    try:
        with pytest.raises(SecretError, match="not both"):
            read_secret(_file(tmp_path, b"tok\n"), r)
    finally:
        os.close(r)
