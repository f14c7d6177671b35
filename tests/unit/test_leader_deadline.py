"""One writer at a time (issue 44): the leader's renew deadline (leader.py) and the runner's writers
on the leader only (runner.py).

The elector runs its real loop on a thread against ``FakeClock`` (a monotonic clock that moves
only when the test says, as client-go's testing clock: the test sees what the loop waits for and
steps the time to it) and ``LeaseStore``, the Lease endpoint of tests/unit/test_leader.py, seen
through ``Link`` (one candidate's connection to it: cut, or hanging). Every ordering is proven by
waiting on what the loop waits for, an Event or a counter, never by sleeping.

With the chart's timings (15 s lease, 10 s renew deadline, 5 s renew, 2 s retry): a leader last
renewed at 0 whose renewals fail tries again at 5, 7 and 9 s and stops at 10 s; a standby that saw
that renewal may take the Lease at 15 s, not before."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable

import kopf
import pytest
from kubernetes import client

from e2e import versions
from fewerbits_operator.base import gcpause
from fewerbits_operator.base.kube import Kube
from fewerbits_operator.base.settings import OperatorSettings
from fewerbits_operator.base.storage import ObjectStore
from fewerbits_operator.runtime import slicewatch
from fewerbits_operator.runtime.leader import LeaseElector
from fewerbits_operator.runtime.runner import WRITE_PREFIXES, LeaderOnlyWrites, NotLeading, Operator
from tests.unit.test_atzero import NS, FakeIO, model
from tests.unit.test_leader import LeaseStore

CHART = dict(lease_seconds=15, renew_deadline_seconds=10, renew_seconds=5, retry_seconds=2)
"""The chart's leaderElection defaults (charts/fewerbits/values.yaml)."""
WAIT = 10.0
"""Real seconds any wait of a test may take before it fails (the loops answer in milliseconds)."""
ROOT = Path(__file__).resolve().parents[2]


def eventually(what: str, done: Callable[[], bool]) -> None:
    """Wait for ``done()`` (a counter, a flag another thread sets), checking every 5 ms."""
    tick = threading.Event()
    for _ in range(int(WAIT / 0.005)):
        if done():
            return
        tick.wait(0.005)
    raise AssertionError(f"timed out waiting for {what}")


class FakeClock:
    """A monotonic clock and its waits: ``waiting`` holds, for each Event a thread waits on, when
    (this clock) that wait ends; ``set`` moves the time and ends the waits it reaches."""

    def __init__(self) -> None:
        self.now = 0.0
        self.cond = threading.Condition()
        self.waiting: dict[threading.Event, float] = {}

    def __call__(self) -> float:
        with self.cond:
            return self.now

    def wait(self, event: threading.Event, seconds: float) -> bool:
        with self.cond:
            until = self.now + seconds
            self.waiting[event] = until
            while not event.is_set() and self.now < until:
                self.cond.wait(0.005)  # an Event set by another thread does not notify this Condition
            self.waiting.pop(event, None)
            return event.is_set()

    def set(self, now: float) -> None:
        with self.cond:
            self.now = now
            self.waiting = {e: t for e, t in self.waiting.items() if t > now}
            self.cond.notify_all()

    def until(self, what: str, done: Callable[[], bool]) -> None:
        with self.cond:
            for _ in range(int(WAIT / 0.005)):
                if done():
                    return
                self.cond.wait(0.005)
        raise AssertionError(f"timed out waiting for {what}")


class Link:
    """One candidate's connection to the Lease endpoint: ``cut`` (every request fails at once, as
    with a network partition) or ``hang`` (the next request is taken and never answered until
    ``answer`` is set). Each request is logged with this candidate's time and its timeout."""

    def __init__(self, store: LeaseStore, clock: FakeClock) -> None:
        self.store, self.clock = store, clock
        self.cut = self.hang = False
        self.requests: list[tuple[float, str, Any]] = []
        self.hanging, self.answer = threading.Event(), threading.Event()

    def _send(self, verb: str, kwargs: dict[str, Any]) -> None:
        self.requests.append((self.clock(), verb, kwargs.get("_request_timeout")))
        if self.hang:
            self.hang = False
            self.hanging.set()
            self.answer.wait(WAIT)
        if self.cut:
            raise ConnectionError("the API server is unreachable")

    def read_namespaced_lease(self, name, namespace, **kw):
        self._send("get", kw)
        return self.store.read_namespaced_lease(name, namespace)

    def create_namespaced_lease(self, namespace, body, **kw):
        self._send("create", kw)
        return self.store.create_namespaced_lease(namespace, body)

    def replace_namespaced_lease(self, name, namespace, body, **kw):
        self._send("update", kw)
        return self.store.replace_namespaced_lease(name, namespace, body)


class Campaign:
    """One elector's loop on a thread, and when (its clock) it started and stopped leading."""

    def __init__(self, elector: LeaseElector, clock: FakeClock) -> None:
        self.clock = clock
        self.stop, self.stopped = threading.Event(), threading.Event()
        self.started_at: float | None = None
        self.stopped_at: float | None = None
        self.thread = threading.Thread(target=elector.run, args=(self.stop, self._started, self._stopped), daemon=True)
        self.thread.start()

    def _started(self) -> None:
        self.started_at = self.clock()

    def _stopped(self) -> None:
        self.stopped_at = self.clock()
        self.stopped.set()

    def pausing(self) -> bool:
        """The loop waits for its next try (no request of its under way)."""
        return self.stop in self.clock.waiting

    def end(self) -> None:
        self.stop.set()
        self.thread.join(WAIT)
        assert not self.thread.is_alive()


def elector(api: Any, identity: str, clock: FakeClock) -> LeaseElector:
    return LeaseElector(api, "ops", "fewerbits", identity, clock=clock, wait=clock.wait, **CHART)


# ------------------------------------------------------------------ the renew deadline


def test_a_leader_whose_renewals_fail_stops_at_the_deadline_before_a_standby_may_take_over():
    store, clock = LeaseStore(), FakeClock()
    link = Link(store, clock)
    a, b = elector(link, "a", clock), elector(store, "b", clock)
    run = Campaign(a, clock)
    try:
        clock.until("a to lead and pause", lambda: run.started_at == 0.0 and run.pausing())
        assert not b.try_acquire_or_renew()  # b reads a's renewal at 0: it may take over at 15
        writes = store.writes
        link.cut = True
        while True:  # each of a's pauses ends: a tries again, or stops
            clock.until("a to pause or stop", lambda: run.pausing() or run.stopped.is_set())
            if run.stopped.is_set():
                break
            assert not b.try_acquire_or_renew() and a.leading.is_set()
            clock.set(clock.waiting[run.stop])
        assert [(t, verb) for t, verb, _ in link.requests[-3:]] == [(5.0, "get"), (7.0, "get"), (9.0, "get")]
        assert run.stopped_at == 10.0 and not a.leading.is_set()  # the deadline: 10 s after the last renewal
        clock.set(14.999)
        assert not b.try_acquire_or_renew()
        clock.set(15.0)
        assert b.try_acquire_or_renew()  # the first moment b may: 5 s after a stopped
        assert store.writes == writes + 1 and store.leases["fewerbits"].spec.holder_identity == "b"
        run.thread.join(WAIT)
        assert not run.thread.is_alive()  # the loop returned: the runner ends the process
    finally:
        run.end()


def test_a_hanging_renewal_does_not_keep_the_leader_past_its_deadline():
    store, clock = LeaseStore(), FakeClock()
    link = Link(store, clock)
    a = elector(link, "a", clock)
    run = Campaign(a, clock)
    try:
        clock.until("a to lead and pause", lambda: run.started_at == 0.0 and run.pausing())
        link.cut = True
        clock.set(5.0)  # the renewal at 5 fails at once; a tries again at 7
        clock.until("a to pause after its failed renewal", lambda: clock.waiting.get(run.stop) == 7.0)
        link.cut, link.hang = False, True
        clock.set(7.0)  # this renewal is taken and never answered
        clock.until("a to wait for the hanging renewal", lambda: link.hanging.is_set() and len(clock.waiting) == 1
                    and not run.pausing())
        assert link.requests[-1] == (7.0, "get", (3.0, 3.0))  # the call's own timeout: the time left, not 5 s
        assert list(clock.waiting.values()) == [10.0]  # a waits for the answer until its deadline only
        assert a.leading.is_set()
        clock.set(10.0)
        clock.until("a to stop", run.stopped.is_set)
        assert run.stopped_at == 10.0 and not a.leading.is_set()
        assert not link.answer.is_set()  # still hanging: a stopped without its answer
    finally:
        link.answer.set()
        run.end()


def test_a_renewal_after_failures_moves_the_deadline():
    store, clock = LeaseStore(), FakeClock()
    link = Link(store, clock)
    a = elector(link, "a", clock)
    run = Campaign(a, clock)
    try:
        clock.until("a to lead and pause", lambda: run.started_at == 0.0 and run.pausing())
        link.cut = True
        for t in (5.0, 7.0):
            clock.set(t)
            clock.until("a to pause", lambda t=t: run.pausing() and clock.waiting[run.stop] > t)
        link.cut = False
        clock.set(9.0)  # this one lands: the deadline is 19 now, the next renewal due at 14
        clock.until("a to pause after renewing", lambda: clock.waiting.get(run.stop) == 14.0)
        assert a.deadline() == 19.0 and a.leading.is_set() and not run.stopped.is_set()
    finally:
        run.end()


# ------------------------------------------------------------------ the timings' order


@pytest.mark.parametrize("timings, message", [
    (dict(renew_deadline_seconds=15), "renew_deadline_seconds = 15 must be below lease_seconds = 15"),
    (dict(renew_deadline_seconds=12, lease_seconds=12.5),
     "renew_deadline_seconds = 12 must be below lease_seconds = 12"),  # the Lease holds whole seconds
    (dict(renew_seconds=10), "renew_seconds = 10 must be above 0 and below renew_deadline_seconds = 10"),
    (dict(renew_seconds=0), "renew_seconds = 0 must be above 0"),
    (dict(retry_seconds=0), "retry_seconds (0) must be above 0"),
])
def test_an_elector_refuses_timings_out_of_order_naming_the_parameter(timings: dict, message: str):
    with pytest.raises(ValueError, match=re.escape(message)):
        LeaseElector(LeaseStore(), "ops", "fewerbits", "a", **{**CHART, **timings})


@pytest.mark.parametrize("fields, message", [
    (dict(leader_renew_deadline_seconds=15),
     "FEWERBITS_LEADER_RENEW_DEADLINE_SECONDS (chart: leaderElection.renewDeadlineSeconds) = 15 must be below "
     "FEWERBITS_LEADER_LEASE_SECONDS (chart: leaderElection.leaseSeconds) = 15"),
    (dict(leader_renew_seconds=12),
     "FEWERBITS_LEADER_RENEW_SECONDS (chart: leaderElection.renewSeconds) = 12 must be above 0 and below "
     "FEWERBITS_LEADER_RENEW_DEADLINE_SECONDS (chart: leaderElection.renewDeadlineSeconds) = 10"),
])
def test_the_settings_refuse_timings_out_of_order_naming_the_setting(fields: dict, message: str):
    with pytest.raises(ValueError, match=re.escape(message)):
        OperatorSettings(**fields)
    s = OperatorSettings()
    assert (s.leader_lease_seconds, s.leader_renew_deadline_seconds, s.leader_renew_seconds) == (15, 10, 5)


@pytest.mark.parametrize("values", [["leaderElection.renewDeadlineSeconds=15"], ["leaderElection.renewSeconds=10"],
                                    ["leaderElection.leaseSeconds=8"]])
def test_the_chart_refuses_timings_out_of_order_naming_them(values: list[str], tmp_path: Path):
    versions.ensure_built("helm")
    env = {**os.environ, "HELM_CACHE_HOME": str(tmp_path / "c"), "HELM_CONFIG_HOME": str(tmp_path / "f"),
           "HELM_DATA_HOME": str(tmp_path / "d")}
    sets = [a for v in values for a in ("--set", v)]
    out = subprocess.run([str(versions.binary("helm")), "template", "r", str(ROOT / "charts" / "fewerbits"),
                          "--kube-version", versions.version("kubernetes"), *sets],
                         capture_output=True, text=True, env=env)
    assert out.returncode != 0
    assert "leaderElection needs renewSeconds < renewDeadlineSeconds < leaseSeconds" in out.stderr, out.stderr


# ------------------------------------------------------------------ the writers on the leader only


def test_every_method_of_the_clients_is_a_read_or_a_fenced_write():
    """LeaderOnlyWrites knows writes by name: each public method of Kube and ObjectStore is a read
    listed here or a write by WRITE_PREFIXES (runner.py), never both and never neither."""
    reads = {"list_raw", "watch_raw", "use_views", "namespace_labels", "secret_data", "job_pods", "lws_available", "serves",  # Kube
             "head_object", "list_location", "model_config", "adapter_config", "source_json", "unreadable"}  # ObjectStore
    for cls in (Kube, ObjectStore):
        for name, _ in inspect.getmembers(cls, callable):
            if name.startswith("_"):
                continue
            read = name in reads or name.startswith(("get_", "list_", "read_"))
            assert read != name.startswith(WRITE_PREFIXES), (
                f"{cls.__name__}.{name}: a write goes in runner.WRITE_PREFIXES, a read in this test's list")


def test_a_client_refuses_every_write_once_the_replica_no_longer_leads():
    leading = [True]
    io = FakeIO([model()], [])
    fenced = LeaderOnlyWrites(io, lambda: leading[0])
    body = {"metadata": {"namespace": NS, "name": "s", "labels": {}}}
    fenced.create_endpoint_slice(body)
    leading[0] = False
    with pytest.raises(NotLeading, match="create_endpoint_slice"):
        fenced.create_endpoint_slice({"metadata": {"namespace": NS, "name": "t", "labels": {}}})
    assert io.writes == 1 and len(fenced.list_models([])) == 1  # reads go on


def test_a_leader_paused_past_its_deadline_writes_nothing_before_its_loop_wakes():
    """The fence reads the deadline at each write: a process stopped past it (SIGSTOP, a long
    pause) and resumed writes nothing in the moment before its election loop runs and stops it."""
    clock = FakeClock()
    a = elector(LeaseStore(), "a", clock)
    assert a.try_acquire_or_renew()
    a.leading.set()  # leading since 0; its loop, as if paused, never runs here
    op = Operator()
    op.settings, op.elector = OperatorSettings(leader_election=True), a
    io = FakeIO([model()], [])
    fenced = LeaderOnlyWrites(io, op._leading)
    clock.set(9.999)
    fenced.create_endpoint_slice({"metadata": {"namespace": NS, "name": "s", "labels": {}}})
    clock.set(10.0)
    with pytest.raises(NotLeading):
        fenced.create_endpoint_slice({"metadata": {"namespace": NS, "name": "t", "labels": {}}})
    assert a.leading.is_set() and io.writes == 1


class RecordedKube(FakeIO):
    """The Kube client the runner is given: atzero's fake I/O, every call logged, the first
    EndpointSlice written signalled."""

    discovery = None

    def __init__(self) -> None:
        super().__init__([model()], [])
        self.calls: list[str] = []
        self.slice_written = threading.Event()

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if callable(attr) and not name.startswith("_"):
            super().__getattribute__("calls").append(name)
        return attr

    def use_views(self, *args: Any, **kwargs: Any) -> None:
        pass

    def create_endpoint_slice(self, body: dict) -> None:
        super().create_endpoint_slice(body)
        self.slice_written.set()


class ActivatorSlices:
    """slicewatch.SliceWatch's stand-in: the activator Service's slices, listed at once."""

    def __init__(self, discovery: Any, namespace: str, service: str, timeout_seconds: int = 300) -> None:
        activator = FakeIO([], []).activator
        self.slices = lambda: activator

    def run(self, stop: threading.Event) -> None:
        stop.wait()


class CountedReads(LeaseStore):
    """The Lease endpoint, counting its reads (a standby's polls)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def read_namespaced_lease(self, name, namespace, **kw):
        self.reads += 1
        return super().read_namespaced_lease(name, namespace, **kw)

    def hold(self, holder: str | None, renewed: str) -> None:
        lease = self.read_namespaced_lease("fewerbits", "ops")
        lease.spec.holder_identity, lease.spec.renew_time = holder, renewed
        self.replace_namespaced_lease("fewerbits", "ops", lease)


def test_a_standby_runs_no_writer_and_the_activator_path_runs_only_while_leading(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(gcpause, "install", lambda: None)  # a process-wide setting, not this test's business
    monkeypatch.setattr(slicewatch, "SliceWatch", ActivatorSlices)
    leases, kube = CountedReads(), RecordedKube()
    leases.create_namespaced_lease("ops", client.V1Lease(
        metadata=client.V1ObjectMeta(name="fewerbits", namespace="ops"),
        spec=client.V1LeaseSpec(holder_identity="other", renew_time="t0", lease_duration_seconds=15)))
    s = OperatorSettings(leader_election=True, leader_election_namespace="ops", leader_election_lease="fewerbits",
                         leader_renew_seconds=0.01, leader_retry_seconds=0.01, activator_service="fewerbits-system/act",
                         activator_sync_seconds=0.01, metrics_port=0, autoscaler_enabled=False, namespaces=[NS],
                         workers=1)
    op = Operator()
    op.identity = "me"
    alive = lambda: {t.name for t in op._threads if t.is_alive()}  # noqa: E731
    op.on_startup(kopf.OperatorSettings(), {}, settings=s, kube=kube, coordination=leases)
    try:
        polls = leases.reads + 3
        eventually("the standby to read the Lease three more times", lambda: leases.reads >= polls)
        assert alive() == {"fewerbits-leader-election", "fewerbits-activator-slices"}  # no writer
        assert kube.calls == ["use_views"] and kube.writes == 0  # not even a read through the client
        assert not op._leading() and leases.leases["fewerbits"].spec.holder_identity == "other"
        with pytest.raises(NotLeading):
            op.kube.create_endpoint_slice({"metadata": {"namespace": NS, "name": "x", "labels": {}}})

        leases.hold(None, "t1")  # the other replica lets go: this one takes the Lease at its next poll
        assert kube.slice_written.wait(WAIT)  # the activator path, on the leader
        eventually("start_leading to return", lambda: bool(op._leading_threads))
        writers = list(op._leading_threads)
        assert "fewerbits-atzero" in {t.name for t in writers} and op._leading()
        assert all(t.name not in ("fewerbits-leader-election", "fewerbits-activator-slices") for t in writers)

        leases.hold("other", "t2")  # taken by force: this one stops leading, its writers end
        assert op.stop_flag.wait(WAIT) and op.lost_leadership and not op._leading()
        for t in writers:
            t.join(WAIT)
            assert not t.is_alive(), t.name
        with pytest.raises(NotLeading):
            op.kube.create_endpoint_slice({"metadata": {"namespace": NS, "name": "x", "labels": {}}})
    finally:
        op.stop()
        op.join(WAIT)


def test_a_clean_stop_hands_the_lease_over_after_its_writers_end_and_within_its_deadline(
        monkeypatch: pytest.MonkeyPatch):
    """on_cleanup: the writers stop and are waited for while the election still renews; then the
    Lease is released (holder cleared) and the election ends. The slice watch, which only reads and
    may sit in a watch call, is not waited for."""
    monkeypatch.setattr(gcpause, "install", lambda: None)
    monkeypatch.setattr(slicewatch, "SliceWatch", ActivatorSlices)
    leases, kube = CountedReads(), RecordedKube()
    s = OperatorSettings(leader_election=True, leader_election_namespace="ops", leader_election_lease="fewerbits",
                         leader_renew_seconds=0.01, leader_retry_seconds=0.01, activator_service="fewerbits-system/act",
                         activator_sync_seconds=0.01, metrics_port=0, autoscaler_enabled=False, namespaces=[NS],
                         workers=1)
    op = Operator()
    op.identity = "me"
    op.on_startup(kopf.OperatorSettings(), {}, settings=s, kube=kube, coordination=leases)
    try:
        assert kube.slice_written.wait(WAIT)
        eventually("start_leading to return", lambda: bool(op._leading_threads))
        writers = list(op._leading_threads)
        op.on_cleanup()
        assert [t.name for t in writers if t.is_alive()] == []
        assert leases.leases["fewerbits"].spec.holder_identity is None  # handed over, not waited out
        election = next(t for t in op._threads if t.name == "fewerbits-leader-election")
        election.join(WAIT)
        assert not election.is_alive() and not op._leading()
    finally:
        op.stop()
        op._stop_election.set()
