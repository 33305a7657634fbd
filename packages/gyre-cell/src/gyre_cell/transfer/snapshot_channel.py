"""The core's per-batch weight snapshot for satellites, over Mooncake (docs/design/training.md#multi-cell-training, docs/design/cells.md).

`MooncakeSnapshotChannel` implements gyre-train's `SnapshotChannel` protocol (structurally):

- core: `publish(batch, flat_params) -> ref` copies the flat parameters into one registered `WeightPublisher`
  buffer (`{"flat": params}`, layout fixed by the first publish) at version = batch and serves its manifest over HTTP;
- satellite: `load(ref)` pulls a consistent snapshot with a cached `WeightSubscriber` (one per manifest URL) and
  checks that its version is the ref's batch, so a satellite never trains on another batch's weights.

A ref is `mooncake+<manifest URL>#batch=<batch>`, e.g. `mooncake+http://127.0.0.1:41233/weights/manifest#batch=3`.
"""

from __future__ import annotations

import threading

import torch

from gyre_cell.errors import StaleSnapshotError, TornSnapshotError, TransferError
from gyre_train.errors import SnapshotError

from ..weight_sync import dtype_name
from .mooncake import MooncakeConfig
from .publisher import WeightPublisher
from .subscriber import SubscriberConfig, WeightSubscriber, fetch_manifest

REF_SCHEME = "mooncake+"
FLAT = "flat"


def make_ref(manifest_url: str, batch: int, scheme: str = REF_SCHEME) -> str:
    return f"{scheme}{manifest_url}#batch={batch}"


def parse_ref(ref: str, scheme: str = REF_SCHEME) -> tuple[str, int]:
    """(manifest URL, batch) of a ref made by `make_ref`; ValueError naming the expected form otherwise."""
    url, sep, batch = ref.removeprefix(scheme).rpartition("#batch=")
    if not ref.startswith(scheme) or not sep or not url or not batch.isdigit():
        kind = "Mooncake" if scheme == REF_SCHEME else scheme.removesuffix("+").upper()
        raise ValueError(f"not a {kind} snapshot ref: {ref!r} (expected '{scheme}<manifest URL>#batch=<N>')")
    return url, int(batch)


class MooncakeSnapshotChannel:
    """One object per process; the core publishes through it, satellites load through it.

    `mooncake` says how this process opens its transfer engine (TCP on loopback by default; RDMA in production);
    its `local_hostname` is also the address the manifest is served on. `subscriber` tunes the reads.
    `HttpSnapshotChannel` is this channel over another transport (its own `scheme`, publisher and subscriber).
    """

    scheme = REF_SCHEME

    def __init__(
        self,
        mooncake: MooncakeConfig | None = None,
        *,
        subscriber: SubscriberConfig | None = None,
    ) -> None:
        self.mooncake = mooncake or MooncakeConfig()
        self.subscriber_config = subscriber or SubscriberConfig()
        self._publisher: WeightPublisher | None = None
        self._url: str | None = None
        self._subscribers: dict[str, WeightSubscriber] = {}
        self._lock = threading.Lock()
        self._closed = False

    # ---- core ------------------------------------------------------------------------------------
    @property
    def manifest_url(self) -> str | None:
        """Where this process serves its manifest (None before the first publish)."""
        return self._url

    def publish(self, batch: int, params: torch.Tensor) -> str:
        """Core, at batch open: expose the flat parameters (fixed during accumulation); return a reference string."""
        if batch < 0:
            raise ValueError(f"batch must be >= 0, got {batch}")
        flat = params.detach()
        with self._lock:
            self._check_open()
            if self._publisher is None:
                self._publisher, self._url = self._new_publisher({FLAT: flat}, batch)
            else:
                entry = self._publisher.manifest().tensors[0]
                if list(flat.shape) != entry.shape or dtype_name(flat.dtype) != entry.dtype:
                    raise ValueError(
                        f"flat parameters changed layout: {flat.dtype}{list(flat.shape)}, the first publish "
                        f"fixed {entry.dtype}{entry.shape}"
                    )
                self._publisher.publish({FLAT: flat}, version=batch)
            assert self._url is not None
            return make_ref(self._url, batch, self.scheme)

    def _new_publisher(self, named: dict[str, torch.Tensor], batch: int) -> tuple[WeightPublisher, str]:
        """The publisher of the first batch, serving its manifest; and the manifest's URL."""
        # flat parameters for satellites' training, checked nowhere before either (check_finite=False); one slot:
        # satellites copy the snapshot (nothing binds it), and an open write must read as torn, not as the last batch
        publisher = WeightPublisher(named, version=batch, config=self.mooncake, check_finite=False, slots=1)
        return publisher, publisher.serve_manifest(host=self.mooncake.local_hostname)

    def _new_subscriber(self, url: str) -> WeightSubscriber:
        """A subscriber of the publisher whose manifest is at `url`."""
        return WeightSubscriber(fetch_manifest(url), config=self.subscriber_config, mooncake=self.mooncake)

    # ---- satellite -------------------------------------------------------------------------------
    def load(self, ref: str) -> torch.Tensor:
        """Satellite: the flat parameters the reference names (a consistent snapshot; raise on a torn or stale read).

        Raises `StaleSnapshotError` if the publisher holds another batch, `SnapshotError` (gyre-train's, also the base
        of the former) if no consistent read succeeds within the subscriber's attempts, `TransferError` if the
        publisher is unreachable.
        """
        url, batch = parse_ref(ref, self.scheme)
        with self._lock:
            self._check_open()
            if url == self._url and self._publisher is not None:  # the core reading its own ref: no transfer
                version, flat = self._publisher.version, self._publisher.tensors()[FLAT].clone()
            else:
                sub = self._subscribers.get(url)
                if sub is None:
                    sub = self._new_subscriber(url)
                    if [e.name for e in sub.manifest.tensors] != [FLAT]:
                        sub.close()
                        raise TransferError(f"{url} does not describe a flat-parameter snapshot")
                    self._subscribers[url] = sub
                got: dict[str, torch.Tensor] = {}

                def take(tensors: dict[str, torch.Tensor], _version: int) -> None:
                    # the mapped publisher's pages: a copy (a write overlapping it runs this again); the
                    # subscriber's own buffer: itself, valid until its next read (the protocol's contract)
                    got[FLAT] = tensors[FLAT].clone() if sub.shared else tensors[FLAT]

                try:
                    version = sub.read_apply(take)
                except TornSnapshotError as e:
                    raise SnapshotError(f"torn snapshot {ref!r}: {e}") from e
                except TransferError:
                    self._subscribers.pop(url).close()  # publisher gone: a later ref fetches a fresh manifest
                    raise
                flat = got[FLAT]
        if version != batch:
            moved = "has moved on to" if version > batch else "has not reached"
            raise StaleSnapshotError(
                f"stale snapshot ref {ref!r}: the publisher {moved} batch {batch} (it holds batch {version})"
            )
        return flat

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for sub in self._subscribers.values():
                sub.close()
            self._subscribers.clear()
            if self._publisher is not None:
                self._publisher.close()
                self._publisher = None
                self._url = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("snapshot channel is closed")

    def __enter__(self) -> MooncakeSnapshotChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
