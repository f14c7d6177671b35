"""Pure tests of the quantization Job: recipes, key verification, the termination message,
redaction and the dataset loaders. No S3 server, no model (those are in
tests/integration/test_quantjob.py)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import tomllib
from pathlib import Path

import pytest

from fewerbits_api.artifact import QUANTJOB_TOOL_VERSIONS, ArtifactKeyInputs
from fewerbits_api.formats import FORMAT_FACTS, QUANTIZED_FORMATS, QuantFormat
from fewerbits_api.datasets import BUILTIN_DATASET_SHA256
from fewerbits_api.jobcontract import TERMINATION_MESSAGE_MAX_BYTES, QuantJobContract
from fewerbits_quantjob import errors, job, recipes, report, textdata
from fewerbits_quantjob.errors import JobError

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------- recipes
EXPECTED_KINDS = {
    QuantFormat.FP8_DYNAMIC: ["QuantizationModifier"],
    QuantFormat.FP8_BLOCK: ["QuantizationModifier"],
    QuantFormat.W4A16_AWQ: ["AWQModifier", "QuantizationModifier"],
    QuantFormat.W4A16_GPTQ: ["GPTQModifier"],
    QuantFormat.W8A8_INT8: ["SmoothQuantModifier", "GPTQModifier"],
    QuantFormat.W4AFP8: ["QuantizationModifier"],
    QuantFormat.NVFP4: ["QuantizationModifier"],
    QuantFormat.NVFP4A16: ["QuantizationModifier"],
}


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS, ids=lambda f: f.value)
def test_recipe_per_format_follows_the_design_table(fmt):
    specs = recipes.build_recipe_spec(fmt, ["lm_head", "re:.*gate$"])
    assert [s.kind for s in specs] == EXPECTED_KINDS[fmt]
    quantizer = specs[-1]
    assert quantizer.kwargs["scheme"] == FORMAT_FACTS[fmt].llmcompressor_scheme
    assert quantizer.kwargs["targets"] == ["Linear"]
    # ignore reaches every modifier that takes one (AWQModifier takes none in 0.14: it follows the
    # quantizer's schemes, see recipes.py).
    for spec in specs:
        if spec.kind != "AWQModifier":
            assert spec.kwargs["ignore"] == ["lm_head", "re:.*gate$"], spec


def test_design_table_schemes():
    schemes = {f: recipes.build_recipe_spec(f, [])[-1].kwargs["scheme"] for f in QUANTIZED_FORMATS}
    assert schemes == {QuantFormat.FP8_DYNAMIC: "FP8_DYNAMIC", QuantFormat.FP8_BLOCK: "FP8_BLOCK",
                       QuantFormat.W4A16_AWQ: "W4A16_ASYM", QuantFormat.W4A16_GPTQ: "W4A16",
                       QuantFormat.W8A8_INT8: "W8A8", QuantFormat.W4AFP8: "W4AFP8", QuantFormat.NVFP4: "NVFP4",
                       QuantFormat.NVFP4A16: "NVFP4A16"}


def test_none_and_auto():
    assert recipes.build_recipe_spec(QuantFormat.NONE, ["lm_head"]) == []
    with pytest.raises(JobError) as e:
        recipes.build_recipe_spec(QuantFormat.AUTO, [])
    assert e.value.reason == errors.RECIPE_INVALID and e.value.permanent


def test_a_contract_with_recipe_parameters_is_refused():
    # The format alone names the recipe: nothing in the contract can set a modifier argument.
    ki = ArtifactKeyInputs(sourceUri="hf://org/model", format="fp8-dynamic", recipe={"dampeningFrac": 0.1})
    with pytest.raises(JobError) as e:
        job.parse_contract({"key": ki.key(), "keyInputs": ki.to_wire(), "storage": {"uri": "s3://bucket/p"}})
    assert e.value.reason == errors.CONTRACT_INVALID and "recipe parameters" in e.value.message


@pytest.mark.quantize
def test_recipes_instantiate_real_llmcompressor_modifiers():
    pytest.importorskip("llmcompressor")
    for fmt in QUANTIZED_FORMATS:
        mods = recipes.instantiate(recipes.build_recipe_spec(fmt, ["lm_head"]))
        assert [type(m).__name__ for m in mods] == EXPECTED_KINDS[fmt]


@pytest.mark.quantize
def test_awq_cpu_guard_is_narrow(monkeypatch):
    pytest.importorskip("llmcompressor")
    from llmcompressor.pipelines.cache import IntermediatesCache

    from fewerbits_quantjob import quantize

    original = IntermediatesCache.pin_memory
    monkeypatch.setattr(quantize, "accelerator_available", lambda: False)
    with quantize.cpu_awq_pin_memory_guard(QuantFormat.W4A16_GPTQ) as active:
        assert not active and IntermediatesCache.pin_memory is original  # not AWQ: untouched
    with quantize.cpu_awq_pin_memory_guard(QuantFormat.W4A16_AWQ) as active:
        assert active and IntermediatesCache.pin_memory is not original
    assert IntermediatesCache.pin_memory is original  # restored
    monkeypatch.setattr(quantize, "accelerator_available", lambda: True)
    with quantize.cpu_awq_pin_memory_guard(QuantFormat.W4A16_AWQ) as active:
        assert not active and IntermediatesCache.pin_memory is original  # a GPU node: untouched


# ------------------------------------------------------------------------------- key verification
def _contract(fmt=QuantFormat.W4A16_GPTQ, **ki_overrides) -> QuantJobContract:
    ki = ArtifactKeyInputs(**{"sourceUri": "hf://org/model", "sourceRevision": "abc", "format": fmt,
                              "ignore": ["lm_head"], "calibrationDataset": "general-en", "calibrationSamples": 512,
                              "calibrationMaxSeqLength": 2048, **ki_overrides})
    return QuantJobContract(key=ki.key(), keyInputs=ki, storage={"uri": "s3://bucket/p"})


def test_verify_contract_accepts_a_consistent_contract():
    job.verify_contract(_contract(), dict(QUANTJOB_TOOL_VERSIONS))


def test_what_the_key_covers_is_stated_once():
    # Source URI and revision, format, ignore list and calibration are read from keyInputs only:
    # no second copy in the contract can disagree with the key.
    fields = set(QuantJobContract.model_fields)
    assert not fields & {"format", "ignore", "calibration", "sourceMountPath"}, fields
    assert not set(QuantJobContract.model_fields["source"].annotation.model_fields) & {"uri", "revision"}
    c = _contract()
    assert c.format is c.keyInputs.format and c.calibration.samples == c.keyInputs.calibrationSamples


def test_verify_contract_recomputes_the_key():
    # Built without validation (as a hand-edited object could be): the Job still refuses it.
    good = _contract()
    forged = QuantJobContract.model_construct(**{**dict(good), "keyInputs": good.keyInputs.model_copy(
        update={"calibrationSamples": 16})})
    with pytest.raises(JobError) as e:
        job.verify_contract(forged, dict(QUANTJOB_TOOL_VERSIONS))
    assert e.value.reason == errors.KEY_MISMATCH and e.value.permanent


@pytest.mark.parametrize("fmt, overrides, needle", [
    (QuantFormat.W4A16_GPTQ, {"calibrationSamples": None}, "needs calibrationDataset"),
    (QuantFormat.FP8_DYNAMIC, {}, "uses no calibration data"),
])
def test_contract_calibration_follows_the_format(fmt, overrides, needle):
    with pytest.raises(ValueError, match=needle):
        _contract(fmt, **overrides)


def test_verify_contract_refuses_other_tool_versions_than_a_legacy_key_names():
    legacy = _contract(tools=dict(QUANTJOB_TOOL_VERSIONS))
    with pytest.raises(JobError) as e:
        job.verify_contract(legacy, {**QUANTJOB_TOOL_VERSIONS, "transformers": "9.9.9"})
    assert e.value.reason == errors.TOOL_VERSION_MISMATCH and "transformers key=5.17.0 image=9.9.9" in e.value.message
    # A current key names no tool versions: any image may make it (the manifest records which).
    job.verify_contract(_contract(), {**QUANTJOB_TOOL_VERSIONS, "transformers": "9.9.9"})


def test_a_tampered_key_is_a_key_mismatch():
    wire = json.loads(_contract().to_json())
    wire["keyInputs"]["calibrationSamples"] = 1
    with pytest.raises(JobError) as e:
        job.parse_contract(json.dumps(wire))
    assert e.value.reason == errors.KEY_MISMATCH


def test_run_reports_a_bad_contract_in_the_termination_message(tmp_path):
    term = tmp_path / "term"
    assert job.run('{"kind": "QuantJob"}', {"FEWERBITS_TERMINATION_LOG": str(term)}) == errors.EXIT_PERMANENT
    summary = json.loads(term.read_text())
    assert summary["result"] == "failed" and summary["stage"] == "contract" and summary["reason"] == "ContractInvalid"


def test_keyed_tool_versions_equal_the_quantjob_pins():
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["quantjob"]
    pinned = dict(p.split("==") for p in pins)
    for tool, version in QUANTJOB_TOOL_VERSIONS.items():
        assert pinned[tool] == version
    assert all("==" in p for p in pins), f"unpinned [quantjob] requirement: {pins}"


# --------------------------------------------------------------------------- termination message
def test_termination_message_fits_and_parses():
    big = {"result": "failed", "stage": "quantize", "reason": "QuantizationFailed", "message": "é" * 10000, "key": "a" * 64}
    text = report.termination_message(big)
    assert len(text.encode()) <= TERMINATION_MESSAGE_MAX_BYTES
    parsed = json.loads(text)
    assert parsed["reason"] == "QuantizationFailed" and parsed["key"] == "a" * 64
    assert parsed["message"].startswith("éé") and parsed["message"].endswith("…")


def test_termination_message_small_is_unchanged():
    s = {"result": "published", "key": "k", "quality": {"passed": True}}
    assert json.loads(report.termination_message(s)) == s


def test_termination_message_falls_back_to_essentials():
    s = {"result": "published", "key": "k", "quality": {"passed": False, "x": ["y" * 100] * 100}}
    parsed = json.loads(report.termination_message(s, limit=300))
    assert parsed == {"result": "published", "key": "k", "quality": {"passed": False}, "truncated": True}


# ------------------------------------------------------------------------------------- redaction
def test_redact_urls_tokens_and_secret_values():
    secrets = report.secret_values({"AWS_SECRET_ACCESS_KEY": "s3cr3tvalue", "HF_TOKEN": "", "OTHER": "x"})
    assert secrets == {"AWS_SECRET_ACCESS_KEY": "s3cr3tvalue"}
    text = ("fetch https://user:pa55@host.example/path s3://AKIA:xyz@bucket/k token hf_abcdefghijklmnopqrstuvwx "
            "https://b.s3/obj?X-Amz-Signature=deadbeef&X-Amz-Credential=AKIA%2F then s3cr3tvalue leaked")
    out = report.redact(text, secrets)
    for leak in ("pa55", "user:", "AKIA:xyz", "hf_abcdefghijklmnopqrstuvwx", "deadbeef", "s3cr3tvalue"):
        assert leak not in out, leak
    assert "https://***@host.example/path" in out and "X-Amz-Signature=***" in out


def test_progress_lines_have_stage_percent_elapsed_and_no_secret():
    stream = io.StringIO()
    report.configure_logging(stream)
    try:
        progress = report.Progress(secrets={"AWS_SECRET_ACCESS_KEY": "topsecretvalue"})
        with progress.stage("upload") as st:
            st.report(0.5, rate="1.0MiB/s")
            progress.note("uploading with topsecretvalue")
    finally:
        logging.getLogger("fewerbits-quantjob").handlers.clear()
    lines = stream.getvalue().splitlines()
    assert "stage=upload event=start progress=85% elapsed=" in lines[0]
    assert "event=progress progress=92% " in lines[1] and "rate=1.0MiB/s" in lines[1]
    assert "topsecretvalue" not in stream.getvalue()
    assert "stage=upload event=end progress=99%" in lines[-1] and "took=" in lines[-1]
    assert "upload" in progress.timings


# -------------------------------------------------------------------------------------- datasets
def test_builtin_datasets_are_english_paragraphs_that_do_not_overlap():
    cal = textdata.load_texts("general-en", {})
    held = textdata.load_texts("general-en-heldout", {})
    assert len(cal.texts) >= 40 and len(held.texts) >= 12
    assert all(len(t) > 100 for t in cal.texts + held.texts)
    assert not set(cal.texts) & set(held.texts)
    assert cal.details["fileSha256"] == BUILTIN_DATASET_SHA256["general-en"]
    assert cal.details["fileSha256"] == hashlib.sha256(
        (REPO / "quantjob/fewerbits_quantjob/data/general-en.txt").read_bytes()).hexdigest()
    limited = textdata.load_texts("general-en", {}, limit=5)
    assert limited.texts == cal.texts[:5] and limited.sha256 != cal.sha256


def test_unknown_builtin_dataset():
    with pytest.raises(JobError) as e:
        textdata.load_texts("general-fr", {})
    assert e.value.reason == errors.DATASET_NOT_FOUND and "general-en" in e.value.message


def test_parse_jsonl():
    assert textdata.parse_jsonl(b'{"text": "a"}\n\n{"text": "b", "id": 2}\n{"text": "  "}\n', "x") == ["a", "b"]
    with pytest.raises(JobError, match="line 2: not JSON"):
        textdata.parse_jsonl(b'{"text": "a"}\nnope\n', "x")
    with pytest.raises(JobError, match='line 1: expected an object with a "text" string'):
        textdata.parse_jsonl(b'{"content": "a"}\n', "x")
    with pytest.raises(JobError, match="no text records"):
        textdata.parse_jsonl(b"\n", "x")


class _FakeS3:
    """Just enough of a boto3 client for the JSONL loader (the real server is in integration)."""

    def __init__(self, objects):
        self.objects = objects
        self.calls = []

    def get_object(self, Bucket, Key):  # noqa: N803 — boto3's names
        self.calls.append((Bucket, Key))
        if (Bucket, Key) not in self.objects:
            from botocore.exceptions import ClientError

            raise ClientError({"Error": {"Code": "NoSuchKey"}}, "GetObject")
        return {"Body": io.BytesIO(self.objects[(Bucket, Key)]), "ETag": '"etag-1"'}


def test_s3_jsonl_loader():
    body = b'{"text": "one"}\n{"text": "two"}\n{"text": "three"}\n'
    fake = _FakeS3({("data", "sets/cal.jsonl"): body})
    loaded = textdata.load_texts("s3://data/sets/cal.jsonl", {}, lambda: fake, limit=2)
    assert loaded.texts == ["one", "two"] and fake.calls == [("data", "sets/cal.jsonl")]
    assert loaded.details == {"etag": "etag-1", "sha256": hashlib.sha256(body).hexdigest()}
    with pytest.raises(JobError) as e:
        textdata.load_texts("s3://data/missing.jsonl", {}, lambda: fake)
    assert e.value.reason == errors.DATASET_NOT_FOUND


def test_dataset_hash_verification_accepts_file_hash_or_etag():
    loaded = textdata.TextSet(["a"], "s3://b/x.jsonl", "samplehash", {"etag": "etag-1", "sha256": "filehash"})
    for ok in (None, "filehash", "etag-1", '"etag-1"', "samplehash"):
        job.verify_dataset_hash(ok, loaded, "s3://b/x.jsonl")
    with pytest.raises(JobError) as e:
        job.verify_dataset_hash("other", loaded, "s3://b/x.jsonl")
    assert e.value.reason == errors.DATASET_CHANGED


def test_hf_dataset_uri_and_loader(monkeypatch):
    assert textdata.parse_hf_dataset_uri("hf://datasets/org/name@v1.0") == ("org/name", "v1.0")
    assert textdata.parse_hf_dataset_uri("hf://datasets/org/name") == ("org/name", None)
    datasets = pytest.importorskip("datasets")
    seen = {}

    def fake_load_dataset(repo, revision=None, token=None, streaming=False):
        seen.update(repo=repo, revision=revision, token=token, streaming=streaming)
        return {"validation": [{"text": "x"}], "train": [{"text": "first"}, {"text": ""}, {"text": "second"}, {"text": "third"}]}

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    loaded = textdata.load_texts("hf://datasets/org/name@abc", {"HF_TOKEN": "hf_tok"}, limit=2)
    assert loaded.texts == ["first", "second"] and loaded.details == {"split": "train", "revision": "abc"}
    assert seen == {"repo": "org/name", "revision": "abc", "token": "hf_tok", "streaming": True}


# ------------------------------------------------------------------------------------------ fetch
def test_hf_fetch_resolves_the_revision_and_maps_errors(monkeypatch, tmp_path):
    hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub.errors import RepositoryNotFoundError

    from fewerbits_quantjob import fetch

    calls = {}

    class FakeApi:
        def __init__(self, token=None):
            calls["token"] = token

        def model_info(self, repo, revision=None):
            calls["info"] = (repo, revision)
            if repo == "org/missing":
                import httpx

                request = httpx.Request("GET", "https://hub.invalid/api/models/org/missing")
                raise RepositoryNotFoundError("404 Repository Not Found",
                                              response=httpx.Response(404, request=request))
            return type("Info", (), {"sha": "c0ffee" * 6 + "abcd"})()

    def fake_snapshot(repo, revision=None, token=None, local_dir=None, allow_patterns=None):
        calls["snapshot"] = (repo, revision, token, allow_patterns)
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        (Path(local_dir) / "config.json").write_text("{}")
        return local_dir

    monkeypatch.setattr(hub, "HfApi", FakeApi)
    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot)
    got = fetch._fetch_hf("org/model", "main", False, {"HF_TOKEN": "hf_secret"}, tmp_path / "src")
    assert got.resolved_revision == "c0ffee" * 6 + "abcd" and (got.path / "config.json").exists()
    assert calls["info"] == ("org/model", "main") and calls["token"] == "hf_secret"
    repo, revision, token, patterns = calls["snapshot"]
    assert revision == got.resolved_revision, "the snapshot must be of the resolved commit, not the moving branch"
    assert "*.safetensors" in patterns and "*.py" not in patterns  # no remote code unless trusted
    fetch._fetch_hf("org/model", None, True, {}, tmp_path / "src2")
    assert "*.py" in calls["snapshot"][3]  # trustRemoteCode: the model's code comes along
    with pytest.raises(JobError) as e:
        fetch._fetch_hf("org/missing", None, False, {}, tmp_path / "src3")
    assert e.value.reason == errors.SOURCE_NOT_FOUND and e.value.permanent


def test_s3_source_uses_its_own_endpoint_and_region():
    from fewerbits_api.quantizedmodel import SourceSpec, StorageSpec
    from fewerbits_quantjob.storage import source_client

    storage = StorageSpec(uri="s3://artifacts/q", endpoint="http://artifacts.example:9000", region="eu-west-1")
    own = source_client(SourceSpec(uri="s3://models/m", endpoint="http://models.example:9000", region="us-west-2"),
                        storage, {})
    assert own.meta.endpoint_url == "http://models.example:9000" and own.meta.region_name == "us-west-2"
    fallback = source_client(SourceSpec(uri="s3://models/m"), storage, {})
    assert fallback.meta.endpoint_url == "http://artifacts.example:9000" and fallback.meta.region_name == "eu-west-1"


def test_awq_mappings_for_the_loaded_models_type_are_pure_data():
    specs = recipes.build_recipe_spec(QuantFormat.W4A16_AWQ, ["lm_head"])
    assert recipes.for_model(specs, "llama") == specs  # llm-compressor's own mappings resolve there
    (awq, quant) = recipes.for_model(specs, "gemma3")
    assert awq.kind == "AWQModifier" and quant == specs[1]
    assert all("language_model" in m["smooth_layer"] for m in awq.kwargs["mappings"])
    named = [recipes.ModifierSpec("AWQModifier", {"mappings": []}), specs[1]]
    assert recipes.for_model(named, "gemma3") == named  # a spec's own mappings are kept
    (sq, gptq) = recipes.for_model(recipes.build_recipe_spec(QuantFormat.W8A8_INT8, ["lm_head"]), "gemma3")
    assert sq.kind == "SmoothQuantModifier" and [m[1] for m in sq.kwargs["mappings"]] == [
        r"re:.*language_model.*input_layernorm$", r"re:.*language_model.*pre_feedforward_layernorm$"]
    assert "mappings" not in gptq.kwargs


@pytest.mark.quantize
def test_gemma3_awq_and_smoothquant_mappings_resolve_on_the_real_multimodal_model():
    """The zoo's Gemma-3 (SigLIP tower with v_proj and out_proj, Gemma-3 text model) loaded as the
    Job loads it: llm-compressor's default mapping matched a vision v_proj and two language v_proj as
    one smooth layer; the language-model mappings resolve one smooth layer per decoder layer."""
    pytest.importorskip("llmcompressor")
    from llmcompressor.modifiers.quantization import QuantizationModifier

    from fewerbits_quantjob import quantize
    from tests.testmodel.zoo import build_zoo_model

    model, _ = quantize.load_for_quantization(build_zoo_model("gemma3"), trust_remote_code=False)
    specs = recipes.for_model(recipes.build_recipe_spec(QuantFormat.W4A16_AWQ, ["lm_head"]), model.config.model_type)
    awq, quant = recipes.instantiate(specs)
    assert isinstance(quant, QuantizationModifier)
    # What the QuantizationModifier after AWQ marks (AWQ smooths only layers that carry a scheme):
    # the language model's Linear layers; the vision tower and lm_head are in the ignore list.
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".language_model." in f".{name}":
            module.quantization_scheme = quant.scheme
    awq._set_resolved_mappings(model)  # the default mappings raised here
    smoothed = [m.smooth_name for m in awq._resolved_mappings]
    assert smoothed and all(".language_model." in f".{n}" for n in smoothed), smoothed
    layers = model.config.text_config.num_hidden_layers
    assert len([n for n in smoothed if n.endswith("up_proj")]) == layers  # up -> down, in every decoder layer

    sq, _ = recipes.instantiate(recipes.for_model(
        recipes.build_recipe_spec(QuantFormat.W8A8_INT8, ["lm_head"]), model.config.model_type))
    resolved = sq._resolve_mappings(model)  # the default mappings raised here (SigLIP's q/k/v_proj)
    assert len(resolved) == 2 * layers and all(".language_model." in f".{m.smooth_name}" for m in resolved)
