"""kopf wiring, deliberately thin: events only enqueue a cluster key; the work queue reconciles.

Handlers are coroutines: kopf runs plain functions in a thread pool, and the work queue
belongs to the event loop. Owned pods, Services and router Deployments are watched by
`ownedwatch` (kopf's per-event bookkeeping is too costly for hundreds of pods). No kopf state-machine handlers (on.create/update with progress annotations) and no daemons
(which would add finalizers): every pass is level-based, so events are hints, and the
periodic resync catches anything a missed event would hide. Deletion is left to the
garbage collector through ownerReferences.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import types
from typing import Any

import aiohttp
import kopf

from tessera_operator import api, kube
from tessera_operator.admission import webhook
from tessera_operator.config import CONFIG
from tessera_operator.kube import KubeClient
from tessera_operator.reconcile.ownedwatch import watch_owned
from tessera_operator.reconcile.reconciler import Reconciler
from tessera_operator.reconcile.workqueue import WorkQueue

# What the operator owns and reacts to between resyncs: a rank pod or Service changing, and the
# router's Deployment turning Ready (the client Service then selects the router at once).
WATCHED_KINDS = ("pods", "services", "deployments")


def decode_deep_json_in_kopf() -> None:
    """kopf lists with aiohttp's `response.json()` and reads watch lines with `json.loads`, both of
    which fail past about 1000 levels: one InferenceCluster with a deep free-form field (stored
    with the webhook off; the API server takes 10000) would then fail every list and watch of its
    namespace, and no cluster there would be reconciled again. Both decode with `kube.loads`."""
    from kopf._cogs.clients import api as kopf_api

    if getattr(aiohttp.ClientResponse.json, "_tessera", False):
        return
    plain = aiohttp.ClientResponse.json

    @functools.wraps(plain)
    async def response_json(self: aiohttp.ClientResponse, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("loads", kube.loads)
        return await plain(self, *args, **kwargs)

    response_json._tessera = True  # type: ignore[attr-defined]
    aiohttp.ClientResponse.json = response_json  # type: ignore[method-assign]
    decoder = types.SimpleNamespace(loads=kube.loads, dumps=json.dumps, JSONDecodeError=json.JSONDecodeError)
    kopf_api.json = decoder  # type: ignore[assignment]


decode_deep_json_in_kopf()

if (
    CONFIG.webhook_port is not None
):  # `kopf run -m tessera_operator.reconcile.handlers` configured by environment
    webhook.register()


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.enabled = False  # our own Events say what happened; kopf's would repeat logs
    settings.watching.server_timeout = 300
    settings.networking.connect_timeout = 10
    client = KubeClient.from_environment(CONFIG.kubeconfig, concurrency=CONFIG.concurrency)
    certfile = webhook.configure(settings, CONFIG, client)
    tasks = []
    if certfile is not None:
        tasks.append(asyncio.create_task(webhook.restart_when_changed(certfile), name="tessera-cert"))
    elif CONFIG.webhook_port is not None:  # serving a self-signed pair made at this start
        tasks.append(asyncio.create_task(webhook.restart_to_renew(), name="tessera-cert"))
    reconciler = Reconciler(
        client,
        resync_seconds=CONFIG.resync_seconds,
        policy=CONFIG.pod_policy,
        autoscale_interval=CONFIG.autoscale_interval_seconds,
    )

    async def handle(key: Any) -> float | None:
        namespace, name = key
        return await reconciler.reconcile(namespace, name)

    queue = WorkQueue(handle, workers=CONFIG.workers, min_interval=CONFIG.min_interval_seconds)
    queue.start()

    def enqueue(namespace: str, cluster: str) -> None:
        queue.add((namespace, cluster))

    scopes: list[str | None] = list(CONFIG.namespaces) or [None]
    tasks += [
        asyncio.create_task(watch_owned(client, kind, ns, enqueue), name=f"tessera-watch-{kind}-{ns}")
        for kind in WATCHED_KINDS
        for ns in scopes
    ]
    memo["client"], memo["queue"], memo["tasks"] = client, queue, tasks
    logging.getLogger("tessera_operator").info(
        "started: %d workers, %d concurrent requests, resync %.0fs",
        CONFIG.workers,
        CONFIG.concurrency,
        CONFIG.resync_seconds,
    )


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    for task in memo["tasks"]:
        task.cancel()
    await asyncio.gather(*memo["tasks"], return_exceptions=True)
    await memo["queue"].stop()
    await memo["client"].close()


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL)  # type: ignore[arg-type]
async def cluster_changed(
    event: dict[str, Any], name: str, namespace: str, memo: kopf.Memo, **_: Any
) -> None:
    queue: WorkQueue = memo["queue"]
    if event.get("type") == "DELETED":
        queue.forget((namespace, name))
    else:
        queue.add((namespace, name))
