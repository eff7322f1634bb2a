"""deploy/: the configs parse, the Ray cluster YAML passes Ray's schema, and every metric the
Grafana dashboard queries is one the coordinator exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_ray_cluster_yaml_matches_ray_schema_and_node_types():
    import jsonschema
    import ray.autoscaler

    config = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    types = config["available_node_types"]
    assert types["edge"]["resources"]["edge"] >= 1
    assert types["verifier"]["resources"]["verifier"] >= 1
    assert config["head_node_type"] in types


def test_kuberay_manifests_declare_custom_resources():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kuberay" / "raycluster.yaml").read_text()) if d]
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    for name in ("edge", "verifier"):
        resources = json.loads(json.loads(groups[name]["rayStartParams"]["resources"]))
        assert resources[name] >= 1
    job = yaml.safe_load((DEPLOY / "kuberay" / "rayjob-deploy.yaml").read_text())
    assert job["kind"] == "RayJob" and "coordinator.ray_app" in job["spec"]["entrypoint"]


def test_cluster_configs_select_the_same_grpc_transport_as_the_cli():
    from steerspec.serving.grpc_env import LEGACY_TCP_EXPERIMENTS

    config = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = next(c for c in config[key] if "ray start" in c)
        assert f"GRPC_EXPERIMENTS={LEGACY_TCP_EXPERIMENTS}" in start, key
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kuberay" / "raycluster.yaml").read_text()) if d]
    spec = next(d for d in docs if d["kind"] == "RayCluster")["spec"]
    pods = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
    for pod in pods:
        env = {e["name"]: e["value"] for e in pod["template"]["spec"]["containers"][0]["env"]}
        assert env["GRPC_EXPERIMENTS"] == LEGACY_TCP_EXPERIMENTS


@pytest.mark.parametrize("name", ["otel-collector.yaml", "prometheus.yaml", "docker-compose.yaml",
                                  "grafana-datasources.yaml", "grafana-dashboards.yaml"])
def test_observability_yaml_parses(name):
    assert isinstance(yaml.safe_load((DEPLOY / "observability" / name).read_text()), dict)


def test_dashboard_queries_exported_metrics():
    """Every metric a panel queries is one a service exports (tests/deploy/test_dashboard_prometheus.py evaluates
    the panels on a real Prometheus)."""
    from prometheus_client import generate_latest

    from steerspec.decoding.rounds import BlockStats
    from steerspec.observability.prometheus import SteerSpecMetrics
    from steerspec.observability.service_metrics import CallMetrics
    from steerspec.serving.batching import WindowBatcher

    metrics = SteerSpecMetrics()
    metrics.observe_block(BlockStats(seq=1, drafted=4, accepted=2, committed=3, cycle_ms=3.0, bytes_up=100, bytes_down=20))
    metrics.observe_generation()
    metrics.observe_request("text_completion", "m", 0.1, 0.01, 0.5)
    calls = CallMetrics("coordinator", metrics.registry)
    calls.calls.labels("coordinator", "Generate", "OK").inc()
    replica = CallMetrics("verifier")
    replica.watch_table([], lambda: 0)
    batcher = WindowBatcher(lambda jobs: jobs, 0.0, lambda: 1, inline=True)
    replica.watch_batcher(batcher)
    batcher.on_pass(2, 9)  # one pass of two blocks, nine rows
    replica.count_spec_decode().observe(4, 2)
    text = generate_latest(metrics.registry).decode() + generate_latest(replica.registry).decode()
    exported = set(re.findall(r"^((?:steerspec|gen_ai)_\w+?)(?:\{| )", text, re.M))
    dashboard = json.loads((DEPLOY / "observability" / "grafana-dashboard.json").read_text())
    queried = {m for panel in dashboard["panels"] for t in panel["targets"]
               for m in re.findall(r"\b((?:steerspec|gen_ai)_\w+)", t["expr"])}
    assert queried and queried <= exported, queried - exported
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for title in ("acceptance rate", "mean acceptance length", "accepted tokens/s", "acceptance by draft position",
                  "inter-token latency", "round trip", "stage breakdown", "bytes per block", "verifier batch",
                  "sessions per replica"):
        assert title in titles, title
