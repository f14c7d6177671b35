"""How a failed serving container is told in the Ready condition (base.terminations.termination_text), and
the small helpers of observe and decide."""

import json

from fewerbits_operator.base.terminations import termination_text
from fewerbits_operator.base.observed import ContainerTermination


def _termination_text(term: dict) -> str:
    return termination_text(ContainerTermination(
        pod="p", container="c", exit_code=int(term.get("exitCode") or 0), reason=str(term.get("reason") or ""),
        message=str(term.get("message") or "")))


def test_runtime_json_message_gives_reason_and_message():
    msg = json.dumps({"component": "fetch", "reason": "DigestMismatch", "exitCode": 12,
                      "message": "sha256 mismatch for model.safetensors"})
    assert _termination_text({"exitCode": 12, "reason": "Error", "message": msg}) == \
        "exit 12, DigestMismatch: sha256 mismatch for model.safetensors"


def test_plain_text_message_keeps_its_last_line_only():
    term = {"exitCode": 1, "reason": "Error", "message": "Traceback...\n  frame\nRuntimeError: CUDA out of memory"}
    assert _termination_text(term) == "exit 1, Error: RuntimeError: CUDA out of memory"


def test_vllm_refusals_keep_the_flag_or_field_they_name():
    """vLLM's own start failures: argparse names the flag on the last line; a config error ends with
    pydantic's link, and the field's name sits two lines up: both reach the Ready condition."""
    argparse = "usage: api_server.py [-h] ...\napi_server.py: error: unrecognized arguments: --monokernel"
    assert _termination_text({"exitCode": 2, "message": argparse}) == \
        "exit 2, Error: api_server.py: error: unrecognized arguments: --monokernel"
    pydantic = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                "pydantic_core._pydantic_core.ValidationError: 1 validation error for SchedulerConfig\n"
                "max_num_seqs\n  Input should be greater than 0 [type=greater_than, input_value=0]\n"
                "    For further information visit https://errors.pydantic.dev/2.12/v/greater_than\n")
    text = _termination_text({"exitCode": 1, "message": pydantic})
    assert text.startswith("exit 1, Error: pydantic_core._pydantic_core.ValidationError: 1 validation error for "
                           "SchedulerConfig max_num_seqs Input should be greater than 0"), text
    assert "errors.pydantic.dev" not in text


def test_no_message_and_a_json_lookalike_still_read_well():
    assert _termination_text({"exitCode": 137, "reason": "OOMKilled"}) == "exit 137, OOMKilled"
    assert _termination_text({"exitCode": 2, "message": "{not json"}) == "exit 2, Error: {not json"


def test_long_messages_are_cut():
    msg = json.dumps({"reason": "StorageError", "message": "x" * 5000})
    assert len(_termination_text({"exitCode": 14, "message": msg})) < 700


def test_an_invalid_policy_governs_the_namespaces_its_selector_names_or_all_when_unreadable():
    from fewerbits_operator.core.observe import may_select as _may_select

    raw = {"metadata": {"name": "p"}, "spec": {"namespaceSelector": {"matchLabels": {"team": "a"}},
                                               "formatByGPUFamily": {"hopper": "auto"}}}
    assert _may_select(raw, {"team": "a"}) and not _may_select(raw, {"team": "b"})
    assert _may_select({"spec": 5}, {})
    assert _may_select({"spec": {"namespaceSelector": {"matchLabels": {"bad key!": "x"}}}}, {"team": "b"})
    assert _may_select({"spec": {}}, {"anything": "x"})  # an empty selector selects every namespace


def test_serving_targets_are_told_as_written():
    from fewerbits_api.quantizedmodel import ServingTarget
    from fewerbits_operator.core.acceptance import _target_text

    assert _target_text(ServingTarget(family="hopper")) == "family hopper"
    assert _target_text(ServingTarget(product="NVIDIA-B200")) == "product NVIDIA-B200"
    assert _target_text(ServingTarget(nodeSelector={"pool": "x"})) == "nodeSelector pool=x"
