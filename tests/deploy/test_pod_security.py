"""Pod security of the rendered manifests: every pod of the cpu overlay, and
the example jobs, against the Pod Security Standards' baseline and
restricted levels (the checks Kubernetes' Pod Security admission makes,
written out below from the standard) and the manifests' own rules; the gpu
overlay's pods break baseline in exactly the documented ways and no other;
the namespaces carry the matching pod-security.kubernetes.io labels."""

import copy
import os

import pytest

from deploy_common import (EXAMPLES, SOURCE, example, find, pod_templates, render,
                           render_with_components)

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID",
                         "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
PROBES = ["livenessProbe", "readinessProbe", "startupProbe"]

# What the gpu overlay's node daemon needs beyond baseline, and why
# (deploy/overlays/gpu/node-gpu.yaml, docs/operations.md "GPU nodes").
GPU_EXCEPTIONS = {("DaemonSet/zerod-node", "hostPID"), ("DaemonSet/zerod-node", "hostIPC")}


def all_containers(spec):
    return [(kind, c) for kind in ("initContainers", "containers", "ephemeralContainers")
            for c in spec.get(kind, [])]


def baseline(template):
    """The baseline level's findings for a pod template, as short names."""
    spec, meta = template["spec"], template.get("metadata", {})
    found = []
    psc = spec.get("securityContext", {})
    if psc.get("windowsOptions", {}).get("hostProcess"):
        found.append("hostProcess")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            found.append(field)
    found += [f"hostPath volume {v['name']}" for v in spec.get("volumes", []) if "hostPath" in v]
    for key, value in meta.get("annotations", {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and \
                value != "runtime/default" and not value.startswith("localhost/"):
            found.append(f"apparmor annotation {key}")
        if key.startswith("seccomp.security.alpha.kubernetes.io/") and value == "unconfined":
            found.append(f"seccomp annotation {key}")
    contexts = [("pod", psc)] + [(c["name"], c.get("securityContext", {}))
                                 for _, c in all_containers(spec)]
    for where, sc in contexts:
        if sc.get("seccompProfile", {}).get("type") == "Unconfined":
            found.append(f"seccomp Unconfined ({where})")
        if sc.get("appArmorProfile", {}).get("type") == "Unconfined":
            found.append(f"apparmor Unconfined ({where})")
        se = sc.get("seLinuxOptions", {})
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            found.append(f"seLinuxOptions ({where})")
    for sysctl in psc.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            found.append(f"sysctl {sysctl['name']}")
    for _, c in all_containers(spec):
        sc = c.get("securityContext", {})
        if sc.get("windowsOptions", {}).get("hostProcess"):
            found.append(f"hostProcess ({c['name']})")
        if sc.get("privileged"):
            found.append(f"privileged ({c['name']})")
        extra = set(sc.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES
        if extra:
            found.append(f"capabilities {sorted(extra)} ({c['name']})")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            found.append(f"hostPort ({c['name']})")
        if sc.get("procMount", "Default") != "Default":
            found.append(f"procMount ({c['name']})")
        handlers = [c.get(p, {}) for p in PROBES] + list(c.get("lifecycle", {}).values())
        for h in handlers:
            if h.get("httpGet", {}).get("host") or h.get("tcpSocket", {}).get("host"):
                found.append(f"probe or hook host ({c['name']})")
    return found


def restricted(template):
    """The restricted level's findings beyond baseline's."""
    spec = template["spec"]
    psc = spec.get("securityContext", {})
    found = []
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {v['name']} {sorted(kinds)}")
    containers = all_containers(spec)
    for _, c in containers:
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"allowPrivilegeEscalation ({name})")
        if not (sc.get("runAsNonRoot") is True or
                (psc.get("runAsNonRoot") is True and sc.get("runAsNonRoot") is not False)):
            found.append(f"runAsNonRoot ({name})")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            found.append(f"runAsUser 0 ({name})")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"seccompProfile ({name})")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            found.append(f"capabilities not dropped ({name})")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"capabilities added ({name})")
    if psc.get("runAsUser") == 0:
        found.append("runAsUser 0 (pod)")
    return found


def ours(template):
    """The manifests' own rules on top: the pod says who it runs as and
    which seccomp profile, every container drops every capability and adds
    none, none runs as root or as another user."""
    spec = template["spec"]
    psc = spec.get("securityContext", {})
    found = []
    if psc.get("runAsNonRoot") is not True or not psc.get("runAsUser"):
        found.append("pod runAsNonRoot/runAsUser")
    if psc.get("seccompProfile") != {"type": "RuntimeDefault"}:
        found.append("pod seccompProfile RuntimeDefault")
    for _, c in all_containers(spec):
        sc = c.get("securityContext", {})
        if sc.get("capabilities", {}).get("add") or sc.get("capabilities", {}).get("drop") != ["ALL"]:
            found.append(f"capabilities ({c['name']})")
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"allowPrivilegeEscalation ({c['name']})")
        for key in ("runAsUser", "runAsGroup", "runAsNonRoot"):
            if key in sc and sc[key] != psc.get(key):
                found.append(f"{key} differs from the pod's ({c['name']})")
    return found


def examples():
    return [(f"Job/{d['metadata']['name']}", d["spec"]["template"])
            for name in EXAMPLES for d in example(name)]


def test_cpu_overlay_and_examples_pass_baseline_restricted_and_ours():
    templates = pod_templates(render("cpu")) + examples()
    assert {name for name, _ in templates} == {"StatefulSet/zerod-coordinator",
                                               "DaemonSet/zerod-node", "Job/mlp-train",
                                               "Job/lm-train"}
    for name, template in templates:
        assert baseline(template) == [], name
        assert restricted(template) == [], name
        assert ours(template) == [], name


def test_gpu_overlay_breaks_baseline_only_where_documented():
    findings = set()
    for name, template in pod_templates(render("gpu")):
        findings.update((name, f) for f in baseline(template))
        assert restricted(template) == [], name
        assert ours(template) == [], name
    assert findings == GPU_EXCEPTIONS
    # Each exception is explained where an operator reads it.
    with open(os.path.join(SOURCE, "deploy", "overlays", "gpu", "node-gpu.yaml")) as f:
        overlay = f.read()
    with open(os.path.join(SOURCE, "docs", "operations.md")) as f:
        docs = f.read()
    gpu_section = docs[docs.index("### GPU nodes"):]
    gpu_section = gpu_section[:gpu_section.index("\n### ", 1)]
    for _, field in GPU_EXCEPTIONS:
        assert f"- {field}:" in overlay, field
        assert f"`{field}`" in gpu_section, field


@pytest.mark.parametrize("overlay,levels", [
    ("cpu", {"enforce": "baseline", "warn": "restricted", "audit": "restricted"}),
    ("gpu", {"enforce": "privileged", "warn": "baseline", "audit": "baseline"}),
])
def test_namespace_pod_security_labels(overlay, levels):
    labels = find(render(overlay), "Namespace", "zerod")["metadata"]["labels"]
    pss = {k.rsplit("/", 1)[1]: v for k, v in labels.items()
           if k.startswith("pod-security.kubernetes.io/")}
    assert pss == levels


def test_socket_dir_init_component_is_baseline_but_runs_as_root(tmp_path):
    docs = render_with_components(tmp_path, "cpu", "socket-dir-init")
    ds = find(docs, "DaemonSet", "zerod-node")["spec"]["template"]
    assert baseline(ds) == []
    assert "runAsUser 0 (socket-dir)" in restricted(ds)
    pv = find(docs, "PersistentVolume", "zerod-socket-dir")
    assert pv["spec"]["hostPath"] == {"path": "/run/zerod", "type": "DirectoryOrCreate"}


def test_socket_dir_volume():
    for overlay in ("cpu", "gpu"):
        docs = render(overlay)
        pv = find(docs, "PersistentVolume", "zerod-socket-dir")
        pvc = find(docs, "PersistentVolumeClaim", "zerod-socket-dir")
        assert "namespace" not in pv["metadata"]
        assert pv["spec"]["hostPath"] == {"path": "/run/zerod", "type": "Directory"}
        # Bound to each other only: no class, the claim names the volume and
        # the volume the claim.
        assert pv["spec"]["claimRef"] == {"namespace": pvc["metadata"]["namespace"],
                                          "name": pvc["metadata"]["name"]}
        assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
        assert pv["spec"]["storageClassName"] == pvc["spec"]["storageClassName"] == ""
        # Every node pod and worker pod on any machine mounts it at once.
        assert pv["spec"]["accessModes"] == pvc["spec"]["accessModes"] == ["ReadWriteMany"]
        assert pv["spec"]["capacity"]["storage"] == pvc["spec"]["resources"]["requests"]["storage"]
        templates = [(n, t) for n, t in pod_templates(docs) if n == "DaemonSet/zerod-node"]
        for _, template in templates + examples():
            volumes = {v["name"]: v for v in template["spec"]["volumes"]}
            assert volumes["socket-dir"] == {"name": "socket-dir", "persistentVolumeClaim":
                                             {"claimName": "zerod-socket-dir"}}


BAD = {
    "hostNetwork": lambda s: s.update(hostNetwork=True),
    "hostPath volume x": lambda s: s["volumes"].append({"name": "x", "hostPath": {"path": "/"}}),
    "privileged (node)": lambda s: s["containers"][0]["securityContext"].update(privileged=True),
    "capabilities ['SYS_ADMIN'] (node)":
        lambda s: s["containers"][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
    "hostPort (node)": lambda s: s["containers"][0]["ports"][0].update(hostPort=9464),
    "seccomp Unconfined (pod)":
        lambda s: s["securityContext"].update(seccompProfile={"type": "Unconfined"}),
    "sysctl kernel.msgmax":
        lambda s: s["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
    "procMount (node)": lambda s: s["containers"][0]["securityContext"].update(procMount="Unmasked"),
    "seLinuxOptions (pod)": lambda s: s["securityContext"].update(seLinuxOptions={"type": "spc_t"}),
    "probe or hook host (node)":
        lambda s: s["containers"][0].update(livenessProbe={"httpGet": {"port": 1, "host": "x"}}),
}


@pytest.mark.parametrize("finding", sorted(BAD))
def test_the_baseline_checks_find_each_violation(finding):
    template = copy.deepcopy(find(render("cpu"), "DaemonSet", "zerod-node")["spec"]["template"])
    BAD[finding](template["spec"])
    assert baseline(template) == [finding]
