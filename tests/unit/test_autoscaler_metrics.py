"""vLLM /metrics parsing (both KV metric names), direct scraping over real HTTP on 127.0.0.1, and
the Prometheus source against a real HTTP server speaking the /api/v1/query protocol."""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fewerbits_operator.autoscaler.metrics import (
    KV_USAGE,
    KV_USAGE_OLD,
    DirectScrapeSource,
    PodSample,
    PodTarget,
    PrometheusSource,
    ScrapeFailure,
    parse_vllm_metrics,
    scrape_pod,
)


def vllm_page(kv: float | None = 0.5, waiting: float = 2, running: float = 7, old_kv: float | None = None,
              model: str = "m", preemptions: float = 3, extra: str = "") -> str:
    """A /metrics page shaped like vLLM's (HELP/TYPE lines, labels, histograms around)."""
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f'vllm:num_requests_running{{engine="0",model_name="{model}"}} {running}',
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f'vllm:num_requests_waiting{{engine="0",model_name="{model}"}} {waiting}',
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
        "# TYPE vllm:num_preemptions_total counter",
        f'vllm:num_preemptions_total{{engine="0",model_name="{model}"}} {preemptions}',
        "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.1",model_name="{model}"}} 4.0',
        f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="{model}"}} 9.0',
        f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="{model}"}} 9.0',
        f'vllm:time_to_first_token_seconds_sum{{engine="0",model_name="{model}"}} 1.5',
    ]
    if kv is not None:
        lines += ["# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
                  "# TYPE vllm:kv_cache_usage_perc gauge",
                  f'vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} {kv}']
    if old_kv is not None:
        lines += ["# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.",
                  "# TYPE vllm:gpu_cache_usage_perc gauge",
                  f'vllm:gpu_cache_usage_perc{{model_name="{model}"}} {old_kv}']
    return "\n".join(lines) + "\n" + extra


# ------------------------------------------------------------------ parsing


def test_new_kv_name():
    s = parse_vllm_metrics(vllm_page(kv=0.42, waiting=3, running=11, preemptions=5), "p")
    assert s == PodSample("p", 0.42, 3.0, 11.0, 5.0, KV_USAGE)


def test_old_kv_name_only_vllm_before_0_10():
    s = parse_vllm_metrics(vllm_page(kv=None, old_kv=0.81), "p")
    assert isinstance(s, PodSample)
    assert s.kv_cache_usage == pytest.approx(0.81) and s.kv_metric == KV_USAGE_OLD


def test_both_names_prefers_new():
    s = parse_vllm_metrics(vllm_page(kv=0.2, old_kv=0.9), "p")
    assert isinstance(s, PodSample) and s.kv_cache_usage == pytest.approx(0.2) and s.kv_metric == KV_USAGE


def test_several_model_names_and_engines_kv_averaged_counts_summed():
    text = (vllm_page(kv=0.2, waiting=1, running=4, model="a", preemptions=1)
            + vllm_page(kv=0.6, waiting=3, running=6, model="b", preemptions=2).replace("# HELP", "# X").replace("# TYPE", "# Y"))
    # The second page repeats families; re-emit it without HELP/TYPE lines so it parses as one page.
    text = "\n".join(line for line in text.splitlines() if not line.startswith(("# X", "# Y")))
    s = parse_vllm_metrics(text, "p")
    assert isinstance(s, PodSample)
    assert s.kv_cache_usage == pytest.approx(0.4)
    assert s.waiting == 4 and s.running == 10 and s.preemptions_total == 3


def test_model_name_filter_narrows_when_present_and_falls_back_when_absent():
    text = "\n".join([
        'vllm:kv_cache_usage_perc{model_name="a"} 0.2', 'vllm:kv_cache_usage_perc{model_name="b"} 0.8',
        'vllm:num_requests_waiting{model_name="a"} 1', 'vllm:num_requests_waiting{model_name="b"} 9', ""])
    mine = parse_vllm_metrics(text, "p", model_name="b")
    assert isinstance(mine, PodSample) and mine.kv_cache_usage == pytest.approx(0.8) and mine.waiting == 9
    other = parse_vllm_metrics(text, "p", model_name="zzz")
    assert isinstance(other, PodSample) and other.kv_cache_usage == pytest.approx(0.5) and other.waiting == 10


def test_nan_series_ignored_and_values_clamped():
    text = "\n".join(['vllm:kv_cache_usage_perc{engine="0"} NaN', 'vllm:kv_cache_usage_perc{engine="1"} 1.7',
                      'vllm:num_requests_waiting 2', ""])
    s = parse_vllm_metrics(text, "p")
    assert isinstance(s, PodSample) and s.kv_cache_usage == 1.0 and s.running is None and s.preemptions_total is None


@pytest.mark.parametrize("text,needle", [
    ("", "no KV-cache metric"),
    ("vllm:kv_cache_usage_perc 0.5\n", "num_requests_waiting"),
    ("process_cpu_seconds_total 3\n", "not a vLLM server"),
    ("vllm:kv_cache_usage_perc{ 0.5 garbage\n", "unparseable"),
    ('vllm:kv_cache_usage_perc NaN\nvllm:num_requests_waiting 1\n', "no KV-cache metric"),
])
def test_unusable_pages_are_typed_failures(text, needle):
    r = parse_vllm_metrics(text, "p")
    assert isinstance(r, ScrapeFailure) and needle in r.reason and r.pod == "p"


# ------------------------------------------------------------------ HTTP


@contextmanager
def serve(handler_fn):
    """A real HTTP server on 127.0.0.1; handler_fn(path) -> (status, body, delay_seconds)."""

    class H(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            status, body, delay = handler_fn(self.path)
            if delay:
                time.sleep(delay)
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    class Quiet(ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            pass  # a client that timed out and hung up is the point of some tests

    srv = Quiet(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    t.start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


def test_scrape_reads_metrics_over_http():
    seen = []

    def h(path):
        seen.append(path)
        return 200, vllm_page(kv=0.33, waiting=4), 0

    with serve(h) as port:
        s = scrape_pod(PodTarget("ns", "p", "127.0.0.1", port))
    assert seen == ["/metrics"]
    assert isinstance(s, PodSample) and s.kv_cache_usage == pytest.approx(0.33) and s.waiting == 4


def test_scrape_failures_are_typed():
    with serve(lambda path: (500, "boom", 0)) as port:
        r = scrape_pod(PodTarget("ns", "p", "127.0.0.1", port))
    assert isinstance(r, ScrapeFailure) and "HTTP 500" in r.reason
    with serve(lambda path: (200, vllm_page(), 1.0)) as port:
        t0 = time.monotonic()
        r = scrape_pod(PodTarget("ns", "p", "127.0.0.1", port), timeout=0.2)
        assert time.monotonic() - t0 < 0.9
    assert isinstance(r, ScrapeFailure) and "cannot read" in r.reason
    with serve(lambda path: (200, "", 0)) as port:
        pass  # closed now: connection refused
    r = scrape_pod(PodTarget("ns", "p", "127.0.0.1", port), timeout=0.5)
    assert isinstance(r, ScrapeFailure) and "cannot read" in r.reason


def test_direct_source_scrapes_in_parallel():
    # Each answer waits until all 8 scrapes are in flight at once (counters, not a clock); scraped
    # one after another, at most one would ever be in flight.
    lock, state, all_in = threading.Lock(), {"in_flight": 0, "most": 0}, threading.Event()

    def page(path):
        with lock:
            state["in_flight"] += 1
            state["most"] = max(state["most"], state["in_flight"])
            if state["in_flight"] == 8:
                all_in.set()
        all_in.wait(timeout=1.5)
        with lock:
            state["in_flight"] -= 1
        return 200, vllm_page(kv=0.5), 0

    with serve(page) as port:
        pods = [PodTarget("ns", f"p{i}", "127.0.0.1", port) for i in range(8)]
        got = DirectScrapeSource(timeout=30).sample(pods)
    assert state["most"] == 8, f"at most {state['most']} scrapes were in flight together"
    assert set(got) == {f"p{i}" for i in range(8)} and all(isinstance(v, PodSample) for v in got.values())


def test_ipv6_url():
    assert PodTarget("ns", "p", "fd00::5", 8000).metrics_url == "http://[fd00::5]:8000/metrics"


# ------------------------------------------------------------------ Prometheus


def prometheus(series: dict[str, dict[str, float]], queries: list[str], status: str = "success"):
    """A tiny /api/v1/query server: answers by which metric the query names (enough to check the
    source's queries and its handling of each answer)."""

    def h(path):
        u = urllib.parse.urlparse(path)
        assert u.path == "/api/v1/query"
        q = urllib.parse.parse_qs(u.query)["query"][0]
        queries.append(q)
        if status != "success":
            return 400, json.dumps({"status": "error", "errorType": "bad_data", "error": "parse error"}), 0
        if q.startswith("time() - max"):
            key = "age"
        elif "unless" in q:
            key = "kv_old"
        elif q.startswith("avg by (pod) (vllm:kv_cache_usage_perc"):
            key = "kv"
        else:
            key = next(k for k in ("waiting", "running", "preemptions") if k in q)
        result = [{"metric": {"pod": pod}, "value": [time.time(), str(v)]} for pod, v in series.get(key, {}).items()]
        return 200, json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}), 0

    return h


def test_prometheus_source_per_pod_figures():
    queries: list[str] = []
    series = {"kv": {"a": 0.4, "b": 0.9}, "kv_old": {"b": 0.9}, "waiting": {"a": 1, "b": 6, "c": 2},
              "running": {"a": 5}, "preemptions": {}, "age": {"a": 5, "b": 3, "d": 500}}
    with serve(prometheus(series, queries)) as port:
        src = PrometheusSource(f"http://127.0.0.1:{port}/", max_age_seconds=60)
        pods = [PodTarget("llm", n, "10.0.0.1") for n in ("a", "b", "c", "d")]
        got = src.sample(pods)
    assert got["a"] == PodSample("a", 0.4, 1.0, 5.0, None, KV_USAGE)
    assert isinstance(got["b"], PodSample) and got["b"].kv_metric == KV_USAGE_OLD and got["b"].running is None
    assert isinstance(got["c"], ScrapeFailure) and "no vllm:kv_cache_usage_perc or" in got["c"].reason
    assert isinstance(got["d"], ScrapeFailure)
    kvq = next(q for q in queries if q.startswith("avg by (pod) (vllm:kv_cache_usage_perc"))
    # Both names, the new one on the left of `or` (PromQL keeps the left where both exist).
    assert kvq.index("vllm:kv_cache_usage_perc") < kvq.index(" or ") < kvq.index("vllm:gpu_cache_usage_perc")
    assert 'namespace="llm"' in kvq and 'pod=~"a|b|c|d"' in kvq


def test_prometheus_stale_sample_is_a_failure():
    series = {"kv": {"a": 0.4}, "waiting": {"a": 1}, "age": {"a": 120}}
    with serve(prometheus(series, [])) as port:
        got = PrometheusSource(f"http://127.0.0.1:{port}", max_age_seconds=60).sample([PodTarget("llm", "a", "x")])
    assert isinstance(got["a"], ScrapeFailure) and "120s old" in got["a"].reason


def test_prometheus_errors_fail_every_pod_typed():
    with serve(prometheus({}, [], status="error")) as port:
        got = PrometheusSource(f"http://127.0.0.1:{port}").sample([PodTarget("llm", "a", "x"), PodTarget("llm", "b", "y")])
    assert all(isinstance(v, ScrapeFailure) and "Prometheus query failed" in v.reason for v in got.values())
    got = PrometheusSource("http://127.0.0.1:1", timeout=0.5).sample([PodTarget("llm", "a", "x")])
    assert isinstance(got["a"], ScrapeFailure)


def test_prometheus_pod_names_are_escaped_in_the_regex():
    q = PrometheusSource("http://x").queries("ns", ["m-h100.0", 'we"ird'])
    # re.escape for the regex, then PromQL string escaping of the backslashes and quotes.
    assert 'pod=~"m\\\\-h100\\\\.0|we\\"ird"' in q["kv"]
