"""Endpoints the operator, the quantization Job and the runtime fetcher connect to on a user's behalf.

A `spec.source.endpoint` or `spec.storage.endpoint` is an address the operator (reading configs
and manifests), the Job and the fetcher will send requests to, with the workload's identity. An
endpoint in link-local space or naming a cloud metadata service would hand that identity's
credentials (or the node's) to whoever wrote the spec, so such endpoints are refused always,
before any connection; a policy's `rules.allowedEndpoints` can only narrow what is left.

One implementation, used by all three (standard library only: the fetcher's image carries this
package). Deciding stays pure: the operator's acceptance checks literal addresses and known names
only. Connecting is guarded (``guard_endpoint``): right before a client is built, the name is
resolved once, every address is checked, and the addresses that passed are *pinned*: later lookups
of that name in this process return them without asking DNS again, so a second lookup cannot
rebind the name to a refused address (`169.254.169.254.nip.io`, or a record with a zero TTL that
changes between the check and the connection). The pin lives at ``socket.getaddrinfo`` because
Python has no per-client resolver: botocore (urllib3), urllib.request, requests and huggingface_hub
all resolve there at connect time, and the Host header and TLS server name (SNI, certificate
check) stay the name the user wrote. A pin is re-resolved and re-checked after ``PIN_SECONDS``.

Private ranges (RFC 1918, carrier-grade NAT, IPv6 unique-local) are refused too unless the
operator's ``allowPrivateEndpoints`` setting allows them (an in-cluster MinIO at a Service
address needs it); the operator hands the setting to the Job and the fetcher as
``FEWERBITS_ALLOW_PRIVATE_ENDPOINTS``. Loopback stays allowed: it reaches only the pod itself
(tests and sidecar stores use it).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
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
PRIVATE = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",  # RFC 1918
    "100.64.0.0/10",  # RFC 6598 carrier-grade NAT (some clusters' pod and Service ranges)
    "fc00::/7",  # RFC 4193 unique-local
))
"""Refused unless the setting allows private endpoints (``ALLOW_PRIVATE_ENV``)."""
ALLOW_PRIVATE_ENV = "FEWERBITS_ALLOW_PRIVATE_ENDPOINTS"
"""How the operator hands its ``allowPrivateEndpoints`` setting to the Job and the fetcher."""
ALLOW_PRIVATE_HINT = ("private addresses are allowed only when the operator's allowPrivateEndpoints setting is true "
                      "(FEWERBITS_ALLOW_PRIVATE_ENDPOINTS; chart value config.allowPrivateEndpoints)")
PIN_SECONDS = 300.0
"""How long a checked resolution is reused before the name is resolved and checked again."""

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


def address_refusal(addr: ipaddress.IPv4Address | ipaddress.IPv6Address, allow_private: bool = True) -> str | None:
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr in METADATA_ADDRESSES:
        return f"{addr} is a cloud metadata service address"
    if any(addr in net for net in LINK_LOCAL if net.version == addr.version):
        return f"{addr} is a link-local address"
    if not allow_private and any(addr in net for net in PRIVATE if net.version == addr.version):
        return f"{addr} is a private address ({ALLOW_PRIVATE_HINT})"
    return None


def _resolved_refusal(host: str, addresses: Iterable[str], allow_private: bool) -> str | None:
    for a in addresses:
        try:
            why = address_refusal(ipaddress.ip_address(a.split("%", 1)[0]), allow_private)
        except ValueError:
            return f"{host} resolves to {a!r}, not an IP address"
        if why:
            return f"{host} resolves to {why.replace(' is ', ', ', 1)}"
    return None


def endpoint_refusal(url: str, resolve: Resolver | None = None, allow_private: bool = True) -> str | None:
    """Why ``url`` must not be connected to, or None. Without ``resolve``: pure (literal addresses
    and known metadata names only). With it: every address the host resolves to is checked too (a
    name that does not resolve is not refused here; connecting will fail on its own). Private
    ranges are refused only when ``allow_private`` is false."""
    host = endpoint_host(url)
    if not host:
        return None
    if host in METADATA_NAMES:
        return f"{host} is a cloud metadata service"
    addr = literal_address(host)
    if addr is not None:
        return address_refusal(addr, allow_private)
    if resolve is not None:
        try:
            resolved = list(resolve(host))
        except OSError:
            return None
        return _resolved_refusal(host, resolved, allow_private)
    return None


def resolve_host(host: str) -> list[str]:
    """The addresses ``host`` resolves to (the system resolver, as a connection would use)."""
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})


def check_endpoint(url: str | None, field: str, resolve: Resolver | None = resolve_host,
                   allow_private: bool = True) -> None:
    """Raise ``EndpointRefused`` naming ``field`` when ``url`` is refused (see module doc). A check
    only: ``guard_endpoint`` also pins what was checked for the connection."""
    if not url:
        return
    if why := endpoint_refusal(url, resolve, allow_private):
        raise EndpointRefused(f"{field}: {url} is refused: {why}")


def allow_private_from_env(env: Mapping[str, str] | None = None) -> bool:
    """The Job's and the fetcher's copy of the operator's allowPrivateEndpoints setting."""
    value = (os.environ if env is None else env).get(ALLOW_PRIVATE_ENV, "")
    return value.strip().lower() in ("1", "true", "yes")


# ------------------------------------------------------------------ pinning (the connection side)


class PinnedRefusal(socket.gaierror):
    """A pinned name re-resolved (after ``PIN_SECONDS``) to a refused address: raised from
    ``socket.getaddrinfo``, so every client library reports it as a failed name lookup, with why."""


class _Pins:
    """Checked resolutions of guarded names, served from ``socket.getaddrinfo`` (see module doc)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # host -> (addresses, when checked, allow_private, field, the URL as the user wrote it)
        self.table: dict[str, tuple[list[str], float, bool, str, str]] = {}
        self.system_getaddrinfo = socket.getaddrinfo
        self.installed = False
        self.resolve: Resolver = self._system_resolve
        self.clock: Callable[[], float] = time.monotonic

    def _system_resolve(self, host: str) -> list[str]:
        infos = self.system_getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        return sorted({str(info[4][0]) for info in infos})

    def install(self) -> None:
        with self.lock:
            if not self.installed:
                socket.getaddrinfo = self.getaddrinfo
                self.installed = True

    def pin(self, host: str, field: str, allow_private: bool, resolve: Resolver | None = None,
            url: str | None = None) -> list[str]:
        """Resolve ``host`` once, check every address, keep them; raise EndpointRefused naming ``field``."""
        url = url or host
        try:
            addresses = sorted(set(map(str, (resolve or self.resolve)(host))))
        except OSError:
            with self.lock:  # not resolvable now: resolved and checked when a connection asks
                self.table[host] = ([], float("-inf"), allow_private, field, url)
            raise
        if why := _resolved_refusal(host, addresses, allow_private):
            raise EndpointRefused(f"{field}: {url} is refused: {why}")
        with self.lock:
            self.table[host] = (addresses, self.clock(), allow_private, field, url)
        return addresses

    def fresh(self, host: str, allow_private: bool) -> bool:
        with self.lock:
            entry = self.table.get(host)
        return entry is not None and entry[2] == allow_private and self.clock() - entry[1] <= PIN_SECONDS

    def getaddrinfo(self, host, port, family=0, type=0, proto=0, flags=0):  # noqa: A002 - socket's own names
        name = host.decode() if isinstance(host, bytes) else host
        key = name.rstrip(".").lower() if isinstance(name, str) else name
        with self.lock:
            entry = self.table.get(key)
        if entry is None:
            return self.system_getaddrinfo(host, port, family, type, proto, flags)
        addresses, at, allow_private, field, url = entry
        if self.clock() - at > PIN_SECONDS:
            try:
                addresses = self.pin(key, field, allow_private, url=url)
            except EndpointRefused as e:
                raise PinnedRefusal(socket.EAI_FAIL, str(e)) from None
        out = []
        for a in addresses:  # numeric: no DNS is asked; the socket's shape comes from the system
            try:
                out += self.system_getaddrinfo(a, port, family, type, proto, flags | socket.AI_NUMERICHOST)
            except socket.gaierror:
                continue  # an address of the other family than the one asked for
        if not out:
            raise socket.gaierror(socket.EAI_NONAME, f"{key}: no checked address of the family asked for")
        return out


PINS = _Pins()


def guard_endpoint(url: str | None, field: str, allow_private: bool, resolve: Resolver | None = None) -> None:
    """Refuse ``url`` (EndpointRefused naming ``field``) or pin its name's checked addresses for
    every connection this process makes to it (module doc). ``resolve`` replaces DNS (tests)."""
    if not url:
        return
    check_endpoint(url, field, None, allow_private)  # literals and metadata names, no DNS
    host = endpoint_host(url)
    if not host or literal_address(host) is not None:
        return  # a literal is connected to as written: nothing to rebind
    PINS.install()
    if PINS.fresh(host, allow_private) and resolve is None:
        return  # checked within PIN_SECONDS: no lookup per request
    try:
        PINS.pin(host, field, allow_private, resolve, url)
    except OSError:
        pass  # no address yet: the connection's own lookup resolves and checks it, or fails on its own
