"""The proxy's admin API as another stack's rollout code uses it: open an execution, end it, take its selected
trajectories (J_max admission, docs/design/tito.md#provenance-mask-and-selection)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["TitoSession"]


@dataclass
class TitoSession:
    """A client of one gyre-tito proxy's admin API (`gyre-tito serve --admin-token-file F`)."""

    proxy_url: str
    admin_token: str = field(repr=False)
    timeout_s: float = 60.0

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        url = self.proxy_url.rstrip("/") + path
        r = httpx.request(method, url, json=body or {}, headers=headers, timeout=self.timeout_s)
        if r.status_code != 200:
            raise RuntimeError(f"gyre-tito {method} {path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def open(self, group_id: str | None = None, metadata: dict[str, Any] | None = None) -> tuple[str, str]:
        """A new execution: its id and the credential its harness sends as the API key."""
        body: dict[str, Any] = {"metadata": metadata or {}}
        if group_id is not None:
            body["group_id"] = group_id
        out = self._call("POST", "/admin/executions", body)
        return out["execution_id"], out["credential"]

    def end(self, execution_id: str) -> None:
        self._call("POST", f"/admin/executions/{execution_id}/end")

    def trajectories(self, execution_id: str, j_max: int = 1, seed: int = 0) -> list[dict[str, Any]]:
        """The execution's admitted trajectories, highest role priority first (`gyre_tito.types.Trajectory`)."""
        out = self._call("POST", f"/admin/executions/{execution_id}/export", {"j_max": j_max, "seed": seed})
        return out["trajectories"]
