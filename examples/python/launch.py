"""Starting and stopping a local training run: a zerod daemon and workers.

`Cluster` starts, in a temporary directory, a standalone zerod daemon (for
the zerod backend) and one worker process per rank, watches them, and stops
them all whatever happens: a worker that fails, a daemon that dies, Ctrl-C,
SIGTERM, or the launcher itself being killed (every child is started with
PR_SET_PDEATHSIG, so the kernel sends it SIGTERM when the launcher dies).

The workers are `train_lm.py --worker --local-rank R`; the daemon is
`zerod standalone --ranks N --dir DIR`.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN_LM = Path(__file__).resolve().parent / "train_lm.py"
PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """A part of the run could not be started or failed; the message says which."""


def find_zerod_binary(explicit: Optional[str] = None) -> Path:
    """The daemon binary: `explicit`, else $ZEROD_BIN_DIR/zerod, else build/release/bin/zerod."""
    if explicit:
        candidates = [Path(explicit)]
    elif os.environ.get("ZEROD_BIN_DIR"):
        candidates = [Path(os.environ["ZEROD_BIN_DIR"]) / "zerod"]
    else:
        candidates = [REPO_ROOT / "build" / "release" / "bin" / "zerod"]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise LaunchError(f"the zerod daemon binary was not found at {candidates[0]}: "
                      f"build it with `make` in {REPO_ROOT} (or pass --zerod-bin)")


def _die_with_parent() -> None:
    """Runs in each child before exec: SIGTERM it when the launcher dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _stop(proc: subprocess.Popen, sig: int, grace_s: float) -> Optional[int]:
    """Sends `sig` to a running child, waits `grace_s`, then kills it; its exit status."""
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
        except ProcessLookupError:
            pass
    return proc.wait()


def status_text(returncode: int) -> str:
    """'status 1' or 'signal SIGKILL' for a child's return code."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"status {returncode}"


class Cluster:
    """A daemon (for `backend == "zerod"`, unless `socket` names a running one)
    and `ranks` worker processes running `train_lm.py` with `worker_argv`.

    Use as a context manager: leaving it stops every process it started and
    removes its directory. Rank 0's stdout goes to `rank0_stdout` (default:
    ours), the other ranks' to /dev/null; every stderr is ours.
    """

    def __init__(
        self,
        backend: str,
        ranks: int,
        worker_argv: Sequence[str],
        *,
        zerod_bin: Optional[str] = None,
        socket: Optional[str] = None,
        daemon_threads: int = 1,
        daemon_log_level: str = "warn",
        rank0_stdout=None,
        quiet: bool = False,
        env: Optional[Dict[str, str]] = None,
    ) -> None:
        self.backend = backend
        self.ranks = ranks
        self.worker_argv = list(worker_argv)
        self.zerod_bin = zerod_bin
        self.socket = socket
        self.daemon_threads = daemon_threads
        self.daemon_log_level = daemon_log_level
        self.rank0_stdout = rank0_stdout
        self.quiet = quiet
        self.env = dict(os.environ if env is None else env)
        self.dir: Optional[Path] = None
        self.daemon: Optional[subprocess.Popen] = None
        self.workers: List[subprocess.Popen] = []

    # -- lifecycle ---------------------------------------------------------

    def __enter__(self) -> "Cluster":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Starts the daemon (if needed) and the workers."""
        self.dir = Path(tempfile.mkdtemp(prefix=f"zerod-lm-{self.backend}-"))
        if self.backend == "zerod" and self.socket is None:
            self._start_daemon()
        for rank in range(self.ranks):
            self.workers.append(self._start_worker(rank))

    def wait(self, poll_s: float = 0.05) -> None:
        """Returns when every worker has exited 0; raises LaunchError at the first failure."""
        while True:
            if self.daemon is not None and self.daemon.poll() is not None:
                raise LaunchError(f"zerod exited ({status_text(self.daemon.returncode)}) during the run"
                                  + self._daemon_log_tail())
            codes = [w.poll() for w in self.workers]
            for rank, code in enumerate(codes):
                if code not in (None, 0):
                    raise LaunchError(f"worker rank {rank} (pid {self.workers[rank].pid}) exited "
                                      f"with {status_text(code)}" + self._daemon_log_tail())
            if all(code == 0 for code in codes):
                return
            time.sleep(poll_s)

    def stop_daemon(self, grace_s: float = 15.0) -> None:
        """Stops the daemon with SIGTERM; raises LaunchError if it did not exit cleanly."""
        if self.daemon is None:
            return
        code = _stop(self.daemon, signal.SIGTERM, grace_s)
        if code != 0:
            raise LaunchError(f"zerod exited with {status_text(code)} on SIGTERM" + self._daemon_log_tail())

    def close(self) -> None:
        """Stops whatever is still running (workers first) and removes the directory."""
        for worker in self.workers:
            _stop(worker, signal.SIGTERM, 5.0)
        if self.daemon is not None:
            _stop(self.daemon, signal.SIGTERM, 15.0)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def pids(self) -> List[int]:
        """The pids of the processes of this run that are still running."""
        procs = ([self.daemon] if self.daemon is not None else []) + self.workers
        return [p.pid for p in procs if p.poll() is None]

    # -- the processes -----------------------------------------------------

    @property
    def socket_path(self) -> str:
        """The socket the workers attach to."""
        assert self.dir is not None
        return self.socket or str(self.dir / "zerod.sock")

    def _start_daemon(self, timeout_s: float = 20.0) -> None:
        binary = find_zerod_binary(self.zerod_bin)
        assert self.dir is not None
        log = open(self.dir / "zerod.log", "wb")
        cmd = [str(binary), "standalone", "--ranks", str(self.ranks), "--dir", str(self.dir),
               "--socket", self.socket_path, "--threads-per-rank", str(self.daemon_threads),
               "--log-level", self.daemon_log_level]
        if not self.quiet:
            print(f"== zerod standalone: {self.ranks} CPU ranks, state in {self.dir}", flush=True)
        # Its own session: Ctrl-C reaches the workers but not the daemon, which
        # is stopped last, after the workers have detached.
        self.daemon = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                       env=self.env, preexec_fn=_die_with_parent,
                                       start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.socket_path):
            if self.daemon.poll() is not None:
                raise LaunchError(f"zerod exited ({status_text(self.daemon.returncode)}) before it was "
                                  "ready" + self._daemon_log_tail())
            if time.monotonic() > deadline:
                raise LaunchError(f"zerod did not create {self.socket_path} within {timeout_s:.0f} s"
                                  + self._daemon_log_tail())
            time.sleep(0.05)

    def _start_worker(self, rank: int) -> subprocess.Popen:
        assert self.dir is not None
        cmd = [sys.executable, str(TRAIN_LM), *self.worker_argv, "--backend", self.backend,
               "--worker", "--local-rank", str(rank), "--world-size", str(self.ranks)]
        if self.backend == "zerod":
            cmd += ["--socket", self.socket_path]
        else:
            cmd += ["--store", str(self.dir / "store")]
        env = dict(self.env)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        stdout = self.rank0_stdout if rank == 0 else subprocess.DEVNULL
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=stdout, env=env,
                                preexec_fn=_die_with_parent)

    def _daemon_log_tail(self) -> str:
        if self.daemon is None or self.dir is None:
            return ""
        tail = _tail(self.dir / "zerod.log")
        return f"\nlast lines of the zerod log:\n{tail}" if tail else ""
