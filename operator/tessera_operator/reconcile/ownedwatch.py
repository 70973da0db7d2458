"""Watch the pods, Services and router Deployments the operator owns and enqueue their cluster:
cheap, no kopf (a router Deployment turning Ready moves the client Service onto it at once).

kopf computes a diff base and progress state for every event of every watched object; for
hundreds of rank pods that cost more CPU than everything else the operator does (profiled:
about 25 s for 800 pods). Here an event costs a JSON parse and a dict lookup. The IC itself
stays on kopf (few objects, and the webhook and liveness come with it).

Like client-go's reflector: list once, then watch from the last resourceVersion seen (a stream
the server ends is resumed from there, not listed again); list again only when that version is
gone (410). Failures back off exponentially with jitter, so an API server in trouble is not
asked again by every operator at once; an event the client cannot decode is skipped (kube.py).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from tessera_operator import naming
from tessera_operator.kube import ApiError, KubeClient

log = logging.getLogger("tessera_operator.reconcile.ownedwatch")
WATCH_TIMEOUT_SECONDS = 300
BACKOFF_BASE_SECONDS, BACKOFF_MAX_SECONDS = 0.5, 30.0
# A stream that ends this soon with nothing in it counts as a failure (a proxy that closes it at
# once would otherwise have it reopened in a tight loop).
MIN_HEALTHY_STREAM_SECONDS = 1.0


# The API group of each watched kind outside the core group.
GROUP_PATHS = {"deployments": "/apis/apps/v1"}


def collection_path(kind: str, namespace: str | None) -> str:
    prefix = GROUP_PATHS.get(kind, "/api/v1")
    return f"{prefix}/namespaces/{namespace}/{kind}" if namespace else f"{prefix}/{kind}"


def backoff_delay(failures: int, rand: Callable[[], float] = random.random) -> float:
    """The wait after `failures` failures in a row: exponential, capped, with jitter (half of it
    random, so waits still grow while operators restarted together spread out)."""
    ceiling = min(BACKOFF_MAX_SECONDS, BACKOFF_BASE_SECONDS * 2 ** max(failures - 1, 0))
    return ceiling * (0.5 + 0.5 * rand())


class Gone(Exception):
    """The resourceVersion watched from is too old (410): list again."""


async def watch_owned(
    client: KubeClient,
    kind: str,
    namespace: str | None,
    on_cluster: Callable[[str, str], None],
    *,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    rand: Callable[[], float] = random.random,
    monotonic: Callable[[], float] = time.monotonic,
) -> None:
    path = collection_path(kind, namespace)
    selector = naming.CLUSTER_LABEL
    version: str | None = None  # the last resourceVersion seen; None: list first
    failures = 0
    while True:
        try:
            if version is None:
                listing = await client.list_object(path, selector)
                for item in listing.get("items", []):
                    meta = item["metadata"]
                    on_cluster(meta["namespace"], meta["labels"][naming.CLUSTER_LABEL])
                version = listing["metadata"]["resourceVersion"]
            params = {
                "labelSelector": selector,
                "resourceVersion": version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(WATCH_TIMEOUT_SECONDS),
            }
            started, seen = monotonic(), 0
            async for event in client.watch(path, params):
                kind_of = event.get("type")
                obj = event.get("object") or {}
                if kind_of == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone(obj.get("message", "410 Gone"))
                    raise ApiError(int(obj.get("code") or 500), obj)
                seen, failures = seen + 1, 0
                meta = obj.get("metadata") or {}
                version = meta.get("resourceVersion") or version
                cluster = (meta.get("labels") or {}).get(naming.CLUSTER_LABEL)
                if cluster and kind_of != "BOOKMARK":
                    on_cluster(meta["namespace"], cluster)
            if seen == 0 and monotonic() - started < MIN_HEALTHY_STREAM_SECONDS:
                raise ConnectionError("the watch stream ended at once")
            failures = 0  # a stream that ran its course: resume from `version` at once
            continue
        except asyncio.CancelledError:
            raise
        except Gone as exc:
            log.info("watch on %s: resourceVersion %s expired (%s); listing again", path, version, exc)
            version = None
            failures += 1
            if failures == 1:
                continue  # the usual case: list again at once
        except ApiError as exc:
            if exc.status == 410:
                version = None
            failures += 1
            log.warning("watch on %s interrupted (%s)", path, exc)
        except (OSError, ValueError, KeyError) as exc:
            failures += 1
            log.warning("watch on %s interrupted (%s)", path, exc)
        except Exception:  # aiohttp's own errors included: never let the watch die
            failures += 1
            log.exception("watch on %s failed", path)
        delay = backoff_delay(failures, rand)
        log.info("watch on %s: retrying in %.1fs (failure %d in a row)", path, delay, failures)
        await sleep(delay)
