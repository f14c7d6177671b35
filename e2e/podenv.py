"""What a kubelet materialises for a pod before any process starts: the containers' environment and
the pod's volumes, resolved through the API.

Environment: secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef, envFrom, $(VAR) expansion,
the runner's own pass-through variables and a test's per-image overrides. Volumes: emptyDir and
projected volumes as folders of the pod, hostPath as one folder per (fake) node, claims as one folder
per claim, Secrets and ConfigMaps written out; a container's mount paths are rewritten to those
folders in its env and args (`rewrite`). A missing Secret/ConfigMap key raises ConfigError, which the
lifecycle (e2e/podrunner.py) reports as CreateContainerConfigError and retries, as a kubelet does.

Nothing here starts or watches a process: that is e2e/podrunner.py's part.
"""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path

TERMINATION_LOG_ENV = "FEWERBITS_TERMINATION_LOG"
ENV_OVERRIDES = "env-overrides.json"
"""In the runner's state dir: {image substring: {NAME: value}}, extra env for matching containers."""
PASS_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH", "TZ", "FEWERBITS_CPU_CAPABILITY")
"""FEWERBITS_CPU_CAPABILITY: the CPU level vLLM's CPU build acts on (e2e/vllm_cpu.py); a pod's own env wins."""
PASS_ENV_PREFIXES = ("HF_", "TRANSFORMERS_", "TORCH", "OMP_", "MKL_")


class ConfigError(Exception):
    """The container cannot be created yet (missing Secret/ConfigMap key): CreateContainerConfigError."""

    reason = "CreateContainerConfigError"


class ImageNotPresent(ConfigError):
    """Image mode: the image is not in the local storage and is never pulled."""

    reason = "ErrImageNeverPull"


class ImagePullFailed(ConfigError):
    """Image mode: the pull the pull policy asked for failed (retried, as a kubelet backs off)."""

    reason = "ErrImagePull"


class PodEnvironment:
    """One pod's environment and volumes. `api` is a CoreV1Api; `pod_dir` the pod's own folder under
    the runner's `state_dir`; `server`/`ca_file` the API server a ServiceAccount kubeconfig names."""

    def __init__(self, api, pod: dict, ip: str, pod_dir: Path, state_dir: Path, mode: str, server: str,
                 ca_file: str):
        self.api = api
        self.pod = pod
        md = pod["metadata"]
        self.ns, self.name, self.uid = md["namespace"], md["name"], md["uid"]
        self.ip = ip
        self.dir = pod_dir
        self.state_dir = state_dir
        self.mode = mode
        self.server = server
        self.ca_file = ca_file

    def lookup(self, kind: str, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            fn = self.api.read_namespaced_secret if kind == "Secret" else self.api.read_namespaced_config_map
            obj = fn(name, self.ns, _preload_content=False)
            return json.loads(obj.data)
        except ApiException as e:
            if e.status == 404:
                return None
            if e.status >= 500:  # the API server restarting: retried, as a kubelet does
                raise ConfigError(f"{kind.lower()} {name}: {e.reason}") from e
            raise
        except HTTPError as e:  # unreachable (restarting): retried, as a kubelet does
            raise ConfigError(f"{kind.lower()} {name}: API server unreachable ({type(e).__name__})") from e

    def key(self, kind: str, ref: dict) -> str | None:
        obj = self.lookup(kind, ref["name"])
        optional = ref.get("optional", False)
        if obj is None:
            if optional:
                return None
            raise ConfigError(f'{kind.lower()} "{ref["name"]}" not found')
        data = obj.get("data") or {}
        if ref["key"] in data:
            v = data[ref["key"]]
            return base64.b64decode(v).decode() if kind == "Secret" else v
        if kind == "ConfigMap" and ref["key"] in (obj.get("binaryData") or {}):
            return base64.b64decode(obj["binaryData"][ref["key"]]).decode(errors="replace")
        if optional:
            return None
        raise ConfigError(f'couldn\'t find key {ref["key"]} in {kind} {self.ns}/{ref["name"]}')

    def field(self, path: str) -> str:
        md, spec = self.pod["metadata"], self.pod["spec"]
        simple = {"metadata.name": md["name"], "metadata.namespace": self.ns, "metadata.uid": self.uid,
                  "spec.nodeName": spec.get("nodeName", ""), "spec.serviceAccountName": spec.get("serviceAccountName", ""),
                  "status.podIP": self.ip, "status.podIPs": self.ip, "status.hostIP": "127.0.0.1",
                  "status.hostIPs": "127.0.0.1"}
        if path in simple:
            return simple[path]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return (md.get(m.group(1)) or {}).get(m.group(2), "")
        raise ConfigError(f"unsupported fieldRef {path}")

    def resource(self, spec: dict, ref: dict) -> str:
        kind, _, res = ref["resource"].partition(".")
        val = ((spec.get("resources") or {}).get(kind) or {}).get(res)
        return str(val) if val is not None else "0"

    def env(self, spec: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        for src in spec.get("envFrom") or []:
            prefix = src.get("prefix", "")
            for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if key in src:
                    obj = self.lookup(kind, src[key]["name"])
                    if obj is None:
                        if src[key].get("optional"):
                            continue
                        raise ConfigError(f'{kind.lower()} "{src[key]["name"]}" not found')
                    for k, v in (obj.get("data") or {}).items():
                        env[prefix + k] = base64.b64decode(v).decode() if kind == "Secret" else v
        for e in spec.get("env") or []:
            if "valueFrom" in e:
                vf = e["valueFrom"]
                if "secretKeyRef" in vf:
                    v = self.key("Secret", vf["secretKeyRef"])
                elif "configMapKeyRef" in vf:
                    v = self.key("ConfigMap", vf["configMapKeyRef"])
                elif "fieldRef" in vf:
                    v = self.field(vf["fieldRef"]["fieldPath"])
                elif "resourceFieldRef" in vf:
                    v = self.resource(spec, vf["resourceFieldRef"])
                else:
                    raise ConfigError(f"unsupported valueFrom in env {e['name']}")
                if v is None:
                    continue
            else:
                v = expand(e.get("value", ""), env)
            env[e["name"]] = v
        return env

    def volumes(self) -> dict[str, Path]:
        vols: dict[str, Path] = {}
        root = self.dir / "volumes"
        for v in self.pod["spec"].get("volumes") or []:
            name = v["name"]
            if "hostPath" in v:
                # One folder per (fake) node and host path, for the cluster's lifetime: the stand-in
                # for a node's disk, so pods on the same node share it and pods elsewhere do not.
                node = self.pod["spec"].get("nodeName") or "_unbound"
                p = self.state_dir / "nodes" / node / v["hostPath"]["path"].lstrip("/")
                p.mkdir(parents=True, exist_ok=True)
                vols[name] = p
                continue
            if "persistentVolumeClaim" in v:
                # Claims outlive pods: one folder per claim for the cluster's lifetime.
                p = self.state_dir / "pvc" / f"{self.ns}_{v['persistentVolumeClaim']['claimName']}"
            else:
                p = root / name
            p.mkdir(parents=True, exist_ok=True)
            if self.mode == "image" and ("emptyDir" in v or "persistentVolumeClaim" in v):
                p.chmod(0o777)  # as a kubelet makes an emptyDir: the container's non-root user writes it
            if "projected" in v:
                self.project(v["projected"], p)
            for kind, key in (("Secret", "secret"), ("ConfigMap", "configMap")):
                if key in v:
                    ref = v[key]
                    obj = self.lookup(kind, ref.get("secretName") or ref.get("name"))
                    if obj is None:
                        if ref.get("optional"):
                            continue
                        raise ConfigError(f"{kind.lower()} {ref.get('secretName') or ref.get('name')} not found")
                    data = obj.get("data") or {}
                    items = ref.get("items") or [{"key": k, "path": k} for k in data]
                    for it in items:
                        if it["key"] not in data:
                            continue
                        raw = data[it["key"]]
                        f = p / it["path"]
                        f.parent.mkdir(parents=True, exist_ok=True)
                        f.write_bytes(base64.b64decode(raw) if kind == "Secret" else raw.encode())
            vols[name] = p
        return vols

    def project(self, projected: dict, into: Path) -> None:
        """Materialise a projected volume (what the ServiceAccount admission plugin adds as
        kube-api-access-*): a bound service-account token, the root CA ConfigMap, downward API."""
        for src in projected.get("sources") or []:
            if "serviceAccountToken" in src:
                t = src["serviceAccountToken"]
                token = self.token(t.get("expirationSeconds", 3607), t.get("audience"))
                (into / t["path"]).write_text(token)
            elif "configMap" in src or "secret" in src:
                kind, ref = ("ConfigMap", src["configMap"]) if "configMap" in src else ("Secret", src["secret"])
                obj = self.lookup(kind, ref["name"])
                if obj is None:
                    if ref.get("optional"):
                        continue
                    raise ConfigError(f"{kind.lower()} {ref['name']} not found")
                data = obj.get("data") or {}
                for it in ref.get("items") or [{"key": k, "path": k} for k in data]:
                    if it["key"] in data:
                        raw = data[it["key"]]
                        f = into / it["path"]
                        f.parent.mkdir(parents=True, exist_ok=True)
                        f.write_bytes(base64.b64decode(raw) if kind == "Secret" else raw.encode())
            elif "downwardAPI" in src:
                for it in src["downwardAPI"].get("items") or []:
                    if "fieldRef" in it:
                        (into / it["path"]).write_text(self.field(it["fieldRef"]["fieldPath"]))

    def token(self, seconds: int = 86400, audience: str | None = None) -> str:
        """A token for the pod's ServiceAccount, bound to this pod (TokenRequest, as a kubelet does)."""
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        spec = {"expirationSeconds": max(int(seconds), 86400),
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid}}
        if audience:
            spec["audiences"] = [audience]
        return self.api.create_namespaced_service_account_token(sa, self.ns, {"spec": spec}).status.token

    def service_account_kubeconfig(self, embed_ca: bool = False) -> Path | None:
        """A kubeconfig with the pod's ServiceAccount token, so a local process talks to the API server
        as that ServiceAccount (its RBAC applies). In-cluster config reads fixed paths under
        /var/run/secrets, which a local process cannot have; KUBECONFIG is the standard fallback."""
        spec = self.pod["spec"]
        if spec.get("automountServiceAccountToken") is False:
            return None
        path = self.dir / ("serviceaccount.image.kubeconfig" if embed_ca else "serviceaccount.kubeconfig")
        if not path.exists():
            # A container cannot read the host's CA file: its kubeconfig carries the CA itself.
            ca = ({"certificate-authority-data": base64.b64encode(Path(self.ca_file).read_bytes()).decode()}
                  if embed_ca else {"certificate-authority": self.ca_file})
            cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "sa",
                   "clusters": [{"name": "e2e", "cluster": {"server": self.server, **ca}}],
                   "users": [{"name": "sa", "user": {"token": self.token()}}],
                   "contexts": [{"name": "sa", "context": {"cluster": "e2e", "user": "sa", "namespace": self.ns}}]}
            path.write_text(json.dumps(cfg, indent=1))
            if embed_ca:
                path.chmod(0o644)  # the container's user reads it (the pod's own token, as a kubelet mounts it)
        return path

    def mounts(self, spec: dict, vols: dict[str, Path]) -> list[tuple[str, Path]]:
        out = []
        for m in spec.get("volumeMounts") or []:
            if m["name"] not in vols:
                continue
            local = vols[m["name"]] / m["subPath"] if m.get("subPath") else vols[m["name"]]
            local.mkdir(parents=True, exist_ok=True)
            out.append((m["mountPath"].rstrip("/") or "/", local))
        return sorted(out, key=lambda t: -len(t[0]))

    @staticmethod
    def rewrite(s: str, mounts: list[tuple[str, Path]]) -> str:
        # One pass over all mounts (longest first): a local path that replaced one mount path
        # (e.g. under /tmp) is never rewritten again by another mount (e.g. /tmp).
        table = {mount: str(local) for mount, local in mounts if mount != "/"}
        if not table:
            return s
        alts = "|".join(re.escape(m) for m in sorted(table, key=len, reverse=True))
        return re.sub(rf"(?<![\w./-])({alts})(?=/|$|[^\w.-])", lambda m: table[m.group(1)], s)

    def env_overrides(self, spec: dict) -> dict[str, str]:
        """Extra environment a test asked for, for containers of one image (`Cluster.set_container_env`):
        debug hooks such as the quantjob's upload pause. Read at each container start, so a test
        can set and clear it while the cluster runs; the operator's objects are never changed."""
        try:
            table = json.loads((self.state_dir / ENV_OVERRIDES).read_text())
        except (FileNotFoundError, ValueError):
            return {}
        image = spec.get("image") or ""
        out: dict[str, str] = {}
        for match, extra in table.items():
            if match in image:
                out.update({str(k): str(v) for k, v in extra.items()})
        return out

    def process_env(self, spec: dict, env_pod: dict[str, str], mounts: list[tuple[str, Path]],
                    term: Path) -> dict[str, str]:
        """A local process's environment: what the runner passes through (PATH, HOME, HF_*, ... and
        $FEWERBITS_E2E_PASS_ENV), the pod's env with mount paths rewritten, a test's overrides, the
        termination-message file and the pod's identity."""
        env = {k: v for k, v in os.environ.items() if k in PASS_ENV or k.startswith(PASS_ENV_PREFIXES)}
        for k in filter(None, os.environ.get("FEWERBITS_E2E_PASS_ENV", "").split(",")):
            if k in os.environ:
                env[k] = os.environ[k]
        env.update({k: self.rewrite(v, mounts) for k, v in env_pod.items()})
        env.update(self.env_overrides(spec))
        env.update({TERMINATION_LOG_ENV: str(term), "POD_IP": self.ip, "POD_NAME": self.name,
                    "POD_NAMESPACE": self.ns, "HOSTNAME": self.name})
        return env


def expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: defined variables are replaced, $$ escapes, others stay."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, s)
