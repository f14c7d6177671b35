"""The steps ``decide_artifact`` is composed of, one at a time: each takes the facts it reads and
returns its verdict, writes and events without writing anything itself (test_decide checks the
composition through ``decide``)."""

from __future__ import annotations

from fewerbits_api.policy import KueueQueueing, QuantizationJobPlacement
from fewerbits_api.quantizedmodel import ArtifactFailure, ArtifactStatus
from fewerbits_api.conditions import Reason
from fewerbits_operator.base.claims import Claim, new_claim
from fewerbits_operator.base.datapins import EVAL_FIELD
from fewerbits_operator.core.decide import AddJobOwner, ClaimArtifact, CreateJob
from fewerbits_operator.core.acceptance import JobSizing
from fewerbits_operator.core.artifact_steps import decide_artifact
from fewerbits_operator.core.outcome import StatusBuilder
from fewerbits_operator.core.artifact_steps import (
    admission_step,
    as_published,
    claim_step,
    job_step,
    published_step,
    queued_since,
    refusal_step,
    start_step,
)
from fewerbits_operator.base.observed import ArtifactFacts, JobFacts, JobState
from fewerbits_operator.base.queueing import KUEUE, OPERATOR_CAP, Admission, QueueFacts, operator_queue
from tests.unit.test_decide import NOW, NS, SETTINGS, UID, World, manifest

EARLIER = "2026-11-23T11:00:00Z"
PLACEMENT = QuantizationJobPlacement()
KUEUE_PLACEMENT = QuantizationJobPlacement(kueue=KueueQueueing(localQueueName="lq"))


def world_artifact(world: World | None = None):
    world = world or World()
    obs = world.observed()
    acc, _, arts = world.planned()
    return obs, acc, arts[0]


def status_with(world: World, **art) -> World:
    _, _, planned = world_artifact(world)
    world.status = {"artifacts": [ArtifactStatus(key=planned.key, uri="s3://x/", format=planned.format,
                                                 **art).model_dump(mode="json", exclude_none=True)]}
    return world


def test_refusal_order_failed_generation_then_policy_then_dataset() -> None:
    world = World(dataset_errors={EVAL_FIELD: "eval set unreadable"})
    obs, _, planned = world_artifact(world)
    sizing = JobSizing(refusals={planned.format: "needs 4 GPUs, policy allows 1"})
    dataset = refusal_step(obs, planned, None, None)
    assert dataset is not None and dataset.refused == "eval set unreadable"
    assert dataset.refused_reason == Reason.DATASET_UNREADABLE
    policy = refusal_step(obs, planned, None, sizing)
    assert policy is not None and policy.refused == "needs 4 GPUs, policy allows 1"
    assert policy.refused_reason == Reason.JOB_EXCEEDS_POLICY
    failed = ArtifactFailure(generation=1, reason=Reason.JOB_OOM_KILLED, message="oom", job="j")
    prev = ArtifactStatus(key=planned.key, uri="s3://x/", format=planned.format, failure=failed)
    kept = refusal_step(obs, planned, prev, sizing)
    assert kept is not None and kept.failure == failed and kept.job == "j" and kept.refused is None
    # An edit (a new generation) tries again: the policy refusal answers then.
    assert refusal_step(World(generation=2).observed(), planned, prev, sizing).refused == policy.refused
    assert refusal_step(World().observed(), planned, None, None) is None


def test_claim_step_free_mine_held_stale() -> None:
    obs, acc, planned = world_artifact()
    free = claim_step(obs, acc.spec.storage, planned, ArtifactFacts(), 3600)
    assert free.held is None and isinstance(free.write, ClaimArtifact) and not free.write.take_over
    assert Claim.parse(free.write.body) == new_claim(NS, planned.job_name, NOW, 3600)
    mine = new_claim(NS, planned.job_name, EARLIER, 3600)
    assert claim_step(obs, acc.spec.storage, planned,
                      ArtifactFacts(claim_present=True, claim=mine), 3600).write is None
    other = new_claim("other", planned.job_name, EARLIER, 86400)
    held = claim_step(obs, acc.spec.storage, planned, ArtifactFacts(claim_present=True, claim=other), 3600)
    assert held.write is None and held.held is not None and held.held.pending
    assert "namespace other" in held.held.waiting
    stale = claim_step(obs, acc.spec.storage, planned,
                       ArtifactFacts(claim_present=True, claim=other, claim_holder_gone=True), 3600)
    assert stale.held is None and stale.write is not None and stale.write.take_over


def test_admission_step_queues_over_the_cap_and_leaves_kueue_alone() -> None:
    obs, _, planned = world_artifact()
    full = QueueFacts(running=frozenset({("x", "running")}))
    assert admission_step(obs, planned, PLACEMENT, None, NOW) is None
    assert admission_step(obs, planned, KUEUE_PLACEMENT, Admission(1, full), NOW) is None
    queued = admission_step(obs, planned, PLACEMENT, Admission(1, full), EARLIER)
    assert queued is not None and queued.queue == operator_queue(1, EARLIER) and queued.job == planned.job_name
    assert "1 of 1 quantization Jobs running" in queued.waiting
    room = Admission(1, QueueFacts())
    assert admission_step(obs, planned, PLACEMENT, room, NOW) is None
    assert room.running == 1  # the admitted Job holds the slot for the pass's later Jobs


def test_start_step_renders_the_job_and_says_so() -> None:
    obs, acc, planned = world_artifact()
    step = start_step(obs, acc, planned, PLACEMENT, SETTINGS, None, NOW)
    (create,) = step.actions
    assert isinstance(create, CreateJob) and create.job["metadata"]["name"] == planned.job_name
    assert step.verdict.pending and step.verdict.queue is None and "pending" in step.verdict.waiting
    assert [e.reason for e in step.events] == ["QuantizationStarted"]
    kueue = start_step(obs, acc, planned, KUEUE_PLACEMENT, SETTINGS, None, EARLIER)
    assert kueue.actions[0].job["spec"]["suspend"] is True
    assert kueue.verdict.queue.reason == KUEUE and kueue.verdict.queue.since == EARLIER
    assert kueue.events[0].message.endswith("once Kueue admits it")


def test_job_step_co_owns_and_reads_the_job() -> None:
    obs, _, planned = world_artifact()
    mine = job_step(obs, planned, JobFacts(planned.job_name, ({"uid": UID},), JobState.ACTIVE, pod_phases=("Running",)),
                    None)
    assert mine.actions == () and mine.verdict.waiting.endswith("running (pod Running)")
    theirs = job_step(obs, planned, JobFacts(planned.job_name, ({"uid": "other"},), JobState.ACTIVE), None)
    (add,) = theirs.actions
    assert isinstance(add, AddJobOwner) and [r["uid"] for r in add.owner_refs] == ["other", UID]
    prev = ArtifactStatus(key=planned.key, uri="s3://x/", format=planned.format, queue=operator_queue(1, EARLIER))
    suspended = job_step(obs, planned, JobFacts(planned.job_name, ({"uid": UID},), JobState.ACTIVE, suspended=True,
                                                queue_name="lq"), prev)
    assert suspended.verdict.queue.reason == KUEUE and suspended.verdict.queue.since == EARLIER
    assert queued_since(None, NOW) == NOW


def test_published_step_says_cache_hit_once() -> None:
    obs, _, planned = world_artifact()
    facts = ArtifactFacts(manifest=manifest(planned, 0.5))
    first = published_step(obs, planned, facts, None, SETTINGS)
    assert first.verdict.cache_hit and first.verdict.job is None and [e.reason for e in first.events] == ["CacheHit"]
    prev = ArtifactStatus(key=planned.key, uri="s3://x/", format=planned.format, cacheHit=True)
    assert published_step(obs, planned, facts, prev, SETTINGS).events == ()
    # Its own Job published it: no cache hit.
    own = ArtifactFacts(manifest=facts.manifest, job=JobFacts(planned.job_name, ({"uid": UID},), JobState.SUCCEEDED))
    made = published_step(obs, planned, own, None, SETTINGS).verdict
    assert not made.cache_hit and made.job == planned.job_name
    assert as_published(planned, facts) is planned


def test_no_claim_is_written_for_a_job_held_back_by_the_cap() -> None:
    obs, acc, planned = world_artifact()
    st, actions = StatusBuilder([], 1, NOW), []
    full = Admission(1, QueueFacts(running=frozenset({("x", "running")})))
    v = decide_artifact(obs, acc, planned, ArtifactFacts(), PLACEMENT, SETTINGS, st, actions, None, full)
    assert v.queue is not None and v.queue.reason == OPERATOR_CAP and actions == [] and st.events == []
    v = decide_artifact(obs, acc, planned, ArtifactFacts(), PLACEMENT, SETTINGS, st, actions, None,
                        Admission(1, QueueFacts()))
    assert [type(a) for a in actions] == [ClaimArtifact, CreateJob] and v.pending
    assert [e.reason for e in st.events] == ["QuantizationStarted"]
