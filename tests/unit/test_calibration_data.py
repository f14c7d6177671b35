"""The default calibration data (issue 31 item 2): `auto` reads the pinned Hub chat set when the
Job reaches the Hub and the built-in set otherwise; chat rows are rendered with the model's chat
template; what was used (samples, tokens, source) reaches the manifest and status, with the reason
CalibrationReduced when it is less than asked. This machine has no network: the Hub is reached
for real (and fails), and a stand-in for `datasets.load_dataset` serves chat rows where the
test needs the Hub to answer (named in each test)."""

from __future__ import annotations

import pytest

from fewerbits_api.datasets import AUTO_CALIBRATION, AUTO_FALLBACK_HASH, AUTO_HUB_DATASET, named_dataset_hash
from fewerbits_quantjob import errors, textdata
from fewerbits_quantjob.errors import JobError

CHATS = [
    [{"role": "user", "content": f"Question {i}: how do rivers form?"},
     {"role": "assistant", "content": "Rain gathers in channels that deepen over time. " * (i + 1)}]
    for i in range(6)
]


@pytest.fixture
def hub_with_chats(monkeypatch):
    """Stands in for the Hub (unreachable here): `datasets.load_dataset` serves CHATS as a split."""
    import datasets

    asked = []

    def load_dataset(repo, *config, revision=None, token=None, streaming=False):
        asked.append((repo, config, revision))
        return {"train_sft": [{"prompt": c[0]["content"], "messages": c} for c in CHATS]}

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(textdata, "hub_unreachable", lambda env: None)  # the stand-in answers
    return asked


def test_auto_reads_the_pinned_hub_chat_set(hub_with_chats):
    loaded = textdata.load_calibration(AUTO_CALIBRATION, {}, limit=4)
    assert hub_with_chats == [("HuggingFaceH4/ultrachat_200k", ("default",), "8049631c405ae6576f93f445c6b8166f76f5505a")]
    assert loaded.read_from == AUTO_HUB_DATASET and loaded.source == AUTO_CALIBRATION
    assert loaded.conversations == CHATS[:4] and len(loaded.texts) == 4
    assert "fallback" not in loaded.details
    assert loaded.details["keyHash"] == named_dataset_hash(AUTO_CALIBRATION)


@pytest.mark.parametrize("env, why", [
    ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
    # A real connection attempt: this machine has no route to the Hub (a closed loopback port
    # stands in for a Hub mirror that does not answer).
    ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "http://127.0.0.1:9 unreachable: "),
])
def test_auto_falls_back_to_the_built_in_set_when_the_hub_cannot_be_reached(env, why):
    loaded = textdata.load_calibration(AUTO_CALIBRATION, env, limit=512)
    assert loaded.read_from == "general-en" and loaded.conversations is None
    assert len(loaded.texts) == 44  # every paragraph the image ships, fewer than asked
    assert loaded.details["fallback"].startswith(f"{AUTO_HUB_DATASET} could not be read (DatasetFetchFailed: {why}")


def test_the_hub_key_accepts_only_the_hub_set_and_the_fallback_key_only_the_fallback(hub_with_chats):
    """Issue 47: one key for both sources let an artifact calibrated offline serve every later model
    with the same inputs. Each source now verifies against its own key only."""
    from fewerbits_quantjob.job import verify_dataset_hash

    hub_key, fallback_key = named_dataset_hash(AUTO_CALIBRATION), AUTO_FALLBACK_HASH
    from_hub = textdata.load_calibration("auto", {}, limit=2)
    fallback = textdata.load_calibration("auto", {}, limit=2, hub=_unreachable)
    assert "keyHash" not in fallback.details and fallback.details["fileSha256"] == fallback_key
    verify_dataset_hash(hub_key, from_hub, "auto")
    verify_dataset_hash(fallback_key, fallback, "auto")
    for key, loaded in ((hub_key, fallback), (fallback_key, from_hub), ("0" * 64, fallback)):
        with pytest.raises(JobError) as e:
            verify_dataset_hash(key, loaded, "auto")
        assert e.value.reason == errors.DATASET_CHANGED


def test_a_job_told_the_hub_is_down_reads_the_fallback_without_probing(monkeypatch):
    monkeypatch.setattr(textdata, "hub_unreachable", _must_not_probe)
    loaded = textdata.load_calibration("auto", {}, limit=2, hub_down="HF_HUB_OFFLINE is set")
    assert loaded.read_from == "general-en" and "HF_HUB_OFFLINE is set" in loaded.details["fallback"]


def _must_not_probe(env):
    raise AssertionError("the Hub was probed again")


def _unreachable(*_args):
    raise JobError(errors.DATASET_FETCH_FAILED, "ConnectionError: offline")


def test_a_messages_cell_must_be_role_and_content(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: {"train": [{"messages": [{"role": "user"}]}]})
    with pytest.raises(JobError, match='"messages" entry is not'):
        textdata.load_texts("hf://datasets/org/chats@abc", {}, limit=2)


def _tokenizer(chat_template: str | None):
    from tests.testmodel import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = chat_template
    return tok


TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


def test_chat_rows_are_rendered_with_the_models_chat_template(hub_with_chats):
    from fewerbits_quantjob.quantize import calibration_samples

    loaded = textdata.load_calibration("auto", {}, limit=3)
    tok = _tokenizer(TEMPLATE)
    samples = calibration_samples(loaded, tok, max_seq_length=32)
    assert samples.chat_template and samples.count == 3
    assert samples.texts[0] == tok.apply_chat_template(CHATS[0], tokenize=False)
    assert samples.texts[0].startswith("<s>user: Question 0")
    # Tokens as calibration sees them: each sample cut at the sequence length, no second BOS.
    expected = sum(min(len(tok(t, add_special_tokens=False)["input_ids"]), 32) for t in samples.texts)
    assert samples.tokens == expected and 0 < samples.tokens <= 3 * 32
    plain = calibration_samples(loaded, _tokenizer(None), max_seq_length=4096)  # a base model: plain text
    assert not plain.chat_template and plain.texts == loaded.texts


def test_what_was_used_and_the_shortfall_reach_the_manifest():
    from fewerbits_api.quantizedmodel import CalibrationSpec
    from fewerbits_quantjob.job import calibration_used
    from fewerbits_quantjob.quantize import calibration_samples

    loaded = textdata.load_calibration("auto", {}, limit=512, hub=_unreachable)
    samples = calibration_samples(loaded, _tokenizer(None), max_seq_length=2048)
    used = calibration_used(CalibrationSpec(), loaded, samples)
    assert (used.dataset, used.source, used.samples, used.requestedSamples, used.maxSeqLength) == \
        ("auto", "general-en", 44, 512, 2048)
    assert used.tokens == samples.tokens > 44
    assert used.shortfall.startswith(f"calibrated on 44 samples ({samples.tokens} tokens) of the 512 asked: "
                                     f"{AUTO_HUB_DATASET} could not be read")
    enough = calibration_used(CalibrationSpec(samples=16), textdata.load_calibration("general-en", {}, limit=16),
                              calibration_samples(textdata.load_calibration("general-en", {}, limit=16),
                                                  _tokenizer(None), 64))
    assert enough.shortfall is None and enough.samples == 16 and enough.source == "general-en"


# ------------------------------------------------------------- the key names what was calibrated on
def _auto_contract(**ki_overrides):
    from fewerbits_api.artifact import ArtifactKeyInputs
    from fewerbits_api.jobcontract import QuantJobContract

    ki = ArtifactKeyInputs(**{"sourceUri": "hf://org/model", "sourceRevision": "abc", "format": "w4a16-gptq",
                              "ignore": ["lm_head"], "calibrationDataset": "auto",
                              "calibrationDatasetHash": named_dataset_hash(AUTO_CALIBRATION), "calibrationSamples": 512,
                              "calibrationMaxSeqLength": 2048, **ki_overrides})
    return QuantJobContract(key=ki.key(), keyInputs=ki, storage={"uri": "s3://bucket/p"})


def test_the_auto_key_without_and_with_the_fallback():
    """The planned key names the Hub set; the fallback's artifact has a key of its own, equal in all
    but the calibration hash (the fallback file's sha256), so neither is taken for the other."""
    from fewerbits_api.artifact import auto_fallback_inputs, calibrated_on_fallback

    planned = _auto_contract().keyInputs
    fallback = auto_fallback_inputs(planned)
    assert fallback is not None and fallback.key() != planned.key()
    assert fallback.model_copy(update={"calibrationDatasetHash": planned.calibrationDatasetHash}) == planned
    assert fallback.calibrationDatasetHash == AUTO_FALLBACK_HASH and calibrated_on_fallback(fallback)
    assert not calibrated_on_fallback(planned) and auto_fallback_inputs(fallback) is None
    for other in ({"calibrationDataset": "general-en", "calibrationDatasetHash": AUTO_FALLBACK_HASH},
                  {"calibrationDataset": "s3://data/cal.jsonl", "calibrationDatasetHash": "etag"}):
        assert auto_fallback_inputs(planned.model_copy(update=other)) is None
    # The explicit built-in set is a third key: the same file, named otherwise.
    assert planned.model_copy(update={"calibrationDataset": "general-en",
                                      "calibrationDatasetHash": AUTO_FALLBACK_HASH}).key() != fallback.key()


def test_a_job_without_the_hub_publishes_under_the_fallback_key(monkeypatch, tmp_path):
    """The Job probes the Hub only when no artifact is at the planned key; without it, the fallback's
    key is the one it looks up and publishes (here: already there, a cache hit under that key)."""
    import json

    from fewerbits_api.artifact import Manifest, auto_fallback_inputs
    from fewerbits_quantjob import job, storage

    contract = _auto_contract()
    fallback = auto_fallback_inputs(contract.keyInputs)
    published = Manifest(key=fallback.key(), keyInputs=fallback, format=fallback.format, files=[], totalBytes=0,
                         createdAt="2026-11-23T12:00:00Z")
    looked_up = []

    def read_manifest(client, uri, key):
        looked_up.append(key)
        return (published, "found") if key == fallback.key() else (None, "no manifest")

    monkeypatch.setattr(storage, "storage_client", lambda *a: object())
    monkeypatch.setattr(storage, "read_manifest", read_manifest)
    term = tmp_path / "termination"
    code = job.run(contract, {"HF_HUB_OFFLINE": "1", "FEWERBITS_TERMINATION_LOG": str(term)})
    summary = json.loads(term.read_text())
    assert code == 0 and summary["result"] == "cache-hit" and summary["key"] == fallback.key()
    assert looked_up == [contract.key, fallback.key()]
    assert job.hub_down(contract, {"HF_HUB_OFFLINE": "1"}) == "HF_HUB_OFFLINE is set"
    assert job.hub_down(contract.model_copy(update={"mode": "evaluate"}), {"HF_HUB_OFFLINE": "1"}) is None


def test_a_hub_that_answers_the_probe_and_fails_the_read_switches_the_key_before_calibrating(monkeypatch):
    import datasets

    from fewerbits_api.artifact import auto_fallback_inputs
    from fewerbits_quantjob import job
    from fewerbits_quantjob.report import Progress

    monkeypatch.setattr(textdata, "hub_unreachable", lambda env: None)
    monkeypatch.setattr(datasets, "load_dataset", _refuse)
    contract = _auto_contract()
    loaded, calibrated = job._calibration_data(contract, {}, Progress())
    assert loaded.read_from == "general-en" and "ConnectionError" in loaded.details["fallback"]
    assert calibrated.keyInputs == auto_fallback_inputs(contract.keyInputs) and calibrated.key != contract.key
    # A contract already on the fallback key reads the fallback and stays as it is.
    monkeypatch.setattr(textdata, "hub_unreachable", _must_not_probe)
    again, same = job._calibration_data(calibrated, {}, Progress(), offline="HF_HUB_OFFLINE is set")
    assert same is calibrated and again.texts == loaded.texts


def _refuse(*_args, **_kwargs):
    raise ConnectionError("the Hub answered the probe, not the read")
