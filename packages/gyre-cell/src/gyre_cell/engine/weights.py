"""Model weights of the torch engine: loading, in-place updates by HF name, release and restore.

Release really frees memory: every parameter's storage is swapped for an empty tensor after a backup is
taken (a CPU copy on CUDA, an unnamed spill file on CPU: `gyre_cell.spill`, nothing left on disk by a killed engine;
or nothing with `none`).

Bound parameters (`WeightStore.bind`): on the publisher's host the parameters can be read-only views of the
publisher's newest buffer, held by a lease (`gyre_cell.transfer.shm.SlotLease`) so it is not overwritten. Writing
into those pages would kill the process (SIGSEGV): every path that writes parameters (`apply`) or drops them
(`release`, `close`) first gives them private memory or lets go of the views, and then of the lease. A lease the
publisher broke (the engine missed a publication) makes the engine revoke them (`intact`, `revoke`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file

from gyre_cell.errors import WeightError

from ..spill import SpillFile


class Lease(Protocol):
    """What keeps a bound buffer from being overwritten (`gyre_cell.transfer.shm.SlotLease`)."""

    def release(self) -> None: ...

    def intact(self) -> bool:
        """False once the publisher began rewriting the buffer anyway (the engine missed a publication)."""
        ...


def load_checkpoint_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files in a Hugging Face checkpoint directory."""
    p = Path(path)
    shown = str(p) if len(str(p)) <= 200 else str(p)[:200] + "..."
    try:
        if not p.is_dir():
            raise WeightError(f"model_path {shown!r} is not a directory")
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise WeightError(f"no *.safetensors files in {shown!r}")
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
    except WeightError:
        raise
    except OSError as e:  # a name too long, a permission, a vanished file: the request's fault, not a crash
        raise WeightError(f"model_path {shown!r}: {e.strerror or e}") from None
    except Exception as e:  # safetensors raises its own error type on a damaged file
        raise WeightError(f"model_path {shown!r}: cannot read the checkpoint: {e}") from None
    return out


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in `t`. A finite sum proves it (NaN and inf propagate into a sum): one reading pass, no
    allocation, 0.5 ms for 2.4M float32 values; `isfinite(t).all()` writes a bool tensor as large as `t` (11 ms), and
    took 0.17 s of a 0.21 s load of 52M parameters. Only a sum that overflowed (huge finite values) asks it."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


def check_allowed_dir(path: str, roots: list[str] | None) -> None:
    """Refuse a checkpoint directory outside the configured `weight_dirs` (None: no restriction)."""
    if roots is None:
        return
    try:
        target = Path(path).resolve()
    except (OSError, RuntimeError, ValueError) as e:
        raise WeightError(f"model_path: {e}") from None
    if not any(target == Path(r).resolve() or target.is_relative_to(Path(r).resolve()) for r in roots):
        shown = path if len(path) <= 200 else path[:200] + "..."
        raise WeightError(f"model_path {shown!r} is outside the engine's weight directories {roots}")


class WeightStore:
    """Owns the parameters of one model: update by name, release, resume."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device, backup: str) -> None:
        self.model = model
        self.device = device
        self.backup = backup
        self._params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())
        tied = getattr(model.config, "tie_word_embeddings", False)
        # A tied checkpoint may carry lm_head.weight or not; both names reach the same tensor.
        self._aliases = {"lm_head.weight": "model.embed_tokens.weight"} if tied else {}
        self.released = False
        self._cpu_backup: dict[str, torch.Tensor] | None = None
        self._disk_backup: SpillFile | None = None
        self._meta: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._lease: Lease | None = None
        """Held while the parameters are read-only views of a publisher's buffer (`bind`)."""
        self._meta_of = {n: (p.shape, p.dtype) for n, p in self._params.items()}
        self.revoked = False
        """The bound buffer was rewritten under the engine (`revoke`): nothing to serve until a whole load."""

    @property
    def bound(self) -> bool:
        return self._lease is not None

    def intact(self) -> bool:
        """False once the buffer the parameters are bound to is being rewritten (the publisher overwrote the slot of
        an engine that missed a publication: `gyre_cell.transfer.shm`). Check it after the reads it vouches for."""
        return self._lease is None or self._lease.intact()

    def revoke(self) -> None:
        """Stop using bound parameters whose buffer is being rewritten: they get private memory of the right
        shape, holding nothing, and `revoked` stays set until a whole load (`bind`, or `apply` with `strict`)."""
        if self._lease is None:
            return
        self.unbind(keep_values=False)
        with torch.inference_mode(False):
            for name, p in self._params.items():
                shape, dtype = self._meta_of[name]
                p.data = torch.empty(shape, dtype=dtype, device=self.device)
        self.revoked = True

    def _resolve(self, name: str) -> torch.nn.Parameter:
        return self._params[self._resolve_name(name)]

    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._params.values())

    def expected_shape(self, name: str) -> tuple[int, ...]:
        if self.released:
            return tuple(self._meta[self._resolve_name(name)][0])
        return tuple(self._resolve(name).shape)

    def _resolve_name(self, name: str) -> str:
        if name in self._params:
            return name
        alias = self._aliases.get(name)
        if alias is None:
            raise WeightError(f"unknown parameter name {name!r}")
        return alias

    @torch.inference_mode()
    def apply(
        self, named: Mapping[str, torch.Tensor], *, strict: bool = False, check_finite: bool = True
    ) -> int:
        """Copy tensors into parameters by HF name, in place; all-or-nothing (validated before any copy).
        `strict` also requires every parameter to be present (a full checkpoint load). `check_finite=False` skips
        the NaN/inf pass, for a source that checked its tensors itself (a `WeightPublisher` with `check_finite`)."""
        if self.released:
            raise WeightError("weights are released: resume_memory_occupation(['weights']) first")
        if not named:
            raise WeightError("no tensors given")
        targets = []
        for name, t in named.items():
            p = self._resolve(name)
            if tuple(t.shape) != tuple(p.shape):
                raise WeightError(
                    f"shape mismatch for {name!r}: got {list(t.shape)}, expected {list(p.shape)}"
                )
            if check_finite and not all_finite(t):
                raise WeightError(f"tensor {name!r} holds NaN or infinite values")
            targets.append((p, t))
        if strict:
            given = {self._resolve_name(n) for n in named}
            missing = sorted(set(self._params) - given)
            if missing:
                raise WeightError(f"checkpoint lacks parameters: {missing[:5]}")
        if self.revoked and not strict:
            raise WeightError(
                "weights are revoked (their buffer was rewritten): only a whole load restores them"
            )
        # bound views are read-only pages: the copy below needs memory of its own
        self.unbind()
        for p, t in targets:
            p.data.copy_(t)  # converts dtype and device itself: no intermediate tensor
        self.revoked = False
        return len(targets)

    def bindable(self, entries: Iterable[tuple[str, str, list[int]]]) -> bool:
        """Whether `bind` can take views laid out as `entries` ((name, dtype name, shape) each): every parameter
        among them with its dtype and shape, every name known, on the CPU (the views are host memory)."""
        if self.released or self.device.type != "cpu":
            return False
        seen: set[str] = set()
        for name, dtype, shape in entries:
            try:
                resolved = self._resolve_name(name)
            except WeightError:
                return False
            p = self._params[resolved]
            if str(p.dtype).removeprefix("torch.") != dtype or list(p.shape) != list(shape):  # `dtype_name`
                return False
            seen.add(resolved)
        return seen == set(self._params)

    def bind(self, views: Mapping[str, torch.Tensor], lease: Lease) -> None:
        """Make the parameters `views` (checked with `bindable`; tied names share one parameter, so they keep
        sharing), then let go of the previous lease: O(#params) pointer swaps instead of a copy. `lease` keeps the
        views' buffer from being overwritten until the next bind, `apply`, `release` or `close` drops it."""
        if self.released:
            lease.release()
            raise WeightError("weights are released: resume_memory_occupation(['weights']) first")
        for name, p in self._params.items():
            view = views[name]
            if (
                view.shape != p.shape or view.dtype != p.dtype
            ):  # `bindable` said otherwise: refuse, bind nothing
                lease.release()
                raise WeightError(
                    f"cannot bind {name!r}: {view.dtype}{list(view.shape)} for {p.dtype}{list(p.shape)}"
                )
        for name, p in self._params.items():
            p.data = views[name]
        self.revoked = False
        previous, self._lease = self._lease, lease
        if previous is not None:
            previous.release()

    def unbind(self, *, keep_values: bool = True) -> None:
        """Private memory for bound parameters (their current values with `keep_values`), then drop the lease."""
        if self._lease is None:
            return
        with torch.inference_mode(
            False
        ):  # ordinary tensors, as loaded: later updates copy into them in place
            for p in self._params.values():
                p.data = p.data.clone() if keep_values else torch.empty(0, dtype=p.dtype, device=p.device)
        lease, self._lease = self._lease, None
        lease.release()

    def release(self) -> None:
        if self.released:
            return
        self._meta = {n: (p.shape, p.dtype) for n, p in self._params.items()}
        mode = self.backup
        if mode == "cpu":
            self._cpu_backup = {n: p.detach().to("cpu", copy=True) for n, p in self._params.items()}
        elif mode == "disk":
            self._disk_backup = SpillFile(self._params)
        self.unbind(keep_values=False)  # the backup above read the bound values
        for p in self._params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.released = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self) -> None:
        if not self.released:
            return
        saved: Mapping[str, torch.Tensor] | None = self._cpu_backup
        if self._disk_backup is not None:
            saved = self._disk_backup.load()
        for n, p in self._params.items():
            shape, dtype = self._meta[n]
            if saved is not None:
                p.data = saved[n].to(device=self.device, dtype=dtype)
            else:  # like SGLang without a CPU backup: memory is back, contents need a weight update
                p.data = torch.zeros(shape, dtype=dtype, device=self.device)
        if self._disk_backup is not None:
            self._disk_backup.close()
        self._cpu_backup, self._disk_backup = None, None
        self.released = False

    def close(self) -> None:
        # the model may outlive the engine: never leave it on pages it does not hold
        self.unbind()
        if self._disk_backup is not None:
            self._disk_backup.close()
