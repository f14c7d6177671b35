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
  runc and cgroupfs (images/containers.conf);
* the image pulled as a kubelet pulls it (`pull_needed`): by the container's `imagePullPolicy`
  (`Never` and absent: `ErrImageNeverPull`; `IfNotPresent`, a digest's default: only when absent;
  `Always`), then run with `--pull never`. A loopback registry is plain HTTP (`--tls-verify=false`).

Storage: by default the one scripts/images.sh builds into (its images are present, nothing is
pulled); with FEWERBITS_E2E_IMAGE_STORE=DIR a storage of its own in DIR, a node's, which holds only
what was pulled (the image-mode e2e pulls every image from the registry by digest into an empty one).

Pure functions decide (`security_args`, `run_argv`, `pull_needed`, `pull_argv`,
`read_only_violations`); `Podman` runs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
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


STORE_ENV = "FEWERBITS_E2E_IMAGE_STORE"
"""A podman storage of the runner's own (a node's): only pulled images are in it."""


def repository(image: str) -> str:
    """The reference without its tag or digest: `127.0.0.1:5000/a/b:1@sha256:..` -> `127.0.0.1:5000/a/b`
    (a colon before the last `/` is a registry's port, not a tag)."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    return name[:colon] if colon > slash else name


def is_image_workload(image: str) -> bool:
    repo = repository(image)
    return any(repo.endswith("/" + n) or repo == n for n in IMAGE_NAMES)


def pull_policy(image: str, policy: str | None) -> str:
    """The effective imagePullPolicy (the API server's default when the spec has none: `Always`
    for `:latest` or no tag, `IfNotPresent` for a tag or a digest)."""
    if policy:
        return policy
    tagged = "@" in image or repository(image) != image.split("@", 1)[0]
    latest = image.split("@", 1)[0].endswith(":latest")
    return "IfNotPresent" if tagged and not latest else "Always"


def pull_needed(image: str, policy: str | None, present: bool) -> bool:
    """Whether a kubelet pulls before it creates the container. `Never` with the image absent is
    the caller's ErrImageNeverPull."""
    effective = pull_policy(image, policy)
    return effective == "Always" or (effective == "IfNotPresent" and not present)


def registry_host(image: str) -> str:
    """The registry of a reference (`docker.io` when the first part is not a host)."""
    first, _, rest = image.partition("/")
    return first if rest and ("." in first or ":" in first or first == "localhost") else "docker.io"


def pull_argv(podman: list[str], image: str) -> list[str]:
    """`podman pull` of a reference; a loopback registry is plain HTTP (an insecure registry)."""
    insecure = re.sub(r":\d+$", "", registry_host(image)) in ("127.0.0.1", "localhost", "[::1]")
    return [*podman, "pull", "--quiet", *(["--tls-verify=false"] if insecure else []), image]


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


def store_flags(store: Path) -> tuple[str, ...]:
    """podman's storage flags for a storage in `store` (its runroot, on tmpfs, named after it)."""
    digest = hashlib.sha256(str(store).encode()).hexdigest()[:8]
    return ("--root", str(store / "storage"), "--runroot", f"/run/fewerbits-e2e-{digest}",
            "--storage-driver", "overlay")


@lru_cache(maxsize=1)
def podman_settings() -> tuple[tuple[str, ...], dict[str, str]]:
    """(podman global flags, env) of scripts/images.sh's storage: the images it built."""
    out = subprocess.run([str(IMAGES_SCRIPT), "--env"], check=True, capture_output=True, text=True).stdout
    env: dict[str, str] = {}
    for line in out.splitlines():
        m = re.fullmatch(r"export ([A-Z_]+)=(.*)", line)
        if m:
            env[m.group(1)] = shlex.split(m.group(2))[0] if m.group(2) else ""
    flags = tuple(shlex.split(env.pop("FEWERBITS_PODMAN_ARGS", "")))
    return flags, env


class Podman:
    """podman on scripts/images.sh's storage, or on the storage in `store` (a node's: only what it
    pulled; `Podman.for_runner()` takes it from FEWERBITS_E2E_IMAGE_STORE)."""

    def __init__(self, store: Path | None = None) -> None:
        flags, env = podman_settings()
        if store is not None:
            flags = store_flags(store)
        self.store = store
        self.argv = ["podman", *flags]
        self.env = {**os.environ, **env}
        self._pulls: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([*self.argv, *args], env=self.env, capture_output=True, text=True, check=check)

    def image_user(self, image: str) -> str | None:
        """The image's USER, or None when the image is not in the storage."""
        r = self.run("image", "inspect", "--format", "{{.Config.User}}", image, check=False)
        return r.stdout.strip() if r.returncode == 0 else None

    @classmethod
    def for_runner(cls) -> "Podman":
        store = os.environ.get(STORE_ENV)
        return cls(Path(store) if store else None)

    def pull(self, image: str) -> str:
        """Pull `image` (one pull per reference at a time, as a kubelet serializes them); "" on
        success, else podman's error."""
        with self._lock:
            lock = self._pulls.setdefault(image, threading.Lock())
        with lock:
            r = subprocess.run(pull_argv(self.argv, image), env=self.env, capture_output=True, text=True)
        return "" if r.returncode == 0 else (r.stderr.strip() or r.stdout.strip())[-500:]

    def image_id(self, image: str) -> str:
        r = self.run("image", "inspect", "--format", "{{.Id}}", image, check=False)
        return r.stdout.strip()

    def stop(self, name: str, grace: float) -> None:
        self.run("stop", "--ignore", "-t", str(max(0, int(grace))), name, check=False)
        self.run("rm", "-f", "--ignore", name, check=False)

    def digests(self) -> set[str]:
        """`repository@sha256:...` of every image in the storage, each of its names with each digest
        it is known by (an image pulled onto one already there keeps that one's digest too)."""
        ids = sorted(set(self.run("images", "--quiet", "--no-trunc", check=False).stdout.split()))
        if not ids:
            return set()
        r = self.run("image", "inspect", "--format", "{{range .RepoDigests}}{{println .}}{{end}}", *ids, check=False)
        return {line.strip() for line in r.stdout.splitlines() if "@sha256:" in line}

    def remove_store(self) -> None:
        """Remove this storage's containers, images and folders (a node's storage, never the build's)."""
        assert self.store is not None, "only a runner's own storage is removed"
        self.run("rm", "--all", "--force", check=False)
        self.run("rmi", "--all", "--force", check=False)
        flags = store_flags(self.store)
        for folder in (self.store, Path(flags[flags.index("--runroot") + 1])):
            shutil.rmtree(folder, ignore_errors=True)

    def remove_stale(self) -> None:
        """Remove containers of runners that are gone (a SIGKILLed test session leaves them)."""
        r = self.run("ps", "-a", "--filter", f"label={LABEL}", "--format", "{{.Names}} {{.Labels}}", check=False)
        for line in r.stdout.splitlines():
            name, _, labels = line.partition(" ")
            m = re.search(rf"{re.escape(LABEL)}:(\d+)", labels)
            if m and not Path(f"/proc/{m.group(1)}").exists():
                self.run("rm", "-f", "--ignore", name, check=False)


def load_check(path: Path):
    """A check script of images/ (run inside the images, standard library only, not a package module)
    loaded by path, for the tests that run its functions here."""
    spec = importlib.util.spec_from_file_location(path.stem + "_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
