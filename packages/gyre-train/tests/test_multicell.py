"""Two cell processes over gloo: a satellite joins mid-batch; the summed gradient equals the float64 reference."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from gyre_train.advantages import group_advantages
from gyre_train.localrun import LocalRunSpec, launch
from gyre_train.loss import LossConfig
from gyre_train.loss_reference import RefExecution, reference_loss, trajectory_target_logprobs
from gyre_train.synthetic import make_groups


def _reference_grads(model_path: str, spec: LocalRunSpec) -> tuple[float, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    model.eval()
    execs = []
    for _, _, ex in make_groups(spec.batch_groups, spec.group_size, spec.seed, spec.max_len):
        for (_, _, trajs), a in zip(ex, group_advantages([r for _, r, _ in ex]), strict=True):
            lps = [trajectory_target_logprobs(model, t, 1.0) for t in trajs]
            bs = [torch.tensor([b for b, m in zip(t.behavior_logprobs, t.target_mask, strict=True) if m],
                               dtype=torch.float64) for t in trajs]  # fmt: skip
            execs.append(RefExecution(a, torch.cat(lps), torch.cat(bs)))
    loss = reference_loss(execs, spec.group_size * spec.batch_groups, LossConfig())
    loss.backward()
    return float(loss.detach()), torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.slow
def test_two_cell_processes_satellite_joins_mid_batch(tiny_model, tmp_path):
    spec = LocalRunSpec(model_path=tiny_model, out_dir=str(tmp_path), num_cells=2, steps=2, steps_per_burst=2,
                        wait_join_at=2, save_grads=True)  # fmt: skip
    assert launch(spec, timeout=240) == [0, 0]
    reports = [json.loads(line) for line in (tmp_path / "reports.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in reports] == [1, 2]
    first = reports[0]
    by_cell = {int(k): v for k, v in first["microsteps_by_cell"].items()}
    assert by_cell.get(1, 0) >= 1 and by_cell[0] >= 1  # both cells trained in step 0
    # step 1 ran after a non-final update (parameters broadcast to the satellite, which stayed)
    assert (tmp_path / "grads-1.pt").exists() and reports[1]["num_target_tokens"] > 0
    ref_loss, ref_grads = _reference_grads(tiny_model, spec)
    assert first["loss"] == pytest.approx(ref_loss, abs=1e-9)
    grads = torch.load(tmp_path / "grads-0.pt")
    assert torch.allclose(grads, ref_grads, atol=1e-6, rtol=0)
    assert float(ref_grads.abs().max()) > 1e-4
