"""docs/cluster.md's Prometheus snippets are what Prometheus accepts: each ```yaml block is
checked with `promtool check config` or `check rules` (Debian's `prometheus` package ships
promtool; .ci/run installs it; without it these tests skip, saying so).

Debian's Prometheus is built without Kubernetes discovery, so where promtool does not know
`kubernetes_sd_configs` the pod job is checked in two halves: its relabelling by promtool (a
static target standing in for the discovery), its discovery entry against the fields and roles
Prometheus documents. A full promtool checks it whole.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "cluster.md"
_BLOCK = re.compile(r"^```yaml\n(.*?)^```", re.S | re.M)
# Prometheus's documented <kubernetes_sd_config> fields and roles (configuration.md).
K8S_FIELDS = {
    "api_server",
    "role",
    "kubeconfig_file",
    "namespaces",
    "selectors",
    "attach_metadata",
    "basic_auth",
    "authorization",
    "oauth2",
    "proxy_url",
    "follow_redirects",
    "enable_http2",
    "tls_config",
}
K8S_ROLES = {"node", "service", "pod", "endpoints", "endpointslice", "ingress"}


def _blocks() -> dict[str, dict[str, Any]]:
    """The doc's YAML blocks, by what their first comment line says they are."""
    out = {}
    for m in _BLOCK.finditer(DOC.read_text()):
        text = m.group(1)
        first = text.splitlines()[0]
        assert first.startswith("# "), f"a yaml block in cluster.md says what it is: {first!r}"
        assert first[2:] not in out, f"two yaml blocks in cluster.md say {first!r}"
        out[first[2:]] = yaml.safe_load(text)
    return out


BLOCKS = _blocks()


def _promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool is not installed (Debian's prometheus package ships it)")
    return tool


def _check(kind: str, doc: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / f"{kind}.yml"
    path.write_text(yaml.safe_dump(doc))
    return subprocess.run(
        [_promtool(), "check", kind, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _valid(kind: str, doc: dict[str, Any], tmp_path: Path) -> None:
    proc = _check(kind, doc, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _knows_kubernetes(tmp_path: Path) -> bool:
    probe = {"scrape_configs": [{"job_name": "p", "kubernetes_sd_configs": [{"role": "pod"}]}]}
    proc = _check("config", probe, tmp_path)
    return (
        proc.returncode == 0 or "kubernetes_sd_configs not found" not in proc.stdout + proc.stderr
    )


def _pod_job() -> dict[str, Any]:
    (job,) = BLOCKS["prometheus.yml, on Kubernetes"]["scrape_configs"]
    assert "kubernetes_sd_configs" in job
    return dict(job)


def test_the_blocks_are_there() -> None:
    assert set(BLOCKS) == {
        "prometheus.yml, with file_sd",
        "prometheus.yml, on Kubernetes",
        "the training container",
        "rules.yml, loaded by each cluster's Prometheus (rule_files: [rules.yml])",
        "the global prometheus.yml",
        "each cluster's prometheus.yml",
    }


@pytest.mark.parametrize("name", ["the global prometheus.yml", "each cluster's prometheus.yml"])
def test_federation_and_remote_write_configs_pass_promtool(name: str, tmp_path: Path) -> None:
    _valid("config", BLOCKS[name], tmp_path)


def test_the_file_sd_config_passes_promtool(tmp_path: Path) -> None:
    _valid("config", BLOCKS["prometheus.yml, with file_sd"], tmp_path)


def test_the_recording_rules_pass_promtool(tmp_path: Path) -> None:
    name = "rules.yml, loaded by each cluster's Prometheus (rule_files: [rules.yml])"
    _valid("rules", BLOCKS[name], tmp_path)


def test_the_pod_jobs_relabelling_passes_promtool(tmp_path: Path) -> None:
    job = _pod_job()
    del job["kubernetes_sd_configs"]
    job["static_configs"] = [{"targets": ["10.0.0.7:9410"]}]  # what the pod role would find
    _valid("config", {"scrape_configs": [job]}, tmp_path)


def test_the_pod_jobs_discovery_is_one_prometheus_documents(tmp_path: Path) -> None:
    (sd,) = _pod_job()["kubernetes_sd_configs"]
    assert set(sd) <= K8S_FIELDS and sd["role"] in K8S_ROLES
    assert sd["role"] == "pod"  # one target per declared container port: the ports below
    if not _knows_kubernetes(tmp_path):
        pytest.skip("this promtool is built without Kubernetes discovery (Debian's is)")
    _valid("config", BLOCKS["prometheus.yml, on Kubernetes"], tmp_path)


def test_the_containers_ports_are_the_ones_the_job_keeps() -> None:
    c = BLOCKS["the training container"]
    env = {e["name"]: e["value"] for e in c["env"]}
    base = int(env["EVENTBUS_PROMETHEUS_PORT"])
    assert env["EVENTBUS_SUBSCRIBERS"] == "prometheus:host=0.0.0.0"  # reachable from the pod IP
    (keep,) = [r for r in _pod_job()["relabel_configs"] if r.get("action") == "keep"]
    for rank, port in enumerate(c["ports"]):  # base + local rank, each named for the keep rule
        assert port["containerPort"] == base + rank
        assert re.fullmatch(keep["regex"], port["name"])
