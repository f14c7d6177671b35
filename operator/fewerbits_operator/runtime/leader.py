"""Leader election on a ``coordination.k8s.io/v1`` Lease: the gap it fills is that kopf's peering
pauses operators of lower priority but *freezes* peers of equal priority (two replicas of one
Deployment would both stop), and the Kubernetes client 36.0.3's ``leaderelection`` has only a
ConfigMap lock.

The rules are client-go's (tools/leaderelection): a candidate takes the Lease when nobody holds
it, or when the holder has not renewed it for ``lease_seconds`` as *this* candidate observed it
(its own monotonic clock from the moment it last saw the record change: no trust in another
node's wall clock); every write is conditional on the resourceVersion read, so of two candidates
one wins and the other sees a conflict. The leader renews every ``renew_seconds`` (after a failed
try, every ``retry_seconds``) and stops leading (``on_stopped``: the runner refuses every further
write and exits, and the pod restarts as a standby) when another holds the Lease or, client-go's
``renewDeadline``, as soon as ``renew_deadline_seconds`` passed on its own monotonic clock since
its last successful renewal began, also while a renewal call still hangs: the call runs on a
thread of its own and the loop waits for it only until the deadline. On a clean stop the leader
gives the Lease up (holder cleared), so the standby takes over at its next poll instead of after
the lease duration.

The guarantee: the leader counts its deadline from *before* its renewal's read, a standby counts
``lease_seconds`` from when it *read* the renewed record (after the write landed), and
``renew_deadline_seconds < lease_seconds`` (``settings.check_leader_timings``, for both), so the
old leader stops acting at least ``lease_seconds - renew_deadline_seconds`` (5 s at 15/10) before
any standby may take over. With clocks that advance at the same rate (their origins may differ)
two leaders never act at once; a difference of rate eats into that margin. What remains: a write
the old leader sent before its deadline and that is still in flight after it. The runner checks
before each write that this replica leads and that its deadline has not passed
(``runner.LeaderOnlyWrites``, ``within_deadline``), so that is at most one write per writing
thread; the Kube client's calls carry no timeout of their own, so such a write lands whenever the
API server takes it. ``tests/unit/test_leader_deadline.py`` measures it with the
chart's timings: the old leader stops at 10 s, a standby may take over at 15 s.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fewerbits_operator.base.settings import check_leader_timings

log = logging.getLogger("fewerbits.leader")
TIMEOUT = (5, 5)
"""Connect and read timeouts of every Lease call: an API server that accepts and never answers must
not hold a campaign (or a clean stop's hand-over) for long. A leader's renewal is bounded tighter,
by the time left to its deadline, and the loop does not wait for it past the deadline anyway."""


def _now_micro() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _wait(event: threading.Event, seconds: float) -> bool:
    return event.wait(seconds)


class LeaseElector:
    """One candidate. ``leading`` is set while this process holds the Lease.

    ``clock`` and ``wait`` (wait on an Event for up to so many seconds of ``clock``) are the
    monotonic clock and ``Event.wait``; tests pass a fake clock's."""

    def __init__(self, coordination: Any, namespace: str, name: str, identity: str, *,
                 lease_seconds: float = 15.0, renew_deadline_seconds: float = 10.0, renew_seconds: float = 5.0,
                 retry_seconds: float = 2.0, clock: Callable[[], float] = time.monotonic,
                 wait: Callable[[threading.Event, float], bool] = _wait):
        check_leader_timings(lease_seconds, renew_deadline_seconds, renew_seconds)
        if not retry_seconds > 0:
            raise ValueError(f"retry_seconds ({retry_seconds:g}) must be above 0")
        self.api = coordination
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_seconds, self.renew_seconds, self.retry_seconds = lease_seconds, renew_seconds, retry_seconds
        self.renew_deadline_seconds = renew_deadline_seconds
        self.clock, self.wait = clock, wait
        self.leading = threading.Event()
        self._observed: tuple[Any, float] | None = None
        """(holder, renewTime) last seen, and when (our clock) it was first seen so."""
        self._renewed_at = 0.0
        """When (our clock) the last successful acquisition or renewal began: before its read."""
        self.holder: str | None = None
        """The holder this candidate last read."""
        self.writes = 0

    def deadline(self) -> float:
        """When (our clock) this leader stops acting unless a renewal succeeds first."""
        return self._renewed_at + self.renew_deadline_seconds

    def within_deadline(self) -> bool:
        """Whether the last renewal is younger than the renew deadline, read now: with ``leading``,
        the writers' fence (runner.LeaderOnlyWrites), so a process paused past its deadline (a
        SIGSTOP, a long pause of the interpreter) writes nothing before its loop wakes to stop."""
        return self.clock() < self.deadline()

    # ------------------------------------------------------------ one attempt (unit-tested)

    def try_acquire_or_renew(self, timeout: tuple[float, float] = TIMEOUT) -> bool:
        """One read and, when this candidate may hold the Lease, one conditional write. True while leading."""
        now = self.clock()
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=timeout)
        except ApiException as e:
            if e.status != 404:
                raise
            return self._create(now, timeout)
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
        if self.leading.is_set() and not self.within_deadline():
            return False  # paused between the read and the write: a renewal now would come too late
        spec.holder_identity = self.identity
        spec.lease_duration_seconds = int(self.lease_seconds)
        spec.renew_time = _now_micro()
        lease.spec = spec
        try:
            self.api.replace_namespaced_lease(self.name, self.namespace, lease,  # conditional: metadata.resourceVersion
                                              _request_timeout=timeout)
        except ApiException as e:
            if e.status == 409:
                return False  # another candidate wrote first
            raise
        self.writes += 1
        self._renewed_at = now
        return True

    def _create(self, now: float, timeout: tuple[float, float]) -> bool:
        body = client.V1Lease(metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                              spec=client.V1LeaseSpec(holder_identity=self.identity, acquire_time=_now_micro(),
                                                      renew_time=_now_micro(), lease_transitions=0,
                                                      lease_duration_seconds=int(self.lease_seconds)))
        try:
            self.api.create_namespaced_lease(self.namespace, body, _request_timeout=timeout)
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        self.writes += 1
        self._renewed_at = now
        return True

    def release(self) -> None:
        """Give the Lease up (holder cleared) if this candidate holds it and its renew deadline has
        not passed: a clean stop's hand-over (after the deadline a standby may lead already, and
        this replica writes nothing more)."""
        if not self.leading.is_set():
            return
        in_time = self.within_deadline()
        self.leading.clear()
        if not in_time:
            log.warning("lease %s/%s: not released: the renew deadline passed, so the standby may be leading",
                        self.namespace, self.name)
            return
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
        ``renew_seconds`` (after a failure, every ``retry_seconds``), and ``on_stopped`` (then
        return) as soon as another holds the Lease or ``renew_deadline_seconds`` passed since the
        last renewal began."""
        while not stop.is_set():
            leading = self.leading.is_set()
            ok = self._renew() if leading else self._attempt(TIMEOUT)
            if leading and not ok and (why := self._lost(ok)):
                log.error("lost the lease %s/%s (%s): stopping", self.namespace, self.name, why)
                self.leading.clear()
                on_stopped()
                return
            if ok and not leading:
                log.info("leading (lease %s/%s, identity %s)", self.namespace, self.name, self.identity)
                self.leading.set()
                on_started()
            self.wait(stop, self._pause(ok))

    def _attempt(self, timeout: tuple[float, float]) -> bool:
        try:
            return self.try_acquire_or_renew(timeout)
        except Exception as e:  # noqa: BLE001 — the API unreachable: try again; the lease decides
            log.warning("lease %s/%s: %s: %s", self.namespace, self.name, type(e).__name__, e)
            return False

    def _renew(self) -> bool | None:
        """One renewal, waited for until the deadline and no longer. None: the deadline passed
        first (a call still hanging then is left to its thread: even if it lands, this leader
        stops)."""
        left = self.deadline() - self.clock()
        if left <= 0:
            return None
        bound = (min(TIMEOUT[0], left), min(TIMEOUT[1], left))
        result: list[bool] = []
        done = threading.Event()

        def attempt() -> None:
            result.append(self._attempt(bound))
            done.set()

        threading.Thread(target=attempt, name="fewerbits-lease-renewal", daemon=True).start()
        if not self.wait(done, self.deadline() - self.clock()):
            log.warning("lease %s/%s: the renewal did not answer by the deadline", self.namespace, self.name)
            return None
        return result[0]

    def _lost(self, ok: bool | None) -> str | None:
        """Why a leader whose renewal failed stops now, or None while it may still try."""
        if ok is None or self.clock() >= self.deadline():
            return f"not renewed within renew_deadline_seconds ({self.renew_deadline_seconds:g})"
        if self.holder not in (None, self.identity):
            return f"held by {self.holder}"
        return None

    def _pause(self, ok: bool) -> float:
        """Until the next try: a leader wakes at its deadline at the latest."""
        if not self.leading.is_set():
            return self.retry_seconds
        step = self.renew_seconds if ok else self.retry_seconds
        return max(0.0, min(step, self.deadline() - self.clock()))
