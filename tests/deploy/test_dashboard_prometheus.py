"""The Grafana dashboard against a real Prometheus: Debian's `prometheus` scrapes the three real services
(verifier, drafter, coordinator as processes, tiny pair) through real generations over gRPC and HTTP, and every
PromQL expression of every panel is evaluated through Prometheus' HTTP API: each result non-empty and finite,
the counters equal to the generations' own summaries. `make test` installs prometheus when it can
(scripts/ensure-prometheus.sh); without it this test is skipped."""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import openai
import pytest

from coord_helpers import ROOT, kill, service_env, spawn_service, wait_ready
from coordinator.client import Client

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("prometheus") is None,
                                                   reason="prometheus not installed (scripts/ensure-prometheus.sh)")]
DASHBOARD = ROOT / "deploy" / "observability" / "grafana-dashboard.json"
WINDOW = "60s"  # $__rate_interval: the window covers every measured generation
PROMPTS = ["def fibonacci(n):", "class Queue:", "import os\n", "for i in range(10):"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _metrics_address(log: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = re.search(r"metrics on http://(127\.0\.0\.1:\d+)/metrics", Path(log).read_text())
        if match:
            return match.group(1)
        time.sleep(0.05)
    raise RuntimeError(f"no metrics address in {Path(log).read_text()[-2000:]}")


def _query(prom: str, expr: str) -> list:
    url = f"http://{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as reply:
        body = json.loads(reply.read())
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _scalar(prom: str, expr: str) -> float:
    result = _query(prom, expr)
    assert len(result) == 1, (expr, result)
    return float(result[0]["value"][1])


@pytest.fixture
def services(tiny_pair, tmp_path):
    """Verifier, drafter and coordinator processes with /metrics, and a Prometheus scraping them every 200 ms."""
    procs = []
    try:
        verifier, vlog = spawn_service("verifier", tiny_pair[0], "--metrics-port", "0")
        drafter, dlog = spawn_service("drafter", tiny_pair[1], "--metrics-port", "0")
        procs += [verifier, drafter]
        v_target, d_target = wait_ready(verifier, vlog), wait_ready(drafter, dlog)
        clog = tempfile.NamedTemporaryFile("w+", prefix="steerspec-coordinator-", suffix=".log", delete=False).name
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "steerspec", "serve", "coordinator",
             "--port", "0", "--verifier", v_target, "--drafter", d_target, "--metrics-port", "0", "--http-port", "0"],
            stdout=open(clog, "w"), stderr=subprocess.STDOUT, text=True, env=service_env(), cwd=str(ROOT))
        procs.append(coordinator)
        c_target = wait_ready(coordinator, clog)
        http = re.search(r"API at (http://127\.0\.0\.1:\d+/v1)", Path(clog).read_text()).group(1)
        targets = {"verifier": _metrics_address(vlog), "drafter": _metrics_address(dlog),
                   "coordinator": _metrics_address(clog)}
        config = {"global": {"scrape_interval": "200ms", "scrape_timeout": "150ms"},
                  "scrape_configs": [{"job_name": f"steerspec-{name}", "static_configs": [{"targets": [address]}]}
                                     for name, address in targets.items()]}
        (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # YAML is a superset of JSON
        prom = f"127.0.0.1:{_free_port()}"
        prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address={prom}", "--log.level=warn"],
            stdout=open(tmp_path / "prometheus.log", "w"), stderr=subprocess.STDOUT)
        procs.append(prometheus)
        deadline = time.monotonic() + 30
        while True:
            try:
                up = _query(prom, "up")
                if len(up) == 3 and all(r["value"][1] == "1" for r in up):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and prometheus.poll() is None, \
                (tmp_path / "prometheus.log").read_text()[-2000:]
            time.sleep(0.1)
        yield {"grpc": c_target, "http": http, "prometheus": prom}
    finally:
        for proc in reversed(procs):
            kill(proc)


def _generate(services, n_grpc: int, n_http: int) -> list:
    """Concurrent generations, half through the gRPC SDK, half through the HTTP API: their (drafted, accepted,
    blocks with drafts, tokens) from each one's own summary."""
    out, errors = [], []
    model = openai.OpenAI(base_url=services["http"], api_key="x", max_retries=0).models.list().data[0].id

    def grpc_one(prompt):
        with Client(services["grpc"], retries=0) as client:
            s = client.complete(prompt, max_new_tokens=20, k=3, timeout=60)
        out.append((s.drafted, s.accepted, sum(1 for d in s.block_drafted if d), len(s.token_ids)))

    def http_one(prompt):
        client = openai.OpenAI(base_url=services["http"], api_key="x", max_retries=0)
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"k": 3})
        final = list(stream)[-1]
        spec = final.metrics["speculative_decoding"]
        out.append((spec["num_draft_tokens"], spec["num_accepted_draft_tokens"], spec["num_spec_steps"],
                    final.usage.completion_tokens))

    def guarded(fn, prompt):
        try:
            fn(prompt)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(grpc_one, PROMPTS[i % 4])) for i in range(n_grpc)]
    threads += [threading.Thread(target=guarded, args=(http_one, PROMPTS[(i + 1) % 4])) for i in range(n_http)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    return out


def _counters(runs) -> dict:
    """What the services' counters must read after `runs` (each run's own summary figures)."""
    drafted, accepted = sum(r[0] for r in runs), sum(r[1] for r in runs)
    return {'steerspec_spec_decode_num_draft_tokens_total{service="coordinator"}': drafted,
            'steerspec_spec_decode_num_accepted_tokens_total{service="coordinator"}': accepted,
            'steerspec_spec_decode_num_drafts_total{service="coordinator"}': sum(r[2] for r in runs),
            'steerspec_spec_decode_num_draft_tokens_total{service="verifier"}': drafted,
            'steerspec_spec_decode_num_accepted_tokens_total{service="verifier"}': accepted,
            'steerspec_generated_tokens_total{service="coordinator"}': sum(r[3] for r in runs),
            'sum(steerspec_generations_total{service="coordinator"})': len(runs),
            'sum(gen_ai_server_request_duration_seconds_count{service="coordinator"})': len(runs),
            'sum(steerspec_spec_decode_num_accepted_tokens_per_pos_total{service="coordinator"})': accepted}


def _scraped(prom: str, want: dict, timeout_s: float = 10.0) -> dict:
    """The counters as Prometheus reads them, once they reach `want` (or at the timeout)."""
    want = {k: float(v) for k, v in want.items()}
    deadline = time.monotonic() + timeout_s
    while True:
        got = {expr: [float(r["value"][1]) for r in _query(prom, expr)] for expr in want}
        got = {expr: values[0] if len(values) == 1 else values for expr, values in got.items()}  # [] until scraped
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_every_dashboard_panel_evaluates_on_prometheus_scraping_the_real_services(services):
    prom = services["prometheus"]
    warm = _generate(services, 1, 1)  # every labelled series exists, and is scraped, before the measured window
    assert _scraped(prom, _counters(warm)) == {k: float(v) for k, v in _counters(warm).items()}
    window_start = time.time()
    time.sleep(0.6)  # flat samples open the measured window
    measured = _generate(services, 2, 2)
    want = _counters(warm + measured)
    assert _scraped(prom, want) == {k: float(v) for k, v in want.items()}
    dashboard = json.loads(DASHBOARD.read_text())
    evaluated = 0
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", WINDOW)
            result = _query(prom, expr)
            assert result, f"panel '{panel['title']}': no data for {expr}"
            values = [float(r["value"][1]) for r in result]
            assert all(math.isfinite(v) for v in values), f"panel '{panel['title']}': {expr} -> {values}"
            evaluated += 1
    assert evaluated >= 25
    # over a window holding just the measured generations, the ratio panels equal their summaries' ratios
    window = f"{int((time.time() - window_start) * 1000)}ms"
    m_drafted, m_accepted, steps = (sum(r[i] for r in measured) for i in range(3))
    rate = next(p for p in dashboard["panels"] if p["title"] == "Acceptance rate")["targets"][0]["expr"]
    assert _scalar(prom, rate.replace("$__rate_interval", window)) == pytest.approx(m_accepted / m_drafted, rel=1e-6)
    length = next(p for p in dashboard["panels"] if p["title"] == "Mean acceptance length")["targets"][0]["expr"]
    assert _scalar(prom, length.replace("$__rate_interval", window)) == pytest.approx(1 + m_accepted / steps,
                                                                                     rel=1e-6)
