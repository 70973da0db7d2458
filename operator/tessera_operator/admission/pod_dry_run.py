"""The API server's own verdict on a revision's pods, asked with a server-side dry run.

The CRD keeps what the spec passes into pods (volumes, env sources, affinity, ...) free-form, and
`validation.py` checks its outline only: Kubernetes' full pod validation, and the namespace's
admission policies (LimitRanges, policy webhooks), run when a pod is created. Creating one leader
and one worker of a revision with `dryRun=All` first turns a pod the API server would refuse into
an invalid spec naming the pod's field, before a rollout deletes a running group that nothing
could then replace.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from tessera_operator import builders
from tessera_operator.api import InferenceClusterSpec
from tessera_operator.fielderror import FieldError
from tessera_operator.kube import ApiError, KubeClient, core_path

log = logging.getLogger("tessera_operator.admission.pod_dry_run")
# A pod the API server cannot decode (400) or finds invalid (422). Not 403: a quota exceeded
# now may fit once a rollout's old group is gone.
REFUSED_STATUSES = (400, 422)
# ... except the 400 of a pod webhook that cannot take dry runs (sideEffects Unknown, the
# default of admissionregistration v1beta1): the real create would pass it.
NO_DRY_RUN_MESSAGE = "does not support dry run"
# Well inside the webhook's own 10 s: a slow policy webhook must not fail a valid object closed.
DRY_RUN_TIMEOUT_S = 5.0
MAX_CAUSES = 5


def sample_pods(ref: builders.ClusterRef, spec: InferenceClusterSpec, revision: str) -> list[dict[str, Any]]:
    """A leader and (if the group has one) a worker of the revision, under generated names (a
    running pod of the same name would otherwise answer 409) and owned by nothing (an object
    being admitted may have no uid yet)."""
    group = builders.build_group(ref, spec, revision, 0)
    samples = group[:1] + group[1:][-1:]
    for pod in samples:
        meta = pod["metadata"]
        meta["generateName"] = meta.pop("name") + "-"
        meta.pop("ownerReferences", None)
    return samples


def refusal_errors(exc: ApiError) -> list[FieldError]:
    """The API server's causes, each naming the pod field at fault."""
    body: dict[str, Any] = exc.body if isinstance(exc.body, dict) else {"message": str(exc.body)}
    causes = (body.get("details") or {}).get("causes") or []
    named = [
        f"{c['field']}: {c.get('message', '')}" if c.get("field") else str(c.get("message", ""))
        for c in causes[:MAX_CAUSES]
    ]
    details = "; ".join(named) or str(body.get("message", exc))
    return [FieldError("spec.template", f"the API server refuses the rank pods made from it: {details}")]


async def refused_pod_fields(
    client: KubeClient, ref: builders.ClusterRef, spec: InferenceClusterSpec, revision: str
) -> list[FieldError] | None:
    """Why the API server would refuse this revision's `sample_pods` ([] when it takes them), or
    None when it could not say (unreachable, slow, a policy webhook down or unable to dry-run):
    best effort, never a blocked repair. The pods are asked at once, each once, within
    DRY_RUN_TIMEOUT_S."""
    path = core_path(ref.namespace, "pods")
    pods = sample_pods(ref, spec, revision)
    try:
        async with asyncio.timeout(DRY_RUN_TIMEOUT_S):
            answers = await asyncio.gather(
                *(client.create(path, pod, dry_run=True) for pod in pods), return_exceptions=True
            )
    except TimeoutError:
        answers = [TimeoutError(f"no answer within {DRY_RUN_TIMEOUT_S:g} s")]
    failures = [a for a in answers if isinstance(a, BaseException)]
    refusals = [f for f in failures if isinstance(f, ApiError) and is_refusal(f)]
    if refusals:
        return refusal_errors(refusals[0])
    for failure in failures:
        if not isinstance(failure, ApiError | aiohttp.ClientError | TimeoutError):
            raise failure
        log.warning("%s/%s: no dry run of revision %s's pods: %s", ref.namespace, ref.name, revision, failure)
        return None
    return []


def is_refusal(exc: ApiError) -> bool:
    return exc.status in REFUSED_STATUSES and NO_DRY_RUN_MESSAGE not in str(exc)
