"""The Kubernetes manifests in deploy/: each overlay renders with kubectl's
kustomize, every rendered document (and the example job) validates against
the Kubernetes schemas in strict mode (kubernetes-validate, offline), and the
parts zerod depends on are where the daemons expect them: flags, ports,
probes, volumes, the NetworkPolicy's selectors and ports. Pod security is
test_pod_security.py's, the monitoring component test_monitoring.py's."""

import os
import subprocess

import pytest

from deploy_common import (BIN, DEPLOY, EXAMPLES, OVERLAYS, container, example, find,
                           pod_templates, project_version, render, validate)


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


def labels_match(selector, labels):
    """Whether a LabelSelector (matchLabels only, as the manifests use) selects labels."""
    assert set(selector) <= {"matchLabels"}, selector
    return selector.get("matchLabels", {}).items() <= labels.items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_zerod_image_is_the_one_make_image_builds(overlay):
    # `make image` tags localhost/zerod:VERSION (scripts/image.sh); the
    # torch example's image (deploy/examples/torch/Containerfile) carries
    # the same version.
    expected = f"localhost/zerod:{project_version()}"
    images = set()
    for _, template in pod_templates(render(overlay)):
        spec = template["spec"]
        images.update(c["image"] for c in spec["containers"] + spec.get("initContainers", []))
    assert images == {expected}, images
    job = example("train-job.yaml")[0]
    assert [c["image"] for c in job["spec"]["template"]["spec"]["containers"]] == [expected]
    torch_job = example("train-torch-job.yaml")[0]
    assert [c["image"] for c in torch_job["spec"]["template"]["spec"]["containers"]] == \
        [f"localhost/zerod-torch:{project_version()}"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay, tmp_path):
    docs = render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["Namespace", "ServiceAccount", "ServiceAccount",
                            "PersistentVolumeClaim", "PersistentVolumeClaim",
                            "PersistentVolume", "Service", "Service", "StatefulSet",
                            "PodDisruptionBudget", "DaemonSet", "NetworkPolicy",
                            "NetworkPolicy", "NetworkPolicy"]), kinds
    validate(tmp_path, overlay, docs)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_job_validates(name, tmp_path):
    docs = example(name)
    validate(tmp_path, name, docs)
    assert [d["kind"] for d in docs] == ["Job"]
    assert docs[0]["metadata"]["namespace"] == "zerod"
    spec = docs[0]["spec"]["template"]["spec"]
    # The cpu overlay's daemons need no host namespace in their workers.
    assert not spec.get("hostIPC") and not spec.get("hostPID")
    assert spec["nodeSelector"] == {"zerod/node": "true"}
    volumes = {v["name"]: v for v in spec["volumes"]}
    # The machine's /run/zerod (test_pod_security.py checks the volume).
    assert volumes["socket-dir"]["persistentVolumeClaim"]["claimName"] == "zerod-socket-dir"
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    worker = container(spec, "worker")
    assert "--socket=/run/zerod/zerod.sock" in worker["args"]
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    assert mounts == {"socket-dir": "/run/zerod", "dshm": "/dev/shm"}
    env = {e["name"]: e for e in worker["env"]}
    token = env["ZEROD_TOKEN"]["valueFrom"]["secretKeyRef"]
    job = next(a.split("=", 1)[1] for a in worker["args"] if a.startswith("--job="))
    assert token == {"name": f"zerod-job-{job}", "key": "token"}
    # The socket is 0600 for the daemon's uid.
    assert spec["securityContext"]["runAsUser"] == 65532


def test_torch_example_runs_train_lm_under_torchrun():
    spec = example("train-torch-job.yaml")[0]["spec"]["template"]["spec"]
    worker = container(spec, "worker")
    assert worker["command"][:3] == ["python3", "-m", "torch.distributed.run"]
    script = worker["args"][0]
    assert script == "/opt/zerod/examples/python/train_lm.py"
    # The image puts examples/python under /opt/zerod (train_lm.py reads
    # README.md and docs/ two directories above itself).
    with open(os.path.join(DEPLOY, "examples", "torch", "Containerfile")) as f:
        containerfile = f.read()
    assert "COPY examples/python /opt/zerod/examples/python" in containerfile
    assert "COPY docs /opt/zerod/docs" in containerfile
    assert "USER 65532:65532" in containerfile
    with open(os.path.join(DEPLOY, "..", "examples", "python", "train_lm.py")) as f:
        train_lm = f.read()
    for arg in worker["args"][1:]:
        flag = arg.split("=", 1)[0]
        assert f'"{flag}"' in train_lm, f"{flag} is not an option of train_lm.py"
    # One rank per pod, as the base's node daemons take (--ranks default 1).
    nproc = worker["command"][worker["command"].index("--nproc_per_node") + 1]
    assert nproc == "1"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_node_daemonset(overlay):
    docs = render(overlay)
    ds = find(docs, "DaemonSet", "zerod-node")
    assert ds["metadata"]["namespace"] == "zerod"
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 1
    spec = ds["spec"]["template"]["spec"]
    # CUDA IPC handles need host namespaces (test_pod_security.py holds the
    # gpu overlay's exceptions); memfd descriptors over the socket do not.
    assert spec.get("hostIPC", False) is (overlay == "gpu")
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
    # The machine's /run/zerod, made there for uid 65532 (no root init
    # container; test_pod_security.py checks the volume).
    assert volumes["socket-dir"]["persistentVolumeClaim"]["claimName"] == "zerod-socket-dir"
    assert "initContainers" not in spec
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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_node_metrics_service(overlay):
    docs = render(overlay)
    svc = find(docs, "Service", "zerod-node-metrics")
    # Headless: one DNS record per node pod, joined or not.
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    template = find(docs, "DaemonSet", "zerod-node")["spec"]["template"]
    assert svc["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    node = container(template["spec"], "node")
    ports = {p["name"]: p["containerPort"] for p in node["ports"]}
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(9464, "metrics")]
    assert ports["metrics"] == 9464 and "--metrics-listen=0.0.0.0:9464" in node["args"]


def ingress_sources(policy, port):
    """The peers of the policy's rules that admit `port` (a rule without
    ports admits every port)."""
    peers = []
    for rule in policy["spec"].get("ingress", []):
        if "ports" not in rule or any(p["port"] == port for p in rule["ports"]):
            peers.extend(rule["from"])
    return peers


def admits(peers, labels, namespace_labels=None):
    """Whether a pod with labels (in the policy's namespace, or in a namespace
    with namespace_labels) is among peers."""
    for peer in peers:
        if namespace_labels is None:
            if "namespaceSelector" not in peer and labels_match(peer["podSelector"], labels):
                return True
        elif "podSelector" not in peer and labels_match(peer["namespaceSelector"],
                                                         namespace_labels):
            return True
    return False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy(overlay):
    docs = render(overlay)
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    assert set(policies) == {"zerod-default-deny-ingress", "zerod-coordinator", "zerod-node"}
    for p in policies.values():
        assert p["metadata"]["namespace"] == "zerod"
        assert p["spec"]["policyTypes"] == ["Ingress"]
    deny = policies["zerod-default-deny-ingress"]["spec"]
    assert deny["podSelector"] == {} and "ingress" not in deny

    coord = find(docs, "StatefulSet", "zerod-coordinator")["spec"]["template"]
    node = find(docs, "DaemonSet", "zerod-node")["spec"]["template"]
    workers = [example(name)[0]["spec"]["template"] for name in EXAMPLES]
    assert labels_match(policies["zerod-coordinator"]["spec"]["podSelector"],
                        coord["metadata"]["labels"])
    assert not labels_match(policies["zerod-coordinator"]["spec"]["podSelector"],
                            node["metadata"]["labels"])
    assert labels_match(policies["zerod-node"]["spec"]["podSelector"], node["metadata"]["labels"])
    assert not labels_match(policies["zerod-node"]["spec"]["podSelector"],
                            coord["metadata"]["labels"])

    def port_names(template):
        return {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
    for p in policies.values():
        for rule in p["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                target = coord if p is policies["zerod-coordinator"] else node
                assert port["port"] in port_names(target), (p["metadata"]["name"], port)

    scraper = {"zerod/metrics-scraper": "true"}
    other_namespace = {"kubernetes.io/metadata.name": "default"}
    # The coordinator's gRPC: node daemons and client pods, nobody else.
    grpc = ingress_sources(policies["zerod-coordinator"], "grpc")
    assert admits(grpc, node["metadata"]["labels"])
    for w in workers:
        assert admits(grpc, w["metadata"]["labels"])
    assert not admits(grpc, {"app.kubernetes.io/name": "other"})
    assert not admits(grpc, {}, scraper)
    # Metrics: the scraper's namespace and clients (zerodctl top), on both.
    for name, template in [("zerod-coordinator", coord), ("zerod-node", node)]:
        metrics = ingress_sources(policies[name], "metrics")
        assert admits(metrics, {}, scraper) and not admits(metrics, {}, other_namespace)
        for w in workers:
            assert admits(metrics, w["metadata"]["labels"])
    # Node to node: every port (Gloo and replica servers listen on ports the
    # kernel picks); not from workers or the coordinator.
    any_port = [r for r in policies["zerod-node"]["spec"]["ingress"] if "ports" not in r]
    assert len(any_port) == 1
    peers = any_port[0]["from"]
    assert admits(peers, node["metadata"]["labels"])
    assert not admits(peers, coord["metadata"]["labels"])
    for w in workers:
        assert not admits(peers, w["metadata"]["labels"])
