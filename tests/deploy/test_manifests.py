"""The Kubernetes manifests in deploy/: each overlay renders with kubectl's
kustomize, every rendered document (and the example job) validates against
the Kubernetes schemas in strict mode (kubernetes-validate, offline), and the
parts zerod depends on are where the daemons expect them."""

import os
import re
import shutil
import subprocess

import pytest
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


def kubectl():
    path = os.environ.get("ZEROD_KUBECTL") or shutil.which("kubectl")
    assert path, "kubectl not found: scripts/deps.sh test installs kubernetes-client"
    return path


def render(overlay):
    proc = subprocess.run([kubectl(), "kustomize", os.path.join(DEPLOY, "overlays", overlay)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def assert_flags_exist(args, *mode):
    """Every --flag the manifest passes is one the binary's help lists."""
    zerod = os.path.join(BIN, "zerod")
    assert os.path.exists(zerod), "zerod not built (ZEROD_BIN_DIR=%s)" % BIN
    help_text = subprocess.run([zerod, *mode, "--help"], capture_output=True, text=True,
                               check=True).stdout
    for a in args:
        if a.startswith("--"):
            flag = a.split("=", 1)[0]
            assert flag + " " in help_text, "%s is not a flag of zerod %s" % (flag, " ".join(mode))


def find(docs, kind, name):
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(pod_spec, name):
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def validate(tmp_path, name, docs):
    assert os.path.exists(VALIDATE_PYTHON), (
        f"{VALIDATE_PYTHON} missing: scripts/deps.sh test makes the kubernetes-validate venv")
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


def project_version():
    with open(os.path.join(SOURCE, "CMakeLists.txt")) as f:
        return re.search(r"project\(zerod VERSION ([0-9.]+)", f.read()).group(1)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_zerod_image_is_the_one_make_image_builds(overlay):
    # `make image` tags localhost/zerod:VERSION (scripts/image.sh); the
    # busybox init container is the only other image.
    expected = f"localhost/zerod:{project_version()}"
    images = set()
    for doc in render(overlay):
        if doc["kind"] in ("StatefulSet", "DaemonSet"):
            images.update(c["image"] for c in doc["spec"]["template"]["spec"]["containers"])
    assert images == {expected}, images
    with open(os.path.join(DEPLOY, "examples", "train-job.yaml")) as f:
        job = next(d for d in yaml.safe_load_all(f) if d)
    assert [c["image"] for c in job["spec"]["template"]["spec"]["containers"]] == [expected]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay, tmp_path):
    docs = render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["Namespace", "ServiceAccount", "ServiceAccount",
                            "PersistentVolumeClaim", "Service", "StatefulSet",
                            "PodDisruptionBudget", "DaemonSet"]), kinds
    validate(tmp_path, overlay, docs)


def test_example_job_validates(tmp_path):
    with open(os.path.join(DEPLOY, "examples", "train-job.yaml")) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    validate(tmp_path, "train-job", docs)
    spec = docs[0]["spec"]["template"]["spec"]
    assert spec["hostIPC"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["socket-dir"]["hostPath"]["path"] == "/run/zerod"
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    worker = container(spec, "worker")
    assert "--socket=/run/zerod/zerod.sock" in worker["args"]
    env = {e["name"]: e for e in worker["env"]}
    assert env["ZEROD_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "zerod-job-mlp"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_node_daemonset(overlay):
    docs = render(overlay)
    ds = find(docs, "DaemonSet", "zerod-node")
    assert ds["metadata"]["namespace"] == "zerod"
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 1
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostIPC"] is True
    assert spec["nodeSelector"]["zerod/node"] == "true"
    assert spec["terminationGracePeriodSeconds"] >= 5
    assert spec["securityContext"]["runAsNonRoot"] is True
    node = container(spec, "node")
    args = node["args"]
    assert args[0] == "node"
    for flag in ["--coordinator=zerod-coordinator:7070", "--name=$(NODE_NAME)",
                 "--comm-host=$(POD_IP)", "--dir=/run/zerod", "--health-listen=0.0.0.0:7072",
                 "--tls-ca=/etc/zerod/tls/ca.crt", "--tls-cert=/etc/zerod/tls/tls.crt",
                 "--tls-key=/etc/zerod/tls/tls.key",
                 "--auth-token-file=/etc/zerod/token/token"]:
        assert flag in args, flag
    assert "--metrics-listen=0.0.0.0:9464" in args
    assert_flags_exist(args[1:])
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in node["env"]}
    assert env == {"NODE_NAME": "spec.nodeName", "POD_IP": "status.podIP"}
    assert node["startupProbe"]["grpc"]["port"] == 7072
    assert node["readinessProbe"]["grpc"]["port"] == 7072
    assert node["livenessProbe"]["tcpSocket"]["port"] == 7072
    assert node["resources"]["requests"] and node["resources"]["limits"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["socket-dir"]["hostPath"]["path"] == "/run/zerod"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "zerod-checkpoints"
    mounts = {m["name"]: m["mountPath"] for m in node["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm"
    assert mounts["checkpoints"] == "/var/lib/zerod/checkpoints"
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9464"
    gpus = node["resources"]["limits"].get("nvidia.com/gpu")
    if overlay == "gpu":
        assert gpus and "--device=cuda" in args
    else:
        assert gpus is None and not any(a.startswith("--device") for a in args)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_coordinator(overlay):
    docs = render(overlay)
    sts = find(docs, "StatefulSet", "zerod-coordinator")
    assert sts["spec"]["replicas"] == 1
    claims = sts["spec"]["volumeClaimTemplates"]
    assert [c["metadata"]["name"] for c in claims] == ["state"]
    spec = sts["spec"]["template"]["spec"]
    coord = container(spec, "coordinator")
    args = coord["args"]
    assert args[0] == "coordinator"
    for flag in ["--listen=0.0.0.0:7070", "--state-dir=/var/lib/zerod/state",
                 "--checkpoint-dir=/var/lib/zerod/checkpoints",
                 "--tls-cert=/etc/zerod/tls/tls.crt", "--tls-key=/etc/zerod/tls/tls.key",
                 "--tls-client-ca=/etc/zerod/tls/ca.crt",
                 "--auth-file=/etc/zerod/auth/principals", "--health-listen=0.0.0.0:7073",
                 "--metrics-listen=0.0.0.0:9464"]:
        assert flag in args, flag
    assert_flags_exist(args[1:], "coordinator")
    # The probes ask the plain-text health listener (the main port is TLS).
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"]:
        assert coord[probe]["grpc"]["port"] == 7073, probe
    mounts = {m["name"]: m["mountPath"] for m in coord["volumeMounts"]}
    assert mounts["state"] == "/var/lib/zerod/state"
    # The coordinator and every node see checkpoints on one RWX volume at
    # the same path.
    assert mounts["checkpoints"] == "/var/lib/zerod/checkpoints"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "zerod-checkpoints"
    pvc = find(docs, "PersistentVolumeClaim", "zerod-checkpoints")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    svc = find(docs, "Service", "zerod-coordinator")
    assert svc["spec"]["type"] == "ClusterIP"
    assert [p["port"] for p in svc["spec"]["ports"]] == [7070]
    pdb = find(docs, "PodDisruptionBudget", "zerod-coordinator")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= \
        sts["spec"]["template"]["metadata"]["labels"].items()
    for sa in ["zerod-node", "zerod-coordinator"]:
        assert find(docs, "ServiceAccount", sa)["automountServiceAccountToken"] is False
