"""The core's per-batch weight snapshot for satellites over HTTP, where Mooncake cannot load (docs/design/training.md#multi-cell-training, docs/design/cells.md).

`HttpSnapshotChannel` is `MooncakeSnapshotChannel` (gyre-train's `SnapshotChannel` protocol: batch = version, stale
and torn refs refused, one cached subscriber per core) with the HTTP transport underneath: the core publishes into
one `HttpWeightPublisher` served on `host`, satellites read it with `HttpWeightSubscriber`s. Every request carries
the run's secret. A ref is `http+<manifest URL>#batch=<batch>`.
"""

from __future__ import annotations

import torch

from .http_publisher import HttpWeightPublisher
from .http_subscriber import HttpWeightSubscriber, fetch_http_manifest
from .snapshot_channel import MooncakeSnapshotChannel
from .subscriber import SubscriberConfig

__all__ = ["HttpSnapshotChannel"]


class HttpSnapshotChannel(MooncakeSnapshotChannel):
    """One object per process; the core publishes through it (served on `host`, the address peers reach),
    satellites load through it. `secret`: the run's token (the engine token every cell holds)."""

    scheme = "http+"

    def __init__(
        self, host: str = "127.0.0.1", *, secret: str, subscriber: SubscriberConfig | None = None
    ) -> None:
        if not secret:
            raise ValueError("the HTTP snapshot channel needs the run's secret (the engine token)")
        super().__init__(subscriber=subscriber)
        self.host, self._secret = host, secret

    def _new_publisher(self, named: dict[str, torch.Tensor], batch: int) -> tuple[HttpWeightPublisher, str]:
        publisher = HttpWeightPublisher(named, version=batch, secret=self._secret, check_finite=False)
        return publisher, publisher.serve_manifest(self.host)

    def _new_subscriber(self, url: str) -> HttpWeightSubscriber:
        manifest = fetch_http_manifest(url, self._secret)
        return HttpWeightSubscriber(manifest, secret=self._secret, config=self.subscriber_config)
