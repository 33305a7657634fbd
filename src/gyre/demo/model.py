"""The demo policy: a small Qwen3 model built offline, deterministically, and briefly trained to act in the demo's tasks.

A random tiny model never emits a tool call, so nothing of the agentic path (tool calls recorded as policy tokens,
tool results as context, trees with several leaves, J_max selection) would do any work, and there is nothing for RL
to amplify. `demo_policy()` therefore builds, once per machine, a model that can act:

1. **Transcripts.** The built-in agent's own conversation loop (`gyre.demo.agent.run_conversation`, context resets
   included) runs queries of the demo's task family (`gyre.tasks.random_query`) against a scripted teacher, with
   real files and real tools. The teacher is deliberately uneven, like the data a base model is pre-trained on:
   after reading a file that links on it follows the link, answers at once with that file's code, or reads a
   file the link does not name; sometimes it guesses without reading, or lists the files first. Its mean reward
   is about 0.47.
2. **Tokens exactly as the proxy makes them.** Each model call is rendered with the tokenizer's Qwen3 chat template
   and encoded the way the TITO proxy encodes a request (`gyre_tito.render.ChatTokenizer`, earlier outputs spliced
   in verbatim); a chain of calls is one training sequence, a context reset starts another. The loss covers the
   teacher's outputs only (the tokens the policy will produce), never prompts or tool results.
3. **Tokenizer and model.** A byte-level BPE (Qwen special tokens as single ids, the same chat template as
   `gyre_tito.tiny_tokenizer`) trained on the transcripts' text, and a `Qwen3ForCausalLM` of about 0.5M
   parameters (2 layers, width 128, tied embeddings), trained for 200 AdamW steps from a seeded init on one thread.
   Copying (a file name from the latest link, the latest code) is what a model this small learns last: trained
   on everything at once it stays at chance for hundreds of steps. So the first 70% of the steps train on a short
   form of the transcripts (no system prompt, no tools) with the loss on the copied tokens weighted 10x over the
   rest; the last 30% on the real form, every token alike.

The result behaves like the teacher's mixture, imperfectly: about 60% of its outputs are well-formed tool calls, it
reaches the end of a chain about one time in five and scores about 0.27 on average; RL on the real loop has to do
the rest. The build takes about 85 s of one core. The
directory lands in the user's cache (`$GYRE_CACHE_DIR`, else `$XDG_CACHE_HOME/gyre`, else `~/.cache/gyre`) under a
key that hashes this module, the task family and the agent, so changing any of them rebuilds it; builds are atomic
(written aside, then renamed) and serialized by a file lock. `python -m gyre.demo.model [--out DIR]` builds it and
prints where it is and what the build measured.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from gyre import tasks
from gyre.demo import agent

log = logging.getLogger("gyre")

__all__ = [
    "DemoPolicyConfig",
    "Teacher",
    "build_demo_policy",
    "cache_key",
    "cache_root",
    "demo_policy",
    "synthetic_transcripts",
    "training_sequences",
]

_BUILD_VERSION = 1
"""Bump to invalidate every cached build (the key also hashes the sources it depends on)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Teacher:
    """The scripted teacher's mixture of behaviours. After reading a file that links on, it follows the link,
    answers with that file's code at once, or reads another file; at the file without a link it answers its code."""

    follow: float = 0.45
    stop: float = 0.25
    """Else: read a file the link does not name."""
    guess: float = 0.15
    """Answer a random code before reading anything."""
    list_first: float = 0.25
    """List the files before the first read."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoPolicyConfig:
    """Everything the build depends on; hashed into the cache key."""

    transcripts: int = 1500
    """Synthetic transcripts drawn (each gives one sequence per context, i.e. 1 or 2)."""
    teacher: Teacher = Teacher()
    vocab_size: int = 1024
    """BPE entries, special tokens included (also the model's vocabulary)."""
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    """Tied input/output embeddings: copying a token from the context is then close to an identity map."""
    steps: int = 200
    """AdamW steps."""
    batch_sequences: int = 16
    lr: float = 5e-3
    warmup_steps: int = 20
    decay_steps: int = 40
    weight_decay: float = 0.0
    short_fraction: float = 0.7
    """Share of the steps (the first ones) trained on the short form (no system prompt, no tools), where what to
    copy stands out in a short context."""
    short_batch: int = 32
    short_other_weight: float = 0.1
    """In the short phase the loss is mean(copied tokens) + this * mean(other targets): the copies (a file name
    from the latest link, the latest code) are learned first; learned together with the format from the start,
    they stay at chance for hundreds of steps. Afterwards both weigh 1."""
    threads: int = 1
    """torch threads of the build: fixed, so the result does not depend on the machine's core count (and one
    thread is the fastest for a model this small on a shared machine)."""
    context_chars: int = 150
    """The agent's context-reset threshold the transcripts are generated with (the demo run uses the same)."""
    max_turns: int = 6
    seed: int = 0


# ---- transcripts ------------------------------------------------------------------------------------------------
def _tool_call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class _TeacherRun:
    """One scripted execution: reacts to what it has read (it knows the workspace), with the teacher's mixture."""

    def __init__(self, query: tasks.Query, teacher: Teacher, rng: random.Random, max_turns: int) -> None:
        self.query, self.teacher, self.rng, self.max_turns = query, teacher, rng, max_turns
        self.raw: list[str] = []
        self.call_of: dict[str, int] = {}  # tool-call id -> index of the call that produced it
        self.last: str | None = None  # the file read last

    def _next_output(self) -> str:
        t, rng, q = self.teacher, self.rng, self.query
        k = len(self.raw)
        if k == 0:
            if rng.random() < t.guess:
                return f"The code is {rng.choice(tasks.CODE_WORDS)}."
            if rng.random() < t.list_first:
                return _tool_call("list_files", {})
        if self.last is None:
            self.last = q.chain[0]
        else:
            link = q.field(self.last, "next")
            u = rng.random()
            if link is None or k >= self.max_turns - 1 or u >= t.follow + (1 - t.follow - t.stop):
                return f"The code is {q.field(self.last, 'code')}."  # " pink": the very token the file holds
            if u < t.follow:
                self.last = link
            else:
                self.last = rng.choice([f for f in tasks.FILE_NAMES if f not in (self.last, link)])
        return _tool_call("read_file", {"path": self.last})

    def __call__(self, messages: list[dict]) -> dict:
        from gyre_tito.parse import parse_output

        k = len(self.raw)
        raw = self._next_output()
        self.raw.append(raw)
        parsed = parse_output(raw)  # the assistant message the proxy would return (OpenAI shape)
        calls = []
        for i, c in enumerate(parsed.tool_calls):
            self.call_of[f"call_{k}_{i}"] = k
            calls.append(
                {
                    "id": f"call_{k}_{i}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
            )
        message: dict = {"role": "assistant", "content": parsed.text if (parsed.text or not calls) else None}
        if calls:
            message["tool_calls"] = calls
        return message


@dataclass
class Transcript:
    query: tasks.Query
    calls: list[tuple[list[dict], str]]
    """(messages sent, raw output text) per model call."""
    call_of: dict[str, int]
    """Tool-call id -> the call whose output holds it."""
    resets: int
    reward: float


def synthetic_transcripts(
    count: int, teacher: Teacher, seed: int, context_chars: int, max_turns: int
) -> Iterator[Transcript]:
    """`count` teacher executions of random queries through the built-in agent's loop (real files, real tools)."""
    rng = random.Random(f"gyre-demo-transcripts-{seed}")
    with tempfile.TemporaryDirectory(prefix="gyre-demo-ws-") as tmp:
        for i in range(count):
            query = tasks.random_query(rng, f"synthetic-{i}")
            workspace = Path(tmp) / str(i)
            query.setup(workspace)
            run = _TeacherRun(query, teacher, rng, max_turns)
            result = agent.run_conversation(
                run, workspace, query.prompt, max_turns, context_chars, record=True
            )
            shutil.rmtree(workspace)
            calls = [(messages, raw) for (messages, _), raw in zip(result.transcript, run.raw, strict=True)]
            reward = tasks.score_answer(result.answer or "", query.codes)
            yield Transcript(query, calls, run.call_of, result.resets, reward)


# ---- tokens -----------------------------------------------------------------------------------------------------
def training_sequences(
    chat, transcript: Transcript, short: bool = False
) -> list[tuple[list[int], list[int]]]:
    """(token ids, target mask) per context of the transcript, encoded as the proxy encodes requests.

    Each call's prompt is rendered with earlier outputs spliced in verbatim (`ChatTokenizer.encode_rendered`, as
    `gyre_tito.proxy.Proxy.encode` does). Within one context a prompt extends the previous prompt plus its output
    (checked), so the context's sequence is its last prompt plus that call's output, with targets on every output
    token; a context reset starts a new sequence."""
    from gyre_tito.render import recorded_marker

    sequences: list[tuple[list[int], list[int]]] = []
    outputs: list[list[int]] = []  # each call's output ids, <|im_end|> included
    chain: tuple[list[int], list[int]] | None = None  # (ids, marks) of the current context
    for messages, raw in transcript.calls:
        recorded: list[list[int]] = []
        template: list[dict] = []
        for m in messages:
            ids = [transcript.call_of[c["id"]] for c in m.get("tool_calls") or []]
            if m["role"] == "assistant" and ids:
                recorded.append(outputs[ids[0]])
                template.append({"role": "assistant", "content": recorded_marker(len(recorded) - 1)})
            else:
                template.append(m)
        if short:  # the curriculum's short form: no system prompt, no tools
            template = [m for m in template if m["role"] != "system"]
        text = chat.render(template, None if short else agent.TOOLS, add_generation_prompt=True)
        enc = chat.encode_rendered(text, recorded, [""] * len(recorded))
        prompt, policy = list(enc.ids), list(enc.policy)
        out = [*chat.encode_text(raw), chat.im_end_id]
        outputs.append(out)
        marks = _output_marks(chat, out, "<tool_call>" in raw)
        if recorded:  # the same context: the prompt extends the previous prompt and output
            if chain is None or prompt[: len(chain[0])] != chain[0]:
                raise AssertionError("a prompt does not extend its context's previous prompt and output")
            if any(policy[len(chain[0]) :]):
                raise AssertionError("recorded outputs beyond the previous call's")
            chain = (prompt + out, chain[1] + [0] * (len(prompt) - len(chain[0])) + marks)
        else:  # a new context (the first call or after a reset)
            if chain is not None:
                sequences.append(chain)
            chain = (prompt + out, [0] * len(prompt) + marks)
    if chain is not None:
        sequences.append(chain)
    return sequences


_LETTERS = {name.split(".")[0] for name in tasks.FILE_NAMES}


_CODES = {" " + code for code in tasks.CODE_WORDS}


def _output_marks(chat, out: list[int], tool_call: bool) -> list[int]:
    """Target marks of one output: 3 on a file name in a tool call, 2 on the code of an answer, else 1.

    Only tokens that copy something from the context are marked: the choices (call a tool or answer, which tool)
    are made on unmarked tokens, so weighting the marked ones does not tilt the teacher's mixture."""
    copies = _LETTERS if tool_call else _CODES
    return [(3 if tool_call else 2) if s in copies else 1 for s in chat.token_strings(out)]


# ---- tokenizer --------------------------------------------------------------------------------------------------
def _transcript_text(transcript: Transcript) -> list[str]:
    texts = []
    for messages, raw in transcript.calls:
        texts.extend(m.get("content") or "" for m in messages)
        texts.append(raw)
    return texts


def build_tokenizer(out: Path, corpus: list[str], vocab_size: int) -> None:
    """A byte-level BPE with the Qwen special tokens and gyre-tito's Qwen3 chat template, trained on `corpus`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from gyre_tito.tiny_tokenizer import CORPUS, QWEN3_CHAT_TEMPLATE, SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    template_text = agent.SYSTEM_PROMPT + "\n" + QWEN3_CHAT_TEMPLATE + json.dumps(agent.TOOLS)
    tok.train_from_iterator(list(CORPUS) + [template_text] * 8 + corpus, trainer=trainer)
    if tok.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise RuntimeError(f"demo tokenizer has more than {vocab_size} ids")
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=False)
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    extra = [t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_end|>")]
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": extra,
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    specials = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "additional_special_tokens": extra}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").write_text(QWEN3_CHAT_TEMPLATE)


# ---- training ---------------------------------------------------------------------------------------------------
def _common_prefix(sequences: list[tuple[list[int], list[int]]]) -> int:
    """Length of the prompt every sequence starts with (no target inside)."""
    first = sequences[0][0]
    n = min(len(s[0]) for s in sequences)
    for ids, mask in sequences:
        i = 0
        while i < n and ids[i] == first[i] and not mask[i]:
            i += 1
        n = i
    return n


def _pad(batch, prefix: int, pad_id: int):
    """Right-padded suffixes (after `prefix` shared tokens), next-token labels, target marks, attention mask."""
    import torch

    width = max(len(ids) for ids, _ in batch) - prefix
    ids = torch.full((len(batch), width), pad_id)
    labels = torch.full((len(batch), width), -100)
    marks = torch.zeros((len(batch), width), dtype=torch.long)
    attention = torch.zeros((len(batch), prefix + width), dtype=torch.long)
    attention[:, :prefix] = 1
    for row, (seq, mask) in enumerate(batch):
        suffix, smask = seq[prefix:], mask[prefix:]
        ids[row, : len(suffix)] = torch.tensor(suffix)
        attention[row, prefix : prefix + len(suffix)] = 1
        labels[row, : len(suffix) - 1] = torch.tensor(
            [t if m else -100 for t, m in zip(suffix[1:], smask[1:], strict=True)]
        )
        marks[row, : len(suffix) - 1] = torch.tensor(smask[1:])
    return ids, labels, marks, attention


def train_policy(
    model,
    sequences: list[tuple[list[int], list[int]]],
    cfg: DemoPolicyConfig,
    pad_id: int,
    short: list[tuple[list[int], list[int]]] | None = None,
    log_every: int = 0,
) -> dict:
    """Next-token loss on the target tokens, AdamW with warm-up then cosine decay, fixed steps and order.

    The first `short_fraction` of the steps train on the short form (`short`: no system prompt, no tools), where
    what to copy stands out in a short context; the rest on the real form. Every real sequence starts with the same
    prompt (system prompt and tools): each step computes it once and shares its keys/values across the batch
    (gradients flow through it), which cuts the work about threefold."""
    import torch
    from transformers import DynamicCache

    # keep one prefix token in the suffix: it predicts the first suffix token
    prefix = _common_prefix(sequences) - 1
    prefix_ids = torch.tensor([sequences[0][0][:prefix]])
    rng = random.Random(f"gyre-demo-train-{cfg.seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    short_steps = int(cfg.short_fraction * cfg.steps) if short else 0

    def lr_at(step: int) -> float:  # warm-up, constant, then a linear decay over the last `decay_steps`
        return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps, (cfg.steps - step) / cfg.decay_steps)

    model.train()
    history: list[tuple[float, float, float]] = []  # (loss, copy-token loss, other-token loss)
    for step in range(cfg.steps):
        phase_short = step < short_steps
        pool, n, shared = (
            (short, cfg.short_batch, 0) if phase_short else (sequences, cfg.batch_sequences, prefix)
        )
        batch = [pool[rng.randrange(len(pool))] for _ in range(n)]
        ids, labels, marks, attention = _pad(batch, shared, pad_id)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        cache = None
        if shared:
            cache = DynamicCache(config=model.config)
            model(input_ids=prefix_ids, past_key_values=cache, use_cache=True)
            cache.batch_repeat_interleave(len(batch))
        logits = model(input_ids=ids, past_key_values=cache, attention_mask=attention, use_cache=False).logits
        token_loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
        )
        m = marks.reshape(-1)
        copy, other = (m >= 2).float(), (m == 1).float()
        copy_loss = (token_loss * copy).sum() / copy.sum().clamp(min=1)
        other_loss = (token_loss * other).sum() / other.sum().clamp(min=1)
        loss = copy_loss + (cfg.short_other_weight if phase_short else 1.0) * other_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history.append((float(loss.detach()), float(copy_loss.detach()), float(other_loss.detach())))
        if log_every and (step + 1) % log_every == 0:
            recent = history[-log_every:]
            print(
                f"step {step + 1}: loss {sum(h[0] for h in recent) / len(recent):.3f} "
                f"copy {sum(h[1] for h in recent) / len(recent):.3f} "
                f"other {sum(h[2] for h in recent) / len(recent):.3f}",
                file=sys.stderr,
                flush=True,
            )
    model.eval()
    tail = history[-10:]
    return {
        "first_loss": round(history[0][0], 4),
        "final_loss": round(sum(h[0] for h in tail) / len(tail), 4),
        "final_copy_loss": round(sum(h[1] for h in tail) / len(tail), 4),
        "prefix_tokens": prefix,
    }


# ---- build and cache --------------------------------------------------------------------------------------------
def cache_root() -> Path:
    """`$GYRE_CACHE_DIR`, else `$XDG_CACHE_HOME/gyre`, else `~/.cache/gyre`."""
    if os.environ.get("GYRE_CACHE_DIR"):
        return Path(os.environ["GYRE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gyre"


def cache_key(cfg: DemoPolicyConfig) -> str:
    """Hash of the build's settings and of the sources its data comes from (this module, the tasks, the agent)."""
    h = hashlib.sha256(f"v{_BUILD_VERSION}".encode())
    h.update(json.dumps(asdict(cfg), sort_keys=True).encode())
    for module in (sys.modules[__name__], tasks, agent):
        h.update(Path(module.__file__).read_bytes())
    from gyre_tito.tiny_tokenizer import QWEN3_CHAT_TEMPLATE

    h.update(QWEN3_CHAT_TEMPLATE.encode())
    return h.hexdigest()[:16]


def build_demo_policy(out_dir: str | Path, cfg: DemoPolicyConfig | None = None, log_every: int = 0) -> dict:
    """Build the demo policy into `out_dir` (a Hugging Face checkpoint with its tokenizer); returns the build report."""
    started, cpu0 = time.monotonic(), time.process_time()
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from gyre_tito.render import ChatTokenizer

    cfg = cfg or DemoPolicyConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        transcripts = list(
            synthetic_transcripts(cfg.transcripts, cfg.teacher, cfg.seed, cfg.context_chars, cfg.max_turns)
        )
        corpus = [text for t in transcripts[: max(1, len(transcripts) // 4)] for text in _transcript_text(t)]
        build_tokenizer(out, corpus, cfg.vocab_size)
        chat = ChatTokenizer(out)
        sequences = [s for t in transcripts for s in training_sequences(chat, t)]
        short = [s for t in transcripts for s in training_sequences(chat, t, short=True)]
        data_s = time.monotonic() - started
        hf_config = Qwen3Config(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=cfg.tie_word_embeddings,
            eos_token_id=chat.im_end_id,
            pad_token_id=chat.added["<|endoftext|>"],
            torch_dtype="float32",
        )
        rng_state = torch.random.get_rng_state()
        try:
            torch.manual_seed(cfg.seed)
            model = Qwen3ForCausalLM(hf_config).to(torch.float32)
            report = train_policy(model, sequences, cfg, chat.added["<|endoftext|>"], short, log_every)
        finally:
            torch.random.set_rng_state(rng_state)
        model.save_pretrained(out, safe_serialization=True)
        GenerationConfig(eos_token_id=chat.eos_ids, pad_token_id=chat.added["<|endoftext|>"]).save_pretrained(
            out
        )
    finally:
        torch.set_num_threads(threads)
    teacher_reward = sum(t.reward for t in transcripts) / len(transcripts)
    report |= {
        "key": cache_key(cfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "sequences": len(sequences),
        "teacher_reward": round(teacher_reward, 4),
        "data_s": round(data_s, 2),
        "wall_s": round(time.monotonic() - started, 2),
        "cpu_s": round(time.process_time() - cpu0, 2),
        "config": asdict(cfg),
    }
    (out / "gyre_demo_policy.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def demo_policy(cfg: DemoPolicyConfig | None = None, root: Path | None = None) -> Path:
    """The cached demo policy's directory, built first if it is not there (atomic; concurrent callers wait)."""
    cfg = cfg or DemoPolicyConfig()
    root = root or cache_root()
    target = root / f"demo-policy-{cache_key(cfg)}"
    if (target / "gyre_demo_policy.json").exists():
        return target
    with _locked(root / "demo-policy.lock"):
        if (target / "gyre_demo_policy.json").exists():
            return target
        log.info("building the demo policy (once per machine) in %s", target)
        tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
        try:
            report = build_demo_policy(tmp, cfg)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info(
            "demo policy built in %.0f s (%d parameters, final loss %.3f)",
            report["wall_s"],
            report["parameters"],
            report["final_loss"],
        )
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre.demo.model", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=None, help="build into this directory instead of the cache"
    )
    parser.add_argument("--log-every", type=int, default=0, help="print the training loss every N steps")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if args.out is not None:
        report = build_demo_policy(args.out, log_every=args.log_every)
        print(json.dumps({"path": str(args.out), **{k: v for k, v in report.items() if k != "config"}}))
    else:
        path = demo_policy()
        report = json.loads((path / "gyre_demo_policy.json").read_text())
        print(json.dumps({"path": str(path), **{k: v for k, v in report.items() if k != "config"}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
