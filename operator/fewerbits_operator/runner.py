"""The operator's process-level parts: kopf settings, the reconciler, the resync loop, metrics."""

from __future__ import annotations

import logging
import threading
from typing import Any

import kopf
from prometheus_client import start_http_server

from .autoscaler import Autoscaler, DirectScrapeSource, PrometheusSource
from .kube import Kube
from .reconcile import Reconciler
from .settings import OperatorSettings, get_settings
from .storage import ObjectStore

log = logging.getLogger("fewerbits.operator")
PREFIX = "fewerbits.io"


class Operator:
    def __init__(self) -> None:
        self.reconciler: Reconciler | None = None
        self.settings: OperatorSettings | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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
        kopf_settings.execution.max_workers = 8
        kube = Kube()
        self.reconciler = Reconciler(kube, ObjectStore(timeout=s.storage_timeout_seconds), s)
        if s.metrics_port:
            start_http_server(s.metrics_port)
        self._stop.clear()
        self._thread = threading.Thread(target=self._resync_loop, name="fewerbits-resync", daemon=True)
        self._thread.start()
        if s.autoscaler_enabled:
            source = (PrometheusSource(s.autoscaler_prometheus_url, timeout=s.autoscaler_scrape_timeout_seconds)
                      if s.autoscaler_metrics_source == "prometheus"
                      else DirectScrapeSource(timeout=s.autoscaler_scrape_timeout_seconds))
            scaler = Autoscaler(kube, source, namespaces=s.namespaces,
                                status_interval_seconds=s.autoscaler_status_interval_seconds)
            threading.Thread(target=scaler.run_forever, args=(self._stop, s.autoscaler_period_seconds),
                             name="fewerbits-autoscaler", daemon=True).start()
        log.info("fewerbits operator started (namespaces: %s, resync every %ss)",
                 ", ".join(s.namespaces) or "all", s.resync_seconds)

    def stop(self) -> None:
        self._stop.set()

    def reconcile(self, namespace: str, name: str) -> None:
        assert self.reconciler is not None
        self.reconciler.reconcile(namespace, name)

    def reconcile_owners(self, body: Any) -> None:
        """A child changed: reconcile each QuantizedModel that owns it."""
        ns = body["metadata"].get("namespace")
        for ref in body["metadata"].get("ownerReferences") or []:
            if ref.get("kind") == "QuantizedModel":
                self._safe(ns, ref["name"])

    def reconcile_all(self) -> None:
        assert self.reconciler is not None and self.settings is not None
        for obj in self.reconciler.kube.list_models(self.settings.namespaces):
            self._safe(obj["metadata"]["namespace"], obj["metadata"]["name"])

    def _safe(self, namespace: str, name: str) -> None:
        try:
            self.reconcile(namespace, name)
        except Exception as e:  # the next event or resync retries; one model never stops the rest
            log.warning("reconcile of %s/%s failed: %s: %s", namespace, name, type(e).__name__, e)

    def _resync_loop(self) -> None:
        assert self.settings is not None
        while not self._stop.wait(self.settings.resync_seconds):
            try:
                self.reconcile_all()
            except Exception as e:
                log.warning("resync failed: %s: %s", type(e).__name__, e)
