"""deploy/: the Dockerfile, the compose stack (Prometheus, Grafana and its dashboard) and
the Helm chart are checked against the code they deploy: files they mount exist, the
settings and metrics they name are real, the probes hit real routes, and each binds
0.0.0.0 only with API keys or ``allow_anonymous`` given by name.  The compose file is
validated against the Compose Specification's schema.  (No helm binary installs from the
registries here: the chart is not rendered; its values and names are checked instead.)
The Dockerfile's lint by hadolint is in the processes tier (tests/processes/test_hadolint.py),
a GPU host's install resolved against the registry in the network tier
(tests/network/test_gpu_install.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.cli import anonymous_bind_refusal
from gateway.core.config import Settings, unknown_env
from tests.settings import gateway_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "vcache"


def _family(metric: str) -> str:
    """A sample's or family's name without the suffixes Prometheus adds."""
    return re.sub(r"_(bucket|total|count|sum|created)$", "", metric)


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def exposed(demo_model: Path) -> tuple[set[str], set[str]]:
    """(metric families on /metrics, route paths) of a gateway with providers configured."""
    engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)))
    settings = gateway_settings(grpc_port=None, providers={"openai": {"api_key": "x"}})
    app = create_app(settings, [engine])
    with TestClient(app) as http:
        text = http.get("/metrics").text
    families = {_family(m) for m in re.findall(r"^# HELP (\w+)", text, re.M)}
    routes = {getattr(r, "path", "") for r in app.routes}
    return families, routes


def test_the_dockerfile_runs_vcache_on_vllm_032_as_a_user_with_a_healthcheck() -> None:
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v0\.32\.\d+$", text, re.M)
    user = re.search(r"^USER (\S+)$", text, re.M)
    assert user and user.group(1) not in ("root", "0")
    assert "HEALTHCHECK" in text and "/healthz" in text
    assert 'ENTRYPOINT ["vcache", "serve"]' in text
    for src in re.findall(r"^COPY (\S+)", text, re.M):
        assert (ROOT / src).exists(), src


def test_the_compose_file_follows_the_compose_specification() -> None:
    schema = json.loads((ROOT / "tests" / "unit" / "data" / "compose_spec.json").read_text())
    validator = jsonschema.Draft201909Validator(schema)
    compose = _yaml(DEPLOY / "compose.yaml")
    assert [e.message for e in validator.iter_errors(compose)] == []
    compose["services"]["vcache"]["ports"] = "8000"  # not a list: the schema says so
    assert any("is not of type 'array'" in e.message for e in validator.iter_errors(compose))


def test_the_compose_stack_mounts_files_that_exist() -> None:
    compose = _yaml(DEPLOY / "compose.yaml")
    assert set(compose["services"]) == {"vcache", "prometheus", "grafana", "postgres", "redis"}
    build = compose["services"]["vcache"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).exists()
    for svc in compose["services"].values():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), source
    prom = _yaml(DEPLOY / "prometheus" / "prometheus.yml")
    target = prom["scrape_configs"][0]["static_configs"][0]["targets"][0]
    assert (
        target == "vcache:8000" and "127.0.0.1:8000:8000" in compose["services"]["vcache"]["ports"]
    )
    env = compose["services"]["vcache"]["environment"]
    nested: dict[str, Any] = {}
    for k, v in env.items():
        *parents, leaf = k.removeprefix("VCACHE_").lower().split("__")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = v
    settings = gateway_settings(**nested)
    assert settings.session_log.url and settings.state.url  # the stores of the stack
    assert settings.session_log.url.endswith("@postgres:5432/vcache")
    assert settings.state.url == "redis://redis:6379/0"


def test_the_image_binds_every_interface_and_leaves_keys_or_anonymous_to_its_user() -> None:
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    env = re.search(r"^ENV (?:.*\\\n)*.*$", text, re.M)
    assert env and "VCACHE_HOST=0.0.0.0" in env.group(0)
    # neither is decided in the image: started with neither, the gateway refuses to serve
    assert "VCACHE_API_KEYS" not in env.group(0) and "VCACHE_ALLOW_ANONYMOUS" not in env.group(0)
    assert anonymous_bind_refusal("0.0.0.0", keyed=False, allow_anonymous=False)
    header = text.split("ARG ")[0]  # the usage comment names both ways in
    assert "VCACHE_API_KEYS" in header and "--allow-anonymous" in header
    assert "VCACHE_ALLOW_ANONYMOUS=true" in header


def test_the_compose_gateway_binds_every_interface_with_keys_or_anonymous_by_name() -> None:
    service = _yaml(DEPLOY / "compose.yaml")["services"]["vcache"]
    env = service["environment"]
    config = _yaml(DEPLOY / "vcache.example.yaml")  # mounted as its --config
    keyed = bool(env.get("VCACHE_API_KEYS") or config.get("api_keys"))
    anonymous = str(env.get("VCACHE_ALLOW_ANONYMOUS", config.get("allow_anonymous"))) == "true"
    assert env["VCACHE_HOST"] == "0.0.0.0"
    assert keyed or anonymous, "set api_keys or VCACHE_ALLOW_ANONYMOUS by name"
    assert anonymous_bind_refusal(env["VCACHE_HOST"], keyed, anonymous) is None
    if not keyed:  # served anonymously: published on the host's loopback only
        assert all(str(p).startswith("127.0.0.1:") for p in service["ports"]), service["ports"]


def test_the_chart_binds_every_interface_with_keys_or_anonymous_by_name() -> None:
    values = _yaml(CHART / "values.yaml")["gateway"]
    gateway = (CHART / "templates" / "gateway.yaml").read_text()
    secrets = (CHART / "templates" / "secret.yaml").read_text()
    assert '{name: VCACHE_HOST, value: "0.0.0.0"}' in gateway
    # neither by default: the render fails, naming both
    assert values["apiKeys"] == [] and values["allowAnonymous"] is False
    guard = r"if not \(or \.Values\.gateway\.apiKeys \.Values\.gateway\.allowAnonymous\) }}"
    assert re.search(
        guard + r'\n{{- fail "[^"]*gateway\.apiKeys[^"]*gateway\.allowAnonymous', gateway
    )
    keys = r"if \.Values\.gateway\.apiKeys }}\n\s*- name: VCACHE_API_KEYS\n"
    assert re.search(keys + r".*secretKeyRef: {name: .*-keys, key: apiKeys}", gateway)
    assert "apiKeys: {{ toJson .Values.gateway.apiKeys | quote }}" in secrets
    anonymous = r"if \.Values\.gateway\.allowAnonymous }}\n\s*- {name: VCACHE_ALLOW_ANONYMOUS, "
    assert re.search(anonymous + r'value: "true"}', gateway)


def test_the_dashboard_queries_metrics_the_gateway_exposes(
    exposed: tuple[set[str], set[str]],
) -> None:
    families, _ = exposed
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "vcache.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {_family(m) for e in exprs for m in re.findall(r"\bvcache_\w+", e)}
    assert len(dash["panels"]) >= 10
    assert used and used <= families, used - families
    provisioned = _yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    assert provisioned["datasources"][0]["uid"] == dash["panels"][0]["datasource"]["uid"]


def test_the_chart_names_only_values_it_has_and_routes_that_exist(
    exposed: tuple[set[str], set[str]],
) -> None:
    _, routes = exposed
    chart = _yaml(CHART / "Chart.yaml")
    assert chart["apiVersion"] == "v2" and chart["name"] == "vcache"
    values = _yaml(CHART / "values.yaml")
    templates = "".join(p.read_text() for p in sorted((CHART / "templates").iterdir()))
    for ref in set(re.findall(r"\.Values\.([\w.]+)", templates)):
        node: Any = values
        for part in ref.split("."):
            assert isinstance(node, dict) and part in node, f".Values.{ref} is not in values.yaml"
            node = node[part]
    for path in re.findall(r"path: (/\w+)", templates):
        assert path in routes or path == "/health", path  # /health: vLLM's own
    assert "/readyz" in templates and "/healthz" in templates


def test_the_chart_configures_the_gateway_with_real_settings() -> None:
    templates = (CHART / "templates" / "gateway.yaml").read_text()
    names = set(re.findall(r"name: (VCACHE_\w+)", templates))
    assert not unknown_env({n: "x" for n in names})
    top = {n.removeprefix("VCACHE_").lower() for n in names if "__" not in n}
    assert top - {"control_secret"} <= set(Settings.model_fields), top
    replicas = (CHART / "templates" / "vllm-statefulset.yaml").read_text()
    for needed in (
        "--prefix-caching-hash-algo=sha256_cbor",
        "VLLM_PLUGINS",
        "enable_kv_cache_events",
    ):
        assert needed in replicas


def test_the_chart_runs_gateways_active_active_on_shared_stores() -> None:
    values = _yaml(CHART / "values.yaml")
    gateway = (CHART / "templates" / "gateway.yaml").read_text()
    secrets = (CHART / "templates" / "secret.yaml").read_text()
    assert values["gateway"]["replicas"] > 1
    assert "kind: PodDisruptionBudget" in gateway and "minAvailable" in gateway
    # more than one gateway without a shared log is refused at render time, by name
    assert re.search(r"fail \"gateway.replicas > 1 needs sharedState.postgresUrl", gateway)
    for env, key in (("VCACHE_SESSION_LOG__URL", "postgresUrl"), ("VCACHE_STATE__URL", "redisUrl")):
        assert re.search(rf"{env}\n.*secretKeyRef: {{name: .*-stores, key: {key}}}", gateway)
        assert f"{key}: {{{{ .Values.sharedState.{key} | quote }}}}" in secrets
    assert "VCACHE_INSTANCE_ID" in gateway and "metadata.name" in gateway
    assert "--workers={{ .Values.gateway.workers }}" in gateway
