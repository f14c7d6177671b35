"""Time to serve: one replica more, from the scale decision to the new pod Ready, on the real control plane.

    python bench/bench_scaleup.py [--size-gib 1] [--warm 3] [--load-gbps 2.0]

Starts its own control plane (``e2e.cluster.Cluster``: kube-apiserver, controller-manager,
scheduler, kwok GPU nodes, MinIO, the pod runner as the kubelet), publishes one ~N GiB
multi-file artifact (the data ``bench/bench_fetch.py`` generates and caches), and creates the
serving Deployment exactly as the operator renders it (``render_deployment``) in two variants:

* ``Pod`` (today): every pod fetches the artifact into its own emptyDir;
* ``Node``: ``spec.serving.artifactCache: Node``, the node-local cache (docs/cache.md).

Each scale-up is a bump of the Deployment's scale subresource, as the autoscaler writes it. Nodes
are cordoned so that the new pod lands where the step wants it: on a *cold* node (nothing
cached) or on a *warm* node (one that already holds the verified artifact). Each pod's
milestones are observed by polling the API (50 ms) with the monotonic clock of this process:

    scheduling    scale written -> the pod bound to a node (ReplicaSet controller + scheduler)
    fetch         init container running -> terminated (a process: interpreter start, manifest
                  GET, download and verify, or the cache's check); the fetcher's own figure from
                  its termination message beside it
    engine start  vLLM container running -> Ready: **simulated** here (llm-d-inference-sim starts in
                  well under a second), plus a **modelled** weight-load time, bytes / --load-gbps
                  (default 2 GB/s, local NVMe into GPU memory); the model is the same for both
                  variants, so it shifts both totals equally and never favours one

Totals are measured time + the modelled load. The machine is shared (load average in the output):
compare the variants within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "crds", REPO / "runtime", REPO / "operator"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench.bench_fetch import ensure_data  # noqa: E402

NS = "bench"
SECRET = "s3-credentials"
POOL = "h100"
PRODUCT = "NVIDIA-H100-80GB-HBM3"
DEPLOYMENTS: dict[str, str] = {}


def render(c, key: str, total: int, mode: str) -> dict:
    from fewerbits_api.quantizedmodel import PlanVariant, QuantizedModelSpec
    from fewerbits_operator.serving.render import Owner, render_deployment
    from fewerbits_operator.base.settings import OperatorSettings

    spec = QuantizedModelSpec.model_validate({
        "source": {"uri": "hf://fewerbits-test/bench", "revision": "0" * 40},
        "storage": {"uri": "s3://bench-scaleup/artifacts", "endpoint": c.s3.endpoint, "credentialsSecret": SECRET},
        "serving": {"artifactCache": mode},
    })
    variant = PlanVariant(pool=f"{POOL}-{mode.lower()}", gpuProduct=PRODUCT, family="hopper", format="fp8-dynamic",
                          kvCacheDtype="fp8", dtype="bfloat16", tensorParallelSize=1, maxModelLen=4096,
                          weightsGiB=total / 2**30, kvCacheTokens=100000, decodeTokensPerSecond=100.0,
                          vllmArgs=["--max-model-len", "4096"])
    owner = Owner(f"scale-{mode.lower()}", NS, "00000000-0000-4000-8000-00000000000" + ("1" if mode == "Pod" else "2"))
    d = render_deployment(owner, spec, variant, {"fewerbits.io/bench-mode": mode}, "9.0", key, total, 0,
                          OperatorSettings())
    d["metadata"].pop("ownerReferences", None)
    return d


def cordon_all_but(core, nodes: list[str], keep: str) -> None:
    for n in nodes:
        core.patch_node(n, {"spec": {"unschedulable": n != keep}})


def observe(core, name: str, known: set[str], t0: float, timeout: float = 900) -> dict:
    """Poll until a pod of Deployment ``name`` that is not in ``known`` is Ready; its milestones."""
    seen: dict[str, float] = {}
    pod_name = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in core.list_namespaced_pod(NS, label_selector=f"fewerbits.io/model={name}").items:
            if p.metadata.name in known or p.metadata.deletion_timestamp:
                continue
            pod_name = p.metadata.name
            now = time.monotonic() - t0
            seen.setdefault("created", now)
            if p.spec.node_name:
                seen.setdefault("scheduled", now)
                seen.setdefault("node", p.spec.node_name)  # type: ignore[arg-type]
            st = p.status
            for ic in st.init_container_statuses or []:
                if ic.state.running or ic.state.terminated:
                    seen.setdefault("fetchStart", now)
                if ic.state.terminated:
                    seen.setdefault("fetchEnd", now)
                    if ic.state.terminated.exit_code != 0:
                        raise RuntimeError(f"fetch failed on {p.spec.node_name}: {ic.state.terminated.message}")
                    seen.setdefault("term", ic.state.terminated.message or "")  # type: ignore[arg-type]
            for cs in st.container_statuses or []:
                if cs.state.running:
                    seen.setdefault("engineStart", now)
            if any(x.type == "Ready" and x.status == "True" for x in st.conditions or []):
                seen.setdefault("ready", now)
                seen["pod"] = pod_name  # type: ignore[assignment]
                return seen
        time.sleep(0.05)
    raise TimeoutError(f"no new Ready pod of {name} after {timeout}s (seen {seen})")


def step(c, apps, core, name: str, nodes: list[str], node: str, replicas: int, total: int, load_gbps: float,
         label: str) -> dict:
    cordon_all_but(core, nodes, node)
    known = {p.metadata.name for p in core.list_namespaced_pod(NS, label_selector=f"fewerbits.io/model={name}").items}
    t0 = time.monotonic()
    apps.patch_namespaced_deployment_scale(DEPLOYMENTS[name], NS, {"spec": {"replicas": replicas}})
    s = observe(core, name, known, t0)
    term = json.loads(s.get("term") or "{}")
    modelled = total / (load_gbps * 1e9)
    row = {
        "variant": name, "node": s["node"], "kind": label,
        "scheduling": round(s["scheduled"], 3),
        "fetch": round(s["fetchEnd"] - s["fetchStart"], 3),
        "fetcherSeconds": round(float(term.get("seconds", 0.0)), 3),
        "fetchReason": term.get("reason"),
        "engineStartSimulated": round(s["ready"] - s["engineStart"], 3),
        "loadModelled": round(modelled, 3),
        "measured": round(s["ready"], 3),
        "total": round(s["ready"] + modelled, 3),
    }
    assert s["node"] == node, (s["node"], node)
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--warm", type=int, default=3, help="warm-node scale-ups per variant")
    ap.add_argument("--load-gbps", type=float, default=2.0, help="modelled weight load, GB/s (local disk -> GPU)")
    ap.add_argument("--keep", action="store_true", help="leave the state directory (logs) behind")
    a = ap.parse_args()

    from kubernetes import client

    from e2e import cluster as cluster_mod
    from e2e import demo, gpu
    from fewerbits_runtime.testing import publish_dir

    src, digests = ensure_data(a.size_gib)
    state = Path(tempfile.mkdtemp(prefix="bench-scaleup-"))
    c = cluster_mod.Cluster(state / "cluster", with_s3=True)
    c.start()
    rows: list[dict] = []
    try:
        print(f"control plane up in {c.timings['total']:.1f}s (state {state}); load average {os.getloadavg()}", flush=True)
        core = client.CoreV1Api(c.api_client())
        apps = client.AppsV1Api(c.api_client())
        nodes = {}
        for mode in ("Pod", "Node"):
            names = [f"{POOL}-{mode.lower()}-{i}" for i in range(2)]
            for n in names:
                core.create_node(gpu.node_manifest(n, gpu.lookup("h100"), extra_labels={"fewerbits.io/bench-mode": mode}))
            c.wait_nodes_ready(names)
            nodes[mode] = names
        demo.create_namespace_with_secret(c, NS, SECRET)
        s3 = c.s3.client()
        s3.create_bucket(Bucket="bench-scaleup")
        t = time.monotonic()
        m = publish_dir(s3, "s3://bench-scaleup/artifacts", src, name="bench-scaleup", digests=digests)
        total = m.totalBytes
        print(f"published {len(m.files)} files, {total / 2**30:.2f} GiB in {time.monotonic() - t:.1f}s", flush=True)
        for mode in ("Pod", "Node"):
            d = render(c, m.key, total, mode)
            DEPLOYMENTS[f"scale-{mode.lower()}"] = d["metadata"]["name"]
            c.apply(d)
        for mode in ("Pod", "Node"):
            name = f"scale-{mode.lower()}"
            n0, n1 = nodes[mode]
            r = 0
            # cold node, then warm scale-ups on it, then a second cold node.
            for node, kind, count in ((n0, "cold", 1), (n0, "warm", a.warm), (n1, "cold", 1)):
                for _ in range(count):
                    r += 1
                    rows.append(step(c, apps, core, name, nodes[mode], node, r, total, a.load_gbps, kind))
            apps.patch_namespaced_deployment_scale(DEPLOYMENTS[name], NS, {"spec": {"replicas": 0}})
    finally:
        c.stop()
        if not a.keep:
            shutil.rmtree(state, ignore_errors=True)

    def med(variant: str, kind: str, field: str) -> float:
        vals = [r[field] for r in rows if r["variant"] == variant and r["kind"] == kind]
        return statistics.median(vals) if vals else float("nan")

    print()
    print(f"artifact {total / 2**30:.2f} GiB, {len(m.files)} files; modelled load {a.load_gbps} GB/s; "
          f"load average at the end {os.getloadavg()[0]:.1f}; medians, seconds")
    print(f"{'variant':<22} {'scheduling':>10} {'fetch':>7} {'fetcher':>8} {'engine(sim)':>11} {'load(model)':>11} {'total':>7}")
    summary = {}
    for variant, label in (("scale-pod", "Pod (today)"), ("scale-node", "Node cache")):
        for kind in ("cold", "warm"):
            vals = {f: med(variant, kind, f) for f in ("scheduling", "fetch", "fetcherSeconds",
                                                       "engineStartSimulated", "loadModelled", "total")}
            summary[f"{variant}/{kind}"] = vals
            print(f"{label + ', ' + kind + ' node':<22} {vals['scheduling']:>10.2f} {vals['fetch']:>7.2f} "
                  f"{vals['fetcherSeconds']:>8.2f} {vals['engineStartSimulated']:>11.2f} {vals['loadModelled']:>11.2f} "
                  f"{vals['total']:>7.2f}")
    warm_fetch = summary["scale-node/warm"]["fetch"]
    cold_ratio = summary["scale-node/cold"]["fetch"] / summary["scale-pod/cold"]["fetch"]
    print(f"warm node, node cache: fetch {warm_fetch:.2f} s (goal < 1 s: {'MET' if warm_fetch < 1 else 'NOT MET'}); "
          f"cold node fetch, node cache / today: {cold_ratio:.2f}")
    print(json.dumps({"bytes": total, "summary": summary, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
