"""The canary evaluation's pure parts and its prompt-logprobs branch.

vLLM cannot run here (no GPU), and `transformers serve` offers no prompt logprobs, so the
perplexity branch is tested against a STAND-IN: a tiny local HTTP server that answers
`/v1/completions` in the shape of vLLM's recorded answer (tests/fixtures/vllm/
completion-prompt-logprobs.json, written from vLLM's protocol definitions and tests) and records
what it was sent. What it proves: the prompts are exactly the quantization Job's held-out windows
(evaluate.build_windows on the artifact's tokenizer), the per-window NLL is read from the prompt
token's own entry, and the perplexity and verdict follow.
"""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from fewerbits_api.artifact import ArtifactKeyInputs, Manifest, QualityReport
from fewerbits_api.canary import CanaryContract, ServingMetric, SkippedMetric
from fewerbits_api.formats import QuantFormat
from fewerbits_api.quality import MetricResult, eval_identity
from fewerbits_quantjob import canary
from fewerbits_quantjob.canary import CanaryError, Part, Server, split_budget, verdict, window_nll

RECORDED = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "vllm" /
                       "completion-prompt-logprobs.json").read_text())


# ------------------------------------------------------------------------------------------ budget
def test_budget_deals_documents_round_robin_and_never_exceeds_it():
    parts = [Part("perplexity", "perplexity", [1] * 10), Part("custom:rougeL", "custom", [1] * 3),
             Part("benchmark:mc/acc", "benchmark", [4] * 5)]
    assert split_budget(parts, 100) == {"perplexity": 10, "custom:rougeL": 3, "benchmark:mc/acc": 5}
    docs = split_budget(parts, 12)
    # Rounds: 1+1+4, 1+1+4 = 12: every part gets its first documents before any gets many.
    assert docs == {"perplexity": 2, "custom:rougeL": 2, "benchmark:mc/acc": 2}
    # A part whose next document no longer fits stops; the others take what is left.
    docs = split_budget(parts, 15)
    assert docs == {"perplexity": 4, "custom:rougeL": 3, "benchmark:mc/acc": 2}
    for budget in range(0, 40):
        got = split_budget(parts, budget)
        assert sum(sum(p.costs[:got[p.name]]) for p in parts) <= budget
    assert split_budget(parts, 0) == {"perplexity": 0, "custom:rougeL": 0, "benchmark:mc/acc": 0}


# ------------------------------------------------------------------------------ recorded vLLM shape
def test_window_nll_reads_the_prompt_tokens_own_entry_of_the_recorded_vllm_answer():
    prompt = RECORDED["request"]["prompt"]
    # Ranks 3, 1, 7, 2: the prompt token's entry, not the top-1 one, and never the null first entry.
    assert window_nll(RECORDED["response"], prompt) == pytest.approx(2.75 + 0.5 + 3.0 + 1.5)
    with pytest.raises(CanaryError, match="5 entries for a 4-token window"):
        window_nll(RECORDED["response"], prompt[:4])
    with pytest.raises(CanaryError, match="no log-probability for prompt token 99"):
        window_nll(RECORDED["response"], [0, 43, 99, 17, 250])
    with pytest.raises(CanaryError, match="no choices"):
        window_nll({"choices": [{"text": "x"}]}, prompt)


class VLLMStandIn:
    """A STAND-IN for vLLM's /v1/completions (vLLM needs a GPU): answers token-id prompts that ask
    for prompt logprobs in the recorded shape, each prompt token at log-probability
    -(1 + (token % 7) / 10); answers a generation request (one prompt or a batch of token-id
    prompts) with `generated` for each; records every request. ``mode``: "vllm", "text-only"
    (refuses the field with 422, as `transformers serve` does) or "slow" (answers after 2 s)."""

    generated = " the"

    def __init__(self, mode: str = "vllm"):
        self.requests: list[dict] = []
        self.models = ["q"]
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802 — /v1/models, in vLLM's shape: the base and each LoRA it loaded
                data = [{"id": m, "object": "model", **({"parent": "q"} if m != "q" else {})} for m in outer.models]
                return self.answer(200, {"object": "list", "data": data})

            def do_POST(self):  # noqa: N802 — the http.server hook's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                if mode == "slow":
                    time.sleep(2)
                if mode == "text-only":
                    return self.answer(422, {"detail": "Unexpected fields in the request: {'prompt_logprobs'}"})
                if "prompt_logprobs" not in body:
                    prompts = body["prompt"] if isinstance(body["prompt"], list) and body["prompt"] and \
                        isinstance(body["prompt"][0], list) else [body["prompt"]]
                    answer = json.loads(json.dumps(RECORDED["response"]))
                    answer["choices"] = [{**answer["choices"][0], "index": i, "text": outer.generated,
                                          "prompt_logprobs": None, "finish_reason": "stop"}
                                         for i in range(len(prompts))]
                    return self.answer(200, answer)
                assert body["max_tokens"] == 1 and body["prompt_logprobs"] == 0 and body["temperature"] == 0
                assert all(isinstance(t, int) for t in body["prompt"]), body
                answer = json.loads(json.dumps(RECORDED["response"]))
                answer["model"] = body["model"]
                rows = [None] + [{str(t): {"logprob": -(1 + (t % 7) / 10), "rank": 1, "decoded_token": "x"}}
                                 for t in body["prompt"][1:]]
                answer["choices"][0]["prompt_logprobs"] = rows
                answer["usage"]["prompt_tokens"] = len(body["prompt"])
                self.answer(200, answer)

            def answer(self, code: int, doc: dict) -> None:
                raw = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                try:
                    self.wfile.write(raw)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (the timeout test)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stand_in(request):
    srv = VLLMStandIn(getattr(request, "param", "vllm"))
    yield srv
    srv.close()


def test_prompt_logprobs_branch_scores_exactly_the_jobs_windows(stand_in):
    from transformers import AutoConfig, AutoTokenizer

    from fewerbits_quantjob import evaluate, gate, textdata
    from tests.testmodel import build_test_model

    model = build_test_model()
    tokenizer, config = AutoTokenizer.from_pretrained(model), AutoConfig.from_pretrained(model)
    texts = textdata.load_texts("general-en-heldout", {})
    length = evaluate.window_length(64, config)
    windows = evaluate.build_windows(tokenizer, texts.texts, length, 6).tolist()

    server = Server(stand_in.url, "q", timeout=10)
    offered, how = canary.probe(server, canary.PROBE_TOKEN_IDS)
    assert offered and how == "prompt_logprobs"
    served, tokens = canary._perplexity(server, windows, concurrency=3, say=lambda m: None)
    sent = [r["prompt"] for r in stand_in.requests[1:]]
    assert sorted(sent) == sorted(windows) and len(sent) == 6, "the prompts are the Job's windows, token for token"
    assert all(r["model"] == "q" for r in stand_in.requests) and server.requests == 7
    assert tokens == 6 * (length - 1)  # the Job scores every token after the first of each window
    expected = math.exp(sum(1 + (t % 7) / 10 for w in windows for t in w[1:]) / tokens)
    assert served == pytest.approx(expected, rel=1e-12)

    # Judged with the Job's own perplexity rule (maxPerplexityIncreasePercent form).
    ppl = evaluate.Perplexities(baseline=served / 1.2, quantized=served, windows=6, tokens=tokens, window_length=length)
    judged = gate.perplexity_metric(ppl, 10.0)
    m = canary.serving_metric(judged, None, "prompt_logprobs")
    assert not m.passed and m.recoveryPercent == pytest.approx(100 / 1.2)
    passed, reason = verdict([m], [], "fp8")
    assert not passed and reason.startswith("perplexity ") and "(+20.0%, max +10%)" in reason
    assert reason.endswith("with KV cache fp8")


@pytest.mark.parametrize("stand_in", ["text-only"], indirect=True)
def test_a_server_without_prompt_logprobs_is_told_apart(stand_in):
    server = Server(stand_in.url, "q", timeout=10)
    offered, how = canary.probe(server, canary.PROBE_TOKEN_IDS)
    assert not offered and "HTTP 422" in how and "prompt_logprobs" in how
    assert server.requests == 1


@pytest.mark.parametrize("stand_in", ["slow"], indirect=True)
def test_a_timeout_is_an_error_naming_the_endpoint(stand_in):
    server = Server(stand_in.url, "q", timeout=1)
    with pytest.raises(CanaryError) as e:
        canary.probe(server, canary.PROBE_TOKEN_IDS)
    assert f"{stand_in.url}/v1/completions" in str(e.value) and "within 1s" in str(e.value)


# ----------------------------------------------------------------------------------------- verdict
def metric(name: str, recovery: float, minimum: float, kind: str = "custom") -> ServingMetric:
    return ServingMetric(name=name, kind=kind, base=0.5, served=0.5 * recovery / 100, recoveryPercent=recovery,
                         minRecoveryPercent=minimum, passed=recovery >= minimum)


def test_verdict_names_the_worst_failing_metric_with_figures_and_the_kv_cache():
    metrics = [metric("custom:contains", 61.0, 95), metric("benchmark:gsm8k/exact_match", 90.0, 95, "benchmark"),
               metric("benchmark:arc/acc", 99.0, 95, "benchmark")]
    passed, reason = verdict(metrics, [], "fp8")
    assert not passed
    assert reason.startswith("custom:contains 61.0% of base (min 95%; served 0.305, base 0.5) with KV cache fp8")
    assert reason.endswith("(and 1 more failing)")

    passed, reason = verdict(metrics[2:], [SkippedMetric(name="perplexity", reason="no prompt logprobs")], "auto")
    assert passed and "with KV cache auto" in reason and "skipped perplexity" in reason

    # Nothing measured is no pass: a skipped metric never passes a canary by itself.
    passed, reason = verdict([], [SkippedMetric(name="perplexity", reason="needs prompt logprobs: HTTP 422")], "fp8")
    assert not passed and "nothing could be measured" in reason and "perplexity: needs prompt logprobs" in reason


# ------------------------------------------------------------------------------------- base scores
class FakeS3:
    """get_object over a dict (what base_report reads), NoSuchKey otherwise."""

    def __init__(self, objects: dict[str, bytes]):
        self.objects = objects

    def get_object(self, Bucket, Key):  # noqa: N803 — boto3's argument names
        if Key not in self.objects:
            raise ClientError({"Error": {"Code": "NoSuchKey", "Message": "no"}}, "GetObject")
        return {"Body": _Body(self.objects[Key])}


class _Body:
    def __init__(self, raw: bytes):
        self.raw = raw

    def read(self) -> bytes:
        return self.raw


def test_no_base_scores_for_the_gates_identity_fails_closed():
    ki = ArtifactKeyInputs(sourceUri="pvc://m/x", format=QuantFormat.FP8_DYNAMIC)
    gate = {"customEval": {"dataset": "s3://bkt/c.jsonl", "metric": "rougeL"}}
    contract = CanaryContract(key=ki.key(), configHash="ab" * 16, variant="h100", kvCacheDtype="fp8",
                              endpoint="http://10.0.0.1:8000", servedModelName="q", storage={"uri": "s3://bkt/a"},
                              qualityGate=gate)
    report = QualityReport(baselinePerplexity=10, perplexity=10.5, increasePercent=5, maxIncreasePercent=10, passed=True,
                           evalDataset="general-en-heldout", evalWindows=64, evalTokens=100,
                           metrics=[MetricResult(name="perplexity", kind="perplexity", base=10, quantized=10.5,
                                                 recoveryPercent=95.2, minRecoveryPercent=90.9, passed=True)],
                           evalIdentity="0" * 64)
    manifest = Manifest(key=ki.key(), keyInputs=ki, format=QuantFormat.FP8_DYNAMIC, files=[], totalBytes=0,
                        quality=report, createdAt="2026-01-01T00:00:00Z")
    objects = {f"a/{ki.key()}/manifest.json": json.dumps(manifest.to_wire()).encode()}
    with pytest.raises(CanaryError) as e:
        canary.base_report(FakeS3(objects), contract)
    assert f"evaluation identity {eval_identity(contract.qualityGate)[:12]}" in str(e.value)
    assert "000000000000" in str(e.value) and "must measure the base model" in str(e.value)

    # The re-evaluation under the gate's identity is where the base scores come from.
    identity = eval_identity(contract.qualityGate)
    objects[f"a/{ki.key()}/quality/{identity}.json"] = json.dumps(
        report.model_copy(update={"evalIdentity": identity}).to_wire()).encode()
    found, source, _ = canary.base_report(FakeS3(objects), contract)
    assert found.evalIdentity == identity and source.endswith(f"quality/{identity}.json")

    with pytest.raises(CanaryError, match="no artifact at s3://bkt/a/"):
        canary.base_report(FakeS3({}), contract)


def test_a_16_bit_variant_is_judged_against_the_16_bit_base_figures_of_a_quantized_artifact():
    """A `none` artifact measures nothing; the canary takes the 16-bit base's figures from a quantized
    artifact of the same model (``scoresKey``), as the Job's figures of the served model too."""
    from fewerbits_api.adapters import AdapterQuality

    plain = ArtifactKeyInputs(sourceUri="pvc://m/x", format=QuantFormat.NONE)
    fp8 = ArtifactKeyInputs(sourceUri="pvc://m/x", format=QuantFormat.FP8_DYNAMIC)
    contract = CanaryContract(key=plain.key(), scoresKey=fp8.key(), configHash="ab" * 16, variant="l4",
                              kvCacheDtype="fp8", endpoint="http://10.0.0.1:8000", servedModelName="q",
                              storage={"uri": "s3://bkt/a"})
    report = QualityReport(baselinePerplexity=10, perplexity=10.5, increasePercent=5, maxIncreasePercent=10, passed=True,
                           evalDataset="general-en-heldout", evalWindows=64, evalTokens=100,
                           metrics=[MetricResult(name="perplexity", kind="perplexity", base=10, quantized=10.5,
                                                 recoveryPercent=95.2, minRecoveryPercent=90.9, passed=True)],
                           adapters=[AdapterQuality(name="sound", baselinePerplexity=20, perplexity=20.4,
                                                    increasePercent=2, maxIncreasePercent=3, passed=True)],
                           evalIdentity=eval_identity(contract.qualityGate))
    own = Manifest(key=plain.key(), keyInputs=plain, format=QuantFormat.NONE, files=[], totalBytes=0,
                   createdAt="2026-01-01T00:00:00Z")
    scored = Manifest(key=fp8.key(), keyInputs=fp8, format=QuantFormat.FP8_DYNAMIC, files=[], totalBytes=0,
                      quality=report, createdAt="2026-01-01T00:00:00Z")
    objects = {f"a/{plain.key()}/manifest.json": json.dumps(own.to_wire()).encode(),
               f"a/{fp8.key()}/manifest.json": json.dumps(scored.to_wire()).encode()}
    found, source, manifest = canary.base_report(FakeS3(objects), contract)
    assert manifest.key == plain.key() and fp8.key() in source and "16-bit base" in source
    (m,) = canary.job_metrics(found).values()
    assert (m.base, m.quantized) == (10, 10) and found.adapters[0].perplexity == 20  # the Job's figure is the base's
    with pytest.raises(CanaryError, match="no base scores"):  # its own artifact alone has none: fail closed
        canary.base_report(FakeS3(objects), contract.model_copy(update={"scoresKey": None}))


# ------------------------------------------------------------------------------------- task parts
def test_tasks_become_parts_with_their_request_costs_or_are_skipped_with_the_reason(tmp_path):
    from fewerbits_api.quantizedmodel import QualityGateSpec
    from fewerbits_quantjob import lmeval

    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "lmeval"
    gate = QualityGateSpec(benchmarks=[{"task": "fewerbits_cloze", "limit": 5, "metric": "acc"}],
                           customEval={"dataset": "s3://bkt/c.jsonl", "metric": "contains", "limit": 3})
    prepared = lmeval.prepare(gate, tmp_path, local_custom=(fixtures / "custom-eval.jsonl").read_bytes(),
                              local_task_dirs=[fixtures])
    cloze, custom = prepared.tasks
    output_type, costs = canary._task_costs(prepared, cloze)
    assert output_type == "multiple_choice" and len(costs) == 5 and all(c == 4 for c in costs)  # one per choice
    assert canary._task_costs(prepared, custom) == ("generate_until", [1, 1, 1])

    skipped = canary.plan_task(cloze.name, "benchmark", output_type, costs, False, "HTTP 422")
    assert isinstance(skipped, SkippedMetric) and skipped.reason == "multiple_choice needs logprobs: HTTP 422"
    part = canary.plan_task(cloze.name, "benchmark", output_type, costs, True, "prompt_logprobs")
    assert isinstance(part, Part) and part.costs == costs and "echo logprobs" in part.method
    assert canary.plan_task(custom.name, "custom", "generate_until", [1], False, "x").method == "lm-eval local-completions"
    rolling = canary.plan_task("benchmark:wikitext/word_perplexity", "benchmark", "loglikelihood_rolling", [1], True, "")
    assert isinstance(rolling, SkippedMetric) and "unbounded" in rolling.reason


def test_each_adapter_the_pod_loads_is_asked_for_by_its_name_and_judged_against_the_16_bit_base(stand_in):
    """The adapters vLLM lists in /v1/models that the contract names are measured on their own
    windows under their own name; one the pod does not load is not asked for; one the Job has no
    16-bit figure for is skipped with the reason; a failing one fails the verdict naming it."""
    from fewerbits_api.adapters import AdapterEvaluation, AdapterQuality

    stand_in.models = ["q", "sound", "damaged", "nofigures"]
    evals = [AdapterEvaluation(name=n, uri=f"s3://adapters/{n}", evalDataset="general-en-heldout", evalSamples=4,
                               maxIncreasePercent=0.6 if n == "damaged" else 3.0)
             for n in ("sound", "damaged", "absent", "nofigures")]
    contract = CanaryContract(key="a" * 64, configHash="c" * 32, variant="h100", kvCacheDtype="fp8",
                              endpoint=stand_in.url, servedModelName="q", storage={"uri": "s3://models/q"},
                              adapters=evals)
    server = Server(stand_in.url, "q", timeout=10)
    windows = [[5, 6, 7, 8, 9]] * 2
    served = math.exp(sum(1 + (t % 7) / 10 for w in windows for t in w[1:]) / 8)
    figures = [AdapterQuality(name="sound", baselinePerplexity=served, perplexity=served, increasePercent=0.0,
                              maxIncreasePercent=3, passed=True),
               AdapterQuality(name="damaged", baselinePerplexity=served / 1.02, perplexity=served, increasePercent=2.0,
                              maxIncreasePercent=3, passed=True),
               AdapterQuality(name="absent", baselinePerplexity=9.0, maxIncreasePercent=3, passed=True)]
    report = QualityReport(baselinePerplexity=10, perplexity=10, increasePercent=0, maxIncreasePercent=5, passed=True,
                           evalDataset="general-en-heldout", evalWindows=8, evalTokens=800, adapters=figures,
                           evalIdentity=eval_identity(contract.qualityGate))
    out = canary.Outcome()
    found = canary.served_adapters(server, contract, report, (True, "prompt_logprobs"), out)
    assert [a.part for a in found] == ["adapter:sound", "adapter:damaged"]
    assert [(s.name, "no perplexity of it on the 16-bit base" in s.reason) for s in out.skipped] == \
        [("adapter:nofigures", True)]
    metrics = [canary.adapter_metric(server, a, windows, 2, lambda m: None) for a in found]
    asked = [r["model"] for r in stand_in.requests]
    assert asked == ["sound", "sound", "damaged", "damaged"] and server.requests == 5  # the model list counts
    sound, damaged = metrics
    assert sound.passed and sound.kind == "adapter" and sound.served == pytest.approx(served)
    assert not damaged.passed and damaged.base == pytest.approx(served / 1.02) and damaged.jobQuantized == served
    passed, reason = verdict(metrics, out.skipped, "fp8")
    assert not passed and reason.startswith("adapter damaged: perplexity") and "(+2.00%, max +0.6%)" in reason
    # Figures of another evaluation identity (adapters or their sets changed since) are not compared.
    out = canary.Outcome()
    stale = report.model_copy(update={"evalIdentity": "older"})
    assert canary.served_adapters(server, contract, stale, (True, "prompt_logprobs"), out) == []
    assert all("another evaluation identity" in s.reason for s in out.skipped) and len(out.skipped) == 3
    # The adapters' figures never stand for the base's: a verdict needs a base metric.
    assert verdict([sound], [], "fp8")[0] is False
    # Without prompt logprobs nothing of the adapters is measured: each loaded one is skipped, named.
    out = canary.Outcome()
    assert canary.served_adapters(server, contract, report, (False, "HTTP 422"), out) == []
    assert sorted(s.name for s in out.skipped) == ["adapter:damaged", "adapter:nofigures", "adapter:sound"]
