"""deploy/components/monitoring: it renders into either overlay; its
PodMonitor and PrometheusRule (CRD kinds kubernetes-validate does not know)
are checked field by field; the alert rules pass `promtool check rules` and
their unit tests (`promtool test rules`, tests/deploy/zerod-rules.test.yaml);
the Grafana dashboard ships as a labelled ConfigMap; and every series name
the rules and the dashboard query is one the daemons register (daemon/) or
Prometheus' own `up`."""

import glob
import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from deploy_common import (DEPLOY, OVERLAYS, SOURCE, container, find, render_with_components,
                           validate)
from deploy_common import render as render_overlay

COMPONENT = os.path.join(DEPLOY, "components", "monitoring")
RULES_TEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zerod-rules.test.yaml")
# The PodMonitor's jobLabel gives `job` these values (the pods'
# app.kubernetes.io/name); the rules and the dashboard select on them.
JOBS = {"zerod-coordinator", "zerod-node"}
PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
                "group_left", "group_right", "inf", "nan"}


def promtool():
    # Debian's prometheus package (scripts/deps.sh test): a missing promtool
    # fails here rather than skipping the rules' checks.
    path = os.environ.get("ZEROD_PROMTOOL") or shutil.which("promtool")
    assert path, "promtool not found: scripts/deps.sh test installs Debian's prometheus"
    return path


def daemon_metrics():
    """Every series name the daemons register: metrics_family(), the rank's
    series() and the process collector take (registry, METRIC_<TYPE>,
    "name", ...); a histogram's series are name_bucket, _sum and _count."""
    names = set()
    pattern = re.compile(r'METRIC_(GAUGE|COUNTER|HISTOGRAM)\s*,\s*"([a-zA-Z_:][a-zA-Z0-9_:]*)"')
    for path in glob.glob(os.path.join(SOURCE, "daemon", "**", "*.c"), recursive=True):
        with open(path) as f:
            for kind, name in pattern.findall(f.read()):
                names.add(name)
                if kind == "HISTOGRAM":
                    names.update(name + s for s in ("_bucket", "_sum", "_count"))
    return names


def promql_metrics(expr):
    """The series names a PromQL expression selects (Grafana's $variables
    allowed in matchers and ranges)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for name, call in re.findall(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\(?)", e):
        if not call and name not in PROMQL_WORDS:
            names.add(name)
    return names


def test_promql_metrics_reads_names():
    assert promql_metrics('sum by (zerod_job, le) (rate(a_b_bucket{x="y",z=~"$v"}[5m])) > 1e3'
                          ' and on (rank) c offset 30m or absent(up{job="j"})') == \
        {"a_b_bucket", "c", "up"}
    assert "zerod_steps_total" in daemon_metrics()
    assert "zerod_step_duration_seconds_bucket" in daemon_metrics()
    assert "process_resident_memory_bytes" in daemon_metrics()


def render(tmp_path, overlay):
    return render_with_components(tmp_path, overlay, "monitoring")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_component_renders_and_validates(overlay, tmp_path):
    docs = render(tmp_path, overlay)
    def key(d):
        return (d["kind"], d["metadata"]["name"])
    added = sorted(set(map(key, docs)) - set(map(key, render_overlay(overlay))))
    assert added == [("ConfigMap", "zerod-dashboard"), ("PodMonitor", "zerod"),
                     ("PrometheusRule", "zerod")], added
    # Kubernetes' own kinds strictly; the CRDs' by hand below.
    validate(tmp_path, f"{overlay}-monitoring", docs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_monitor_selects_both_daemons_metrics_port(overlay, tmp_path):
    docs = render(tmp_path, overlay)
    pm = find(docs, "PodMonitor", "zerod")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["namespace"] == "zerod"
    spec = pm["spec"]
    assert set(spec) == {"jobLabel", "selector", "podMetricsEndpoints"}
    [expr] = spec["selector"]["matchExpressions"]
    assert set(spec["selector"]) == {"matchExpressions"}
    assert expr["key"] == spec["jobLabel"] == "app.kubernetes.io/name"
    assert expr["operator"] == "In" and set(expr["values"]) == JOBS
    [endpoint] = spec["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert re.fullmatch(r"[0-9]+s", endpoint["interval"])
    assert re.fullmatch(r"[0-9]+s", endpoint["scrapeTimeout"])
    for kind, name, cname in [("StatefulSet", "zerod-coordinator", "coordinator"),
                              ("DaemonSet", "zerod-node", "node")]:
        template = find(docs, kind, name)["spec"]["template"]
        assert template["metadata"]["labels"][spec["jobLabel"]] == name
        c = container(template["spec"], cname)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["metrics"] == 9464
        assert "--metrics-listen=0.0.0.0:9464" in c["args"]
        assert template["metadata"]["annotations"]["prometheus.io/path"] == endpoint["path"]


def rule_groups():
    with open(os.path.join(COMPONENT, "zerod-rules.yaml")) as f:
        doc = yaml.safe_load(f)
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    assert doc["metadata"]["namespace"] == "zerod"
    assert set(doc["spec"]) == {"groups"}
    return doc["spec"]


def test_rules_fields():
    alerts = {}
    for group in rule_groups()["groups"]:
        assert set(group) == {"name", "rules"}
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            alerts[rule["alert"]] = rule
            assert rule["labels"]["severity"] in ("critical", "warning", "info")
            assert set(rule["annotations"]) == {"summary", "description"}
            for job in re.findall(r'(?<!\w)job="([^"]*)"', rule["expr"]):
                assert job in JOBS, (rule["alert"], job)
    # What the alerts must cover (issue 37): node down and lease lost, jobs
    # degraded or failed, checkpoint failures, stalls, the in-memory copies.
    assert {"ZerodCoordinatorDown", "ZerodNodeDown", "ZerodNodeNotMember", "ZerodJobDegraded",
            "ZerodJobAborting", "ZerodJobStalled", "ZerodCheckpointFailed",
            "ZerodReplicaCopyBehind", "ZerodReplicaCopySlow"} <= set(alerts)


def test_rules_use_only_the_daemons_metrics():
    known = daemon_metrics() | {"up"}
    used = set()
    for group in rule_groups()["groups"]:
        for rule in group["rules"]:
            names = promql_metrics(rule["expr"])
            assert names, rule["alert"]
            assert names <= known, (rule["alert"], names - known)
            used |= names
    assert "zerod_coordinator_members" in used and "zerod_replica_step" in used


def test_promtool_checks_and_unit_tests_the_rules(tmp_path):
    rules = tmp_path / "zerod.rules.yaml"
    rules.write_text(yaml.safe_dump(rule_groups()))
    proc = subprocess.run([promtool(), "check", "rules", str(rules)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Every alert has a unit test that makes it fire.
    with open(RULES_TEST) as f:
        tests = yaml.safe_load(f)
    assert tests["rule_files"] == ["zerod.rules.yaml"]
    fired = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]
             if t.get("exp_alerts")}
    alerts = {r["alert"] for g in rule_groups()["groups"] for r in g["rules"]}
    assert fired == alerts, alerts ^ fired
    for case in tests["tests"]:
        for series in case["input_series"]:
            name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", series["series"]).group(0)
            assert name in daemon_metrics() | {"up"}, name
    shutil.copy(RULES_TEST, tmp_path)
    proc = subprocess.run([promtool(), "test", "rules", os.path.basename(RULES_TEST)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


def dashboard():
    with open(os.path.join(COMPONENT, "zerod-dashboard.json")) as f:
        return json.load(f)


def panels(d):
    for p in d["panels"]:
        yield p
        yield from p.get("panels", [])


def test_dashboard_ships_as_a_labelled_config_map(tmp_path):
    cm = find(render(tmp_path, "cpu"), "ConfigMap", "zerod-dashboard")
    assert cm["metadata"]["namespace"] == "zerod"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["zerod-dashboard.json"]) == dashboard()


def test_dashboard_queries_only_the_daemons_metrics():
    d = dashboard()
    assert d["uid"] and d["title"] == "zerod"
    known = daemon_metrics() | {"up"}
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    query = variables["zerod_job"]["query"]["query"]
    metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", query).groups()
    assert metric in known and label == "zerod_job"
    used = set()
    ids = set()
    for p in panels(d):
        assert p["id"] not in ids
        ids.add(p["id"])
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["targets"], p["title"]
        for t in p["targets"]:
            names = promql_metrics(t["expr"])
            assert names and names <= known, (p["title"], names - known)
            used |= names
            for job in re.findall(r'(?<!\w)job=~?"([^"]*)"', t["expr"]):
                assert set(job.split("|")) <= JOBS, (p["title"], job)
    # The panels cover training, memory, checkpoints, copies and the cluster.
    for name in ["zerod_steps_total", "zerod_shard_bytes", "zerod_checkpoint_operations_total",
                 "zerod_replica_step", "zerod_coordinator_members", "zerod_coordinator_jobs"]:
        assert name in used, name
