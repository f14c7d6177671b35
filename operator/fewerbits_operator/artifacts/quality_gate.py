"""The quality gate as the operator judges it: a manifest's measured figures against THIS model's
thresholds (an artifact shared by two models may pass one's gate and fail the other's).

Pure: a ``QualityReport`` (from the manifest) and the effective ``QualityGateSpec`` in, a typed
``QualityStatus`` out. A threshold change is judged here with no Job; a change of what decides
the figures (the evaluation identity, fewerbits_api.quality) cannot be judged from figures
measured under another identity, so the gate fails closed naming what was not measured.
"""

from __future__ import annotations

from fewerbits_api.artifact import QualityReport
from fewerbits_api.quality import MetricResult, answers, recovery_percent
from fewerbits_api.quantizedmodel import QualityGateSpec, QualityStatus


def wanted_thresholds(gate: QualityGateSpec) -> dict[str, float]:
    """Metric name -> minimum recovery percent, for every metric the gate asks for."""
    out = {"perplexity": 100.0 / (1.0 + gate.maxPerplexityIncreasePercent / 100.0)}
    for b in gate.benchmarks:
        out[f"benchmark:{b.task}/{b.metric}"] = b.minRecoveryPercent
    if gate.customEval is not None:
        out[f"custom:{gate.customEval.metric}"] = gate.customEval.minRecoveryPercent
    return out


def judge_quality(q: QualityReport, gate: QualityGateSpec) -> QualityStatus:
    """Every measured metric re-judged with this gate's thresholds; a metric the gate asks for
    that the report lacks fails the gate (named in ``missing``)."""
    increase = q.increasePercent
    ppl_ok = increase <= gate.maxPerplexityIncreasePercent
    wanted = wanted_thresholds(gate)
    measured = {m.name: m for m in q.metrics}
    if "perplexity" not in measured:  # a manifest from before per-metric results
        measured["perplexity"] = MetricResult(
            name="perplexity", kind="perplexity", base=q.baselinePerplexity, quantized=q.perplexity,
            recoveryPercent=recovery_percent(q.baselinePerplexity, q.perplexity, False),
            minRecoveryPercent=wanted["perplexity"], passed=ppl_ok, higherIsBetter=False, samples=q.evalWindows)
    metrics: list[MetricResult] = []
    for name, threshold in wanted.items():
        m = measured.get(name)
        if m is None:
            continue
        passed = ppl_ok if name == "perplexity" else m.recoveryPercent >= threshold
        metrics.append(m.model_copy(update={"minRecoveryPercent": threshold, "passed": passed}))
    missing = [n for n in wanted if n not in measured]
    return QualityStatus(
        baselinePerplexity=q.baselinePerplexity, perplexity=q.perplexity, increasePercent=increase,
        maxIncreasePercent=gate.maxPerplexityIncreasePercent,
        passed=not missing and all(m.passed for m in metrics),
        metrics=metrics, worstRecoveryPercent=min((m.recoveryPercent for m in metrics), default=None),
        evalIdentity=q.evalIdentity, missing=missing,
    )


def identity_matches(q: QualityReport, gate: QualityGateSpec) -> bool:
    """Whether ``q`` was measured under ``gate``'s evaluation identity (None: an older manifest,
    which measured perplexity only on its own evaluation set; a report measured with adapters
    answers a gate without them: fewerbits_api.quality.answers)."""
    return answers(q, gate)


def metric_text(m: MetricResult) -> str:
    if m.kind == "perplexity":
        return (f"perplexity {m.base:.3f} → {m.quantized:.3f} (recovery {m.recoveryPercent:.1f}% < "
                f"{m.minRecoveryPercent:.1f}%)")
    return f"{m.name} {m.base:.4g} → {m.quantized:.4g} (recovery {m.recoveryPercent:.1f}% < {m.minRecoveryPercent:g}%)"


def failure_text(fmt: str, quality: QualityStatus) -> str:
    """Names every failing metric with its figures, and every metric the gate asked for that
    was not measured under the current evaluation identity."""
    parts = [metric_text(m) for m in quality.metrics if not m.passed]
    missing = quality.missing
    if missing:
        parts.append(f"not measured under the current gate: {', '.join(missing)} (the artifact was evaluated "
                     f"under evaluation identity {(quality.evalIdentity or 'none')[:12]}; an evaluation-only Job "
                     "measures it)")
    return f"{fmt}: " + "; ".join(parts) + "; not rolled out"


def worst_recovery(qualities: list[QualityStatus | None]) -> str | None:
    """`98.2% benchmark:arc_easy/acc` over every artifact's metrics (for `kubectl get -o wide`)."""
    worst: MetricResult | None = None
    for q in qualities:
        for m in (q.metrics if q else []):
            if worst is None or m.recoveryPercent < worst.recoveryPercent:
                worst = m
    return f"{worst.recoveryPercent:.1f}% {worst.name}" if worst else None


def needs_evaluation(q: QualityReport | None, gate: QualityGateSpec) -> bool:
    """Whether the manifest's figures cannot answer ``gate``: they were measured under another
    evaluation identity, or the gate asks for a metric they lack. A manifest from before
    evaluation identities (None) that measured perplexity only is still judged as it is for a
    perplexity-only gate: an upgrade starts no Job."""
    if q is None:
        return False
    if q.evalIdentity is not None and not answers(q, gate):
        return True
    if gate.adapters and q.evalIdentity is None:  # LoRA adapters are measured under an identity naming them
        return True
    if gate.adapters and any(a.error is None and a.adapterKey is None for a in q.adapters):
        return True  # measured by a Job that published no adapters (an older release): their files are needed

    return bool(judge_quality(q, gate).missing)
