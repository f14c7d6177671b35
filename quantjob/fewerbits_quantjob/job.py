"""The quantization Job: one contract in, one artifact (or one failure) out.

    python -m fewerbits_quantjob            # contract from FEWERBITS_JOB_CONTRACT / _FILE

Stages, each logged with a start and an end line (stage, overall percent, elapsed seconds):
contract -> cache-check -> fetch -> calibration-data -> quantize -> save -> evaluate -> upload ->
manifest. A valid manifest already at ``<storage>/<key>/`` ends the Job at cache-check, before
anything is fetched.

Exit codes: 0 published or cache hit (including a failed quality gate: the artifact is published
with ``quality.passed=false`` and the OPERATOR refuses to roll it out); 1 failed, may succeed on
retry; 2 failed for a reason a retry cannot fix (bad contract, missing model, bad dataset).
The termination message (``FEWERBITS_TERMINATION_LOG``, default /dev/termination-log) holds a
JSON summary under 4 KiB either way.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from pydantic import ValidationError

from fewerbits_api.artifact import (
    FILES_DIR,
    CalibrationUsed,
    Manifest,
    QualityReport,
    artifact_prefix,
    auto_fallback_inputs,
    calibrated_on_fallback,
)
from fewerbits_api.datasets import AUTO_FALLBACK, EVALUATION_SPLITS
from fewerbits_api.endpoints import EndpointRefused, allow_private_from_env, guard_endpoint
from fewerbits_api.formats import QuantFormat
from fewerbits_api.jobcontract import (
    CONTRACT_ENV,
    CONTRACT_FILE_ENV,
    KEY_MISMATCH_MESSAGE,
    TERMINATION_LOG_DEFAULT,
    TERMINATION_LOG_ENV,
    QuantJobContract,
)

from . import adapters, errors, recipes, storage
from .errors import EXIT_FAILED, EXIT_OK, EXIT_PERMANENT, JobError
from .report import Progress, configure_logging, log, one_line, redact, secret_values, termination_message

WORK_DIR_ENV = "FEWERBITS_WORK_DIR"
"""Scratch space for the downloaded model and the checkpoint (an emptyDir in the pod). Default: a
fresh temporary directory, removed at the end."""

KEYED_TOOLS = ("llmcompressor", "compressed-tensors", "transformers")


# --------------------------------------------------------------------------------------- contract
def load_contract(env: Mapping[str, str]) -> QuantJobContract:
    """The contract from ``FEWERBITS_JOB_CONTRACT`` (JSON) or the file ``FEWERBITS_JOB_CONTRACT_FILE``."""
    raw = env.get(CONTRACT_ENV)
    if not raw and env.get(CONTRACT_FILE_ENV):
        try:
            raw = Path(env[CONTRACT_FILE_ENV]).read_text()
        except OSError as e:
            raise JobError(errors.CONTRACT_INVALID, f"{CONTRACT_FILE_ENV}: cannot read {env[CONTRACT_FILE_ENV]} "
                           f"({e.strerror})", permanent=True) from e
    if not raw:
        raise JobError(errors.CONTRACT_INVALID, f"no contract: set {CONTRACT_ENV} or {CONTRACT_FILE_ENV}", permanent=True)
    return parse_contract(raw)


def parse_contract(raw: str | bytes | dict) -> QuantJobContract:
    try:
        if isinstance(raw, dict):
            return QuantJobContract.model_validate(raw)
        return QuantJobContract.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "contract"
        reason = errors.KEY_MISMATCH if KEY_MISMATCH_MESSAGE in str(first.get("msg")) else errors.CONTRACT_INVALID
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise JobError(reason, f"{where}: {first.get('msg')}{more}", permanent=True) from e


def installed_tool_versions() -> dict[str, str]:
    versions: dict[str, str] = {}
    for dist in (*KEYED_TOOLS, "torch", "datasets", "huggingface-hub", "boto3", "fewerbits", "accelerate"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    versions["python"] = ".".join(map(str, sys.version_info[:3]))
    return versions


def verify_contract(contract: QuantJobContract, installed: Mapping[str, str]) -> None:
    """The key must describe what this Job will produce. Everything that decides the bytes is in
    ``keyInputs`` and nowhere else in the contract, so the check is: the key recomputed from
    keyInputs equals the key, and the tool versions a legacy key names (current keys name none)
    are the ones baked into this image."""
    ki = contract.keyInputs
    if ki.key() != contract.key:
        raise JobError(errors.KEY_MISMATCH, KEY_MISMATCH_MESSAGE, permanent=True)
    if ki.tools is None:
        return  # a current key names no tool versions: the manifest records the ones used
    wrong = {t: (ki.tools.get(t), installed.get(t)) for t in KEYED_TOOLS if ki.tools.get(t) != installed.get(t)}
    if wrong:
        detail = ", ".join(f"{t} key={k} image={i}" for t, (k, i) in sorted(wrong.items()))
        raise JobError(errors.TOOL_VERSION_MISMATCH,
                       f"the key names tool versions this image does not have ({detail}); use the matching quantjob image",
                       permanent=True)


def verify_endpoints(contract: QuantJobContract, env: Mapping[str, str], resolve=None) -> None:
    """Refuse a link-local or cloud metadata endpoint, or a private one unless the operator allows
    them (the name as resolved here), before any connection, and pin what was checked for every
    connection the Job makes to it (fewerbits_api.endpoints.guard_endpoint). ``resolve``: tests."""
    adapters = [(f"adapters[{i}].endpoint", a.endpoint) for i, a in enumerate(contract.adapters or ())]
    for field, url in (("source.endpoint", contract.source.endpoint),
                       ("FEWERBITS_SOURCE_S3_ENDPOINT", env.get("FEWERBITS_SOURCE_S3_ENDPOINT")),
                       ("storage.endpoint", contract.storage.endpoint), *adapters):
        try:
            guard_endpoint(url, field, allow_private_from_env(env), resolve)
        except EndpointRefused as e:
            raise JobError(errors.ENDPOINT_REFUSED, str(e), permanent=True) from None


def verify_dataset_hash(expected: str | None, loaded, uri: str) -> None:
    """``keyInputs.calibrationDatasetHash``, when set, must match what was read: the file's
    sha256 (built-in, S3), the S3 ETag, or the hash of the samples used."""
    if not expected:
        return
    accepted = {loaded.sha256, *loaded.details.values()}
    if expected.strip('"') not in accepted:
        raise JobError(errors.DATASET_CHANGED,
                       f"{uri}: content differs from calibrationDatasetHash in the key (the data changed since the key "
                       "was computed)", permanent=True)


def calibration_used(cal, loaded, samples) -> CalibrationUsed:
    """What the manifest and status say of the calibration: what was read, how much, and why it
    is less than the key asks when it is (``shortfall``)."""
    shortfall = None
    if samples.count < cal.samples:
        why = loaded.details.get("fallback") or f"{loaded.read_from} has no more samples"
        shortfall = (f"calibrated on {samples.count} samples ({samples.tokens} tokens) of the {cal.samples} asked: "
                     f"{why}")
    return CalibrationUsed(dataset=cal.dataset, source=redact(loaded.read_from), samples=samples.count,
                           tokens=samples.tokens, requestedSamples=cal.samples, maxSeqLength=cal.maxSeqLength,
                           chatTemplate=samples.chat_template, shortfall=shortfall)


def verify_eval_etag(expected: str | None, loaded, uri: str) -> None:
    """``evalDatasetEtag``, when set, must be the ETag of the S3 evaluation set read: it is part of
    the evaluation identity the result is filed under."""
    if expected and loaded.details.get("etag") != expected.strip('"'):
        raise JobError(errors.DATASET_CHANGED,
                       f"qualityGate.evalDataset {uri}: content differs from the ETag the operator read "
                       f"({expected}); the data changed since, and the next reconcile reads it again", permanent=True)


# -------------------------------------------------------------------------------------------- run
def run(contract: QuantJobContract | str | dict, env: Mapping[str, str] | None = None) -> int:
    """Run the Job; write the termination message; return the exit code (never raises)."""
    env = dict(os.environ) if env is None else dict(env)
    progress = Progress(secrets=secret_values(env))
    term_path = env.get(TERMINATION_LOG_ENV) or TERMINATION_LOG_DEFAULT
    key: str | None = None
    try:
        with progress.stage("contract"):
            if not isinstance(contract, QuantJobContract):
                contract = parse_contract(contract)
            key = contract.key
            installed = installed_tool_versions()
            verify_contract(contract, installed)
            verify_endpoints(contract, env)
            specs = recipes.build_recipe_spec(contract.format, contract.keyInputs.ignore)
            progress.note(f"key={contract.key} format={contract.format.value} "
                          f"source={redact(contract.keyInputs.sourceUri)} "
                          f"storage={contract.storage.uri}")
        summary = _run(contract, env, progress, installed, specs)
        code = EXIT_OK
    except JobError as e:
        summary = _failure(progress, e.stage or progress.current, e.reason, e.message, key)
        code = EXIT_PERMANENT if e.permanent else EXIT_FAILED
    except MemoryError as e:
        summary = _failure(progress, progress.current, errors.OUT_OF_MEMORY, f"host memory exhausted: {e}", key)
        code = EXIT_FAILED
    except Exception as e:  # noqa: BLE001 — every failure ends as a one-line reason, never a bare traceback
        reason = errors.OUT_OF_MEMORY if type(e).__name__ == "OutOfMemoryError" else \
            errors.STAGE_FAILED_REASON.get(progress.current, "Failed")
        log.exception(redact(f"stage={progress.current} unexpected error", progress.secrets))
        summary = _failure(progress, progress.current, reason, f"{type(e).__name__}: {e}", key)
        code = EXIT_FAILED
    write_termination_message(term_path, summary, progress)
    log.info(redact(f"result={summary['result']} exit={code} elapsed={progress.elapsed():.1f}s", progress.secrets))
    return code


def _failure(progress: Progress, stage: str, reason: str, message: str, key: str | None) -> dict:
    message = one_line(redact(message, progress.secrets), 1000)
    log.error(f"stage={stage} failed reason={reason} message={message}")
    summary: dict[str, object] = {"result": "failed", "stage": stage, "reason": reason, "message": message}
    if key:
        summary["key"] = key
    return summary


def write_termination_message(path: str, summary: Mapping[str, object], progress: Progress) -> None:
    text = termination_message(summary)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:  # outside a kubelet /dev/termination-log may not exist: say so, don't fail
        log.warning(f"cannot write the termination message to {path}: {e.strerror}")
    log.info(redact(f"summary {text}", progress.secrets))


def _quality_summary(q: QualityReport | None) -> dict | None:
    if q is None:
        return None
    return {"baselinePerplexity": round(q.baselinePerplexity, 4), "perplexity": round(q.perplexity, 4),
            "increasePercent": round(q.increasePercent, 3), "maxIncreasePercent": q.maxIncreasePercent,
            "passed": q.passed,
            **({"failing": [m.name for m in q.metrics if not m.passed],
                "worstRecoveryPercent": round(min(m.recoveryPercent for m in q.metrics), 2)} if q.metrics else {})}


def _success(result: str, manifest: Manifest, storage_uri: str) -> dict:
    bucket, prefix = artifact_prefix(storage_uri, manifest.key)
    summary: dict[str, object] = {"result": result, "key": manifest.key, "format": manifest.format.value,
                                  "uri": f"s3://{bucket}/{prefix}", "sizeBytes": manifest.totalBytes}
    quality = _quality_summary(manifest.quality)
    if quality is not None:
        summary["quality"] = quality
        if not quality["passed"]:
            summary["note"] = ("quality gate FAILED: the artifact is published with quality.passed=false and the "
                               "operator will not roll it out")
    return summary


def on_fallback(contract: QuantJobContract) -> QuantJobContract:
    """The contract of the artifact an ``auto`` calibration makes on the built-in fallback: the same
    Job, publishing under the fallback's key (fewerbits_api.artifact.auto_fallback_inputs), never
    under the planned key, which names the Hub set. Unchanged for any other contract."""
    inputs = auto_fallback_inputs(contract.keyInputs)
    if inputs is None:
        return contract
    return contract.model_copy(update={"keyInputs": inputs, "key": inputs.key()})


def hub_down(contract: QuantJobContract, env: Mapping[str, str]) -> str | None:
    """Why a quantization whose key names ``auto``'s Hub set cannot read it (the Hub is out of reach,
    hubprobe.py), or None: it can, or the key names other data."""
    from . import textdata

    if contract.mode != "quantize" or auto_fallback_inputs(contract.keyInputs) is None:
        return None
    return textdata.hub_unreachable(env)


def _fallback_note(progress: Progress, contract: QuantJobContract, why: str) -> None:
    progress.note(f"calibration: {why}: calibrating on the built-in {AUTO_FALLBACK} instead of the Hub set, "
                  f"published under the fallback's own key {contract.key}")


def _cache_hit(manifest: Manifest, contract: QuantJobContract, progress: Progress) -> dict:
    """The Job's result when a valid manifest is already at the contract's key."""
    progress.note(f"cache hit: a valid manifest for key {contract.key} exists; nothing to do")
    return _success("cache-hit", manifest, contract.storage.uri)


def _run(contract: QuantJobContract, env: Mapping[str, str], progress: Progress, installed: Mapping[str, str],
         specs: list[recipes.ModifierSpec]) -> dict:
    with progress.stage("cache-check") as st:
        client = storage.storage_client(contract.storage, env)
        manifest, why = storage.read_manifest(client, contract.storage.uri, contract.key)
        offline = hub_down(contract, env) if manifest is None else None
        if offline:  # `auto` without the Hub: the fallback's artifact, under its own key
            contract = on_fallback(contract)
            _fallback_note(progress, contract, offline)
            manifest, why = storage.read_manifest(client, contract.storage.uri, contract.key)
        st.summary["found"] = why.replace(" ", "-").split(";")[0]
        if manifest is not None and contract.mode == "evaluate":
            progress.note(f"evaluation only: artifact {contract.key} exists; measuring it under the current gate")
        elif manifest is not None:
            return _cache_hit(manifest, contract, progress)
        elif contract.mode == "evaluate":
            raise JobError(errors.ARTIFACT_MISSING, f"evaluation only: no artifact at key {contract.key} ({why})",
                           permanent=True)
        progress.note(why)
        storage.check_bucket(client, contract.storage.uri)

    if contract.mode == "evaluate":
        return _evaluate_only(contract, env, progress, client, manifest)
    own_workdir = not env.get(WORK_DIR_ENV)
    workdir = Path(env.get(WORK_DIR_ENV) or tempfile.mkdtemp(prefix="fewerbits-quantjob-"))
    try:
        return _produce_and_publish(contract, env, progress, installed, specs, client, workdir, offline)
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _produce_and_publish(contract, env, progress: Progress, installed, specs, client, workdir: Path,
                         offline: str | None = None) -> dict:
    """Fetch, calibrate, quantize, evaluate, upload, manifest. ``offline``: why the Hub is out of
    reach when the cache check found it so (the contract is then already the fallback's)."""
    from .fetch import fetch_source

    workdir.mkdir(parents=True, exist_ok=True)
    if contract.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise JobError(errors.NO_GPU, "device 'cuda' requested but no GPU is visible to the Job", stage="quantize")

    with progress.stage("fetch") as st:
        fetched = fetch_source(contract, env, workdir, st)

    quality: QualityReport | None = None
    calibration: CalibrationUsed | None = None
    if contract.format is QuantFormat.NONE:
        out = fetched.path  # the base weights are the artifact
        progress.note("format none: publishing the base weights unchanged (no quantization, no evaluation)")
    else:
        loaded, calibrated = _calibration_data(contract, env, progress, offline)
        if calibrated.key != contract.key:  # the Hub answered the probe, then failed the read
            contract = calibrated
            manifest, _ = storage.read_manifest(client, contract.storage.uri, contract.key)
            if manifest is not None:
                return _cache_hit(manifest, contract, progress)
        out = workdir / "quantized"
        out, quality, calibration = _quantize_and_evaluate(contract, env, progress, specs, fetched.path, out, loaded)

    with progress.stage("upload") as st:
        uploaded = storage.upload_directory(client, out, contract.storage.uri, contract.key, st, env)
        quality = adapters.publish(client, contract, workdir, quality, st)

    with progress.stage("manifest"):
        tools = dict(installed)
        tools.update(_runtime_facts())
        manifest = Manifest(
            key=contract.key, keyInputs=contract.keyInputs, format=contract.format,
            resolvedRevision=fetched.resolved_revision, files=uploaded.files, totalBytes=uploaded.total_bytes,
            quality=quality, calibration=calibration, tools=tools, timings=dict(progress.timings),
            createdAt=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        manifest.timings["upload"] = round(uploaded.seconds, 3)
        storage.write_manifest(client, contract.storage.uri, manifest)
    return _success("published", manifest, contract.storage.uri)


def _runtime_facts() -> dict[str, str]:
    import torch

    facts = {"torch.cuda": str(torch.version.cuda or "none")}
    if torch.cuda.is_available():
        facts["device"] = torch.cuda.get_device_name(0)
        facts["deviceCount"] = str(torch.cuda.device_count())
    else:
        facts["device"] = "cpu"
    return facts


def _calibration_data(contract: QuantJobContract, env, progress: Progress, offline: str | None = None):
    """(the calibration samples or None, the contract they make): ``auto``'s fallback read where
    the key still names the Hub set (the Hub answered the probe, then failed the read) switches the
    contract to the fallback's key (``on_fallback``); the key's hash is then checked against what
    was read. ``offline``: why the Hub is out of reach, known already (the fallback is read)."""
    from . import textdata

    cal = contract.calibration
    if cal is None:
        return None, contract
    s3_factory = lambda: storage.storage_client(contract.storage, env)  # noqa: E731 — datasets live in the store
    with progress.stage("calibration-data") as st:
        loaded = textdata.load_calibration(cal.dataset, env, s3_factory, limit=cal.samples, hub_down=offline)
        if (why := loaded.details.get("fallback")) and not calibrated_on_fallback(contract.keyInputs):
            contract = on_fallback(contract)
            _fallback_note(progress, contract, why)
        verify_dataset_hash(contract.keyInputs.calibrationDatasetHash, loaded, cal.dataset)
        st.summary.update(samples=len(loaded.texts), requested=cal.samples, sha256=loaded.sha256[:16],
                          source=redact(loaded.read_from))
    return loaded, contract


def _quantize_and_evaluate(contract: QuantJobContract, env, progress: Progress, specs, source: Path, out: Path,
                           loaded):
    from . import quantize

    cal = contract.calibration
    used = None
    eval_set, prepared = _prepare_evaluation(contract, env, progress, workdir=out.parent)

    with progress.stage("quantize") as st:
        model, tokenizer = quantize.load_for_quantization(source, contract.source.trustRemoteCode)
        st.report(0.1, loaded=type(model).__name__)
        samples = quantize.calibration_samples(loaded, tokenizer, cal.maxSeqLength) if cal and loaded else None
        if cal is not None and loaded is not None and samples is not None:
            used = calibration_used(cal, loaded, samples)
            st.summary.update(calibrationSamples=used.samples, calibrationTokens=used.tokens)
            if used.shortfall:
                progress.note(f"calibration: {used.shortfall}")
        model = quantize.run_oneshot(model, tokenizer, contract.format, specs, samples,
                                     cal.maxSeqLength if cal else None, progress) or model

    with progress.stage("save") as st:
        quantize.save_checkpoint(model, tokenizer, source, out)
        st.summary["files"] = len(storage.list_artifact_files(out))
        quantize.release(model)
        del model

    with progress.stage("evaluate") as st:
        quality = _evaluate(contract, progress, st, source, out, tokenizer, eval_set, prepared)
    return out, quality, used


def _prepare_evaluation(contract: QuantJobContract, env, progress: Progress, workdir: Path):
    """The evaluation text, benchmark tasks and custom set, read and checked before any model is
    loaded: bad input fails here, naming the field, before GPU time is spent; and the LoRA
    adapters' files and texts (adapters.prepare: one that cannot be read is its own failure)."""
    from . import lmeval, textdata

    gate = contract.qualityGate
    s3_factory = lambda: storage.storage_client(contract.storage, env)  # noqa: E731
    with progress.stage("eval-data") as st:
        eval_set = textdata.load_texts(gate.evalDataset, env, s3_factory, splits=EVALUATION_SPLITS)
        verify_eval_etag(contract.evalDatasetEtag, eval_set, gate.evalDataset)
        prepared = lmeval.prepare(gate, workdir, s3_factory)
        adapter_inputs = adapters.prepare(contract, env, workdir, s3_factory, note=progress.note)
        st.summary.update(evalSamples=len(eval_set.texts), tasks=len(prepared.tasks),
                          adapters=len(contract.adapters or ()))
    return eval_set, (prepared, adapter_inputs)


def _evaluate(contract: QuantJobContract, progress: Progress, st, source: Path, out: Path, tokenizer, eval_set,
              inputs):
    from . import gate as quality_gate

    gate = contract.qualityGate
    prepared, (specs, failures) = inputs
    meter = None
    if specs:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(source, trust_remote_code=contract.source.trustRemoteCode)
        meter = adapters.AdapterMeter.for_config(tokenizer, contract.evalMaxSeqLength, config, specs, note=progress.note)
    quality = quality_gate.measure(source, out, tokenizer, eval_set.texts, gate.evalDataset, eval_set.sha256, gate,
                                   contract.evalMaxSeqLength, contract.source.trustRemoteCode, prepared,
                                   on_progress=lambda f: st.report(f), note=progress.note,
                                   also=meter.hook if meter is not None else None)
    if contract.adapters:
        quality = quality.model_copy(update={"adapters": adapters.report(contract, meter, failures)})
        for a in quality.adapters:
            progress.note(f"adapter={a.name} base={a.baselinePerplexity} quantized={a.perplexity} "
                          f"increase={a.increasePercent} max={a.maxIncreasePercent} passed={str(a.passed).lower()}"
                          + (f" error={a.error}" if a.error else ""))
    for m in quality.metrics:
        progress.note(f"metric={m.name} base={m.base:.4f} quantized={m.quantized:.4f} "
                      f"recovery={m.recoveryPercent:.2f}% min={m.minRecoveryPercent:.2f}% "
                      f"passed={str(m.passed).lower()} seconds={m.seconds:.1f}")
    st.summary.update(baseline=f"{quality.baselinePerplexity:.4f}", quantized=f"{quality.perplexity:.4f}",
                      increase=f"{quality.increasePercent:+.3f}%", gate=f"<={gate.maxPerplexityIncreasePercent}%",
                      passed=str(quality.passed).lower(), windows=quality.evalWindows, metrics=len(quality.metrics))
    return quality


def _evaluate_only(contract: QuantJobContract, env, progress: Progress, client, manifest: Manifest) -> dict:
    """Measure an existing artifact under the current gate; write the result beside it
    (``<key>/quality/<identity>.json``). The artifact's files and manifest are never written."""
    from fewerbits_api.quality import eval_identity, quality_result_key

    from .fetch import fetch_source

    identity = eval_identity(contract.qualityGate)
    bucket, prefix = artifact_prefix(contract.storage.uri, contract.key)
    result_key = quality_result_key(prefix, identity)
    own_workdir = not env.get(WORK_DIR_ENV)
    workdir = Path(env.get(WORK_DIR_ENV) or tempfile.mkdtemp(prefix="fewerbits-evaljob-"))
    try:
        eval_set, prepared = _prepare_evaluation(contract, env, progress, workdir)
        with progress.stage("fetch") as st:
            fetched = fetch_source(contract, env, workdir, st)
            out = workdir / "artifact"
            storage.download_prefix(client, bucket, f"{prefix}{FILES_DIR}/", out)
        with progress.stage("evaluate") as st:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(fetched.path, trust_remote_code=contract.source.trustRemoteCode)
            quality = _evaluate(contract, progress, st, fetched.path, out, tokenizer, eval_set, prepared)
        with progress.stage("manifest") as st:
            quality = adapters.publish(client, contract, workdir, quality, st)
            body = json.dumps(quality.to_wire(), indent=2, sort_keys=True).encode()
            client.put_object(Bucket=bucket, Key=result_key, Body=body, ContentType="application/json")
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    summary = _success("evaluated", manifest.model_copy(update={"quality": quality}), contract.storage.uri)
    summary["evalIdentity"] = identity
    return summary


# ------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    configure_logging()
    env = dict(os.environ)
    progress = Progress(secrets=secret_values(env))
    try:
        contract = load_contract(env)
    except JobError as e:
        summary = _failure(progress, "contract", e.reason, e.message, None)
        write_termination_message(env.get(TERMINATION_LOG_ENV) or TERMINATION_LOG_DEFAULT, summary, progress)
        return EXIT_PERMANENT
    if contract.device == "cpu":
        # Before torch is imported: a GPU node asked to run on the CPU must not touch its GPUs.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return run(contract, env)


def contract_json_for_logs(contract: QuantJobContract) -> str:
    """The contract holds no secret (jobcontract.py); still redact URLs before showing it."""
    return redact(json.dumps(contract.to_wire(), sort_keys=True))
