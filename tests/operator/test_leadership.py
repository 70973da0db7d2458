"""Leader election's decisions without a cluster: when a replica may take the Lease, what it
writes, how its term ends, and that only a leading replica's reconciler writes."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from aiohttp import web

from tessera_operator.__main__ import parse_args
from tessera_operator.kube import ApiError
from tessera_operator.leadership import lease
from tessera_operator.leadership.elector import LeaderElector, LeaderOnlyClient, NotLeading
from tessera_operator.leadership.settings import LeaderElection
from tests.fixtures.loopback_http import serving

HELD = lease.Record("other_1", 15, "a", "b", 3)


def test_a_free_missing_or_own_lease_may_be_taken_at_once() -> None:
    for record in (None, lease.Record(), lease.Record("me_1", 15)):
        assert lease.may_take(lease.Observed(record, at=100.0), "me_1", now=100.0)


def test_a_held_lease_expires_by_this_replicas_clock_from_the_last_change_it_saw() -> None:
    seen = lease.observe(None, HELD, now=100.0)
    assert not lease.may_take(seen, "me_1", now=114.9)
    # The same record seen again keeps its time: nobody renewed it.
    seen = lease.observe(seen, HELD, now=110.0)
    assert seen.at == 100.0 and lease.may_take(seen, "me_1", now=115.0)
    # A renewal (any change) restarts the wait, whatever renewTime another node's clock wrote.
    renewed = lease.observe(seen, lease.Record("other_1", 15, "a", "c", 3), now=114.0)
    assert renewed.at == 114.0 and not lease.may_take(renewed, "me_1", now=128.0)


def test_a_renewal_keeps_acquire_time_and_a_takeover_counts_a_transition() -> None:
    renewed = lease.claim(lease.Record("me_1", 15, "t0", "t1", 2), "me_1", wall=1e9, duration_seconds=15)
    assert (renewed.acquire_time, renewed.transitions) == ("t0", 2) and renewed.renew_time != "t1"
    taken = lease.claim(HELD, "me_1", wall=1e9, duration_seconds=4)
    assert taken.holder == "me_1" and taken.transitions == 4 and taken.acquire_time == taken.renew_time
    assert taken.duration_seconds == 4 and taken.renew_time == "2001-09-09T01:46:40.000000Z"
    assert lease.claim(None, "me_1", wall=1e9, duration_seconds=4).transitions == 0


def test_a_release_frees_the_lease_for_the_next_try() -> None:
    released = lease.release(HELD, wall=1e9)
    assert released.holder == "" and released.duration_seconds == 1 and released.transitions == 3
    assert released.spec()["holderIdentity"] is None
    assert lease.may_take(lease.Observed(released, at=0.0), "me_1", now=0.0)


def test_the_term_ends_a_renew_deadline_after_the_renewal_was_sent() -> None:
    assert lease.leading_until(renewal_sent=50.0, renew_deadline=10.0) == 60.0


@pytest.mark.parametrize(
    ("lease_s", "renew_s", "retry_s"),
    [(10, 10, 2), (10, 12, 2), (15, 10, 9)],
    ids=["equal", "longer", "retry"],
)
def test_settings_that_would_let_two_leaders_act_are_refused(
    lease_s: float, renew_s: float, retry_s: float
) -> None:
    with pytest.raises(ValueError):
        LeaderElection(
            lease_duration_seconds=lease_s, renew_deadline_seconds=renew_s, retry_period_seconds=retry_s
        )


def test_the_flags_set_the_election() -> None:
    args = parse_args(
        ["-n", "a", "--leader-elect", "--leader-elect-lease-duration=4", "--leader-elect-renew-deadline=3"]
    )
    assert args.leader_elect is True and args.lease_duration_seconds == 4 and args.renew_deadline_seconds == 3
    assert parse_args(["-n", "a"]).leader_elect is False  # off unless asked (the chart asks)


class FakeLeaseApi:
    """The Lease's API as the API server keeps it: resourceVersion checked on update, 409 on a
    stale one or a second create; `down` makes every call fail as a partition would."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.down: set[str] = set()

    def client(self, name: str) -> Any:
        api = self

        class Client:
            async def request(self, method: str, path: str, body: Any = None, **_: Any) -> dict[str, Any]:
                if name in api.down:
                    raise OSError("connection reset")
                return api.handle(method, body)

        return Client()

    def handle(self, method: str, body: Any) -> dict[str, Any]:
        if method == "GET":
            if self.lease is None:
                raise ApiError(404, {"message": "not found"})
            return copy.deepcopy(self.lease)
        if method == "POST" and self.lease is not None:
            raise ApiError(409, {"message": "exists"})
        if method == "PUT" and (
            self.lease is None or body["metadata"]["resourceVersion"] != str(self.version)
        ):
            raise ApiError(409, {"message": "conflict"})
        self.version += 1
        self.lease = {
            **copy.deepcopy(body),
            "metadata": {**body["metadata"], "resourceVersion": str(self.version)},
        }
        return copy.deepcopy(self.lease)


def elector(api: FakeLeaseApi, name: str, settings: LeaderElection) -> LeaderElector:
    async def nothing() -> None:
        return None

    return LeaderElector(api.client(name), settings, "ops", f"{name}_1", nothing, nothing)


async def test_of_two_replicas_one_leads_and_a_cut_off_leader_stops_before_the_other_takes_over() -> None:
    api = FakeLeaseApi()
    settings = LeaderElection(
        leader_elect=True, lease_duration_seconds=1, renew_deadline_seconds=0.6, retry_period_seconds=0.1
    )
    a, b = elector(api, "a", settings), elector(api, "b", settings)
    assert await a.try_acquire_or_renew(timeout=1) is True
    assert await b.try_acquire_or_renew(timeout=1) is False and a.is_leader() and not b.is_leader()
    runs = [asyncio.create_task(e.run()) for e in (a, b)]
    try:
        await asyncio.sleep(0.5)
        assert a.is_leader() and not b.is_leader()
        api.down.add("a")
        loop = asyncio.get_running_loop()
        cut = loop.time()
        while not b.is_leader():
            assert loop.time() - cut < 3, "b never took over"
            # Never both: by the time b leads, a's term is over.
            assert not (a.is_leader() and b.is_leader())
            await asyncio.sleep(0.01)
        assert not a.is_leader() and api.lease is not None
        assert api.lease["spec"]["holderIdentity"] == "b_1" and api.lease["spec"]["leaseTransitions"] == 1
        # Healed, a finds the lease held and stands by.
        api.down.clear()
        await asyncio.sleep(0.5)
        assert b.is_leader() and not a.is_leader()
        await b.release()
        assert api.lease["spec"]["holderIdentity"] is None
    finally:
        for run in runs:
            run.cancel()
        await asyncio.gather(*runs, return_exceptions=True)


async def test_only_a_leading_replica_sends_writes() -> None:
    seen: list[str] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(f"{request.method} {request.query.get('dryRun', '')}".strip())
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/x", record)
    async with serving(app) as port:
        client = LeaderOnlyClient(f"http://127.0.0.1:{port}", None, False)
        leading = True
        client.may_write = lambda: leading
        try:
            await client.merge_patch("/x", {})
            leading = False
            with pytest.raises(NotLeading):
                await client.create("/x", {})
            with pytest.raises(NotLeading):
                await client.delete("/x")
            await client.get("/x")  # reads and dry runs are no writes: a standby may make them
            await client.create("/x", {}, dry_run=True)
        finally:
            await client.close()
    assert seen == ["PATCH", "GET", "POST All"]
    assert (client.writes_sent, client.writes_refused) == (1, 2)
