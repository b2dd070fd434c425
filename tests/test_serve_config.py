"""infra/serve.yaml and the KubeRay manifest name the deployments that exist, validly."""

from __future__ import annotations

from pathlib import Path

import yaml
from ray.serve.schema import ServeDeploySchema

from schemas.settings import ServeSettings

ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENTS = {"SelfRAGIngress", "RetrievalDecider", "BranchPool", "Retriever", "Ranker"}


def _check(config: dict) -> None:
    schema = ServeDeploySchema.model_validate(config)
    app = schema.applications[0]
    assert app.import_path == "ray_app:app"
    names = {d.name for d in app.deployments}
    assert names == DEPLOYMENTS
    for d in app.deployments:
        auto = d.autoscaling_config
        assert auto["min_replicas"] <= auto["max_replicas"]
        assert auto["target_ongoing_requests"] > 0


def test_serve_yaml_is_a_valid_serve_config():
    config = yaml.safe_load((ROOT / "infra" / "serve.yaml").read_text())
    _check(config)
    retriever = next(
        d for d in config["applications"][0]["deployments"] if d["name"] == "Retriever"
    )
    # Embedded Qdrant: one client per folder.
    assert retriever["autoscaling_config"]["max_replicas"] == 1
    assert (
        sum(d["ray_actor_options"]["num_cpus"] for d in config["applications"][0]["deployments"])
        <= 2
    )
    # The same default as `selfrag serve` (serve.ray_access_log).
    assert config["logging_config"]["enable_access_log"] is ServeSettings().ray_access_log


def test_rayservice_manifest_embeds_a_valid_serve_config():
    manifest = yaml.safe_load((ROOT / "infra" / "k8s" / "rayservice.yaml").read_text())
    assert manifest["kind"] == "RayService"
    config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    _check(config)
    assert config["logging_config"]["enable_access_log"] is ServeSettings().ray_access_log
