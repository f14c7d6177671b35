"""The serving canary evaluation: the quality gate measured through a canary pod's OpenAI API.

    python -m fewerbits_quantjob canary      # contract from FEWERBITS_CANARY_CONTRACT (JSON)

The quantization Job judged the weights in transformers with a 16-bit KV cache. This measures
what users get instead: the served configuration (its kernels, its KV-cache dtype), through
``POST <endpoint>/v1/completions``, and compares it with the base model's scores the Job measured
(``<key>/quality/<identity>.json`` for the gate's evaluation identity, else the manifest's
report when it was measured under that identity; none at all is an error: fail closed).

Parts, each with the Job's own code (docs/quality.md, "Through the serving API", says why each
equals the Job's measurement):

* **perplexity** — the Job's held-out windows (``textdata.load_texts``, ``evaluate.window_length``
  and ``evaluate.build_windows`` with the artifact's own tokenizer and config), each sent as a
  token-id prompt with vLLM's ``prompt_logprobs: 0`` and ``max_tokens: 1``; the log-probability of
  every window token after the first, summed, is the Job's per-window NLL. A server that offers no
  prompt logprobs (``transformers serve``) gets the metric skipped with the reason.
* **custom set and generation benchmarks** — ``lmeval.prepare`` and ``lmeval.score_lm`` (the Job's
  task configs, metrics, seeds, limits and few-shot counts) on lm-eval's ``local-completions``
  API model: greedy, ``seed`` BENCHMARK_SEED, the custom set's ``maxNewTokens`` and stop at a
  newline. Token-id prompts when the server takes them (vLLM), else text.
* **loglikelihood-style tasks** (multiple choice, the custom ``perplexity`` metric) need prompt
  logprobs (lm-eval sends ``echo`` + ``logprobs``): run on a server that offers them, else skipped.

Bounded: at most ``limits.maxRequests`` requests in all (one capability probe, then the parts'
documents dealt round robin, see :func:`split_budget`), ``limits.concurrency`` in flight, each
with ``limits.requestTimeoutSeconds``. A timeout, a refused connection or a 5xx is an ``error``
(no verdict, no traffic), never a skipped document.

Out: a ``ServingQualityResult`` at ``<key>/serving/<configHash>.json`` (one PUT: never half
written) and a ``CanaryTermination`` in the termination log. Exit 0 for a verdict (passed or
failed), 1 for an error, 2 for a contract that does not parse.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from pydantic import ValidationError

from fewerbits_api.adapters import AdapterEvaluation, AdapterQuality
from fewerbits_api.artifact import FILES_DIR, QualityReport, artifact_prefix
from fewerbits_api.canary import (
    CANARY_CONTRACT_ENV,
    CanaryContract,
    CanaryTermination,
    ServingMetric,
    ServingQualityResult,
    SkippedMetric,
    serving_result_key,
)
from fewerbits_api.datasets import EVALUATION_SPLITS
from fewerbits_api.endpoints import EndpointRefused, allow_private_from_env, guard_endpoint
from fewerbits_api.names import TERMINATION_LOG_DEFAULT, TERMINATION_LOG_ENV
from fewerbits_api.quality import MetricResult, base_eval_identity, eval_identity, quality_result_key
from fewerbits_api.s3errors import S3ErrorKind, classify_s3_error

from .errors import EXIT_FAILED, EXIT_OK, EXIT_PERMANENT, JobError
from .report import configure_logging, log, one_line, redact, secret_values, termination_message

COMMAND = "canary"
"""``python -m fewerbits_quantjob canary``."""

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".npz", ".ckpt", ".onnx")
"""Artifact files the evaluation never downloads: it needs the tokenizer and config only."""

PROBE_TOKEN_IDS = [0, 1, 2, 3]
"""The capability probe's prompt: token ids every vocabulary has (what they mean does not matter:
only whether the server answers with a log-probability for each)."""

GENERATE = "generate_until"
LOGPROB_TYPES = ("loglikelihood", "multiple_choice")


class CanaryError(Exception):
    """No verdict: the evaluation could not be done (fail closed). The message names the cause."""


# ------------------------------------------------------------------------------------ pure parts
@dataclass
class Part:
    """One part of the gate: its result name, how it is measured, and the requests each of its
    documents costs (in order: the first documents are the ones the Job scored first)."""

    name: str
    kind: str
    costs: list[int]
    method: str = ""


def split_budget(parts: list[Part], budget: int) -> dict[str, int]:
    """Documents per part within ``budget`` requests: one document of each part in turn (in the
    parts' order), while the next one's requests still fit; a part whose next document does not
    fit stops there, the others go on. Every part gets its first documents before any gets many,
    and the sum of the requests never exceeds the budget."""
    taken = {p.name: 0 for p in parts}
    left = budget
    active = [p for p in parts if p.costs]
    while active and left > 0:
        still = []
        for p in active:
            i = taken[p.name]
            if i < len(p.costs) and p.costs[i] <= left:
                left -= p.costs[i]
                taken[p.name] = i + 1
                if i + 1 < len(p.costs):
                    still.append(p)
        active = still
    return taken


def plan_task(name: str, kind: str, output_type: str, costs: list[int], logprobs: bool, how: str) -> Part | SkippedMetric:
    """A benchmark or the custom set as a part of the evaluation, or skipped with the reason:
    generation always; loglikelihood-style tasks only when the server offers logprobs (lm-eval
    sends ``echo`` + ``logprobs``); rolling loglikelihood never (unbounded requests per document)."""
    if output_type == GENERATE:
        return Part(name, kind, costs, "lm-eval local-completions")
    if output_type in LOGPROB_TYPES and logprobs:
        return Part(name, kind, costs, "lm-eval local-completions (echo logprobs)")
    if output_type in LOGPROB_TYPES:
        return SkippedMetric(name=name, reason=f"{output_type} needs logprobs: {how}")
    return SkippedMetric(name=name, reason=f"{output_type or 'this'} task type is not evaluated through the "
                         "serving API (unbounded requests per document)")


def window_nll(response: Mapping, window: list[int]) -> float:
    """Summed negative log-likelihood of ``window[1:]`` from a vLLM completion answered with
    ``prompt_logprobs``: ``choices[0].prompt_logprobs`` holds one entry per prompt token, ``null``
    for the first, then ``{"<token id>": {"logprob": x, "rank": r, "decoded_token": s}, ...}``
    with the prompt token itself always present (plus the top-k others when k > 0)."""
    choices = response.get("choices") or []
    rows = choices[0].get("prompt_logprobs") if choices and isinstance(choices[0], Mapping) else None
    if not isinstance(rows, list):
        raise CanaryError("the answer has no choices[0].prompt_logprobs list")
    if len(rows) != len(window):
        raise CanaryError(f"prompt_logprobs has {len(rows)} entries for a {len(window)}-token window")
    total = 0.0
    for i in range(1, len(window)):
        row = rows[i]
        entry = row.get(str(window[i])) if isinstance(row, Mapping) else None
        value = entry.get("logprob") if isinstance(entry, Mapping) else entry
        if not isinstance(value, (int, float)) or math.isnan(value):
            raise CanaryError(f"prompt_logprobs[{i}] has no log-probability for prompt token {window[i]}")
        total -= float(value)
    return total


def serving_metric(m: MetricResult, job: MetricResult | None, method: str) -> ServingMetric:
    """A judged metric (``quantized`` holds the served score) as the result records it."""
    return ServingMetric(name=m.name, kind=m.kind, base=m.base, jobQuantized=job.quantized if job else None,
                         served=m.quantized, recoveryPercent=m.recoveryPercent,
                         minRecoveryPercent=m.minRecoveryPercent, passed=m.passed, higherIsBetter=m.higherIsBetter,
                         samples=m.samples, method=method)


def metric_figures(m: ServingMetric) -> str:
    """``custom:contains 61.0% of base (min 95%)``; perplexity in its increase form."""
    if m.kind in ("perplexity", "adapter"):
        increase = (m.served / m.base - 1.0) * 100.0 if m.base else float("inf")
        allowed = (100.0 / m.minRecoveryPercent - 1.0) * 100.0
        if m.kind == "adapter":
            return (f"adapter {m.name.split(':', 1)[1]}: perplexity {m.served:.4g} served vs {m.base:.4g} with it on "
                    f"the 16-bit base ({increase:+.2f}%, max +{allowed:.3g}%)")
        return f"perplexity {m.served:.4g} vs base {m.base:.4g} ({increase:+.1f}%, max +{allowed:.3g}%)"
    return f"{m.name} {m.recoveryPercent:.1f}% of base (min {m.minRecoveryPercent:g}%; served {m.served:.4g}, " \
           f"base {m.base:.4g})"


def verdict(metrics: list[ServingMetric], skipped: list[SkippedMetric], kv_cache_dtype: str) -> tuple[bool, str]:
    """Passed only when at least one metric was measured and every measured one passed; the
    reason names the worst failing metric (the largest shortfall below its threshold) with its
    figures, and the KV-cache dtype."""
    kv = f"with KV cache {kv_cache_dtype}"
    failing = sorted((m for m in metrics if not m.passed), key=lambda m: m.recoveryPercent - m.minRecoveryPercent)
    if failing:
        more = f" (and {len(failing) - 1} more failing)" if len(failing) > 1 else ""
        return False, f"{metric_figures(failing[0])} {kv}{more}"
    if not any(m.kind != "adapter" for m in metrics):  # the adapters' figures never stand for the base's
        why = "; ".join(f"{s.name}: {s.reason}" for s in skipped) or "the gate asks for nothing"
        return False, f"nothing could be measured of the base through the serving API {kv} ({why})"
    worst = min(metrics, key=lambda m: m.recoveryPercent - m.minRecoveryPercent)
    note = f"; skipped {', '.join(s.name for s in skipped)}" if skipped else ""
    return True, f"{len(metrics)} metric(s) passed {kv} (closest: {worst.name} {worst.recoveryPercent:.1f}% of " \
                 f"base, min {worst.minRecoveryPercent:.3g}%){note}"


# ------------------------------------------------------------------------------------------- HTTP
class Server:
    """The canary's ``/v1/completions``: every request counted, bounded by the timeout; a refused
    connection, a timeout or a 5xx raises CanaryError naming the endpoint and the cause."""

    def __init__(self, endpoint: str, model: str, timeout: float):
        self.endpoint, self.model, self.timeout = endpoint.rstrip("/"), model, timeout
        self.url = f"{self.endpoint}/v1/completions"
        self.requests = 0
        self.server = ""
        self._lock = threading.Lock()

    def count(self) -> None:
        with self._lock:
            self.requests += 1

    def post(self, payload: dict, model: str | None = None) -> tuple[int, dict]:
        """One completion request for the served model, or for ``model`` (a LoRA adapter's name)."""
        import requests

        self.count()
        try:
            r = requests.post(self.url, json={"model": model or self.model, **payload}, timeout=self.timeout)
        except requests.exceptions.Timeout:
            raise CanaryError(f"{self.url}: no answer within {self.timeout:g}s (limits.requestTimeoutSeconds)") \
                from None
        except requests.exceptions.RequestException as e:
            raise CanaryError(f"{self.url}: cannot connect ({_cause(e)})") from None
        if not self.server:
            self.server = r.headers.get("server", "")
        if r.status_code >= 500 or r.status_code == 404:
            raise CanaryError(f"{self.url}: HTTP {r.status_code} ({one_line(r.text, 300)})")
        try:
            body = r.json()
        except ValueError:
            body = {"text": one_line(r.text, 300)}
        return r.status_code, body if isinstance(body, dict) else {"body": body}


def _cause(e: BaseException) -> str:
    """The innermost reason of a connection error (e.g. 'Connection refused'), one line."""
    text = str(e)
    for marker in ("Errno", "Connection refused", "Name or service not known", "timed out"):
        i = text.find(marker)
        if i >= 0:
            return one_line(text[max(0, i - 1):].strip("[( )]'\""), 200)
    return one_line(f"{type(e).__name__}: {text}", 200)


def probe(server: Server, token_ids: list[int]) -> tuple[bool, str]:
    """(prompt logprobs offered, detail): one token-id prompt asking for prompt logprobs. vLLM
    answers with ``prompt_logprobs``; a server that refuses the field or token-id prompts (4xx) or
    ignores it offers none."""
    status, body = server.post({"prompt": token_ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
    if status >= 400:
        detail = one_line(str(body.get("detail") or body.get("error") or body), 160)
        return False, f"the server refused prompt_logprobs (HTTP {status}: {detail})"
    try:
        window_nll(body, token_ids)
    except CanaryError as e:
        return False, f"the server answered without prompt logprobs ({e})"
    return True, "prompt_logprobs"


# ------------------------------------------------------------------------------------ base scores
def base_report(client, contract: CanaryContract):
    """(the Job's report measured under the contract gate's evaluation identity, where it came
    from, the manifest); CanaryError when there is none (fail closed). A 16-bit variant
    (``scoresKey``) takes the figures of a quantized artifact of the same model: its 16-bit base's
    are what the served model is judged against, and they are also what the Job would measure of it."""
    from . import storage

    bucket, prefix = artifact_prefix(contract.storage.uri, contract.key)
    manifest, why = storage.read_manifest(client, contract.storage.uri, contract.key)
    if manifest is None:
        raise CanaryError(f"no artifact at s3://{bucket}/{prefix} ({why})")
    if not contract.scoresKey or contract.scoresKey == contract.key:
        return (*_scores(client, contract, contract.key, manifest), manifest)
    scores_manifest, why = storage.read_manifest(client, contract.storage.uri, contract.scoresKey)
    if scores_manifest is None:
        raise CanaryError(f"no artifact at {contract.scoresKey[:12]} for the 16-bit base's figures ({why})")
    report, source = _scores(client, contract, contract.scoresKey, scores_manifest)
    return unquantized(report), f"{source} (its 16-bit base's figures)", manifest


def unquantized(q: QualityReport) -> QualityReport:
    """A report of the 16-bit base as the Job's figures of a 16-bit variant: what the Job measured
    of the base is what it would measure of the variant (``jobQuantized`` = ``base``)."""
    return q.model_copy(update={
        "perplexity": q.baselinePerplexity, "increasePercent": 0.0,
        "metrics": [m.model_copy(update={"quantized": m.base, "recoveryPercent": 100.0}) for m in q.metrics],
        "adapters": [a.model_copy(update={"perplexity": a.baselinePerplexity, "increasePercent": 0.0})
                     for a in q.adapters]})


def _scores(client, contract: CanaryContract, key: str, manifest) -> tuple[QualityReport, str]:
    # The canary judges the base as vLLM serves it: the base's own figures, measured with the
    # model's adapters or without (fewerbits_api.quality.base_eval_identity).
    gate = contract.qualityGate
    identity = base_eval_identity(gate)
    bucket, prefix = artifact_prefix(contract.storage.uri, key)
    for name in dict.fromkeys((quality_result_key(prefix, eval_identity(gate)), quality_result_key(prefix, identity))):
        try:
            body = client.get_object(Bucket=bucket, Key=name)["Body"].read()
            return QualityReport.model_validate_json(body), f"s3://{bucket}/{name}"
        except ValidationError as e:
            raise CanaryError(f"s3://{bucket}/{name}: not a quality result ({one_line(str(e), 200)})") from None
        except Exception as e:  # noqa: BLE001 — only "not there" falls back to the next place
            if classify_s3_error(e).kind is not S3ErrorKind.NOT_FOUND:
                raise CanaryError(f"reading s3://{bucket}/{name}: {type(e).__name__} {classify_s3_error(e).code}") from None
    q = manifest.quality
    legacy_same = (q is not None and q.evalIdentity is None and not gate.benchmarks and gate.customEval is None
                   and q.evalDataset == gate.evalDataset and q.evalWindows == gate.evalSamples)
    if q is not None and (identity in (q.evalIdentity, q.baseEvalIdentity) or legacy_same):
        return q, f"s3://{bucket}/{prefix}manifest.json"
    measured = q.evalIdentity[:12] if q is not None and q.evalIdentity else "none"
    raise CanaryError(f"no base scores for the gate's evaluation identity {identity[:12]} (the manifest's figures "
                      f"are for {measured}, and there is no {QUALITY_DIR_NOTE}): the quantization Job's evaluation "
                      "must measure the base model under this gate first")


QUALITY_DIR_NOTE = "quality/<identity>.json re-evaluation"


def job_metrics(q: QualityReport) -> dict[str, MetricResult]:
    """The Job's metrics by name (a report from before per-metric results: perplexity only)."""
    from fewerbits_api.quality import recovery_percent

    out = {m.name: m for m in q.metrics}
    if "perplexity" not in out:
        out["perplexity"] = MetricResult(
            name="perplexity", kind="perplexity", base=q.baselinePerplexity, quantized=q.perplexity,
            recoveryPercent=recovery_percent(q.baselinePerplexity, q.perplexity, False),
            minRecoveryPercent=100.0 / (1.0 + q.maxIncreasePercent / 100.0), passed=q.passed,
            higherIsBetter=False, samples=q.evalWindows)
    return out


# -------------------------------------------------------------------------------------- artifact
def download_small_files(client, contract: CanaryContract, manifest_files, dest: Path) -> Path:
    """The artifact's tokenizer, config and other small files (never the weights), checked
    against the manifest's sha256."""
    bucket, prefix = artifact_prefix(contract.storage.uri, contract.key)
    for f in manifest_files:
        if f.path.lower().endswith(WEIGHT_SUFFIXES):
            continue
        target = dest / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, f"{prefix}{FILES_DIR}/{f.path}", str(target))
        digest = hashlib.sha256(target.read_bytes()).hexdigest()
        if digest != f.sha256:
            raise CanaryError(f"artifact file {f.path}: sha256 {digest[:12]} differs from the manifest's {f.sha256[:12]}")
    return dest


# ------------------------------------------------------------------------------------ evaluation
@dataclass
class Outcome:
    metrics: list[ServingMetric] = field(default_factory=list)
    skipped: list[SkippedMetric] = field(default_factory=list)


class _Say:
    def __init__(self, secrets: Mapping[str, str]):
        self.secrets = secrets
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        log.info(redact(f"canary elapsed={time.monotonic() - self.started:.1f}s {one_line(message, 2000)}",
                        self.secrets))


def _perplexity(server: Server, windows: list[list[int]], concurrency: int, say: Callable[[str], None],
                model: str | None = None, part: str = "perplexity") -> tuple[float, int]:
    """Perplexity of the served model (or of the adapter ``model``) on ``windows`` (prompt
    logprobs, one window per request), progress every ~10%."""
    done = [0]
    lock = threading.Lock()
    step = max(1, len(windows) // 10)

    def one(w: list[int]) -> float:
        status, body = server.post({"prompt": w, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}, model)
        if status >= 400:
            raise CanaryError(f"{server.url}: HTTP {status} for a {len(w)}-token perplexity window "
                              f"({one_line(str(body), 200)})")
        nll = window_nll(body, w)
        with lock:
            done[0] += 1
            if done[0] % step == 0 or done[0] == len(windows):
                say(f"part={part} windows={done[0]}/{len(windows)}")
        return nll

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        nlls = list(pool.map(one, windows))
    tokens = sum(len(w) - 1 for w in windows)
    return math.exp(sum(nlls) / max(tokens, 1)), tokens


def _api_model(server: Server, contract: CanaryContract, tokenizer_dir: Path, token_ids: bool):
    """lm-eval's ``local-completions`` model, counting every request it sends; no retries (a
    failed request is an error, and a retry would exceed the request budget)."""
    from fewerbits_api.quality import BENCHMARK_SEED
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    class Counted(LocalCompletionsAPI):
        def _create_payload(self, *args, **kwargs):
            server.count()
            return super()._create_payload(*args, **kwargs)

    return Counted(
        base_url=server.url, model=server.model, tokenizer=str(tokenizer_dir), tokenizer_backend="huggingface",
        # Token ids (vLLM) are exactly the Job's: HFLM encodes with the tokenizer's default special
        # tokens, as add_bos_token=True asks of the API model. A text-only server encodes the same
        # text with the same tokenizer's defaults.
        tokenized_requests=token_ids, add_bos_token=True, num_concurrent=contract.limits.concurrency,
        max_retries=1, timeout=contract.limits.requestTimeoutSeconds, seed=BENCHMARK_SEED,
        max_length=contract.evalMaxSeqLength, batch_size=1)


def _task_costs(prepared, t) -> tuple[str, list[int]]:
    """(lm-eval output type, requests per document for the first ``t.limit`` documents)."""
    from . import lmeval

    if t.kind == "custom":
        return ("loglikelihood" if t.metric == "perplexity" else GENERATE), [1] * t.limit
    from lm_eval.tasks import get_task_dict

    manager = lmeval._task_manager(prepared.include_paths, prepared.include_defaults)
    tasks = lmeval._leaf_tasks(get_task_dict([t.config], manager))
    output_type = getattr(tasks[0], "OUTPUT_TYPE", "") if tasks else ""
    docs = list(tasks[0].eval_docs)[: t.limit] if tasks else []
    if output_type == "multiple_choice":
        return output_type, [len(tasks[0].doc_to_choice(d)) for d in docs]
    return output_type, [1] * len(docs)


def evaluate(contract: CanaryContract, env: Mapping[str, str], client, workdir: Path, say) -> tuple[Outcome, Server]:
    from . import evaluate as ppl_eval
    from . import lmeval, storage, textdata

    gate = contract.qualityGate
    report, source, manifest = base_report(client, contract)
    job = job_metrics(report)
    say(f"base scores from {source}: {', '.join(sorted(job))}")
    # Before anything heavy: an unreachable canary is an error within seconds.
    server = Server(contract.endpoint, contract.servedModelName, contract.limits.requestTimeoutSeconds)
    logprobs, how = probe(server, PROBE_TOKEN_IDS)
    say(f"server at {contract.endpoint} answered; prompt logprobs: {'yes' if logprobs else 'no'} ({how})")

    from transformers import AutoConfig, AutoTokenizer

    art = download_small_files(client, contract, manifest.files, workdir / "artifact")
    tokenizer = AutoTokenizer.from_pretrained(art)
    length = ppl_eval.window_length(contract.evalMaxSeqLength, AutoConfig.from_pretrained(art))

    out = Outcome()
    s3_factory = lambda: storage.storage_client(contract.storage, env)  # noqa: E731
    parts: list[Part] = []
    windows: dict[str, list[list[int]]] = {}
    if not logprobs:
        out.skipped.append(SkippedMetric(name="perplexity", reason=f"needs prompt logprobs: {how}"))
    else:
        texts = textdata.load_texts(gate.evalDataset, env, s3_factory, splits=EVALUATION_SPLITS)
        if report.evalDatasetSha256 and report.evalDatasetSha256 != texts.sha256:
            out.skipped.append(SkippedMetric(name="perplexity", reason=f"{gate.evalDataset} changed since the Job "
                                             "measured it (another text hash): not the same windows"))
        else:
            windows["perplexity"] = ppl_eval.build_windows(tokenizer, texts.texts, length, gate.evalSamples).tolist()
            parts.append(Part("perplexity", "perplexity", [1] * len(windows["perplexity"]), "prompt_logprobs"))

    prepared = lmeval.prepare(gate, workdir, s3_factory)
    for t in prepared.tasks:
        output_type, costs = _task_costs(prepared, t)
        planned = plan_task(t.name, t.kind, output_type, costs, logprobs, how)
        (parts if isinstance(planned, Part) else out.skipped).append(planned)
    adapters = {a.part: a for a in served_adapters(server, contract, report, (logprobs, how), out)}
    for a in adapters.values():
        if (found := adapter_windows(a, env, s3_factory, tokenizer, length, out)) is not None:
            # All of its windows or none: the Job's figure is over all of them.
            windows[a.part] = found
            parts.append(Part(a.part, "adapter", [len(found)], "prompt_logprobs"))

    budget = contract.limits.maxRequests - server.requests
    docs = split_budget(parts, budget)
    plan = ", ".join(f"{p.name}={docs[p.name]}/{len(p.costs)}" for p in parts)
    say(f"request budget {contract.limits.maxRequests} (probe and model list {server.requests}): documents per "
        f"part {plan or 'none'}; concurrency {contract.limits.concurrency}")
    for p in parts:
        if docs[p.name] == 0:
            out.skipped.append(SkippedMetric(name=p.name, reason=f"limits.maxRequests ({contract.limits.maxRequests}) "
                                             "left no request for this part"))
    measure = Measure(contract, server, job, windows, prepared, art, adapters, logprobs, say)
    for p in parts:
        if docs[p.name]:
            measure.part(p, docs[p.name], out)
    return out, server


@dataclass
class Measure:
    """Measures one part through the server and records it (or why it was skipped) in ``out``."""

    contract: CanaryContract
    server: Server
    job: dict[str, MetricResult]
    windows: dict[str, list[list[int]]]
    prepared: object
    art: Path
    adapters: dict[str, ServedAdapter]
    logprobs: bool
    say: Callable[[str], None]

    def part(self, p: Part, n: int, out: Outcome) -> None:
        from . import evaluate as ppl_eval
        from . import gate as gate_mod
        from . import lmeval

        if p.kind == "adapter":
            m = adapter_metric(self.server, self.adapters[p.name], self.windows[p.name],
                               self.contract.limits.concurrency, self.say)
        elif (base := self.job.get(p.name)) is None:
            out.skipped.append(SkippedMetric(name=p.name, reason="the Job's report has no base score for it"))
            return
        elif p.name == "perplexity":
            t0 = time.monotonic()
            served, tokens = _perplexity(self.server, self.windows[p.name][:n], self.contract.limits.concurrency,
                                         self.say)
            ppl = ppl_eval.Perplexities(baseline=base.base, quantized=served, windows=n, tokens=tokens,
                                        window_length=len(self.windows[p.name][0]), seconds=time.monotonic() - t0)
            m = serving_metric(gate_mod.perplexity_metric(ppl, self.contract.qualityGate.maxPerplexityIncreasePercent),
                               base, p.method)
        else:
            t = next(t for t in self.prepared.tasks if t.name == p.name)
            lm = _api_model(self.server, self.contract, self.art, token_ids=self.logprobs)
            scores = _lm_eval(lm, self.prepared, t, n, self.server, self.say)
            base_score = lmeval.Score(value=base.base, stderr=None, samples=base.samples, seconds=0.0)
            judged = gate_mod.task_metric(t, base_score, scores, gate_mod.thresholds(self.contract.qualityGate)[t.name])
            m = serving_metric(judged, base, p.method)
        out.metrics.append(m)
        self.say(f"metric={m.name} base={m.base:.4f} job={m.jobQuantized if m.jobQuantized is not None else float('nan'):.4f} "
                 f"served={m.served:.4f} recovery={m.recoveryPercent:.2f}% min={m.minRecoveryPercent:.2f}% "
                 f"passed={str(m.passed).lower()} samples={m.samples} requests={self.server.requests}")


# ------------------------------------------------------------------------------------ adapters
@dataclass(frozen=True)
class ServedAdapter:
    """A LoRA adapter the canary pod loads, with what the Job measured of it on this base."""

    evaluation: AdapterEvaluation
    job: AdapterQuality

    @property
    def part(self) -> str:
        return f"adapter:{self.evaluation.name}"


def loaded_models(server: Server) -> set[str]:
    """The names the server answers to: ``GET /v1/models`` (vLLM lists the served model and every
    LoRA adapter it loaded); counted as a request."""
    import requests

    server.count()
    try:
        r = requests.get(f"{server.endpoint}/v1/models", timeout=server.timeout)
        r.raise_for_status()
        return {str(m.get("id")) for m in r.json().get("data") or [] if isinstance(m, dict)}
    except (requests.exceptions.RequestException, ValueError, AttributeError) as e:
        raise CanaryError(f"{server.endpoint}/v1/models: {_cause(e)}") from None


def served_adapters(server: Server, contract: CanaryContract, report: QualityReport, logprobs: tuple[bool, str],
                    out: Outcome) -> list[ServedAdapter]:
    """The model's adapters the pod loads (every one published for its pool,
    serving/canary.py), each with the Job's figures under the contract's evaluation identity;
    one that cannot be judged is recorded as skipped with the reason (the operator does not
    serve it on this pool)."""
    if not contract.adapters:
        return []
    if contract.limits.maxRequests - server.requests < 1:
        out.skipped.extend(SkippedMetric(name=f"adapter:{a.name}", reason=f"limits.maxRequests "
                                         f"({contract.limits.maxRequests}) left no request for it")
                           for a in contract.adapters)
        return []
    loaded = loaded_models(server)
    current = report.evalIdentity == eval_identity(contract.qualityGate)
    figures = {q.name: q for q in report.adapters} if current else {}
    found = []
    for a in contract.adapters:
        if a.name not in loaded:
            continue
        q = figures.get(a.name)
        why = (f"needs prompt logprobs: {logprobs[1]}" if not logprobs[0] else
               "the Job's report is of another evaluation identity (measured before the adapters or their "
               "evaluation sets changed)" if not current else
               "the Job's report has no perplexity of it on the 16-bit base"
               if q is None or q.baselinePerplexity is None or not q.baselinePerplexity > 0 else None)
        if why is None:
            found.append(ServedAdapter(a, q))
        else:
            out.skipped.append(SkippedMetric(name=f"adapter:{a.name}", reason=why))
    return found


def adapter_windows(a: ServedAdapter, env: Mapping[str, str], s3_factory, tokenizer, length: int,
                    out: Outcome) -> list[list[int]] | None:
    """The adapter's evaluation windows as the Job cut them (``adapters.AdapterMeter``: its own
    evaluation set pinned to the ETag the operator read, the base's window length), or None with
    the reason recorded: a set that changed or cannot be read for good, windows other than the
    Job's. A transient read error is a CanaryError (no verdict, tried again)."""
    from . import evaluate as ppl_eval
    from .adapters import eval_texts

    try:
        texts = eval_texts(a.evaluation, env, s3_factory)
    except JobError as e:
        if not e.permanent:
            raise CanaryError(f"adapter {a.evaluation.name}'s evaluation set: {e.message}") from None
        out.skipped.append(SkippedMetric(name=a.part, reason=f"its evaluation set: {e.message}"))
        return None
    windows = ppl_eval.build_windows(tokenizer, texts, length, max(1, a.evaluation.evalSamples)).tolist() \
        if any(isinstance(t, str) and t.strip() for t in texts) else []
    if not windows or len(windows[0]) < 2 or len(windows) != a.job.windows:
        out.skipped.append(SkippedMetric(name=a.part, reason=f"its evaluation text gives {len(windows)} windows of "
                                         f"{len(windows[0]) if windows else 0} tokens, the Job scored {a.job.windows}"))
        return None
    return windows


def adapter_metric(server: Server, a: ServedAdapter, windows: list[list[int]], concurrency: int,
                   say: Callable[[str], None]) -> ServingMetric:
    """The adapter asked for by its name through the pod, against the same adapter on the 16-bit
    base as the Job measured it, with the adapter's own threshold."""
    from fewerbits_api.quality import recovery_percent

    served, _ = _perplexity(server, windows, concurrency, say, model=a.evaluation.name, part=a.part)
    base = float(a.job.baselinePerplexity or 0.0)
    increase = (served / base - 1.0) * 100.0
    limit = a.evaluation.maxIncreasePercent
    return ServingMetric(name=a.part, kind="adapter", base=base, jobQuantized=a.job.perplexity, served=served,
                         recoveryPercent=recovery_percent(base, served, False),
                         minRecoveryPercent=100.0 / (1.0 + limit / 100.0), passed=increase <= limit,
                         higherIsBetter=False, samples=len(windows), method="prompt_logprobs")


def _lm_eval(lm, prepared, t, n: int, server: Server, say):
    from . import lmeval

    try:
        return lmeval.score_lm(lm, prepared, [t], on_task=lambda name: say(f"part={name} documents={n}"),
                               limits={t.name: n})[t.name]
    except JobError:
        raise
    except Exception as e:  # noqa: BLE001 — lm-eval's HTTP errors (requests, aiohttp), retries off
        raise CanaryError(f"{server.url}: {t.name} failed ({_cause(e)})") from None


# -------------------------------------------------------------------------------------------- run
def load_contract(env: Mapping[str, str]) -> CanaryContract:
    raw = env.get(CANARY_CONTRACT_ENV)
    if not raw:
        raise JobError("ContractInvalid", f"no contract: set {CANARY_CONTRACT_ENV}", permanent=True)
    try:
        return CanaryContract.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "contract"
        raise JobError("ContractInvalid", f"{CANARY_CONTRACT_ENV}: {where}: {first.get('msg')}", permanent=True) from e


def run(env: Mapping[str, str] | None = None) -> int:
    """The whole evaluation; writes the termination message; returns the exit code (never raises)."""
    env = dict(os.environ) if env is None else dict(env)
    secrets = secret_values(env)
    say = _Say(secrets)
    term = env.get(TERMINATION_LOG_ENV) or TERMINATION_LOG_DEFAULT
    config_hash = ""
    try:
        contract = load_contract(env)
    except JobError as e:
        return _finish(term, CanaryTermination(outcome="error", reason=e.message), EXIT_PERMANENT, secrets, say)
    config_hash = contract.configHash
    workdir = Path(tempfile.mkdtemp(prefix="fewerbits-canary-"))
    started = time.monotonic()
    try:
        guard_endpoint(contract.storage.endpoint, "storage.endpoint", allow_private_from_env(env))
        from . import storage

        say(f"variant={contract.variant} configHash={config_hash} key={contract.key} endpoint={contract.endpoint} "
            f"kvCacheDtype={contract.kvCacheDtype} maxRequests={contract.limits.maxRequests}")
        client = storage.storage_client(contract.storage, env)
        outcome, server = evaluate(contract, env, client, workdir, say)
        passed, reason = verdict(outcome.metrics, outcome.skipped, contract.kvCacheDtype)
        result = ServingQualityResult(
            key=contract.key, configHash=config_hash, variant=contract.variant, kvCacheDtype=contract.kvCacheDtype,
            passed=passed, reason=one_line(reason, 1000), metrics=outcome.metrics, skipped=outcome.skipped,
            requests=server.requests, seconds=round(time.monotonic() - started, 3),
            server=one_line(f"{server.server or 'unknown'} model={contract.servedModelName}", 200),
            measuredAt=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        write_result(client, contract, result)
        say(f"verdict passed={str(passed).lower()} requests={server.requests} seconds={result.seconds:.1f}: {reason}")
        done = CanaryTermination(outcome="passed" if passed else "failed", configHash=config_hash, reason=reason)
        return _finish(term, done, EXIT_OK, secrets, say)
    except (CanaryError, EndpointRefused) as e:
        return _finish(term, CanaryTermination(outcome="error", configHash=config_hash, reason=str(e)), EXIT_FAILED,
                       secrets, say)
    except JobError as e:
        return _finish(term, CanaryTermination(outcome="error", configHash=config_hash, reason=f"{e.reason}: {e.message}"),
                       EXIT_FAILED, secrets, say)
    except Exception as e:  # noqa: BLE001 — one line with the cause, never a bare traceback as the verdict
        log.exception(redact("canary: unexpected error", secrets))
        return _finish(term, CanaryTermination(outcome="error", configHash=config_hash,
                                               reason=f"{type(e).__name__}: {e}"), EXIT_FAILED, secrets, say)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def write_result(client, contract: CanaryContract, result: ServingQualityResult) -> None:
    """One PUT of the whole object: S3 never shows a half-written one."""
    bucket, prefix = artifact_prefix(contract.storage.uri, contract.key)
    key = serving_result_key(prefix, contract.configHash)
    body = json.dumps(result.to_wire(), indent=2, sort_keys=True).encode()
    try:
        client.put_object(Bucket=bucket, Key=key, Body=body, ContentType="application/json")
    except Exception as e:  # noqa: BLE001
        raise CanaryError(f"writing s3://{bucket}/{key}: {type(e).__name__} {classify_s3_error(e).code}") from None


def _finish(path: str, done: CanaryTermination, code: int, secrets: Mapping[str, str], say) -> int:
    done = done.model_copy(update={"reason": one_line(redact(done.reason, secrets), 1500)})
    text = termination_message(done.to_wire())
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        log.warning(f"cannot write the termination message to {path}: {e.strerror}")
    say(f"outcome={done.outcome} exit={code} reason={done.reason}")
    return code


def main(argv: list[str] | None = None) -> int:
    configure_logging(sys.stdout)
    return run()
