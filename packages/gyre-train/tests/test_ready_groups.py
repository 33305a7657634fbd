"""Advantages are given with complete groups (add_group / ReadyGroupMessage), never computed by packing."""

from __future__ import annotations

import math
import random

import orjson
import pytest
from pydantic import ValidationError

from gyre_eval.groups import group_advantages
from gyre_tito.export import write_trajectories
from gyre_train.buffer import ExecutionEntry, TrajectoryBuffer
from gyre_train.packing import PackingConfig, StreamPackingBuffer
from gyre_train.testing.synthetic import make_trajectory, placeholder
from gyre_train.types import ReadyExecution, ReadyGroupMessage


def _trajs(rng, eid, gid, k=2):
    return [make_trajectory(rng, eid, gid, j, rng.randint(12, 40)) for j in range(k)]


def _pack_all(buffer, n, b, version=0):
    packer = StreamPackingBuffer(PackingConfig(group_size=n, batch_groups=b, tokens_per_shard=64), buffer)
    packer.open_batch(0, version)
    out = []
    while not packer.closed:
        out += packer.next_microsteps()
    return packer, out


def test_packing_uses_the_given_advantages_never_computes_them():
    rng = random.Random(3)
    buf = TrajectoryBuffer(3)
    given = {"a-0": 0.7, "a-1": -0.25, "a-2": 3.5}  # not GRPO of the rewards below (which are all equal)
    entries = [ExecutionEntry(eid, 1.0, adv, tuple(_trajs(rng, eid, "a"))) for eid, adv in given.items()]
    group = buf.add_group("a", 0, entries)
    assert [e.advantage for e in group.executions] == [0.7, -0.25, 3.5]
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]  # what computing them would have given
    packer, mss = _pack_all(buf, 3, 1)
    seen = {e.execution_id: e.advantage for m in mss for e in m.executions}
    assert seen == given
    assert {e.execution_id: e.advantage for e in packer.executions} == given


def test_no_work_placeholder_in_add_group_counts_with_no_targets():
    rng = random.Random(4)
    buf = TrajectoryBuffer(3)
    entries = [
        ExecutionEntry("p-0", 1.0, 0.8, tuple(_trajs(rng, "p-0", "p"))),
        ExecutionEntry("p-1", 0.0, -0.4, ()),  # no_work: no trajectories
        ExecutionEntry("p-2", 0.0, -0.4, (placeholder("p-2", "p"),)),  # or the placeholder trajectory
    ]
    buf.add_group("p", 2, entries)
    packer, mss = _pack_all(buf, 3, 1, version=2)
    infos = {e.execution_id: e for e in packer.executions}
    assert set(infos) == {"p-0", "p-1", "p-2"}
    assert (infos["p-1"].num_targets, infos["p-2"].num_targets) == (0, 0)
    assert infos["p-0"].num_targets == sum(t.num_targets for t in entries[0].trajectories) > 0
    assert {e.execution_id for m in mss for e in m.executions} == {"p-0"}
    assert all(m.norm == 3 for m in mss)


def test_add_group_refuses_bad_groups_and_adds_nothing():
    rng = random.Random(5)
    buf = TrajectoryBuffer(2)
    ok = [ExecutionEntry("g-0", 1.0, 1.0, tuple(_trajs(rng, "g-0", "g"))), ExecutionEntry("g-1", 0.0, -1.0)]
    with pytest.raises(ValueError, match="has 1 executions"):
        buf.add_group("g", 0, ok[:1])
    with pytest.raises(ValueError, match="twice"):
        buf.add_group("g", 0, [ok[0], ok[0]])
    with pytest.raises(ValueError, match="must be finite"):
        buf.add_group("g", 0, [ok[0], ExecutionEntry("g-1", 0.0, math.nan)])
    with pytest.raises(ValueError, match="added under g-1/g"):
        buf.add_group("g", 0, [ok[0], ExecutionEntry("g-1", 0.0, -1.0, tuple(_trajs(rng, "g-0", "g", 1)))])
    assert buf.num_ready == 0
    buf.add_group("g", 0, ok)
    with pytest.raises(ValueError, match="already complete"):
        buf.add_group("g", 0, ok)
    buf.add_execution("h", 0, "h-0", 1.0)
    with pytest.raises(ValueError, match="one by one"):
        buf.add_group("h", 0, [ExecutionEntry("h-0", 1.0, 0.0), ExecutionEntry("h-1", 1.0, 0.0)])
    assert buf.num_ready == 1 and buf.pop_ready().group_id == "g"


def test_add_execution_fills_advantages_from_rewards_and_checkpoints_keep_them():
    buf = TrajectoryBuffer(4, advantage_mode="mean")
    for i, r in enumerate([1.0, 0.0, 0.0, 0.5]):
        group = buf.add_execution("m", 1, f"m-{i}", r)
    assert [e.advantage for e in group.executions] == [0.625, -0.375, -0.375, 0.125]
    grpo = TrajectoryBuffer(2)
    grpo.add_execution("q", 0, "q-0", 1.0)
    assert grpo.add_execution("q", 0, "q-1", 0.0).executions[0].advantage == pytest.approx(1.0, abs=1e-5)
    grpo.add_group("r", 0, [ExecutionEntry("r-0", 0.0, 9.0), ExecutionEntry("r-1", 0.0, -9.0)])
    grpo.add_execution("s", 0, "s-0", 1.0)  # pending
    state = orjson.loads(orjson.dumps(grpo.state_dict()))
    back = TrajectoryBuffer(2)
    back.load_state_dict(state)
    assert [e.advantage for e in back.pop_ready().executions] == pytest.approx([1.0, -1.0], abs=1e-5)
    assert [e.advantage for e in back.pop_ready().executions] == [9.0, -9.0]  # given ones survive as given
    assert back.add_execution("s", 0, "s-1", 0.0).executions[1].advantage == pytest.approx(-1.0, abs=1e-5)
    # a checkpoint written before advantages were stored: they were GRPO of the rewards
    for g in state["ready"]:
        for e in g["executions"]:
            del e["advantage"]
    old = TrajectoryBuffer(2)
    old.load_state_dict(state)
    assert [e.advantage for e in old.pop_ready().executions] == pytest.approx([1.0, -1.0], abs=1e-5)
    assert [e.advantage for e in old.pop_ready().executions] == [0.0, 0.0]


def test_packing_config_has_no_advantage_mode():
    with pytest.raises(TypeError, match="advantage_mode"):
        PackingConfig(group_size=2, batch_groups=1, advantage_mode="grpo")


def _message(tmp_path, rng, gid="G", suffix="parquet"):
    trajs = {f"{gid}-x{i}": _trajs(rng, f"{gid}-x{i}", gid, 1 + i % 3) for i in range(3)}
    execs = []
    for i, (eid, ts) in enumerate(trajs.items()):
        path = tmp_path / f"{eid}.{suffix}"
        write_trajectories(path, ts)
        execs.append(
            ReadyExecution(
                execution_id=eid, reward=i / 2, advantage=0.1 * (i - 1), trajectories_path=str(path)
            )
        )
    no_work = tmp_path / f"{gid}-x3.{suffix}"
    write_trajectories(no_work, [placeholder(f"{gid}-x3", gid)])
    execs.append(
        ReadyExecution(
            execution_id=f"{gid}-x3",
            reward=0.0,
            advantage=-0.3,
            trajectories_path=str(no_work),
            placeholder=True,
        )
    )
    return ReadyGroupMessage(group_id=gid, policy_version=4, executions=execs), trajs


def test_ready_group_message_round_trips_and_validates(tmp_path):
    msg, _ = _message(tmp_path, random.Random(6))
    back = ReadyGroupMessage.model_validate(orjson.loads(orjson.dumps(msg.model_dump(mode="json"))))
    assert back == msg and back.executions[3].placeholder and back.policy_version == 4
    assert ReadyGroupMessage.model_validate_json(msg.model_dump_json()) == msg
    e = dict(execution_id="e", reward=1.0, advantage=0.5)
    with pytest.raises(ValidationError, match="no trajectories_path"):
        ReadyExecution(**e)
    assert ReadyExecution(**e, placeholder=True).trajectories_path is None
    with pytest.raises(ValidationError, match="finite"):
        ReadyExecution(**{**e, "advantage": math.inf}, trajectories_path="x.parquet")
    with pytest.raises(ValidationError, match="twice"):
        ReadyGroupMessage(
            group_id="g", policy_version=0, executions=[ReadyExecution(**e, placeholder=True)] * 2
        )
    with pytest.raises(ValidationError):
        ReadyGroupMessage(group_id="g", policy_version=-1, executions=[ReadyExecution(**e, placeholder=True)])


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_add_group_message_reads_gyre_tito_files(tmp_path, suffix):
    msg, trajs = _message(tmp_path, random.Random(7), suffix=suffix)
    buf = TrajectoryBuffer(4)
    group = buf.add_group_message(msg)
    assert (group.group_id, group.policy_version) == ("G", 4)
    by_id = {e.execution_id: e for e in group.executions}
    for eid, ts in trajs.items():
        assert list(by_id[eid].trajectories) == ts  # token ids, masks, behaviour log-probs exactly
    assert [e.advantage for e in group.executions] == [-0.1, 0.0, 0.1, -0.3]
    assert [e.reward for e in group.executions] == [0.0, 0.5, 1.0, 0.0]
    assert by_id["G-x3"].num_targets == 0 and by_id["G-x3"].trajectories[0].placeholder
    packer, mss = _pack_all(buf, 4, 1, version=5)
    assert {e.execution_id: e.advantage for e in packer.executions} == {
        "G-x0": -0.1,
        "G-x1": 0.0,
        "G-x2": 0.1,
        "G-x3": -0.3,
    }
    targets = sum(1 for m in mss for s in m.shards for x in s.exec_slot if x >= 0)
    assert targets == sum(t.num_targets for ts in trajs.values() for t in ts)
    assert {e.staleness for e in packer.executions} == {1}  # v_t 5 - v_d 4


def test_add_group_message_relative_paths_and_refusals(tmp_path):
    rng = random.Random(8)
    msg, _ = _message(tmp_path, rng)
    rel = msg.model_copy(
        update={
            "executions": [
                e.model_copy(update={"trajectories_path": e.trajectories_path.rsplit("/", 1)[1]})
                for e in msg.executions
            ]
        }
    )
    buf = TrajectoryBuffer(4)
    assert buf.add_group_message(rel, root=tmp_path).group_id == "G"

    def swapped(gid, i, path):
        m, _ = _message(tmp_path, rng, gid=gid)
        execs = list(m.executions)
        execs[i] = execs[i].model_copy(update={"trajectories_path": str(path)})
        return m.model_copy(update={"executions": execs})

    other = tmp_path / "other.parquet"
    write_trajectories(other, _trajs(rng, "A-x0", "G", 1))  # right execution id, group G instead of A
    with pytest.raises(
        ValueError, match=r"other\.parquet \(execution A-x0 of group A\) holds a trajectory of A-x0/G"
    ):
        buf.add_group_message(swapped("A", 0, other))
    targets = tmp_path / "targets.parquet"
    write_trajectories(targets, _trajs(rng, "B-x3", "B", 1))
    with pytest.raises(ValueError, match="placeholder execution has a trajectory with targets"):
        buf.add_group_message(swapped("B", 3, targets))
    ph = tmp_path / "ph.parquet"
    write_trajectories(ph, [placeholder("C-x0", "C")])
    with pytest.raises(ValueError, match="scored execution holds the placeholder"):
        buf.add_group_message(swapped("C", 0, ph))
    with pytest.raises(FileNotFoundError):
        buf.add_group_message(swapped("D", 1, tmp_path / "missing.parquet"))
    assert buf.num_ready == 1 and buf.num_pending == 0  # nothing of the refused messages was added
