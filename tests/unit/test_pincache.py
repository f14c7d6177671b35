"""The S3 calibration ETag is remembered between passes (pincache.py): HEAD requests counted, the
clock a number the test moves (no sleep)."""

from __future__ import annotations

import pytest

from fewerbits_api.quantizedmodel import QuantizedModelStatus, StorageSpec
from fewerbits_operator.base.datapins import DataPin
from fewerbits_operator.artifacts.pincache import PinCache, PinKey, settled_etag
from fewerbits_operator.runtime.reconcile import Reconciler
from fewerbits_operator.base.settings import OperatorSettings
from fewerbits_operator.base.storage import StorageError
from tests.unit.test_reconcile_fake import NAME, NS, FakeKube, FakeStore, publish

DATA = "s3://data/calib.jsonl"
STORAGE = StorageSpec(uri="s3://artifacts/p", endpoint="http://127.0.0.1:9000")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Heads:
    """A HEAD of the calibration object that counts itself."""

    def __init__(self, etag: str = "e1") -> None:
        self.etag, self.count, self.fail = etag, 0, False

    def __call__(self, uri: str = DATA) -> DataPin:
        self.count += 1
        if self.fail:
            raise StorageError(f"{uri}: object storage unreachable")
        return DataPin(uri, self.etag)


def test_reused_while_fresh_and_settled_read_again_on_any_change() -> None:
    clock, heads = Clock(), Heads()
    cache = PinCache(300, clock)
    key = PinKey.of("uid-m", 1, STORAGE, DATA)
    assert cache.pin(key, None, heads).etag == "e1" and heads.count == 1
    assert cache.pin(key, None, heads) and heads.count == 2  # not settled on it yet: read every pass
    for _ in range(5):
        cache.pin(key, "e1", heads)
    assert heads.count == 2  # settled, fresh: no HEAD
    assert cache.pin(key, "e0", heads) and heads.count == 3  # status settled on another ETag
    cache.pin(PinKey.of("uid-m", 2, STORAGE, DATA), "e1", heads)  # a spec edit
    cache.pin(PinKey.of("uid-m", 1, STORAGE, "s3://data/other.jsonl"), "e1", lambda: heads("s3://data/other.jsonl"))
    cache.pin(PinKey.of("uid-m", 1, StorageSpec(uri="s3://artifacts/p"), DATA), "e1", heads)  # another store
    assert heads.count == 6
    clock.t += 299
    cache.pin(key, "e1", heads)
    assert heads.count == 6
    heads.etag = "e2"  # replaced in place, the model unchanged: seen once the read is ttl old
    clock.t += 1
    assert cache.pin(key, "e1", heads).etag == "e2" and heads.count == 7


def test_a_failed_read_is_not_remembered_and_memory_is_bounded() -> None:
    clock, heads = Clock(), Heads()
    cache = PinCache(300, clock, max_entries=2)
    key = PinKey.of("uid-m", 1, STORAGE, DATA)
    heads.fail = True
    with pytest.raises(StorageError):
        cache.pin(key, "e1", heads)
    heads.fail = False
    assert cache.pin(key, "e1", heads).etag == "e1" and heads.count == 2
    for gen in (2, 3, 4):
        cache.pin(PinKey.of("uid-m", gen, STORAGE, DATA), "e1", heads)
    assert len(cache) == 2
    clock.t += 300
    cache.pin(PinKey.of("uid-x", 1, STORAGE, DATA), "e1", heads)
    assert len(cache) == 1  # expired entries go when a new one is stored


def test_settled_only_when_every_artifact_is_published() -> None:
    art = {"key": "k", "uri": "s3://a/k/", "format": "w4a16-gptq"}
    data = {"dataset": DATA, "pinned": True, "etag": "e1"}
    assert settled_etag(QuantizedModelStatus()) is None
    assert settled_etag(QuantizedModelStatus.model_validate({"artifacts": [art], "calibrationData": data})) is None
    published = {**art, "sizeBytes": 10}
    assert settled_etag(QuantizedModelStatus.model_validate({"artifacts": [published], "calibrationData": data})) == "e1"
    assert settled_etag(QuantizedModelStatus.model_validate(
        {"artifacts": [published, art], "calibrationData": data})) is None


class CountingStore(FakeStore):
    def __init__(self) -> None:
        super().__init__()
        self.etag, self.heads = "e1", 0

    def head_object(self, storage, uri, creds):
        assert uri == DATA
        self.heads += 1
        return self.etag, None


def test_a_model_at_rest_heads_its_calibration_object_once_per_ttl() -> None:
    kube, store = FakeKube(), CountingStore()
    kube.model["spec"]["quantization"] = {"format": "w4a16-gptq", "calibration": {"dataset": DATA}}
    rec = Reconciler(kube, store, OperatorSettings(_env_file=None, resync_seconds=30))
    clock = Clock()
    rec.observer.pins.clock = clock
    rec.reconcile(NS, NAME)
    rec.reconcile(NS, NAME)
    assert store.heads == 2 and len(kube.jobs) == 1  # a Job wanted and running: every pass reads
    publish(store, kube)
    rec.reconcile(NS, NAME)  # the pass that finds the manifest still reads (status not settled yet)
    assert store.heads == 3 and kube.model["status"]["calibrationData"]["etag"] == "e1"
    for _ in range(5):
        rec.reconcile(NS, NAME)
    assert store.heads == 3  # at rest: no HEAD while the read is fresh
    store.etag = "e2"  # the object replaced, the model unchanged
    clock.t += rec.settings.calibration_etag_seconds
    rec.reconcile(NS, NAME)
    assert store.heads == 4 and len(kube.jobs) == 2  # seen: a new key and its Job
    kube.model["metadata"]["generation"] = 2
    rec.reconcile(NS, NAME)
    assert store.heads == 5  # a spec edit reads again at once
