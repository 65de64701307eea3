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
    assert names == {"gateway", "prefill", "decode", "kv_index", "balancer"}
    assert all(_resolves(app.import_path) for app in config.applications)


def test_kuberay_manifest_is_a_rayservice_with_a_valid_serve_config():
    schema = pytest.importorskip("ray.serve.schema")
    manifest = yaml.safe_load((DEPLOY / "kuberay.yaml").read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    schema.ServeDeploySchema.model_validate(serve_config)
    assert manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]


def test_compose_has_the_data_plane_jaeger_and_every_service():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"nats", "redis", "jaeger", "gateway", "prefill", "decode", "kv_index",
            "balancer"} <= set(services)
    for name in ("gateway", "prefill", "decode", "kv_index", "balancer"):
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(":4318")
        assert services[name]["command"].split()[2] == f"evenflow.{name}"
