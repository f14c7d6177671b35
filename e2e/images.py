"""The pod runner's image mode: a pod's containers run from the built images with podman.

`scripts/images.sh` builds the images into its own podman storage (under the cache); this module
asks it for those settings (`scripts/images.sh --env`, the one place they live) and turns a
container of a pod into a `podman run` command line, as a kubelet would run it:

* the pod's env (values are passed by name, `-e NAME`, from podman's environment: a Secret's value
  never appears in a command line), its volumes bind-mounted at their mount paths (read-only when
  the mount says so), the termination-message file at `terminationMessagePath`;
* its security context: `runAsUser`/`runAsGroup` (`--user`), `fsGroup`/`supplementalGroups`
  (`--group-add`), `runAsNonRoot` checked against the image's user, `readOnlyRootFilesystem`
  (`--read-only` and no tmpfs podman would add on its own: only the pod's volumes are writable),
  `capabilities` (`--cap-drop`/`--cap-add`), `allowPrivilegeEscalation: false`
  (`no-new-privileges`);
* the host network (pods talk to the API server and MinIO on 127.0.0.1 and bind their pod IPs),
  runc and cgroupfs (images/containers.conf), never a pull: an image that is not built is
  `ErrImageNeverPull`.

Pure functions decide (`security_args`, `run_argv`, `read_only_violations`); `Podman` runs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGES_SCRIPT = REPO / "scripts" / "images.sh"
LABEL = "fewerbits.e2e.runner"
"""Label on every container the runner starts: its value is the runner's pid (stale ones are removed)."""

# The images the runner runs from podman in image mode (by the repository part of the reference).
IMAGE_NAMES = ("fewerbits-operator", "fewerbits-quantjob", "fewerbits-runtime")
READ_ONLY = re.compile(r"\[Errno 30\] Read-only file system: '([^']+)'|"
                       r"(?:cannot create|can't create|touch: cannot touch) '?([^':]+)'?: Read-only file system")


class SecurityError(ValueError):
    """The security context cannot be honoured (runAsNonRoot with a root image user): a config error."""


def is_image_workload(image: str) -> bool:
    repo = image.split("@", 1)[0].rsplit(":", 1)[0] if "/" in image or ":" in image else image
    return any(repo.endswith("/" + n) or repo == n for n in IMAGE_NAMES)


def _merged(pod_sc: dict | None, c_sc: dict | None) -> dict:
    """The effective security context: the container's fields win over the pod's (as in Kubernetes)."""
    keys = ("runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile")
    pod_sc, c_sc = pod_sc or {}, c_sc or {}
    out = {k: pod_sc[k] for k in keys if k in pod_sc}
    out.update(c_sc)
    return out


def security_args(pod_sc: dict | None, container_sc: dict | None, image_user: str) -> list[str]:
    """podman flags for a container's security context. `image_user` is the image's USER ("" = root)."""
    sc = _merged(pod_sc, container_sc)
    pod_sc = pod_sc or {}
    args: list[str] = []
    uid, gid = sc.get("runAsUser"), sc.get("runAsGroup")
    if uid is not None:
        args += ["--user", f"{uid}:{gid}" if gid is not None else str(uid)]
    elif gid is not None:
        args += ["--user", f"{(image_user or '0').split(':')[0]}:{gid}"]
    if sc.get("runAsNonRoot"):
        effective = str(uid) if uid is not None else (image_user or "0").split(":")[0]
        if not effective.isdigit():
            raise SecurityError(f"container has runAsNonRoot and image has non-numeric user ({effective}), "
                                "cannot verify user is non-root")
        if int(effective) == 0:
            raise SecurityError("container has runAsNonRoot and image will run as root")
    for g in [pod_sc.get("fsGroup"), *(pod_sc.get("supplementalGroups") or [])]:
        if g is not None:
            args += ["--group-add", str(g)]
    if sc.get("privileged"):
        args.append("--privileged")
    if sc.get("readOnlyRootFilesystem"):
        args += ["--read-only", "--read-only-tmpfs=false"]
    caps = sc.get("capabilities") or {}
    for cap in caps.get("drop") or []:
        args += ["--cap-drop", cap]
    for cap in caps.get("add") or []:
        args += ["--cap-add", cap]
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        args += ["--security-opt", "seccomp=unconfined"]
    return args


@dataclass(frozen=True)
class Mount:
    host: Path
    path: str
    read_only: bool = False


def container_name(ns: str, pod: str, container: str, uid: str, restart: int) -> str:
    raw = f"fb-{ns}-{pod}-{container}-{uid[:8]}-{restart}"
    return re.sub(r"[^a-zA-Z0-9_.-]", "-", raw)[-120:].lstrip("-_.") or "fb"


def run_argv(podman: list[str], *, name: str, image: str, hostname: str, security: list[str],
             mounts: list[Mount], env_names: list[str], command: list[str], args: list[str],
             labels: dict[str, str]) -> list[str]:
    """The `podman run` command line (env values come from podman's own environment, by name)."""
    argv = [*podman, "run", "--rm", "--name", name, "--pull", "never", "--network", "host",
            "--hostname", hostname, "--init=false", "--sig-proxy=true", *security]
    for k, v in sorted(labels.items()):
        argv += ["--label", f"{k}={v}"]
    for m in mounts:
        argv += ["-v", f"{m.host}:{m.path}" + (":ro" if m.read_only else "")]
    for k in env_names:
        argv += ["-e", k]
    if command:
        argv += ["--entrypoint", json.dumps(command)]
    argv.append(image)
    return argv + list(args)


def read_only_violations(text: str) -> list[str]:
    """Paths a container failed to write because the root filesystem is read-only (from its log)."""
    return sorted({m.group(1) or m.group(2) for m in READ_ONLY.finditer(text)})


@lru_cache(maxsize=1)
def podman_settings() -> tuple[tuple[str, ...], dict[str, str]]:
    """(podman global flags, env) of scripts/images.sh's storage: the same images it built."""
    out = subprocess.run([str(IMAGES_SCRIPT), "--env"], check=True, capture_output=True, text=True).stdout
    env: dict[str, str] = {}
    for line in out.splitlines():
        m = re.fullmatch(r"export ([A-Z_]+)=(.*)", line)
        if m:
            env[m.group(1)] = shlex.split(m.group(2))[0] if m.group(2) else ""
    flags = tuple(shlex.split(env.pop("FEWERBITS_PODMAN_ARGS", "")))
    return flags, env


class Podman:
    def __init__(self) -> None:
        flags, env = podman_settings()
        self.argv = ["podman", *flags]
        self.env = {**os.environ, **env}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([*self.argv, *args], env=self.env, capture_output=True, text=True, check=check)

    def image_user(self, image: str) -> str | None:
        """The image's USER, or None when the image is not in the storage."""
        r = self.run("image", "inspect", "--format", "{{.Config.User}}", image, check=False)
        return r.stdout.strip() if r.returncode == 0 else None

    def image_id(self, image: str) -> str:
        r = self.run("image", "inspect", "--format", "{{.Id}}", image, check=False)
        return r.stdout.strip()

    def stop(self, name: str, grace: float) -> None:
        self.run("stop", "--ignore", "-t", str(max(0, int(grace))), name, check=False)
        self.run("rm", "-f", "--ignore", name, check=False)

    def remove_stale(self) -> None:
        """Remove containers of runners that are gone (a SIGKILLed test session leaves them)."""
        r = self.run("ps", "-a", "--filter", f"label={LABEL}", "--format", "{{.Names}} {{.Labels}}", check=False)
        for line in r.stdout.splitlines():
            name, _, labels = line.partition(" ")
            m = re.search(rf"{re.escape(LABEL)}:(\d+)", labels)
            if m and not Path(f"/proc/{m.group(1)}").exists():
                self.run("rm", "-f", "--ignore", name, check=False)
