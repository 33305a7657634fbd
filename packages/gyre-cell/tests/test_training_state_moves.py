"""A restore never reads an offload that is still being written (the core's final save restoring its state while a
role switch offloads it: "SafetensorError: header too small" ended runs)."""

from __future__ import annotations

import threading

import torch

from gyre_cell import roles
from gyre_cell.roles import TorchTrainingState


class _WatchedLock:
    """The state's lock, reporting when a second mover has to wait for the first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.contended = threading.Event()

    def __enter__(self) -> None:
        if not self.lock.acquire(blocking=False):
            self.contended.set()
            self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_restore_waits_for_an_offload_in_progress(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = TorchTrainingState(model, opt)
    state._moving = watched = _WatchedLock()
    writing, release = threading.Event(), threading.Event()
    real_save = roles.save_file

    def held_save(tensors, path):  # the offload is mid-write: the file exists, empty
        writing.set()
        assert release.wait(60)
        real_save(tensors, path)

    monkeypatch.setattr(roles, "save_file", held_save)
    errors: list[BaseException] = []

    def run(fn):
        try:
            fn()
        except BaseException as exc:  # surfaced by the asserts below
            errors.append(exc)

    offload = threading.Thread(target=run, args=(state.offload_blocking,))
    offload.start()
    assert writing.wait(60)
    restore = threading.Thread(target=run, args=(state.restore_blocking,))
    restore.start()
    assert watched.contended.wait(60), errors  # the restore waits for the offload instead of reading its file
    release.set()
    offload.join(60)
    restore.join(60)
    assert errors == [] and not state.offloaded
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
