"""The dashboard's printed URL is one a user can open: never the wildcard address it may be bound to."""

from __future__ import annotations

import asyncio

import httpx

from gyre.observe.dashboard.server import DashboardServer, openable_host
from gyre.observe.rundata import RunView


def test_a_dashboard_on_every_interface_prints_an_address_that_opens(tmp_path):
    async def main() -> tuple[str, int]:
        server = DashboardServer(RunView(tmp_path), host="0.0.0.0", port=0)
        url = await server.start()
        try:
            async with httpx.AsyncClient() as client:
                return url, (await client.get(url)).status_code  # the printed URL, token included
        finally:
            await server.stop()

    url, status = asyncio.run(main())
    assert "0.0.0.0" not in url and url.startswith("http://") and "?token=" in url
    assert status == 200


def test_only_the_wildcard_is_replaced():
    assert openable_host("127.0.0.1") == "127.0.0.1" and openable_host("10.1.2.3") == "10.1.2.3"
    assert openable_host("node-7.cluster") == "node-7.cluster"
    assert openable_host("0.0.0.0") != "0.0.0.0" and openable_host("::") != "::"
