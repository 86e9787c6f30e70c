"""What the deploy/ tests share: where things are, rendering a kustomization
with kubectl's kustomize, strict offline validation (kubernetes-validate),
and finding objects and pod templates in what was rendered."""

import os
import re
import shutil
import subprocess

import yaml

SOURCE = os.environ.get("ZEROD_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
DEPLOY = os.path.join(SOURCE, "deploy")
VALIDATE_PYTHON = os.environ.get("ZEROD_DEPLOY_PYTHON",
                                 os.path.join(SOURCE, ".venv-deploy", "bin", "python"))
# The oldest Kubernetes the manifests are meant for (grpc probes are GA since
# 1.27) and the newest kubernetes-validate knows.
K8S_VERSIONS = ["1.30.0", "latest"]
OVERLAYS = ["cpu", "gpu"]
BIN = os.environ.get("ZEROD_BIN_DIR", os.path.join(SOURCE, "build", "release", "bin"))
# Kinds whose schemas are CRDs (the Prometheus Operator's, cert-manager's): kubernetes-validate
# knows only Kubernetes' own, so the tests check these by hand.
CRD_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule", "Certificate", "Issuer"}
EXAMPLES = ["train-job.yaml", "train-torch-job.yaml"]
POD_TEMPLATE_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def kubectl():
    path = os.environ.get("ZEROD_KUBECTL") or shutil.which("kubectl")
    assert path, "kubectl not found: scripts/deps.sh test installs kubernetes-client"
    return path


def render_dir(path):
    proc = subprocess.run([kubectl(), "kustomize", path], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def render(overlay):
    return render_dir(os.path.join(DEPLOY, "overlays", overlay))


def render_with_components(tmp_path, overlay, *components):
    """An overlay plus components, through a kustomization in tmp_path (how an
    operator enables them); kustomize wants paths relative to it."""
    def rel(*parts):
        return os.path.relpath(os.path.join(DEPLOY, *parts), tmp_path)
    lines = ["resources:", f"  - {rel('overlays', overlay)}", "components:"]
    lines += [f"  - {rel('components', c)}" for c in components]
    (tmp_path / "kustomization.yaml").write_text("\n".join(lines) + "\n")
    return render_dir(str(tmp_path))


def example(name):
    with open(os.path.join(DEPLOY, "examples", name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def validate(tmp_path, name, docs):
    assert os.path.exists(VALIDATE_PYTHON), (
        f"{VALIDATE_PYTHON} missing: scripts/deps.sh test makes the kubernetes-validate venv")
    docs = [d for d in docs if d["kind"] not in CRD_KINDS]
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    latest = subprocess.run([VALIDATE_PYTHON, "-c",
                             "import kubernetes_validate.utils as u; print(u.latest_version())"],
                            capture_output=True, text=True, check=True).stdout.strip()
    for version in K8S_VERSIONS:
        version = latest if version == "latest" else version
        proc = subprocess.run([VALIDATE_PYTHON, "-m", "kubernetes_validate", "--strict",
                               "-k", version, str(path)], capture_output=True, text=True)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{name} against Kubernetes {version}:\n{out}"
        # One INFO line per valid document; anything else is a finding.
        assert out.count("INFO") == len(docs) and "ERROR" not in out and "WARN" not in out, out


def find(docs, kind, name):
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(pod_spec, name):
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def pod_templates(docs):
    """(KIND/NAME, pod template) of every workload in docs."""
    return [(f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"])
            for d in docs if d["kind"] in POD_TEMPLATE_KINDS]


def project_version():
    with open(os.path.join(SOURCE, "CMakeLists.txt")) as f:
        return re.search(r"project\(zerod VERSION ([0-9.]+)", f.read()).group(1)
