"""`auto` calibration's Hub probe goes where the Hub client goes (issue 47): through the proxy the
environment names (HTTPS_PROXY, ALL_PROXY, lower case first), around it for the hosts NO_PROXY
names, as huggingface_hub's httpx reads them. A proxy-only cluster reached the Hub through its
client but always fell back, because the probe dialled the Hub directly.

A stub proxy on loopback answers the tunnel request; nothing leaves this machine (the Hub's name
is never resolved through the proxy: the proxy is asked to do that)."""

from __future__ import annotations

import base64
import os
import socket
import threading
from urllib.parse import urlsplit

import pytest

from fewerbits_quantjob import hubprobe


class StubProxy:
    """An HTTP proxy on loopback that answers each CONNECT with ``status`` and records the requests."""

    def __init__(self, status: bytes = b"HTTP/1.1 200 Connection established"):
        self.status = status
        self.requests: list[str] = []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(1024)
                    if not chunk:
                        break
                    head += chunk
                self.requests.append(head.decode())
                conn.sendall(self.status + b"\r\n\r\n")

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def proxy():
    stub = StubProxy()
    yield stub
    stub.close()


HUB = "https://hub.example.invalid"


def test_a_proxy_only_cluster_reaches_the_hub_through_its_proxy(proxy):
    env = {"HF_ENDPOINT": HUB, "HTTPS_PROXY": f"http://user:p%40ss@127.0.0.1:{proxy.port}"}
    assert hubprobe.hub_unreachable(env) is None
    (request,) = proxy.requests
    assert request.startswith("CONNECT hub.example.invalid:443 HTTP/1.1\r\n")
    token = base64.b64encode(b"user:p@ss").decode()
    assert f"Proxy-Authorization: Basic {token}" in request


def test_a_proxy_that_refuses_the_tunnel_is_the_reason_without_its_credentials():
    stub = StubProxy(b"HTTP/1.1 403 Forbidden")
    try:
        why = hubprobe.hub_unreachable({"HF_ENDPOINT": HUB, "https_proxy": f"http://u:secret@127.0.0.1:{stub.port}"})
    finally:
        stub.close()
    assert why == (f"the proxy http://127.0.0.1:{stub.port} answered 'HTTP/1.1 403 Forbidden' to CONNECT "
                   "hub.example.invalid:443")
    assert "secret" not in why


def test_no_proxy_sends_the_probe_direct(proxy):
    # The direct connection goes to a closed loopback port: refused at once, and the proxy saw nothing.
    env = {"HF_ENDPOINT": "https://127.0.0.1:9", "HTTPS_PROXY": f"http://127.0.0.1:{proxy.port}",
           "NO_PROXY": "localhost,127.0.0.1"}
    why = hubprobe.hub_unreachable(env)
    assert why is not None and why.startswith("https://127.0.0.1:9 unreachable: ") and "proxy" not in why
    assert proxy.requests == []


def test_an_unreachable_proxy_is_named_in_the_reason():
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    why = hubprobe.hub_unreachable({"HF_ENDPOINT": HUB, "ALL_PROXY": f"127.0.0.1:{port}"})
    assert why.startswith(f"{HUB} unreachable through the proxy http://127.0.0.1:{port}: ")


def test_offline_mode_is_the_reason_before_any_connection():
    def refuse(*_a, **_k):
        raise AssertionError("connected")

    assert hubprobe.hub_unreachable({"HF_HUB_OFFLINE": "1", "HTTPS_PROXY": "http://p:3128"}, refuse) == \
        "HF_HUB_OFFLINE is set"


@pytest.mark.parametrize("env, endpoint, proxy", [
    ({}, HUB, None),
    ({"HTTPS_PROXY": "http://p:3128"}, HUB, "http://p:3128"),
    ({"HTTPS_PROXY": "p:3128"}, HUB, "http://p:3128"),  # no scheme: http, as httpx reads it
    ({"HTTPS_PROXY": "http://upper:1", "https_proxy": "http://lower:1"}, HUB, "http://lower:1"),
    ({"HTTPS_PROXY": "http://upper:1", "https_proxy": ""}, HUB, None),  # an empty lower-case one unsets
    ({"ALL_PROXY": "http://all:1"}, HUB, "http://all:1"),
    ({"HTTP_PROXY": "http://plain:1"}, HUB, None),  # another scheme's proxy
    ({"HTTP_PROXY": "http://plain:1"}, "http://mirror.internal", "http://plain:1"),
    ({"HTTPS_PROXY": "http://p:1", "NO_PROXY": "*"}, HUB, None),
    ({"HTTPS_PROXY": "http://p:1", "NO_PROXY": "example.invalid"}, HUB, None),  # the domain and below
    ({"HTTPS_PROXY": "http://p:1", "NO_PROXY": ".example.invalid"}, HUB, None),
    ({"HTTPS_PROXY": "http://p:1", "NO_PROXY": ".hub.example.invalid"}, HUB, "http://p:1"),  # below only
    ({"HTTPS_PROXY": "http://p:1", "NO_PROXY": "ample.invalid"}, HUB, "http://p:1"),  # not a suffix match
    ({"HTTPS_PROXY": "http://p:1", "no_proxy": "hub.example.invalid:443"}, HUB, None),
    ({"HTTPS_PROXY": "http://p:1", "no_proxy": "hub.example.invalid:8443"}, HUB, "http://p:1"),
    ({"HTTPS_PROXY": "http://p:1", "no_proxy": "http://hub.example.invalid"}, HUB, "http://p:1"),  # other scheme
    ({"HTTPS_PROXY": "http://p:1", "no_proxy": "10.0.0.0/8"}, "https://10.1.2.3", "http://p:1"),  # no ranges
    ({"HTTPS_PROXY": "http://p:1", "no_proxy": "10.1.2.3"}, "https://10.1.2.3", None),
    ({"HTTPS_PROXY": "http://p:1", "no_proxy": "bad:port"}, HUB, "http://p:1"),
])
def test_the_proxy_is_chosen_as_the_hub_client_chooses_it(env, endpoint, proxy):
    assert hubprobe.hub_proxy(endpoint, env) == proxy


def test_the_table_agrees_with_httpx_where_httpx_reads_the_environment(monkeypatch):
    """The Hub client's own reading (huggingface_hub 1.x uses httpx with trust_env) on the same
    variables: the proxy httpx mounts for the Hub's URL is the one the probe uses."""
    httpx = pytest.importorskip("httpx")
    for key in [k for k in os.environ if k.lower().endswith("_proxy")]:
        monkeypatch.delenv(key)
    cases = [({"HTTPS_PROXY": "http://p:3128"}, HUB),
             ({"HTTPS_PROXY": "http://p:3128", "NO_PROXY": "example.invalid"}, HUB),
             ({"HTTPS_PROXY": "http://p:3128", "NO_PROXY": ".hub.example.invalid"}, HUB),
             ({"ALL_PROXY": "http://a:1"}, HUB), ({"HTTPS_PROXY": "http://p:1", "NO_PROXY": "*"}, HUB),
             ({"HTTP_PROXY": "http://plain:1"}, "http://mirror.internal")]
    for env, endpoint in cases:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        mounts = httpx._utils.get_environment_proxies()
        url = httpx.URL(endpoint)
        patterns = sorted(httpx._utils.URLPattern(p) for p in mounts)
        chosen = next((mounts[p.pattern] for p in patterns if p.matches(url)), None)
        assert hubprobe.hub_proxy(endpoint, env) == chosen, env
        for k in env:
            monkeypatch.delenv(k)


def test_shown_drops_credentials():
    assert hubprobe.shown("http://user:pw@proxy.corp:3128") == "http://proxy.corp:3128"
    assert urlsplit(hubprobe.shown("https://proxy.corp")).port is None
