"""Two processes (jax.distributed over gloo on CPU) train like one process with the same batch."""

import json
import os
import socket
import subprocess
import sys

import pytest

from experiments import train as train_cli

ARGS = ["--preset", "llama", "--set", "embed_dim=32", "mlp_dim=64", "num_layers=2",
        "--batch-size", "8", "--seq-len", "32", "--eval-batches", "1", "--eval-every", "0",
        "--sample-tokens", "0", "--lr", "1e-2", "--warmup", "1", "--steps", "3"]


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _losses(path):
  return [json.loads(l)["loss"] for l in path.read_text().splitlines() if '"loss"' in l]


def test_two_processes_match_one(tmp_path):
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)
  env.pop("XLA_FLAGS", None)
  port = _free_port()
  out = tmp_path / "multi"
  procs = [subprocess.Popen(
      [sys.executable, "-m", "experiments.train", *ARGS, "--out", str(out),
       "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
      cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=600)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail("multi-process training timed out")
  assert all(p.returncode == 0 for p in procs), "\n\n".join(l[-3000:] for l in logs)
  assert "2 process(es)" in logs[0]
  single = tmp_path / "single"
  train_cli.train(train_cli.make_parser().parse_args(ARGS + ["--out", str(single)]))
  multi_losses, single_losses = _losses(out / "metrics.jsonl"), _losses(single / "metrics.jsonl")
  assert len(multi_losses) == 3
  for a, b in zip(multi_losses, single_losses):
    assert a == pytest.approx(b, rel=1e-5)
