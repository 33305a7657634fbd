"""Chat rendering with the model's own chat template, and encoding that never re-tokenizes recorded outputs.

`ChatTokenizer` loads a Hugging Face tokenizer directory with `tokenizers` + `jinja2` only (no transformers, so
no torch): `tokenizer.json` and the chat template from `tokenizer_config.json` or `chat_template.jinja`.

Encoding is exact and incremental:
- Added tokens (`<|im_start|>`, `<tool_call>`, ...) split the text before the pre-tokenizer runs, so encoding the
  pieces between them one by one gives the same ids as encoding the whole string. Pieces are memoised (bounded LRU),
  so a growing conversation only pays for its new pieces.
- An assistant turn that replays one of our recorded outputs is rendered as a sentinel (`recorded_marker(k)`) and
  replaced by the recorded token ids verbatim, whatever the template would re-render for it (Qwen3 drops earlier
  `<think>` blocks; harnesses reformat tool-call JSON). Those ids are flagged as policy tokens.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Environment
from jinja2.ext import loopcontrols
from tokenizers import Tokenizer

from gyre_tito.errors import TemplateError

__all__ = ["ChatTokenizer", "EncodedContext", "TemplateError", "recorded_marker"]

# The splice marker carries a per-process secret nonce: request text is rendered into the same string, and a marker a
# harness could type would splice earlier model output (flagged as policy tokens) into its context, or break the call.
# The rendered text never leaves the process, so the nonce cannot be learnt; text holding the private-use characters
# without it is ordinary text.
_MARK_OPEN = f"\ue000R{secrets.token_hex(16)}:"
_MARK_CLOSE = "\ue001"
_MARK_RE = re.compile(re.escape(_MARK_OPEN) + r"(\d+)" + re.escape(_MARK_CLOSE))


def recorded_marker(k: int) -> str:
    """Content placeholder for the k-th recorded output spliced into a render (private-use code points)."""
    return f"{_MARK_OPEN}{k}{_MARK_CLOSE}"


@dataclass
class EncodedContext:
    """Token ids of one rendered request (`array('i')`) plus per-token policy flags (1 = a recorded output)."""

    ids: array = field(default_factory=lambda: array("i"))
    policy: bytearray = field(default_factory=bytearray)
    text_chars: int = 0


class _Obj(dict):
    """A dict whose keys are also attributes: jinja's `x.key` then succeeds without raising and catching an
    AttributeError per access (the dominant cost of rendering long conversations). Missing keys stay undefined."""

    __slots__ = ()

    def __getattr__(self, k: str) -> Any:
        try:
            return self[k]
        except KeyError:
            raise AttributeError(k) from None


def _wrap(m: Any) -> Any:
    if isinstance(m, dict):
        return _Obj({k: _wrap(v) if k in ("tool_calls", "function") else v for k, v in m.items()})
    if isinstance(m, list):
        return [_wrap(x) for x in m]
    return m


def _raise(msg: str) -> None:
    raise TemplateError(msg)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    # Same defaults as transformers' chat-template `tojson`, so renders match apply_chat_template exactly.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ByteLRU:
    """Text -> token ids, least recently used first out, bounded by the bytes it really holds, thread-safe.

    Memory stays bounded whatever text requests carry (unique 120 KB messages used to pile up by entry count); an
    entry larger than an eighth of the budget is not kept at all. An entry keeps a 16-byte digest of its text, not the
    text (a 120 KB message was held whole as a key, in each of the two caches, and counted at one byte a character
    whatever its encoding), and its ids in an exact-size `array('i')`. `nbytes` is `sys.getsizeof` of every key and
    ids plus that of the ordered dict itself (its hash table and links, which grow in steps), so it bounds what the
    cache keeps alive (the proxy kept +215-300 MB after its executions ended, 1.7-2.4x what these caches counted; a
    fixed 160 bytes a slot later missed the table just after it grew, about 185 a slot, measured with tracemalloc)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries_bytes = 0
        """Keys and ids; the dict's own size is read when needed (`nbytes`)."""
        self._d: OrderedDict[bytes, array] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._entries_bytes + sys.getsizeof(self._d)

    @staticmethod
    def _key(text: str) -> bytes:
        # 128 bits: no two texts a run sees share a digest by chance, and none can be made to (keyed by content)
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    @staticmethod
    def _size(key: bytes, ids: array) -> int:
        return sys.getsizeof(key) + sys.getsizeof(ids)

    def get(self, text: str) -> array | None:
        key = self._key(text)
        with self._lock:
            ids = self._d.get(key)
            if ids is not None:
                self._d.move_to_end(key)
            return ids

    def put(self, text: str, ids: array) -> None:
        key, ids = self._key(text), array(ids.typecode, ids)  # a copy without the spare room of its growth
        size = self._size(key, ids)
        if size > self.max_bytes // 8:
            return
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self._entries_bytes -= self._size(key, old)
            self._d[key] = ids
            self._entries_bytes += size
            while self.nbytes > self.max_bytes and self._d:
                k, v = self._d.popitem(last=False)
                self._entries_bytes -= self._size(k, v)

    def __len__(self) -> int:
        return len(self._d)


class ChatTokenizer:
    """A tokenizer directory's tokenizer + chat template, with memoised exact encoding."""

    BIG_PIECE_CHARS = 65536
    """Pieces at least this long are encoded with `encode_batch`, which releases the GIL (plain `encode` holds it for
    the whole piece: a 3.7 MB piece froze every other thread for 15 s)."""

    def __init__(self, path: str | Path, cache_bytes: int = 64 << 20):
        p = Path(path)
        tj = p / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {p}")
        self.path = p
        self.tokenizer = Tokenizer.from_file(str(tj))
        cfg: dict[str, Any] = {}
        if (p / "tokenizer_config.json").is_file():
            cfg = json.loads((p / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (p / "chat_template.jinja").is_file():
            template = (p / "chat_template.jinja").read_text()
        if not template:
            raise ValueError(f"{p} has no chat template")
        self.template_source: str = template
        # A plain (not sandboxed) environment: the template is part of the operator's model directory, trusted like
        # the weights, and the sandbox's per-attribute checks cost more than the rest of a call at long contexts.
        env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(template)
        self._native = self._native_if_equivalent()
        added = self.tokenizer.get_added_tokens_decoder()
        self.added: dict[str, int] = {t.content: i for i, t in added.items()}
        alts = sorted(self.added, key=len, reverse=True)
        self._split_re = re.compile("(" + "|".join(re.escape(a) for a in alts) + ")") if alts else None
        self.im_end_id = self.added.get("<|im_end|>")
        self.eos_ids = [i for t, i in self.added.items() if t in ("<|im_end|>", "<|endoftext|>")]
        self._cache = ByteLRU(cache_bytes)  # piece between added tokens -> ids
        self._turns = ByteLRU(cache_bytes)  # text between two <|im_start|> -> ids
        self._turn_sep_id = self.added.get("<|im_start|>")
        self._suffixes: dict[tuple, str] = {}
        vocab = self.tokenizer.get_vocab(with_added_tokens=False)
        # the longest text one token can stand for: a text of B UTF-8 bytes has at least B / this many tokens
        self.max_token_bytes = (
            max((len(self.tokenizer.decode([i]).encode()) for i in vocab.values()), default=1) or 1
        )

    # ---- rendering -------------------------------------------------------------------------------------------
    def _native_if_equivalent(self):
        from gyre_tito.qwen3_render import PROBES, render_qwen3

        for msgs, tools, kw in PROBES:
            try:
                same = self._jinja(msgs, tools, **kw) == render_qwen3(msgs, tools, **kw)
            except Exception:
                same = False
            if not same:
                return None
        return render_qwen3

    @property
    def native(self) -> bool:
        """Whether renders use the native Qwen3 renderer (it matched this template on every probe)."""
        return self._native is not None

    def _jinja(self, messages, tools, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return self._template.render(
            messages=[_wrap(m) for m in messages],
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render with the chat template (transformers' `apply_chat_template(tokenize=False)` semantics)."""
        try:
            if self._native is not None:
                return self._native(messages, tools, add_generation_prompt, **kwargs)
            return self._jinja(messages, tools, add_generation_prompt, **kwargs)
        except TemplateError:
            raise
        except Exception as e:  # a template bug or odd input must surface as a 4xx, not a 500
            raise TemplateError(f"chat template failed: {e}") from e

    # ---- encoding --------------------------------------------------------------------------------------------
    def cache_bytes(self) -> int:
        """Bytes held by the encoding caches (bounded by their budget)."""
        return self._cache.nbytes + self._turns.nbytes

    def min_tokens(self, text: str) -> int:
        """A lower bound on the token count of `text`, without encoding it (for an early length check)."""
        return len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes

    def _encode_piece(self, piece: str) -> array:
        # releases the GIL: other threads and the event loop keep running
        if len(piece) >= self.BIG_PIECE_CHARS:
            return array("i", self.tokenizer.encode_batch([piece], add_special_tokens=False)[0].ids)
        return array("i", self.tokenizer.encode(piece, add_special_tokens=False).ids)

    def _encode_pieces(self, text: str) -> array:
        out = array("i")
        pieces = self._split_re.split(text) if self._split_re is not None else [text]
        for piece in pieces:
            if not piece:
                continue
            sid = self.added.get(piece)
            if sid is not None:
                out.append(sid)
                continue
            ids = self._cache.get(piece)
            if ids is None:
                ids = self._encode_piece(piece)
                self._cache.put(piece, ids)
            out.extend(ids)
        return out

    def encode_text(self, text: str) -> array:
        """Exact ids of `text` (added tokens parsed) as `array('i')`.

        Memoised twice: per turn (the text between two `<|im_start|>`, found with one C-level `str.split`, so a
        long conversation costs one hash lookup per turn) and, inside a new turn, per piece between added tokens."""
        if self._turn_sep_id is None:
            return self._encode_pieces(text)
        parts = text.split("<|im_start|>")
        out = self._encode_pieces(parts[0]) if parts[0] else array("i")
        for part in parts[1:]:
            ids = self._turns.get(part)
            if ids is None:
                ids = array("i", [self._turn_sep_id])
                ids.extend(self._encode_pieces(part))
                self._turns.put(part, ids)
            out.extend(ids)
        return out

    def encode_rendered(
        self, text: str, recorded: Sequence[Sequence[int]], prefixes: Sequence[str] | None = None
    ) -> EncodedContext:
        """Encode a render whose recorded assistant turns are `recorded_marker(k)` placeholders.

        Each marker becomes `recorded[k]` verbatim (policy tokens). `prefixes[k]` is text the generation prompt of
        that call put after the assistant header (Qwen3 with thinking off: `<think>\n\n</think>\n\n`); it is
        context the engine saw before the output, so it is restored in front of the marker (a re-render drops it).
        When that output ended with `<|im_end|>`, the template's own `<|im_end|>` right after the marker is the same
        token and is not added twice."""
        enc = EncodedContext(text_chars=len(text))
        pos = 0
        im_end = "<|im_end|>"
        while (start := text.find(_MARK_OPEN, pos)) >= 0:
            m = _MARK_RE.match(text, start)
            if m is None:
                raise TemplateError("malformed recorded-output marker in render")
            k = int(m.group(1))
            if k >= len(recorded):
                raise TemplateError(f"render refers to recorded output {k} that does not exist")
            pre = self.encode_text(text[pos : m.start()] + (prefixes[k] if prefixes else ""))
            enc.ids.extend(pre)
            enc.policy.extend(bytes(len(pre)))
            out = recorded[k]
            enc.ids.extend(out)
            enc.policy.extend(b"\x01" * len(out))
            pos = m.end()
            if out and out[-1] == self.im_end_id and text.startswith(im_end, pos):
                pos += len(im_end)
        rest = self.encode_text(text[pos:])
        enc.ids.extend(rest)
        enc.policy.extend(bytes(len(rest)))
        return enc

    def generation_suffix(self, **kwargs: Any) -> str:
        """What the generation prompt adds after the assistant header under these template arguments ("" for most;
        Qwen3 with `enable_thinking=False`: an empty think block). Found by rendering a one-message probe."""
        key = tuple(sorted(kwargs.items()))
        got = self._suffixes.get(key)
        if got is None:
            probe = [{"role": "user", "content": "x"}]
            with_gen = self.render(probe, None, True, **kwargs)
            without = self.render(probe, None, False, **kwargs)
            tail = with_gen[len(without) :] if with_gen.startswith(without) else ""
            header = "<|im_start|>assistant\n"
            got = self._suffixes[key] = tail[len(header) :] if tail.startswith(header) else ""
        return got

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Per-token text (for OpenAI logprobs): each id decoded alone."""
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
