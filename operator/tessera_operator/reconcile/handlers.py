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
from typing import Any, cast

import aiohttp
import kopf

from tessera_operator import api, kube
from tessera_operator.admission import webhook
from tessera_operator.config import CONFIG
from tessera_operator.kube import KubeClient, custom_path
from tessera_operator.leadership import settings as leader_settings
from tessera_operator.leadership.elector import LeaderElector, LeaderOnlyClient
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
# Set by `tessera-operator` from its flags; `kopf run` takes the environment's.
LEADER_ELECTION = leader_settings.from_env()

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
    election = LEADER_ELECTION
    # The reconciler's own client: with leader election, its writes stop the instant the term ends.
    # The webhook, the watches and the election itself keep the plain one (every replica serves).
    guarded = (
        cast(
            LeaderOnlyClient,
            LeaderOnlyClient.from_environment(CONFIG.kubeconfig, concurrency=CONFIG.concurrency),
        )
        if election.leader_elect
        else None
    )
    writer = guarded or client
    reconciler = Reconciler(
        writer,
        resync_seconds=CONFIG.resync_seconds,
        policy=CONFIG.pod_policy,
        autoscale_interval=CONFIG.autoscale_interval_seconds,
    )

    async def handle(key: Any) -> float | None:
        namespace, name = key
        return await reconciler.reconcile(namespace, name)

    queue = WorkQueue(handle, workers=CONFIG.workers, min_interval=CONFIG.min_interval_seconds)

    def enqueue(namespace: str, cluster: str) -> None:
        queue.add((namespace, cluster))

    scopes: list[str | None] = list(CONFIG.namespaces) or [None]
    tasks += [
        asyncio.create_task(watch_owned(client, kind, ns, enqueue), name=f"tessera-watch-{kind}-{ns}")
        for kind in WATCHED_KINDS
        for ns in scopes
    ]
    elector, electing = None, None
    if guarded is not None:
        elector = elector_for(election, client, guarded, queue, scopes)
        electing = asyncio.create_task(elector.run(), name="tessera-leader-election")
    else:
        queue.start()
    memo["writer"], memo["elector"], memo["electing"] = writer, elector, electing
    memo["client"], memo["queue"], memo["tasks"] = client, queue, tasks
    logging.getLogger("tessera_operator").info(
        "started: %d workers, %d concurrent requests, resync %.0fs",
        CONFIG.workers,
        CONFIG.concurrency,
        CONFIG.resync_seconds,
    )


def elector_for(
    election: leader_settings.LeaderElection,
    client: KubeClient,
    writer: LeaderOnlyClient,
    queue: WorkQueue,
    scopes: list[str | None],
) -> LeaderElector:
    """The election, wired: the work queue's workers run only while this replica leads."""

    listing: list[asyncio.Task[None]] = []

    async def enqueue_all() -> None:
        # A new leader looks at every cluster at once: a change made while no one led (the old
        # leader dead or cut off) must not wait for the next event or resync.
        for ns in scopes:
            path = (
                custom_path(api.GROUP, api.VERSION, ns, api.PLURAL)
                if ns
                else f"/apis/{api.GROUP}/{api.VERSION}/{api.PLURAL}"
            )
            try:
                items = await client.list(path)
            except Exception as exc:  # kopf's watch queued each at its start as well
                logging.getLogger("tessera_operator").warning(
                    "cannot list %s to reconcile them: %s", path, exc
                )
                continue
            for item in items:
                queue.add((item["metadata"]["namespace"], item["metadata"]["name"]))

    async def started() -> None:
        queue.start()
        # In the background: the elector goes on renewing while it lists (the API may be slow).
        listing.append(asyncio.create_task(enqueue_all(), name="tessera-enqueue-all"))

    async def stopped() -> None:
        for task in listing:
            task.cancel()
        await asyncio.gather(*listing, return_exceptions=True)
        listing.clear()
        await queue.stop()
        log_writes(writer, "stopped reconciling")

    namespace = leader_settings.lease_namespace(election, list(CONFIG.namespaces))
    elector = LeaderElector(
        client, election, namespace, leader_settings.holder_identity(election), started, stopped
    )
    writer.may_write = elector.is_leader
    return elector


def log_writes(writer: LeaderOnlyClient, when: str) -> None:
    """The reconciler's writes so far: none from a replica that never led, none sent after a term."""
    logging.getLogger("tessera_operator.leadership").info(
        "%s: %d writes sent, %d refused (not leading)", when, writer.writes_sent, writer.writes_refused
    )


@kopf.on.probe(id="leadership")
def leadership(memo: kopf.Memo, **_: Any) -> dict[str, Any]:
    """In /healthz: this replica's identity, whether it leads, the holder it last saw, and the
    writes its reconciler sent (and refused for want of a term). kopf caches probes for 10 s;
    the Lease's holderIdentity is the current word on who leads."""
    elector: LeaderElector | None = memo.get("elector")
    if elector is None:
        return {"leader": True, "election": "off"}
    writer: LeaderOnlyClient = memo["writer"]
    return {**elector.health(), "writes": writer.writes_sent, "writesRefused": writer.writes_refused}


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    if memo["electing"] is not None:  # its end stops the queue: no pass writes after it
        memo["electing"].cancel()
        await asyncio.gather(memo["electing"], return_exceptions=True)
        await memo["elector"].release()
    for task in memo["tasks"]:
        task.cancel()
    await asyncio.gather(*memo["tasks"], return_exceptions=True)
    await memo["queue"].stop()
    await memo["client"].close()
    if memo["writer"] is not memo["client"]:
        log_writes(memo["writer"], "shutting down")
        await memo["writer"].close()


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL)  # type: ignore[arg-type]
async def cluster_changed(
    event: dict[str, Any], name: str, namespace: str, memo: kopf.Memo, **_: Any
) -> None:
    queue: WorkQueue = memo["queue"]
    if event.get("type") == "DELETED":
        queue.forget((namespace, name))
    else:
        queue.add((namespace, name))
