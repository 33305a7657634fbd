"""Synthetic inputs for tests and benchmarks: a tiny seeded Qwen3 causal LM and synthetic gyre_tito trajectories.

Nothing here is downloaded: the model is built from a config with seeded random weights and saved to a local path.
"""

from __future__ import annotations

import random
from pathlib import Path

from gyre_tito.types import Trajectory, WeightSpan

TINY_VOCAB = 512


def build_tiny_model(path: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> str:
    """Save a seeded tiny Qwen3ForCausalLM (vocab 512) to ``path``; returns the path."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=TINY_VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def make_trajectory(
    rng: random.Random, execution_id: str, group_id: str, index: int, length: int, vocab: int = TINY_VOCAB
) -> Trajectory:
    """A context prefix, then alternating policy-output (target) and context spans; random behaviour log-probs."""
    ids = [rng.randrange(vocab) for _ in range(length)]
    mask = [0] * length
    spans = []
    p = max(1, length // 4)
    while p < length:
        n = min(rng.randint(1, 12), length - p)
        mask[p : p + n] = [1] * n
        spans.append(WeightSpan(start=p, end=p + n, engine_id="e0", weight_version="0"))
        p += n + rng.randint(1, 10)
    blp = [-rng.uniform(0.5, 8.0) if m else 0.0 for m in mask]
    return Trajectory(
        execution_id=execution_id,
        group_id=group_id,
        index=index,
        leaf_call_id=f"{execution_id}-c{index}",
        role_class="main/task",
        token_ids=ids,
        target_mask=mask,
        behavior_logprobs=blp,
        weight_versions=spans,
    )


def placeholder(execution_id: str, group_id: str) -> Trajectory:
    """The zero-reward stand-in for an execution with no assessable work (no tokens, no targets)."""
    return Trajectory(
        execution_id=execution_id,
        group_id=group_id,
        index=0,
        leaf_call_id=None,
        role_class="main/task",
        token_ids=[],
        target_mask=[],
        behavior_logprobs=[],
        weight_versions=[],
        placeholder=True,
    )


def make_groups(num_groups: int, group_size: int, seed: int = 0, max_len: int = 60, version: int = 0) -> list:
    """[(group_id, version, [(execution_id, reward, [Trajectory])])]; group 0's last execution is a placeholder."""
    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        gid = f"g{seed}-{g}"
        execs = []
        for i in range(group_size):
            eid = f"{gid}-x{i}"
            if i == group_size - 1 and g == 0:
                execs.append((eid, 0.0, [placeholder(eid, gid)]))
                continue
            trajs = [
                make_trajectory(rng, eid, gid, j, rng.randint(8, max_len)) for j in range(rng.randint(1, 3))
            ]
            execs.append((eid, float(rng.randint(0, 4)) / 4, trajs))
        groups.append((gid, version, execs))
    return groups
