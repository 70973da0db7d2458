"""The operator's API client on a real socket: watches never starve its requests; tokens that
expire are fetched again."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp import web

from tessera_operator import kube
from tessera_operator.kube import KubeClient
from tests.fixtures.loopback_http import serving


async def test_open_watches_leave_the_request_pool_free() -> None:
    """Two watches per watched namespace stay open for minutes: were they on the request pool
    (here of 2), every GET and PATCH would wait for one to end."""
    release = asyncio.Event()

    async def watch(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b'{"type": "ADDED", "object": {}}\n')
        await release.wait()
        return response

    async def get(request: web.Request) -> web.Response:
        return web.json_response({"kind": "Pod"})

    app = web.Application()
    app.router.add_get("/watch", watch)
    app.router.add_get("/pod", get)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    client = KubeClient(f"http://127.0.0.1:{port}", None, False, concurrency=2)

    async def first_event() -> None:
        async for _ in client.watch("/watch", {"timeoutSeconds": "300"}):
            await release.wait()

    watches = [asyncio.create_task(first_event()) for _ in range(4)]
    try:
        await asyncio.sleep(0.3)  # all four watches hold a connection now
        assert await asyncio.wait_for(client.get("/pod"), timeout=10) == {"kind": "Pod"}
    finally:
        release.set()
        await asyncio.gather(*watches, return_exceptions=True)
        await client.close()
        await runner.cleanup()


EXEC_PLUGIN = """#!/bin/sh
# An exec credential plugin as EKS and GKE use: a new short-lived token at each call.
n=$(cat "$0.count" 2>/dev/null || echo 0); n=$((n+1)); echo $n > "$0.count"
printf '{"apiVersion":"client.authentication.k8s.io/v1beta1","kind":"ExecCredential",'
printf '"status":{"token":"token-%s","expirationTimestamp":"%s"}}' $n "$(date -u -d '+2 seconds' +%Y-%m-%dT%H:%M:%SZ)"
"""


async def test_a_kubeconfig_exec_plugins_token_is_fetched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run outside the cluster (EKS: tokens of 15 minutes), a token read once would turn every
    request into a 401 for good."""
    seen: list[str | None] = []

    async def version(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"major": "1"})

    app = web.Application()
    app.router.add_get("/version", version)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    plugin = tmp_path / "credentials.sh"
    plugin.write_text(EXEC_PLUGIN)
    plugin.chmod(0o755)
    (tmp_path / "kubeconfig").write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
        "users: [{name: u, user: {exec: {apiVersion: client.authentication.k8s.io/v1beta1, "
        f"command: {plugin}, interactiveMode: Never}}}}}}]\n"
    )
    client = KubeClient.from_environment(str(tmp_path / "kubeconfig"))
    monkeypatch.setattr(kube, "TOKEN_RELOAD_S", 0.0)
    try:
        await client.get("/version")
        await asyncio.sleep(2.5)  # the first token has expired
        await client.get("/version")
    finally:
        await client.close()
        await runner.cleanup()
    assert seen[0] != seen[1] and all(s and s.startswith("Bearer token-") for s in seen), seen


@pytest.mark.parametrize("auth", ["bearer jwt-abc", "Bearer jwt-abc", "jwt-abc"])
def test_the_token_loses_its_scheme_whatever_the_loaders_case(auth: str) -> None:
    # The in-cluster loader writes "bearer ": sent as "Bearer bearer ..." every request was a 401.
    assert kube._bearer_token(SimpleNamespace(api_key={"authorization": auth})) == "jwt-abc"


async def test_a_dry_run_is_asked_once_and_a_create_is_retried_on_5xx() -> None:
    """A dry run is a question inside someone's admission deadline (the webhook's 10 s): a 503 is
    its answer, not a reason to wait and ask four more times as a write that must land does."""
    seen: list[str] = []

    async def pods(request: web.Request) -> web.Response:
        seen.append(request.query.get("dryRun", "-"))
        return web.json_response({"message": "unavailable"}, status=503)

    app = web.Application()
    app.router.add_post("/pods", pods)
    async with serving(app) as port:
        client = KubeClient(f"http://127.0.0.1:{port}", None, False)
        try:
            with pytest.raises(kube.ApiError):
                await client.create("/pods", {"kind": "Pod"}, dry_run=True)
            assert seen == ["All"]
            with pytest.raises(kube.ApiError):
                await client.create("/pods", {"kind": "Pod"})
            assert seen[1:] == ["-"] * 5
        finally:
            await client.close()
