"""The default calibration data (issue 31 item 2): `auto` reads the pinned Hub chat set when the
Job reaches the Hub and the built-in set otherwise; chat rows are rendered with the model's chat
template; what was used (samples, tokens, source) reaches the manifest and status, with the reason
CalibrationReduced when it is less than asked. This machine has no network: the Hub is reached
for real (and fails), and a stand-in for `datasets.load_dataset` serves chat rows where the
test needs the Hub to answer (named in each test)."""

from __future__ import annotations

import pytest

from fewerbits_api.datasets import AUTO_CALIBRATION, AUTO_HUB_DATASET, named_dataset_hash
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


def test_the_job_accepts_either_source_under_the_auto_key(hub_with_chats):
    from fewerbits_quantjob.job import verify_dataset_hash

    verify_dataset_hash(named_dataset_hash(AUTO_CALIBRATION), textdata.load_calibration("auto", {}, limit=2), "auto")
    fallback = textdata.load_calibration("auto", {}, limit=2, hub=_unreachable)
    verify_dataset_hash(named_dataset_hash(AUTO_CALIBRATION), fallback, "auto")
    with pytest.raises(JobError) as e:  # a key computed for other data still refuses it
        verify_dataset_hash("0" * 64, fallback, "auto")
    assert e.value.reason == errors.DATASET_CHANGED


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
