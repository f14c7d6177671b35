"""What `spec.serving.loadFormat` and `spec.serving.artifactCache` change in the serving pod."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fewerbits_api.names import DEST_MANIFEST_NAME
from fewerbits_api.quantizedmodel import QuantizedModelSpec
from fewerbits_operator.planner.vllm_args import check_vllm_args
from fewerbits_operator.serving.render import render_deployment
from tests.unit.test_render import OWNER, SETTINGS, SPEC, VARIANT

KEY = "f" * 64


def _pod(**serving):
    spec = SPEC.model_copy(update={"serving": SPEC.serving.model_copy(update=serving)})
    d = render_deployment(OWNER, spec, VARIANT, {}, "8.0", KEY, 5 * 2**30, 1, SETTINGS)
    return d["spec"]["template"]["spec"]


def test_default_is_a_verified_fetch_into_the_pods_own_volume():
    pod = _pod()
    assert pod["volumes"][0] == {"name": "models", "emptyDir": {"sizeLimit": "6400Mi"}}
    assert "--dest" in pod["initContainers"][0]["args"] and "--manifest-only" not in pod["initContainers"][0]["args"]
    assert "--load-format" not in pod["containers"][0]["command"]


def test_node_cache_mounts_the_nodes_copy_read_only():
    pod = _pod(artifactCache="Node")
    assert pod["volumes"][0] == {"name": "models", "hostPath": {"path": "/var/lib/fewerbits/cache",
                                                                "type": "DirectoryOrCreate"}}
    init = pod["initContainers"][0]
    assert init["args"][init["args"].index("--node-cache") + 1] == "/node-cache"
    assert {"name": "models", "mountPath": "/node-cache"} in init["volumeMounts"]
    assert {"name": "models", "mountPath": f"/models/{KEY}", "subPath": f"artifacts/{KEY}",
            "readOnly": True} in pod["containers"][0]["volumeMounts"]
    cmd = pod["containers"][0]["command"]
    assert cmd[cmd.index("--manifest") + 1] == f"/models/{KEY}/{DEST_MANIFEST_NAME}"


def test_stream_lets_vllm_read_s3_with_credentials_from_the_secret_only():
    pod = _pod(loadFormat="stream")
    cmd = pod["containers"][0]["command"]
    args = cmd[cmd.index("serve") + 1:]
    assert args[0] == f"s3://bkt/q/{KEY}/files/"
    assert args[args.index("--load-format") + 1] == "runai_streamer"
    assert check_vllm_args(args[1:]) == []
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "s3", "key": "AWS_SECRET_ACCESS_KEY"}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "s3"
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio.storage:9000"
    assert all("value" not in e for n, e in env.items() if "KEY" in n)
    assert "--manifest-only" in pod["initContainers"][0]["args"]


def test_stream_with_a_node_cache_is_refused_naming_the_field():
    raw = SPEC.model_dump(mode="json", exclude_none=True)
    raw["serving"] |= {"loadFormat": "stream", "artifactCache": "Node"}
    with pytest.raises(ValidationError) as e:
        QuantizedModelSpec.model_validate(raw)
    assert "artifactCache" in str(e.value)
    raw["serving"]["loadFormat"] = "fetc"
    with pytest.raises(ValidationError) as e:
        QuantizedModelSpec.model_validate(raw)
    assert "loadFormat" in str(e.value)
