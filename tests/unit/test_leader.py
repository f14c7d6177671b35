"""Leader election on a Lease (leader.py): two candidates, one leader; the standby takes over only
after the lease went unrenewed for its duration on the standby's own clock, at once after a clean
release; a leader that finds another holder stops; its renew deadline counts from before its
renewal's read. ``LeaseStore`` stands in for the API server's Lease endpoint (read, create, replace
conditional on resourceVersion: 409 on a stale write); the integration test
tests/integration/test_failover.py runs the same code against a real one. The renew deadline's
loop (failing and hanging renewals against a fake clock): tests/unit/test_leader_deadline.py."""

from __future__ import annotations

import copy
import threading

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fewerbits_operator.runtime.leader import LeaseElector


class LeaseStore:
    """The stand-in for coordination.k8s.io/v1 leases of one namespace."""

    def __init__(self) -> None:
        self.leases: dict[str, client.V1Lease] = {}
        self.rv = 0
        self.writes = 0

    def read_namespaced_lease(self, name, namespace, **_):
        if name not in self.leases:
            raise ApiException(status=404)
        return copy.deepcopy(self.leases[name])

    def create_namespaced_lease(self, namespace, body, **_):
        if body.metadata.name in self.leases:
            raise ApiException(status=409)
        return self._store(body)

    def replace_namespaced_lease(self, name, namespace, body, **_):
        if body.metadata.resource_version != self.leases[name].metadata.resource_version:
            raise ApiException(status=409)
        return self._store(body)

    def _store(self, body):
        self.rv += 1
        self.writes += 1
        body = copy.deepcopy(body)
        body.metadata.resource_version = str(self.rv)
        self.leases[body.metadata.name] = body
        return body


def candidates(store: LeaseStore, now: list[float]) -> tuple[LeaseElector, LeaseElector]:
    make = lambda ident: LeaseElector(store, "ops", "fewerbits", ident, lease_seconds=15,  # noqa: E731
                                      clock=lambda: now[0])
    return make("a"), make("b")


def test_one_of_two_candidates_leads_and_the_other_waits_for_the_lease_to_expire():
    store, now = LeaseStore(), [0.0]
    a, b = candidates(store, now)
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    now[0] = 10
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()  # renewed: b saw the record change
    now[0] = 24  # 14 s after b last saw a renewal: not yet
    assert not b.try_acquire_or_renew()
    now[0] = 26  # a stopped renewing (killed) 16 s ago, as b observed it
    assert b.try_acquire_or_renew()
    lease = store.leases["fewerbits"]
    assert lease.spec.holder_identity == "b" and lease.spec.lease_transitions == 1
    assert not a.try_acquire_or_renew() and a.holder == "b"  # a, back, finds b holding it


def test_a_conflicting_write_loses_the_race():
    store, now = LeaseStore(), [0.0]
    a, b = candidates(store, now)
    a.try_acquire_or_renew()
    now[0] = 20
    assert not b.try_acquire_or_renew()  # b sees a's record for the first time now: not expired for b
    stale = store.read_namespaced_lease("fewerbits", "ops")
    a.try_acquire_or_renew()  # a renews in between
    stale.spec.holder_identity = "b"
    try:
        store.replace_namespaced_lease("fewerbits", "ops", stale)
        raise AssertionError("a write at an old resourceVersion must conflict")
    except ApiException as e:
        assert e.status == 409


def test_a_clean_release_hands_over_at_the_next_poll():
    store, now = LeaseStore(), [0.0]
    a, b = candidates(store, now)
    a.try_acquire_or_renew()
    a.leading.set()
    a.release()
    assert store.leases["fewerbits"].spec.holder_identity is None and not a.leading.is_set()
    assert b.try_acquire_or_renew()


def test_a_release_after_the_renew_deadline_writes_nothing():
    """Past its deadline a standby may lead already: the old leader clears nothing."""
    store, now = LeaseStore(), [0.0]
    a, _ = candidates(store, now)
    a.try_acquire_or_renew()
    a.leading.set()
    writes = store.writes
    now[0] = a.renew_deadline_seconds
    a.release()
    assert store.writes == writes and not a.leading.is_set()
    assert store.leases["fewerbits"].spec.holder_identity == "a"


class PausedBetweenReadAndWrite(LeaseStore):
    """A leader paused (SIGSTOP, a long interpreter pause) after its renewal's read: the clock jumps."""

    def __init__(self, now: list[float], jump_to: float) -> None:
        super().__init__()
        self.now, self.jump_to, self.armed = now, jump_to, False

    def read_namespaced_lease(self, name, namespace, **kw):
        lease = super().read_namespaced_lease(name, namespace, **kw)
        if self.armed:
            self.now[0] = self.jump_to
        return lease


def test_a_renewal_whose_write_would_come_after_the_deadline_is_not_sent():
    now = [0.0]
    store = PausedBetweenReadAndWrite(now, jump_to=11.0)
    a = LeaseElector(store, "ops", "fewerbits", "a", lease_seconds=15, clock=lambda: now[0])
    assert a.try_acquire_or_renew()
    a.leading.set()
    now[0], store.armed, writes = 5.0, True, store.writes
    assert not a.try_acquire_or_renew()  # read at 5 s, woke at 11 s: past the 10 s deadline
    assert store.writes == writes


def test_the_loop_calls_back_on_gaining_and_on_losing_the_lease():
    store, now = LeaseStore(), [0.0]
    a, b = candidates(store, now)
    a.retry_seconds = a.renew_seconds = 0.01
    events: list[str] = []
    stop = threading.Event()
    started = threading.Event()

    def on_started():
        events.append("started")
        started.set()

    t = threading.Thread(target=a.run, args=(stop, on_started, lambda: events.append("stopped")))
    t.start()
    assert started.wait(5)
    lease = store.read_namespaced_lease("fewerbits", "ops")  # someone takes it by force
    lease.spec.holder_identity = "b"
    lease.spec.renew_time = "later"
    store.replace_namespaced_lease("fewerbits", "ops", lease)
    t.join(5)
    stop.set()
    assert not t.is_alive() and events == ["started", "stopped"] and not a.leading.is_set()


def test_the_deadline_counts_from_before_the_renewals_read():
    """A standby counts the lease from when it read the renewed record, after the write landed; the
    leader counts its deadline from before its read, so a slow renewal shortens only the leader's
    time (the margin between the two never shrinks)."""
    store, now = LeaseStore(), [0.0]
    a, b = candidates(store, now)
    assert a.try_acquire_or_renew() and a.deadline() == 10.0
    read = store.read_namespaced_lease

    def slow_read(name, namespace, **kw):  # the renewal's read answers 3 s after it was sent
        now[0] += 3.0
        return read(name, namespace, **kw)

    store.read_namespaced_lease = slow_read
    now[0] = 5.0
    assert a.try_acquire_or_renew() and now[0] == 8.0
    assert a.deadline() == 15.0  # 5 + 10: from the moment the renewal began
    store.read_namespaced_lease = read
    assert not b.try_acquire_or_renew()  # b sees the renewal at 8 at the earliest: it may take over at 23
    now[0] = 22.9
    assert not b.try_acquire_or_renew()
    now[0] = 23.0
    assert b.try_acquire_or_renew()
