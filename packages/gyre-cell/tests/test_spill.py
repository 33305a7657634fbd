"""gyre_cell.spill: tensors parked in an unnamed file come back bit for bit, and no name is ever left on disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from gyre_cell.spill import SpillFile


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(5, 7, generator=g),
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (4, 3), generator=g),
        "bool": torch.rand(9, generator=g) > 0.5,
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "transposed": torch.randn(6, 4, generator=g).t(),  # not contiguous
        "nan_inf": torch.tensor([float("nan"), float("inf"), -0.0]),
    }


def test_round_trip_is_bit_exact_for_every_dtype_and_shape(tmp_path):
    src = _tensors()
    with SpillFile(src, dir=str(tmp_path)) as spill:
        assert spill.nbytes == sum(t.numel() * t.element_size() for t in src.values())
        assert os.listdir(tmp_path) == []
        back = spill.load()
        again = spill.load()  # loads are independent copies
    assert list(back) == list(src)
    for name, t in src.items():
        b = back[name]
        assert b.dtype == t.dtype and b.shape == t.shape, name
        assert torch.equal(b.reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)), (
            name
        )
        assert b.data_ptr() != again[name].data_ptr() or b.numel() == 0
    with pytest.raises(ValueError, match="closed"):
        spill.load()


def test_a_process_killed_while_spilled_leaves_no_file(tmp_path):
    """The old named temp files stayed after a SIGKILL (129 training states, 63 engine backups after one CI run)."""
    code = (
        "import sys, torch; from gyre_cell.spill import SpillFile\n"
        f"s = SpillFile({{'w': torch.ones(1 << 20)}}, dir={str(tmp_path)!r})\n"
        "print(s.nbytes, flush=True); sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == str(4 << 20)  # spilled, the process holds it open
        held = [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
        assert any(link.startswith(str(tmp_path)) and link.endswith("(deleted)") for link in held), held
        assert os.listdir(tmp_path) == []
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert os.listdir(tmp_path) == []
