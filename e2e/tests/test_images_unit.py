"""The pod runner's image mode decides its podman command lines with pure functions (e2e/images.py):
checked here without podman. The run itself: test_images_e2e.py (marker `images`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from e2e import images

CHART_POD = {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
             "seccompProfile": {"type": "RuntimeDefault"}}
CHART_CONTAINER = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                   "capabilities": {"drop": ["ALL"]}}


def test_the_charts_security_context_becomes_podman_flags():
    args = images.security_args(CHART_POD, CHART_CONTAINER, "65532:65532")
    assert args == ["--user", "65532:65532", "--group-add", "65532", "--read-only", "--read-only-tmpfs=false",
                    "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]


def test_the_containers_fields_win_over_the_pods():
    args = images.security_args({"runAsUser": 1000, "runAsGroup": 1000}, {"runAsUser": 2000}, "")
    assert args[:2] == ["--user", "2000:1000"]


def test_no_security_context_leaves_the_images_user_and_a_writable_root():
    assert images.security_args(None, None, "65532:65532") == []


@pytest.mark.parametrize("pod, image_user, message", [
    ({"runAsNonRoot": True}, "", "image will run as root"),
    ({"runAsNonRoot": True}, "0:0", "image will run as root"),
    ({"runAsNonRoot": True}, "nobody", "non-numeric user (nobody)"),
    ({"runAsNonRoot": True, "runAsUser": 0}, "65532", "image will run as root"),
])
def test_run_as_non_root_is_checked_against_the_effective_user(pod, image_user, message):
    with pytest.raises(images.SecurityError, match=re.escape(message)):
        images.security_args(pod, None, image_user)


def test_run_argv_passes_env_by_name_only_and_mounts_read_only_where_asked():
    argv = images.run_argv(
        ["podman", "--root", "/s"], name="fb-x", image="ghcr.io/fewerbits/fewerbits-runtime:0.1.0",
        hostname="p", security=["--read-only"],
        mounts=[images.Mount(Path("/h/model"), "/model"), images.Mount(Path("/h/kc"), "/var/run/k", True)],
        env_names=["AWS_SECRET_ACCESS_KEY"], command=["python", "-m", "fewerbits_runtime"], args=["fetch", "--to", "/model"],
        labels={images.LABEL: "42"})
    assert argv[:3] == ["podman", "--root", "/s"]
    assert "--pull" in argv and argv[argv.index("--pull") + 1] == "never"
    assert argv[argv.index("-e") + 1] == "AWS_SECRET_ACCESS_KEY"  # a name; the value stays in podman's env
    assert "/h/model:/model" in argv and "/h/kc:/var/run/k:ro" in argv
    assert json.loads(argv[argv.index("--entrypoint") + 1]) == ["python", "-m", "fewerbits_runtime"]
    assert argv[-4:] == ["ghcr.io/fewerbits/fewerbits-runtime:0.1.0", "fetch", "--to", "/model"]


def test_no_command_keeps_the_images_entrypoint():
    argv = images.run_argv(["podman"], name="n", image="img:1", hostname="h", security=[], mounts=[],
                           env_names=[], command=[], args=["--x"], labels={})
    assert "--entrypoint" not in argv and argv[-2:] == ["img:1", "--x"]


@pytest.mark.parametrize("image, ours", [
    ("ghcr.io/fewerbits/fewerbits-operator:0.1.0", True),
    ("registry.example/team/fewerbits-quantjob@sha256:" + "0" * 64, True),
    ("fewerbits-runtime:dev", True),
    ("vllm/vllm-openai:v0.33.0", False),
    ("fewerbits-test/python", False),
    ("127.0.0.1:5000/fewerbits-operator@sha256:" + "0" * 64, True),
    ("127.0.0.1:5000/fewerbits-runtime:0.1.0", True),
    ("127.0.0.1:5000/vllm-openai:v1", False),
])
def test_which_images_run_from_podman(image, ours):
    assert images.is_image_workload(image) is ours


def test_read_only_violations_name_the_paths():
    log = ("Traceback (most recent call last):\n"
           "OSError: [Errno 30] Read-only file system: '/opt/fewerbits-app/stray.txt'\n"
           "sh: 1: cannot create /etc/x: Read-only file system\n"
           "PermissionError: [Errno 13] Permission denied: '/root/y'\n")
    assert images.read_only_violations(log) == ["/etc/x", "/opt/fewerbits-app/stray.txt"]
    assert images.read_only_violations("all fine\n") == []


def test_container_names_are_valid_and_distinct_per_restart():
    a = images.container_name("demo", "tiny-llama-server-abc", "fetch", "0123456789", 0)
    b = images.container_name("demo", "tiny-llama-server-abc", "fetch", "0123456789", 1)
    assert a != b and a.startswith("fb-demo-") and all(ch.isalnum() or ch in "_.-" for ch in a)


@pytest.mark.parametrize("image, repo", [
    ("127.0.0.1:5000/fewerbits-operator@sha256:" + "0" * 64, "127.0.0.1:5000/fewerbits-operator"),
    ("127.0.0.1:5000/a/b:1.0", "127.0.0.1:5000/a/b"),
    ("ghcr.io/fewerbits/fewerbits-runtime:0.1.0", "ghcr.io/fewerbits/fewerbits-runtime"),
    ("localhost:5000/x", "localhost:5000/x"),
    ("busybox", "busybox"),
])
def test_a_registry_port_is_not_a_tag(image, repo):
    assert images.repository(image) == repo


DIGEST_REF = "127.0.0.1:5000/fewerbits-quantjob@sha256:" + "0" * 64


@pytest.mark.parametrize("image, policy, present, pull", [
    (DIGEST_REF, None, False, True),            # a digest defaults to IfNotPresent: absent -> pull
    (DIGEST_REF, None, True, False),            # present -> no pull
    (DIGEST_REF, "Always", True, True),
    (DIGEST_REF, "Never", False, False),        # the caller's ErrImageNeverPull
    ("ghcr.io/fewerbits/fewerbits-runtime:0.1.0", None, True, False),
    ("ghcr.io/fewerbits/fewerbits-runtime:latest", None, True, True),   # :latest defaults to Always
    ("ghcr.io/fewerbits/fewerbits-runtime", None, True, True),          # no tag: latest
])
def test_pulls_follow_the_pull_policy_as_a_kubelet_does(image, policy, present, pull):
    assert images.pull_needed(image, policy, present) is pull


def test_a_loopback_registry_is_pulled_over_plain_http_and_no_other():
    assert images.pull_argv(["podman"], DIGEST_REF) == ["podman", "pull", "--quiet", "--tls-verify=false", DIGEST_REF]
    ref = "localhost:5000/fewerbits-runtime:0.1.0"
    assert "--tls-verify=false" in images.pull_argv(["podman"], ref)
    for ref in ("ghcr.io/fewerbits/fewerbits-runtime:0.1.0", "registry.example:5000/fewerbits-runtime:1",
                "fewerbits/fewerbits-runtime:1"):
        assert images.pull_argv(["podman"], ref) == ["podman", "pull", "--quiet", ref]


def test_a_store_of_its_own_has_its_own_runroot(tmp_path):
    a, b = images.store_flags(tmp_path / "a"), images.store_flags(tmp_path / "b")
    assert a[:2] == ("--root", str(tmp_path / "a" / "storage")) and a[3] != b[3]
