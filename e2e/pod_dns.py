"""The cluster's DNS for pods: A records built from the API's Services, Endpoints and Pods.

It answers what CoreDNS's kubernetes plugin answers for `cluster.local` and nothing else (names
outside the cluster get NXDOMAIN: it never forwards, so pods only ever reach this machine):
  <svc>.<ns>.svc.cluster.local              ready endpoint IPs (headless or not: there is no
                                            kube-proxy, so a ClusterIP Service answers with the
                                            addresses behind it)
  <hostname>.<svc>.<ns>.svc.cluster.local   the endpoint address carrying that hostname (pods
                                            with spec.hostname and spec.subdomain = <svc>)
  <a-b-c-d>.<ns>.pod.cluster.local          the pod IP a.b.c.d
  kubernetes.default.svc.cluster.local      where the node agent forwards to the API server
"""

from __future__ import annotations

import asyncio
import ipaddress
import struct
from collections.abc import Iterable, Mapping
from typing import Any, cast

DOMAIN = "cluster.local"
API_SERVICE_NAME = f"kubernetes.default.svc.{DOMAIN}"
TYPE_A = 1
CLASS_IN = 1
RCODE_NXDOMAIN = 3
TTL_SECONDS = 5

Records = dict[str, list[str]]


def build_records(endpoints: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> Records:
    """Name -> IPv4 addresses, from the Endpoints of every Service and every pod with an IP."""
    records: Records = {}
    for item in endpoints:
        meta = item["metadata"]
        service_name = f"{meta['name']}.{meta['namespace']}.svc.{DOMAIN}"
        addresses = records.setdefault(service_name, [])
        for subset in item.get("subsets") or []:
            # Not-ready addresses are listed only for publishNotReadyAddresses Services' endpoints.
            for address in subset.get("addresses") or []:
                if address["ip"] not in addresses:
                    addresses.append(address["ip"])
                if address.get("hostname"):
                    records[f"{address['hostname']}.{service_name}"] = [address["ip"]]
    for pod in pods:
        pod_ip = pod.get("status", {}).get("podIP")
        if pod_ip:
            namespace = pod["metadata"]["namespace"]
            records[f"{pod_ip.replace('.', '-')}.{namespace}.pod.{DOMAIN}"] = [pod_ip]
    return records


def _parse_question(packet: bytes) -> tuple[int, int, str, int, int] | None:
    """(id, flags, qname, qtype, end offset of the question) of a one-question query."""
    if len(packet) < 12:
        return None
    query_id, flags, qdcount = struct.unpack("!HHH", packet[:6])
    if qdcount != 1 or flags & 0x8000:
        return None
    labels, offset = [], 12
    while offset < len(packet) and packet[offset] != 0:
        length = packet[offset]
        if length & 0xC0:  # compression never appears in a question
            return None
        labels.append(packet[offset + 1 : offset + 1 + length].decode("ascii", "replace"))
        offset += 1 + length
    offset += 1
    if offset + 4 > len(packet):
        return None
    qtype, _qclass = struct.unpack("!HH", packet[offset : offset + 4])
    return query_id, flags, ".".join(labels).lower(), qtype, offset + 4


def answer(packet: bytes, records: Mapping[str, list[str]]) -> bytes | None:
    parsed = _parse_question(packet)
    if parsed is None:
        return None
    query_id, flags, qname, qtype, question_end = parsed
    addresses = records.get(qname)
    known = addresses is not None and (bool(addresses) or qname.endswith(f".svc.{DOMAIN}"))
    rcode = 0 if known else RCODE_NXDOMAIN
    answers = [a for a in (addresses or []) if qtype == TYPE_A]
    # QR, opcode copied, AA, RD copied, RA off (we recurse for nobody).
    response_flags = 0x8000 | (flags & 0x7900) | 0x0400 | rcode
    header = struct.pack("!HHHHHH", query_id, response_flags, 1, len(answers), 0, 0)
    body = packet[12:question_end]
    for address in answers:
        # Name: a pointer to the question's name at offset 12.
        body += struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, TTL_SECONDS, 4)
        body += ipaddress.IPv4Address(address).packed
    return header + body


class DnsServer(asyncio.DatagramProtocol):
    """UDP on <address>:53; `records` is replaced wholesale by whoever watches the API."""

    def __init__(self) -> None:
        self.records: Records = {}
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        reply = answer(data, self.records)
        if reply is not None and self._transport is not None:
            self._transport.sendto(reply, addr)

    async def start(self, address: str, port: int = 53) -> None:
        loop = asyncio.get_running_loop()
        await loop.create_datagram_endpoint(lambda: self, local_addr=(address, port))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
