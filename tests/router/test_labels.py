"""The router's copy of the operator's pod labels matches the operator's own (naming.py)."""

from __future__ import annotations

from tessera.router import labels
from tessera_operator import naming


def test_the_routers_labels_are_the_operators() -> None:
    assert labels.CLUSTER_LABEL == naming.CLUSTER_LABEL
    assert labels.ROLE_LABEL == naming.ROLE_LABEL
    assert labels.LEADER == naming.LEADER
    assert labels.MANAGED_BY == naming.MANAGED_BY
    assert labels.LEAVING_LABEL == naming.LEAVING_LABEL
    # The pods the router follows are those the client Service selects.
    assert labels.leader_pod_selector("c1") == naming.selector_string(naming.rank_leader_selector("c1"))
