"""Retention of published artifacts (issue 16, item 8): `rules.artifactRetention: Delete` removes
an artifact that no QuantizedModel has referenced for `rules.artifactRetentionPeriodSeconds`.

A periodic sweep, in three parts like a reconcile:

- observe (:func:`observe_sweep`): the models (from the watched cache) and, per model, its
  effective storage and retention (the same ``effective_for`` a reconcile uses); the keys any model
  references (`status.artifacts[].key`, `status.serving[].artifactKey`); and a listing of each swept
  storage location: per key, whether its manifest is there, its objects, and the time it was first
  seen unreferenced (the `.unreferenced` marker's LastModified).
- decide (:func:`sweep`, pure): which locations are swept (every model using the location says
  `Delete`; one `Retain` keeps the whole location), and per stored key: mark it unreferenced,
  clear the mark (referenced again), or delete it (marked at least the period ago, unreferenced now).
- execute (``execute.execute_retention``): writes the marks, and deletes an artifact **manifest
  first** (no manifest, no artifact: a fetcher or a model looking it up from then on sees none, never
  a half-deleted one), then its files, then its claim and mark; an event on each model using the
  location and the `fewerbits_artifacts_deleted_total` metric.

The unreferenced-since time lives in storage (the marker), not in the operator's memory: a restart
neither resets nor skips a period. A location no model uses any more is not swept (nothing says what
its retention is); keys that are not 64-hex content addresses are never touched.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Iterator, Union

from pydantic import ValidationError

from fewerbits_api.quantizedmodel import QuantizedModelStatus, StorageSpec
from fewerbits_api.names import UNREFERENCED_MARKER

from fewerbits_operator.core.acceptance import effective_for
from fewerbits_operator.core.observe import now_rfc3339, read_policies
from fewerbits_operator.base.observed import Observed

log = logging.getLogger("fewerbits.retention")

MARKER_NAME = UNREFERENCED_MARKER
"""Under a key's prefix: written when the sweep first sees the key unreferenced."""
DEFAULT_PERIOD_SECONDS = 7 * 86400
"""`rules.artifactRetentionPeriodSeconds` when no policy sets it."""
KEY = re.compile(r"^[0-9a-f]{64}$")
ARTIFACT_DELETED = "ArtifactDeleted"
"""Event reason on the models using a location an artifact was deleted from."""


@dataclass(frozen=True)
class Location:
    """A storage location (`spec.storage` as the effective spec has it) and how to reach it."""

    uri: str
    endpoint: str | None = None
    region: str | None = None

    @classmethod
    def of(cls, storage: StorageSpec) -> Location:
        return cls(storage.uri.rstrip("/"), (storage.endpoint or "").rstrip("/") or None, storage.region)

    def storage(self, secret: str | None) -> StorageSpec:
        return StorageSpec(uri=self.uri, endpoint=self.endpoint, region=self.region, credentialsSecret=secret)


@dataclass(frozen=True)
class LocationUse:
    """One model using a location, with its effective retention."""

    location: Location
    namespace: str
    model: str
    secret: str | None
    retention: str
    period_seconds: int


@dataclass(frozen=True)
class StoredArtifact:
    """One key's objects in a location, as listed."""

    key: str
    objects: tuple[str, ...]
    """Every object key under ``<prefix>/<key>/`` (manifest, files, claim, marker)."""
    manifest: str | None
    """The manifest's object key, when the artifact is published."""
    unreferenced_since: str | None = None
    """The marker's LastModified (RFC 3339), when marked."""


@dataclass(frozen=True)
class MarkUnreferenced:
    location: Location
    key: str
    secret: str | None
    namespace: str


@dataclass(frozen=True)
class ClearMark:
    location: Location
    key: str
    secret: str | None
    namespace: str


@dataclass(frozen=True)
class DeleteArtifact:
    location: Location
    key: str
    secret: str | None
    namespace: str
    """Where ``secret`` lives."""
    objects: tuple[str, ...]
    """In deletion order: the manifest, then the files, then the claim and the marker."""
    models: tuple[tuple[str, str], ...]
    """(namespace, name) of the models using the location: each gets the event."""
    unreferenced_since: str


RetentionAction = Union[MarkUnreferenced, ClearMark, DeleteArtifact]


def referenced_keys(statuses: list[QuantizedModelStatus]) -> frozenset[str]:
    """Every key any model's status names (in use, in the making, or still served; its adapters' too)."""
    keys: set[str] = set()
    for s in statuses:
        keys |= {a.key for a in s.artifacts}
        keys |= {v.artifactKey for v in s.serving if v.artifactKey}
        keys |= {p.adapterKey for a in s.adapters or () for p in a.pools if p.adapterKey}  # LoRA adapters' files
    return frozenset(keys)


def swept_locations(uses: list[LocationUse]) -> dict[Location, tuple[int, list[LocationUse]]]:
    """Locations every user of which says Delete, with the longest period any of them sets."""
    by_location: dict[Location, list[LocationUse]] = {}
    for u in uses:
        by_location.setdefault(u.location, []).append(u)
    return {loc: (max(u.period_seconds for u in us), us) for loc, us in by_location.items()
            if all(u.retention == "Delete" for u in us)}


def deletion_order(artifact: StoredArtifact) -> tuple[str, ...]:
    """The manifest first, then the files, then everything else (claim, marker) last."""
    rest = [o for o in artifact.objects if o != artifact.manifest]
    files = sorted(o for o in rest if "/files/" in o)
    others = sorted(o for o in rest if "/files/" not in o)
    return ((artifact.manifest,) if artifact.manifest else ()) + tuple(files) + tuple(others)


def _time(rfc3339: str) -> datetime:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00"))


def sweep(uses: list[LocationUse], referenced: frozenset[str], listings: dict[Location, list[StoredArtifact]],
          now: str) -> list[RetentionAction]:
    """The retention actions for this sweep. Pure: the clock is ``now``."""
    out: list[RetentionAction] = []
    t = _time(now)
    for loc, (period, users) in sorted(swept_locations(uses).items(), key=lambda kv: kv[0].uri):
        first = sorted(users, key=lambda u: (u.namespace, u.model))[0]
        models = tuple(sorted((u.namespace, u.model) for u in users))
        for art in listings.get(loc, []):
            if not KEY.match(art.key):
                continue
            if art.key in referenced:
                if art.unreferenced_since is not None:
                    out.append(ClearMark(loc, art.key, first.secret, first.namespace))
                continue
            if art.unreferenced_since is None:
                out.append(MarkUnreferenced(loc, art.key, first.secret, first.namespace))
            elif t - _time(art.unreferenced_since) >= timedelta(seconds=period):
                out.append(DeleteArtifact(loc, art.key, first.secret, first.namespace, deletion_order(art), models,
                                          art.unreferenced_since))
    return out


def group_listing(prefix: str, objects: list[tuple[str, str]]) -> list[StoredArtifact]:
    """``objects``: (object key, LastModified RFC 3339) under ``prefix`` (ending in '/' or empty),
    grouped per artifact key."""
    by_key: dict[str, list[tuple[str, str]]] = {}
    for name, modified in objects:
        key = name[len(prefix):].split("/", 1)[0]
        by_key.setdefault(key, []).append((name, modified))
    out = []
    for key, objs in sorted(by_key.items()):
        names = tuple(sorted(n for n, _ in objs))
        manifest = f"{prefix}{key}/manifest.json"
        marker = next((m for n, m in objs if n == f"{prefix}{key}/{MARKER_NAME}"), None)
        out.append(StoredArtifact(key, names, manifest if manifest in names else None, marker))
    return out


def effective_models(kube: Any, settings: Any) -> Iterator[tuple[dict[str, Any], QuantizedModelStatus, Any]]:
    """Every watched model (from the watched cache) with its status and its effective spec and
    policy (``core.acceptance.effective_for``, as a reconcile computes them)."""
    raws = kube.list_policies()
    for body in kube.list_models(settings.namespaces):
        md = body["metadata"]
        try:
            status = QuantizedModelStatus.model_validate(body.get("status") or {})
        except ValidationError:
            status = QuantizedModelStatus()
        labels = kube.namespace_labels(md["namespace"])
        policies, broken = read_policies(raws, labels)
        obs = Observed(now=now_rfc3339(), namespace=md["namespace"], name=md["name"], uid=md.get("uid", ""),
                       generation=md.get("generation"), resource_version=None, raw=body, spec=body.get("spec") or {},
                       old_status_raw={}, old_status=status, policies=policies, broken_policies=broken,
                       namespace_labels=labels)
        yield body, status, effective_for(obs, settings)


def observe_sweep(kube: Any, settings: Any) -> tuple[list[LocationUse], frozenset[str]]:
    """The models' locations with their effective retention, and every referenced key (reads only
    the watched caches; the listing is read per swept location by the caller)."""
    uses: list[LocationUse] = []
    statuses: list[QuantizedModelStatus] = []
    for body, status, acc in effective_models(kube, settings):
        md = body["metadata"]
        statuses.append(status)
        if acc.spec is None or acc.spec.storage is None:
            continue  # an unreadable spec: its location is unknown (its keys still count as referenced)
        rules = acc.effective.policy.rules
        uses.append(LocationUse(Location.of(acc.spec.storage), md["namespace"], md["name"],
                                acc.spec.storage.credentialsSecret, rules.artifactRetention,
                                rules.artifactRetentionPeriodSeconds if rules.artifactRetentionPeriodSeconds is not None
                                else DEFAULT_PERIOD_SECONDS))
    return uses, referenced_keys(statuses)
