"""Recovery time: from kill -9 of a training job to the first step of the job started again by the same command.

    python benchmarks/recovery_time.py --model tiny --nproc 1
    python benchmarks/recovery_time.py --model gpt3-125m --nproc 4 --batch 8 --seq-len 128

Trains until the first checkpoint is complete and one more step ran, SIGKILLs every process of the job (the torchrun
agent and its workers by pid, as a node failure would), starts the same command at once and timestamps its console
lines as they arrive. Prints where the time went: interpreter and imports up to the first line, data (indexes,
sample order), model build, checkpoint read, the first step, and the total from the kill. Figures and dates are in
docs/performance.md ("Recovery time").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


class Job:
    """A training command whose console lines are kept with their arrival times."""

    def __init__(self, cmd: list[str], env: dict):
        self.lines: list[tuple[float, str]] = []
        self.start = time.time()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip()))

    def wait_for(self, pattern: str, timeout: float = 1800) -> tuple[float, str]:
        regex, deadline, seen = re.compile(pattern), time.time() + timeout, 0
        while time.time() < deadline:
            for t, line in self.lines[seen:]:
                if regex.search(line):
                    return t, line
            seen = len(self.lines)
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.01)
        tail = "\n".join(line for _, line in self.lines[-30:])
        raise RuntimeError(f"no line matching {pattern!r}:\n{tail}")

    def kill(self) -> None:
        pids = [*_children(self.proc.pid), self.proc.pid]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def seconds(line: str, pattern: str) -> float:
    m = re.search(pattern, line)
    return float(m.group(1)) if m else float("nan")


def measure(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="hybridpar-recovery-"))
    run_dir = work / "run"
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
           if args.nproc > 1 else [sys.executable]) + [
        "launch/pretrain_gpt.py", "--model.name", args.model, "--train.steps", "1000",
        "--train.global_batch_size", str(args.batch), "--train.seq_len", str(args.seq_len),
        "--train.eval_interval", "0", "--train.sample_tokens", "0", "--logging.interval", "100",
        "--checkpoint.interval", str(args.interval), "--logging.wandb.mode", "disabled",
        "--data.cache_dir", args.cache_dir, "--run.dir", str(run_dir), *args.extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    first = Job(cmd, env)
    first.wait_for(rf"saved checkpoint .*step_{args.interval:08d}")
    time.sleep(args.after)
    first.kill()
    killed = time.time()
    second = Job(cmd, env)
    t_first_line = second.wait_for(r".")[0]
    t_data, data_line = second.wait_for(r"start-up: data ready")
    t_model, model_line = second.wait_for(r"start-up: this rank's shards materialised")
    t_read, read_line = second.wait_for(r"resuming from .* read in")
    t_step, step_line = second.wait_for(r"first step done in")
    second.kill()
    shutil.rmtree(work, ignore_errors=True)
    if args.verbose:
        for t, line in second.lines:
            if t <= t_step:
                print(f"{t - killed:7.2f}s  {line[:110]}")
    return {
        "model": args.model, "nproc": args.nproc, "batch": args.batch, "seq_len": args.seq_len,
        "restart_to_first_line": t_first_line - killed,
        "data_seconds": seconds(data_line, r"in ([\d.]+)s"),
        "model_build_seconds": t_model - t_data,
        "checkpoint_read_seconds": seconds(read_line, r"read in ([\d.]+)s"),
        "first_step_seconds": seconds(step_line, r"done in ([\d.]+)s"),
        "kill_to_first_step": t_step - killed,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--interval", type=int, default=2, help="checkpoint.interval of the killed run")
    p.add_argument("--after", type=float, default=0.5, help="seconds between the checkpoint and the kill")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/hybridpar"))
    p.add_argument("--verbose", action="store_true", help="print the restarted job's lines with their times")
    p.add_argument("--out", help="append the result as a JSON line to this file")
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py arguments (after --)")
    args = p.parse_args()
    result = measure(args)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
