"""Every RECUR_ variable the deploy files set is a field of app.config.Settings.

pydantic-settings ignores an environment variable it has no field for, so a misspelt or
renamed RECUR_ variable in the Dockerfile, compose file or manifests would be silently
dropped (for API keys: a deployment left open). This catches it.
"""

from __future__ import annotations

import re

import yaml

from app.config import Settings
from tests.deploy.test_deploy_lint import COMPOSE, DOCKERFILE, k8s_docs


def test_every_recur_variable_is_a_setting() -> None:
    """A misspelt RECUR_ variable is silently ignored by the server, so catch it here."""
    known = {f"RECUR_{name.upper()}" for name in Settings.model_fields}
    used: dict[str, str] = {}
    for var in re.findall(r"\b(RECUR_[A-Z_]+)=", DOCKERFILE.read_text()):
        used[var] = "Dockerfile"
    for var in yaml.safe_load(COMPOSE.read_text())["services"]["recur"]["environment"]:
        used[var] = "docker/compose.yaml"
    for path, doc in k8s_docs():
        if doc["kind"] == "ConfigMap":
            names = list(doc["data"])
        elif doc["kind"] == "Deployment":
            names = [
                e["name"] for c in doc["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])
            ]
        else:
            continue
        used.update({n: f"docker/k8s/{path.name}" for n in names})
    unknown = {var: where for var, where in used.items() if var.startswith("RECUR_") and var not in known}
    assert not unknown, f"not fields of app.config.Settings: {unknown}"
