"""deploy/kubernetes*/ validated offline against the real schemas: Kubernetes' own OpenAPI
schemas (kubernetes-validate, strict: an unknown field is an error) for the version
docs/deployment.md names, and the Prometheus Operator's CRD schemas for ServiceMonitor and
PrometheusRule.

The CRD schemas come from cloudcoil-models-prometheus-operator (PyPI), pydantic models
generated from the operator's CRDs (v0.80.1): field types, enums, patterns such as the
Duration of ``interval`` and ``for``, and required fields are checked by the model; a field
the CRD does not have is dropped by it, so the document must also equal its model's dump.
Both packages are in the dev extra; the raw manifests are checked without anything else,
the kustomize renderings (labels and images applied, the TLS overlay's patches) where
kubectl is installed (:mod:`tests.tooling`: a skip locally, a failure in CI).
"""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.files import DEPLOY, KUBERNETES, REPO, kubernetes_documents
from tests.tooling import require_tool

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate (dev extra) holds Kubernetes' schemas"
)
prometheus_operator = pytest.importorskip(
    "cloudcoil.models.prometheus_operator.v1",
    reason="cloudcoil-models-prometheus-operator (dev extra) holds the operator's CRD schemas",
)

KUBERNETES_TLS = DEPLOY / "kubernetes-tls"
CRD_MODELS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): prometheus_operator.ServiceMonitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): prometheus_operator.PrometheusRule,
}


def documented_kubernetes_version() -> str:
    """The oldest Kubernetes the deployment page says the manifests need
    (``Kubernetes >= 1.29``)."""
    text = (REPO / "docs" / "deployment.md").read_text()
    found = set(re.findall(r"Kubernetes >= (\d+\.\d+)", text))
    assert len(found) == 1, f"docs/deployment.md should name one minimum version: {found}"
    return found.pop()


VERSION = documented_kubernetes_version()


def validate(doc: dict[str, Any], version: str = VERSION) -> None:
    """Raise (kubernetes_validate.ValidationError, pydantic.ValidationError, AssertionError)
    unless ``doc`` is valid for its kind's schema."""
    model = CRD_MODELS.get((doc["apiVersion"], doc["kind"]))
    if model is None:
        kubernetes_validate.validate(doc, version, strict=True)
        return
    parsed = model.model_validate(doc)
    dumped = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    assert dumped == doc, f"{doc['kind']}: fields its CRD does not define (dropped by the model)"


def raw_documents() -> list[tuple[str, dict[str, Any]]]:
    """Every object deploy/kubernetes/kustomization.yaml lists, with its file name (the TLS
    overlay holds patches, not objects: it is checked as kustomize renders it)."""
    return [(path.name, doc) for path, doc in kubernetes_documents()]


def test_readme_names_a_version_the_validator_has() -> None:
    assert VERSION == "1.29"
    # kubernetes-validate picks the newest schema not newer than the version asked for.
    assert (
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {}},
            VERSION,
            strict=True,
        )
        == VERSION
    )


def test_every_base_manifest_is_valid() -> None:
    """deploy/kubernetes/ as written."""
    docs = raw_documents()
    assert sorted(doc["kind"] for _, doc in docs) == [
        "Deployment",
        "PrometheusRule",
        "Service",
        "ServiceMonitor",
    ]
    for name, doc in docs:
        try:
            validate(doc)
        except Exception as exc:  # the name of the file, then the validator's own message
            raise AssertionError(f"{name} {doc['kind']}: {exc}") from exc


@pytest.mark.parametrize("directory", [KUBERNETES, KUBERNETES_TLS], ids=lambda p: p.name)
def test_the_kustomize_rendering_is_valid(directory: Path) -> None:
    kubectl = require_tool(
        "kubectl",
        "kubectl kustomize renders the kustomizations (the machine image's apt package "
        "'kubectl'; apt-get install kubectl where its repository is configured)",
    )
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    import yaml

    docs = [d for d in yaml.safe_load_all(result.stdout) if d is not None]
    assert {d["kind"] for d in docs} == {
        "Deployment",
        "Service",
        "ServiceMonitor",
        "PrometheusRule",
    }
    for doc in docs:
        try:
            validate(doc)
        except Exception as exc:
            raise AssertionError(f"{directory.name} {doc['kind']}: {exc}") from exc


def base(kind: str) -> dict[str, Any]:
    (found,) = [doc for _, doc in raw_documents() if doc["kind"] == kind]
    return copy.deepcopy(found)


def test_the_validators_reject_what_a_cluster_would() -> None:
    """The checks can fail: a misspelt field, a wrong type, a bad Duration, a missing
    required field, each one change away from the real manifests."""
    deployment = base("Deployment")
    sidecar = deployment["spec"]["template"]["spec"]["initContainers"][0]
    sidecar["startupProbe"]["grpc"]["servce"] = sidecar["startupProbe"]["grpc"].pop("service")
    with pytest.raises(kubernetes_validate.ValidationError, match="servce"):
        validate(deployment)
    service = base("Service")
    service["spec"]["ports"][0]["port"] = "50051"
    with pytest.raises(kubernetes_validate.ValidationError, match="50051"):
        validate(service)
    monitor = base("ServiceMonitor")
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(ValueError, match="interval"):
        validate(monitor)
    monitor = base("ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(AssertionError, match="fields its CRD does not define"):
        validate(monitor)
    rule = base("PrometheusRule")
    del rule["spec"]["groups"][0]["rules"][0]["expr"]
    with pytest.raises(ValueError, match="expr"):
        validate(rule)


def test_the_native_sidecar_needs_the_version_the_docs_name() -> None:
    """An init container's restartPolicy (the native sidecar) is not in Kubernetes 1.27's
    schema: the version matters, and the documented one has it."""
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicy"):
        validate(base("Deployment"), "1.27")
    validate(base("Deployment"), VERSION)
