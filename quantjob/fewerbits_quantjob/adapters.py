"""The per-adapter gate (issue 43): each LoRA adapter measured on the quantized base against the same
adapter on the 16-bit base, by perplexity on the adapter's own evaluation text.

It rides on the perplexity pass the Job already makes (``evaluate.evaluate_pair``, one model in
memory at a time): :meth:`AdapterMeter.hook` is its ``with_model(which, model)``, or is called from
it. For the loaded model, each adapter in turn is attached with peft (its LoRA layers wrapped around
the model's own Linear modules, in place: no copy of the base), scored on the adapter's windows with
``evaluate.window_nlls``, and detached, so that whatever else runs in the same hook (the benchmarks,
the custom set) sees the model exactly as it was loaded.

    meter = AdapterMeter(tokenizer, length, [AdapterSpec("plays", Path("/adapters/plays"), texts, 64, 3.0)])
    ppl = evaluate.evaluate_pair(base, quantized, tokenizer, texts, max_seq_length, count,
                                 trust_remote_code, with_model=meter.hook)
    for r in meter.results():          # AdapterResult per adapter measured on both
        ...
    for name, err in meter.failures.items():   # AdapterError per adapter that could not be measured
        ...

Windows are built once per adapter, from the base's tokenizer (``evaluate.build_windows``, the
length ``evaluate.window_length`` gives the base measurement): both bases see exactly the same
token ids. An adapter that cannot be attached (target modules the base lacks, shapes that do not
match, a file missing) is recorded as an :class:`AdapterError` naming it, the model is put back,
and the other adapters and the base's own gate go on; with ``raise_errors=True`` the error is
raised instead (a ``JobError``: the Job reports it without a traceback).

peft on a compressed-tensors checkpoint (``evaluate.load_bf16`` of an llm-compressor artifact):
its modules stay ``torch.nn.Linear`` (packed or FP8 weights, a forward that decompresses on the
fly), so peft's plain LoRA ``Linear`` wraps them and calls their own forward; the adapter's weights
stay float32 (peft's default upcast), on both bases alike.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import errors, evaluate
from .errors import JobError

ADAPTER_INVALID = "AdapterInvalid"
"""JobError reason of an adapter that cannot be measured on the base (the operator's condition
reason for an adapter that does not fit)."""

SLOT = "fewerbits_adapter"
"""peft's name for the adapter while it is attached (one at a time): an adapter's own name may hold
dots, which peft's module dictionaries refuse."""

WHICH = ("base", "quantized")


class AdapterError(JobError):
    """An adapter that cannot be measured on this base; ``adapter`` names it."""

    def __init__(self, adapter: str, message: str):
        super().__init__(ADAPTER_INVALID, f"adapter {adapter!r}: {message}", permanent=True)
        self.adapter = adapter


@dataclass(frozen=True)
class AdapterSpec:
    """What one adapter's measurement needs."""

    name: str
    path: Path
    """Local peft adapter directory: adapter_config.json and adapter_model.safetensors."""
    texts: list[str]
    """Its evaluation texts (samples, in order)."""
    eval_samples: int
    """Windows to score (the gate's evalSamples)."""
    max_increase_percent: float
    """Largest perplexity increase (percent) of the adapter on the quantized base that passes."""


@dataclass
class AdapterResult:
    """One adapter's gate, field names as the API's (camelCase)."""

    name: str
    baselinePerplexity: float
    """The adapter on the 16-bit base."""
    perplexity: float
    """The adapter on the quantized base."""
    increasePercent: float
    maxIncreasePercent: float
    passed: bool
    windows: int
    tokens: int
    ci95Low: float | None = None
    """95% interval of the increase (percent), paired per window; None with one window."""
    ci95High: float | None = None


@dataclass
class _Scores:
    nlls: list[float]
    tokens: list[int]
    seconds: float


def judge(name: str, base_nlls: Sequence[float], quant_nlls: Sequence[float], tokens: Sequence[int],
          max_increase_percent: float) -> AdapterResult:
    """The gate from per-window NLLs of the adapter on the 16-bit (``base_nlls``) and the quantized
    base, on the same windows. A perplexity that is not finite never passes."""
    if len(base_nlls) != len(quant_nlls) or len(base_nlls) != len(tokens) or not tokens:
        raise ValueError(f"adapter {name!r}: per-window scores do not pair ({len(base_nlls)}, {len(quant_nlls)}, "
                         f"{len(tokens)} windows)")
    total = max(sum(tokens), 1)
    base_ppl = _exp(sum(base_nlls) / total)
    quant_ppl = _exp(sum(quant_nlls) / total)
    increase = (quant_ppl / base_ppl - 1.0) * 100.0 if math.isfinite(base_ppl) and base_ppl > 0 else math.nan
    low = high = None
    if len(tokens) >= 2 and math.isfinite(increase):
        low, high, _half = evaluate.paired_increase_interval(list(base_nlls), list(quant_nlls), list(tokens))
    passed = math.isfinite(increase) and math.isfinite(quant_ppl) and increase <= max_increase_percent
    return AdapterResult(name=name, baselinePerplexity=base_ppl, perplexity=quant_ppl, increasePercent=increase,
                         maxIncreasePercent=max_increase_percent, passed=bool(passed), windows=len(tokens),
                         tokens=sum(tokens), ci95Low=low, ci95High=high)


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


@dataclass
class AdapterMeter:
    """Scores every adapter on each model handed to :meth:`hook`; built once, before the models load.

    ``window_length`` is the base measurement's (``evaluate.window_length(max_seq_length, config)``;
    :meth:`for_config` computes it). ``on_progress(fraction)`` gets this meter's own share of the
    work done (0..1, both models); ``note(line)`` one line per adapter per model."""

    tokenizer: object
    window_length: int
    adapters: Sequence[AdapterSpec]
    on_progress: Callable[[float], None] | None = None
    note: Callable[[str], None] | None = None
    raise_errors: bool = False
    failures: dict[str, AdapterError] = field(default_factory=dict, init=False)
    """Adapters that could not be measured, by name (their windows or their attachment failed)."""
    _windows: dict[str, object] = field(default_factory=dict, init=False, repr=False)
    _scores: dict[str, dict[str, _Scores]] = field(default_factory=dict, init=False, repr=False)
    _done: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        names = [a.name for a in self.adapters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"adapter names must be unique: {', '.join(dupes)}")
        for spec in self.adapters:
            try:
                self._check_files(spec)
                if not any(isinstance(t, str) and t.strip() for t in spec.texts):
                    raise AdapterError(spec.name, "its evaluation text is empty")
                windows = evaluate.build_windows(self.tokenizer, list(spec.texts), self.window_length,
                                                 max(1, int(spec.eval_samples)))
                if windows.shape[1] < 2:
                    raise AdapterError(spec.name, "its evaluation text has no tokens to score")
                self._windows[spec.name] = windows
            except AdapterError as e:
                self._fail(e)
        self._total = 2 * sum(int(w.shape[0]) for w in self._windows.values())

    @classmethod
    def for_config(cls, tokenizer, max_seq_length: int, config, adapters: Sequence[AdapterSpec],
                   **kwargs) -> AdapterMeter:
        """A meter whose windows have the base measurement's length for this model ``config``."""
        return cls(tokenizer, evaluate.window_length(max_seq_length, config), adapters, **kwargs)

    # ------------------------------------------------------------------------------------ measure
    def hook(self, which: str, model) -> None:
        """``evaluate_pair``'s ``with_model``: score every adapter on ``model`` ("base" is the
        16-bit base, "quantized" the quantized one); the model is left as it came."""
        if which not in WHICH:
            raise ValueError(f"which must be one of {', '.join(WHICH)}, not {which!r}")
        for spec in self.adapters:
            if spec.name in self.failures:
                continue
            try:
                self._scores.setdefault(spec.name, {})[which] = self._score(spec, which, model)
            except AdapterError as e:
                self._fail(e)
                measured = len(self._scores.get(spec.name, {}))  # its share of both models counts as done
                self._done += (len(WHICH) - measured) * int(self._windows[spec.name].shape[0])
                self._progress()
                continue
            s = self._scores[spec.name][which]
            ppl = _exp(sum(s.nlls) / max(sum(s.tokens), 1))
            self._note(f"adapter {spec.name} on the {'16-bit' if which == 'base' else 'quantized'} base: "
                       f"perplexity {ppl:.4f} windows={len(s.tokens)} tokens={sum(s.tokens)} seconds={s.seconds:.1f}")

    __call__ = hook

    def _score(self, spec: AdapterSpec, which: str, model) -> _Scores:
        windows = self._windows[spec.name]
        start = self._done
        _settle(model)
        before = _fingerprint(model)
        t0 = time.monotonic()
        try:
            attach(model, spec.path, spec.name)
            nlls, tokens = evaluate.window_nlls(model, windows, self._on_batch(start))
        except AdapterError:
            raise
        except Exception as e:  # a forward that fails with the adapter on (shapes peft did not check)
            if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
                raise  # the Job's, not the adapter's
            raise AdapterError(spec.name, f"scoring failed with the adapter attached: {_one_line(e)}") from e
        finally:
            detach(model, before)
        self._done = start + int(windows.shape[0])
        return _Scores(nlls, tokens, time.monotonic() - t0)

    def _on_batch(self, start: int):
        if not self.on_progress:
            return None

        def report(done: int, _n: int) -> None:
            self.on_progress(min(1.0, (start + done) / max(self._total, 1)))

        return report

    def _progress(self) -> None:
        if self.on_progress:
            self.on_progress(min(1.0, self._done / max(self._total, 1)))

    def _fail(self, err: AdapterError) -> None:
        if self.raise_errors:
            raise err
        self.failures[err.adapter] = err
        self._note(err.message)

    def _note(self, line: str) -> None:
        if self.note:
            self.note(line)

    @staticmethod
    def _check_files(spec: AdapterSpec) -> None:
        path = Path(spec.path)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            if not (path / name).is_file():
                raise AdapterError(spec.name, f"{name} is missing from its directory")

    # ------------------------------------------------------------------------------------- judge
    def results(self) -> list[AdapterResult]:
        """One result per adapter measured on both bases, in the order given (failures are in
        :attr:`failures`). Raises when an adapter was measured on one base only."""
        out = []
        for spec in self.adapters:
            if spec.name in self.failures:
                continue
            scores = self._scores.get(spec.name, {})
            missing = [w for w in WHICH if w not in scores]
            if missing:
                raise RuntimeError(f"adapter {spec.name!r} was not measured on the {' and '.join(missing)} model")
            base, quant = scores["base"], scores["quantized"]
            if base.tokens != quant.tokens:
                raise RuntimeError(f"adapter {spec.name!r}: the two bases scored different windows")
            out.append(judge(spec.name, base.nlls, quant.nlls, base.tokens, spec.max_increase_percent))
        return out

    def nlls(self, name: str, which: str) -> tuple[list[float], list[int]]:
        """Per-window NLLs and tokens of adapter ``name`` on model ``which`` (as measured)."""
        s = self._scores[name][which]
        return list(s.nlls), list(s.tokens)


# ------------------------------------------------------------------------------ attach / detach
def attach(model, path: Path, name: str) -> None:
    """Wrap ``model``'s modules with the LoRA adapter at ``path`` (in place, in eval mode). The
    caller detaches it with :func:`detach`. Raises AdapterError naming ``name`` when the adapter
    does not fit (and then leaves no LoRA layer behind)."""
    from peft import PeftConfig, PeftModel
    from peft.utils import PeftType
    from peft.utils.save_and_load import load_peft_weights, set_peft_model_state_dict

    _settle(model)
    try:
        config = PeftConfig.from_pretrained(str(path))
    except Exception as e:
        raise AdapterError(name, f"adapter_config.json cannot be read: {_one_line(e)}") from e
    if config.peft_type != PeftType.LORA:
        raise AdapterError(name, f"peft_type {getattr(config.peft_type, 'value', config.peft_type)} is not LoRA")
    config.inference_mode = True
    try:
        weights = load_peft_weights(str(path), device="cpu")
    except Exception as e:
        raise AdapterError(name, f"adapter_model.safetensors cannot be read: {_one_line(e)}") from e
    try:
        wrapped = PeftModel(model, config, adapter_name=SLOT)
    except Exception as e:
        _strip(model)
        raise AdapterError(name, f"does not fit the base: {_one_line(e)}") from e
    try:
        loaded = set_peft_model_state_dict(wrapped, weights, adapter_name=SLOT)
        own = {n for n, _ in wrapped.named_parameters() if f".{SLOT}." in n}
        missing = sorted(k for k in loaded.missing_keys if k in own)
        unexpected = sorted(loaded.unexpected_keys)
        if missing or unexpected:
            parts = []
            if unexpected:
                parts.append(f"{len(unexpected)} weights name no layer of the base (first {_short(unexpected[0])})")
            if missing:
                parts.append(f"{len(missing)} adapted layers get no weights (first {_short(missing[0])})")
            raise AdapterError(name, "does not fit the base: " + "; ".join(parts))
        for module in model.modules():
            if _is_tuner_layer(module):
                module.eval()
    except AdapterError:
        _strip(model)
        raise
    except Exception as e:
        _strip(model)
        raise AdapterError(name, f"does not fit the base: {_one_line(e)}") from e


def detach(model, before=None) -> None:
    """Remove every LoRA layer from ``model`` (each module back to the Linear it wrapped) and undo
    what peft set on it. With ``before`` (:func:`_fingerprint` taken before :func:`attach`), the
    parameters' flags and modules' modes are restored to it and the model checked against it."""
    _strip(model)
    if before is None:
        return
    _restore(model, before)
    after = _fingerprint(model)
    if after != before:
        diff = _first_difference(before, after)
        raise JobError(errors.EVALUATION_FAILED, f"detaching an adapter left the model changed ({diff})")


def _settle(model) -> None:
    """Let a compressed-tensors model decompress itself, as its first forward pass would: until
    then its int4 modules hold ``weight_packed`` and no ``weight``, which peft needs to wrap them
    (``evaluate_pair`` has always run a forward before its hook; this covers any other caller)."""
    if getattr(model, "ct_decompress_hook", None) is None:
        return
    import torch

    device = next(model.parameters()).device
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=device))


def _is_tuner_layer(module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer)


def _strip(model) -> None:
    """Replace each peft tuner layer (and auxiliary wrapper) in ``model`` by the module it wraps."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # older peft
        AuxiliaryTrainingWrapper = ()  # noqa: N806
    changed = True
    while changed:  # replacing changes named_modules: start over until none is left
        changed = False
        for qualified, module in list(model.named_modules()):
            if not qualified:
                continue
            if isinstance(module, BaseTunerLayer):
                original = module.get_base_layer()
            elif AuxiliaryTrainingWrapper and isinstance(module, AuxiliaryTrainingWrapper):
                original = module.original_module
            else:
                continue
            parent_name, _, child = qualified.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, original)
            changed = True
            break
    if "peft_config" in getattr(model, "__dict__", {}):
        del model.peft_config


def _fingerprint(model) -> dict:
    """What an attached-then-detached adapter must leave as it was: the module tree (identity,
    type, mode, hooks), every parameter and buffer (identity, dtype, device, requires_grad) and
    the config."""
    modules = tuple((n, id(m), type(m).__name__, m.training, len(m._forward_hooks), len(m._forward_pre_hooks))
                    for n, m in model.named_modules())
    params = tuple((n, id(p), p.dtype, str(p.device), p.requires_grad) for n, p in model.named_parameters())
    buffers = tuple((n, id(b), b.dtype, str(b.device)) for n, b in model.named_buffers())
    config = getattr(model, "config", None)
    return {"modules": modules, "parameters": params, "buffers": buffers,
            "config": config.to_json_string() if hasattr(config, "to_json_string") else None,
            "attributes": tuple(sorted(getattr(model, "__dict__", {})))}


def _restore(model, before: dict) -> None:
    """Put back what peft changes on the base without replacing it: requires_grad (it freezes every
    base parameter), modules' train/eval mode, the config's pretraining_tp."""
    grads = {n: g for n, _i, _d, _dev, g in before["parameters"]}
    for n, p in model.named_parameters():
        if n in grads and p.requires_grad != grads[n]:
            p.requires_grad_(grads[n])
    modes = {n: t for n, _i, _ty, t, _h, _p in before["modules"]}
    for n, m in model.named_modules():
        if n in modes and m.training != modes[n]:
            m.training = modes[n]
    config = getattr(model, "config", None)
    if before["config"] is not None and hasattr(config, "pretraining_tp"):
        import json

        old = json.loads(before["config"]).get("pretraining_tp")
        if old is not None and config.pretraining_tp != old:
            config.pretraining_tp = old


def _first_difference(before: dict, after: dict) -> str:
    for key in before:
        if before[key] == after[key]:
            continue
        if isinstance(before[key], tuple):
            for old, new in zip(before[key], after[key]):
                if old != new:
                    return f"{key}: {old[0] if isinstance(old, tuple) else old!r}"
            return f"{key}: {len(before[key])} before, {len(after[key])} after"
        return key
    return "nothing"


def _short(key: str) -> str:
    return key.replace(f".{SLOT}", "").removeprefix("base_model.model.")


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


# ------------------------------------------------------------------ the Job's side


def adapter_dir(workdir: Path, index: int) -> Path:
    """Where the Job keeps ``contract.adapters[index]``'s files (prepare fetches, publish uploads)."""
    return workdir / "adapters" / str(index)


def eval_texts(a, env, s3_factory) -> list[str]:
    """An adapter's (an ``AdapterEvaluation``'s) evaluation texts, its S3 set pinned to the ETag
    the operator read: other bytes are a permanent ``DatasetChanged`` (the next reconcile reads
    it again); a transient read error raises as it is (the Job or canary is retried)."""
    from fewerbits_api.datasets import EVALUATION_SPLITS

    from . import textdata

    loaded = textdata.load_texts(a.evalDataset, env, s3_factory, splits=EVALUATION_SPLITS)
    if a.evalDatasetEtag and loaded.details.get("etag") != a.evalDatasetEtag.strip('"'):
        raise JobError(errors.DATASET_CHANGED, f"its evaluation set {a.evalDataset} differs from the ETag the "
                       f"operator read ({a.evalDatasetEtag}); the next reconcile reads it again", permanent=True)
    return list(loaded.texts)


def prepare(contract, env, workdir: Path, s3_factory, note: Callable[[str], None] | None = None
            ) -> tuple[list[AdapterSpec], dict[str, str]]:
    """Every adapter of the contract fetched (``workdir/adapters/<index>``) and its evaluation text
    read, before any model loads. An adapter that is not there or refused is recorded as its
    failure (its figures: none, its verdict: not passed) and the base's gate goes on; a transient
    error fails the Job, which is retried."""
    from .fetch import fetch_adapter

    specs: list[AdapterSpec] = []
    failures: dict[str, str] = {}
    for i, a in enumerate(contract.adapters or ()):
        try:
            path = fetch_adapter(a, i, contract, env, adapter_dir(workdir, i))
            texts = eval_texts(a, env, s3_factory)
        except JobError as e:
            if not e.permanent:
                raise  # a transient read: the Job is retried, nothing is recorded against the adapter
            failures[a.name] = e.message
            if note:
                note(f"adapter {a.name}: not measured: {e.message}")
            continue
        specs.append(AdapterSpec(a.name, path, list(texts), a.evalSamples, a.maxIncreasePercent))
    return specs, failures


def report(contract, meter: AdapterMeter | None, failures: dict[str, str]):
    """The quality report's ``adapters``: one ``AdapterQuality`` per contract adapter, in its order."""
    from fewerbits_api.adapters import AdapterQuality

    measured = {r.name: r for r in meter.results()} if meter is not None else {}
    errors_ = {**failures, **({n: e.message for n, e in meter.failures.items()} if meter is not None else {})}
    out = []
    for a in contract.adapters or ():
        r = measured.get(a.name)
        if r is None:
            out.append(AdapterQuality(name=a.name, maxIncreasePercent=a.maxIncreasePercent, passed=False,
                                      error=errors_.get(a.name, "not measured")))
            continue
        finite = all(math.isfinite(x) for x in (r.baselinePerplexity, r.perplexity, r.increasePercent))
        out.append(AdapterQuality(
            name=a.name, baselinePerplexity=r.baselinePerplexity if finite else None,
            perplexity=r.perplexity if finite else None, increasePercent=r.increasePercent if finite else None,
            maxIncreasePercent=r.maxIncreasePercent, passed=r.passed, windows=r.windows, tokens=r.tokens,
            increaseCI95=[r.ci95Low, r.ci95High] if r.ci95Low is not None else None,
            error=None if finite else "its perplexity is not finite on one of the bases"))
    return out



def publish(client, contract, workdir: Path, quality, stage):
    """Every measured adapter's files published to the model's storage under their content key
    (``fewerbits_api.artifact.adapter_key_inputs``), so serving pods fetch and verify them as they
    do an artifact; ``quality`` (a QualityReport) comes back with each adapter's ``adapterKey``. An
    adapter already published under its key is left as it is (the key names its bytes); the
    manifest is written after its files, as an artifact's."""
    from datetime import datetime, timezone

    from fewerbits_api.artifact import Manifest, adapter_key_inputs

    from . import storage

    if quality is None or not quality.adapters:
        return quality
    storage_uri = contract.storage.uri
    paths = {a.name: adapter_dir(workdir, i) for i, a in enumerate(contract.adapters or ())}
    sources = {a.name: a for a in contract.adapters or ()}
    out = []
    for q in quality.adapters:
        path = paths.get(q.name)
        if path is None or q.error is not None:
            out.append(q)
            continue
        digests = {rel.as_posix(): storage.sha256_file(path / rel) for rel in storage.list_artifact_files(path)}
        inputs = adapter_key_inputs(sources[q.name].uri, sources[q.name].revision, digests)
        key = inputs.key()
        manifest, _why = storage.read_manifest(client, storage_uri, key)  # parsed: its files are the key's
        if manifest is None:
            uploaded = storage.upload_directory(client, path, storage_uri, key, stage)
            manifest = Manifest(key=key, keyInputs=inputs, format=inputs.format, files=uploaded.files,
                                totalBytes=uploaded.total_bytes,
                                createdAt=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
            storage.write_manifest(client, storage_uri, manifest)
        else:  # published before, maybe since unreferenced: its sweep mark goes, as the report names it again
            from fewerbits_api.artifact import artifact_prefix
            from fewerbits_api.names import UNREFERENCED_MARKER

            bucket, prefix = artifact_prefix(storage_uri, key)
            try:
                client.delete_object(Bucket=bucket, Key=prefix + UNREFERENCED_MARKER)
            except Exception as e:  # noqa: BLE001 - not the base's failure: the next sweep clears it as referenced
                stage.progress.note(f"adapter {q.name}: its retention mark stays ({type(e).__name__})")
        stage.progress.note(f"adapter {q.name}: published as {key} ({manifest.totalBytes} bytes)")
        out.append(q.model_copy(update={"adapterKey": key, "sizeBytes": manifest.totalBytes}))
    return quality.model_copy(update={"adapters": out})
