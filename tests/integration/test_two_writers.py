"""One writer at a time (issue 44), read from the API server's audit log: two operator replicas on
one Lease, with the chart's RBAC, each under a ServiceAccount of its own (the chart's, and a second
bound wherever the chart binds the first) on a control plane of its own with an audit log (e2e
``Cluster(audit=True)``), so every request names the replica that sent it. Both watch a model that
may reach zero, whose activator EndpointSlice only the leader keeps (runtime/atzero.py, which before
ran on every replica). Three situations, none a race the leader might win by chance:

1. The leader is paused (SIGSTOP) and the model's slice deleted: the standby, which sees the
   deletion, writes nothing but the Lease until it holds the Lease (a lease duration after the
   paused leader's last renewal); then it puts the slice back.
2. The paused leader resumes (SIGCONT) long after its renew deadline (its last successful renewal
   + ``renew_deadline_seconds``): it makes no write after that deadline, not even a try at the
   Lease, and exits (status 1: the pod restarts as a standby, which it then is).
3. The new leader's renewals are refused (its Lease grant revoked, its other writes still allowed)
   and, once its renew deadline passed, the model's spec changes, which a leader answers with a
   status write: the refused leader writes nothing after its deadline and exits; the standby takes
   over and writes the status.

The timings are shorter than the chart's defaults (15/10/5/2 s), and values the chart accepts
(``leaderElection.*``; ``helm template`` renders them): lease 6 s, renew deadline 4 s, renew 2 s,
retry 1 s, so the old leader stops 2 s before a standby may take over.

Simulator: none of its models reaches serving: the one model names a Secret that does not exist,
so it stays Accepted=False (its status.autoscaling published, which is all the activator path
reads) and no Job or serving pod is ever created; the control plane runs without the simulator."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest
from kubernetes import client

from e2e import cluster as cluster_mod
from e2e import demo
from tests.integration.operator_harness import REPO, OperatorProcess

pytestmark = pytest.mark.cluster

NS = "tw"
GROUP, VERSION, PLURAL = "fewerbits.io", "v1alpha1", "quantizedmodels"
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
SLICES = "endpointslice.kubernetes.io/managed-by=activator.fewerbits.io"
LEASE_SECONDS, RENEW_DEADLINE_SECONDS, RENEW_SECONDS, RETRY_SECONDS = 6, 4, 2, 1
STANDBY_CLOCK_SLACK = timedelta(seconds=0.5)
"""A standby counts the lease duration from just before its read that first saw the leader's last
renewal (leader.py), which the audit log dates a little later than that moment."""
AFTER_DEADLINE = timedelta(seconds=0.3)
"""Situation 3 changes the spec this long after the refused leader's deadline, so a write answering
the change cannot be one checked before the deadline and still in flight (leader.py allows that one)."""


def _load_models_module() -> Any:
    """bench/load_models.py: its CRD install, the operator's identity under the chart's RBAC."""
    spec = importlib.util.spec_from_file_location("load_models", REPO / "bench" / "load_models.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["load_models"] = mod
    spec.loader.exec_module(mod)
    return mod


def wait_for(what: str, done: Callable[[], Any], timeout: float, logs: Callable[[], str] = lambda: "") -> Any:
    deadline = time.monotonic() + timeout
    while not (value := done()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}\n{logs()}"
        time.sleep(0.2)
    return value


def now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class Request:
    """One API request as the audit log records it (Metadata level): who, verb, object, answer, and
    when the API server received it (its clock is this machine's)."""

    at: datetime
    user: str
    verb: str
    resource: str
    code: int

    @property
    def writes(self) -> bool:
        """A write, answered or refused (a refused write was still tried)."""
        return self.verb in WRITE_VERBS

    @property
    def on_lease(self) -> bool:
        return self.resource == "leases"

    @property
    def took(self) -> bool:
        """A Lease write that landed: an acquisition or a renewal."""
        return self.on_lease and self.writes and 200 <= self.code < 300

    def __str__(self) -> str:
        return f"{self.at:%H:%M:%S.%f} {self.verb} {self.resource} {self.code}"


class AuditLog:
    """The API server's audit log, read as it grows: one Request per auditID (a watch logs
    ResponseStarted, then ResponseComplete) for the users asked about."""

    def __init__(self, path: Path, users: Iterable[str]):
        self.path, self.users = path, set(users)
        self._offset = 0
        self._by_id: dict[str, Request] = {}

    def requests(self, user: str) -> list[Request]:
        self._read()
        return sorted((r for r in self._by_id.values() if r.user == user), key=lambda r: r.at)

    def _read(self) -> None:
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self._offset += end
        for raw in data[:end].splitlines():
            if not any(u.encode() in raw for u in self.users):
                continue
            e = json.loads(raw)
            user = (e.get("user") or {}).get("username")
            if user not in self.users:
                continue
            ref = e.get("objectRef") or {}
            resource = ref.get("resource", "?") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            self._by_id[e["auditID"]] = Request(datetime.fromisoformat(e["requestReceivedTimestamp"]), user,
                                                e.get("verb", "?"), resource,
                                                int((e.get("responseStatus") or {}).get("code") or 0))


def revoke_lease_grant(c: cluster_mod.Cluster, load: Any, name: str) -> None:
    """``name`` off the chart's leader-election RoleBinding: its Lease reads and writes are refused
    (403), every other grant stays."""
    api = c.api_client()
    rbac = client.RbacAuthorizationV1Api(api)
    binding = f"{load.RELEASE}-fewerbits-leader-election"
    subjects = [api.sanitize_for_serialization(s)
                for s in rbac.read_namespaced_role_binding(binding, load.OPERATOR_NS).subjects]
    kept = [s for s in subjects if s.get("name") != name]
    assert len(kept) == len(subjects) - 1, subjects
    rbac.patch_namespaced_role_binding(binding, load.OPERATOR_NS, {"subjects": kept})


def activator_service(load: Any) -> tuple[str, list[dict[str, Any]]]:
    """The activator's Service as the operator reads it: a Service and one EndpointSlice with a
    ready endpoint (no activator process: nothing here sends it a request)."""
    name = f"{load.RELEASE}-fewerbits-activator"
    return f"{load.OPERATOR_NS}/{name}", [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": load.OPERATOR_NS},
         "spec": {"ports": [{"name": "http", "port": 8082, "protocol": "TCP"}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": f"{name}-1", "namespace": load.OPERATOR_NS,
                      "labels": {"kubernetes.io/service-name": name}},
         "addressType": "IPv4", "ports": [{"name": "http", "port": 8082, "protocol": "TCP"}],
         "endpoints": [{"addresses": ["10.0.0.8"], "conditions": {"ready": True}}]}]


def first_take(requests: list[Request], after: datetime) -> Request | None:
    return next((r for r in requests if r.took and r.at > after), None)


def last_take(requests: list[Request], before: datetime | None = None) -> Request:
    return [r for r in requests if r.took and (before is None or r.at < before)][-1]


def listing(requests: Iterable[Request]) -> str:
    return "; ".join(map(str, requests)) or "none"


def test_one_writer_at_a_time_with_a_paused_and_a_refused_leader(tmp_path):
    load = _load_models_module()
    c = cluster_mod.Cluster(tmp_path / "cluster", audit=True, with_s3=False, with_sim=False,
                            kwok_cidr="127.180.0.0/16", pod_cidr="127.181.0.0/16")
    a: OperatorProcess | None = None
    b: OperatorProcess | None = None
    problems: list[str] = []  # each situation's verdicts, all reported at the end: one does not hide another
    try:
        c.start()
        load.install_crds(c)
        kube_a, user_a = load.operator_identity(c, tmp_path)
        kube_b, user_b = load.second_identity(c, tmp_path, "replica-b")
        audit = AuditLog(c.audit_log, [user_a, user_b])
        service, objects = activator_service(load)
        c.apply(objects)
        c.core().create_namespace({"metadata": {"name": NS}})
        lease = f"{load.RELEASE}-fewerbits"
        env = {"FEWERBITS_NAMESPACES": f'["{NS}"]', "FEWERBITS_LEADER_ELECTION": "true",
               "FEWERBITS_LEADER_ELECTION_NAMESPACE": load.OPERATOR_NS, "FEWERBITS_LEADER_ELECTION_LEASE": lease,
               "FEWERBITS_ACTIVATOR_SERVICE": service,
               "FEWERBITS_LEADER_LEASE_SECONDS": str(LEASE_SECONDS),
               "FEWERBITS_LEADER_RENEW_DEADLINE_SECONDS": str(RENEW_DEADLINE_SECONDS),
               "FEWERBITS_LEADER_RENEW_SECONDS": str(RENEW_SECONDS),
               "FEWERBITS_LEADER_RETRY_SECONDS": str(RETRY_SECONDS),
               # The chart's periods, not the harness's test-speed ones.
               "FEWERBITS_RESYNC_SECONDS": "30", "FEWERBITS_RETENTION_SWEEP_SECONDS": "600",
               "FEWERBITS_AUTOSCALER_PERIOD_SECONDS": "15", "FEWERBITS_AUTOSCALER_STATUS_INTERVAL_SECONDS": "60"}
        coordination = client.CoordinationV1Api(c.api_client())
        holder = lambda: coordination.read_namespaced_lease(lease, load.OPERATOR_NS).spec.holder_identity  # noqa: E731
        a = OperatorProcess(kube_a, tmp_path / "a.log", env_extra={**env, "POD_NAME": "replica-a"}).start()
        wait_for("replica a to take the Lease", lambda: _holder(holder) == "replica-a", 90, a.log_tail)
        b = OperatorProcess(kube_b, tmp_path / "b.log", env_extra={**env, "POD_NAME": "replica-b"}).start()
        wait_for("replica b to campaign", lambda: sum(
            r.on_lease for r in audit.requests(user_b)) >= 2, 90, b.log_tail)

        # A model that may reach zero: reconcile (the leader's) publishes status.autoscaling though
        # its Secret is missing, and the activator path then adds the activator's slice to its Service.
        spec = demo.test_model_spec("http://s3.invalid:9000", "s3://models/tiny", "absent", "tw",
                                    autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 1})
        custom = client.CustomObjectsApi(c.api_client())
        custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "QuantizedModel", "metadata": {"name": "m"}, "spec": spec})
        discovery = client.DiscoveryV1Api(c.api_client())
        slices = lambda: discovery.list_namespaced_endpoint_slice(NS, label_selector=SLICES).items  # noqa: E731
        wait_for("the leader to put the activator in the model's Service", slices, 60, a.log_tail)
        by_a = {f"{r.verb} {r.resource}" for r in audit.requests(user_a) if r.writes}
        assert {"patch quantizedmodels/status", "update leases"} <= by_a, by_a
        # Which replica writes the slice first is a race while both are live and a standby writes
        # (it did before): a verdict, not a wait; situation 1 takes the race away.
        if "create endpointslices" not in by_a:
            problems.append(f"0: the slice was not put in by the leader: {sorted(by_a)}")
        if live := [r for r in audit.requests(user_b) if r.writes]:
            problems.append(f"0: the standby wrote while the leader was live: {listing(live)}")

        # 1. The leader paused; the slice deleted. The standby sees it go and must leave it to the
        # leader until it holds the Lease, which it may take a lease duration after the paused
        # leader's last renewal; then it puts the slice back. Paused just after a renewal landed,
        # RENEW_SECONDS before the next: no renewal of its is half sent (read, not yet written).
        renewals = sum(r.took for r in audit.requests(user_a))
        wait_for("a renewal by the leader", lambda: sum(r.took for r in audit.requests(user_a)) > renewals,
                 3 * RENEW_SECONDS, a.log_tail)
        os.kill(a.proc.pid, signal.SIGSTOP)
        paused = now()
        for s in slices():
            discovery.delete_namespaced_endpoint_slice(s.metadata.name, NS)
        wait_for("replica b to take the Lease", lambda: _holder(holder) == "replica-b", 6 * LEASE_SECONDS, b.log_tail)
        wait_for("the new leader to put the activator back", slices, 30, b.log_tail)
        reqs_b = audit.requests(user_b)
        took_b = first_take(reqs_b, paused)
        last_a = last_take(audit.requests(user_a))  # paused: its last
        assert took_b is not None, listing(reqs_b)
        if early := [r for r in reqs_b if r.writes and not r.on_lease and paused <= r.at < took_b.at]:
            problems.append(f"1: the standby wrote before it took the Lease at {took_b}: {listing(early)}")
        if took_b.at - last_a.at < timedelta(seconds=LEASE_SECONDS) - STANDBY_CLOCK_SLACK:
            problems.append(f"1: the standby took the Lease ({took_b}) less than {LEASE_SECONDS}s after the "
                            f"leader's last renewal ({last_a})")
        if not any(r.verb == "create" and r.resource == "endpointslices" and r.at > took_b.at for r in reqs_b):
            problems.append(f"1: the slice was not put back by the new leader: "
                            f"{listing(r for r in reqs_b if r.writes)}")

        # 2. The paused leader resumes, long after its deadline: no write after it, and it exits.
        deadline_a = last_a.at + timedelta(seconds=RENEW_DEADLINE_SECONDS)
        woke = now()
        os.kill(a.proc.pid, signal.SIGCONT)
        wait_for("the old leader to exit", lambda: a.proc.poll() is not None, 30, a.log_tail)
        reqs_a = audit.requests(user_a)
        if late := [r for r in reqs_a if r.writes and r.at > deadline_a]:
            problems.append(f"2: the old leader wrote after its deadline {deadline_a:%H:%M:%S.%f}: {listing(late)}")
        if a.proc.returncode != 1:
            problems.append(f"2: the old leader exited with {a.proc.returncode}, not 1 (leadership lost)")
        print(f"2: the old leader's Lease requests after it woke: "
              f"{listing(r for r in reqs_a if r.on_lease and r.at >= woke)}")
        # Restarted (its pod would be), it stands by.
        restarted = now()
        a.start()
        wait_for("the restarted replica a to campaign", lambda: sum(
            r.on_lease for r in audit.requests(user_a) if r.at > restarted) >= 2, 90, a.log_tail)

        # 3. The leader's renewals refused: at its deadline it stops, though its other grants stay.
        # The spec changes after that deadline; a leader would write the status's new generation.
        revoke_lease_grant(c, load, "replica-b")
        revoked = now()
        refused = wait_for("replica b's renewal refused", lambda: next((
            r for r in audit.requests(user_b) if r.on_lease and r.at > revoked and r.code == 403), None),
            30, b.log_tail)
        last_b = last_take(audit.requests(user_b), refused.at)
        deadline_b = last_b.at + timedelta(seconds=RENEW_DEADLINE_SECONDS)
        wait_for("replica b's renew deadline to pass", lambda: now() > deadline_b + AFTER_DEADLINE, 30)
        generation = custom.patch_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, "m", {"spec": {"autoscaling": {"maxReplicas": 2}}})["metadata"]["generation"]
        wait_for("replica a to take the Lease back", lambda: _holder(holder) == "replica-a", 6 * LEASE_SECONDS,
                 a.log_tail)
        wait_for("the model's status at its new generation", lambda: (custom.get_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, "m").get("status") or {}).get("observedGeneration") == generation, 30,
            a.log_tail)
        wait_for("the refused leader to exit", lambda: b.proc.poll() is not None, 30, b.log_tail)
        reqs_a, reqs_b = audit.requests(user_a), audit.requests(user_b)
        if late := [r for r in reqs_b if r.writes and r.at > deadline_b]:
            problems.append(f"3: the refused leader wrote after its deadline {deadline_b:%H:%M:%S.%f}: {listing(late)}")
        if b.proc.returncode != 1:
            problems.append(f"3: the refused leader exited with {b.proc.returncode}, not 1 (leadership lost)")
        took_a = first_take(reqs_a, restarted)
        assert took_a is not None, listing(reqs_a)
        if early := [r for r in reqs_a if r.writes and not r.on_lease and restarted < r.at < took_a.at]:
            problems.append(f"3: the restarted standby wrote before it took the Lease at {took_a}: {listing(early)}")
        if not any(r.resource == "quantizedmodels/status" and r.writes and r.at > took_a.at for r in reqs_a):
            problems.append(f"3: the new generation's status was not written by the new leader: "
                            f"{listing(r for r in reqs_a if r.writes)}")
        print(f"3: replica b's last renewal {last_b}, deadline {deadline_b:%H:%M:%S.%f}, first refusal {refused}; "
              f"replica a took the Lease {took_a}")
        assert not problems, "\n".join(problems)
    finally:
        for op in (a, b):
            if op is not None and op.proc is not None and op.proc.poll() is None:
                os.kill(op.proc.pid, signal.SIGCONT)  # a stopped process would not act on SIGTERM
                op.stop()
        c.stop()


def _holder(read: Callable[[], str | None]) -> str | None:
    try:
        return read()
    except client.ApiException:
        return None  # not created yet
