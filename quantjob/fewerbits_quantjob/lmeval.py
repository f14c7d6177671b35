"""Benchmark tasks and the custom evaluation set, run with lm-evaluation-harness.

Two steps, so that bad input costs no model load (and so no GPU time):

1. :func:`prepare` (before any model is loaded): downloads each ``taskSource`` prefix from S3 and
   makes the task YAML's relative ``data_files`` absolute, resolves every task name (an unknown
   one names ``benchmarks[i].task``), builds the tasks (their data is read here) and checks that
   the task reports the requested metric (else ``benchmarks[i].metric``); reads the custom set
   and checks every record has a ``prompt`` and a ``reference`` string and that there is at
   least one (else ``customEval.dataset``).
2. :func:`score` (once per model, while it is loaded): one ``simple_evaluate`` over every task,
   with the same limit, few-shot count, generation settings and seeds (``BENCHMARK_SEED``) for
   the base and the quantized model.

The custom set is an lm-eval task built in code: ``generate_until`` with greedy decoding (stop
at a newline, ``maxNewTokens``) scored by exact match (lm-eval's own metric, surrounding
whitespace ignored), ``contains`` or ROUGE-L F1 (``rouge_score``, which lm-eval depends on), or
``loglikelihood`` of the reference given the prompt for ``perplexity`` (lm-eval's metric,
aggregated as exp(-mean log-likelihood per record)).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fewerbits_api.artifact import split_s3_uri
from fewerbits_api.quality import BENCHMARK_SEED, LOWER_IS_BETTER, METRICS_BY_OUTPUT_TYPE

from . import errors
from .errors import JobError

CUSTOM_TASK = "fewerbits_custom_eval"
BATCH_SIZE = 8


@dataclass
class PreparedTask:
    name: str
    """Result name: ``benchmark:<task>/<metric>`` or ``custom:<metric>``."""
    kind: str
    task: str
    metric: str
    limit: int
    num_fewshot: int
    higher_is_better: bool
    config: dict | str
    """A task name (resolved by the task manager) or a task config dict."""


@dataclass
class Prepared:
    tasks: list[PreparedTask] = field(default_factory=list)
    include_paths: list[str] = field(default_factory=list)
    include_defaults: bool = False
    """Index lm-eval's own tasks (thousands of YAML files: seconds) only when a benchmark names one."""
    custom_sha256: str | None = None

    def __bool__(self) -> bool:
        return bool(self.tasks)


@dataclass
class Score:
    value: float
    stderr: float | None
    samples: int
    seconds: float


# ---------------------------------------------------------------------------------- custom metrics
def contains(references, predictions, **kwargs) -> float:
    """1.0 when the reference occurs in the generation (both trimmed)."""
    return float(str(references[0]).strip() in str(predictions[0]))


def rougeL(references, predictions, **kwargs) -> float:  # noqa: N802 — the metric's name as users write it
    """ROUGE-L F1 of the generation against the reference."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    return float(scorer.score(str(references[0]), str(predictions[0]))["rougeL"].fmeasure)


def _metric_entry(metric: str) -> dict:
    if metric == "exact_match":
        return {"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                "regexes_to_ignore": [r"^\s+", r"\s+$"]}
    fn = {"contains": contains, "rougeL": rougeL}[metric]
    return {"metric": fn, "aggregation": "mean", "higher_is_better": True}


def parse_custom_records(body: bytes, source: str, limit: int) -> list[dict]:
    """``{"prompt": str, "reference": str}`` per line; the error names the line and the field."""
    field_name = "spec.quantization.qualityGate.customEval.dataset"
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise JobError(errors.DATASET_INVALID, f"{field_name}: {source} is not UTF-8", permanent=True) from e
    records: list[dict] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as e:
            raise JobError(errors.DATASET_INVALID, f"{field_name}: {source} line {number}: not JSON ({e.msg})",
                           permanent=True) from e
        missing = [k for k in ("prompt", "reference") if not isinstance(rec, dict) or not isinstance(rec.get(k), str)]
        if missing:
            raise JobError(errors.DATASET_INVALID, f"{field_name}: {source} line {number}: needs a "
                           f"{' and a '.join(repr(m) for m in missing)} string", permanent=True)
        records.append({"prompt": rec["prompt"], "reference": rec["reference"]})
        if len(records) >= limit:
            break
    if not records:
        raise JobError(errors.DATASET_INVALID, f"{field_name}: {source} has no records (an empty file)",
                       permanent=True)
    return records


def custom_task_config(data_file: Path, metric: str, max_new_tokens: int) -> dict:
    base = {"task": CUSTOM_TASK, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data_file)}},
            "test_split": "test", "doc_to_text": "{{prompt}}", "doc_to_target": "{{reference}}",
            "metadata": {"version": 1}}
    if metric == "perplexity":
        return {**base, "output_type": "loglikelihood", "target_delimiter": " ",
                "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False}]}
    return {**base, "output_type": "generate_until", "target_delimiter": " ",
            "generation_kwargs": {"until": ["\n"], "do_sample": False, "max_gen_toks": max_new_tokens},
            "metric_list": [_metric_entry(metric)]}


# ------------------------------------------------------------------------------------ task sources
def download_task_source(uri: str, dest: Path, s3_client_factory) -> Path:
    """Copy every object under the ``taskSource`` prefix into ``dest``; make relative
    ``data_files`` in its YAML absolute (lm-eval would resolve them against the working
    directory)."""

    bucket, prefix = split_s3_uri(uri)
    prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
    client = s3_client_factory()
    count = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix):]
            if not rel or rel.endswith("/") or ".." in rel.split("/"):
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, obj["Key"], str(target))
            count += 1
    if count == 0:
        raise JobError(errors.DATASET_NOT_FOUND, f"taskSource {uri}: no objects under this prefix", permanent=True)
    return absolutize_data_files(dest)


def absolutize_data_files(dest: Path) -> Path:
    """Make relative ``dataset_kwargs.data_files`` in the task YAML under ``dest`` absolute."""
    import yaml

    for path in [*dest.rglob("*.yaml"), *dest.rglob("*.yml")]:
        doc = yaml.safe_load(path.read_text())
        files = ((doc or {}).get("dataset_kwargs") or {}).get("data_files") if isinstance(doc, dict) else None
        if isinstance(files, dict):
            for split, value in list(files.items()):
                if isinstance(value, str) and "://" not in value and not value.startswith("/"):
                    files[split] = str((path.parent / value).resolve())
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest


def _task_manager(include_paths: list[str], include_defaults: bool = True):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_paths or None, include_defaults=include_defaults)


def _leaf_tasks(task_dict) -> list:
    out = []
    for value in task_dict.values():
        if isinstance(value, dict):
            out.extend(_leaf_tasks(value))
        else:
            out.append(value)
    return out


def prepare(gate, workdir: Path, s3_client_factory=None, local_custom: bytes | None = None,
            local_task_dirs: list[Path] | None = None) -> Prepared:
    """Resolve and check everything the gate asks for, before any model is loaded.

    ``local_custom`` and ``local_task_dirs`` stand in for the S3 objects in tests of this module
    alone (the Job reads S3)."""
    import shutil

    prepared = Prepared()
    if not gate.benchmarks and gate.customEval is None:
        return prepared
    for j, local in enumerate(local_task_dirs or []):
        dest = workdir / "lmeval-local" / str(j)
        shutil.copytree(local, dest, dirs_exist_ok=True)
        prepared.include_paths.append(str(absolutize_data_files(dest)))
    for i, b in enumerate(gate.benchmarks):
        if b.taskSource:
            if s3_client_factory is None:
                raise JobError(errors.DATASET_FETCH_FAILED, f"benchmarks[{i}].taskSource: no S3 client configured")
            dest = download_task_source(b.taskSource, workdir / "lmeval-tasks" / str(i), s3_client_factory)
            prepared.include_paths.append(str(dest))
    from lm_eval.tasks import get_task_dict

    prepared.include_defaults = any(b.taskSource is None for b in gate.benchmarks) and not local_task_dirs
    manager = _task_manager(prepared.include_paths, prepared.include_defaults)
    known = set(manager.all_tasks)
    for i, b in enumerate(gate.benchmarks):
        where = f"spec.quantization.qualityGate.benchmarks[{i}]"
        if b.task not in known:
            raise JobError(errors.BENCHMARK_INVALID, f"{where}.task: unknown lm-eval task {b.task!r}"
                           + (" (not in lm-eval's tasks nor in taskSource)" if b.taskSource else
                              " (not one of lm-eval's tasks; bring your own with taskSource)"), permanent=True)
        try:
            tasks = _leaf_tasks(get_task_dict([b.task], manager))
        except Exception as e:  # noqa: BLE001 — the data could not be read: one line, the field named
            raise JobError(errors.BENCHMARK_INVALID, f"{where}.task: {b.task!r} could not be loaded: "
                           f"{type(e).__name__}: {e}", permanent=True) from e
        for t in tasks:
            output_type = getattr(t, "OUTPUT_TYPE", None)
            reported = set(getattr(t, "_metric_fn_list", {}) or {})
            if b.metric not in reported:
                fits = ", ".join(sorted(reported)) or ", ".join(METRICS_BY_OUTPUT_TYPE.get(output_type or "", ()))
                raise JobError(errors.BENCHMARK_INVALID, f"{where}.metric: {b.metric!r} does not fit task {b.task!r} "
                               f"({output_type}); it reports: {fits}", permanent=True)
        higher = b.metric not in LOWER_IS_BETTER
        prepared.tasks.append(PreparedTask(name=f"benchmark:{b.task}/{b.metric}", kind="benchmark", task=b.task,
                                           metric=b.metric, limit=b.limit, num_fewshot=b.numFewshot,
                                           higher_is_better=higher, config=b.task))
    c = gate.customEval
    if c is not None:
        import hashlib

        body = local_custom if local_custom is not None else _read_s3(c.dataset, s3_client_factory)
        records = parse_custom_records(body, c.dataset, c.limit)
        data = workdir / "lmeval-custom" / "eval.jsonl"
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        prepared.custom_sha256 = hashlib.sha256(body).hexdigest()
        prepared.tasks.append(PreparedTask(
            name=f"custom:{c.metric}", kind="custom", task=CUSTOM_TASK, metric=c.metric, limit=len(records),
            num_fewshot=0, higher_is_better=c.metric != "perplexity",
            config=custom_task_config(data, c.metric, c.maxNewTokens)))
    return prepared


def _read_s3(uri: str, s3_client_factory) -> bytes:
    from fewerbits_api.s3errors import S3ErrorKind, classify_s3_error

    if s3_client_factory is None:
        raise JobError(errors.DATASET_FETCH_FAILED, f"{uri}: no S3 client configured")
    bucket, key = split_s3_uri(uri)
    try:
        return s3_client_factory().get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as e:  # noqa: BLE001
        if classify_s3_error(e).kind in (S3ErrorKind.NOT_FOUND, S3ErrorKind.BUCKET_NOT_FOUND):
            raise JobError(errors.DATASET_NOT_FOUND, f"spec.quantization.qualityGate.customEval.dataset: {uri}: "
                           "no such object", permanent=True) from e
        raise JobError(errors.DATASET_FETCH_FAILED, f"customEval.dataset {uri}: {type(e).__name__}: {e}") from e


def score(model, tokenizer, prepared: Prepared, max_length: int,
          on_task: Callable[[str], None] | None = None) -> dict[str, Score]:
    """Every prepared task on ``model`` (already loaded), one task at a time so that each has its
    own time; the same seeds and settings on every call."""
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=BATCH_SIZE, max_length=max_length)
    return score_lm(lm, prepared, prepared.tasks, on_task)


def score_lm(lm, prepared: Prepared, tasks: list[PreparedTask], on_task: Callable[[str], None] | None = None,
             limits: dict[str, int] | None = None) -> dict[str, Score]:
    """``tasks`` (of ``prepared``) on any lm-eval model object (``HFLM`` in the Job, an API model
    in the serving canary), with the Job's settings and seeds; ``limits`` cuts a task's document
    count (by result name)."""
    import lm_eval

    manager = _task_manager(prepared.include_paths, prepared.include_defaults)
    out: dict[str, Score] = {}
    for t in tasks:
        if on_task:
            on_task(t.name)
        t0 = time.monotonic()
        limit = (limits or {}).get(t.name, t.limit)
        result = lm_eval.simple_evaluate(
            model=lm, tasks=[t.config], num_fewshot=t.num_fewshot or None, limit=limit, task_manager=manager,
            log_samples=False, bootstrap_iters=1, random_seed=BENCHMARK_SEED, numpy_random_seed=BENCHMARK_SEED,
            torch_random_seed=BENCHMARK_SEED, fewshot_random_seed=BENCHMARK_SEED)
        seconds = time.monotonic() - t0
        out[t.name] = _pick(result, t, seconds)
    return out


def _pick(result: dict, t: PreparedTask, seconds: float) -> Score:
    results = result.get("results", {})
    row = results.get(t.task) or next(iter(results.values()), {})
    key = next((k for k in row if k.split(",")[0] == t.metric and not k.endswith("_stderr")), None)
    if key is None:
        raise JobError(errors.BENCHMARK_INVALID, f"{t.name}: lm-eval reported no {t.metric!r} (got "
                       f"{', '.join(sorted(k for k in row if ',' in k))})", permanent=True)
    value = float(row[key])
    err = row.get(key.replace(",", "_stderr,", 1))
    stderr = float(err) if isinstance(err, (int, float)) and math.isfinite(float(err)) else None
    samples = result.get("n-samples", {}).get(t.task, {}).get("effective") or row.get("sample_len") or t.limit
    return Score(value=value, stderr=stderr, samples=int(samples), seconds=seconds)
