import hashlib
import json

from gyre_cell.cli import main
from gyre_cell.tiny_model import build_tiny_model


def _digest(p):
    return hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()


def test_tiny_model_is_deterministic_and_has_tokenizer(tmp_path, tiny_model):
    from transformers import AutoConfig, AutoTokenizer  # slow to import: not at collection

    assert main(["tiny-model", str(tmp_path / "again")]) == 0
    assert _digest(tmp_path / "again") == _digest(tiny_model)
    other = build_tiny_model(
        tmp_path / "seed1", __import__("gyre_cell.tiny_model").tiny_model.TinyModelConfig(seed=1)
    )
    assert _digest(other) != _digest(tiny_model)

    cfg = AutoConfig.from_pretrained(tiny_model)
    assert cfg.model_type == "qwen3" and cfg.vocab_size == 512 and cfg.num_hidden_layers == 2
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert len(tok) <= 512
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg.eos_token_id == im_end
    assert json.loads((tiny_model / "gyre_tiny_model.json").read_text())["seed"] == 0
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user" in text and text.endswith("<|im_start|>assistant\n")
