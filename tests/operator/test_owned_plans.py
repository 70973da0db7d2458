"""The pure plans for what a cluster owns besides its pods: Services, the budget, scaling."""

from typing import Any

from tessera_operator import builders
from tessera_operator.api import AutoscalingSpec
from tessera_operator.builders import ClusterRef
from tessera_operator.reconcile.owned_plans import plan_budget, plan_services
from tessera_operator.scaling.autoscaler import History
from tessera_operator.scaling.plan import plan_scale, seconds_until_sample

REF = ClusterRef("demo", "ns", "uid-1")


def foreign(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {**obj["metadata"], "uid": "x", "ownerReferences": [{"uid": "other", "controller": True}]}
    return {**obj, "metadata": meta}


def test_services_missing_are_created_ours_kept_and_anothers_refused() -> None:
    assert [p.action for p in plan_services(REF, [])] == ["create", "create"]
    ours = [builders.build_headless_service(REF), builders.build_client_service(REF)]
    assert [p.action for p in plan_services(REF, ours)] == ["keep", "keep"]
    assert [p.action for p in plan_services(REF, [foreign(ours[0]), ours[1]])] == ["not_ours", "keep"]


def test_a_rendezvous_service_that_lost_its_headlessness_is_made_again() -> None:
    headless = builders.build_headless_service(REF)
    drifted = {**headless, "spec": {**headless["spec"], "clusterIP": "10.0.0.1"}}
    assert plan_services(REF, [drifted])[0].action == "replace"


def test_the_budget_plan() -> None:
    desired = {"metadata": {"name": "demo"}, "spec": {"minAvailable": 1, "selector": {}}}
    current = {
        **desired,
        "metadata": {"name": "demo", "uid": "b1", "ownerReferences": [builders.owner_reference(REF)]},
    }
    assert plan_budget(REF, None, None).action == "keep"
    assert plan_budget(REF, desired, None).action == "create"
    assert plan_budget(REF, desired, current).action == "keep"
    assert plan_budget(REF, None, current).uid == "b1"
    changed = {**desired, "spec": {"minAvailable": 2, "selector": {}}}
    assert plan_budget(REF, changed, current).body == {"spec": changed["spec"]}
    assert plan_budget(REF, desired, foreign(current)).action == "not_ours"
    assert plan_budget(REF, None, foreign(current)).action == "keep"


def test_the_scaling_plan_waits_for_its_interval_and_warns_once_when_blind() -> None:
    settings = AutoscalingSpec.model_validate(
        {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 2}
    )
    history = History()
    assert seconds_until_sample(history, 100.0, 15.0) is None
    loaded = plan_scale(settings, 1, {0: 7.0}, history, 100.0)
    assert loaded.scales and loaded.decision.desired == 4 and loaded.event()[0] == "ScaledUp"
    assert seconds_until_sample(history, 105.0, 15.0) == 10.0
    blind = plan_scale(settings, 1, {0: None}, history, 120.0)
    assert blind.blind and blind.blind_warning is not None and not blind.scales
    history.blind = blind.blind
    assert plan_scale(settings, 1, {0: None}, history, 140.0).blind_warning is None
