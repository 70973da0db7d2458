"""A small asyncio Kubernetes client on aiohttp: the few verbs the reconciler needs, fast.

Why not the `kubernetes` package's client: it is synchronous (a thread per request), and
creating hundreds of pods at once is exactly where concurrency matters. Credentials come
from the `kubernetes` package's own kubeconfig / in-cluster loaders, so every auth form it
supports (tokens, client certificates, CA files) works here too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import aiohttp

SA_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
RETRYABLE = {429, 500, 502, 503, 504}
USER_AGENT = f"tessera-operator/{version('tessera')}"


TOKEN_RELOAD_S = 60.0
log = logging.getLogger("tessera_operator.kube")

# The API server's JSON decoder refuses objects nested deeper than this; Python's stops near its
# recursion limit (1000). An object stored with a deep free-form field (written with the webhook
# off) must still decode here, or it would fail every pass and every watch that lists it.
MAX_DECODE_DEPTH = 10_000
# Watch events this process could not decode, by watch (logged, skipped: the watch goes on).
# The operator serves no metrics of its own: this counts them for logs and tests.
UNDECODABLE: Counter[str] = Counter()


def loads(text: str | bytes) -> Any:
    """json.loads, also of values nested up to MAX_DECODE_DEPTH deep (the C decoder needs about
    300 bytes of stack per level: 3 MB at most, within a thread's 8 MiB). The recursion limit is
    raised only while that one value decodes, so any recursive walk of it afterwards still stops
    at the usual limit with a RecursionError, never a crash. ValueError when it cannot decode."""
    try:
        return json.loads(text)
    except RecursionError:
        pass
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, MAX_DECODE_DEPTH + 2000))
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {MAX_DECODE_DEPTH} levels") from None
    finally:
        sys.setrecursionlimit(limit)


def _bearer_token(cfg: Any) -> str | None:
    """The token a kubernetes-client Configuration holds, without its scheme (the in-cluster
    loader writes "bearer <token>", kubeconfig loaders "Bearer <token>")."""
    auth = str(cfg.api_key.get("authorization") or cfg.api_key.get("BearerToken") or "").strip()
    return (auth[len("bearer ") :] if auth.lower().startswith("bearer ") else auth).strip() or None


class ApiError(Exception):
    def __init__(self, status: int, body: dict[str, Any] | str) -> None:
        self.status = status
        self.body = body
        message = body.get("message", "") if isinstance(body, dict) else body
        super().__init__(f"{status}: {message}")


class KubeClient:
    def __init__(
        self,
        server: str,
        token: str | None,
        ssl_context: ssl.SSLContext | bool,
        reload_token: Callable[[], str | None] | None = None,
        concurrency: int = 64,
    ) -> None:
        self.server = server.rstrip("/")
        self._token = token
        # Tokens expire (bound ServiceAccount tokens rotate, exec plugins' last minutes): the
        # current one is fetched again every TOKEN_RELOAD_S.
        self._reload_token = reload_token
        self._token_read = time.monotonic()
        self._ssl = ssl_context
        self._concurrency = concurrency
        self._session: aiohttp.ClientSession | None = None
        # Watches hold a connection for minutes each (two per watched namespace): on the request
        # pool they would starve every GET and PATCH once namespaces reach half its size.
        self._watch_session: aiohttp.ClientSession | None = None

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None, concurrency: int = 64) -> KubeClient:
        """kubeconfig (argument, $KUBECONFIG, ~/.kube/config) or, inside a pod, the ServiceAccount."""
        from kubernetes import client as k8s_client
        from kubernetes import config as k8s_config

        cfg = k8s_client.Configuration()
        try:
            k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
            hook = cfg.refresh_api_key_hook  # set for exec plugins and OIDC: tokens that expire

            def reload_token() -> str | None:
                if hook is not None:
                    hook(cfg)
                return _bearer_token(cfg)

        except k8s_config.ConfigException:
            k8s_config.load_incluster_config(client_configuration=cfg)

            def reload_token() -> str | None:
                return SA_TOKEN.read_text().strip() or None

        token = _bearer_token(cfg)
        context: ssl.SSLContext | bool
        if cfg.verify_ssl:
            context = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
            if cfg.cert_file:
                context.load_cert_chain(cfg.cert_file, cfg.key_file)
        else:
            context = False
        return cls(cfg.host, token, context, reload_token=reload_token, concurrency=concurrency)

    def _headers(self) -> dict[str, str]:
        if self._reload_token is not None and time.monotonic() - self._token_read > TOKEN_RELOAD_S:
            self._token = self._reload_token()
            self._token_read = time.monotonic()
        # The API server names this client's writes in managedFields (and audit logs) after it.
        headers = {"User-Agent": USER_AGENT}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._concurrency, ssl=self._ssl)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=60)
            )
        return self._session

    async def watch_session(self) -> aiohttp.ClientSession:
        if self._watch_session is None or self._watch_session.closed:
            connector = aiohttp.TCPConnector(limit=0, ssl=self._ssl)
            self._watch_session = aiohttp.ClientSession(connector=connector)
        return self._watch_session

    async def close(self) -> None:
        for session in (self._session, self._watch_session):
            if session is not None:
                await session.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
        attempts: int = 5,
    ) -> dict[str, Any]:
        """One call; a 429 or 5xx is tried again, up to `attempts` times in all."""
        session = await self.session()
        data = None if body is None else json.dumps(body)
        for attempt in range(attempts):
            headers = {**self._headers(), "Accept": "application/json"}
            if data is not None:
                headers["Content-Type"] = content_type
            async with session.request(
                method, self.server + path, data=data, params=params, headers=headers
            ) as response:
                text = await response.text()
                if response.status < 400:
                    return loads(text) if text else {}
                try:
                    payload: dict[str, Any] | str = loads(text)
                except ValueError:
                    payload = text
                if response.status in RETRYABLE and attempt < attempts - 1:
                    retry_after = float(response.headers.get("Retry-After", "0") or 0)
                    await asyncio.sleep(max(retry_after, 0.2 * 2**attempt))
                    continue
                raise ApiError(response.status, payload)
        raise AssertionError("unreachable")

    async def watch(self, path: str, params: dict[str, str]) -> AsyncIterator[dict[str, Any]]:
        """Stream a watch's events (one JSON object per line); ends when the server closes it."""
        session = await self.watch_session()
        headers = {**self._headers(), "Accept": "application/json"}
        timeout = aiohttp.ClientTimeout(total=None, sock_read=float(params.get("timeoutSeconds", 300)) + 30)
        async with session.get(
            self.server + path, params={**params, "watch": "1"}, headers=headers, timeout=timeout
        ) as response:
            if response.status >= 400:
                raise ApiError(response.status, await response.text())
            buffer = b""
            async for chunk in response.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    try:
                        event = loads(line)
                    except ValueError as exc:  # one object we cannot read never stops the watch
                        UNDECODABLE[path] += 1
                        log.warning(
                            "watch on %s: skipped an event it cannot decode (%s; %d so far)",
                            path, exc, UNDECODABLE[path],
                        )  # fmt: skip
                        continue
                    yield event

    async def get(self, path: str) -> dict[str, Any]:
        return await self.request("GET", path)

    async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        return list((await self.list_object(path, label_selector)).get("items", []))

    async def list_object(self, path: str, label_selector: str | None = None) -> dict[str, Any]:
        params = {"labelSelector": label_selector} if label_selector else None
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        """POST; with `dry_run` the API server validates and admits the object but stores nothing
        (asked once: a question, not a write that must land)."""
        if dry_run:
            return await self.request("POST", path, body=body, params={"dryRun": "All"}, attempts=1)
        return await self.request("POST", path, body=body)

    async def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", path, body=body, content_type="application/merge-patch+json")

    async def delete(self, path: str, *, uid: str | None = None) -> None:
        """Delete; with `uid` only that incarnation (a precondition), so a recreated object survives."""
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        await self.request("DELETE", path, body=body)


def core_path(namespace: str, plural: str, name: str | None = None) -> str:
    path = f"/api/v1/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


def custom_path(group: str, version: str, namespace: str, plural: str, name: str | None = None) -> str:
    path = f"/apis/{group}/{version}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path
