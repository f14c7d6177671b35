"""Helpers of the fault and security tests: artifacts in S3, Pod Security labels, and a scan for
secret values in everything the operator and its workloads leave behind."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from kubernetes import client

from e2e import demo

ARTIFACT_BUCKET = demo.ARTIFACT_BUCKET


def manifests(cluster, namespace: str) -> list[str]:
    """Object keys of every artifact manifest the test's storage prefix holds."""
    s3 = cluster.s3.client()
    keys: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=ARTIFACT_BUCKET, Prefix=f"{namespace}/"):
        keys += [o["Key"] for o in page.get("Contents", []) if o["Key"].endswith("/manifest.json")]
    return keys


def artifact_objects(cluster, namespace: str, key: str) -> dict[str, int]:
    """{object key: size} under one artifact's prefix."""
    s3 = cluster.s3.client()
    out: dict[str, int] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=ARTIFACT_BUCKET, Prefix=f"{namespace}/{key}/"):
        out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return out


def assert_manifest_complete(cluster, namespace: str, key: str) -> dict[str, Any]:
    """The manifest exists and every file it lists is in storage with its size and sha256 metadata."""
    s3 = cluster.s3.client()
    manifest = json.loads(s3.get_object(Bucket=ARTIFACT_BUCKET, Key=f"{namespace}/{key}/manifest.json")["Body"].read())
    objects = artifact_objects(cluster, namespace, key)
    for f in manifest["files"]:
        obj = f"{namespace}/{key}/files/{f['path']}"
        assert objects.get(obj) == f["sizeBytes"], f"{obj}: listed {f['sizeBytes']} bytes, stored {objects.get(obj)}"
        head = s3.head_object(Bucket=ARTIFACT_BUCKET, Key=obj)
        assert head["Metadata"].get("sha256") == f["sha256"], f"{obj}: sha256 metadata differs from the manifest"
    return manifest


def enforce_pod_security(cluster, namespace: str, level: str = "restricted") -> None:
    """Make the namespace enforce a Pod Security Standard level (admission refuses other pods)."""
    client.CoreV1Api(cluster.api_client()).patch_namespace(namespace, {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": level, "pod-security.kubernetes.io/enforce-version": "latest"}}})


def no_pod_security_refusals(cluster, namespace: str) -> list[str]:
    """Events saying admission refused a pod (FailedCreate from the Job or ReplicaSet controller)."""
    events = client.CoreV1Api(cluster.api_client()).list_namespaced_event(namespace).items
    return [f"{e.involved_object.kind}/{e.involved_object.name}: {e.message}" for e in events
            if e.reason == "FailedCreate" or "violates PodSecurity" in (e.message or "")]


def secret_forms(value: str) -> list[str]:
    """A secret value as it could leak: plain, and base64 (as in a Secret's data or a dumped env)."""
    return [value, base64.b64encode(value.encode()).decode()]


def scan_for_secrets(cluster, namespace: str, secrets: list[str],
                     operator_log: Path | None = None) -> tuple[list[str], list[str]]:
    """Every place a secret value shows up in what the operator made or wrote for one namespace:
    Jobs, Deployments, ReplicaSets, Pods (spec and status: termination messages), Services, Events,
    QuantizedModels (status, annotations), the operator's log and the workloads' logs. The Secrets
    themselves are the only objects allowed to hold the values, and are not scanned.

    Returns (leaks, what was scanned): a test asserts no leaks, and that the scan saw something."""
    api = cluster.api_client()
    core, apps, batch = client.CoreV1Api(api), client.AppsV1Api(api), client.BatchV1Api(api)
    custom = client.CustomObjectsApi(api)
    texts: dict[str, str] = {}

    def add(kind: str, items: list[Any]) -> None:
        for item in items:
            d = item if isinstance(item, dict) else api.sanitize_for_serialization(item)
            texts[f"{kind}/{d['metadata']['name']}"] = json.dumps(d)

    add("Job", batch.list_namespaced_job(namespace).items)
    add("Deployment", apps.list_namespaced_deployment(namespace).items)
    add("ReplicaSet", apps.list_namespaced_replica_set(namespace).items)
    add("Pod", core.list_namespaced_pod(namespace).items)
    add("Service", core.list_namespaced_service(namespace).items)
    add("ConfigMap", core.list_namespaced_config_map(namespace).items)
    add("Event", core.list_namespaced_event(namespace).items)
    add("QuantizedModel", custom.list_namespaced_custom_object(
        "fewerbits.io", "v1alpha1", namespace, "quantizedmodels")["items"])
    if operator_log is not None and operator_log.exists():
        texts["operator log"] = operator_log.read_text(errors="replace")
    for d in sorted((cluster.state_dir / "pods").glob(f"{namespace}_*")):
        for f in sorted(d.glob("*.log")) + sorted(d.glob("*.termination-log")):
            texts[f"container output {d.name}/{f.name}"] = f.read_text(errors="replace")
    leaks = []
    for where, text in texts.items():
        for s in secrets:
            for form in secret_forms(s):
                if form in text:
                    leaks.append(f"{where} contains a secret value ({len(s)} characters)")
    return leaks, sorted(texts)
