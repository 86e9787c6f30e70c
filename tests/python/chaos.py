"""The chaos run (docs/redundancy.md, "Chaos"): two jobs of two tenants, each
on three of four `zerod node`s (one rank each per node, redundancy 1),
trained by worker processes (chaos_worker.py) while a node (SIGKILLed and
started again, as Kubernetes would) or a worker (SIGKILLed) is killed every
few seconds. A supervisor keeps one worker on each node of each job's
placement, as an orchestrator would. The killed node comes back empty and
is the next loss's spare, so each job keeps its world of three ranks.

At the end the workers train to one more step count and each job's
parameters must equal, bit for bit, those of the same job trained without
a fault to that step; every daemon's threads, descriptors and memory must be
back near where they were before the jobs (after the jobs are deleted).

`make chaos` runs it for minutes (scripts/chaos.py); python.zerod_chaos for
under a minute."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import numpy as np

from conftest import ctl, job, python, wait_for, worker_env

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "chaos_worker.py")
JOBS = {"alpha": ("tenant-a", 11), "beta": ("tenant-b", 22)}  # name: (tenant, seed)
TOKEN = "chaos-token"


def usage(pid):
    """Threads, open descriptors and resident MiB of process pid."""
    with open("/proc/%d/status" % pid) as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return (int(status["Threads"]), len(os.listdir("/proc/%d/fd" % pid)),
            int(status["VmRSS"].split()[0]) / 1024)


class Chaos:
    def __init__(self, cluster, tmp_path, seed):
        self.cluster, self.tmp, self.rng = cluster, tmp_path, random.Random(seed)
        self.until_file = str(tmp_path / "until")
        with open(self.until_file, "w") as f:
            f.write(str(1 << 60))
        self.workers = {}  # (job, node name) -> Popen
        self.kills = []    # what was killed, in order
        self.baseline = {}

    def start(self):
        c = self.cluster
        c.start_coordinator(lease_ttl_s=1.0)
        self.nodes = {n: c.start_node("node-" + n, ranks=2, timeout_s=30) for n in "abcd"}
        wait_for("4 members", lambda: ctl(c, "members").stdout.count("node-") >= 4)
        self.baseline = self.usages()
        for name, (tenant, _) in JOBS.items():
            ctl(c, "jobs", "create", name, "--tenant", tenant, "--node", "node-a,node-b,node-c",
                "--ranks-per-node", "1", "--token", TOKEN, "--optimizer", "adamw", "--lr", "0.01",
                "--redundancy", "1")
        for name in JOBS:
            wait_for(name, lambda: job(c, name)["state"] == "ready")

    def usages(self):
        procs = {"coordinator": self.cluster.coordinator.proc}
        procs.update({n: d.proc for n, d in self.nodes.items()})
        return {n: usage(p.pid) for n, p in procs.items()}

    def out(self, name, node):
        return str(self.tmp / ("%s-%s.npy" % (name, node)))

    def supervise(self):
        """One worker on each node of each job's placement; none elsewhere."""
        for name, (_, seed) in JOBS.items():
            info = job(self.cluster, name)
            placed = {p["node"][len("node-"):] for p in info["placement"]}
            for (j, node), proc in list(self.workers.items()):
                if j == name and (node not in placed or proc.poll() not in (None, 0)):
                    proc.kill()
                    proc.wait()
                    del self.workers[(j, node)]
            for node in placed:
                if (name, node) not in self.workers:
                    self.workers[(name, node)] = subprocess.Popen(
                        [python(), WORKER, "--socket", self.nodes[node].socket, "--job", name,
                         "--token", TOKEN, "--seed", str(seed), "--until-file", self.until_file,
                         "--out", self.out(name, node)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=worker_env())

    def kill_one(self):
        """A node of a job (killed and started again) two times in three,
        else a worker."""
        if self.rng.random() < 2 / 3:
            hosting = sorted({p["node"][len("node-"):] for name in JOBS
                              for p in job(self.cluster, name)["placement"]})
            node = self.rng.choice(hosting)
            for (j, n), proc in list(self.workers.items()):
                if n == node:  # its workers go with it
                    proc.kill()
                    proc.wait()
                    del self.workers[(j, n)]
            self.nodes[node].restart()
            self.baseline[node] = None  # measured again once it is back
            self.kills.append("node-" + node)
        else:
            key = self.rng.choice(sorted(self.workers))
            self.workers[key].kill()
            self.kills.append("worker %s@node-%s" % key)

    def run(self, duration_s, every_s):
        deadline = time.monotonic() + duration_s
        next_kill = time.monotonic() + every_s
        while time.monotonic() < deadline:
            self.supervise()
            for n, d in self.nodes.items():
                if self.baseline.get(n) is None and d.alive():
                    self.baseline[n] = usage(d.proc.pid)
            # A kill once the last one is over: every job ready, and the node
            # killed back as a member (the next loss's spare), as an
            # orchestrator restarting it keeps it.
            if time.monotonic() >= next_kill and self.settled():
                self.kill_one()
                next_kill = time.monotonic() + every_s * self.rng.uniform(0.5, 1.5)
            time.sleep(0.5)

    def settled(self):
        members = ctl(self.cluster, "members").stdout.count("node-")
        return members >= len(self.nodes) and all(
            job(self.cluster, name)["state"] == "ready" for name in JOBS)

    def finish(self, more_steps):
        """Lets the workers train to the jobs' highest reported step plus
        more_steps; for each job, its parameters (its workers' alike) and
        the step they are of (the job may have been past that target)."""
        wait_for("the jobs ready", lambda: all(
            job(self.cluster, n)["state"] == "ready" and not job(self.cluster, n)["stalled"]
            for n in JOBS), timeout_s=120)
        for n in JOBS:  # a spare took each lost node's place: the world is whole
            assert job(self.cluster, n)["world_size"] == 3, job(self.cluster, n)
        target = max(job(self.cluster, n)["step"] for n in JOBS) + more_steps
        with open(self.until_file, "w") as f:
            f.write(str(target))

        def done():
            self.supervise()
            return all(p.poll() == 0 for p in self.workers.values())
        wait_for("the workers to reach step %d" % target, done, timeout_s=300)
        results = {}
        for (name, node) in self.workers:
            w = np.load(self.out(name, node))
            with open(self.out(name, node) + ".step") as f:
                step = int(f.read())
            if name in results:
                np.testing.assert_array_equal(w, results[name][0], err_msg=name)
                assert step == results[name][1], (name, step, results[name][1])
            results[name] = (w, step)
        return results

    def reference(self, steps):
        """Each job trained without a fault to its step in steps, on three
        nodes."""
        c = self.cluster
        for name in JOBS:
            ctl(c, "jobs", "delete", name)
        nodes = [n for n, d in sorted(self.nodes.items()) if d.alive()][:3]
        refs = {}
        for name, (tenant, seed) in JOBS.items():
            ref = "ref-" + name
            ctl(c, "jobs", "create", ref, "--tenant", tenant, "--node",
                ",".join("node-" + n for n in nodes), "--ranks-per-node", "1", "--token", TOKEN,
                "--optimizer", "adamw", "--lr", "0.01")
            wait_for(ref, lambda: job(c, ref)["state"] == "ready")
            procs = [subprocess.Popen(
                [python(), WORKER, "--socket", self.nodes[n].socket, "--job", ref, "--token",
                 TOKEN, "--seed", str(seed), "--until", str(steps[name]), "--out",
                 self.out(ref, n)],
                env=worker_env()) for n in nodes]
            for p in procs:
                assert p.wait(timeout=300) == 0
            refs[name] = np.load(self.out(ref, nodes[0]))
            ctl(c, "jobs", "delete", ref)
        return refs

    def leaks(self):
        """What grew in a daemon since its baseline, the jobs gone: more than
        8 threads, 16 descriptors or (not under ASan, whose quarantine
        keeps freed memory) 64 MiB resident. Prints every daemon's
        figures."""
        wait_for("the jobs gone", lambda: "alpha" not in ctl(self.cluster, "jobs", "list").stdout
                 and "ref-" not in ctl(self.cluster, "jobs", "list").stdout, timeout_s=60)
        time.sleep(2)  # nodes free a deleted job once its workers are gone
        grown = {}
        asan = "asan" in open("/proc/%d/maps" % self.cluster.coordinator.proc.pid).read()
        for n, (threads, fds, rss) in self.usages().items():
            t0, f0, r0 = self.baseline[n]
            print("%s: threads %d -> %d, fds %d -> %d, rss %.0f -> %.0f MiB" % (
                n, t0, threads, f0, fds, r0, rss))
            if threads > t0 + 8 or fds > f0 + 16 or (rss > r0 + 64 and not asan):
                grown[n] = ((t0, f0, round(r0)), (threads, fds, round(rss)))
        return grown

    def stop_workers(self):
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
