"""A first-time user's defaults and a job's lifetime (issue 37):

- a standalone daemon started with no --dir keeps its state in the user's
  state directory (here $XDG_STATE_HOME/zerod), wherever it starts, and a
  worker and zerodctl find it from another directory with no socket or
  address given; with no daemon there, both say where they looked and what
  to do;
- a standalone daemon with the default --ranks hosts a job of the
  launcher's WORLD_SIZE (ranks are made per job), and refuses one over its
  --max-ranks naming the flag;
- attach modes: create=False refuses a missing job (a typo), create=True
  resumes an existing job and says at which step, create="fresh" refuses a
  trained job naming how to start over;
- a script that exits without detaching is detached at exit, not "lost".
"""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import zerod
from conftest import PACKAGE_DIR, binary, start_daemon, worker_env  # noqa: F401 (fixture)

# One step of a tiny model: attach, register, reduce ones, step; prints the
# job's world size and step. argv: job name, create mode.
STEP = r"""
import sys, numpy as np, zerod
create = {"true": True, "false": False}.get(sys.argv[2], sys.argv[2])
client = zerod.Client()
job = client.attach(sys.argv[1], create=create, config=zerod.JobConfig(optimizer="sgd", lr=0.5))
unit = job.register("u", [("w", (4,))], values=np.zeros(4, dtype=np.float32))
unit.grad_buffer().arrays()["w"][...] = 1.0
unit.reduce()
result = job.step()
print("world=%d step=%d" % (job.world_size, result.step), flush=True)
"""


def env_for(state_home, **extra):
    env = worker_env()
    env.pop("ZEROD_SOCKET", None)
    env.pop("ZEROD_COORDINATOR", None)
    env["XDG_STATE_HOME"] = str(state_home)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(args, env, cwd, timeout=60):
    return subprocess.run(args, env=env, cwd=str(cwd), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def default_daemon(tmp_path):
    """zerod standalone with no --dir, --ranks or --socket, started in one
    directory with the user's state directory under tmp_path."""
    state, start_cwd = tmp_path / "state", tmp_path / "started-here"
    start_cwd.mkdir()
    env = env_for(state)
    log = open(tmp_path / "zerod.log", "w")
    proc = subprocess.Popen([binary("zerod"), "standalone", "--threads-per-rank", "1"],
                            env=env, cwd=str(start_cwd), stderr=log)
    socket = state / "zerod" / "zerod.sock"
    deadline = time.monotonic() + 20
    while not socket.exists():
        assert proc.poll() is None, (tmp_path / "zerod.log").read_text()
        assert time.monotonic() < deadline, (tmp_path / "zerod.log").read_text()
        time.sleep(0.02)
    proc.state_home, proc.log_path, proc.cwd = state, tmp_path / "zerod.log", tmp_path
    yield proc
    proc.terminate()
    proc.wait(timeout=30)
    log.close()
    assert not (start_cwd / ".zerod").exists()


def workers(daemon, name, n, create="true", world_size=None):
    env = env_for(daemon.state_home, WORLD_SIZE=world_size or n)
    procs = [subprocess.Popen([sys.executable, "-c", STEP, name, create],
                              env={**env, "LOCAL_RANK": str(r)}, cwd=str(daemon.cwd),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    return [p.communicate(timeout=120) + (p.returncode,) for p in procs]


def test_a_default_daemon_is_found_from_anywhere_and_hosts_the_launchers_world(default_daemon):
    results = workers(default_daemon, "toy", 2)
    for out, err, rc in results:
        assert rc == 0, err
        assert "world=2 step=1" in out, out
    assert "zerod: job toy: starting at step 0 (2 ranks)" in results[0][1]
    assert "starting at step" not in results[1][1]  # local rank 0 only
    ctl = run([binary("zerodctl"), "jobs", "list"], env_for(default_daemon.state_home),
              default_daemon.cwd)
    assert ctl.returncode == 0 and "toy" in ctl.stdout, ctl.stdout + ctl.stderr


def test_nothing_found_says_where_it_looked(tmp_path):
    env = env_for(tmp_path / "empty")
    ctl = run([binary("zerodctl"), "jobs", "list"], env, tmp_path)
    assert ctl.returncode != 0
    looked = str(tmp_path / "empty" / "zerod" / "control.sock")
    assert looked in ctl.stderr and "--coordinator" in ctl.stderr, ctl.stderr
    worker = run([sys.executable, "-c", "import zerod; zerod.Client()"], env, tmp_path)
    assert worker.returncode != 0
    assert str(tmp_path / "empty" / "zerod" / "zerod.sock") in worker.stderr, worker.stderr
    assert "zerod standalone" in worker.stderr and "ZEROD_SOCKET" in worker.stderr


def test_a_world_over_the_daemons_capacity_names_the_flag(start_daemon):
    daemon = start_daemon(ranks=1, extra=["--max-ranks", "2"])
    with zerod.Client(daemon.socket) as client:
        with pytest.raises(zerod.ResourceExhaustedError, match="--max-ranks 3"):
            client.attach("big", world_size=3)
        job = client.attach("small", world_size=2)
        assert job.world_size == 2


def test_attach_modes(default_daemon):
    out, err, rc = workers(default_daemon, "toyy", 1, create="false")[0]
    assert rc != 0 and "NotFoundError" in err and "no job named 'toyy'" in err, err
    assert "create" in err
    assert all(r[2] == 0 for r in workers(default_daemon, "toy", 1))
    out, err, rc = workers(default_daemon, "toy", 1)[0]
    assert rc == 0 and "step=2" in out, err
    assert "zerod: job toy exists: resuming it at step 1" in err, err
    out, err, rc = workers(default_daemon, "toy", 1, create="fresh")[0]
    assert rc != 0 and "FailedPreconditionError" in err, err
    assert "has done 2 step(s)" in err and "zerodctl jobs delete toy" in err, err
    # A fresh start of a new job works, and joining it before a step too.
    results = workers(default_daemon, "new", 2, create="fresh")
    assert all(r[2] == 0 and "step=1" in r[0] for r in results), results


# A zerod.torch script that ends without closing anything (with torch
# loaded, the interpreter's teardown used to leave the connection to the
# kernel: "worker lost").
TORCH_SCRIPT = r"""
import torch, zerod, zerod.torch
job = zerod.Client().attach("tidy", config=zerod.JobConfig(lr=0.1))
model = zerod.torch.shard(torch.nn.Linear(4, 4), job)
model(torch.ones(2, 4)).sum().backward()
"""


def test_a_clean_exit_detaches(default_daemon):
    env = env_for(default_daemon.state_home)
    proc = run([sys.executable, "-c", TORCH_SCRIPT], env, default_daemon.cwd, timeout=120)
    assert proc.returncode == 0, proc.stderr
    deadline = time.monotonic() + 10
    log = ""
    while "worker detached" not in log and time.monotonic() < deadline:
        time.sleep(0.05)
        log = default_daemon.log_path.read_text()
    assert "worker detached" in log and "job=tidy" in log, log
    assert "disconnected without detaching" not in log, log


def jobs_listed(daemon):
    proc = subprocess.run([binary("zerodctl"), "-c", "unix:%s/control.sock" % daemon.dir, "jobs",
                           "list", "--json"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_an_idle_job_expires_and_an_attached_one_does_not(start_daemon):
    daemon = start_daemon(ranks=1, extra=["--job-idle-ttl", "2s"])
    with zerod.Client(daemon.socket) as client:
        kept = client.attach("kept")
        with zerod.Client(daemon.socket) as other:
            other.attach("idle").detach()
        deadline = time.monotonic() + 30
        while '"idle"' in jobs_listed(daemon):
            assert time.monotonic() < deadline, daemon.read_log()
            time.sleep(0.2)
        # The job with a worker attached all along is still there, and works.
        assert '"kept"' in jobs_listed(daemon)
        unit = kept.register("u", [("w", (4,))], values=np.zeros(4, dtype=np.float32))
        unit.grad_buffer().arrays()["w"][...] = 1.0
        unit.reduce()
        assert kept.step().step == 1
    log = daemon.read_log()
    assert "job expired" in log and "job=idle" in log, log
    assert 'msg=audit method=(expiry) principal=coordinator job=idle' in log, log
    assert "job=kept idle_s" not in log
