"""A stand-in for cluster DNS and kube-proxy, for the Service URLs a model publishes
(``http://<service>.<namespace>.svc:<port>``): this harness has neither (docs/routing.md).

``open_service_url`` does what a client's request to that URL goes through on a cluster: the name
is resolved to the Service, the Service's port to its ready endpoints, one endpoint is picked at
random (kube-proxy's iptables mode), and the request goes there with the ``Host`` the client used.
The endpoints are the ones kube-proxy would merge:

- every EndpointSlice labelled ``kubernetes.io/service-name: <service>``, whoever manages it (the
  operator's activator slice among them; read from the API server, as kube-proxy reads them);
- the ready pods the Service's selector picks, on the target port: what the EndpointSlice
  controller would publish, read here from the pods because every pod IP of this harness is a
  loopback address, which the API server refuses in an EndpointSlice (docs/routing.md).

Nothing of the operator is in this module: it only reads the API server's objects.
"""

from __future__ import annotations

import http.client
import random
from dataclasses import dataclass
from urllib.parse import urlsplit

from kubernetes import client


@dataclass(frozen=True)
class Endpoint:
    ip: str
    port: int
    source: str
    """"slice:<name>" or "pod:<name>"."""


def _is_ready(pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def _container_port(pod, target) -> int | None:
    if isinstance(target, int) or (isinstance(target, str) and target.isdigit()):
        return int(target)
    for c in pod.spec.containers:
        for p in c.ports or []:
            if p.name == target:
                return p.container_port
    return None


def service_endpoints(api: client.ApiClient, namespace: str, name: str, port: int) -> list[Endpoint]:
    svc = client.CoreV1Api(api).read_namespaced_service(name, namespace)
    (sport,) = [p for p in svc.spec.ports if p.port == port]
    out: list[Endpoint] = []
    slices = client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(
        namespace, label_selector=f"kubernetes.io/service-name={name}").items
    for s in slices:
        sp = [p.port for p in s.ports or [] if (p.name or "") == (sport.name or "")]
        if not sp:
            continue
        for e in s.endpoints or []:
            if e.conditions is not None and e.conditions.ready is False:
                continue
            out += [Endpoint(a, sp[0], f"slice:{s.metadata.name}") for a in e.addresses]
    if svc.spec.selector:
        sel = ",".join(f"{k}={v}" for k, v in svc.spec.selector.items())
        for pod in client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=sel).items:
            if pod.metadata.deletion_timestamp or not pod.status.pod_ip or not _is_ready(pod):
                continue
            cport = _container_port(pod, sport.target_port or sport.port)
            if cport is not None:
                out.append(Endpoint(pod.status.pod_ip, cport, f"pod:{pod.metadata.name}"))
    return list(dict.fromkeys(out))


def resolve(url: str) -> tuple[str, str, int]:
    """(namespace, service, port) of ``http://<service>.<namespace>.svc[.cluster.local]:<port>``."""
    u = urlsplit(url)
    parts = (u.hostname or "").split(".")
    if len(parts) < 3 or parts[2] != "svc":
        raise ValueError(f"{url}: not a Service URL (<service>.<namespace>.svc)")
    return parts[1], parts[0], u.port or 80


def open_service_url(api: client.ApiClient, url: str, method: str = "GET", body: bytes | None = None,
                     headers: dict[str, str] | None = None, timeout: float = 300.0, host: str | None = None
                     ) -> tuple[Endpoint, http.client.HTTPResponse]:
    """Send one request to a Service URL the way a cluster would deliver it; the response is
    returned unread (a streamed body can be read as it arrives). Raises when the Service has no
    ready endpoint (kube-proxy would reject the connection). ``host``: the Host the request carries
    when it is not the URL's (a gateway forwards its client's Host to the Service)."""
    ns, name, port = resolve(url)
    eps = service_endpoints(api, ns, name, port)
    if not eps:
        raise ConnectionRefusedError(f"Service {ns}/{name}:{port} has no ready endpoint")
    ep = random.choice(eps)
    u = urlsplit(url)
    conn = http.client.HTTPConnection(ep.ip, ep.port, timeout=timeout)
    conn.request(method, (u.path or "/") + (f"?{u.query}" if u.query else ""), body=body,
                 headers={**(headers or {}), "Host": host or u.netloc})
    return ep, conn.getresponse()


def host_address() -> str:
    """This machine's first global IPv4 address: the API server refuses loopback addresses in an
    EndpointSlice, so a host process published as a Service's endpoint needs this one."""
    import subprocess

    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True,
                         check=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    raise RuntimeError("no global IPv4 address on this machine: a host process cannot be a Service "
                       "endpoint (the API server refuses loopback addresses in EndpointSlices)")


def publish_host_process(api: client.ApiClient, namespace: str, name: str, port: int) -> str:
    """The operator's activator runs here as a host process, not in a pod: give it what the chart
    gives it on a cluster, a Service ``<namespace>/<name>`` whose EndpointSlice lists it (port
    ``http``), written here as the EndpointSlice controller would write it for the operator's pod.
    Returns the address published."""
    core, disc = client.CoreV1Api(api), client.DiscoveryV1Api(api)
    ip = host_address()
    try:
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    except client.ApiException as e:
        if e.status != 409:
            raise
    for create, body in (
        (lambda b: core.create_namespaced_service(namespace, b), {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"ports": [{"name": "http", "port": port, "protocol": "TCP"}]}}),
        (lambda b: disc.create_namespaced_endpoint_slice(namespace, b), {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{name}-host", "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}]}),
    ):
        try:
            create(body)
        except client.ApiException as e:
            if e.status != 409:
                raise
            if body["kind"] == "EndpointSlice":  # a previous session's port: this one's
                disc.replace_namespaced_endpoint_slice(body["metadata"]["name"], namespace, {
                    **body, "metadata": {**body["metadata"], "resourceVersion": disc.read_namespaced_endpoint_slice(
                        body["metadata"]["name"], namespace).metadata.resource_version}})
    return ip
