"""Whether the Hugging Face Hub answers, reached the way its client reaches it.

``auto`` calibration (textdata.load_calibration) asks before it reads the pinned Hub set: the
Hub client's own retries take ~25 s to give up where there is no route, the probe 5 s. The probe
goes where the client would: huggingface_hub 1.x speaks through httpx with ``trust_env``, which
takes its proxies from the environment as ``urllib.request.getproxies`` reads it and skips them for
the hosts ``NO_PROXY`` names (httpx ``get_environment_proxies``). A cluster that reaches the
Internet only through a proxy therefore reaches the Hub, and so does this probe: through an HTTP
proxy it asks for a tunnel (``CONNECT host:443``) and takes a 2xx answer as the Hub's.

Pure but for ``hub_unreachable``'s one connection; no torch here.
"""

from __future__ import annotations

import base64
import ipaddress
import socket
import ssl
from collections.abc import Callable, Mapping
from urllib.parse import SplitResult, unquote, urlsplit

HUB_PROBE_SECONDS = 5.0
"""How long ``auto`` waits for the Hub's address and a TCP connection (and, through a proxy, the
proxy's answer to the tunnel) before it falls back."""
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def proxy_variables(env: Mapping[str, str]) -> dict[str, str]:
    """``<scheme>_proxy`` variables by scheme, as ``urllib.request.getproxies_environment`` reads them:
    any case, the lowercase spelling winning and an empty lowercase one unsetting; in a CGI
    environment (``REQUEST_METHOD`` set) an upper-case ``HTTP_PROXY`` is ignored."""
    found: dict[str, str] = {}
    for name, value in env.items():
        if value and name.lower().endswith("_proxy"):
            found[name.lower()[:-6]] = value
    if "REQUEST_METHOD" in env:
        found.pop("http", None)
    for name, value in env.items():
        if name.endswith("_proxy"):
            if value:
                found[name[:-6]] = value
            else:
                found.pop(name[:-6], None)
    return found


def _is_ip(entry: str) -> bool:
    try:
        ipaddress.ip_address(entry.split("/")[0].strip("[]"))
    except ValueError:
        return False
    return True


def _covers(entry: str, url: SplitResult) -> bool:
    """Whether one ``no_proxy`` entry covers ``url``, as httpx mounts it: an IP address (a CIDR's
    network address only: httpx matches hosts, not ranges) or ``localhost`` that host exactly;
    ``scheme://host[:port]`` that URL; ``.example.com`` the hosts below example.com;
    ``example.com[:port]`` example.com and the hosts below it."""
    host = (url.hostname or "").lower()
    if _is_ip(entry) or entry == "localhost":
        return host == entry.split("/")[0].strip("[]")
    pattern = urlsplit(entry if "://" in entry else f"all://{entry}")
    try:
        port = pattern.port
    except ValueError:  # not a port number: an entry no URL matches
        return False
    if pattern.scheme not in ("all", url.scheme) or port not in (None, _address(url)[1]):
        return False
    name = pattern.hostname or ""
    if "://" in entry or not name:
        return host == name
    if name.startswith("."):
        return host.endswith(name)
    return host == name or host.endswith("." + name)


def bypassed(url: SplitResult, no_proxy: str) -> bool:
    """Whether a ``no_proxy`` list (comma-separated; ``*`` covers every host) covers ``url``."""
    entries = [e.strip().lower() for e in no_proxy.split(",") if e.strip()]
    return "*" in entries or any(_covers(e, url) for e in entries)


def _address(url: SplitResult) -> tuple[str, int]:
    """(host, port) of a URL, the port defaulting by its scheme."""
    return url.hostname or "", url.port or (443 if url.scheme == "https" else 80)


def hub_proxy(endpoint: str, env: Mapping[str, str]) -> str | None:
    """The proxy URL the Hub client uses for ``endpoint`` (its scheme's proxy, else ``all_proxy``),
    or None: no proxy set, or ``no_proxy`` covers the endpoint's host."""
    proxies = proxy_variables(env)
    url = urlsplit(endpoint)
    proxy = proxies.get(url.scheme) or proxies.get("all")
    if not proxy or bypassed(url, proxies.get("no", "")):
        return None
    return proxy if "://" in proxy else f"http://{proxy}"


def shown(proxy: str) -> str:
    """A proxy URL without its credentials, for messages."""
    p = urlsplit(proxy)
    return f"{p.scheme}://{p.hostname}{':' + str(p.port) if p.port else ''}"


def connect_request(host: str, port: int, proxy: str) -> bytes:
    """The tunnel request an HTTP proxy gets for ``host:port``, with Basic credentials when the proxy
    URL carries them (as httpx sends them)."""
    p = urlsplit(proxy)
    lines = [f"CONNECT {host}:{port} HTTP/1.1", f"Host: {host}:{port}"]
    if p.username is not None:
        token = base64.b64encode(f"{unquote(p.username)}:{unquote(p.password or '')}".encode()).decode()
        lines.append(f"Proxy-Authorization: Basic {token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _tunnel(proxy: str, host: str, port: int, connect: Callable[..., socket.socket]) -> str | None:
    """Ask ``proxy`` for a tunnel to ``host:port``: None when it grants one, else what it answered."""
    p = urlsplit(proxy)
    with connect(_address(p), timeout=HUB_PROBE_SECONDS) as raw:
        sock = ssl.create_default_context().wrap_socket(raw, server_hostname=p.hostname) \
            if p.scheme == "https" else raw
        sock.sendall(connect_request(host, port, proxy))
        status = sock.recv(1024).split(b"\r\n", 1)[0].decode("latin-1").strip()
    parts = status.split(" ", 2)
    if len(parts) >= 2 and parts[0].startswith("HTTP/") and parts[1].startswith("2"):
        return None
    return f"the proxy {shown(proxy)} answered {status or 'nothing'!r} to CONNECT {host}:{port}"


def hub_unreachable(env: Mapping[str, str], connect: Callable[..., socket.socket] = socket.create_connection
                    ) -> str | None:
    """Why the Hub cannot be reached from here (offline mode, no name, no connection, a proxy that
    refuses the tunnel), or None. ``connect``: ``socket.create_connection`` (tests replace it)."""
    for name in OFFLINE_VARIABLES:
        if (env.get(name) or "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{name} is set"
    endpoint = env.get("HF_ENDPOINT") or DEFAULT_HUB_ENDPOINT
    url = urlsplit(endpoint)
    proxy = hub_proxy(endpoint, env)
    try:
        if proxy is not None and url.scheme == "https":
            return _tunnel(proxy, *_address(url), connect)
        # Direct; or a plain-HTTP endpoint, which goes through its proxy as ordinary requests: reaching
        # the proxy is the probe.
        with connect(_address(urlsplit(proxy or endpoint)), timeout=HUB_PROBE_SECONDS):
            return None
    except OSError as e:
        return f"{endpoint} unreachable{f' through the proxy {shown(proxy)}' if proxy else ''}: {e}"
