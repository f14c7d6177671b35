"""Endpoints the operator, the Job and the fetcher connect to on a user's behalf (issue 16, bad input):
link-local and cloud metadata addresses refused always, before any connection; a policy's
`allowedEndpoints` narrows the rest. No traffic is sent: names are resolved by a fake resolver."""

from __future__ import annotations

from typing import Any

import pytest

from fewerbits_api.endpoints import EndpointRefused, check_endpoint, endpoint_matches, endpoint_refusal
from fewerbits_api.policy import QuantizationPolicy
from fewerbits_operator.artifacts.effective import combine_policies, deep_merge, effective_spec, effective_values

SPEC = {"source": {"uri": "s3://models/llama", "endpoint": "http://127.0.0.1:9000"},
        "storage": {"uri": "s3://bkt/q", "endpoint": "http://127.0.0.1:9000"}}


@pytest.mark.parametrize("url, why", [
    ("http://127.0.0.1:9000", None),                      # loopback: tests and sidecar stores
    ("http://localhost:9000", None),
    ("https://minio.storage.svc:9000", None),
    ("https://s3.us-east-1.amazonaws.com", None),
    ("http://10.0.0.5:9000", None),
    ("http://[::1]:9000", None),
    ("http://169.254.169.254", "169.254.169.254 is a cloud metadata service address"),
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is a cloud metadata service address"),
    ("http://169.254.10.1:9000", "169.254.10.1 is a link-local address"),
    ("http://100.100.100.200", "100.100.100.200 is a cloud metadata service address"),
    ("http://169.254.170.2", "169.254.170.2 is a cloud metadata service address"),
    ("http://[fd00:ec2::254]", "fd00:ec2::254 is a cloud metadata service address"),
    ("http://[fe80::1]:9000", "fe80::1 is a link-local address"),
    ("http://[::ffff:169.254.169.254]", "169.254.169.254 is a cloud metadata service address"),
    ("http://metadata.google.internal", "metadata.google.internal is a cloud metadata service"),
    ("http://METADATA.google.internal.", "metadata.google.internal is a cloud metadata service"),
    ("http://metadata", "metadata is a cloud metadata service"),
    # Legacy IPv4 spellings a resolver turns into the metadata address without asking DNS.
    ("http://2852039166", "169.254.169.254 is a cloud metadata service address"),
    ("http://0xa9.0xfe.0xa9.0xfe", "169.254.169.254 is a cloud metadata service address"),
    ("http://169.254.43518", "169.254.169.254 is a cloud metadata service address"),
    ("http://0251.0376.0251.0376", "169.254.169.254 is a cloud metadata service address"),
    ("http://1password.example", None),
])
def test_default_refusals_are_pure(url, why):
    assert endpoint_refusal(url) == why


def test_a_name_is_checked_by_what_it_resolves_to_when_a_resolver_is_given():
    table = {"rebind.example": ["10.0.0.1", "169.254.169.254"], "store.example": ["10.0.0.2"]}

    def resolve(host: str) -> list[str]:
        if host not in table:
            raise OSError("no such host")
        return table[host]

    assert endpoint_refusal("http://rebind.example:9000") is None  # the operator: no DNS
    assert endpoint_refusal("http://rebind.example:9000", resolve) == \
        "rebind.example resolves to 169.254.169.254, a cloud metadata service address"
    assert endpoint_refusal("http://store.example", resolve) is None
    assert endpoint_refusal("http://unknown.example", resolve) is None  # connecting fails on its own
    with pytest.raises(EndpointRefused, match=r"^spec.storage.endpoint: http://rebind.example:9000 is refused: "):
        check_endpoint("http://rebind.example:9000", "spec.storage.endpoint", resolve)
    check_endpoint(None, "spec.storage.endpoint", resolve)
    check_endpoint("http://127.0.0.1:9000", "spec.storage.endpoint")  # a literal: the resolver is not asked


@pytest.mark.parametrize("patch, error", [
    ({"storage": {"endpoint": "http://169.254.169.254"}},
     "spec.storage.endpoint: http://169.254.169.254 is refused: 169.254.169.254 is a cloud metadata service address"),
    ({"source": {"endpoint": "http://metadata.google.internal"}},
     "spec.source.endpoint: http://metadata.google.internal is refused: metadata.google.internal is a cloud "
     "metadata service"),
    ({"storage": {"endpoint": "http://169.254.1.2:9000"}},
     "spec.storage.endpoint: http://169.254.1.2:9000 is refused: 169.254.1.2 is a link-local address"),
])
def test_the_effective_spec_refuses_them_naming_the_field(patch, error):
    eff = effective_spec(deep_merge(SPEC, patch), None)
    assert not eff.accepted and eff.errors == [error]


def test_a_policy_default_storage_is_checked_too():
    p = qp("defaults", defaults={"storage": {"uri": "s3://bkt/q", "endpoint": "http://169.254.169.254"}})
    spec = {"source": SPEC["source"]}
    eff = effective_spec(spec, combine_policies([p]))
    assert [e.split(":")[0] for e in eff.errors] == ["spec.storage.endpoint"]


def qp(name: str, priority: int = 0, rules: dict | None = None, defaults: dict | None = None) -> QuantizationPolicy:
    return QuantizationPolicy.model_validate({"metadata": {"name": name}, "spec": {
        "priority": priority, "rules": rules or {}, "defaults": defaults or {}}})


STORES = qp("stores", rules={"allowedEndpoints": ["http://127.0.0.1:*", "https://*.storage.svc:9000"]})


def judge(policies: list[QuantizationPolicy], **patch: Any):
    return effective_spec(deep_merge(SPEC, patch), combine_policies(policies))


@pytest.mark.parametrize("patch, violations", [
    ({}, []),
    ({"storage": {"endpoint": "https://minio.storage.svc:9000"}}, []),
    ({"storage": {"uri": "s3://bkt/q"}, "source": {"uri": "hf://meta-llama/Llama-3.1-8B", "endpoint": None}}, []),
    ({"storage": {"endpoint": "https://s3.example.com"}},
     ["policy stores rule allowedEndpoints: spec.storage.endpoint https://s3.example.com matches none of "
      "http://127.0.0.1:*, https://*.storage.svc:9000"]),
    ({"source": {"endpoint": "https://minio.storage.svc:9001"}},
     ["policy stores rule allowedEndpoints: spec.source.endpoint https://minio.storage.svc:9001 matches "
      "none of http://127.0.0.1:*, https://*.storage.svc:9000"]),
])
def test_allowed_endpoints(patch, violations):
    assert judge([STORES], **patch).violations == violations


def test_unset_endpoints_pass_the_list():
    eff = effective_spec({"source": {"uri": "hf://meta-llama/Llama-3.1-8B"}, "storage": {"uri": "s3://bkt/q"}},
                         combine_policies([STORES]))
    assert eff.accepted, eff.violations


def test_endpoints_must_pass_every_policy_with_a_list():
    other = qp("other", 5, rules={"allowedEndpoints": ["http://127.0.0.1:9000"]})
    assert judge([STORES, other]).accepted
    eff = judge([other, STORES], storage={"endpoint": "http://127.0.0.1:9001"})
    assert [v.split(":")[0] for v in eff.violations] == ["policy other rule allowedEndpoints"]
    values = [(v.path, v.value, v.source) for v in effective_values(eff).values if v.path == "rules.allowedEndpoints"]
    assert values == [("rules.allowedEndpoints", '["http://127.0.0.1:9000"]', "other"),
                      ("rules.allowedEndpoints", '["http://127.0.0.1:*","https://*.storage.svc:9000"]', "stores")]


def test_a_list_cannot_allow_what_is_refused_always():
    anything = qp("anything", rules={"allowedEndpoints": ["*"]})
    eff = judge([anything], storage={"endpoint": "http://169.254.169.254"})
    assert not eff.accepted and eff.errors[0].startswith("spec.storage.endpoint: ")


@pytest.mark.parametrize("url, pattern, ok", [
    ("https://minio.storage.svc:9000", "https://*.storage.svc:9000", True),
    ("https://evil.example/x.storage.svc:9000", "https://*.storage.svc:9000", False),
    ("http://127.0.0.1:9000", "http://127.0.0.1:*", True),
    ("http://127.0.0.1:9000/p", "http://127.0.0.1:*", False),
    ("http://127.0.0.1:9000/p", "http://127.0.0.1:*/*", True),
    ("http://a.b", "http://a?b", False),  # only `*` is special
])
def test_endpoint_globs_never_span_a_slash(url, pattern, ok):
    assert endpoint_matches(url, pattern) is ok


# ------------------------------------------------------------------ the Job and the fetcher


def _resolve_to_metadata(host: str) -> list[str]:
    return ["169.254.169.254"]


def _job_contract(**storage: Any):
    from fewerbits_api.artifact import ArtifactKeyInputs
    from fewerbits_api.formats import QuantFormat
    from fewerbits_api.jobcontract import QuantJobContract

    ki = ArtifactKeyInputs(sourceUri="s3://models/m", format=QuantFormat.FP8_DYNAMIC)
    return QuantJobContract(key=ki.key(), keyInputs=ki, storage={"uri": "s3://bucket/p", **storage})


def test_the_job_refuses_before_connecting():
    from fewerbits_quantjob import errors, job
    from fewerbits_quantjob.errors import JobError

    job.verify_endpoints(_job_contract(endpoint="http://127.0.0.1:9000"), {})
    with pytest.raises(JobError) as e:
        job.verify_endpoints(_job_contract(endpoint="http://store.example:9000"), {}, resolve=_resolve_to_metadata)
    assert e.value.reason == errors.ENDPOINT_REFUSED and e.value.permanent
    assert e.value.message == ("storage.endpoint: http://store.example:9000 is refused: store.example resolves to "
                               "169.254.169.254, a cloud metadata service address")
    with pytest.raises(JobError, match="^FEWERBITS_SOURCE_S3_ENDPOINT: http://169.254.1.1 is refused"):
        job.verify_endpoints(_job_contract(), {"FEWERBITS_SOURCE_S3_ENDPOINT": "http://169.254.1.1"})


def test_the_fetcher_refuses_before_connecting():
    from fewerbits_runtime.errors import UsageError
    from fewerbits_runtime.storage import make_client

    with pytest.raises(UsageError, match=r"^--endpoint \(FEWERBITS_STORAGE_ENDPOINT\): http://\[fd00:ec2::254\]"):
        make_client("http://[fd00:ec2::254]", None, 4)
    with pytest.raises(UsageError, match="store.example resolves to 169.254.169.254"):
        make_client("http://store.example:9000", None, 4, resolve=_resolve_to_metadata)
    assert make_client("http://127.0.0.1:9000", None, 4).meta.endpoint_url == "http://127.0.0.1:9000"


# ------------------------------------------------------------------ private ranges, pinning (issue 31)


@pytest.mark.parametrize("url, why", [
    ("http://10.0.0.5:9000", "10.0.0.5 is a private address"),
    ("http://172.20.1.1", "172.20.1.1 is a private address"),
    ("http://192.168.1.9:9000", "192.168.1.9 is a private address"),
    ("http://100.64.0.1", "100.64.0.1 is a private address"),
    ("http://[fd12::1]:9000", "fd12::1 is a private address"),
    ("http://0x0a000005", "10.0.0.5 is a private address"),  # legacy spelling of 10.0.0.5
    ("http://127.0.0.1:9000", None),  # loopback: only the pod itself
    ("http://[::1]:9000", None),
    ("https://s3.us-east-1.amazonaws.com", None),
])
def test_private_addresses_are_refused_unless_the_setting_allows_them(url, why):
    refused = endpoint_refusal(url, allow_private=False)
    assert (refused.split(" (")[0] if refused else None) == why
    if why:
        assert "allowPrivateEndpoints" in refused
    assert endpoint_refusal(url, allow_private=True) is None


class FakeDNS:
    """A resolver whose answers a test changes, counting the questions (no traffic is sent)."""

    def __init__(self, table: dict[str, list[str]]):
        self.table, self.asked = table, 0

    def __call__(self, host: str) -> list[str]:
        self.asked += 1
        if host not in self.table:
            raise OSError("no such host")
        return self.table[host]


@pytest.fixture
def pins(monkeypatch):
    """The process-wide pins with a fake resolver and a hand-moved clock; emptied afterwards."""
    from fewerbits_api import endpoints

    now = [1000.0]
    dns = FakeDNS({})
    monkeypatch.setattr(endpoints.PINS, "resolve", dns)
    monkeypatch.setattr(endpoints.PINS, "clock", lambda: now[0])
    endpoints.PINS.table.clear()
    yield endpoints, dns, now
    endpoints.PINS.table.clear()


def test_a_guarded_name_connects_to_the_address_that_was_checked(pins):
    import socket

    endpoints, dns, now = pins
    dns.table["store.example"] = ["127.0.0.1"]
    endpoints.guard_endpoint("http://store.example:9000", "spec.storage.endpoint", allow_private=False)
    assert dns.asked == 1
    dns.table["store.example"] = ["169.254.169.254"]  # the record changes after the check (rebinding)
    infos = socket.getaddrinfo("store.example", 9000, type=socket.SOCK_STREAM)
    assert {i[4][0] for i in infos} == {"127.0.0.1"} and dns.asked == 1  # the pin, not a second lookup
    endpoints.guard_endpoint("http://store.example:9000", "spec.storage.endpoint", allow_private=False)
    assert dns.asked == 1  # fresh: a client built again within PIN_SECONDS asks nothing
    now[0] += endpoints.PIN_SECONDS + 1  # expired: resolved again, and checked again
    with pytest.raises(endpoints.PinnedRefusal, match="store.example resolves to 169.254.169.254, a cloud metadata"):
        socket.getaddrinfo("store.example", 9000)
    with pytest.raises(EndpointRefused, match="^spec.storage.endpoint: http://store.example:9000 is refused: store.example "
                                              "resolves to 169.254.169.254"):
        endpoints.guard_endpoint("http://store.example:9000", "spec.storage.endpoint", allow_private=False)


def test_a_name_resolving_to_a_private_address_names_the_field_and_the_setting(pins):
    endpoints, dns, _ = pins
    dns.table["minio.storage.svc"] = ["10.96.3.4"]
    with pytest.raises(EndpointRefused) as e:
        endpoints.guard_endpoint("http://minio.storage.svc:9000", "spec.storage.endpoint", allow_private=False)
    assert str(e.value).startswith("spec.storage.endpoint: http://minio.storage.svc:9000 is refused: minio.storage.svc resolves "
                                   "to 10.96.3.4, a private address")
    assert "allowPrivateEndpoints" in str(e.value)
    endpoints.guard_endpoint("http://minio.storage.svc:9000", "spec.storage.endpoint", allow_private=True)
    assert endpoints.PINS.table["minio.storage.svc"][0] == ["10.96.3.4"]


def test_an_unresolvable_name_is_checked_when_the_connection_resolves_it(pins):
    import socket

    endpoints, dns, _ = pins
    endpoints.guard_endpoint("http://later.example", "spec.storage.endpoint", allow_private=False)  # no answer yet
    dns.table["later.example"] = ["169.254.169.254"]
    with pytest.raises(endpoints.PinnedRefusal):
        socket.getaddrinfo("later.example", 80)


def test_unguarded_names_and_literals_pass_through(pins):
    import socket

    endpoints, dns, _ = pins
    endpoints.guard_endpoint("http://127.0.0.1:9000", "spec.storage.endpoint", allow_private=False)
    assert dns.asked == 0 and endpoints.PINS.table == {}
    assert socket.getaddrinfo("127.0.0.1", 80)  # the system's own answer


def _serve_once(reply: bytes):
    """A real HTTP server on loopback that records the Host header of each request."""
    import http.server
    import threading

    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the standard library's name
            seen.append(self.headers["Host"])
            self.send_response(200)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


def test_urllib_and_boto3_connect_to_the_pin_keeping_the_host_header(pins, monkeypatch):
    """Real connections: a name no DNS knows reaches the checked loopback address, and the
    request still names the host the user wrote (what SigV4 signs and TLS checks)."""
    import urllib.request

    from fewerbits_runtime.storage import make_client

    endpoints, dns, _ = pins
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test-access-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret-key")
    server, seen = _serve_once(b'<?xml version="1.0"?><ListAllMyBucketsResult><Buckets></Buckets>'
                               b'</ListAllMyBucketsResult>')
    port = server.server_address[1]
    try:
        dns.table["store.pinned.test"] = ["127.0.0.1"]
        url = f"http://store.pinned.test:{port}"
        endpoints.guard_endpoint(url, "spec.storage.endpoint", allow_private=False)
        with urllib.request.urlopen(url + "/", timeout=5) as r:  # noqa: S310 - loopback test server
            assert r.status == 200
        client = make_client(url, "us-east-1", 2)
        assert client.list_buckets()["Buckets"] == []
        assert seen == [f"store.pinned.test:{port}"] * 2
        assert dns.asked == 1
    finally:
        server.shutdown()


def test_the_operator_refuses_before_connecting_naming_the_field(pins):
    from fewerbits_api.quantizedmodel import SourceSpec, StorageSpec
    from fewerbits_operator.base.storage import ModelConfigError, ObjectStore, S3Credentials, StorageError

    endpoints, dns, _ = pins
    dns.table["minio.storage.svc"] = ["10.96.3.4"]
    storage = StorageSpec(uri="s3://bkt/q", endpoint="http://minio.storage.svc:9000")
    with pytest.raises(StorageError, match=r"^spec.storage.endpoint: http://minio.storage.svc:9000 is refused: "
                                           r"minio.storage.svc resolves to 10.96.3.4, a private address"):
        ObjectStore(timeout=1, allow_private=False).get_manifest(storage, "0" * 64, S3Credentials())
    source = SourceSpec(uri="s3://models/llama", endpoint="http://10.0.0.5:9000")
    with pytest.raises(ModelConfigError, match=r"^spec.source.endpoint: http://10.0.0.5:9000 is refused"):
        ObjectStore(timeout=1, allow_private=False).model_config(source, None, "https://huggingface.co")
