"""The operator's process-level parts: kopf settings, the work queue and its workers, the resync
scheduler, the watched caches, the autoscaler thread and metrics.

Every trigger — a model created, changed or resumed, an event of a Job or Deployment it owns, a
GPU-relevant Node change, a policy change, the periodic resync — only *enqueues* the model's key.
``workers`` threads drain the queue (workqueue.py): a key is queued once however many events
name it, never reconciled by two threads at once, and re-run once if it changed meanwhile. kopf's
handlers therefore return at once and never queue behind a slow reconcile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import zlib
from typing import Any

import kopf
from prometheus_client import start_http_server

from . import metrics
from .autoscaler import Autoscaler, DirectScrapeSource, PrometheusSource
from .kube import Kube
from .reconcile import Reconciler
from .settings import OperatorSettings, get_settings
from .storage import ObjectStore
from .workqueue import WorkQueue, run_worker

log = logging.getLogger("fewerbits.operator")
PREFIX = "fewerbits.io"
Key = tuple[str, str]
ALL_DEBOUNCE_SECONDS = 1.0
"""A pool of N nodes added is N watch events: reconcile every model once, a second after the first."""
MAX_BACKOFF_SECONDS = 60.0
"""Retries of a failing reconcile back off 1, 2, 4 ... s up to this (or resync_seconds if shorter)."""
HANDLER_WAIT_SECONDS = 120.0


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
        self._model_namespaces: set[str] | None = None
        """Namespaces holding models at the last list: policy status is recomputed when they change."""
        self._waiters: dict[Key, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        """kopf handlers waiting for the next reconcile of a key to start and finish."""

    # ------------------------------------------------------------ lifecycle

    def start(self, kopf_settings: kopf.OperatorSettings) -> None:
        s = self.settings = get_settings()
        # kopf's bookkeeping goes to annotations under our prefix, never into status.
        kopf_settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
        kopf_settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=PREFIX, key="last-handled-configuration")
        kopf_settings.persistence.finalizer = f"{PREFIX}/finalizer"
        # We post our own events on real transitions; kopf's per-handler events are noise and writes.
        kopf_settings.posting.enabled = False
        kopf_settings.watching.server_timeout = 300
        # The handlers only enqueue (async, on kopf's loop); reconciles run on our own workers.
        kopf_settings.execution.max_workers = 2
        kube = Kube()
        self.reconciler = Reconciler(kube, ObjectStore(timeout=s.storage_timeout_seconds), s)
        if s.metrics_port:
            start_http_server(s.metrics_port)
        metrics.QUEUE_DEPTH.set_function(lambda: len(self.queue))
        metrics.QUEUE_PROCESSING.set_function(lambda: self.queue.processing)
        self._stop.clear()
        # Nodes and policies from watches; namespace labels kept for one resync period.
        kube.start_caches(self._stop, on_node_change=self._node_changed, on_policy_change=self._policy_changed,
                          namespace_ttl_seconds=s.resync_seconds)
        self.start_workers(s.workers)
        self._spawn(self._resync_loop, "fewerbits-resync")
        if s.autoscaler_enabled:
            source = (PrometheusSource(s.autoscaler_prometheus_url, timeout=s.autoscaler_scrape_timeout_seconds)
                      if s.autoscaler_metrics_source == "prometheus"
                      else DirectScrapeSource(timeout=s.autoscaler_scrape_timeout_seconds))
            scaler = Autoscaler(kube, source, namespaces=s.namespaces,
                                status_interval_seconds=s.autoscaler_status_interval_seconds)
            self._spawn(lambda: scaler.run_forever(self._stop, s.autoscaler_period_seconds), "fewerbits-autoscaler")
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

    def stop(self) -> None:
        self._stop.set()
        self.queue.shut_down()

    # ------------------------------------------------------------ triggers (never raise, never block)

    def enqueue(self, namespace: str, name: str, changed: bool = False) -> None:
        """A model to reconcile now. ``changed``: its spec changed or it is new, so it is not steady."""
        key = (namespace, name)
        with self._lock:
            if changed or key not in self._steady:
                self._steady[key] = False
        self.queue.add(key)

    async def reconcile_soon(self, namespace: str, name: str, timeout: float = HANDLER_WAIT_SECONDS) -> None:
        """kopf's create/update/resume handler: enqueue, then wait (without a thread) until a
        reconcile that started after this call has finished, succeeded or not. kopf writes its
        bookkeeping annotation on the model when the handler returns; returning before the
        reconcile's conditional status write would make that write conflict and be redone.
        Never raises: a failed reconcile is retried by the queue with back-off, not by kopf."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        key = (namespace, name)
        with self._lock:
            self._waiters.setdefault(key, []).append((loop, fut))
        self.enqueue(namespace, name, changed=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(fut), timeout)

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

        from .policy_status import policy_statuses, status_writes

        kube = self.reconciler.kube if self.reconciler is not None else None
        if kube is None or self.settings is None:
            return
        try:
            raws = kube.list_policies()
            namespaces = {o["metadata"]["namespace"] for o in kube.list_models(self.settings.namespaces)}
            desired = policy_statuses(raws, [kube.namespace_labels(ns) for ns in sorted(namespaces)],
                                      now_rfc3339())
            for name, rv, status in status_writes(raws, desired):
                kube.patch_policy_status(name, status, rv)
        except Exception as e:  # noqa: BLE001 - status is advisory; models are governed regardless
            log.warning("writing QuantizationPolicy status failed: %s", e)

    # ------------------------------------------------------------ workers

    def _process(self, key: Key) -> None:
        assert self.reconciler is not None
        with self._lock:
            waiters = self._waiters.pop(key, [])
        started = time.monotonic()
        try:
            self.reconciler.reconcile(*key)
        finally:
            metrics.observe_reconcile_max(time.monotonic() - started)
            for loop, fut in waiters:
                with contextlib.suppress(RuntimeError):  # the loop closed: kopf is shutting down
                    loop.call_soon_threadsafe(_resolve, fut)
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
        """List the models when a list is due (every ``resync_seconds``) or every model was asked
        for; learn which exist and which are steady; give each known model without a pending
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
        listed = {(o["metadata"]["namespace"], o["metadata"]["name"]): model_steady(o)
                  for o in self.reconciler.kube.list_models(self.settings.namespaces)}
        if (namespaces := {ns for ns, _ in listed}) != self._model_namespaces:
            # A namespace gained its first model or lost its last: policies may now meet there.
            self._model_namespaces = namespaces
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


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
