"""How a failed serving container is told in the Ready condition (reconcile._termination_text)."""

import json

from fewerbits_operator.reconcile import _termination_text


def test_runtime_json_message_gives_reason_and_message():
    msg = json.dumps({"component": "fetch", "reason": "DigestMismatch", "exitCode": 12,
                      "message": "sha256 mismatch for model.safetensors"})
    assert _termination_text({"exitCode": 12, "reason": "Error", "message": msg}) == \
        "exit 12, DigestMismatch: sha256 mismatch for model.safetensors"


def test_plain_text_message_keeps_its_last_line_only():
    term = {"exitCode": 1, "reason": "Error", "message": "Traceback...\n  frame\nRuntimeError: CUDA out of memory"}
    assert _termination_text(term) == "exit 1, Error: RuntimeError: CUDA out of memory"


def test_no_message_and_a_json_lookalike_still_read_well():
    assert _termination_text({"exitCode": 137, "reason": "OOMKilled"}) == "exit 137, OOMKilled"
    assert _termination_text({"exitCode": 2, "message": "{not json"}) == "exit 2, Error: {not json"


def test_long_messages_are_cut():
    msg = json.dumps({"reason": "StorageError", "message": "x" * 5000})
    assert len(_termination_text({"exitCode": 14, "message": msg})) < 700
