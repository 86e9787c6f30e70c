#!/usr/bin/env python3
"""Live weights: a model trains while another process generates text with
its newest weights, with no checkpoint in between (docs/subscribe.md).

    /usr/bin/python3 examples/python/live_inference.py    # daemon, trainer, generator

1. Starts `zerod standalone --ranks 1` in a temporary directory (or uses a
   running one: --socket).
2. Starts the trainer: examples/python/train_lm.py (the demo's small GPT,
   trained on the repository's text through zerod.torch) as job "lm".
3. In this process, builds the same GPT as a plain torch module and follows
   the job with zerod.torch.follow: each time training publishes a version
   the module takes it in place (one whole version, never a mix), and this
   process generates a line of text with it and prints which version and
   step it used. Generation is slower than a training step, so versions go
   by in between: each line says how many it skipped (it always takes the
   newest, nothing queues).
4. Stops when the trainer is done, then stops the daemon.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import lm
from launch import LaunchError, _die_with_parent, _stop, find_zerod_binary
from lora_jobs import start_daemon

CLIENT_PYTHON = lm.REPO_ROOT / "client" / "python"
if CLIENT_PYTHON.is_dir() and str(CLIENT_PYTHON) not in sys.path:
    sys.path.append(str(CLIENT_PYTHON))  # the package next to this daemon, unless installed
import zerod  # noqa: E402
import zerod.torch  # noqa: E402

HERE = Path(__file__).resolve().parent
CONFIG = dict(context=64, d_model=128, layers=2, heads=4)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=120, help="the trainer's optimizer steps")
    p.add_argument("--socket", help="use this running daemon instead of starting one")
    p.add_argument("--job", default="lm")
    p.add_argument("--prompt", default="The daemon ")
    p.add_argument("--sample-bytes", type=int, default=48)
    p.add_argument("--zerod-bin", help="the zerod binary (default: $ZEROD_BIN_DIR/zerod, "
                   "else build/release/bin/zerod)")
    return p.parse_args()


def start_trainer(args: argparse.Namespace, socket: str) -> subprocess.Popen:
    cmd = [sys.executable, str(HERE / "train_lm.py"), "--socket", socket, "--job", args.job,
           "--ranks", "1", "--steps", str(args.steps), "--context", str(CONFIG["context"]),
           "--d-model", str(CONFIG["d_model"]), "--layers", str(CONFIG["layers"]),
           "--heads", str(CONFIG["heads"]), "--log-every", "40", "--eval-every", "0",
           "--sample-bytes", "0"]
    print("== trainer: train_lm.py, job %s, %d steps" % (args.job, args.steps), flush=True)
    return subprocess.Popen(cmd, preexec_fn=_die_with_parent)


def wait_for_job(socket: str, job: str, trainer: subprocess.Popen) -> None:
    """The trainer creates the job; a subscriber attaches to an existing one."""
    while True:
        try:
            with zerod.Client(socket) as c:
                c.attach(job, read_only=True, create=False).detach()
                return
        except zerod.NotFoundError:
            if trainer.poll() is not None:
                raise LaunchError("the trainer exited before it created job %s" % job)
            time.sleep(0.2)


def generate_along(args: argparse.Namespace, socket: str, trainer: subprocess.Popen) -> int:
    cfg = lm.LMConfig(context=CONFIG["context"], d_model=CONFIG["d_model"],
                      n_layers=CONFIG["layers"], n_heads=CONFIG["heads"])
    model = lm.build_model(cfg, seed=1).eval()  # its own weights are overwritten at once
    wait_for_job(socket, args.job, trainer)
    print("== generator: following job %s" % args.job, flush=True)
    lines = 0
    for update in zerod.torch.follow(model, args.job, socket=socket, timeout_s=2.0):
        with torch.no_grad():
            text = lm.generate(model, args.prompt.encode(), args.sample_bytes, cfg.context,
                               temperature=0.0)
        print("[version %4d, step %4d, skipped %2d] %s%s" % (
            update.version, update.step, update.skipped, args.prompt, lm.printable(text)),
            flush=True)
        lines += 1
        if trainer.poll() is not None and update.step >= args.steps:
            break
    return lines


def main() -> int:
    args = parse_args()
    daemon = None
    with tempfile.TemporaryDirectory(prefix="zerod-live-") as tmp:
        socket = args.socket
        if socket is None:
            daemon = start_daemon(find_zerod_binary(args.zerod_bin), Path(tmp))
            socket = str(Path(tmp) / "zerod.sock")
        trainer = start_trainer(args, socket)
        try:
            lines = generate_along(args, socket, trainer)
            if trainer.wait() != 0:
                raise LaunchError("the trainer failed (status %d)" % trainer.returncode)
            print("== %d generations, each with the newest weights at the time" % lines,
                  flush=True)
        except LaunchError as e:
            print("live_inference: %s" % e, file=sys.stderr)
            return 1
        finally:
            _stop(trainer, signal.SIGTERM, 10.0)
            if daemon is not None:
                _stop(daemon, signal.SIGTERM, 30.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
