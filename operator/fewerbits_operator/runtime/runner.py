"""The operator's runtime on kopf: what runs beside kopf's watches, and what each event does.

kopf (handlers.py) watches and indexes; this module owns the threads that act on it: the work
queue's workers (workqueue.py), the resync scheduler (resync.py), the retention and node-cache
sweeps, the autoscaler, the metrics probe, the activator path (atzero.py), the leader election
(leader.py) and the metrics endpoint. Only the leader runs the threads that write (``start_leading``:
every one above but the election and the activator Service's slice watch, which reads), and each
of their writes first checks that this replica still leads (``LeaderOnlyWrites``), so a thread
mid-pass when the Lease's renew deadline passed makes no further write. A standby campaigns for the
Lease, keeps kopf's indexes and the activator Service's slices warm and enqueues, and writes
nothing (its one write is the one that takes the Lease).

Every trigger only *enqueues* a model's key (kopf's ``on.event``, through the relevance filter,
relevance.py):

* a QuantizedModel listed, added, deleted, or changed in what the operator acts on (spec
  generation, deletion, labels, annotations; not status) — ``relevance.model_relevant``;
* any change of a Job, Deployment or LeaderWorkerSet labelled ``app.kubernetes.io/managed-by=
  fewerbits``: its QuantizedModel owners (``ownerReferences``);
* a GPU-relevant Node change or a QuantizationPolicy spec change: every model, once, debounced;
* the periodic resync: a steady model every ``steady_period_seconds``, others every
  ``resync_seconds``, spread over the period (resync.py);
* leadership gained: every model once (the previous leader may have left anything half-way; each
  step is idempotent and content-addressed, so nothing is done twice).

``workers`` threads drain the queue: a key is queued once however many events name it, never
reconciled by two threads at once, and re-run once if it changed meanwhile; a failing reconcile is
retried with back-off. Reads go through kopf's indexes (indexes.py, kube.py).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Mapping

from prometheus_client import start_http_server

from fewerbits_operator.base import gcpause, metrics
from fewerbits_operator.autoscaler import Autoscaler, DirectScrapeSource, PrometheusSource
from fewerbits_operator.autoscaler.kube_io import KubeAutoscalerIO
from fewerbits_operator.base.indexes import IndexView
from fewerbits_operator.base.kube import Kube
from fewerbits_operator.runtime.metricsprobe import MetricsProbe
from fewerbits_operator.base.queueing import job_holds_slot, queued_entries
from fewerbits_operator.base.relevance import RelevanceFilter, any_change, model_relevant, node_relevant, policy_relevant
from fewerbits_operator.serving.render import LABEL_COMPONENT, LABEL_MODEL
from fewerbits_operator.runtime.reconcile import Reconciler
from fewerbits_operator.runtime.resync import model_steady, next_resync
from fewerbits_operator.base.settings import OperatorSettings, get_settings
from fewerbits_operator.core import nodecache
from fewerbits_operator.core import retention
from fewerbits_operator.core.execute import execute_references, execute_retention
from fewerbits_operator.core.observe import now_rfc3339
from fewerbits_operator.base.storage import ObjectStore, S3Credentials
from fewerbits_operator.runtime.workqueue import WorkQueue, run_worker

log = logging.getLogger("fewerbits.operator")
Key = tuple[str, str]
ALL_DEBOUNCE_SECONDS = 1.0
"""A pool of N nodes added is N watch events: reconcile every model once, a second after the first."""
MAX_BACKOFF_SECONDS = 60.0
"""Retries of a failing reconcile back off 1, 2, 4 ... s up to this (or resync_seconds if shorter)."""
STOP_SECONDS = 10.0
"""On SIGTERM, how long running reconciles may take to finish before the process exits."""
VIEWS = ("models", "jobs", "deployments", "leaderworkersets", "nodes", "policies", "pods", "endpointslices",
         "services")


WRITE_PREFIXES = ("create", "add_owner", "patch_", "replace_", "delete_", "wake_", "apply_", "post_", "put_")
"""The writes of the Kube client (kube.py) and the object store (storage.py), by method name; every
other method reads (tests/unit/test_leader_deadline.py lists both clients' methods, so a new one
is classed)."""


class NotLeading(RuntimeError):
    """A write refused: this replica no longer leads."""


class LeaderOnlyWrites:
    """A client (Kube, ObjectStore) whose every write first checks ``leading()``: leadership ends
    at the Lease's renew deadline (leader.py), and a reconcile or a loop's pass then under way
    makes no further write (its next one raises NotLeading; the next leader does it over, every
    step being idempotent). Reads pass through."""

    def __init__(self, target: Any, leading: Callable[[], bool]):
        self._target, self._leading = target, leading

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not (callable(attr) and name.startswith(WRITE_PREFIXES)):
            return attr

        def write(*args: Any, **kwargs: Any) -> Any:
            if not self._leading():
                raise NotLeading(f"{name}: this replica no longer leads")
            return attr(*args, **kwargs)
        return write


def job_projection(job: dict[str, Any]) -> Any:
    """A Job's version (every change) and whether it holds a quantization slot (queueing.py)."""
    return (any_change(job), job_holds_slot(job))


class Operator:
    def __init__(self, clock=time.monotonic) -> None:
        self.reconciler: Reconciler | None = None
        self.settings: OperatorSettings | None = None
        self.kube: Kube | None = None
        self.clock = clock
        self.queue: WorkQueue[Key] = WorkQueue(clock)
        self.views = {name: IndexView(name) for name in VIEWS}
        self.filters = {"models": RelevanceFilter(model_relevant), "jobs": RelevanceFilter(job_projection),
                        "deployments": RelevanceFilter(any_change), "leaderworkersets": RelevanceFilter(any_change),
                        "nodes": RelevanceFilter(node_relevant), "policies": RelevanceFilter(policy_relevant)}
        self.elector = None
        self.identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
        self.stop_flag = threading.Event()
        """Set to end kopf (and the process): leadership lost."""
        self.lost_leadership = False
        self._stop = threading.Event()
        self._stop_election = threading.Event()
        """Set after the clean stop's hand-over: the election keeps renewing while the writers finish."""
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._steady: dict[Key, bool] = {}
        """Models known to exist, and whether each is steady (resync.model_steady)."""
        self._failures: dict[Key, int] = {}
        self._all_due: float | None = None
        self._next_list = 0.0
        self._model_namespaces: set[tuple[str, str, int]] | None = None
        """Models (namespace, name, queued Jobs) at the last list: policy status is recomputed when
        they change."""
        self._leading_threads: list[threading.Thread] = []
        """The threads ``start_leading`` started: every one that writes."""
        self.activator_slices: Any = None
        """The activator Service's slices (slicewatch.SliceWatch), watched on every replica: reads only."""

    # ------------------------------------------------------------ kopf's lifecycle (handlers.py)

    def on_startup(self, kopf_settings: Any, indexes: Mapping[str, Any], settings: OperatorSettings | None = None,
                   kube: Kube | None = None, coordination: Any = None) -> None:
        """kopf's ``on.startup``: its settings, the indexes, the Kube client (its writes fenced:
        ``LeaderOnlyWrites``), the threads every replica runs (the election, the activator Service's
        slice watch: neither writes but for the Lease), and ``start_leading`` without an election.
        ``coordination``: the Lease API (tests pass a stand-in)."""
        s = self.settings = settings or get_settings()
        configure_kopf(kopf_settings, s)
        for name, view in self.views.items():
            if name in indexes:
                view.attach(indexes[name])
        kube = kube or Kube()
        kube.use_views(s.namespaces, self.views, read_ttl_seconds=s.resync_seconds)
        self.kube = LeaderOnlyWrites(kube, self._leading)  # every user of the client below is fenced
        store = ObjectStore(timeout=s.storage_timeout_seconds, allow_private=s.allow_private_endpoints)
        self.reconciler = Reconciler(self.kube, LeaderOnlyWrites(store, self._leading), s)
        if s.metrics_port:
            start_http_server(s.metrics_port)
        gcpause.install()
        metrics.QUEUE_DEPTH.set_function(lambda: len(self.queue))
        metrics.QUEUE_PROCESSING.set_function(lambda: self.queue.processing)
        self._stop.clear()
        self._stop_election.clear()
        self._start_activator_slices()
        if s.leader_election:
            from kubernetes import client

            from fewerbits_operator.runtime.leader import LeaseElector
            self.elector = LeaseElector(coordination or client.CoordinationV1Api(kube.api), s.leader_election_namespace,
                                        s.leader_election_lease, self.identity,
                                        lease_seconds=s.leader_lease_seconds,
                                        renew_deadline_seconds=s.leader_renew_deadline_seconds,
                                        renew_seconds=s.leader_renew_seconds, retry_seconds=s.leader_retry_seconds)
            metrics.LEADER.labels(identity=self.identity).set(0)
            self._spawn(lambda: self.elector.run(self._stop_election, self.start_leading, self.stop_leading),
                        "fewerbits-leader-election")
        else:
            self.start_leading()
        log.info("fewerbits operator started as %s (namespaces: %s, %d workers, resync every %ss, steady models "
                 "every %ss, leader election %s)", self.identity, ", ".join(s.namespaces) or "all", s.workers,
                 s.resync_seconds, s.steady_period_seconds, "on" if s.leader_election else "off")

    def on_cleanup(self) -> None:
        """kopf's ``on.cleanup`` (SIGTERM): stop the threads, let the writers' running reconciles
        finish while the election still renews (so they finish within the renew deadline), then hand
        the Lease over and end the election. The threads that only read (the activator Service's
        slice watch, which may sit in a watch call) are not waited for."""
        log.info("stopping: waiting up to %.0fs for running reconciles", STOP_SECONDS)
        self.stop()
        self.join(STOP_SECONDS, self._leading_threads if self.elector is not None else None)
        if self.elector is not None:
            self.elector.release()
        self._stop_election.set()

    def probe(self) -> str:
        """kopf's ``on.probe`` (the liveness endpoint): raises while a thread died."""
        ok, why = self.healthy()
        if not ok:
            raise RuntimeError(why)
        return why

    def start_leading(self) -> None:
        """Leadership gained (or no election): the writing threads start, every model is looked at."""
        s = self.settings
        assert s is not None and self.kube is not None
        metrics.LEADER.labels(identity=self.identity).set(1)
        before = len(self._threads)
        self._start_zero_router()
        self.start_workers(s.workers)
        self._spawn(self._resync_loop, "fewerbits-resync")
        self._spawn(self._retention_loop, "fewerbits-retention")
        self._spawn(self._references_loop, "fewerbits-node-cache-references")
        source = (PrometheusSource(s.autoscaler_prometheus_url, timeout=s.autoscaler_scrape_timeout_seconds)
                  if s.autoscaler_metrics_source == "prometheus"
                  else DirectScrapeSource(timeout=s.autoscaler_scrape_timeout_seconds))
        # Pods without metrics behind an InferencePool, for the models the autoscaler does not scrape
        # (it writes status: the leader's).
        probe = MetricsProbe(KubeAutoscalerIO(self.kube), source, namespaces=s.namespaces, autoscaler_running=s.autoscaler_enabled)
        self._spawn(lambda: probe.run_forever(self._stop, s.autoscaler_period_seconds), "fewerbits-metrics-probe")
        if s.autoscaler_enabled:
            scaler = Autoscaler(KubeAutoscalerIO(self.kube), source, namespaces=s.namespaces,
                                status_interval_seconds=s.autoscaler_status_interval_seconds,
                                held=self.last_woken)
            self._spawn(lambda: scaler.run_forever(self._stop, s.autoscaler_period_seconds), "fewerbits-autoscaler")
        # start_leading runs on the election's thread, which may be listed only after it began.
        self._leading_threads = [t for t in self._threads[before:] if t is not threading.current_thread()]
        self.request_all()

    def stop_leading(self) -> None:
        """Leadership lost (the elector cleared ``leading`` first: from then on every write is
        refused, ``LeaderOnlyWrites``): stop the threads that write and end the process (kopf's stop
        flag); the pod restarts as a standby (client-go's rule: a leader that lost its lease exits)."""
        metrics.LEADER.labels(identity=self.identity).set(0)
        self.lost_leadership = True
        self.stop()
        self.stop_flag.set()

    def _start_activator_slices(self) -> None:
        """The activator Service's slices, watched on every replica (a read; slicewatch.py), so a
        new leader's first activator-path pass need not wait for a list."""
        s = self.settings
        assert s is not None and self.kube is not None
        if s.activator_service:
            from fewerbits_operator.runtime.slicewatch import SliceWatch
            ns, _, name = s.activator_service.partition("/")
            self.activator_slices = SliceWatch(self.kube.discovery, ns, name, timeout_seconds=s.watch_timeout_seconds)
            self._spawn(lambda: self.activator_slices.run(self._stop), "fewerbits-activator-slices")

    def _start_zero_router(self) -> None:
        """The leader's: the models' Services at zero point at the activator's own Service, and
        their HTTPRoutes follow (atzero.py). The activator itself is its own Deployment
        (activator_main.py): a request it holds is not lost when an operator replica is killed, and
        the slices the old leader wrote stay in place until the new leader's first pass."""
        s = self.settings
        assert s is not None and self.kube is not None
        if self.activator_slices is not None:
            from fewerbits_operator.runtime.atzero import ZeroRouter
            router = ZeroRouter(self.kube, s.activator_service, namespaces=s.namespaces,
                                activator_slices=self.activator_slices.slices)
            self._spawn(lambda: router.run_forever(self._stop, s.activator_sync_seconds), "fewerbits-atzero")

    def last_woken(self, namespace: str, name: str) -> float | None:
        """The autoscaler's keep-awake input for a model that may reach zero: when its last serving
        pod became ready (atzero.last_ready_at), read from the pods, since the activator that held
        the requests is another process. None (no read) for a model that cannot reach zero."""
        from fewerbits_operator.runtime.atzero import last_ready_at, may_reach_zero

        assert self.kube is not None
        model = self.kube.get_model(namespace, name)
        if model is None or not may_reach_zero(model):
            return None
        return last_ready_at(self.kube.list_pods(namespace, f"{LABEL_MODEL}={name},{LABEL_COMPONENT}=server"))

    def start_workers(self, n: int) -> None:
        for i in range(n):
            self._spawn(lambda: run_worker(self.queue, self._process, self._failed, self._stop),
                        f"fewerbits-worker-{i}")

    def _spawn(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def healthy(self) -> tuple[bool, str]:
        """Alive while every thread started (workers, resync, autoscaler, the election) runs."""
        if self._stop.is_set():
            return False, "stopping"
        dead = [t.name for t in self._threads if not t.is_alive()]
        return (not dead, "ok" if not dead else "stopped: " + ", ".join(dead))

    def stop(self) -> None:
        self._stop.set()
        self.queue.shut_down()

    def join(self, timeout: float, threads: list[threading.Thread] | None = None) -> None:
        """Wait up to ``timeout`` for ``threads`` (default: every thread this runner started)."""
        deadline = time.monotonic() + timeout
        for t in self._threads if threads is None else threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------ triggers: kopf's on.event (never raise, never block)

    def on_event(self, kind: str, event_type: str | None, body: dict[str, Any]) -> None:
        """One watch event (kopf delivers none before every index listed once): through the
        relevance filter to the triggers below."""
        for view in self.views.values():
            view.mark_synced()
        change = self.filters[kind].observe(event_type, body)
        if kind == "models":
            self._model_event(event_type, body, change)
        elif change is None:
            return
        elif kind in ("jobs", "deployments", "leaderworkersets"):
            self._child_changed(kind, body, change)
        elif kind == "nodes":
            md = body.get("metadata") or {}
            log.info("node %s %s: re-planning every model", md.get("name"), "added" if change[0] is None
                     else "removed" if change[1] is None else "changed (labels/allocatable)")
            self.request_all()
        elif kind == "policies":
            self.request_all()
            if self._leading():
                self._write_policy_status()

    def _leading(self) -> bool:
        """Whether this replica may write: it leads and its last renewal is younger than the renew
        deadline (read at each write, not only when the election's loop wakes), or it runs without
        an election."""
        if self.elector is not None:
            return self.elector.leading.is_set() and self.elector.within_deadline()
        return self.settings is None or not self.settings.leader_election

    def enqueue(self, namespace: str, name: str, changed: bool = False) -> None:
        """A model to reconcile now. ``changed``: its spec changed or it is new, so it is not steady."""
        key = (namespace, name)
        with self._lock:
            if changed or key not in self._steady:
                self._steady[key] = False
        self.queue.add(key)

    def enqueue_owners(self, body: Any) -> None:
        """A child changed: enqueue each QuantizedModel that owns it."""
        md = body.get("metadata") or {}
        for ref in md.get("ownerReferences") or []:
            if ref.get("kind") == "QuantizedModel":
                self.queue.add((md.get("namespace"), ref["name"]))

    def request_all(self) -> None:
        """Reconcile every model soon (debounced: a burst of changes is one pass)."""
        with self._lock:
            if self._all_due is None:
                self._all_due = self.clock() + ALL_DEBOUNCE_SECONDS

    def _model_event(self, event_type: str | None, body: dict[str, Any], change: Any) -> None:
        md = body.get("metadata") or {}
        key = (md.get("namespace"), md.get("name"))
        if event_type == "DELETED":  # one last reconcile forgets its metrics; no resync after it
            with self._lock:
                self._steady.pop(key, None)
                self._failures.pop(key, None)
            self.queue.add(key)
        elif event_type is None:  # kopf's listing (start-up, a re-list): nothing watched it meanwhile
            with self._lock:
                self._steady[key] = model_steady(body)
            self.queue.add(key)
        elif change is not None:
            self.enqueue(*key, changed=True)

    def _child_changed(self, kind: str, body: dict[str, Any], change: tuple[Any, Any]) -> None:
        self.enqueue_owners(body)
        labels = (body.get("metadata") or {}).get("labels") or {}
        if kind == "jobs" and labels.get(LABEL_COMPONENT) != "server":
            old, new = change
            if old is None or new is None or old[1] != new[1]:  # queueing.slot_changed on the projections
                self._enqueue_queued()

    def _enqueue_queued(self) -> None:
        """A quantization Job started, finished or went: every model waiting for a slot looks
        again (its place in the queue moved, or a slot is free), not only at its next resync."""
        if self.kube is None or self.settings is None or not self.views["models"].synced():
            return
        for m in self.kube.list_models_where(self.settings.namespaces, queued_entries):
            self.queue.add((m["metadata"]["namespace"], m["metadata"]["name"]))

    def _write_policy_status(self) -> None:
        """Each policy's Valid condition and conflicts (policy_status.py decides; written only
        where it changed). A failure is logged: the next policy change or start retries."""
        from fewerbits_api.conditions import now_rfc3339

        from fewerbits_operator.runtime.policy_status import namespace_models, policy_statuses, status_writes

        kube = self.kube
        if kube is None or self.settings is None:
            return
        try:
            raws = kube.list_policies()
            governed = namespace_models(kube.list_models(self.settings.namespaces), kube.namespace_labels)
            desired = policy_statuses(raws, [g.labels for g in governed], now_rfc3339(), governed)
            for name, rv, status in status_writes(raws, desired):
                kube.patch_policy_status(name, status, rv)
        except Exception as e:  # noqa: BLE001 - status is advisory; models are governed regardless
            log.warning("writing QuantizationPolicy status failed: %s", e)

    # ------------------------------------------------------------ workers

    def _process(self, key: Key) -> None:
        assert self.reconciler is not None
        started = time.monotonic()
        try:
            self.reconciler.reconcile(*key)
        finally:
            metrics.observe_reconcile_max(time.monotonic() - started)
        with self._lock:
            self._failures.pop(key, None)
            steady = self._steady.get(key)
        if steady is not None:  # still known: the safety net
            self.queue.add_after(key, self._resync_delay(key, steady))

    def _failed(self, key: Key, e: Exception) -> None:
        with self._lock:
            n = self._failures[key] = self._failures.get(key, 0) + 1
        cap = min(MAX_BACKOFF_SECONDS, self.settings.resync_seconds) if self.settings else MAX_BACKOFF_SECONDS
        delay = min(2.0 ** (min(n, 30) - 1), cap)
        log.warning("reconcile of %s/%s failed (%d in a row, retry in %.0fs): %s: %s",
                    *key, n, delay, type(e).__name__, e)
        self.queue.add_after(key, delay)

    def _resync_delay(self, key: Key, steady: bool) -> float:
        assert self.settings is not None
        period = self.settings.steady_period_seconds if steady else self.settings.resync_seconds
        now = self.clock()
        return next_resync(key, now, period) - now

    # ------------------------------------------------------------ retention (retention.py)

    def _retention_loop(self) -> None:
        assert self.settings is not None
        while not self._stop.wait(self.settings.retention_sweep_seconds):
            try:
                self.retention_sweep()
                metrics.RETENTION_SWEEPS.labels(result="ok").inc()
            except Exception as e:  # noqa: BLE001 — the next sweep retries; nothing is half-published
                metrics.RETENTION_SWEEPS.labels(result="error").inc()
                log.warning("retention sweep failed: %s: %s", type(e).__name__, e)

    def retention_sweep(self) -> int:
        """One sweep: observe (models, their locations and retention, the listing of each location
        swept), decide (``retention.sweep``, pure), execute (``execute.execute_retention``)."""
        assert self.reconciler is not None and self.settings is not None
        kube, store = self.reconciler.kube, self.reconciler.store
        uses, referenced = retention.observe_sweep(kube, self.settings)
        listings: dict[retention.Location, list[retention.StoredArtifact]] = {}
        for loc, (_, users) in retention.swept_locations(uses).items():
            user = sorted(users, key=lambda u: (u.namespace, u.model))[0]
            creds = S3Credentials.from_secret(kube.secret_data(user.namespace, user.secret) if user.secret else None)
            prefix, objects = store.list_location(loc.storage(user.secret), creds)
            listings[loc] = retention.group_listing(prefix, objects)
        now = now_rfc3339()
        return execute_retention(kube, store, retention.sweep(uses, referenced, listings, now), now)

    # ------------------------------------------------------------ node-cache references (nodecache.py)

    def _references_loop(self) -> None:
        assert self.settings is not None
        while not self._stop.wait(self.settings.node_cache_references_seconds):
            try:
                self.references_sync()
            except Exception as e:  # noqa: BLE001 — the next sync retries; the list is an eviction hint
                log.warning("node-cache references sync failed: %s: %s", type(e).__name__, e)

    def references_sync(self) -> int:
        """One sync: observe (models, effective specs, each namespace's ConfigMap), decide
        (``nodecache.decide_references``, pure), execute (``execute.execute_references``)."""
        assert self.reconciler is not None and self.settings is not None
        kube = self.reconciler.kube
        uses, current = nodecache.observe_references(kube, self.settings)
        return execute_references(kube, nodecache.decide_references(uses, current))

    # ------------------------------------------------------------ resync scheduler

    def _resync_loop(self) -> None:
        assert self.settings is not None
        self._next_list = self.clock() + self.settings.resync_seconds
        while not self._stop.wait(0.5):
            try:
                self.resync_tick()
            except Exception as e:  # noqa: BLE001 — the next tick retries
                log.warning("resync failed: %s: %s", type(e).__name__, e)

    def resync_tick(self) -> None:
        """Read the models (from the watched cache; a LIST until it synced) when that is due
        (every ``resync_seconds``) or every model was asked for; learn which exist and which are steady; give each known model without a pending
        reconcile its next resync; enqueue all of them when asked."""
        assert self.reconciler is not None and self.settings is not None
        now = self.clock()
        with self._lock:
            all_now = self._all_due is not None and now >= self._all_due
            if all_now:
                self._all_due = None
        if not all_now and now < self._next_list:
            return
        self._next_list = now + self.settings.resync_seconds
        models = self.reconciler.kube.list_models(self.settings.namespaces)
        listed = {(o["metadata"]["namespace"], o["metadata"]["name"]): model_steady(o) for o in models}
        counts = {(o["metadata"]["namespace"], o["metadata"]["name"], len(queued_entries(o))) for o in models}
        if counts != self._model_namespaces:
            # A namespace gained its first model or lost its last (policies may now meet there), or
            # what policies govern changed (models, queued Jobs: their status counts them).
            self._model_namespaces = counts
            self._write_policy_status()
        with self._lock:
            self._steady = listed
            for key in set(self._failures) - set(listed):
                del self._failures[key]
        if all_now:
            self.queue.add_many(listed)
            return
        for key, steady in listed.items():
            if not self.queue.pending(key):
                self.queue.add_after(key, self._resync_delay(key, steady))




def configure_kopf(k: Any, s: OperatorSettings) -> None:
    """kopf's own settings: nothing written to any object, no CRD list/watch, watch timeouts and
    back-off."""
    from fewerbits_operator.runtime.kopf_storage import NoDiffBase, NoProgress

    k.persistence.progress_storage = NoProgress()
    k.persistence.diffbase_storage = NoDiffBase()
    k.persistence.finalizer = "fewerbits.io/unused"  # never added: no handler needs one; named to be recognised
    k.posting.enabled = False  # no k8s Events from kopf (ours go through kube.post_event)
    k.scanning.disabled = True  # no CustomResourceDefinition or Namespace list/watch (RBAC stays minimal)
    k.watching.server_timeout = s.watch_timeout_seconds
    k.watching.client_timeout = s.watch_timeout_seconds + 30
    k.watching.connect_timeout = 30
    k.watching.reconnect_backoff = 1.0
    k.networking.error_backoffs = (1, 2, 4, 8, 16, 32, 60)
    # The children are listed and watched by their label on the API server (the handlers' `labels=`
    # alone would filter in this process, after every Job and Deployment in scope came over the wire).
    from fewerbits_operator.runtime.handlers import INDEXED, KINDS, MANAGED
    selector = ",".join(f"{k}={v}" for k, v in MANAGED.items())
    for group, _, plural, labels in KINDS.values():
        if labels == MANAGED:
            k.watching.label_selectors[group, plural] = selector
    for group, version, plural, _, server_selector in INDEXED.values():  # the models' pods, the activator's slices
        k.watching.label_selectors[group or version, plural] = server_selector
