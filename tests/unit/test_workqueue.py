"""The coalescing work queue (workqueue.py) and the runner's use of it (runner.py): no cluster."""

from __future__ import annotations

import threading
import time

import pytest

from fewerbits_operator.runtime import runner as runner_mod
from fewerbits_operator.runtime.resync import model_steady, next_resync
from fewerbits_operator.runtime.runner import Operator
from fewerbits_operator.base.settings import OperatorSettings
from fewerbits_operator.runtime.workqueue import WorkQueue, run_worker


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def drain(q: WorkQueue) -> list:
    out = []
    while (k := q.get(timeout=0)) is not None:
        out.append(k)
        q.done(k)
    return out


# ------------------------------------------------------------------ the queue


def test_a_waiting_key_is_queued_once_and_order_is_kept():
    q: WorkQueue[str] = WorkQueue()
    for k in ["a", "b", "a", "c", "b", "a"]:
        q.add(k)
    assert len(q) == 3 and q.adds == 6 and q.coalesced == 3
    assert drain(q) == ["a", "b", "c"]
    assert len(q) == 0


def test_a_key_added_while_processing_runs_once_more_after_and_never_twice_at_once():
    q: WorkQueue[str] = WorkQueue()
    q.add("a")
    assert q.get(timeout=0) == "a"
    q.add("a")
    q.add("a")  # coalesced with the previous re-add
    assert q.get(timeout=0) is None, "a second worker must not get a key being processed"
    q.done("a")
    assert q.get(timeout=0) == "a"
    q.done("a")
    assert q.get(timeout=0) is None and not q.pending("a")


def test_add_after_waits_an_earlier_schedule_wins_and_add_makes_it_ready_now():
    clock = FakeClock()
    q: WorkQueue[str] = WorkQueue(clock)
    q.add_after("a", 10)
    q.add_after("a", 30)  # later: the earlier stays
    assert q.scheduled("a") == 1010 and q.pending("a") and len(q) == 0
    assert q.get(timeout=0) is None
    clock.now = 1009.9
    assert q.get(timeout=0) is None
    clock.now = 1010
    assert q.get(timeout=0) == "a"
    q.done("a")
    q.add_after("b", 5)
    q.add_after("b", 2)  # earlier: replaces
    assert q.scheduled("b") == 1012
    q.add("b")  # ready now; the schedule is dropped, so it does not run twice
    assert q.scheduled("b") is None
    assert drain(q) == ["b"]
    clock.now = 2000
    assert drain(q) == []


def test_get_wakes_for_a_scheduled_key():
    q: WorkQueue[str] = WorkQueue()
    q.add_after("a", 0.2)
    t0 = time.monotonic()
    assert q.get(timeout=5) == "a"
    assert 0.15 <= time.monotonic() - t0 < 2


def test_no_key_is_lost_under_concurrent_producers_and_workers():
    """Many threads add keys while workers process them: every key added after its last
    processing started is processed again (the level-triggered guarantee), none concurrently."""
    q: WorkQueue[int] = WorkQueue()
    stop = threading.Event()
    lock = threading.Lock()
    running: set[int] = set()
    last_add: dict[int, int] = {}
    last_seen: dict[int, int] = {}
    seq = [0]
    overlaps = []

    def handle(k: int) -> None:
        with lock:
            if k in running:
                overlaps.append(k)
            running.add(k)
            seq[0] += 1
            last_seen[k] = seq[0]
        time.sleep(0.001)
        with lock:
            running.discard(k)

    def produce(offset: int) -> None:
        for i in range(400):
            k = (i * 7 + offset) % 25
            with lock:
                seq[0] += 1
                last_add[k] = seq[0]
            q.add(k)

    workers = [threading.Thread(target=run_worker, args=(q, handle, lambda k, e: None, stop)) for _ in range(4)]
    producers = [threading.Thread(target=produce, args=(o,)) for o in range(4)]
    for t in workers + producers:
        t.start()
    for t in producers:
        t.join()
    deadline = time.monotonic() + 10
    while (len(q) or q.processing) and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    q.shut_down()
    for t in workers:
        t.join(5)
    assert not overlaps, f"keys processed by two workers at once: {overlaps[:5]}"
    assert set(last_seen) == set(last_add)
    for k in last_add:
        assert last_seen[k] > last_add[k] or q.pending(k) is False, k
        assert last_seen[k] > last_add[k], f"key {k} added after its last processing began was never re-run"


def test_an_error_does_not_kill_the_worker_and_reaches_the_handler():
    q: WorkQueue[str] = WorkQueue()
    stop = threading.Event()
    done: list[str] = []
    errors: list[tuple[str, str]] = []

    def handle(k: str) -> None:
        if k == "bad":
            raise RuntimeError("boom")
        done.append(k)

    def on_error(k: str, e: Exception) -> None:
        errors.append((k, str(e)))
        raise ValueError("the error handler fails too")

    t = threading.Thread(target=run_worker, args=(q, handle, on_error, stop))
    t.start()
    for k in ["bad", "ok1", "bad", "ok2"]:
        q.add(k)
        time.sleep(0.02)
    deadline = time.monotonic() + 5
    while len(done) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    q.shut_down()
    t.join(5)
    assert done == ["ok1", "ok2"] and errors == [("bad", "boom"), ("bad", "boom")]
    assert not t.is_alive()


def test_shut_down_ends_blocked_workers_and_drops_later_adds():
    q: WorkQueue[str] = WorkQueue()
    got: list = []
    t = threading.Thread(target=lambda: got.append(q.get()))
    t.start()
    time.sleep(0.05)
    q.shut_down()
    t.join(2)
    assert got == [None]
    q.add("late")
    assert len(q) == 0


# ------------------------------------------------------------------ the runner's schedule


def test_next_resync_spreads_keys_over_the_period_and_keeps_intervals_near_it():
    period = 300.0
    keys = [(f"ns-{i % 10}", f"model-{i}") for i in range(300)]
    dues = [next_resync(k, 1000.0, period) for k in keys]
    assert all(1000 + period / 2 < d <= 1000 + 1.5 * period for d in dues)
    # evenly spread: no 30 s slice of the period holds more than twice its share (30 models)
    slices = [0] * 10
    for d in dues:
        slices[int(((d - 1000 - period / 2) % period) // 30)] += 1
    assert max(slices) <= 60, slices
    # one key comes back once per period once it is on its phase
    k = keys[0]
    first = next_resync(k, 1000.0, period)
    assert next_resync(k, first, period) == pytest.approx(first + period)


def test_model_steady_needs_ready_for_the_current_generation():
    ready = {"type": "Ready", "status": "True"}
    assert model_steady({"metadata": {"generation": 2}, "status": {"observedGeneration": 2, "conditions": [ready]}})
    assert not model_steady({"metadata": {"generation": 3}, "status": {"observedGeneration": 2, "conditions": [ready]}})
    assert not model_steady({"metadata": {"generation": 2}, "status": {
        "observedGeneration": 2, "conditions": [{"type": "Ready", "status": "False"}]}})
    assert not model_steady({"metadata": {"generation": 1}})


class FakeKube:
    def __init__(self) -> None:
        self.models: list[dict] = []
        self.lists = 0

    def list_models(self, namespaces):
        self.lists += 1
        return self.models


class FakeReconciler:
    def __init__(self) -> None:
        self.kube = FakeKube()
        self.calls: list[tuple[str, str]] = []
        self.fail: set[tuple[str, str]] = set()

    def reconcile(self, ns: str, name: str) -> None:
        self.calls.append((ns, name))
        if (ns, name) in self.fail:
            raise RuntimeError("api down")


def model(ns: str, name: str, ready: bool) -> dict:
    return {"metadata": {"namespace": ns, "name": name, "generation": 1},
            "status": {"observedGeneration": 1,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def operator() -> tuple[Operator, FakeClock, FakeReconciler]:
    clock = FakeClock()
    op = Operator(clock)
    op.settings = OperatorSettings(resync_seconds=30, steady_resync_seconds=300)  # steady period 300
    op.reconciler = FakeReconciler()  # type: ignore[assignment]
    return op, clock, op.reconciler  # type: ignore[return-value]


def run_ready(op: Operator) -> None:
    """What a worker does, synchronously, for every key ready now."""
    while (k := op.queue.get(timeout=0)) is not None:
        try:
            op._process(k)
        except Exception as e:  # noqa: BLE001
            op._failed(k, e)
        finally:
            op.queue.done(k)


def test_resync_schedules_steady_models_on_the_long_period_and_others_on_the_short():
    op, clock, rec = operator()
    rec.kube.models = [model("a", "ready", True), model("a", "waiting", False)]
    clock.now += 31
    op.resync_tick()
    assert rec.kube.lists == 1
    ready_due, waiting_due = op.queue.scheduled(("a", "ready")), op.queue.scheduled(("a", "waiting"))
    assert clock.now + 150 < ready_due <= clock.now + 450
    assert clock.now + 15 < waiting_due <= clock.now + 45
    op.resync_tick()  # not due: no second list
    assert rec.kube.lists == 1
    clock.now = waiting_due
    run_ready(op)
    assert rec.calls == [("a", "waiting")]
    assert op.queue.scheduled(("a", "waiting")) <= clock.now + 45  # rescheduled on the short period


def test_events_enqueue_at_once_and_a_deleted_model_is_not_rescheduled():
    op, clock, rec = operator()
    op.enqueue("a", "m", changed=True)
    op.enqueue_owners({"metadata": {"namespace": "a", "ownerReferences": [
        {"kind": "QuantizedModel", "name": "m"}, {"kind": "ReplicaSet", "name": "x"}]}})
    run_ready(op)
    assert rec.calls == [("a", "m")]  # two triggers, one reconcile
    assert op.queue.scheduled(("a", "m")) is not None
    rec.kube.models = []  # deleted
    clock.now += 31
    op.resync_tick()
    clock.now += 1000
    run_ready(op)
    assert rec.calls == [("a", "m"), ("a", "m")]  # the pending resync ran once (finds it gone) ...
    assert op.queue.scheduled(("a", "m")) is None  # ... and is not scheduled again


def test_failures_back_off_and_a_success_resets():
    op, clock, rec = operator()
    rec.fail.add(("a", "m"))
    op.enqueue("a", "m")
    run_ready(op)
    assert op.queue.scheduled(("a", "m")) == clock.now + 1
    clock.now += 1
    run_ready(op)
    assert op.queue.scheduled(("a", "m")) == clock.now + 2
    rec.fail.clear()
    clock.now += 2
    run_ready(op)
    assert op._failures == {}
    assert len(rec.calls) == 3


def test_node_or_policy_changes_reconcile_every_model_once_after_a_debounce():
    op, clock, rec = operator()
    rec.kube.models = [model("a", f"m{i}", True) for i in range(5)]
    op._next_list = clock.now + 30  # as the resync loop starts it
    for i in range(40):  # a pool of 40 nodes added
        op.on_event("nodes", "ADDED", {"metadata": {"name": f"h100-{i}"}})
    op.on_event("policies", "ADDED", {"metadata": {"name": "p"}, "spec": {}})
    op.resync_tick()
    assert rec.kube.lists == 0  # debounced
    clock.now += runner_mod.ALL_DEBOUNCE_SECONDS
    op.resync_tick()
    run_ready(op)
    assert rec.kube.lists == 1 and sorted(rec.calls) == [("a", f"m{i}") for i in range(5)]


def test_the_steady_period_is_at_most_ten_resyncs():
    assert OperatorSettings(resync_seconds=30, steady_resync_seconds=300).steady_period_seconds == 300
    assert OperatorSettings(resync_seconds=3, steady_resync_seconds=300).steady_period_seconds == 30
    assert OperatorSettings(resync_seconds=60, steady_resync_seconds=120).steady_period_seconds == 120
