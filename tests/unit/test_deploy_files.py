"""deploy/ parses: the Ray Serve config by Ray's own schema, the manifests as YAML of the
expected kinds, and every import path they name resolves."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _resolves(import_path: str) -> bool:
    module, _, attr = import_path.partition(":")
    return callable(getattr(importlib.import_module(module), attr))


def test_serve_config_validates_with_ray():
    schema = pytest.importorskip("ray.serve.schema")
    raw = yaml.safe_load((DEPLOY / "serve.yaml").read_text())
    config = schema.ServeDeploySchema.model_validate(raw) if hasattr(
        schema.ServeDeploySchema, "model_validate") else schema.ServeDeploySchema.parse_obj(raw)
    names = {app.name for app in config.applications}
    assert names == {"gateway", "prefill", "decode", "kv_index", "balancer", "planner"}
    assert all(_resolves(app.import_path) for app in config.applications)


def test_kuberay_manifest_is_a_rayservice_with_a_valid_serve_config():
    schema = pytest.importorskip("ray.serve.schema")
    docs = list(yaml.safe_load_all((DEPLOY / "kuberay.yaml").read_text()))
    manifest = docs[0]
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    # NATS and Redis are defined too, with probes, behind the Services the apps name
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs[1:]}
    assert kinds == {("Deployment", "nats"), ("Service", "nats"), ("Deployment", "redis"),
                     ("Service", "redis")}
    for d in docs[1:]:
        if d["kind"] == "Deployment":
            container = d["spec"]["template"]["spec"]["containers"][0]
            assert container["readinessProbe"] and container["livenessProbe"]
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    schema.ServeDeploySchema.model_validate(serve_config)
    assert manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    # decode's DEP groups span two nodes: a placement group of one bundle per node
    pytest.importorskip("ray")
    from evenflow.rayserve.app import decode_app

    (decode,) = [a for a in serve_config["applications"] if a["name"] == "decode"]
    assert decode["args"]["ep_nodes"] == 2
    replica = decode_app(decode["args"])._bound_deployment._replica_config
    assert len(replica.placement_group_bundles) == 2
    assert replica.placement_group_strategy == "STRICT_SPREAD"
    workers = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert workers["minReplicas"] >= 2


def test_compose_has_the_data_plane_jaeger_and_every_service():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"nats", "redis", "jaeger", "gateway", "prefill", "decode", "kv_index",
            "balancer"} <= set(services)
    for name in ("gateway", "prefill", "decode", "kv_index", "balancer"):
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(":4318")
        assert services[name]["command"].split()[2] == f"evenflow.{name}"


def test_compose_services_have_healthchecks_and_wait_for_a_healthy_data_plane():
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    for name in ("nats", "redis", "gateway", "prefill", "decode", "kv_index", "balancer",
                 "prometheus"):
        assert services[name]["healthcheck"]["test"], name
        assert services[name]["restart"] == "unless-stopped"
    for name in ("gateway", "prefill", "decode", "kv_index", "balancer"):
        assert services[name]["depends_on"]["nats"]["condition"] == "service_healthy"
        assert services[name]["build"]["dockerfile"] == "Dockerfile"
    assert (DEPLOY.parent / "Dockerfile").is_file()
    assert "download.pytorch.org/whl/cpu" in (DEPLOY.parent / "Dockerfile").read_text()
    scraped = {t for job in yaml.safe_load((DEPLOY / "prometheus.yml").read_text())[
        "scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    assert {t.split(":")[0] for t in scraped} == {"gateway", "prefill", "decode", "kv_index",
                                                   "balancer"}


def exported_metric_names() -> set[str]:
    """Every series name the services export (importing the modules registers them)."""
    from prometheus_client import REGISTRY

    for module in ("evenflow.services.metrics", "evenflow.balancer.rank_stats",
                   "evenflow.balancer.role_balance", "evenflow.kv_index.service"):
        importlib.import_module(module)
    names = set()
    for family in REGISTRY.collect():
        names.add(family.name)
        names.update({family.name + suffix for suffix in ("_total", "_bucket", "_count",
                                                          "_sum", "_created")})
    return names


def test_the_dashboard_uses_only_exported_series():
    import json
    import re

    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "evenflow.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\b(?:vllm:|evenflow_)[a-z0-9_:]+",
                                                          expr)}
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:kv_cache_usage_perc",
            "evenflow_ep_group_balancedness"} <= used
    missing = used - exported_metric_names()
    assert not missing, missing
