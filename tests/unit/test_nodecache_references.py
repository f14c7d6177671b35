"""The node cache's referenced-keys feed: which ConfigMap each namespace gets (pure decision), and
the fetch init container of a node-cache pod reading it."""

from __future__ import annotations

from fewerbits_operator.core.nodecache import (
    REFERENCES_CONFIGMAP,
    REFERENCES_MOUNT,
    ApplyReferences,
    DeleteReferences,
    NodeCacheUse,
    decide_references,
    references_body,
)
from fewerbits_operator.serving.render import render_deployment
from fewerbits_runtime.nodecache import read_referenced
from tests.unit.test_render import OWNER, SETTINGS, SPEC, VARIANT

A, B, C, D = ("a" * 64, "b" * 64, "c" * 64, "d" * 64)


def use(ns, name, node, *keys):
    return NodeCacheUse(ns, name, f"uid-{ns}-{name}", node, frozenset(keys))


USES = [use("ml", "llama", True, A, B), use("ml", "mistral", False, C),
        use("team", "qwen", True, B, D), use("other", "phi", False, C)]


def _keys(body, tmp_path):
    f = tmp_path / "keys"
    f.write_text(body["data"]["keys"])
    return read_referenced(f)


def test_namespaces_with_node_cache_models_get_every_node_cache_key(tmp_path):
    actions = decide_references(USES, {"ml": None, "team": None, "other": None})
    assert [type(a) for a in actions] == [ApplyReferences, ApplyReferences]
    ml, team = actions
    assert (ml.namespace, team.namespace) == ("ml", "team") and ml.resource_version is None
    # Cluster-wide (the node cache is shared by every namespace), node-cache models' keys only:
    # C is referenced by Pod-cached models only, so it is never on a node through them.
    assert _keys(ml.body, tmp_path) == _keys(team.body, tmp_path) == sorted([A, B, D])
    md = ml.body["metadata"]
    assert md["name"] == REFERENCES_CONFIGMAP and md["namespace"] == "ml"
    # Owned by the namespace's node-cache models, none as controller: it goes with the last of them.
    assert [(o["name"], o["controller"]) for o in md["ownerReferences"]] == [("llama", False)]
    assert "secret" not in str(ml.body).lower()


def test_unchanged_is_not_written_and_changes_replace_that_version():
    first = {a.namespace: {**a.body, "metadata": {**a.body["metadata"], "resourceVersion": "7"}}
             for a in decide_references(USES, {"ml": None, "team": None, "other": None})}
    assert decide_references(USES, {**first, "other": None}) == []
    more = USES + [use("team", "gemma", True, "e" * 64)]
    actions = decide_references(more, {**first, "other": None})
    assert [(a.namespace, a.resource_version) for a in actions] == [("ml", "7"), ("team", "7")]
    assert [o["name"] for o in actions[1].body["metadata"]["ownerReferences"]] == ["gemma", "qwen"]


def test_a_namespace_without_node_cache_models_loses_its_configmap():
    stale = references_body("other", frozenset([A]), [use("other", "phi", True)])
    stale["metadata"]["resourceVersion"] = "3"
    actions = decide_references(USES, {"ml": None, "team": None, "other": stale})
    assert DeleteReferences("other", "3") in actions
    # No node-cache model anywhere: nothing is created, existing ones go.
    none = [use("ml", "llama", False, A)]
    assert decide_references(none, {"ml": None}) == []


def test_a_node_cache_pod_reads_the_configmap_in_its_fetch_container():
    spec = SPEC.model_copy(update={"serving": SPEC.serving.model_copy(update={"artifactCache": "Node"})})
    pod = render_deployment(OWNER, spec, VARIANT, {}, "8.0", A, 2**30, 1, SETTINGS)["spec"]["template"]["spec"]
    vol = next(v for v in pod["volumes"] if "configMap" in v)
    assert vol["configMap"] == {"name": REFERENCES_CONFIGMAP, "optional": True}
    (init,) = pod["initContainers"]
    assert init["args"][init["args"].index("--referenced-keys") + 1] == f"{REFERENCES_MOUNT}/keys"
    assert {"name": vol["name"], "mountPath": REFERENCES_MOUNT, "readOnly": True} in init["volumeMounts"]
    assert all(m["name"] != vol["name"] for m in pod["containers"][0]["volumeMounts"])  # vLLM never sees it
    # The default (a pod-local copy) has no such volume.
    default = render_deployment(OWNER, SPEC, VARIANT, {}, "8.0", A, 2**30, 1, SETTINGS)["spec"]["template"]["spec"]
    assert not any("configMap" in v for v in default["volumes"])
