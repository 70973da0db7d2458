"""A small asyncio client for the kube-apiserver, configured from a kubeconfig (token or client cert).

The node agent, its DNS server and the Service proxy need a handful of verbs on a few resources;
a full client library would hide which requests they make.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import yaml

JSON = dict[str, Any]


class KubeApi:
    def __init__(self, kubeconfig: str | Path) -> None:
        config = yaml.safe_load(Path(kubeconfig).read_text())
        context_name = config["current-context"]
        context = next(c["context"] for c in config["contexts"] if c["name"] == context_name)
        cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
        user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
        self.server = str(cluster["server"])
        self.ca_file = str(cluster["certificate-authority"])
        tls = ssl.create_default_context(cafile=self.ca_file)
        headers = {}
        if "token" in user:
            headers["Authorization"] = f"Bearer {user['token']}"
        else:
            tls.load_cert_chain(user["client-certificate"], user["client-key"])
        self._client = httpx.AsyncClient(
            base_url=cluster["server"], verify=tls, headers=headers, timeout=httpx.Timeout(30.0)
        )

    async def close(self) -> None:
        await self._client.aclose()

    async def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> JSON:
        """Returns the decoded body; raises `httpx.HTTPStatusError` on a 4xx/5xx answer."""
        response = await self._client.request(
            method, path, json=body, params=params, headers={"Content-Type": content_type}
        )
        response.raise_for_status()
        return dict(response.json())

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> JSON:
        return await self.request("GET", path, params=params)

    async def get_or_none(self, path: str) -> JSON | None:
        try:
            return await self.get(path)
        except httpx.HTTPStatusError as error:
            if error.response.status_code == 404:
                return None
            raise

    async def merge_patch(self, path: str, body: Mapping[str, Any]) -> JSON:
        return await self.request("PATCH", path, body, content_type="application/merge-patch+json")


def run_until_signalled(kubeconfig: str, serve: Callable[[KubeApi, asyncio.Event], Awaitable[None]]) -> None:
    """The main of the agent's processes: logging, an API client, and SIGTERM/SIGINT setting `stop`."""
    logging.basicConfig(
        level=os.environ.get("E2E_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per API request otherwise

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        api = KubeApi(kubeconfig)
        try:
            await serve(api, stop)
        finally:
            await api.close()

    asyncio.run(main())
