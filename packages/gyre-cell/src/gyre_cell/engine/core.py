"""The torch engine: a scheduler thread that steps every running sequence together (continuous batching).

Requests join between steps: each step admits waiting requests (prefix-cache lookup, then prefill of the
uncached part) and runs them in the same forward as the decoding ones. Control operations (abort, pause,
release/resume, weight updates) take the same lock as a step, so they always land between two steps.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from gyre_cell.errors import EngineInputError, EngineStateError, KVCacheFullError
from gyre_train.hf_import import import_transformers

from .checkpoint import eos_token_ids, load_tokenizer
from .config import EngineConfig
from .kv_cache import PagedKVCache
from .kv_migration import KVMigrator
from .model_runner import ModelRunner, StepInput
from .request import Request, SamplingSpec, Sink, check_finish, render_response
from .sampling import sample_batch
from .script import ReplyScript
from .weights import WeightStore, check_allowed_dir, load_checkpoint_dir

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class TorchEngine:
    """Token-in/token-out generation engine for a local HF causal LM."""

    def __init__(self, config: EngineConfig) -> None:
        import_transformers()  # without its scan of the installed files (2 s of a worker's start)
        from transformers import AutoConfig, AutoModelForCausalLM

        self.config = config
        self.device = resolve_device(config.device)
        if config.cpu_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(config.cpu_threads)  # process-wide: the engine owns its server process
        dtype = getattr(torch, config.dtype)
        hf_cfg = AutoConfig.from_pretrained(config.model_path)
        model = AutoModelForCausalLM.from_pretrained(
            config.model_path, dtype=dtype, attn_implementation="sdpa"
        )
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.runner = ModelRunner(self.model)
        self.vocab_size = self.runner.vocab_size
        self.context_len = int(getattr(hf_cfg, "max_position_embeddings", 4096))
        self.eos_ids = eos_token_ids(config.model_path, hf_cfg)
        self.tokenizer = load_tokenizer(config.model_path)
        self.script = (
            ReplyScript(config.scripted_replies, self.tokenizer) if config.scripted_replies else None
        )
        backup = config.weights_backup
        if backup == "auto":  # a release must really free memory: CPU copy off the GPU, disk file on CPU
            backup = "cpu" if self.device.type == "cuda" else "disk"
        self.weights = WeightStore(self.model, device=self.device, backup=backup)
        self.kv = PagedKVCache(
            num_layers=self.runner.num_layers,
            kv_heads=self.runner.num_kv_heads,
            head_dim=self.runner.head_dim,
            block_size=config.kv_block_size,
            max_total_tokens=config.max_total_tokens,
            dtype=dtype,
            device=self.device,
        )
        self.model_path = config.model_path
        self.weight_version = config.weight_version
        self.released: set[str] = set()
        self.paused = False
        self.update_session_open = False
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Submission never waits for a running step: new requests land in an inbox under a small lock
        # and the loop moves them to `waiting` between steps. `_lock` serializes steps and control ops.
        self._by_rid: dict[str, Request] = {}
        self._inbox: list[Request] = []
        self._inbox_lock = threading.Lock()
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = False
        self._gen = torch.Generator().manual_seed(config.seed)
        self._tokens_generated = 0
        self.prefill_tokens_total = 0
        """Tokens computed at admission (prompt tokens not found in the prefix cache or a migrated sequence)."""
        self.context_prefill_tokens_total = 0
        """The same minus each admission's last token (the one whose logits start generation; for a request moved
        mid-decode, the token the source emitted but never wrote): context that was computed again."""
        self._started = time.monotonic()
        self.migrator = KVMigrator(self, mooncake=config.kv_transfer, ttl_s=config.kv_pin_ttl_s)
        self._thread = threading.Thread(target=self._loop, name="gyre-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._lock:
            self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.migrator.close()
        self.weights.close()

    # ---- requests ----------------------------------------------------------------------------
    def submit(
        self,
        *,
        rid: str,
        input_ids: list[int],
        sampling: SamplingSpec,
        return_logprob: bool,
        stream: bool,
        sink: Sink,
    ) -> None:
        """Queue a request; raises EngineInputError for bad input."""
        if not input_ids:
            raise EngineInputError("input_ids must not be empty")
        bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineInputError(f"input_ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if len(input_ids) >= self.context_len:
            raise EngineInputError(
                f"prompt of {len(input_ids)} tokens does not fit context {self.context_len}"
            )
        sampling.validate(self.vocab_size)
        if sampling.stop and self.tokenizer is None:
            raise EngineInputError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        if len(input_ids) + 1 > self.kv.capacity_tokens:
            raise EngineInputError(f"prompt of {len(input_ids)} tokens exceeds the KV pool")
        gen = None
        if sampling.sampling_seed is not None:
            gen = torch.Generator().manual_seed(sampling.sampling_seed)
        req = Request(rid, list(input_ids), sampling, return_logprob, stream, sink, gen)
        held = False
        if self.script is not None:
            req.forced = self.script.forced(req.input_ids)
            held = req.forced is None  # the script never answers it: known by its rid, never stepped
        with self._inbox_lock:
            if rid in self._by_rid:
                raise EngineInputError(f"rid {rid!r} is already running")
            self._by_rid[rid] = req
            if not held:
                self._inbox.append(req)
        self._wake.set()

    def abort(self, rid: str | None = None, *, abort_all: bool = False, message: str = "Aborted") -> int:
        """Finish requests with finish_reason abort and their partial output; returns how many."""
        with self._lock:
            self._drain_inbox()
            with self._inbox_lock:
                if abort_all:
                    targets = list(self._by_rid.values())
                else:
                    if rid not in self._by_rid:
                        raise EngineInputError(f"unknown rid {rid!r}")
                    targets = [self._by_rid[rid]]
            for req in targets:
                self._finish(
                    req, {"type": "abort", "message": message, "status_code": None, "err_type": None}
                )
            return len(targets)

    # ---- pause / memory ----------------------------------------------------------------------
    def pause(self, mode: str = "abort") -> None:
        with self._lock:
            if mode == "abort":
                self.abort(abort_all=True, message="Aborted by pause_generation")
            elif mode == "retract":
                for req in reversed(self.running):
                    self._retract(req)
            elif mode != "in_place":
                raise EngineInputError(f"unknown pause mode {mode!r} (abort, retract, in_place)")
            self.paused = True

    def resume_generation(self) -> None:
        with self._lock:
            self.paused = False
        self._wake.set()

    def _retract(self, req: Request) -> None:
        """Free a running request's KV and requeue it at the front; it re-prefills input + output."""
        assert req.seq is not None
        self.kv.free_sequence(req.seq, req.all_tokens()[: req.seq.num_tokens])
        req.seq, req.pending = None, []
        req.num_retractions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def release_memory(self, tags: list[str] | None) -> None:
        tags = self._check_tags(tags)
        if "kv_cache" in tags:  # let destinations finish reading pinned blocks (or the pins expire), bounded
            self.migrator.wait_idle(min(self.config.kv_pin_ttl_s, 10.0))
        with self._lock:
            if self.running:
                raise EngineStateError(
                    f"release_memory_occupation needs an idle engine ({len(self.running)} requests running): "
                    "pause_generation first"
                )
            if "weights" in tags:
                self.weights.release()
            if "kv_cache" in tags:
                self.migrator.drop_all()  # a destination still reading gets its ack refused and recomputes
                self.kv.release()
            self.released.update(tags)

    def resume_memory(self, tags: list[str] | None) -> None:
        tags = self._check_tags(tags)
        with self._lock:
            if "weights" in tags:
                self.weights.resume()
            if "kv_cache" in tags and not self.kv.allocated:
                self.kv.allocate()
            self.released.difference_update(tags)
        self._wake.set()

    @staticmethod
    def _check_tags(tags: list[str] | None) -> list[str]:
        if tags is None:
            return list(MEMORY_TAGS)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise EngineInputError(f"unknown memory tags {unknown} (known: {list(MEMORY_TAGS)})")
        return list(tags)

    def flush_cache(self) -> None:
        with self._lock:
            self._drain_inbox()
            if self.running or self.waiting:
                raise EngineStateError("flush_cache refused: requests are running or waiting")
            if self.kv.allocated:
                self.migrator.drop_adopted()
                self.kv.flush()

    # ---- weights -----------------------------------------------------------------------------
    def update_weights(
        self,
        named: Mapping[str, torch.Tensor],
        *,
        weight_version: str | None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        strict: bool = False,
        model_path: str | None = None,
        check_finite: bool = True,
    ) -> int:
        """Apply tensors by HF name between two steps; running requests continue on the new weights.
        `check_finite=False`: the source checked them (`WeightStore.apply`)."""
        with self._lock:
            if abort_all_requests:
                self.abort(abort_all=True, message="Aborted by weight update")
            n = self.weights.apply(named, strict=strict, check_finite=check_finite)
            if flush_cache and self.kv.allocated:
                self.migrator.drop_adopted()
                self.kv.flush()  # cached prefixes were computed with the old weights
            if weight_version is not None:
                self.weight_version = weight_version
            if model_path is not None:
                self.model_path = model_path
            return n

    def bind_weights(
        self, views: Mapping[str, torch.Tensor], lease: Any, *, weight_version: str, flush_cache: bool = True
    ) -> None:
        """Serve `views` (a publisher's buffer on this host, held by `lease`) as the parameters, between two steps:
        pointer swaps, no copy (`WeightStore.bind`; check `weights.bindable` first)."""
        with self._lock:
            self.weights.bind(views, lease)
            if flush_cache and self.kv.allocated:
                self.migrator.drop_adopted()
                self.kv.flush()  # cached prefixes were computed with the old weights
            self.weight_version = weight_version

    def between_steps(self) -> threading.RLock:
        """Held: no step runs (control operations take it too; re-entrant, so `update_weights` inside is fine)."""
        return self._lock

    def update_weights_from_disk(self, model_path: str, **kw: Any) -> int:
        check_allowed_dir(model_path, self.config.weight_dirs)
        return self.update_weights(load_checkpoint_dir(model_path), strict=True, model_path=model_path, **kw)

    def begin_weight_update(self) -> None:
        with self._lock:
            if self.update_session_open:
                raise EngineStateError("a weight update session is already open")
            self.update_session_open = True

    def end_weight_update(self) -> None:
        with self._lock:
            if not self.update_session_open:
                raise EngineStateError("no weight update session is open: call /begin_weight_update first")
            self.update_session_open = False

    def check_update_session(self) -> None:
        if self.config.require_update_session and not self.update_session_open:
            raise EngineStateError("weight update outside a session: call /begin_weight_update first")

    def set_weight_version(self, version: str, *, abort_all_requests: bool) -> None:
        with self._lock:
            if abort_all_requests:
                self.abort(abort_all=True, message="Aborted by update_weight_version")
            self.weight_version = version

    # ---- introspection -----------------------------------------------------------------------
    def load(self) -> dict[str, Any]:
        with self._lock:
            used = self.kv.used_tokens() if self.kv.allocated else 0
            cap = self.kv.capacity_tokens
            elapsed = max(time.monotonic() - self._started, 1e-9)
            return {
                "dp_rank": 0,
                "num_running_reqs": len(self.running),
                "num_waiting_reqs": len(self.waiting),
                "num_used_tokens": used,
                "max_total_num_tokens": cap,
                "token_usage": used / cap,
                "gen_throughput": self._tokens_generated / elapsed,
                "memory": {"weights_bytes": self.weights.nbytes(), "kv_cache_bytes": self.kv.nbytes()},
            }

    def is_idle(self) -> bool:
        return not self.running and not self.waiting and not self._inbox

    # ---- the loop ----------------------------------------------------------------------------
    def _runnable(self) -> bool:
        return not self.paused and not self.released and bool(self.running or self.waiting)

    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._drain_inbox()
                if self._stop:
                    return
                if self._runnable():
                    try:
                        self._step()
                    except Exception as e:  # never let the loop die: fail the batch, keep serving
                        for req in list(self.running) + list(self.waiting):
                            self._finish(req, {"type": "abort", "message": f"engine error: {e!r}"})
                    continue
                self._wake.clear()
            if self._inbox:  # arrived between the drain and the clear: no wake-up is lost
                continue
            self._wake.wait()

    def _admit(self) -> None:
        budget = self.config.max_prefill_tokens
        while self.waiting and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            tokens = req.all_tokens()
            adopted = self.migrator.match(tokens) if self.migrator.adopted else None
            if adopted is not None:  # KV migrated from another engine: its blocks, not a prefill
                seq = self.kv.adopt_sequence(adopted.blocks, len(adopted.tokens))
            else:
                seq = self.kv.new_sequence(tokens, reuse_prefix=self.config.enable_prefix_cache)
            new = len(tokens) - seq.num_tokens
            over_budget = new > budget and self.running
            if over_budget or self.kv.blocks_needed(seq, new) > self.kv.available_blocks():
                if adopted is None:
                    self.kv.free_sequence(seq, None)
                return
            if adopted is not None:
                seq = self.migrator.take(adopted)
                req.migrated_tokens += seq.num_tokens
            budget -= new
            self.prefill_tokens_total += new
            self.context_prefill_tokens_total += max(0, new - 1)
            self.waiting.popleft()
            req.seq, req.pending = seq, tokens[seq.num_tokens :]
            if not req.output_ids:
                req.cached_tokens = seq.num_cached
            self.running.append(req)

    def _revoked(self) -> bool:
        """Bound weights whose buffer the publisher rewrote (the engine missed a publication): every request
        ends, aborted, so its caller continues it elsewhere; nothing runs until a whole load (`WeightStore.revoke`).
        """
        if not self.weights.revoked and self.weights.intact():
            return False
        self.weights.revoke()
        message = "engine weights revoked: this engine missed a publication; it serves again once it loads"
        for req in list(self.running) + list(self.waiting):
            self._finish(req, {"type": "abort", "message": message})
        if self.kv.allocated:
            self.migrator.drop_adopted()
            self.kv.flush()
        return True

    def _step(self) -> None:
        if self._revoked():
            return
        self._admit()
        batch: list[StepInput] = []
        for req in list(self.running):
            while True:
                try:
                    start = req.seq.num_tokens
                    write = self.kv.reserve(req.seq, len(req.pending))
                    break
                except KVCacheFullError:
                    victim = self.running[-1]  # preempt the youngest; it recomputes later
                    self._retract(victim)
                    if victim is req:
                        if not self.running:  # alone and still too long for the whole pool
                            self._finish(req, {"type": "abort", "message": "KV cache too small for request"})
                        break
            if req in self.running:
                batch.append(StepInput(req.pending, start, write, self.kv.slots_of(req.seq)))
        if not batch:
            return
        stepped = list(self.running)
        logits_BV = self.runner.step(batch, self.kv)
        if self._revoked():  # the step read pages being rewritten: nothing it computed is kept
            return
        params = [(r.sampling.temperature, r.sampling.top_p, r.sampling.top_k, r.generator) for r in stepped]
        forced = [r.forced.pop(0) if r.forced else None for r in stepped] if self.script is not None else None
        tokens, logprobs, failed = sample_batch(logits_BV, params, self._gen, forced)
        for b, (req, token, lp) in enumerate(zip(stepped, tokens, logprobs, strict=True)):
            if b in failed:  # this request alone ends; the rest of the batch goes on
                self._finish(req, {"type": "abort", "message": f"sampling failed: {failed[b]}"})
                continue
            req.append(token, lp, self.weight_version)
            req.pending = [token]
            self._tokens_generated += 1
            finish = self._check_finish(req, token)
            if finish is not None:
                self._finish(req, finish)
            elif req.stream:
                req.sink(self._response(req), False)

    def _check_finish(self, req: Request, token: int) -> dict[str, Any] | None:
        return check_finish(
            req, token, eos_ids=self.eos_ids, tokenizer=self.tokenizer, context_len=self.context_len
        )

    def _finish(self, req: Request, finish: dict[str, Any]) -> None:
        req.finish = finish
        if req.seq is not None:
            self.kv.free_sequence(req.seq, req.all_tokens()[: req.seq.num_tokens])
            req.seq = None
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        with self._inbox_lock:
            self._by_rid.pop(req.rid, None)
        req.sink(self._response(req), True)

    def _response(self, req: Request) -> dict[str, Any]:
        return render_response(req, tokenizer=self.tokenizer, weight_version=self.weight_version)
