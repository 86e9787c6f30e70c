"""--log-format json: every line a daemon writes is one JSON object with
ts, level and msg, and the key-value fields of the logfmt tail as string
fields (a standalone daemon through a small training; a coordinator
started and stopped)."""

import json
import os
import re
import signal
import subprocess
import time

from conftest import binary
from test_train import train

TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def parse_lines(text):
    """Every line as a dict; fails on any line that is not one JSON object
    of string values with ts, level and msg."""
    lines = text.splitlines()
    assert lines, "no log lines"
    objects = []
    for line in lines:
        try:
            o = json.loads(line)
        except ValueError as e:
            raise AssertionError("not JSON (%s): %r\nlog:\n%s" % (e, line, text))
        assert isinstance(o, dict), line
        assert TS.match(o.get("ts", "")), line
        assert o.get("level") in ("debug", "info", "warn", "error"), line
        assert isinstance(o.get("msg"), str), line
        # Values are strings, or typed: numbers and booleans (an id of
        # more than 15 digits stays a string, so no reader rounds it).
        assert all(isinstance(v, (str, int, float, bool)) for v in o.values()), line
        assert all(not isinstance(v, int) or abs(v) < 10**15 for v in o.values()), line
        assert "kv_raw" not in o, "a daemon line whose tail is not logfmt: %r" % line
        assert "truncated" not in o, line
        objects.append(o)
    return objects


def first(objects, msg):
    for o in objects:
        if o["msg"] == msg:
            return o
    raise AssertionError("no %r line in %s" % (msg, [o["msg"] for o in objects]))


def test_standalone_json_log(start_daemon, tmp_path):
    d = start_daemon(ranks=1, timeout_s=60, extra=["--log-format", "json"])
    train(d, "logjson", 1, tmp_path)
    d.stop()
    objects = parse_lines(d.log_path.read_text())
    ready = first(objects, "zerod ready")
    assert ready["level"] == "info"
    assert ready["mode"] == "standalone"
    assert ready["socket"] == d.socket
    assert ready["ranks"] == 1
    assert ready["threads_per_rank"] == 1
    assert ready["collective_timeout_s"] == 60
    assert ready["pid"] == d.proc.pid
    attached = first(objects, "worker attached")
    assert attached["job"] == "logjson"
    assert attached["rank"] == 0
    first(objects, "job created")
    assert objects[-1]["msg"] == "stopped"


def test_coordinator_json_log_from_env(tmp_path):
    log_path = tmp_path / "coordinator.log"
    env = dict(os.environ, ZEROD_LOG_FORMAT="json")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [binary("zerod"), "coordinator", "--listen", "127.0.0.1:0",
             "--state-dir", str(tmp_path / "state")], stderr=log, env=env)
        try:
            deadline = time.monotonic() + 30
            while '"coordinator listening"' not in log_path.read_text():
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, log_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log_path.read_text()
    for report in ("AddressSanitizer", "LeakSanitizer", "runtime error"):
        assert report not in text, text
    objects = parse_lines(text)
    listening = first(objects, "coordinator listening")
    assert re.match(r"^127\.0\.0\.1:\d+$", listening["address"]), listening
    assert listening["state_dir"] == str(tmp_path / "state")
    assert objects[-1]["msg"] == "stopped"


def test_bad_log_format_is_refused(tmp_path):
    for args in (["--dir", str(tmp_path)], ["coordinator"]):
        p = subprocess.run([binary("zerod")] + args + ["--log-format", "xml"],
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 2, p.stderr
        assert "invalid --log-format 'xml'" in p.stderr
