"""One Job per key and storage location across namespaces (issue 16, item 6): the claim's states,
and what ``decide`` does with each. Pure."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fewerbits_operator.base.claims import CLAIM_GRACE_SECONDS, Claim, ClaimState, claim_state, new_claim
from fewerbits_operator.core.decide import ClaimArtifact, CreateJob, decide
from fewerbits_operator.base.observed import ArtifactFacts

from tests.unit.test_decide import NOW, NS, SETTINGS, World

LATER = "2026-11-23T12:05:00Z"  # NOW + 5 minutes


def test_new_claim_expires_after_the_deadline_and_a_margin():
    c = new_claim("a", "job", NOW, 3600)
    assert c.expires_at == "2026-11-23T13:10:00Z" and Claim.parse(c.to_json()) == c
    assert Claim.parse(b"not json") is None


@pytest.mark.parametrize("claim, present, now, gone, state", [
    (None, False, NOW, None, ClaimState.FREE),
    (None, True, NOW, None, ClaimState.STALE),  # unreadable
    (new_claim(NS, "job", NOW, 3600), True, LATER, None, ClaimState.MINE),
    (new_claim("other", "job", NOW, 3600), True, LATER, False, ClaimState.HELD),
    (new_claim("other", "job", NOW, 3600), True, LATER, None, ClaimState.HELD),  # not watched: until expiry
    (new_claim("other", "job", NOW, 3600), True, "2026-11-23T13:10:00Z", None, ClaimState.STALE),  # expired
    (new_claim("other", "job", NOW, 3600), True, LATER, True, ClaimState.STALE),  # its Job failed or is gone
    (new_claim("other", "job", NOW, 3600), True, "2026-11-23T12:00:30Z", True, ClaimState.HELD),  # grace
])
def test_claim_state(claim, present, now, gone, state):
    assert CLAIM_GRACE_SECONDS == 60
    assert claim_state(claim, present, NS, "job", now, gone) is state


def _decided(claim: Claim | None, gone: bool | None = None):
    w = World()
    (planned,) = w.planned()[2]
    obs = w.observed()
    facts = ArtifactFacts(claim_present=claim is not None, claim=claim, claim_holder_gone=gone)
    return planned, decide(replace(obs, artifacts={planned.key: facts}), SETTINGS)


def test_a_free_key_is_claimed_before_the_job_is_created():
    planned, out = _decided(None)
    kinds = [type(a) for a in out.actions]
    assert kinds.index(ClaimArtifact) < kinds.index(CreateJob)
    (claim,) = [a for a in out.actions if isinstance(a, ClaimArtifact)]
    assert claim.key == planned.key and not claim.take_over
    assert Claim.parse(claim.body).holder == f"{NS}/{planned.job_name}"


def test_a_key_another_namespace_holds_is_waited_for():
    planned, out = _decided(Claim("team-b", planned_name := "fewerbits-quantize-x", NOW, "2026-11-23T18:00:00Z"))
    assert not [a for a in out.actions if isinstance(a, (ClaimArtifact, CreateJob))]
    q = {c.type: c for c in out.status.conditions}["Quantized"]
    assert q.reason == "JobPending" and f"Job {planned_name} in namespace team-b" in q.message


def test_a_stale_claim_is_taken_over():
    _, out = _decided(Claim("team-b", "fewerbits-quantize-x", "2026-11-23T11:00:00Z", "2026-11-23T18:00:00Z"), gone=True)
    (claim,) = [a for a in out.actions if isinstance(a, ClaimArtifact)]
    assert claim.take_over and [a for a in out.actions if isinstance(a, CreateJob)]
