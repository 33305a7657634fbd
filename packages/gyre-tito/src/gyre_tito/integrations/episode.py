"""One harness run through the proxy, as the SkyRL and verl adapters run it: open an execution, run the harness with
its credential, end it, take its selected trajectories, score it with the user's reward function.

- `Episode(prompt, extras, result, execution_id, trajectories, seconds)`: what a reward function is given.
- `RewardFn = Callable[[Episode], float]`.
- `await run_episode(session, harness, prompt, extras, group_id=, metadata=, j_max=, seed=) -> Episode`: the harness
  may be a plain function (run in a thread: it mostly waits on the model and its tools) or a coroutine function.
- `resolve(obj)`: a callable given as itself or as an import path `"package.module:name"` (what a YAML config holds).
- `stack_class(namespace, name, mixin, base)`: a module `__getattr__` that builds class `name` from `mixin` and the
  stack's base class (an import path) the first time it is looked up, so an adapter module imports nothing of its
  stack until its class is asked for.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gyre_tito.integrations.session import TitoSession

__all__ = ["Episode", "RewardFn", "resolve", "run_episode", "stack_class"]


@dataclass
class Episode:
    """One execution of the harness, finished: what the adapters train and what a reward function scores."""

    prompt: Any
    """the stack's prompt (chat messages) as the harness was given it"""
    extras: dict[str, Any]
    """the stack's per-sample data: SkyRL's `env_extras` (plus `env_class`), verl's dataset fields"""
    result: Any
    """what the harness returned (e.g. its final answer)"""
    execution_id: str
    trajectories: list[dict[str, Any]] = field(repr=False)
    """the execution's admitted trajectories (`gyre_tito.types.Trajectory`), highest role priority first"""
    seconds: float
    """wall time of the harness run"""


RewardFn = Callable[[Episode], float]


def resolve(obj: Any) -> Any:
    """`obj` itself, or the object an import path `"package.module:name"` names."""
    if not isinstance(obj, str):
        return obj
    module, sep, name = obj.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{obj!r}: expected an import path 'package.module:name'")
    target: Any = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    return target


async def run_episode(
    session: TitoSession,
    harness: Callable[..., Any],
    prompt: Any,
    extras: dict[str, Any],
    *,
    group_id: str,
    metadata: dict[str, Any],
    j_max: int = 1,
    seed: int = 0,
) -> Episode:
    """Run `harness(prompt, base_url, api_key)` as one gyre-tito execution and return it, ended, with its admitted
    trajectories. A harness that raises, or that made no model call, fails with the execution named; the execution
    is ended either way."""
    eid, credential = await asyncio.to_thread(session.open, group_id, metadata)
    start = time.monotonic()
    try:
        if inspect.iscoroutinefunction(harness):
            result = await harness(prompt, session.proxy_url, credential)
        else:
            result = await asyncio.to_thread(harness, prompt, session.proxy_url, credential)
    except Exception as exc:
        raise RuntimeError(f"execution {eid}: the harness failed: {type(exc).__name__}: {exc}") from exc
    finally:
        seconds = time.monotonic() - start
        await asyncio.to_thread(session.end, eid)
    trajectories = await asyncio.to_thread(session.trajectories, eid, j_max, seed)
    if not trajectories:
        raise RuntimeError(f"execution {eid}: the harness made no model call through the proxy")
    return Episode(prompt, extras, result, eid, trajectories, seconds)


def stack_class(namespace: dict[str, Any], name: str, mixin: type, base: str) -> Callable[[str], Any]:
    """A module `__getattr__` (PEP 562) giving `name`: `mixin` subclassed with the class at import path `base`, built
    on first look-up and kept in the module's `namespace` (so it pickles, and hydra's `_target_` finds it)."""

    def __getattr__(attr: str) -> Any:
        if attr != name:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {attr!r}")
        cls = type(
            name,
            (mixin, resolve(base)),
            {"__module__": namespace["__name__"], "__qualname__": name, "__doc__": mixin.__doc__},
        )
        namespace[name] = cls
        return cls

    return __getattr__
