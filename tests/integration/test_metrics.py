"""Prometheus metrics (--metrics-listen), scraped by a real Prometheus.

- A real Prometheus server (Debian's `prometheus`) scrapes a standalone
  daemon every second while two workers train the example MLP through it;
  its queries then return the job's steps (exactly the steps trained, per
  rank), a positive step rate during training, and the gather latency
  (a histogram quantile); `promtool check metrics` accepts the exposition.
- Errors are counted by status code for the job and rank that answered.
- The coordinator counts its members, jobs by state and calls by method
  and code; a node labels its build_info with its mode.
- The HTTP side: /metrics only, GET and HEAD only.
"""

import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

import zdraw as z
from conftest import binary, free_port

STEPS = 400


def metrics_port(read_log):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = re.search(r'msg="metrics listening" address=\S+ port=(\d+)', read_log())
        if m:
            return int(m.group(1))
        time.sleep(0.02)
    raise AssertionError("no metrics listener:\n" + read_log())


def scrape(port, path="/metrics", method="GET"):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), method=method)
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, r.headers.get("Content-Type"), r.read().decode()


def samples(text):
    """{(name, frozenset(labels)): value} of an exposition."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$', line)
        assert m, "not a sample line: %r" % line
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def value(text, name, **labels):
    want = set(labels.items())
    found = [v for (n, ls), v in samples(text).items() if n == name and want <= set(ls)]
    assert len(found) == 1, "%s%r: %d samples in\n%s" % (name, labels, len(found), text)
    return found[0]


def need(tool):
    path = shutil.which(tool)
    if path is None:
        pytest.fail("%s is not installed: scripts/deps.sh test installs Debian's prometheus" % tool)
    return path


class Prometheus:
    """A real Prometheus server scraping one target every second."""

    def __init__(self, tmp_path, target_port):
        self.dir = tmp_path / "prometheus"
        self.dir.mkdir()
        config = self.dir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: zerod\n    static_configs:\n"
            "      - targets: ['127.0.0.1:%d']\n" % target_port)
        self.port = free_port()
        self.log = open(self.dir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [need("prometheus"), "--config.file=%s" % config,
             "--storage.tsdb.path=%s" % (self.dir / "data"),
             "--web.listen-address=127.0.0.1:%d" % self.port],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/-/ready" % self.port,
                                            timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("prometheus did not start:\n" + self.read_log())
            time.sleep(0.2)

    def read_log(self):
        self.log.flush()
        return (self.dir / "prometheus.log").read_text()

    def query(self, expr):
        url = "http://127.0.0.1:%d/api/v1/query?%s" % (
            self.port, urllib.parse.urlencode({"query": expr}))
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return {json.dumps(s["metric"], sort_keys=True): float(s["value"][1])
                for s in body["data"]["result"]}

    def wait_for(self, expr, ok, timeout_s=60):
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            last = self.query(expr)
            if ok(last):
                return last
            time.sleep(0.25)
        raise AssertionError("%s stayed %r\n%s" % (expr, last, self.read_log()[-3000:]))

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def prometheus(tmp_path):
    servers = []

    def start(target_port):
        servers.append(Prometheus(tmp_path, target_port))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def test_prometheus_scrapes_a_training_daemon(start_daemon, prometheus):
    d = start_daemon(ranks=2, extra=["--metrics-listen", "127.0.0.1:0"])
    port = metrics_port(d.read_log)
    prom = prometheus(port)
    prom.wait_for('up{job="zerod"}', lambda r: list(r.values()) == [1.0])

    workers = [subprocess.Popen(
        [binary("zerod-mlp-train"), "--socket", d.socket, "--job", "prom", "--local-rank",
         str(rank), "--steps", str(STEPS), "--batch", "64", "--log-every", "100"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    # Scraped while training: some steps seen before the last one.
    during = prom.wait_for('zerod_steps_total{zerod_job="prom"}',
                           lambda r: len(r) == 2 and min(r.values()) > 0, timeout_s=120)
    still_training = any(w.poll() is None for w in workers)
    for w in workers:
        out, _ = w.communicate(timeout=300)
        assert w.returncode == 0, out
    assert still_training and max(during.values()) < STEPS, during

    # Exactly the steps trained, per rank, once the last scrape is in.
    done = prom.wait_for('zerod_steps_total{zerod_job="prom"}',
                         lambda r: sorted(r.values()) == [STEPS, STEPS])
    assert sorted(json.loads(k)["rank"] for k in done) == ["0", "1"]
    rate = prom.query('max_over_time(rate(zerod_steps_total{zerod_job="prom",rank="0"}[3s])[2m:1s])')
    assert list(rate.values())[0] > 0, rate
    gathers = prom.query('sum(zerod_gather_duration_seconds_count{zerod_job="prom"})')
    assert list(gathers.values())[0] >= 2 * STEPS, gathers
    p50 = prom.query('histogram_quantile(0.5, sum by (le) '
                     '(zerod_gather_duration_seconds_bucket{zerod_job="prom"}))')
    latency = list(p50.values())[0]
    assert 0 < latency < 60, p50
    moved = prom.query('zerod_collective_bytes_total{zerod_job="prom",collective="all_gather"}')
    # One node: node level only (no cross-node or flat spanning series).
    assert {json.loads(k)["level"] for k in moved} == {"node"}, moved
    assert len(moved) == 2 and min(moved.values()) > 0, moved
    held = prom.query('zerod_shard_bytes{zerod_job="prom",memory="host"}')
    assert len(held) == 2 and min(held.values()) > 0, held

    # The exposition itself, by Prometheus' own linter.
    status, ctype, text = scrape(port)
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4"), ctype
    check = subprocess.run([need("promtool"), "check", "metrics"], input=text,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert value(text, "zerod_step", zerod_job="prom", rank="1") == STEPS
    assert value(text, "zerod_node_jobs", state="active") == 1
    assert value(text, "process_resident_memory_bytes") > 0
    # No label named job: Prometheus keeps it for the scrape's job.
    assert not re.search(r'[{,]job="', text)


def test_errors_are_counted_by_code(start_daemon):
    d = start_daemon(extra=["--metrics-listen", "127.0.0.1:0"])
    port = metrics_port(d.read_log)
    c = z.Conn(d.socket)
    c.expect_ok(z.ATTACH, z.attach_request("errs", 0))
    for _ in range(3):
        t, fields, _ = c.call(z.GATHER, z.unit_request(7))
        assert t == z.ERROR and z.status_of(fields) == "NOT_FOUND"
    _, _, text = scrape(port)
    assert value(text, "zerod_request_errors_total", zerod_job="errs", rank="0",
                 code="not_found") == 3
    assert value(text, "zerod_worker_attached", zerod_job="errs", rank="0") == 1
    assert value(text, "zerod_node_sessions") == 1
    c.close()


def test_coordinator_and_node_metrics(cluster):
    coordinator = cluster.start_coordinator(extra=["--metrics-listen", "127.0.0.1:0"])
    node = cluster.start_node("metered", extra=["--metrics-listen", "127.0.0.1:0"])
    cport = metrics_port(coordinator.read_log)
    nport = metrics_port(node.read_log)
    deadline = time.monotonic() + 30
    while True:
        _, _, text = scrape(cport)
        joined = [v for (n, ls), v in samples(text).items()
                  if n == "zerod_rpc_server_handled_total"
                  and ("method", "Join") in ls and ("code", "OK") in ls]
        if value(text, "zerod_coordinator_members") == 1 and joined == [1]:
            break
        assert time.monotonic() < deadline, text
        time.sleep(0.1)
    assert value(text, "zerod_coordinator_jobs", state="ready") == 0
    assert value(text, "zerod_build_info", mode="coordinator") == 1
    assert value(text, "zerod_rpc_server_handling_seconds_count", service="zerod.v1.Cluster",
                 method="Join") == 1
    _, _, node_text = scrape(nport)
    assert value(node_text, "zerod_build_info", mode="node") == 1
    assert value(node_text, "zerod_node_jobs", state="active") == 0


def test_http_serves_metrics_only(start_daemon):
    d = start_daemon(extra=["--metrics-listen", "127.0.0.1:0"])
    port = metrics_port(d.read_log)
    status, _, body = scrape(port, method="HEAD")
    assert status == 200 and body == ""
    for path, method, code in (("/other", "GET", 404), ("/metrics", "POST", 405)):
        with pytest.raises(urllib.error.HTTPError) as e:
            scrape(port, path, method)
        assert e.value.code == code
    status, _, body = scrape(port, "/")
    assert status == 200 and "/metrics" in body


def test_a_bad_listen_address_is_refused(tmp_path):
    for addr, why in (("nonsense", "HOST:PORT"), ("127.0.0.1:99999", "bad port")):
        proc = subprocess.run([binary("zerod"), "standalone", "--dir", str(tmp_path / "s"),
                               "--metrics-listen", addr], capture_output=True, text=True,
                              timeout=30)
        assert proc.returncode == 1, proc.stderr
        assert "--metrics-listen %s" % addr in proc.stderr and why in proc.stderr, proc.stderr


def ctl_top(*args, env_metrics=None):
    env = dict(os.environ)
    env.pop("ZEROD_METRICS", None)
    if env_metrics is not None:
        env["ZEROD_METRICS"] = env_metrics
    return subprocess.run([binary("zerodctl"), "top"] + list(args), capture_output=True,
                          text=True, timeout=120, env=env)


def test_zerodctl_top_shows_training(start_daemon):
    d = start_daemon(ranks=2, extra=["--metrics-listen", "127.0.0.1:0"])
    port = metrics_port(d.read_log)
    target = "127.0.0.1:%d" % port
    workers = [subprocess.Popen(
        [binary("zerod-mlp-train"), "--socket", d.socket, "--job", "topjob", "--local-rank",
         str(rank), "--steps", "100000", "--batch", "64", "--log-every", "1000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT) for rank in range(2)]
    try:
        deadline = time.monotonic() + 120
        while True:
            _, _, text = scrape(port)
            if "zerod_step{" in text and value(text, "zerod_node_sessions") == 2:
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.1)
        # JSON: one object, rates over the interval while both ranks train.
        top = ctl_top("--metrics", target, "--once", "--interval", "1", "--json")
        assert top.returncode == 0, top.stderr
        lines = top.stdout.splitlines()
        assert len(lines) == 1, top.stdout
        snap = json.loads(lines[0])
        assert snap["targets"][0]["ok"] and snap["targets"][0]["mode"] == "standalone"
        assert snap["targets"][0]["sessions"] == 2
        ranks = [r for r in snap["ranks"] if r["job"] == "topjob"]
        assert sorted(r["rank"] for r in ranks) == [0, 1], snap
        for r in ranks:
            assert r["steps_per_s"] > 0 and r["step"] > 0, r
            assert r["gather_ms"] > 0 and r["reduce_ms"] > 0 and r["step_ms"] > 0, r
            assert r["moved_bytes_per_s"] > 0 and r["shard_bytes"] > 0, r
            assert r["worker_attached"] is True and r["errors"] == 0, r
            # Counts are integers (step 3, not 3.0); rates stay numbers.
            for count in ("step", "shard_bytes", "live_bytes", "queue_depth", "errors"):
                assert isinstance(r[count], int), (count, r)
        # The table, twice, from ZEROD_METRICS, one job only.
        top = ctl_top("--count", "2", "--interval", "0.3", "--job", "topjob",
                      env_metrics=target)
        assert top.returncode == 0, top.stderr
        assert top.stdout.count("zerodctl top: 1 target") == 2, top.stdout
        rows = [l.split() for l in top.stdout.splitlines() if l.startswith("topjob")]
        assert len(rows) == 4 and {r[1] for r in rows} == {"0", "1"}, top.stdout
        assert all(r[-2] == "yes" for r in rows), top.stdout
        assert re.search(r"^%s\s+standalone\s" % re.escape(target), top.stdout, re.M)
    finally:
        for w in workers:
            w.kill()
            w.wait()


def test_zerodctl_top_failures(start_daemon):
    d = start_daemon(extra=["--metrics-listen", "127.0.0.1:0"])
    port = metrics_port(d.read_log)
    dead = "127.0.0.1:%d" % free_port()
    top = ctl_top("--metrics", dead, "--once", "--interval", "0.2")
    assert top.returncode == 1 and top.stderr.startswith("zerodctl: top: %s: " % dead), top
    assert "unreachable" in top.stdout
    # Not Prometheus' format: the daemon's index page.
    top = ctl_top("--metrics", "http://127.0.0.1:%d/" % port, "--once", "--interval", "0.2")
    assert top.returncode == 1 and "not Prometheus' text format: line 1" in top.stderr, top
    # One target down of two: the table goes on.
    top = ctl_top("--metrics", dead, "--metrics", "127.0.0.1:%d" % port, "--once", "--json",
                  "--interval", "0.2")
    assert top.returncode == 0, top.stderr
    snap = json.loads(top.stdout)
    assert [t["ok"] for t in snap["targets"]] == [False, True]
    assert "connect" in snap["targets"][0]["error"].lower()
    for args, why in ((["--once"], "no target"),
                      (["--metrics", "x", "--once"], "expected HOST:PORT"),
                      (["--metrics", "ftp://h:1/", "--once"], "only http"),
                      (["--metrics", dead, "--interval", "0"], "invalid --interval"),
                      (["--metrics", dead, "--count", "0"], "invalid --count"),
                      (["--metrics", dead, "extra"], "unexpected argument")):
        top = ctl_top(*args)
        assert top.returncode == 2 and why in top.stderr, (args, top.stderr)
    wrong = subprocess.run([binary("zerodctl"), "--json", "top"], capture_output=True, text=True)
    assert wrong.returncode == 2 and "after it" in wrong.stderr, wrong.stderr
