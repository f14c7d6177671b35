"""The cap on running quantization Jobs and its queue (queueing.py), the Kueue hand-off, and the
counts a QuantizationPolicy shows: pure functions, no cluster."""

from __future__ import annotations

from dataclasses import replace

from fewerbits_operator.runtime.admission import AdmissionGate
from fewerbits_operator.core.decide import CreateJob, decide
from fewerbits_operator.base.observed import JobFacts, JobState
from fewerbits_operator.runtime.policy_status import NamespaceModels, namespace_models, policy_statuses
from fewerbits_operator.base.queueing import (
    Admission,
    QueueFacts,
    Waiter,
    facts_from,
    slot_changed,
    waiters_of,
)
from fewerbits_operator.base.settings import OperatorSettings

from tests.unit.test_decide import NAME, NOW, NS, SETTINGS, UID, World, policy

T0, T1, T2 = "2026-11-23T11:00:00Z", "2026-11-23T11:05:00Z", "2026-11-23T11:10:00Z"


def job(ns: str, name: str, *, done: bool = False, suspend: bool = False) -> dict:
    return {"metadata": {"namespace": ns, "name": name}, "spec": {"suspend": suspend},
            "status": {"conditions": [{"type": "Complete", "status": "True"}] if done else []}}


def queued_model(ns: str, name: str, job_name: str, since: str, reason: str = "OperatorCap") -> dict:
    return {"metadata": {"namespace": ns, "name": name},
            "status": {"artifacts": [{"key": "k", "job": job_name,
                                      "queue": {"reason": reason, "position": 1, "since": since}}]}}


# ------------------------------------------------------------------ the order


def test_running_counts_unfinished_unsuspended_jobs_only():
    facts = facts_from([job("a", "j1"), job("a", "j2", done=True), job("b", "j3", suspend=True)], [])
    assert facts.running == {("a", "j1")}
    assert facts.existing == {("a", "j1"), ("a", "j2"), ("b", "j3")}


def test_under_the_cap_a_job_starts_and_holds_a_slot_for_the_next_of_the_same_pass():
    adm = Admission(2, QueueFacts(running=frozenset({("a", "j0")})))
    assert adm.admit(Waiter(T0, "a", "m", "j1")) is None
    assert adm.admit(Waiter(T0, "a", "m", "j2")) == 1
    assert adm.running == 2


def test_order_is_first_wanted_then_namespace_model_job_whoever_asks():
    waiting = (Waiter(T1, "b", "m2", "j2"), Waiter(T0, "z", "m9", "j9"), Waiter(T1, "a", "m3", "j3"))
    facts = QueueFacts(running=frozenset({("x", "r")}), waiting=waiting)
    positions = {w.job: Admission(1, facts).admit(w) for w in waiting}
    assert positions == {"j9": 1, "j3": 2, "j2": 3}
    # A newcomer queues behind everyone who waited longer, and the same facts give the same answer.
    assert Admission(1, facts).admit(Waiter(T2, "a", "new", "jn")) == 4
    assert Admission(1, facts).admit(Waiter(T2, "a", "new", "jn")) == 4


def test_a_free_slot_goes_to_the_head_of_the_queue():
    waiting = (Waiter(T0, "a", "first", "j1"), Waiter(T1, "a", "second", "j2"))
    facts = QueueFacts(waiting=waiting)
    assert Admission(1, facts).admit(waiting[1]) == 1  # the slot is the first's
    assert Admission(1, facts).admit(waiting[0]) is None


def test_a_waiter_whose_job_exists_waits_no_more():
    waiting = (Waiter(T0, "a", "first", "j1"), Waiter(T1, "a", "second", "j2"))
    facts = QueueFacts(existing=frozenset({("a", "j1")}), waiting=waiting)  # j1 started and finished
    assert Admission(1, facts).admit(waiting[1]) is None


def test_two_models_sharing_a_job_are_one_entry_at_the_earliest_time():
    waiting = (Waiter(T0, "a", "m1", "shared"), Waiter(T2, "a", "m2", "shared"), Waiter(T1, "a", "m3", "other"))
    facts = QueueFacts(running=frozenset({("x", "r")}), waiting=waiting)
    assert Admission(1, facts).admit(waiting[1]) == 1
    assert Admission(1, facts).admit(waiting[2]) == 2


def test_no_cap():
    adm = Admission(0, QueueFacts(running=frozenset({("a", str(i)) for i in range(50)})))
    assert adm.admit(Waiter(T0, "a", "m", "j")) is None


def test_waiters_are_read_from_status_and_only_the_operator_caps():
    models = [queued_model("a", "m1", "j1", T0), queued_model("a", "m2", "j2", T1, reason="Kueue"),
              {"metadata": {"namespace": "a", "name": "m3"}, "status": {}}]
    assert waiters_of(models) == (Waiter(T0, "a", "m1", "j1"),)


def test_slot_changes_that_move_the_queue():
    assert slot_changed(None, job("a", "j"))
    assert slot_changed(job("a", "j"), None)
    assert slot_changed(job("a", "j"), job("a", "j", done=True))
    assert slot_changed(job("a", "j", suspend=True), job("a", "j"))  # Kueue admitted it
    assert not slot_changed(job("a", "j"), job("a", "j"))  # a pod became ready: no slot moved


# ------------------------------------------------------------------ decide under the cap


def _world_wanting_a_job() -> World:
    w = World()
    w.no_job()
    return w


def test_over_the_cap_no_job_is_created_and_status_shows_the_position():
    w = _world_wanting_a_job()
    facts = QueueFacts(running=frozenset({("other", "j")}), existing=frozenset({("other", "j")}),
                       waiting=(Waiter(T0, "other", "early", "jx"),))
    cap1 = SETTINGS.model_copy(update={"max_running_quantization_jobs": 1})
    out = decide(replace(w.observed(), queue=facts), cap1)
    assert not [a for a in out.actions if isinstance(a, CreateJob)]
    quantized = next(c for c in out.status.conditions if c.type == "Quantized")
    assert (quantized.status, quantized.reason) == ("False", "Queued")
    assert "queued at position 2: 1 of 1 quantization Jobs running" in quantized.message
    q = out.status.artifacts[0].queue
    assert (q.reason, q.position, q.since) == ("OperatorCap", 2, NOW)
    assert "Queued" in {e.reason for e in out.events}

    # The next pass keeps `since` (its place) and, once a slot is free and it heads the queue, starts.
    w.status = out.status.to_wire()
    again = decide(replace(w.observed(), queue=facts), cap1)
    assert again.status.to_wire() == out.status.to_wire()
    assert not [a for a in again.actions if isinstance(a, CreateJob)]
    free = QueueFacts(existing=frozenset({("other", "j")}),
                      waiting=(Waiter(NOW, NS, NAME, out.status.artifacts[0].job),))
    started = decide(replace(w.observed(), queue=free), cap1)
    assert [type(a) for a in started.actions if isinstance(a, CreateJob)] == [CreateJob]
    assert started.status.artifacts[0].queue is None
    assert next(c for c in started.status.conditions if c.type == "Quantized").reason == "JobPending"


def test_without_queue_facts_decide_creates_as_before():
    w = _world_wanting_a_job()
    out = decide(w.observed(), SETTINGS.model_copy(update={"max_running_quantization_jobs": 1}))
    assert [a for a in out.actions if isinstance(a, CreateJob)]


def test_kueue_jobs_are_never_held_back_by_the_operator_cap():
    w = _world_wanting_a_job()
    w.policies = [policy(rules={"quantizationJob": {"kueue": {"localQueueName": "gpu",
                                                               "workloadPriorityClassName": "batch"}}})]
    w.no_job()
    full = QueueFacts(running=frozenset({("o", str(i)) for i in range(9)}))
    out = decide(replace(w.observed(), queue=full), SETTINGS.model_copy(update={"max_running_quantization_jobs": 1}))
    created = [a.job for a in out.actions if isinstance(a, CreateJob)]
    assert len(created) == 1 and created[0]["spec"]["suspend"] is True
    labels = created[0]["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "gpu" and labels["kueue.x-k8s.io/priority-class"] == "batch"
    # The pod template does not carry the queue label (Kueue's pod integration must not pick the pods).
    assert "kueue.x-k8s.io/queue-name" not in created[0]["spec"]["template"]["metadata"]["labels"]

    # The suspended Job as the next pass sees it: the same status, no write.
    w.status = out.status.to_wire()
    name = created[0]["metadata"]["name"]
    for key in list(w.artifacts):
        w.artifacts[key] = replace(w.artifacts[key], job=JobFacts(name, ({"uid": UID},), JobState.PENDING,
                                                                  suspended=True, queue_name="gpu"))
    again = decide(w.observed(), SETTINGS)
    assert again.status.to_wire() == out.status.to_wire()
    assert not [a for a in again.actions if isinstance(a, CreateJob)]
    # Admitted: no longer queued.
    for key in list(w.artifacts):
        w.artifacts[key] = replace(w.artifacts[key], job=JobFacts(name, ({"uid": UID},), JobState.ACTIVE,
                                                                  pod_phases=("Running",), queue_name="gpu"))
    running = decide(w.observed(), SETTINGS)
    assert running.status.artifacts[0].queue is None
    assert next(c for c in running.status.conditions if c.type == "Quantized").reason == "JobRunning"


def test_the_ledger_counts_a_created_job_until_the_cache_shows_it():
    class FakeKube:
        jobs: list = []

        def list_managed_jobs(self, namespaces):
            return list(self.jobs)

        def list_models_where(self, namespaces, where):
            return []

    t = [0.0]
    kube = FakeKube()
    gate = AdmissionGate(kube, [], clock=lambda: t[0])
    w = _world_wanting_a_job()
    with gate.lock:
        out = decide(replace(w.observed(), queue=gate.facts()), SETTINGS)
        gate.record(out)
    name = next(a.job for a in out.actions if isinstance(a, CreateJob))["metadata"]["name"]
    assert gate.facts().running == {(NS, name)}  # not in the cache yet: still counted
    kube.jobs = [job(NS, name, done=True)]
    assert gate.facts().running == frozenset()  # the cache has it (finished): the ledger forgets it
    kube.jobs = []
    assert gate.facts().running == frozenset()


def test_settings_default_cap():
    assert OperatorSettings(_env_file=None).max_running_quantization_jobs == 4


# ------------------------------------------------------------------ what a policy shows


def test_policy_counts_namespaces_models_and_queued_jobs_it_governs():
    team = {"apiVersion": "fewerbits.io/v1alpha1", "kind": "QuantizationPolicy",
            "metadata": {"name": "team", "generation": 1},
            "spec": {"namespaceSelector": {"matchLabels": {"team": "a"}}}}
    everyone = {**team, "metadata": {"name": "all", "generation": 1}, "spec": {}}
    models = [queued_model("a1", "m1", "j1", T0), {"metadata": {"namespace": "a1", "name": "m2"}},
              {"metadata": {"namespace": "b", "name": "m3"}}]
    labels = {"a1": {"team": "a"}, "b": {"team": "b"}}
    governed = namespace_models(models, labels.__getitem__)
    assert governed == [NamespaceModels({"team": "a"}, 2, 1), NamespaceModels({"team": "b"}, 1, 0)]
    out = policy_statuses([team, everyone], [g.labels for g in governed], NOW, governed)
    assert (out["team"].governedNamespaces, out["team"].governedModels, out["team"].queuedJobs) == (1, 2, 1)
    assert (out["all"].governedNamespaces, out["all"].governedModels, out["all"].queuedJobs) == (2, 3, 1)
    # Written as typed status fields; without counts this time, the last ones are kept.
    team["status"] = out["team"].to_wire()
    assert team["status"]["governedModels"] == 2
    kept = policy_statuses([team], [], NOW)
    assert kept["team"].governedModels == 2
