"""The operator's API client on a real socket: watches never starve its requests."""

from __future__ import annotations

import asyncio

from aiohttp import web

from tessera_operator.kube import KubeClient


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
