"""What to do about the Services and the PodDisruptionBudget a cluster owns, pure: the objects
as listed or read, and the desired ones, in; a plan out. `writes` applies it.

An object of our name that another owner controls is never taken over (`not_ours`); one left
by an orphaning delete (our labels, no controller) is adopted as it is repaired.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from tessera_operator import builders, router_builders
from tessera_operator.builders import ClusterRef
from tessera_operator.reconcile.observe import controlled_by, is_orphaned

ServiceAction = Literal["create", "keep", "repair", "replace", "not_ours"]
BudgetAction = Literal["keep", "create", "delete", "adopt", "patch", "not_ours"]


@dataclass(frozen=True)
class ServicePlan:
    action: ServiceAction
    desired: dict[str, Any]
    current: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return str(self.desired["metadata"]["name"])


@dataclass(frozen=True)
class BudgetPlan:
    action: BudgetAction
    body: dict[str, Any] | None = None  # create: the budget; adopt, patch: the merge patch
    uid: str | None = None  # delete: the precondition (never a newer budget of the name)


def plan_services(
    ref: ClusterRef, services: Iterable[dict[str, Any]], router: bool = False
) -> list[ServicePlan]:
    """The rendezvous (headless) and client Services, in that order; `router`: the client Service
    selects the router's pods (spec.router.enabled)."""
    existing = {s["metadata"]["name"]: s for s in services}
    desired = (builders.build_headless_service(ref), builders.build_client_service(ref, router))
    return [plan_service(ref, want, existing.get(want["metadata"]["name"])) for want in desired]


def plan_service(ref: ClusterRef, desired: dict[str, Any], current: dict[str, Any] | None) -> ServicePlan:
    if current is None:
        return ServicePlan("create", desired)
    orphaned = is_orphaned(current, ref.name)
    if not orphaned and not controlled_by(current, ref.uid):
        return ServicePlan("not_ours", desired, current)  # our labels, another owner
    if not orphaned and not service_drifted(current, desired):
        return ServicePlan("keep", desired, current)
    headless_lost = desired["spec"].get("clusterIP") == "None" and current["spec"].get("clusterIP") != "None"
    # clusterIP is immutable: a Service that lost its headlessness is made again
    return ServicePlan("replace" if headless_lost else "repair", desired, current)


def repaired_service(current: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """The PUT body: the Service as it is (its resourceVersion, clusterIP) with our spec and owner."""
    fixed = dict(current)
    fixed["spec"] = {**current["spec"], **desired["spec"]}
    fixed["metadata"] = {**current["metadata"], "ownerReferences": desired["metadata"]["ownerReferences"]}
    return fixed


def service_drifted(current: dict[str, Any], desired: dict[str, Any]) -> bool:
    cur, want = current.get("spec", {}), desired["spec"]
    if cur.get("selector") != want["selector"]:
        return True
    if bool(cur.get("publishNotReadyAddresses")) != bool(want.get("publishNotReadyAddresses")):
        return True
    if want.get("clusterIP") == "None" and cur.get("clusterIP") != "None":
        return True
    strip = [{k: p.get(k) for k in ("name", "port", "targetPort", "protocol")} for p in cur.get("ports", [])]
    if strip != want["ports"]:
        return True
    owners = [o.get("uid") for o in current["metadata"].get("ownerReferences") or []]
    return desired["metadata"]["ownerReferences"][0]["uid"] not in owners


def plan_budget(
    ref: ClusterRef, desired: dict[str, Any] | None, current: dict[str, Any] | None
) -> BudgetPlan:
    """`desired` None: none wanted (opted out, or one group)."""
    orphaned = current is not None and is_orphaned(current, ref.name)
    if current is not None and not orphaned and not controlled_by(current, ref.uid):
        # another's budget: theirs to keep when we want none; else it would guard our pods wrongly
        return BudgetPlan("keep" if desired is None else "not_ours")
    if desired is None:
        return BudgetPlan("keep") if current is None else BudgetPlan("delete", uid=current["metadata"]["uid"])
    if current is None:
        return BudgetPlan("create", desired)
    if orphaned:  # left by an orphaning delete: adopted, with this cluster's budget
        return BudgetPlan("adopt", {**adoption(current, ref), "spec": desired["spec"]})
    if budget_drifted(current["spec"], desired["spec"]):
        return BudgetPlan("patch", {"spec": desired["spec"]})
    return BudgetPlan("keep")


def budget_drifted(current: dict[str, Any], desired: dict[str, Any]) -> bool:
    """Whether a budget's spec differs from ours in what the API server keeps: one that drops a
    field it does not know (unhealthyPodEvictionPolicy before 1.27) must not be patched each pass."""
    return any(
        current.get(key) != value
        for key, value in desired.items()
        if key in ("minAvailable", "selector") or key in current
    )


def adoption(orphan: dict[str, Any], ref: ClusterRef) -> dict[str, Any]:
    """The merge patch that makes the cluster an orphan's controller; its uid makes it this very
    object, not one made again under its name meanwhile."""
    meta = orphan["metadata"]
    owners = [*(meta.get("ownerReferences") or []), builders.owner_reference(ref)]
    return {"metadata": {"uid": meta["uid"], "ownerReferences": owners}}


OwnedAction = Literal["keep", "create", "update", "delete", "not_ours"]


def plan_owned(
    ref: ClusterRef, desired: dict[str, Any] | None, current: dict[str, Any] | None
) -> OwnedAction:
    """One object the cluster keeps whole (the router's): made, rewritten when its spec hash
    differs from ours, or deleted when none is wanted. Another owner's is left alone (and said so
    when we want one); an orphan of ours is adopted by the rewrite."""
    if current is not None and not is_orphaned(current, ref.name) and not controlled_by(current, ref.uid):
        return "keep" if desired is None else "not_ours"
    if desired is None:
        return "keep" if current is None else "delete"
    if current is None:
        return "create"
    if is_orphaned(current, ref.name) or spec_hash_of(current) != spec_hash_of(desired):
        return "update"
    return "keep"


def spec_hash_of(body: dict[str, Any]) -> str | None:
    annotations = body.get("metadata", {}).get("annotations") or {}
    return annotations.get(router_builders.SPEC_HASH_ANNOTATION)


def updated_owned(current: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """The PUT body: the object as read (its resourceVersion: a 409 if it changed meanwhile) with
    our fields, labels, annotations and owner."""
    body = {**current, **{k: v for k, v in desired.items() if k != "metadata"}}
    meta = current["metadata"]
    body["metadata"] = {
        **meta,
        "labels": {**(meta.get("labels") or {}), **desired["metadata"]["labels"]},
        "annotations": {**(meta.get("annotations") or {}), **desired["metadata"]["annotations"]},
        "ownerReferences": desired["metadata"]["ownerReferences"],
    }
    return body
