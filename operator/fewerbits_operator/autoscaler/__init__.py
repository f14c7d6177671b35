"""Autoscaling of each served variant on vLLM's KV-cache usage and queue depth (issue 8).

- ``metrics``: per-pod figures from a pod's ``/metrics`` or from Prometheus (typed results).
- ``algorithm``: the decision, a pure function.
- ``forecast``: the demand forecast one pod start-up ahead and the predictive rule after the
  decision (docs/autoscaling.md).
- ``loop``: the ``Autoscaler`` that observes, decides and writes only the Deployment's scale
  subresource, the autoscaler-owned fields of ``status.serving`` and Events.
- I/O goes through ``fewerbits_operator.base.kube.Kube``, which implements ``AutoscalerIO`` (one module talks to the API server).
"""

from fewerbits_operator.autoscaler.algorithm import Decision, History, Observation, Tuning, bounds, decide
from fewerbits_operator.autoscaler.forecast import Forecast, Forecaster, ForecastTuning, foresee, foresight_step
from fewerbits_operator.autoscaler.loop import AUTOSCALER_FIELDS, Autoscaler, AutoscalerIO, merge_serving
from fewerbits_operator.autoscaler.metrics import (
    DirectScrapeSource,
    MetricsSource,
    PodSample,
    PodTarget,
    PrometheusSource,
    ScrapeFailure,
    parse_vllm_metrics,
    scrape_pod,
)

__all__ = [
    "AUTOSCALER_FIELDS", "Autoscaler", "AutoscalerIO", "merge_serving",
    "Decision", "History", "Observation", "Tuning", "bounds", "decide",
    "Forecast", "Forecaster", "ForecastTuning", "foresee", "foresight_step",
    "DirectScrapeSource", "MetricsSource", "PodSample", "PodTarget", "PrometheusSource", "ScrapeFailure",
    "parse_vllm_metrics", "scrape_pod",
]
