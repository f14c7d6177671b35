"""The activator Service's EndpointSlices, kept by a watch of this module's own: the one kopf gap
it fills is that kopf watches every resource in the operator's namespaces only (one scope for the
whole process), while the activator's Service lives in the release namespace, which the operator
does not watch (its RBAC there: list and watch EndpointSlices, nothing else). atzero.ZeroRouter
copies these slices' ready endpoints into each model's slice at zero, and reads them from here
instead of a LIST per pass: at rest this costs one watch request per ``timeout_seconds``.

List once, then watch from the list's resourceVersion; a watch that ends is resumed
from the last version seen, a 410 Gone (the version was compacted away) lists again; errors back
off 1, 2, 4 ... 30 s. ``slices()`` is None until the first list succeeded, so that the router
never takes "not read yet" for "no activator endpoints".
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from kubernetes import watch
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("fewerbits.slicewatch")
MAX_BACKOFF_SECONDS = 30.0


class SliceWatch:
    def __init__(self, discovery: Any, namespace: str, service: str, timeout_seconds: int = 300):
        self.discovery = discovery
        self.namespace, self.selector = namespace, f"kubernetes.io/service-name={service}"
        self.timeout_seconds = timeout_seconds
        self._slices: dict[str, dict[str, Any]] | None = None
        self._lock = threading.Lock()
        self.requests = 0
        """API requests made (lists and watches), for tests."""

    def slices(self) -> list[dict[str, Any]] | None:
        with self._lock:
            return None if self._slices is None else list(self._slices.values())

    def _list(self) -> str:
        self.requests += 1
        out = self.discovery.list_namespaced_endpoint_slice(self.namespace, label_selector=self.selector,
                                                            _preload_content=False)
        body = json.loads(out.data)
        with self._lock:
            self._slices = {s["metadata"]["name"]: s for s in body.get("items") or []}
        return body["metadata"]["resourceVersion"]

    def _apply(self, event: dict[str, Any]) -> str | None:
        obj = event.get("raw_object") or {}
        md = obj.get("metadata") or {}
        if event.get("type") in ("ADDED", "MODIFIED"):
            with self._lock:
                assert self._slices is not None
                self._slices[md["name"]] = obj
        elif event.get("type") == "DELETED":
            with self._lock:
                assert self._slices is not None
                self._slices.pop(md.get("name"), None)
        elif event.get("type") == "ERROR":
            raise ApiException(status=int(obj.get("code") or 500), reason=obj.get("message"))
        return md.get("resourceVersion")

    def run(self, stop: threading.Event) -> None:
        """Thread entry."""
        rv: str | None = None
        backoff = 1.0
        while not stop.is_set():
            try:
                if rv is None:
                    rv = self._list()
                self.requests += 1
                for event in watch.Watch().stream(self.discovery.list_namespaced_endpoint_slice, self.namespace,
                                                  label_selector=self.selector, resource_version=rv,
                                                  timeout_seconds=self.timeout_seconds):
                    rv = self._apply(event) or rv
                    if stop.is_set():
                        return
                backoff = 1.0
            except ApiException as e:
                if e.status == 410:  # compacted: list again
                    rv = None
                    continue
                log.warning("watch of %s/%s: %s", self.namespace, self.selector, e)
                stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
            except Exception as e:  # noqa: BLE001 - the API unreachable: list again after a back-off
                log.warning("watch of %s/%s: %s: %s", self.namespace, self.selector, type(e).__name__, e)
                rv = None
                stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
