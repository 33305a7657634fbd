"""What the engine reads from a checkpoint directory besides the weights: EOS ids and the tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gyre_train.hf_import import import_transformers


def _as_ids(eos: Any) -> list[int]:
    return list(eos) if isinstance(eos, list) else [] if eos is None else [eos]


def eos_token_ids(path: str, hf_cfg: Any) -> set[int]:
    """EOS ids from config.json and, when present, generation_config.json (requests stop on them)."""
    import_transformers()
    from transformers import GenerationConfig

    ids = set(_as_ids(getattr(hf_cfg, "eos_token_id", None)))
    if (Path(path) / "generation_config.json").exists():
        ids.update(_as_ids(GenerationConfig.from_pretrained(path).eos_token_id))
    return ids


def load_tokenizer(path: str) -> Any | None:
    """The checkpoint's tokenizer when it has one (for `text` and stop strings), else None
    (then the engine is token-in/token-out only, like SGLang with --skip-tokenizer-init)."""
    p = Path(path)
    if not (p / "tokenizer.json").exists() and not (p / "tokenizer_config.json").exists():
        return None
    import_transformers()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
