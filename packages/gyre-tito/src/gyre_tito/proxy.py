"""The proxy core, independent of HTTP: executions and credentials, incremental encoding, generation, records.

One call (`Proxy.complete`):
1. Restore: assistant turns that are our own recorded responses are recognised through the tool-call payload cache
   (the tool-call ids we issued, or the reply text) and rendered as placeholders; the harness's copy (maybe with
   reformatted arguments, dropped thinking) is ignored, its ids only associate tool results.
2. Render with the chat template and encode: matched content reuses memoised pieces; recorded outputs are spliced in
   verbatim (never re-tokenized). Volatile system lines were removed by the API layer.
3. Match the full context against the execution's tree; the record's input is the context after the matched path.
4. Generate on the engine pool (retries continue partial outputs; one segment per engine/weight version).
5. Append the `CallRecord` durably (fsync, shared by the calls that complete together) and index its tool-call ids, then return the reply.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from array import array
from pathlib import Path
from typing import Any

import orjson

from gyre_tito._memory import return_freed_memory
from gyre_tito.conversation import Conversation, Reply, Sampling, ToolCall
from gyre_tito.engine_client import EnginePool
from gyre_tito.errors import EngineRejected, EnginesExhausted, ProtocolError, RecordLogCorrupt
from gyre_tito.execution import (
    EndedExecution,
    Execution,
    PreparedCall,
    QuarantinedExecution,
    credential_hash,
    text_key,
)
from gyre_tito.incremental import INLINE_CHARS, Splices, encode_incremental, new_chars
from gyre_tito.parse import parse_output
from gyre_tito.proxy_config import ProxyConfig, check_execution_id
from gyre_tito.records import RecordLogConfig, RecordStore, read_log
from gyre_tito.render import ChatTokenizer
from gyre_tito.roles import RoleClassifier, make_classifier
from gyre_tito.tree import ExecutionTree
from gyre_tito.types import CallRecord, OutputSegment, Timings, runs_from_mask

__all__ = ["Execution", "PreparedCall", "Proxy", "ProxyConfig", "check_execution_id"]  # re-exports too

log = logging.getLogger("gyre_tito.proxy")


class Proxy:
    """Executions, their trees and the engine pool; `complete` serves one model call."""

    def __init__(self, config: ProxyConfig, classifiers: dict[str, RoleClassifier] | None = None):
        from gyre_tito.admin import check_export_dirs

        check_export_dirs(config)  # an export dir overlapping the store could overwrite the proxy's own files
        self.config = config
        self.store_dir = Path(config.store)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.chat = ChatTokenizer(config.tokenizer, cache_bytes=config.encode_cache_bytes)
        self.records = RecordStore(
            self.store_dir / "records", RecordLogConfig(fsync=config.fsync, group_commit=config.group_commit)
        )
        self.pool = EnginePool(
            config.engine.model_copy(update={"engines": config.engines}), api_key=config.engine_api_key
        )
        self._engine_context: dict[str, tuple[int | None, float]] = {}  # url -> (context length, when asked)
        self._asking: dict[str, asyncio.Future[int | None]] = {}  # url -> the question in flight
        self.classifiers: dict[str, RoleClassifier] = classifiers or {
            "anthropic": make_classifier(config.classifier),
            "openai": make_classifier(config.openai_classifier),
        }
        self.executions: dict[str, Execution] = {}  # loaded: running (and ended with a call still in flight)
        self.ended: dict[str, EndedExecution] = {}  # ended and unloaded: a summary only
        self.quarantined: dict[
            str, QuarantinedExecution
        ] = {}  # damaged at load: refused, files kept for repair
        self._by_credential: dict[str, str] = {}  # sha256(credential) -> execution id
        self._registry = self.store_dir / "executions.jsonl"
        self.stats: dict[str, float] = {"calls": 0, "input_tokens": 0, "output_tokens": 0, "overhead_s": 0.0}
        self._load_registry()

    # ---- executions ------------------------------------------------------------------------------------------
    def _log_event(self, ev: dict[str, Any]) -> None:
        with open(self._registry, "ab") as f:
            f.write(orjson.dumps(ev) + b"\n")
            f.flush()
            if self.config.fsync:
                import os

                os.fsync(f.fileno())

    def _load_registry(self) -> None:
        """Replay the registry; only executions still running get their tree and payload cache loaded.

        A damaged line, or an execution whose record log cannot be loaded, never stops the proxy: the execution is
        quarantined (its calls are refused with 403 naming the damage, its files are left untouched for repair)
        and every other execution loads."""
        if not self._registry.is_file():
            return
        regs: dict[str, dict[str, Any]] = {}
        ended: set[str] = set()
        for n, line in enumerate(self._registry.read_bytes().splitlines()):
            try:
                ev = orjson.loads(line)
            except orjson.JSONDecodeError:
                log.warning("%s: line %d is not JSON (skipped)", self._registry, n + 1)
                continue  # a torn last line: the registration was never acknowledged
            if not isinstance(ev, dict) or not isinstance(eid := ev.get("execution_id"), str):
                log.warning("%s: line %d is not a registry event (skipped)", self._registry, n + 1)
                continue
            if ev.get("ev") == "register":
                regs.setdefault(eid, ev)
            elif ev.get("ev") == "end" and eid in regs:
                ended.add(eid)
            elif ev.get("ev") == "route" and eid in regs:
                regs[eid] = regs[eid] | {"route": ev.get("route")}
        for eid, ev in regs.items():
            cred, group = ev.get("credential_sha256"), ev.get("group_id")
            problem = check_execution_id(eid)
            if problem is None and not (isinstance(cred, str) and isinstance(group, str)):
                problem = "registration lacks its credential hash or group"
            if problem is not None:
                self._quarantine(eid, group if isinstance(group, str) else eid, cred, f"registry: {problem}")
            elif eid in ended:
                self._by_credential[cred] = eid
                self.ended[eid] = EndedExecution(eid, group, self.records.path(eid), ev.get("route"))
            else:
                try:
                    self._open(eid, group, cred, ev.get("route"), ev.get("metadata"))
                except (RecordLogCorrupt, OSError, ValueError) as e:
                    self._quarantine(eid, group, cred, f"record log: {e}")

    def _quarantine(self, eid: str, group: str, cred_hash: str | None, reason: str) -> None:
        log.error("execution %r quarantined: %s", eid, reason)
        self.quarantined[eid] = QuarantinedExecution(eid, group, self.records.path(eid), reason)
        if isinstance(cred_hash, str):
            self._by_credential[cred_hash] = eid

    def _open(self, eid: str, group: str, cred_hash: str, route, metadata) -> Execution:
        ex = Execution(eid, group, self.records.open(eid), route, metadata=metadata or {})
        for rec in ex.records.tree.records():
            ex.index(rec)
        self.executions[eid] = ex
        self._by_credential[cred_hash] = eid
        return ex

    def _unload(self, ex: Execution) -> None:
        """Replace an ended execution (no call in flight) by its summary: tree, log handle and caches go."""
        self.pool.forget(ex.id)  # its context no longer moves with KV migration
        summary = EndedExecution(ex.id, ex.group_id, ex.records.log.path, ex.route, len(ex.records.tree))
        self.ended[ex.id] = summary
        del self.executions[ex.id]
        self.records.release(ex.id)
        return_freed_memory()

    def loaded_executions(self) -> list[str]:
        """Ids of the executions whose tree is held in memory (running ones, and ended ones with a call in flight)."""
        return sorted(self.executions)

    def register(
        self,
        execution_id: str | None = None,
        group_id: str | None = None,
        route: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> tuple[Execution, str]:
        eid = execution_id or f"ex-{uuid.uuid4().hex[:12]}"
        for name, value in (("execution_id", eid), ("group_id", group_id or eid)):
            problem = check_execution_id(value)
            if problem is not None:
                raise ProtocolError(400, "invalid_request_error", f"{name}: {problem}")
        if eid in self.executions or eid in self.ended or eid in self.quarantined:
            raise ProtocolError(409, "invalid_request_error", f"execution {eid!r} already exists")
        # a log without a registration (a registry line was lost): keep it
        if self.records.path(eid).exists():
            raise ProtocolError(409, "invalid_request_error", f"execution {eid!r} already has a record log")
        credential = "tito-" + secrets.token_urlsafe(24)
        ev = {
            "ev": "register",
            "execution_id": eid,
            "group_id": group_id or eid,
            "credential_sha256": credential_hash(credential),
            "route": route,
            "metadata": metadata or {},
            "t": time.time(),
        }
        # open (create) the log first: an id the filesystem refuses leaves no registry entry behind
        ex = self._open(eid, ev["group_id"], ev["credential_sha256"], route, metadata)
        try:
            self._log_event(ev)
        except BaseException:
            self.executions.pop(eid, None)
            self._by_credential.pop(ev["credential_sha256"], None)
            self.records.release(eid)
            self.records.path(eid).unlink(missing_ok=True)
            raise
        return ex, credential

    def end(self, execution_id: str) -> Execution | EndedExecution:
        """End an execution: its credential stops working, the calls it still has in flight are cancelled (their
        engines abort them; nobody is left to read the reply, and a call an engine never answers would otherwise be
        retried on the next engine at every drain), and its tree leaves memory once they have returned."""
        ex = self.get(execution_id)
        if not ex.ended:
            self._log_event({"ev": "end", "execution_id": execution_id, "t": time.time()})
            ex.ended = True
        if isinstance(ex, Execution):
            for work in list(ex.serving):
                work.cancel()
        if isinstance(ex, Execution) and ex.inflight == 0:
            self._unload(ex)
        return self.get(execution_id)

    def set_route(self, execution_id: str, route: list[str] | None) -> None:
        ex = self.get(execution_id)
        self._log_event({"ev": "route", "execution_id": execution_id, "route": route, "t": time.time()})
        ex.route = route

    def get(self, execution_id: str) -> Execution | EndedExecution:
        ex = self.executions.get(execution_id) or self.ended.get(execution_id)
        if ex is None:
            q = self.quarantined.get(execution_id)
            if q is not None:
                raise ProtocolError(409, "invalid_request_error", q.message())
            raise ProtocolError(404, "not_found_error", f"no execution {execution_id[:200]!r}")
        return ex

    def calls(self, execution_id: str) -> int:
        """Recorded calls of an execution (an ended one's count is read from its log once after a restart)."""
        ex = self.get(execution_id)
        if isinstance(ex, Execution):
            return len(ex.records.tree)
        if ex.calls is None:
            ex.calls = len(self.tree(execution_id))
        return ex.calls

    def tree(self, execution_id: str) -> ExecutionTree:
        """An execution's tree: the live one, or for an ended execution a read-only reload that is not kept."""
        ex = self.get(execution_id)
        if isinstance(ex, Execution):
            return ex.records.tree
        try:
            records = read_log(ex.log_path).records if ex.log_path.is_file() else []
            return ExecutionTree.from_records(ex.id, records)
        except (RecordLogCorrupt, OSError, ValueError) as e:  # damaged after the execution ended
            raise ProtocolError(
                409, "invalid_request_error", f"execution {ex.id!r}: record log unreadable: {e}"
            ) from None

    def authenticate(self, credential: str | None) -> Execution:
        if not credential:
            raise ProtocolError(
                401, "authentication_error", "missing credential (x-api-key or Authorization: Bearer)"
            )
        eid = self._by_credential.get(credential_hash(credential))
        if eid is None:
            raise ProtocolError(401, "authentication_error", "invalid credential: no such execution")
        if eid in self.quarantined:
            raise ProtocolError(403, "permission_error", self.quarantined[eid].message())
        ex = self.get(eid)
        if ex.ended or not isinstance(ex, Execution):
            raise ProtocolError(401, "authentication_error", f"execution {eid} has ended")
        return ex

    # ---- one call --------------------------------------------------------------------------------------------
    @property
    def request_bytes_limit(self) -> int:
        return self.config.max_request_bytes or max(1 << 20, 32 * self.config.max_context_tokens)

    def encode(self, ex: Execution, conv: Conversation, limit: int | None = None) -> tuple[array, bytearray]:
        """Full context ids of a request (recorded outputs spliced in) and the per-token policy flags.

        With `limit`, a render that cannot fit (at least `limit` tokens by its byte length alone) is refused before any
        tokenizing. Runs in a worker thread (see `prepare`): tokenizing a long text never blocks the event loop.
        Natively rendered templates are encoded incrementally (`incremental.py`: the cost of the new messages)."""
        if self.chat.native and self.config.incremental_encode:
            return encode_incremental(self.chat, ex, conv, limit)
        splices = Splices(ex)
        messages = conv.template_messages(splices.slot)
        kwargs = {} if conv.enable_thinking is None else {"enable_thinking": conv.enable_thinking}
        text = self.chat.render(messages, conv.tools, add_generation_prompt=True, **kwargs)
        if limit is not None and (least := self.chat.min_tokens(text)) >= limit:
            raise ProtocolError(
                400, "invalid_request_error", f"prompt is too long: at least {least} tokens > {limit} maximum"
            )
        enc = self.chat.encode_rendered(text, splices.recorded, splices.prefixes)
        return enc.ids, enc.policy

    async def _encode(self, ex: Execution, conv: Conversation, limit: int | None) -> tuple[array, bytearray]:
        """`encode` in a worker thread (tokenizing a long text never blocks the event loop), or on the loop when
        only a little new text is to be encoded: the thread hop and GIL handoff cost more than that (12% of the proxy's
        CPU at 64 concurrent short calls, py-spy)."""
        if (
            self.chat.native
            and self.config.incremental_encode
            and new_chars(ex.encode_state, conv) <= INLINE_CHARS
        ):
            return self.encode(ex, conv, limit)
        return await asyncio.to_thread(self.encode, ex, conv, limit)

    async def count_tokens(self, ex: Execution, conv: Conversation) -> int:
        self._check_running(ex)
        limit = await self.context_limit(ex.route)
        async with ex.lock:
            return len((await self._encode(ex, conv, limit))[0])

    async def complete(
        self,
        ex: Execution,
        conv: Conversation,
        sampling: Sampling,
        api: str,
        meta: dict[str, Any],
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[Reply, CallRecord]:
        """One model call: `prepare` (encode, match, validate) then `finish` (generate, record)."""
        return await self.finish(await self.prepare(ex, conv, sampling, api, meta, body, headers))

    async def prepare(
        self,
        ex: Execution,
        conv: Conversation,
        sampling: Sampling,
        api: str,
        meta: dict[str, Any],
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> PreparedCall:
        """Everything that can fail because of the request itself, before any engine work (raises ProtocolError)."""
        t0 = time.time()
        self._check_running(ex)
        limit = await self.context_limit(ex.route)
        async with ex.lock:  # the tree is not read while a record is being added to it (in a worker thread)
            ids, policy = await self._encode(ex, conv, limit)
            parent, n = ex.records.match(ids)
        max_new = self.fit_max_tokens(len(ids), sampling.max_new_tokens, limit)
        used = self.sampling_used(sampling, body)
        meta = {
            **meta,
            "sampling": {
                "policy": self.config.sampling_policy,
                "asked": {**self._asked(body), "max_tokens": sampling.max_new_tokens},
                "used": {**used, "max_tokens": max_new},
            },
        }
        role = self.classifiers[api].classify(body or {}, headers)
        sp = {
            "max_new_tokens": max_new,
            **used,
            "stop_token_ids": self.chat.eos_ids,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if sampling.stop:
            sp["stop"] = sampling.stop
        msg_id = ("msg_" if api == "anthropic" else "chatcmpl-") + uuid.uuid4().hex[:24]
        return PreparedCall(ex, conv, api, meta, ids, policy, parent, n, tuple(role), sp, msg_id, t0)

    def fit_max_tokens(self, prompt: int, asked: int, limit: int) -> int:
        """Output tokens this call may generate: the room left in the context (`context_overflow = "clamp"`), or
        a 400 in Anthropic's own wording, which Claude Code recognises (it lowers max_tokens and retries)."""
        if prompt >= limit:
            raise ProtocolError(
                400, "invalid_request_error", f"prompt is too long: {prompt} tokens > {limit} maximum"
            )
        if prompt + asked <= limit:
            return asked
        if self.config.context_overflow == "clamp":
            return limit - prompt
        raise ProtocolError(
            400,
            "invalid_request_error",
            f"input length and `max_tokens` exceed context limit: {prompt} + {asked} > {limit}, "
            "decrease input length or `max_tokens` and try again",
        )

    @staticmethod
    def _asked(body: dict[str, Any] | None) -> dict[str, Any]:
        return {k: body[k] for k in ("temperature", "top_p", "top_k") if body and body.get(k) is not None}

    def sampling_used(self, sampling: Sampling, body: dict[str, Any] | None) -> dict[str, Any]:
        """temperature/top_p/top_k sent to the engine under the run's sampling policy (raises a 400 under
        'refuse' when the request asks for a value other than the run's)."""
        run = {"temperature": self.config.temperature, "top_p": self.config.top_p, "top_k": self.config.top_k}
        policy = self.config.sampling_policy
        if policy == "pass":
            return {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}
        if policy == "refuse":
            for key, value in self._asked(body).items():
                if value != run[key]:
                    raise ProtocolError(
                        400,
                        "invalid_request_error",
                        f"{key}: this run samples with {key}={run[key]}, the request asked for {value} "
                        "(sampling policy 'refuse'; leave it unset or send the run's value)",
                    )
        return run

    def refresh_context_limit(self) -> None:
        """Forget what the engines reported: the next call asks the (new) route's engines again."""
        self._engine_context.clear()

    async def context_limit(self, route: list[str] | None) -> int:
        """The configured limit, lowered to the smallest context length the call's engines report (each engine is
        asked once; one that does not answer is asked again after 30 s)."""
        limit = self.config.max_context_tokens
        if not self.config.context_from_engines:
            return limit
        urls = [u.rstrip("/") for u in (route if route is not None else self.config.engines)]
        now = time.monotonic()
        stale = [
            u
            for u in urls
            if u not in self._engine_context
            or (self._engine_context[u][0] is None and now - self._engine_context[u][1] > 30.0)
        ]
        if stale:
            # one question per engine however many calls arrive meanwhile (256 calls starting together asked 256
            # times: 8% of the proxy's CPU in that minute, py-spy)
            for u in stale:
                if u not in self._asking:
                    self._asking[u] = asyncio.ensure_future(self.pool.context_length(u))
            found = await asyncio.gather(*(asyncio.shield(self._asking[u]) for u in stale))
            for u, n in zip(stale, found, strict=True):
                self._engine_context[u] = (n, now)
                self._asking.pop(u, None)
        known = [self._engine_context[u][0] for u in urls if self._engine_context.get(u, (None,))[0]]
        return min([limit, *known])

    def _check_running(self, ex: Execution) -> None:
        # ended between authentication and now (the request body was still arriving)
        if ex.ended:
            raise ProtocolError(401, "authentication_error", f"execution {ex.id} has ended")

    async def finish(self, call: PreparedCall) -> tuple[Reply, CallRecord]:
        """Generate (with retries across engines), record durably, and build the reply."""
        self._check_running(call.ex)
        call.ex.inflight += 1  # no await since the check: `end` cannot unload the execution under this call
        work = asyncio.ensure_future(self._finish(call))
        call.ex.serving.add(work)
        try:
            return await work  # a cancellation of this caller cancels the generation too
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if work.cancelled() and call.ex.ended and (current is None or not current.cancelling()):
                raise ProtocolError(  # `end` cancelled the generation, not this caller
                    409,
                    "invalid_request_error",
                    f"execution {call.ex.id} ended while this call was in flight",
                ) from None
            raise
        finally:
            call.ex.serving.discard(work)
            call.ex.inflight -= 1
            if call.ex.ended and call.ex.inflight == 0 and call.ex.id in self.executions:
                self._unload(call.ex)

    async def _finish(self, call: PreparedCall) -> tuple[Reply, CallRecord]:
        ex, conv, api, meta, ids, policy, parent, n = (
            call.ex,
            call.conv,
            call.api,
            call.meta,
            call.ids,
            call.policy,
            call.parent,
            call.n,
        )
        agent_id, role_class, call_kind = call.role
        sp, msg_id, t0 = call.sampling, call.msg_id, call.t0
        t_engine = time.time()
        try:
            res = await self.pool.generate(  # the route is re-read on every retry
                ids, sp, route=lambda: ex.route, on_accept=call.accepted.set, key=ex.id
            )  # key: where the execution's context lives (its prefix moves with it when that engine drains)
        except EnginesExhausted as e:
            raise ProtocolError(529, "overloaded_error", f"no engine available: {e}") from e
        except EngineRejected as e:
            raise ProtocolError(400, "invalid_request_error", f"the engine rejected the request: {e}") from e
        t_done = time.time()
        raw = self.chat.decode(res.output_ids)
        parsed = parse_output(raw)
        prefix = "toolu_" if api == "anthropic" else "call_"
        calls = [ToolCall(prefix + secrets.token_hex(12), c.name, c.arguments) for c in parsed.tool_calls]
        finish = res.finish
        if finish == "stop" and isinstance(res.matched, str):
            finish = "stop_sequence"
        rec = CallRecord(
            execution_id=ex.id,
            call_id=f"{ex.id}/{uuid.uuid4().hex[:16]}",
            seq=len(ex.records.tree),
            parent_id=parent,
            input_ids=ids[n:].tolist(),
            input_provenance=runs_from_mask(policy[n:]),
            output_ids=res.output_ids,
            output_logprobs=res.logprobs,
            output_segments=[
                OutputSegment(engine_id=s.engine, weight_version=s.weight_version, start=s.start, end=s.end)
                for s in res.segments
            ],
            agent_id=agent_id,
            role_class=role_class,
            call_kind=call_kind,
            finish_reason=finish,
            timings=Timings(request_at=t0, first_token_at=res.first_token_at, end_at=time.time()),
            metadata={
                "api": api,
                "message_id": msg_id,
                "tool_call_ids": [c.id for c in calls],
                "text_key": text_key(parsed.text) if parsed.text and not calls else None,
                "volatile": conv.volatile,
                "gen_suffix": self.chat.generation_suffix(
                    **({} if conv.enable_thinking is None else {"enable_thinking": conv.enable_thinking})
                ),
                "attempts": res.attempts,
                **meta,
            },
        )
        # durable before the harness sees anything (group commit: one fsync shared with the calls ending with it)
        async with ex.lock:
            rec = await self.records.append(ex.records, rec)
        ex.index(rec)
        self.stats["calls"] += 1
        self.stats["input_tokens"] += len(ids)
        self.stats["output_tokens"] += len(res.output_ids)
        self.stats["overhead_s"] += (t_engine - t0) + (time.time() - t_done)
        reply = Reply(
            id=msg_id,
            model=meta.get("model") or self.config.model_name,
            reasoning=parsed.reasoning,
            text=parsed.text,
            tool_calls=calls,
            finish=finish,
            stop_sequence=res.matched if finish == "stop_sequence" else None,
            input_tokens=len(ids),
            output_tokens=len(res.output_ids),
            logprobs=list(res.logprobs),
            token_strings=self.chat.token_strings(res.output_ids) if api == "openai" else [],
        )
        return reply, rec

    async def aclose(self) -> None:
        await self.pool.aclose()
        self.records.close()
