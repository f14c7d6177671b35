"""Retention (issue 16, item 8): the pure sweep (observed references + storage listing + clock →
mark, clear, delete) and the order execute deletes in (manifest first)."""

from __future__ import annotations

from fewerbits_operator.core.execute import execute_retention
from fewerbits_operator.core.retention import (
    ClearMark,
    DeleteArtifact,
    Location,
    LocationUse,
    MarkUnreferenced,
    deletion_order,
    group_listing,
    sweep,
    swept_locations,
)

LOC = Location("s3://artifacts/p", "http://127.0.0.1:9000")
OTHER = Location("s3://artifacts/q", "http://127.0.0.1:9000")
K1, K2, K3 = "1" * 64, "2" * 64, "3" * 64
NOW = "2026-11-23T12:00:00Z"


def use(loc=LOC, retention="Delete", period=60, ns="a", model="m") -> LocationUse:
    return LocationUse(loc, ns, model, "s3", retention, period)


def listing(key: str, since: str | None = None, manifest: bool = True) -> list[tuple[str, str]]:
    objs = [(f"p/{key}/files/model.safetensors", NOW), (f"p/{key}/files/config.json", NOW), (f"p/{key}/.claim", NOW)]
    if manifest:
        objs.append((f"p/{key}/manifest.json", NOW))
    if since:
        objs.append((f"p/{key}/.unreferenced", since))
    return objs


def test_a_location_is_swept_only_when_every_model_using_it_says_delete():
    assert set(swept_locations([use(), use(OTHER, "Retain")])) == {LOC}
    assert swept_locations([use(), use(retention="Retain", model="n")]) == {}
    assert swept_locations([use(period=10), use(period=99, model="n")])[LOC][0] == 99  # the longest period


def test_sweep_marks_then_deletes_after_the_period_and_never_what_is_referenced():
    arts = group_listing("p/", listing(K1) + listing(K2, since="2026-11-23T11:58:00Z")
                         + listing(K3, since="2026-11-23T11:59:30Z") + [("p/not-a-key/x", NOW)])
    actions = sweep([use()], frozenset(), {LOC: arts}, NOW)
    assert [(type(a), a.key) for a in actions] == [(MarkUnreferenced, K1), (DeleteArtifact, K2)]  # K3: 30 s < 60 s
    (delete,) = [a for a in actions if isinstance(a, DeleteArtifact)]
    assert delete.objects[0] == f"p/{K2}/manifest.json"
    assert delete.objects[-2:] == (f"p/{K2}/.claim", f"p/{K2}/.unreferenced")
    assert delete.models == (("a", "m"),)

    # Referenced (again): never deleted, the mark cleared.
    actions = sweep([use()], frozenset({K1, K2, K3}), {LOC: arts}, NOW)
    assert [(type(a), a.key) for a in actions] == [(ClearMark, K2), (ClearMark, K3)]
    # A location under Retain: nothing at all.
    assert sweep([use(retention="Retain")], frozenset(), {LOC: arts}, NOW) == []


def test_deletion_order_is_manifest_files_then_the_rest():
    (art,) = group_listing("p/", listing(K1, since=NOW))
    order = deletion_order(art)
    assert order[0].endswith("manifest.json") and all("/files/" in o for o in order[1:3])
    (unpublished,) = group_listing("p/", listing(K2, manifest=False))
    assert unpublished.manifest is None and "/files/" in deletion_order(unpublished)[0]


class RecordingStore:
    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def put_object(self, storage, creds, key, body):
        self.calls.append(("put", key))

    def delete_object(self, storage, creds, key):
        self.calls.append(("delete", key))


class EventKube:
    def __init__(self):
        self.events: list[tuple[str, str]] = []

    def secret_data(self, namespace, name):
        return {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "secret"}

    def get_model(self, namespace, name):
        return {"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizedModel",
                "metadata": {"namespace": namespace, "name": name, "uid": "u"}}

    def post_event(self, body, type_, reason, message):
        self.events.append((reason, message))


def test_execute_deletes_the_manifest_before_any_file_and_says_so():
    arts = group_listing("p/", listing(K1) + listing(K2, since="2026-11-23T11:00:00Z"))
    store, kube = RecordingStore(), EventKube()
    deleted = execute_retention(kube, store, sweep([use()], frozenset(), {LOC: arts}, NOW), NOW)
    assert deleted == 1
    assert store.calls[0] == ("put", f"p/{K1}/.unreferenced")
    deletes = [k for verb, k in store.calls if verb == "delete"]
    assert deletes[0] == f"p/{K2}/manifest.json" and len(deletes) == 5
    (event,) = kube.events
    assert event[0] == "ArtifactDeleted" and K2[:12] in event[1] and "2026-11-23T11:00:00Z" in event[1]
