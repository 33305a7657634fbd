"""Weight transfer over the Mooncake transfer engine (docs/design/cells.md): the core publishes, satellites and engines pull.

`WeightPublisher` keeps a registered flat buffer of the model's tensors (HF names) and refreshes it in place under
a seqlock; `WeightSubscriber` reads the whole buffer with batched Mooncake reads and never returns a torn
snapshot; `WeightManifest` is the handshake (peer, address, length, version, layout), sent directly or over HTTP.
Where Mooncake cannot load (no libibverbs), `HttpWeightPublisher`, `HttpWeightSubscriber` and `HttpSnapshotChannel`
are the same classes over plain HTTP from the publisher (`choice` says which one a run can use).

The names below load on first use (PEP 562): the publisher and the subscriber import torch, while
`gyre_cell.transfer.mooncake` (whose `MooncakeConfig` a run config embeds) must import without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from gyre_cell.errors import (
        MooncakeUnavailableError,
        StaleSnapshotError,
        TornSnapshotError,
        TransferError,
    )

    from .engine_loader import mooncake_engine_loader, published_weights_loader, pull_into_engine
    from .http_publisher import HttpWeightPublisher
    from .http_snapshot_channel import HttpSnapshotChannel
    from .http_subscriber import HttpWeightSubscriber, fetch_http_manifest
    from .manifest import TensorEntry, WeightManifest
    from .mooncake import MooncakeConfig, import_transfer_engine, open_transfer_engine
    from .publisher import WeightPublisher
    from .snapshot_channel import MooncakeSnapshotChannel
    from .subscriber import Snapshot, SubscriberConfig, WeightSubscriber, fetch_manifest

__all__ = [
    "HttpSnapshotChannel",
    "HttpWeightPublisher",
    "HttpWeightSubscriber",
    "MooncakeConfig",
    "MooncakeSnapshotChannel",
    "MooncakeUnavailableError",
    "Snapshot",
    "StaleSnapshotError",
    "SubscriberConfig",
    "TensorEntry",
    "TornSnapshotError",
    "TransferError",
    "WeightManifest",
    "WeightPublisher",
    "WeightSubscriber",
    "fetch_http_manifest",
    "fetch_manifest",
    "import_transfer_engine",
    "mooncake_engine_loader",
    "open_transfer_engine",
    "published_weights_loader",
    "pull_into_engine",
]

_SOURCES = {
    "HttpWeightPublisher": ".http_publisher",
    "HttpSnapshotChannel": ".http_snapshot_channel",
    "HttpWeightSubscriber": ".http_subscriber",
    "fetch_http_manifest": ".http_subscriber",
    "mooncake_engine_loader": ".engine_loader",
    "published_weights_loader": ".engine_loader",
    "pull_into_engine": ".engine_loader",
    "TensorEntry": ".manifest",
    "WeightManifest": ".manifest",
    "MooncakeConfig": ".mooncake",
    "MooncakeUnavailableError": ".mooncake",
    "import_transfer_engine": ".mooncake",
    "open_transfer_engine": ".mooncake",
    "WeightPublisher": ".publisher",
    "MooncakeSnapshotChannel": ".snapshot_channel",
    "StaleSnapshotError": ".snapshot_channel",
    "Snapshot": ".subscriber",
    "SubscriberConfig": ".subscriber",
    "TornSnapshotError": ".subscriber",
    "TransferError": ".subscriber",
    "WeightSubscriber": ".subscriber",
    "fetch_manifest": ".subscriber",
}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _SOURCES)
