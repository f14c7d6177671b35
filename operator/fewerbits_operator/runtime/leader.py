"""Leader election on a ``coordination.k8s.io/v1`` Lease: the gap it fills is that kopf's peering
pauses operators of lower priority but *freezes* peers of equal priority (two replicas of one
Deployment would both stop), and the Kubernetes client 36.0.3's ``leaderelection`` has only a
ConfigMap lock.

The rules are client-go's (tools/leaderelection): a candidate takes the Lease when nobody holds
it, or when the holder has not renewed it for ``lease_seconds`` as *this* candidate observed it
(its own monotonic clock from the moment it last saw the record change: no trust in another
node's wall clock); the leader renews every ``renew_seconds``; every write is conditional on the
resourceVersion read, so of two candidates one wins and the other sees a conflict. A leader that
cannot renew within ``lease_seconds`` of its last renewal stops leading (``on_stopped``: the
runner exits, and the pod restarts as a standby), so two leaders never act at once for longer
than the clock drift between two nodes. On a clean stop the leader gives the Lease up (holder
cleared), so the standby takes over at its next poll instead of after the lease duration.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable

from kubernetes import client
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("fewerbits.leader")
TIMEOUT = (5, 5)
"""Connect and read timeouts of every Lease call: an API server that accepts and never answers must
not hold a renewal (or a clean stop's hand-over) past the lease duration."""


def _now_micro() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    """One candidate. ``leading`` is set while this process holds the Lease."""

    def __init__(self, coordination: Any, namespace: str, name: str, identity: str, *,
                 lease_seconds: float = 15.0, renew_seconds: float = 5.0, retry_seconds: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        self.api = coordination
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_seconds, self.renew_seconds, self.retry_seconds = lease_seconds, renew_seconds, retry_seconds
        self.clock = clock
        self.leading = threading.Event()
        self._observed: tuple[Any, float] | None = None
        """(holder, renewTime) last seen, and when (our clock) it was first seen so."""
        self._renewed_at = 0.0
        self.holder: str | None = None
        """The holder this candidate last read."""
        self.writes = 0

    # ------------------------------------------------------------ one attempt (unit-tested)

    def try_acquire_or_renew(self) -> bool:
        """One read and, when this candidate may hold the Lease, one conditional write. True while leading."""
        now = self.clock()
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=TIMEOUT)
        except ApiException as e:
            if e.status != 404:
                raise
            return self._create(now)
        spec = lease.spec or client.V1LeaseSpec()
        record = (spec.holder_identity, spec.renew_time)
        if self._observed is None or self._observed[0] != record:
            self._observed = (record, now)
        self.holder = spec.holder_identity
        held_by_other = bool(spec.holder_identity) and spec.holder_identity != self.identity
        expired = now >= self._observed[1] + float(spec.lease_duration_seconds or self.lease_seconds)
        if held_by_other and not expired:
            return False
        if held_by_other or not spec.holder_identity:
            spec.acquire_time = _now_micro()
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
        spec.holder_identity = self.identity
        spec.lease_duration_seconds = int(self.lease_seconds)
        spec.renew_time = _now_micro()
        lease.spec = spec
        try:
            self.api.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=TIMEOUT)  # conditional: metadata.resourceVersion
        except ApiException as e:
            if e.status == 409:
                return False  # another candidate wrote first
            raise
        self.writes += 1
        self._renewed_at = now
        return True

    def _create(self, now: float) -> bool:
        body = client.V1Lease(metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                              spec=client.V1LeaseSpec(holder_identity=self.identity, acquire_time=_now_micro(),
                                                      renew_time=_now_micro(), lease_transitions=0,
                                                      lease_duration_seconds=int(self.lease_seconds)))
        try:
            self.api.create_namespaced_lease(self.namespace, body, _request_timeout=TIMEOUT)
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        self.writes += 1
        self._renewed_at = now
        return True

    def release(self) -> None:
        """Give the Lease up (holder cleared) if this candidate holds it: a clean stop's hand-over."""
        if not self.leading.is_set():
            return
        self.leading.clear()
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=TIMEOUT)
            if lease.spec is not None and lease.spec.holder_identity == self.identity:
                lease.spec.holder_identity = None
                lease.spec.lease_duration_seconds = 1
                self.api.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=TIMEOUT)
                self.writes += 1
        except Exception as e:  # noqa: BLE001 — the API unreachable: the standby waits out the lease instead
            log.warning("could not release the lease %s/%s: %s", self.namespace, self.name, e)

    # ------------------------------------------------------------ the loop

    def run(self, stop: threading.Event, on_started: Callable[[], None], on_stopped: Callable[[], None]) -> None:
        """Thread entry: campaign every ``retry_seconds``; once leading, renew every
        ``renew_seconds``; ``on_stopped`` when a renewal did not land within ``lease_seconds``."""
        while not stop.is_set():
            try:
                ok = self.try_acquire_or_renew()
            except Exception as e:  # noqa: BLE001 — the API unreachable: try again; the lease decides
                log.warning("lease %s/%s: %s: %s", self.namespace, self.name, type(e).__name__, e)
                ok = False
            if ok and not self.leading.is_set():
                log.info("leading (lease %s/%s, identity %s)", self.namespace, self.name, self.identity)
                self.leading.set()
                on_started()
            elif not ok and self.leading.is_set() and (
                    self.holder not in (None, self.identity) or self.clock() >= self._renewed_at + self.lease_seconds):
                log.error("lost the lease %s/%s: stopping", self.namespace, self.name)
                self.leading.clear()
                on_stopped()
                return
            stop.wait(self.renew_seconds if self.leading.is_set() else self.retry_seconds)
