"""Pure pieces of the node agent: DNS records and answers, $(VAR) expansion, endpoint selection."""

from __future__ import annotations

import asyncio
import gc
import socket
import struct
from typing import Any

import pytest

from e2e.container_spec import ContainerConfigError, container_argv, expand, resource_field_value
from e2e.pod_dns import RCODE_NXDOMAIN, answer, build_records
from e2e.service_proxy import ready_targets


def _query(name: str, qtype: int = 1) -> bytes:
    labels = b"".join(bytes([len(part)]) + part.encode() for part in name.split("."))
    return struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack("!HH", qtype, 1)


def _decode(reply: bytes) -> tuple[int, list[str]]:
    _id, flags, _qd, ancount, _ns, _ar = struct.unpack("!HHHHHH", reply[:12])
    # Each answer is 16 bytes at the end: name pointer, type, class, TTL, length, 4 address bytes.
    answers = reply[len(reply) - 16 * ancount :]
    addresses = [socket.inet_ntoa(answers[16 * i + 12 : 16 * i + 16]) for i in range(ancount)]
    return flags & 0xF, addresses


ENDPOINTS: list[dict[str, Any]] = [
    {
        "metadata": {"name": "web", "namespace": "ns"},
        "subsets": [
            {
                "addresses": [{"ip": "10.9.1.2", "hostname": "web-0"}, {"ip": "10.9.2.2"}],
                "notReadyAddresses": [{"ip": "10.9.3.2"}],
                "ports": [{"name": "http", "port": 8080}],
            }
        ],
    },
    {"metadata": {"name": "empty", "namespace": "ns"}},
]
PODS: list[dict[str, Any]] = [
    {"metadata": {"namespace": "ns"}, "status": {"podIP": "10.9.1.2"}},
    {"metadata": {"namespace": "ns"}},
]


def test_records_follow_ready_endpoints_hostnames_and_pod_ips() -> None:
    records = build_records(ENDPOINTS, PODS)
    assert records == {
        "web.ns.svc.cluster.local": ["10.9.1.2", "10.9.2.2"],  # not-ready addresses left out
        "web-0.web.ns.svc.cluster.local": ["10.9.1.2"],
        "empty.ns.svc.cluster.local": [],
        "10-9-1-2.ns.pod.cluster.local": ["10.9.1.2"],
    }


def test_answers_known_names_and_refuses_everything_outside_the_cluster() -> None:
    records = build_records(ENDPOINTS, PODS)
    assert _decode(answer(_query("WEB.ns.svc.cluster.local"), records) or b"") == (
        0,
        ["10.9.1.2", "10.9.2.2"],
    )
    # AAAA of a known name: no error, no address (glibc asks both at once).
    assert _decode(answer(_query("web.ns.svc.cluster.local", qtype=28), records) or b"") == (0, [])
    # A Service without ready endpoints exists, with no address.
    assert _decode(answer(_query("empty.ns.svc.cluster.local"), records) or b"") == (0, [])
    assert _decode(answer(_query("example.com"), records) or b"")[0] == RCODE_NXDOMAIN
    assert answer(b"\x00\x01", records) is None  # garbage is dropped, not answered


def test_resource_field_refs_resolve_as_the_kubelet_resolves_them() -> None:
    """OMP_NUM_THREADS from limits.cpu and the like: the amount over the divisor, rounded up."""
    worker = {
        "name": "w",
        "resources": {"limits": {"cpu": "2500m", "memory": "1Gi"}, "requests": {"cpu": "1"}},
    }
    pod = {"spec": {"containers": [worker, {"name": "sidecar"}]}}
    assert resource_field_value(pod, worker, {"resource": "limits.cpu"}) == "3"
    assert resource_field_value(pod, worker, {"resource": "requests.cpu", "divisor": "1m"}) == "1000"
    assert resource_field_value(pod, worker, {"resource": "limits.memory", "divisor": "1Mi"}) == "1024"
    assert resource_field_value(pod, worker, {"resource": "requests.memory", "divisor": "1Mi"}) == "1024"
    unlimited = resource_field_value(pod, worker, {"containerName": "sidecar", "resource": "limits.cpu"})
    assert int(unlimited) >= 1  # the node's capacity
    with pytest.raises(ContainerConfigError, match="unsupported resourceFieldRef"):
        resource_field_value(pod, worker, {"resource": "limits.gpu"})


def test_var_references_expand_like_kubernetes() -> None:
    env = {"PORT": "8000", "HOST": "web-0"}
    assert expand("$(HOST):$(PORT)/$(MISSING)/$$(PORT)", env) == "web-0:8000/$(MISSING)/$(PORT)"
    argv = container_argv({"name": "c", "command": ["tessera"], "args": ["serve", "--port", "$(PORT)"]}, env)
    assert argv[0].endswith("/bin/tessera") and argv[1:] == ["serve", "--port", "8000"]
    with pytest.raises(ContainerConfigError, match="no command"):
        container_argv({"name": "c"}, env)


def test_the_proxy_picks_ready_addresses_of_the_named_port() -> None:
    service = {
        "metadata": {"name": "web"},
        "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
    }
    assert ready_targets(service, ENDPOINTS[0], 80) == [("10.9.1.2", 8080), ("10.9.2.2", 8080)]
    assert ready_targets(service, None, 80) == []
    with pytest.raises(ValueError, match="no port 81"):
        ready_targets(service, ENDPOINTS[0], 81)


def test_the_proxy_tries_one_endpoint_as_kube_proxy_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # kube-proxy never retries: a pod that refuses (it stopped listening while its Endpoints
    # still list it) or swallows the SYN (its address is gone) fails that client's connection,
    # with a reset; the next connection goes to the next endpoint.
    from e2e import service_proxy

    async def run() -> list[bytes | str]:
        listener = await asyncio.start_server(lambda r, w: (w.write(b"live"), w.close()), "127.0.0.1", 0)
        live_port = listener.sockets[0].getsockname()[1]
        refusing = socket.socket()
        refusing.bind(("127.0.0.1", 0))
        refused_port = refusing.getsockname()[1]
        refusing.close()  # bound once, never listening: connections to it are refused
        real_open = asyncio.open_connection

        async def open_connection(host: str, port: int) -> Any:
            if host == "10.9.9.9":
                await asyncio.sleep(3600)  # a blackholed address
            return await real_open(host, port)

        monkeypatch.setattr(service_proxy.asyncio, "open_connection", open_connection)
        monkeypatch.setattr(service_proxy, "CONNECT_TIMEOUT_SECONDS", 0.2)
        proxy = service_proxy.ServiceProxy(None, "ns", "web", 80)  # type: ignore[arg-type]
        proxy._read_at = float("inf")
        proxy._targets = [("127.0.0.1", refused_port), ("10.9.9.9", 8080), ("127.0.0.1", live_port)]
        front = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
        answers: list[bytes | str] = []
        for _ in range(3):
            reader, writer = await real_open("127.0.0.1", front.sockets[0].getsockname()[1])
            try:
                answers.append(await asyncio.wait_for(reader.read(), 5))
            except ConnectionResetError:
                answers.append("reset")
            writer.close()
        front.close()
        listener.close()
        return answers

    assert asyncio.run(run()) == ["reset", "reset", b"live"]


def test_the_proxy_closes_the_pod_connection_of_a_client_that_left_before_the_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A queued request: the client gives up before its pod has sent a byte. The proxy must still
    # finish the connection (and close the pod's side), not lose it to the garbage collector.
    from e2e import service_proxy

    async def run() -> bool:
        answered, pod_side_closed = asyncio.Event(), asyncio.Event()

        async def pod(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(100)
            await answered.wait()
            writer.write(b"late answer")
            await writer.drain()
            if await reader.read() == b"":
                pod_side_closed.set()

        pod_server = await asyncio.start_server(pod, "127.0.0.1", 0)
        proxy = service_proxy.ServiceProxy(None, "ns", "web", 80)  # type: ignore[arg-type]
        proxy._targets, proxy._read_at = [("127.0.0.1", pod_server.sockets[0].getsockname()[1])], float("inf")
        front = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
        _reader, client = await asyncio.open_connection("127.0.0.1", front.sockets[0].getsockname()[1])
        client.write(b"POST /v1/completions HTTP/1.1\r\n\r\n")
        await client.drain()
        await asyncio.sleep(0.3)
        client.close()
        await asyncio.sleep(0.3)
        gc.collect()
        answered.set()
        try:
            await asyncio.wait_for(pod_side_closed.wait(), 5)
        except TimeoutError:
            return False
        finally:
            front.close()
            pod_server.close()
        return True

    assert asyncio.run(run())
    gc.collect()
    assert not [r.getMessage() for r in caplog.records if "destroyed but it is pending" in r.getMessage()]
