"""One quantization Job per artifact key and storage location, across namespaces (issue 16, item 6).

Jobs are namespaced: two models in two namespaces that publish the same key to the same storage
would each get a Job (same name, different namespace) and quantize the same bytes twice at once.
Before creating a Job the operator takes a **claim in storage**: ``<storage uri>/<key>/.claim``,
written create-only (`PUT` with `If-None-Match: *`, which S3 and MinIO refuse with 412 when the
object exists). The model that wins creates its Job; the others wait for the manifest, which they
then find as a cache hit.

Why a claim in storage and not a Lease: the thing shared is the storage location, not the cluster.
Two clusters (or two operators with different watch scopes) publishing to one bucket meet only
there; the claim lives beside the artifact it guards, needs no RBAC on Leases in some namespace,
and the retention sweep removes it with the artifact (it is under the key's prefix).

A claim is stale, and taken over (deleted, then claimed again create-only: one taker wins), when
its expiry passed (created + the Job's ``activeDeadlineSeconds`` + a margin: no Job of it can still
run), or when its holder Job is in a namespace this operator watches and is seen Failed or gone
while the claim is older than ``CLAIM_GRACE_SECONDS`` (the grace covers the moment between the
claim and the Job's creation, and a watch cache that has not seen the Job yet).

Pure: observe reads the claim and its holder Job, ``decide`` calls :func:`claim_state`, execute
writes the claim (``storage.ObjectStore.put_claim``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from enum import Enum
from typing import Any

CLAIM_NAME = ".claim"
"""The claim object, under the artifact's key prefix (beside ``manifest.json`` and ``files/``)."""
CLAIM_MARGIN_SECONDS = 600
"""Added to the Job's deadline: a claim older than both cannot have a Job still running."""
CLAIM_GRACE_SECONDS = 60
"""A fresh claim whose holder Job is not seen yet is not stale (being created, cache lagging)."""


class ClaimState(str, Enum):
    FREE = "Free"
    """No claim: claim it, then create the Job."""
    MINE = "Mine"
    """Held for this model's own Job (same namespace, same Job name): go on."""
    HELD = "Held"
    """Another namespace's Job is producing the artifact: wait for its manifest."""
    STALE = "Stale"
    """Expired, or its Job failed or is gone: take it over."""


@dataclass(frozen=True)
class Claim:
    namespace: str
    job: str
    created_at: str
    expires_at: str

    @property
    def holder(self) -> str:
        return f"{self.namespace}/{self.job}"

    def to_json(self) -> bytes:
        return json.dumps({"holder": self.holder, "namespace": self.namespace, "job": self.job,
                           "createdAt": self.created_at, "expiresAt": self.expires_at}, sort_keys=True).encode()

    @classmethod
    def parse(cls, raw: bytes) -> Claim | None:
        """None for anything unreadable (treated as no valid claim: stale)."""
        try:
            doc: Any = json.loads(raw)
            return cls(str(doc["namespace"]), str(doc["job"]), str(doc["createdAt"]), str(doc["expiresAt"]))
        except (ValueError, KeyError, TypeError):
            return None


def _time(rfc3339: str) -> datetime:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00"))


def _rfc3339(t: datetime) -> str:
    return t.astimezone(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def new_claim(namespace: str, job: str, now: str, deadline_seconds: int) -> Claim:
    expires = _time(now) + timedelta(seconds=deadline_seconds + CLAIM_MARGIN_SECONDS)
    return Claim(namespace, job, now, _rfc3339(expires))


def claim_state(claim: Claim | None, present: bool, namespace: str, job: str, now: str,
                holder_job_failed_or_gone: bool | None) -> ClaimState:
    """``present``: a claim object exists (``claim`` None then means unreadable).
    ``holder_job_failed_or_gone``: what observe saw of the holder Job (None: not looked up, its
    namespace is not watched)."""
    if not present:
        return ClaimState.FREE
    if claim is None:
        return ClaimState.STALE
    if claim.namespace == namespace and claim.job == job:
        return ClaimState.MINE
    t = _time(now)
    try:
        if t >= _time(claim.expires_at):
            return ClaimState.STALE
        old_enough = (t - _time(claim.created_at)).total_seconds() >= CLAIM_GRACE_SECONDS
    except ValueError:
        return ClaimState.STALE
    if holder_job_failed_or_gone and old_enough:
        return ClaimState.STALE
    return ClaimState.HELD
