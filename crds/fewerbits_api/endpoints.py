"""Endpoints the operator, the quantization Job and the runtime fetcher connect to on a user's behalf.

A `spec.source.endpoint` or `spec.storage.endpoint` is an address the operator (reading configs
and manifests), the Job and the fetcher will send requests to, with the workload's identity. An
endpoint in link-local space or naming a cloud metadata service would hand that identity's
credentials (or the node's) to whoever wrote the spec, so such endpoints are refused always,
before any connection; a policy's `rules.allowedEndpoints` can only narrow what is left.

One function, used by all three (standard library only: the fetcher's image carries this package).
The operator checks literal addresses and known names only, so deciding stays pure (no DNS in the
decision); the Job and the fetcher, which are about to connect anyway, also check what the name
resolves to. Loopback stays allowed (tests and sidecar stores use it).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

METADATA_NAMES = frozenset({
    "metadata", "metadata.google.internal", "metadata.goog",  # GCP
    "instance-data", "instance-data.ec2.internal",  # AWS
    "metadata.azure.com",  # Azure
})
"""Host names of cloud instance metadata services (compared lowercased, without a trailing dot)."""

METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean, Oracle
    "fd00:ec2::254",  # AWS over IPv6
    "100.100.100.200",  # Alibaba Cloud
    "169.254.170.2",  # AWS ECS task credentials
))
LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))

Resolver = Callable[[str], Iterable[str]]


class EndpointRefused(ValueError):
    """An endpoint the workload must not connect to; the message says why."""


def endpoint_matches(url: str, pattern: str) -> bool:
    """Whether ``url`` matches a `rules.allowedEndpoints` glob: `*` matches any run of characters
    but `/` (so `https://*.storage.svc:9000` cannot match `https://evil.example/x.storage.svc:9000`);
    everything else matches itself."""
    regex = "".join("[^/]*" if part == "*" else re.escape(part) for part in re.split(r"(\*)", pattern))
    return re.fullmatch(regex, url) is not None


def endpoint_host(url: str) -> str:
    """The URL's host, lowercased, brackets and a trailing dot removed ('' when it has none)."""
    try:
        host = urlsplit(url).hostname or ""
    except ValueError:
        return ""
    return host.rstrip(".").lower()


def literal_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a host names literally, in any form a resolver accepts without asking DNS:
    dotted, IPv6, and the legacy IPv4 forms (`2852039166`, `0xa9.0xfe.0xa9.0xfe`, `169.254.43518`)."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if host and all(c in "0123456789abcdefx." for c in host) and host[0].isdigit():
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def address_refusal(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr in METADATA_ADDRESSES:
        return f"{addr} is a cloud metadata service address"
    if any(addr in net for net in LINK_LOCAL if net.version == addr.version):
        return f"{addr} is a link-local address"
    return None


def endpoint_refusal(url: str, resolve: Resolver | None = None) -> str | None:
    """Why ``url`` must not be connected to, or None. Without ``resolve``: pure (literal addresses
    and known metadata names only). With it: every address the host resolves to is checked too (a
    name that does not resolve is not refused here; connecting will fail on its own)."""
    host = endpoint_host(url)
    if not host:
        return None
    if host in METADATA_NAMES:
        return f"{host} is a cloud metadata service"
    addr = literal_address(host)
    if addr is not None:
        return address_refusal(addr)
    if resolve is not None:
        try:
            resolved = list(resolve(host))
        except OSError:
            return None
        for a in resolved:
            try:
                why = address_refusal(ipaddress.ip_address(a.split("%", 1)[0]))
            except ValueError:
                continue
            if why:
                return f"{host} resolves to {why.replace(' is ', ', ', 1)}"
    return None


def resolve_host(host: str) -> list[str]:
    """The addresses ``host`` resolves to (the system resolver, as a connection would use)."""
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})


def check_endpoint(url: str | None, field: str, resolve: Resolver | None = resolve_host) -> None:
    """Raise ``EndpointRefused`` naming ``field`` when ``url`` is refused (see module doc). Used by
    the Job and the fetcher right before they build a client; they resolve by default."""
    if not url:
        return
    if why := endpoint_refusal(url, resolve):
        raise EndpointRefused(f"{field}: {url} is refused: {why}")
