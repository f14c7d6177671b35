"""The operator's runtime: the watched caches, the work queue and its workers, the resync
scheduler, the autoscaler thread, metrics and the liveness endpoint. ``python -m
fewerbits_operator`` runs ``Operator.run`` (one replica: nothing here elects a leader).

Every trigger only *enqueues* a model's key:

* a QuantizedModel added, deleted, or changed in what the operator acts on (spec generation,
  deletion, labels, annotations; not status) — ``informer.model_relevant``;
* every model once after each LIST of models (start-up, and every re-list after a watch broke):
  what changed while nobody watched is reconciled;
* any change of a Job or Deployment labelled ``app.kubernetes.io/managed-by=fewerbits``: its
  QuantizedModel owners (``ownerReferences``);
* a GPU-relevant Node change or a QuantizationPolicy spec change: every model, once, debounced;
* the periodic resync: a steady model (Ready at its generation) every ``steady_period_seconds``,
  others every ``resync_seconds``, spread over the period (``next_resync``).

``workers`` threads drain the queue (workqueue.py): a key is queued once however many events
name it, never reconciled by two threads at once, and re-run once if it changed meanwhile; a
failing reconcile is retried with back-off. Reads go through Kube's watched caches (kube.py,
informer.py), so a reconcile at rest costs the reads no watch serves (a Secret, a Service, Pods).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import start_http_server

from . import metrics
from .autoscaler import Autoscaler, DirectScrapeSource, PrometheusSource
from .autoscaler.kube_io import KubeAutoscalerIO
from .kube import Kube
from .queueing import queued_entries, slot_changed
from .render import LABEL_COMPONENT
from .reconcile import Reconciler
from .settings import OperatorSettings, get_settings
from . import nodecache, retention
from .execute import execute_references, execute_retention
from .observe import now_rfc3339
from .storage import ObjectStore, S3Credentials
from .workqueue import WorkQueue, run_worker

log = logging.getLogger("fewerbits.operator")
Key = tuple[str, str]
ALL_DEBOUNCE_SECONDS = 1.0
"""A pool of N nodes added is N watch events: reconcile every model once, a second after the first."""
MAX_BACKOFF_SECONDS = 60.0
"""Retries of a failing reconcile back off 1, 2, 4 ... s up to this (or resync_seconds if shorter)."""
STOP_SECONDS = 10.0
"""On SIGTERM, how long running reconciles may take to finish before the process exits."""


def next_resync(key: Key, now: float, period: float) -> float:
    """When a key is next due: the first time after ``now + period/2`` at the key's own phase of
    the period (from a stable hash of its name). Keys spread evenly over the period whatever the
    moment they were last reconciled (300 models applied at once do not come back at once), and
    two resyncs of one key are 0.5-1.5 periods apart, one period on average."""
    phase = (zlib.crc32(f"{key[0]}/{key[1]}".encode()) % 100_000) / 100_000 * period
    earliest = now + period / 2
    cycles = (earliest - phase) // period + 1
    return phase + cycles * period


def model_steady(obj: dict[str, Any]) -> bool:
    """Ready=True for the current generation: only a watched change can move it."""
    md, status = obj.get("metadata") or {}, obj.get("status") or {}
    if status.get("observedGeneration") != md.get("generation"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


class Operator:
    def __init__(self, clock=time.monotonic) -> None:
        self.reconciler: Reconciler | None = None
        self.settings: OperatorSettings | None = None
        self.clock = clock
        self.queue: WorkQueue[Key] = WorkQueue(clock)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._steady: dict[Key, bool] = {}
        """Models known to exist, and whether each is steady (see model_steady)."""
        self._failures: dict[Key, int] = {}
        self._all_due: float | None = None
        self._next_list = 0.0
        self._model_namespaces: set[tuple[str, str, int]] | None = None
        """Models (namespace, name, queued Jobs) at the last list: policy status is recomputed when
        they change."""
        self._health: ThreadingHTTPServer | None = None

    # ------------------------------------------------------------ lifecycle

    def run(self) -> int:
        """The process: start, serve until SIGTERM or SIGINT, stop. Returns the exit status."""
        done = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: done.set())
        self.start()
        while not done.wait(1.0):
            pass
        log.info("stopping: waiting up to %.0fs for running reconciles", STOP_SECONDS)
        self.stop()
        self.join(STOP_SECONDS)
        return 0

    def start(self, settings: OperatorSettings | None = None, kube: Kube | None = None) -> None:
        s = self.settings = settings or get_settings()
        kube = kube or Kube()
        self.reconciler = Reconciler(kube, ObjectStore(timeout=s.storage_timeout_seconds), s)
        if s.metrics_port:
            start_http_server(s.metrics_port)
        metrics.QUEUE_DEPTH.set_function(lambda: len(self.queue))
        metrics.QUEUE_PROCESSING.set_function(lambda: self.queue.processing)
        self._stop.clear()
        self.start_workers(s.workers)
        self._spawn(self._resync_loop, "fewerbits-resync")
        self._spawn(self._retention_loop, "fewerbits-retention")
        self._spawn(self._references_loop, "fewerbits-node-cache-references")
        # Models, their Jobs and Deployments, Nodes and policies from watches (each LIST of models
        # enqueues every model); namespace labels kept for one resync period.
        self._threads += kube.start_caches(
            self._stop, namespaces=s.namespaces, on_model_change=self._model_changed,
            on_models_listed=self._models_listed, on_child_change=self._child_changed,
            on_node_change=self._node_changed, on_policy_change=self._policy_changed,
            namespace_ttl_seconds=s.resync_seconds)
        activator = None
        if s.activator_port:
            from .activator import Activator
            activator = Activator(kube, queue=s.activator_queue, timeout=s.activator_timeout_seconds)
        if s.autoscaler_enabled:
            source = (PrometheusSource(s.autoscaler_prometheus_url, timeout=s.autoscaler_scrape_timeout_seconds)
                      if s.autoscaler_metrics_source == "prometheus"
                      else DirectScrapeSource(timeout=s.autoscaler_scrape_timeout_seconds))
            scaler = Autoscaler(KubeAutoscalerIO(kube), source, namespaces=s.namespaces,
                                status_interval_seconds=s.autoscaler_status_interval_seconds,
                                held=activator.last_held if activator is not None else None)
            self._spawn(lambda: scaler.run_forever(self._stop, s.autoscaler_period_seconds), "fewerbits-autoscaler")
        if activator is not None:
            from .activator import serve as serve_activator
            try:
                self._activator = serve_activator(activator, s.activator_port)
            except OSError as e:  # the port taken: scale from zero is off, everything else works
                log.error("activator not started on port %d: %s", s.activator_port, e)
        if s.health_port:
            try:
                self._health = serve_health(s.health_port, self.healthy)
            except OSError as e:  # the port taken: the probe fails and says so, the operator still works
                log.error("liveness endpoint not started on port %d: %s", s.health_port, e)
        log.info("fewerbits operator started (namespaces: %s, %d workers, resync every %ss, steady models "
                 "every %ss)", ", ".join(s.namespaces) or "all", s.workers, s.resync_seconds, s.steady_period_seconds)

    def start_workers(self, n: int) -> None:
        for i in range(n):
            self._spawn(lambda: run_worker(self.queue, self._process, self._failed, self._stop),
                        f"fewerbits-worker-{i}")

    def _spawn(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def healthy(self) -> tuple[bool, str]:
        """Alive while every thread started (workers, resync, autoscaler, every watch loop) runs."""
        late = getattr(self.reconciler.kube, "late_threads", []) if self.reconciler is not None else []
        dead = [t.name for t in [*self._threads, *late] if not t.is_alive()]
        if self._stop.is_set():
            return False, "stopping"
        return (not dead, "ok" if not dead else "stopped: " + ", ".join(dead))

    def stop(self) -> None:
        self._stop.set()
        self.queue.shut_down()
        if self._health is not None:
            self._health.shutdown()
            self._health = None

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------ triggers (never raise, never block)

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

    def _model_changed(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        md = (new or old or {}).get("metadata") or {}
        key = (md.get("namespace"), md.get("name"))
        if new is None:  # deleted: one last reconcile forgets its metrics; no resync after it
            with self._lock:
                self._steady.pop(key, None)
                self._failures.pop(key, None)
            self.queue.add(key)
            return
        self.enqueue(*key, changed=True)

    def _models_listed(self, models: list[dict[str, Any]]) -> None:
        """After every LIST of models (start-up, a re-list after the watch broke): reconcile each
        once, as nothing watched them meanwhile."""
        listed = {(o["metadata"]["namespace"], o["metadata"]["name"]): model_steady(o) for o in models}
        with self._lock:
            self._steady.update(listed)
        log.info("%d models listed: reconciling each once", len(listed))
        self.queue.add_many(listed)

    def _child_changed(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        self.enqueue_owners(new or old or {})
        labels = ((new or old or {}).get("metadata") or {}).get("labels") or {}
        if labels.get(LABEL_COMPONENT) != "server" and slot_changed(old, new):  # a Job, not a Deployment
            self._enqueue_queued()

    def _enqueue_queued(self) -> None:
        """A quantization Job started, finished or went: every model waiting for a slot looks
        again (its place in the queue moved, or a slot is free), not only at its next resync."""
        if self.reconciler is None or self.settings is None:
            return
        for m in self.reconciler.kube.list_models_where(self.settings.namespaces, queued_entries):
            self.queue.add((m["metadata"]["namespace"], m["metadata"]["name"]))

    def _node_changed(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        name = ((new or old or {}).get("metadata") or {}).get("name")
        log.info("node %s %s: re-planning every model", name,
                 "added" if old is None else "removed" if new is None else "changed (labels/allocatable)")
        self.request_all()

    def _policy_changed(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        self.request_all()
        self._write_policy_status()

    def _write_policy_status(self) -> None:
        """Each policy's Valid condition and conflicts (policy_status.py decides; written only
        where it changed). A failure is logged: the next policy change or start retries."""
        from fewerbits_api.conditions import now_rfc3339

        from .policy_status import namespace_models, policy_statuses, status_writes

        kube = self.reconciler.kube if self.reconciler is not None else None
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


def serve_health(port: int, healthy) -> ThreadingHTTPServer:
    """``GET /healthz`` on ``port``: 200 while ``healthy()`` says so, else 503 with the reason (the
    chart's livenessProbe; a stopped worker or watch loop gets the pod restarted)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 — the http.server API
            if self.path.split("?")[0] != "/healthz":
                self.send_error(404)
                return
            ok, why = healthy()
            body = why.encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # the kubelet probes every few seconds: no log line each
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="fewerbits-health", daemon=True).start()
    return server
