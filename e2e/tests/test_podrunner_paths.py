"""The pod runner's path rewriting (the kubelet's stand-in for mounts): one pass over all mounts."""

from __future__ import annotations

from pathlib import Path

from e2e.podenv import PodEnvironment


def test_a_local_path_under_tmp_is_not_rewritten_again_by_the_tmp_mount():
    mounts = sorted([("/node-cache", Path("/tmp/e2e/pods/nodes/n0/var/lib/fewerbits/cache")),
                     ("/models", Path("/tmp/e2e/pods/p/volumes/models")),
                     ("/tmp", Path("/tmp/e2e/pods/p/volumes/tmp"))], key=lambda t: -len(t[0]))
    assert PodEnvironment.rewrite("/node-cache", mounts) == "/tmp/e2e/pods/nodes/n0/var/lib/fewerbits/cache"
    assert PodEnvironment.rewrite("--dest=/models/abc", mounts) == "--dest=/tmp/e2e/pods/p/volumes/models/abc"
    assert PodEnvironment.rewrite("/tmp/x /models", mounts) == "/tmp/e2e/pods/p/volumes/tmp/x /tmp/e2e/pods/p/volumes/models"
    assert PodEnvironment.rewrite("/tmpfoo /modelsx", mounts) == "/tmpfoo /modelsx"
