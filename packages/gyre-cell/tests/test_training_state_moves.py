"""A restore never reads an offload that is still being written (the core's final save restoring its state while a
role switch offloads it: "SafetensorError: header too small" ended runs), and an offload on CPU leaves no named file
behind (a killed cell used to leave its whole training state in the temp folder)."""

from __future__ import annotations

import os
import tempfile
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

    class HeldSpill(roles.SpillFile):  # the offload is mid-write: nothing is in the spill yet
        def __init__(self, tensors):
            writing.set()
            assert release.wait(60)
            super().__init__(tensors)

    monkeypatch.setattr(roles, "SpillFile", HeldSpill)
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


def test_an_offload_on_cpu_names_no_file_and_restores_exactly(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 16, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    model(torch.randn(3, 16, dtype=torch.bfloat16)).float().sum().backward()  # grads of the next step held
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    opt_before = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
    state = TorchTrainingState(model, opt)
    resident = state.nbytes()
    state.offload_blocking()
    assert state.offloaded and state.nbytes() == 0
    assert state._spill is not None and state._spill.nbytes == resident  # all of it is on disk ...
    assert os.listdir(tmp_path) == []  # ... in a file without a name: a SIGKILL here leaves nothing
    state.restore_blocking()
    assert not state.offloaded and state._spill is None
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), before[n][0]) and torch.equal(p.grad, before[n][1]), n
    for s, s0 in zip(opt.state.values(), opt_before, strict=True):
        for k, v in s0.items():
            assert torch.equal(s[k], v), k
