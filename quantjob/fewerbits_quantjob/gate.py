"""The quality gate in the Job: perplexity, benchmarks and the custom set, measured on the base
and the quantized model in one pass each (one model in memory at a time), judged into a
``QualityReport`` with one ``MetricResult`` per metric (docs/quality.md).

No decision here differs from the operator's: it judges again, with each model's own thresholds.
"""

from __future__ import annotations

import math
from pathlib import Path

from fewerbits_api.artifact import QualityReport
from fewerbits_api.quality import MetricResult, base_eval_identity, eval_identity, recovery_percent

from . import errors, evaluate, lmeval
from .errors import JobError


def perplexity_metric(ppl: evaluate.Perplexities, max_increase: float) -> MetricResult:
    increase = ppl.increase_percent
    noise = None
    if ppl.noise_floor_percent is not None:
        # The interval of the increase, as points of recovery (base / quantized).
        noise = ppl.noise_floor_percent * 100.0 / (100.0 + increase)
    return MetricResult(name="perplexity", kind="perplexity", base=ppl.baseline, quantized=ppl.quantized,
                        recoveryPercent=recovery_percent(ppl.baseline, ppl.quantized, False),
                        minRecoveryPercent=100.0 / (1.0 + max_increase / 100.0), passed=increase <= max_increase,
                        higherIsBetter=False, samples=ppl.windows, seconds=round(ppl.seconds, 3), noisePercent=noise)


def task_metric(t: lmeval.PreparedTask, base: lmeval.Score, quant: lmeval.Score, threshold: float) -> MetricResult:
    recovery = recovery_percent(base.value, quant.value, t.higher_is_better)
    noise = None
    if base.stderr is not None and quant.stderr is not None and base.value:
        noise = 1.96 * math.hypot(base.stderr, quant.stderr) / abs(base.value) * 100.0
    return MetricResult(name=t.name, kind=t.kind, base=base.value, quantized=quant.value, recoveryPercent=recovery,
                        minRecoveryPercent=threshold, passed=recovery >= threshold, higherIsBetter=t.higher_is_better,
                        samples=quant.samples, seconds=round(base.seconds + quant.seconds, 3), noisePercent=noise)


def thresholds(gate) -> dict[str, float]:
    out = {f"benchmark:{b.task}/{b.metric}": b.minRecoveryPercent for b in gate.benchmarks}
    if gate.customEval is not None:
        out[f"custom:{gate.customEval.metric}"] = gate.customEval.minRecoveryPercent
    return out


def measure(base: Path, quantized: Path, tokenizer, texts: list[str], eval_source: str, eval_sha256: str | None,
            gate, max_seq_length: int, trust_remote_code: bool, prepared: lmeval.Prepared,
            on_progress=None, note=None, also=None) -> QualityReport:
    """Every metric of ``gate`` on ``base`` against ``quantized``; ``prepared`` is
    :func:`lmeval.prepare`'s (made before any model was loaded). ``also(which, model)`` runs on each
    loaded model after the benchmarks (the LoRA adapters' meter, adapters.py)."""
    scores: dict[str, dict[str, lmeval.Score]] = {}

    def with_model(which: str, model) -> None:
        if prepared:
            scores[which] = lmeval.score(model, tokenizer, prepared, max_length=max_seq_length,
                                         on_task=(lambda name: note(f"{which} model: {name}")) if note else None)
        if also is not None:
            also(which, model)

    ppl = evaluate.evaluate_pair(base, quantized, tokenizer, texts, max_seq_length, gate.evalSamples,
                                 trust_remote_code, on_progress=on_progress, with_model=with_model)
    if not (math.isfinite(ppl.baseline) and math.isfinite(ppl.quantized)):
        raise JobError(errors.PERPLEXITY_NOT_FINITE,
                       f"perplexity is not finite (base {ppl.baseline}, quantized {ppl.quantized}): the checkpoint "
                       "is broken or the evaluation text is unusable")
    metrics = [perplexity_metric(ppl, gate.maxPerplexityIncreasePercent)]
    limits = thresholds(gate)
    for t in prepared.tasks:
        metrics.append(task_metric(t, scores["base"][t.name], scores["quantized"][t.name], limits[t.name]))
    low, high = ppl.ci95 if ppl.ci95 else (None, None)
    return QualityReport(
        baselinePerplexity=ppl.baseline, perplexity=ppl.quantized, increasePercent=ppl.increase_percent,
        maxIncreasePercent=gate.maxPerplexityIncreasePercent, passed=all(m.passed for m in metrics),
        evalDataset=eval_source, evalWindows=ppl.windows, evalTokens=ppl.tokens, metrics=metrics,
        evalIdentity=eval_identity(gate), baseEvalIdentity=base_eval_identity(gate) if gate.adapters else None,
        increaseCI95=[low, high] if low is not None else None,
        noiseFloorPercent=ppl.noise_floor_percent, evalDatasetSha256=eval_sha256,
    )
