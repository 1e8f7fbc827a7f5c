"""Robustness of the GPU benchmark scripts run unattended by ``experiments/device_check.sh``: the
adaptive timing rounds, strict JSON, one failing case not losing the others (``--check`` cases,
benchmark rows), rows printed and saved as they are measured, and the device check's overall time
budget with its closing summary line.  Tiny sizes on CPU; the GPU kernels themselves are faked."""

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_decode, bench_flash, bench_sparse_kernel, timing

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _ones(key, shape, dtype=jnp.float32):
  """In place of ``jax.random.normal``, which compiles once per shape (seconds for a check's
  dozen shapes on CPU): these tests need no random values."""
  return jnp.ones(shape, dtype)


def _strict_load(path):
  """``json.loads`` refusing NaN / Infinity, as strict parsers (JavaScript, jq) do."""
  def refuse(name):
    raise ValueError(f"non-strict JSON constant {name}")
  return json.loads(pathlib.Path(path).read_text(), parse_constant=refuse)


# ---------------------------------------------------------------------------------------------
# timing.py
# ---------------------------------------------------------------------------------------------

def test_auto_inner_fills_a_round():
  # A causal T=2048 forward on an H200 (~0.35 ms) + ~30 us of dispatch and sync: 27 calls.
  assert timing.auto_inner(0.38e-3) == 27
  assert timing.auto_inner(1e-6) == timing.MAX_INNER == 50      # capped
  assert timing.auto_inner(0.5) == 1                            # long calls: one per round
  assert timing.auto_inner(0.0) == 50
  assert timing.auto_inner(0.5, min_inner=20) == 20             # bench_decode's floor
  assert timing.auto_inner(1e-4, min_inner=20) == 50
  # The queued outputs stay within queued_bytes (2 GiB outputs: 8 in 16 GiB) ...
  assert timing.auto_inner(1e-4, out_bytes=2 << 30) == 8
  assert timing.auto_inner(1e-4, out_bytes=64 << 30) == 1
  # ... except below an explicit floor.
  assert timing.auto_inner(1e-4, out_bytes=2 << 30, min_inner=20) == 20


class _FakeClock:
  """``time.perf_counter`` advanced only by the fake executable: ``step`` seconds per call."""

  def __init__(self, step):
    self.now, self.step, self.calls = 0.0, step, 0

  def perf_counter(self):
    return self.now

  def call(self, *args):
    self.calls += 1
    self.now += self.step
    return np.zeros(4, np.float32)


def test_best_time_auto_queues_calls_per_round(monkeypatch):
  clock = _FakeClock(0.4e-3)
  monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
  sec = timing.best_time(clock.call, (), repeats=3, inner="auto")
  assert sec == pytest.approx(0.4e-3)                 # still the time of one call
  assert clock.calls == 1 + 1 + 3 * 25                # warm-up, probe, 3 rounds of 10 ms / 0.4 ms
  clock = _FakeClock(0.4e-3)
  monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
  timing.best_time(clock.call, (), repeats=2)         # the default stays one call per round
  assert clock.calls == 1 + 2
  with pytest.raises(ValueError, match="inner"):
    timing.best_time(clock.call, (), repeats=1, inner=0)


def test_write_json_is_strict(tmp_path):
  path = tmp_path / "sub" / "results.json"
  timing.write_json(path, {"a": float("nan"), "b": [1.5, float("inf"), (np.float32("nan"), 2)],
                           "c": np.float64(3.0), "d": None, "e": "x"})
  assert _strict_load(path) == {"a": None, "b": [1.5, None, [None, 2]], "c": 3.0, "d": None,
                                "e": "x"}
  assert not (tmp_path / "sub" / "results.json.tmp").exists()
  assert timing.error_text(RuntimeError("boom\nmore")) == "RuntimeError: boom"


# ---------------------------------------------------------------------------------------------
# bench_sparse_kernel
# ---------------------------------------------------------------------------------------------

def _record_inner(monkeypatch, module):
  seen = []
  real = timing.best_time

  def recording(compiled, args, repeats, inner=1, **kw):
    seen.append((inner, kw))
    return real(compiled, args, repeats, inner=inner, **kw)

  monkeypatch.setattr(module, "best_time", recording)
  return seen


def test_sparse_kernel_results_are_strict_json_and_timed_in_rounds(monkeypatch, tmp_path):
  seen = _record_inner(monkeypatch, bench_sparse_kernel)
  rows = bench_sparse_kernel.main(["--kind", "gqa", "--contexts", "24", "--queries", "2",
                                   "--topk", "8", "--impl", "xla", "--dtype", "float32",
                                   "--repeats", "1", "--out", str(tmp_path)])
  assert np.isnan(rows[0]["max_rel_err"])          # no --check: no error measured
  saved = _strict_load(tmp_path / "results.json")  # was NaN: not JSON
  assert saved[0]["max_rel_err"] is None and saved[0]["kernel_s"] > 0
  assert [inner for inner, _ in seen] == ["auto", "auto"]


def test_sparse_kernel_case_error_keeps_the_other_cases(monkeypatch, tmp_path, capsys):
  real = bench_sparse_kernel.case_inputs

  def case_inputs(kind, t, s, k, heads, dtype):
    if s == 16:
      raise RuntimeError("out of shared memory")
    return real(kind, t, s, k, heads, dtype)

  monkeypatch.setattr(bench_sparse_kernel, "case_inputs", case_inputs)
  with pytest.raises(SystemExit, match="1 of 2 cases failed: gqa 16: RuntimeError: out of"):
    bench_sparse_kernel.main(["--kind", "gqa", "--contexts", "16,24", "--queries", "2",
                              "--topk", "8", "--impl", "xla", "--dtype", "float32",
                              "--repeats", "1", "--out", str(tmp_path)])
  saved = _strict_load(tmp_path / "results.json")
  assert saved[0]["error"] == "RuntimeError: out of shared memory"
  assert "error" not in saved[1] and saved[1]["kernel_s"] > 0
  assert "gqa 16 error: RuntimeError: out of shared memory" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# bench_decode
# ---------------------------------------------------------------------------------------------

def _squeeze(text):
  """Runs of spaces as one (the table's column widths aside)."""
  return "\n".join(" ".join(line.split()) for line in text.splitlines())


TINY_DECODE = ["--kind", "gqa", "--contexts", "32", "--heads", "2", "--kv-heads", "1",
               "--head-dim", "16", "--page-size", "16", "--copy-mb", "1", "--repeats", "1"]


def test_decode_rows_printed_and_saved_as_measured_and_errors_kept(monkeypatch, tmp_path, capsys):
  """A failing implementation gets an error row (the others keep their figures, exit status 1);
  each row is printed and results.json rewritten before the next case starts."""
  out = tmp_path / "out"
  seen = _record_inner(monkeypatch, bench_decode)
  real = bench_decode.build_case
  at_build = []

  def build_case(kind, b, s, args, dtype, rng):
    at_build.append((capsys.readouterr().out,
                     _strict_load(out / "results.json")["rows"] if b > 1 else None))
    fns, nbytes = real(kind, b, s, args, dtype, rng)

    def boom(*a):
      raise RuntimeError("Triton compilation failed\nlong trace")
    fns["xla_paged"] = (boom, fns["xla_paged"][1])
    return fns, nbytes

  monkeypatch.setattr(bench_decode, "build_case", build_case)
  rc = bench_decode.main(TINY_DECODE + ["--batches", "1,2", "--impls", "xla_paged,contiguous",
                                        "--out", str(out)])
  assert rc == 1
  # Before batch 2 was built, batch 1's rows were on screen and on disk.
  printed, saved = at_build[1]
  assert "gqa 32 1 contiguous " in _squeeze(printed)
  assert "gqa 32 1 xla_paged error: RuntimeError: Triton compilation failed" in _squeeze(printed)
  assert [(r["batch"], r["impl"]) for r in saved] == [(1, "contiguous"), (1, "xla_paged")]
  rows = _strict_load(out / "results.json")["rows"]
  assert [(r["batch"], r["impl"]) for r in rows] == [
      (1, "contiguous"), (1, "xla_paged"), (2, "contiguous"), (2, "xla_paged")]
  for r in rows:
    if r["impl"] == "contiguous":
      assert r["ms"] > 0 and r["vs_contiguous"] == 1.0 and "error" not in r
    else:
      assert r["ms"] is None and r["vs_contiguous"] is None
      assert r["error"] == "RuntimeError: Triton compilation failed"
  assert (out / "bench_decode.png").exists()
  assert "2 of 4 rows failed" in capsys.readouterr().out
  # The copy bandwidth and every case: rounds sized automatically (no floor on CPU).
  assert seen and all(s == ("auto", {"min_inner": 1}) for s in seen)


def test_decode_check_case_error_fails_that_case_only(monkeypatch, capsys):
  """``run_check``: a case that raises prints FAIL (<error>), the later cases still run, and the
  check fails.  The kernels are faked (the real ones need a GPU): GQA's raises, MLA's agrees."""
  def paged_attention(q, k, v, table, lengths, implementation, key_scale=None, value_scale=None):
    if implementation == "pallas_gpu":
      raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS")
    return jnp.zeros_like(q)

  def paged_mla_decode(ql, qr, cp, rp, table, lengths, scale, implementation, indices=None,
                       c_kv_scale=None):
    return jnp.zeros_like(ql)

  monkeypatch.setattr(bench_decode, "_on_gpu", lambda: True)
  monkeypatch.setattr(jax.random, "normal", _ones)
  monkeypatch.setattr(bench_decode, "paged_attention", paged_attention)
  monkeypatch.setattr(bench_decode, "paged_mla_decode", paged_mla_decode)
  assert bench_decode.run_check(page_size=16, context=64) is False
  lines = capsys.readouterr().out.splitlines()
  gqa = [x for x in lines if x.startswith("check gqa N=32")]
  assert len(gqa) == 3
  assert all(x.endswith(": FAIL (RuntimeError: CUDA_ERROR_ILLEGAL_ADDRESS)") for x in gqa)
  quant = [x for x in lines if x.startswith("check gqa int8 cache") or
           x.startswith("check gqa float8_e4m3fn cache")]
  assert len(quant) == 2 and all(x.endswith("CUDA_ERROR_ILLEGAL_ADDRESS)") for x in quant)
  mla = [x for x in lines if x.startswith("check mla")]
  assert len(mla) == 8 and all(x.endswith(": PASS") for x in mla)
  assert lines[-1] == "check: FAIL"


def test_decode_check_error_still_runs_the_benchmark(monkeypatch, tmp_path, capsys):
  def run_check(page_size):
    raise ImportError("no Triton")

  monkeypatch.setattr(bench_decode, "run_check", run_check)
  rc = bench_decode.main(TINY_DECODE + ["--batches", "1", "--impls", "contiguous", "--check",
                                        "--out", str(tmp_path)])
  assert rc == 1
  out = capsys.readouterr().out
  assert "check: FAIL (ImportError: no Triton)" in out and "gqa 32 1 contiguous " in _squeeze(out)
  assert _strict_load(tmp_path / "results.json")["rows"][0]["ms"] > 0


# ---------------------------------------------------------------------------------------------
# bench_flash
# ---------------------------------------------------------------------------------------------

def test_flash_check_case_error_fails_that_case_only(monkeypatch, capsys):
  """The first case's kernel raises: FAIL (<error>), then the other three cases still run.  The
  kernel and the formula are faked as zeros (so the rest agree)."""
  import pallas_kernels.flash_attention as fa  # noqa: PLC0415

  def kernel(q, k, v, mask, **kw):
    if q.shape[1] == 1000:
      raise ValueError("block_q 128 does not fit in shared memory")
    return q * 0

  monkeypatch.setattr(bench_flash, "_platform", lambda: "gpu")
  monkeypatch.setattr(jax.random, "normal", _ones)
  monkeypatch.setattr(fa, "flash_attention_gpu", kernel)
  monkeypatch.setattr(bench_flash, "dot_product_attention", lambda q, k, v, **kw: q * 0)
  assert bench_flash.run_check() is False
  lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("check")]
  assert lines[1] == ("check bf16 causal GQA: FAIL (ValueError: block_q 128 does not fit in "
                      "shared memory)")
  assert len(lines) == 2 + 4 and all(x.endswith("PASS") for x in lines[2:-1])
  assert lines[-1] == "check: FAIL"


def test_flash_check_error_still_runs_the_benchmark_and_times_in_rounds(monkeypatch, capsys):
  def run_check():
    raise ImportError("no Mosaic GPU")

  monkeypatch.setattr(bench_flash, "run_check", run_check)
  seen = _record_inner(monkeypatch, bench_flash)
  rc = bench_flash.main(["--check", "--seq-lens", "32", "--tokens", "32", "--heads", "2",
                         "--head-dim", "16", "--repeats", "1", "--matmul-size", "32",
                         "--no-plot"])
  assert rc == 1
  out = capsys.readouterr().out
  assert "check: FAIL (ImportError: no Mosaic GPU)" in out
  assert "    32  False   1 |" in out and "    32   True   1 |" in out
  assert [inner for inner, _ in seen] == ["auto"] * 4      # (ours, base) x (full, causal)


@pytest.mark.parametrize("dense", ["bias", "mask", "flax-mask"])
def test_flash_dense_inputs_reach_both_sides(dense, monkeypatch, capsys):
  """``--dense bias`` / ``mask`` / ``flax-mask``: ours and the baseline each get the same dense
  input (a [1, N, T, T] bias, differentiated in forward + backward; a [B, 1, 1, T] key-padding
  mask; the same padding as a [B, 1, T, T] mask)."""
  seen = {"ours": [], "base": []}
  real_ours, real_base = bench_flash.dot_product_attention, jax.nn.dot_product_attention

  def ours(q, k, v, **kw):
    seen["ours"].append({n: tuple(x.shape) for n, x in kw.items() if n in ("bias", "mask")})
    return real_ours(q, k, v, **kw)

  def base(q, k, v, **kw):
    seen["base"].append({n: tuple(x.shape) for n, x in kw.items() if n in ("bias", "mask")})
    return real_base(q, k, v, **kw)

  monkeypatch.setattr(bench_flash, "dot_product_attention", ours)
  monkeypatch.setattr(jax.nn, "dot_product_attention", base)
  rc = bench_flash.main(["--seq-lens", "32", "--tokens", "64", "--heads", "2", "--head-dim",
                         "16", "--repeats", "1", "--matmul-size", "32", "--no-plot",
                         "--backward", "--dense", dense])
  assert rc == 0
  want = {"bias": {"bias": (1, 2, 32, 32)}, "mask": {"mask": (2, 1, 1, 32)},
          "flax-mask": {"mask": (2, 1, 32, 32)}}[dense]
  assert seen["ours"] and all(x == want for x in seen["ours"] + seen["base"]), seen
  out = capsys.readouterr().out
  assert f"dense={dense}" in out and "    32  False   2 |" in out and "n/a" not in out
  mask = bench_flash.dense_input("mask", 2, 32, 2, jnp.float32, 0)
  assert mask.dtype == jnp.bool_ and int(mask.sum()) == 2 * 28  # the last eighth hidden
  flax = bench_flash.dense_input("flax-mask", 2, 32, 2, jnp.float32, 0)
  assert flax.shape == (2, 1, 32, 32) and int(flax.sum()) == 2 * 28 * 28


def test_flash_sinks_mask_reaches_both_sides(monkeypatch, capsys):
  """``--dense sinks``: the baseline gets the boolean ``[1, 1, T, T]`` array, ours the position
  mask it came from (causal window + sinks); one causal row per length, rates over the allowed
  pairs (``sinks_pairs`` counts the array's)."""
  seen = []
  real_ours = bench_flash.dot_product_attention

  def ours(q, k, v, **kw):
    seen.append(kw.get("mask"))
    return real_ours(q, k, v, **kw)

  monkeypatch.setattr(bench_flash, "dot_product_attention", ours)
  rc = bench_flash.main(["--seq-lens", "256", "--tokens", "256", "--heads", "2", "--head-dim",
                         "16", "--repeats", "1", "--matmul-size", "32", "--no-plot",
                         "--dense", "sinks"])
  assert rc == 0
  assert seen and all(m == bench_flash.sinks_mask(256) for m in seen)
  dense = bench_flash.dense_input("sinks", 1, 256, 2, jnp.float32, 0)
  assert dense.shape == (1, 1, 256, 256)
  np.testing.assert_array_equal(np.asarray(dense[0, 0]),
                                np.asarray(bench_flash.sinks_mask(256).dense(256, 256)))
  assert bench_flash.sinks_pairs(256) == int(dense.sum())
  assert int(dense.sum()) < 256 * 257 // 2  # sparser than causal
  out = capsys.readouterr().out
  assert "dense=sinks" in out and "   256   True   1 |" in out
  assert "   256  False" not in out and "n/a" not in out


def test_flash_hopper_config_flag():
  """``--hopper block_k=64,stages=3,overlap=1`` builds the Hopper kernels' config; unknown names,
  non-integers and configs the kernel refuses are argument errors naming what is allowed."""
  from pallas_kernels.flash_attention import hopper  # noqa: PLC0415

  assert bench_flash.hopper_config("block_k=64,stages=3,overlap=1") == hopper.Config(
      block_k=64, stages=3, overlap=True)
  assert bench_flash.hopper_config("pingpong=0") == hopper.Config(pingpong=False)
  assert bench_flash.hopper_config("overlap=1,pingpong=1,registers=240") == hopper.Config(
      overlap=True, pingpong=True, registers=240)
  assert bench_flash.hopper_label(hopper.Config(overlap=True, pingpong=True)) == (
      "bk=128 stages=2 overlap+pingpong            regs=232")
  assert all(hopper.Config(**s) for s in bench_flash.HOPPER_SWEEP)
  # device_check's core step times the first eight: the default and the overlapped schedules
  first = [hopper.Config(**s) for s in bench_flash.HOPPER_SWEEP[:8]]
  assert first[0] == hopper.Config() and all(c.overlap for c in first[1:])
  assert {c.pingpong for c in first} == {True, False} and {c.registers for c in first} == {
      232, 240}
  assert {(c.block_k, c.stages) for c in first} == {(128, 2), (192, 2), (128, 3)}
  assert [c.persistent for c in first].count(True) == 1
  # every setting fits at head size 128 (without segment ids, as the benchmark calls it)
  assert all(hopper.smem_bytes(128, hopper.Config(**s), segments=False) <= 227 * 1024
             for s in bench_flash.HOPPER_SWEEP)
  # forward + backward: the backward's own switch against each forward schedule
  assert bench_flash.hopper_config("backward_overlap=1") == hopper.Config(backward_overlap=True)
  bwd = [hopper.Config(**s) for s in bench_flash.HOPPER_BWD_SWEEP]
  assert bwd[0] == hopper.Config() and {(c.overlap, c.overlaps_backward) for c in bwd} == {
      (False, False), (False, True), (True, True), (True, False)}
  assert bench_flash.hopper_label(bwd[1], backward=True) == (
      "bk=128 stages=2 plain                       regs=232 bwd=overlap dq_bk=64")
  assert {c.dq_block_k for c in bwd} == {64, 128}
  assert all(hopper.supports_backward(head_dim=128, config=c) is None for c in bwd)
  with pytest.raises(SystemExit):
    bench_flash.main(["--backward-only"])
  for bad, match in (("warps=4", "name one of block_q, block_k"), ("block_k=big", "integer"),
                     ("stages=1", "stages"), ("block_k=96", "multiple of 64")):
    with pytest.raises(argparse.ArgumentTypeError, match=match):
      bench_flash.hopper_config(bad)


# ---------------------------------------------------------------------------------------------
# device_check.sh
# ---------------------------------------------------------------------------------------------

FAKE_PY = """#!/bin/bash
# Stands in for python3: the preflight passes; every other step prints its arguments and then
# sleeps FAKE_SLEEP seconds.
if [ "$1" = - ]; then cat >/dev/null; echo "FAKE preflight"; exit 0; fi
echo "FAKE $*"
exec sleep "${FAKE_SLEEP:-0}"
"""


def _device_check(tmp_path, **env):
  fake = tmp_path / "fakepy"
  fake.write_text(FAKE_PY)
  fake.chmod(0o755)
  out = tmp_path / "out"
  env = {**os.environ, "PYTHON": str(fake), "OUT": str(out), **env}
  t0 = time.monotonic()
  proc = subprocess.run(["bash", str(ROOT / "experiments" / "device_check.sh")], env=env,
                        capture_output=True, text=True, timeout=30)
  return proc, (out / "device_check.log").read_text(), time.monotonic() - t0


needs_bash = pytest.mark.skipif(not (shutil.which("bash") and shutil.which("timeout")),
                                reason="needs bash and GNU timeout")


@needs_bash
def test_device_check_script_parses():
  subprocess.run(["bash", "-n", str(ROOT / "experiments" / "device_check.sh")], check=True)


@needs_bash
def test_device_check_all_steps_pass(tmp_path):
  proc, log, _ = _device_check(tmp_path)
  assert proc.returncode == 0, proc.stdout
  assert proc.stdout.splitlines()[-1] == "device_check: PASSED"
  assert log == proc.stdout                           # the tee'd log is complete
  assert proc.stdout.count("=== ") == 2 * 25 and "SKIPPED" not in proc.stdout
  # one pytest run compiles every GPU kernel test file, before any benchmark
  steps = [x for x in proc.stdout.splitlines() if x.startswith("=== ") and "limit" in x]
  assert steps[1].startswith("=== GPU kernel tests (") and steps[1].count(".py") == 4, steps
  for part, first, n in (("core", "GPU kernel tests", 8), ("more", "triton kernels: fo", 16),
                         ("flash", "GPU kernel tests", 17)):
    proc, _, _ = _device_check(tmp_path, PART=part)
    steps = [x for x in proc.stdout.splitlines() if x.startswith("=== ") and "limit" in x]
    assert proc.returncode == 0 and len(steps) == 1 + n, proc.stdout
    assert steps[1].startswith(f"=== {first}"), steps
    # the schedule sweeps are tuning: PART=flash (the short run) leaves them out
    assert any("schedules" in x for x in steps) == (part != "flash"), steps
  proc, _, _ = _device_check(tmp_path, PART="bogus")
  assert proc.returncode == 1 and "unknown PART=bogus" in proc.stdout


@needs_bash
def test_device_check_keeps_its_budget_and_prints_the_summary(tmp_path):
  """Every step hangs: the first is cut to what is left of the budget (6 s less the preflight's
  second or so: the limit depends on the machine's load) and killed, the rest are skipped, and
  the summary is printed (and logged) well before the old limits' sum (690 s here; each fake
  step would take 40 s)."""
  proc, log, wall = _device_check(tmp_path, FAKE_SLEEP="40", BUDGET_S="6", MIN_STEP_S="2",
                                  PART="decode")
  lines = proc.stdout.splitlines()
  assert proc.returncode == 1, proc.stdout
  limits = [re.fullmatch(r"=== GPU kernel tests \(tests/kernels/test_decode_gpu.py\) "
                         r"\(limit (\d+)s\)", x) for x in lines]
  limits = [int(m.group(1)) for m in limits if m]
  assert len(limits) == 1 and 2 <= limits[0] <= 6, proc.stdout
  assert any(x.startswith("=== GPU kernel tests (") and ": exit 124 (time limit) after " in x
             for x in lines), proc.stdout
  skipped = [x for x in lines if x.startswith("=== SKIPPED ")]
  assert len(skipped) == 5, proc.stdout
  assert skipped[0].startswith("=== SKIPPED contiguous-cache decode on the GPU kernels: ")
  assert skipped[0].endswith(" s left")
  assert lines[-1].startswith("device_check: FAILED (skipped: contiguous-cache decode on the ")
  assert log == proc.stdout
  assert wall < 20


def test_sparse_mla_flops_count_the_absorbed_projections():
  """The MLA call also runs q_nope -> latent and latent -> value (2 T N C (P + h)): left out,
  TFLOP/s read ~5.5% low at k = 2048."""
  t, s, k, n = 2, 16, 4, 2
  _, _, row_bytes, flops = bench_sparse_kernel.case_inputs("mla", t, s, k, n, jnp.float32)
  assert flops == 2 * t * n * k * (512 + 64 + 512) + 2 * t * n * 512 * (128 + 128)
  assert row_bytes == (512 + 64) * 4


def test_bench_context_rows_json_and_plot(tmp_path, capsys):
  """Every strategy's row at a tiny size on 4 of the 8 simulated devices: no errors, the ring
  holds the least memory per device and XLA's partitioning the most, the balanced all-gather's
  busiest device does (2 C + 1) / (4 C) of the unbalanced work."""
  from experiments import bench_context
  js, png = tmp_path / "ctx.json", tmp_path / "ctx.png"
  bench_context.main(["--seq-lens", "64", "--devices", "4", "--heads", "4", "--kv-heads", "2",
                      "--head-dim", "8", "--repeats", "1", "--json", str(js), "--plot", str(png)])
  rows = {r["strategy"]: r for r in _strict_load(js)["rows"]}
  assert sorted(rows) == sorted(bench_context.STRATEGIES)
  assert not [r for r in rows.values() if "error" in r], rows
  mem = {k: r["peak_bytes"] for k, r in rows.items()}
  assert mem["ring"] < mem["all_gather_unbalanced"] < mem["xla"], mem
  assert rows["all_gather"]["busiest_work"] == pytest.approx(9 / 16)
  assert rows["all_gather_unbalanced"]["busiest_work"] == 1.0
  assert png.stat().st_size > 0
  out = capsys.readouterr().out
  assert "ring" in out and "x xla" in out
  with pytest.raises(ValueError, match="multiples of 2 x --devices"):
    bench_context.main(["--seq-lens", "60", "--devices", "4"])
  # the delta rule: its context-parallel rows hold less memory per device than XLA's
  bench_context.main(["--mixer", "deltanet", "--seq-lens", "32", "--devices", "4", "--heads",
                      "4", "--kv-heads", "2", "--head-dim", "8", "--repeats", "1", "--json",
                      str(js)])
  rows = {r["strategy"]: r for r in _strict_load(js)["rows"]}
  assert sorted(rows) == ["context", "xla"] and rows["context"]["mixer"] == "deltanet"
  assert rows["context"]["peak_bytes"] < rows["xla"]["peak_bytes"], rows
  with pytest.raises(ValueError, match="must be among"):
    bench_context.main(["--mixer", "deltanet", "--strategies", "ring", "--seq-lens", "32",
                        "--devices", "4"])
  # a sliding window: the ring row runs and records it
  bench_context.main(["--seq-lens", "64", "--devices", "4", "--heads", "4", "--kv-heads", "2",
                      "--head-dim", "8", "--repeats", "1", "--window", "5", "--strategies",
                      "xla", "ring", "--json", str(js)])
  rows = {r["strategy"]: r for r in _strict_load(js)["rows"]}
  assert not [r for r in rows.values() if "error" in r], rows
  assert rows["ring"]["window"] == 5 and rows["ring"]["busiest_work"] == 1.0
  with pytest.raises(ValueError, match="--window"):
    bench_context.main(["--mixer", "deltanet", "--window", "5", "--seq-lens", "32",
                        "--devices", "4"])


def test_bench_moe_mxfp4_rows_through_the_kernels(tmp_path, capsys):
  """``bench_moe --mxfp4``: every requested path, the interpreted kernels included, agrees with
  the dense baseline on the same frozen MXFP4 experts (forward and the tokens' gradient)."""
  from experiments import bench_moe
  rows = bench_moe.main(["--tokens", "24", "--experts", "4", "--top-k", "2", "--embed", "64",
                         "--expert-dim", "64", "--reps", "1", "--mxfp4", "--backward", "--paths",
                         "dense,blocked,pallas_tpu", "--out", str(tmp_path)])
  assert [r["name"] for r in rows] == ["dense", "blocked", "pallas_tpu"]
  assert all(r["max_abs_diff_vs_dense"] < 1e-3 for r in rows), rows
  saved = _strict_load(tmp_path / "results.json")
  assert saved["config"]["mxfp4"] and len(saved["rows"]) == 3
  assert "MXFP4 experts" in capsys.readouterr().out


def test_bench_moe_lora_rows_factored_and_merged(tmp_path):
  """``bench_moe --lora-rank``: the factored LoRA paths and the merged baseline agree with the
  dense reference (forward and the factors' gradients)."""
  from experiments import bench_moe
  rows = bench_moe.main(["--tokens", "24", "--experts", "4", "--top-k", "2", "--embed", "32",
                         "--expert-dim", "32", "--reps", "1", "--lora-rank", "4", "--backward",
                         "--out", str(tmp_path)])
  assert {"dense", "blocked", "capacity", "blocked_merged"} <= {r["name"] for r in rows}
  assert all(r["max_abs_diff_vs_dense"] < 1e-3 for r in rows if r["name"] != "capacity"), rows


def test_decode_quantized_cache_rows(tmp_path):
  """``--kv-quant none,int8``: each implementation again over an int8 cache (``impl+int8``),
  counting the bytes it reads (codes and a fp32 scale per token and head: ``K * 2 (H + 4)``),
  against the float cache's contiguous row."""
  rc = bench_decode.main(TINY_DECODE + ["--batches", "1", "--impls", "contiguous,xla_paged",
                                        "--kv-quant", "none,int8", "--out", str(tmp_path)])
  assert rc == 0
  rows = {r["impl"]: r for r in _strict_load(tmp_path / "results.json")["rows"]}
  assert list(rows) == ["contiguous", "xla_paged", "contiguous+int8", "xla_paged+int8"]
  # bf16: 1 KV head x 2 x 16 x 2 bytes = 64 per token; int8: 1 x 2 x (16 + 4) = 40.
  assert rows["xla_paged+int8"]["cache_mb"] == pytest.approx(
      rows["xla_paged"]["cache_mb"] * 40 / 64)
  assert all(r["ms"] > 0 and r["vs_contiguous"] is not None for r in rows.values())
  assert rows["contiguous"]["vs_contiguous"] == 1.0
  # MLA: c_KV in codes with a scale per token, k^R in bf16: (32 + 4 + 16 * 2) / ((32 + 16) * 2).
  mla = ["--kind", "mla", "--mla-heads", "2", "--latent", "32", "--rope", "16"]
  argv = TINY_DECODE[2:] + mla + ["--batches", "1", "--impls", "contiguous,xla_paged",
                                  "--kv-quant", "none,int8", "--out", str(tmp_path / "mla")]
  assert bench_decode.main(argv) == 0
  rows = {r["impl"]: r for r in _strict_load(tmp_path / "mla" / "results.json")["rows"]}
  assert list(rows) == ["contiguous", "xla_paged", "contiguous+int8", "xla_paged+int8"]
  assert rows["xla_paged+int8"]["cache_mb"] == pytest.approx(
      rows["xla_paged"]["cache_mb"] * 68 / 96)


# ---------------------------------------------------------------------------------------------
# bench_speculative
# ---------------------------------------------------------------------------------------------

SPECULATIVE_SMOKE = ["--smoke", "--prompts", "2", "--prompt-len", "16", "--new-tokens", "10",
                     "--k", "2", "--repeats", "1", "--engine-repeats", "1"]


def test_bench_speculative_rows_json_and_plot(tmp_path, capsys):
  """``--smoke`` (untrained tiny models): every row on the same prompts, the greedy ones equal to
  ``generate``'s tokens, the statistics in range; the serving engine's greedy rows in a second
  run (``--temperature 0``: its sampled rows are the same engines at another temperature, ten
  more compilations of the engine's programs, about 40 s of this suite; their table is checked
  below)."""
  from experiments import bench_speculative
  assert bench_speculative.main(SPECULATIVE_SMOKE + ["--out", str(tmp_path), "--no-engine"]) == 0
  saved = _strict_load(tmp_path / "results.json")
  rows = {r["name"]: r for r in saved["rows"]}
  assert list(rows) == ["generate (no draft)", "ngram k=2", "draft k=2", "generate (MTP model)",
                        "mtp k=2", "generate (no draft) T=0.8", "draft k=4 T=0.8",
                        "generate (MTP model) T=0.8", "mtp k=4 T=0.8"]
  assert rows["mtp k=4 T=0.8"]["baseline"] == "generate (MTP model) T=0.8"
  assert rows["mtp k=2"]["baseline"] == "generate (MTP model)"
  assert saved["parameters"]["mtp_modules"] > 0
  assert saved["prompts"] == 2 and saved["greedy_mismatches"] == {}
  for name, r in rows.items():
    assert r["tokens_per_s"] > 0 and r["speedup"] > 0 and len(r["per_prompt"]) == 2, name
    assert r["tokens_per_call"] >= 1, name
    if r["temperature"] == 0:
      assert r["mismatched_prompts"] == 0, name
      assert all(p["tokens_equal_baseline"] for p in r["per_prompt"]), name
    else:
      assert r["mismatched_prompts"] is None, name
    if r["draft"] is None:
      assert r["acceptance_rate"] is None and r["tokens_per_call"] == 1.0, name
    else:
      assert 0 <= r["acceptance_rate"] <= 1 and r["tokens_per_call"] <= r["k"] + 1, name
      assert r["drafted"] == r["k"] * r["rounds"] and r["emitted"] == 2 * (10 - 1), name
  assert rows["generate (no draft)"]["speedup"] == 1.0
  assert rows["generate (MTP model)"]["speedup"] == 1.0
  assert (tmp_path / "bench_speculative.png").stat().st_size > 0
  out = capsys.readouterr().out
  assert "ngram k=2" in out and "speed-up" in out and "ERROR" not in out
  assert "serving engine" not in out
  # The serving engine's rows: both prompts in one batch, k = 4, greedy ones with the tokens of
  # their baseline.
  assert bench_speculative.main(SPECULATIVE_SMOKE + ["--out", str(tmp_path / "engine"),
                                                     "--temperature", "0"]) == 0
  saved = _strict_load(tmp_path / "engine" / "results.json")
  assert [r["name"] for r in saved["rows"]] == list(rows)[:5]
  engine = {r["name"]: r for r in saved["engine_rows"]}
  assert list(engine) == ["engine (no draft)", "engine ngram k=4", "engine draft k=4",
                          "engine (MTP model)", "engine mtp k=4"]
  assert engine["engine mtp k=4"]["baseline"] == "engine (MTP model)"
  assert engine["engine draft k=4"]["baseline"] == "engine (no draft)"
  for name, r in engine.items():
    assert r["tokens_per_s"] > 0 and r["speedup"] > 0, name
    assert r["mismatched_prompts"] == 0, name
    assert r["generated"] == 2 * 10 and r["steps"] >= 10 / 5, name
    assert 1 <= r["tokens_per_step"] <= 5, name
    if r["draft"] is None:
      assert r["speedup"] == 1.0 and r["acceptance_rate"] is None, name
      assert r["drafted"] == 0 and r["tokens_per_step"] == 1.0 and r["steps"] == 10, name
    else:
      assert r["k"] == 4 and r["drafted"] > 0 and 0 <= r["acceptance_rate"] <= 1, name
      assert r["accepted"] <= r["drafted"], name
  out = capsys.readouterr().out
  assert "serving engine: all 2 prompts in one batch, greedy" in out and "engine mtp k=4" in out
  # sampled engine rows (no prompt lookup), each against the sampled engine of its model
  sampled = bench_speculative.make_engine_rows(4, 0.8)[5:]
  assert [(r["name"], r["baseline"], r["temperature"]) for r in sampled] == [
      ("engine (no draft) T=0.8", "engine (no draft) T=0.8", 0.8),
      ("engine draft k=4 T=0.8", "engine (no draft) T=0.8", 0.8),
      ("engine (MTP model) T=0.8", "engine (MTP model) T=0.8", 0.8),
      ("engine mtp k=4 T=0.8", "engine (MTP model) T=0.8", 0.8)]


def test_bench_speculative_reports_a_greedy_mismatch(tmp_path, capsys, monkeypatch):
  """A greedy row whose tokens differ from generate's: reported, and the exit status is 1."""
  from experiments import bench_speculative
  real = bench_speculative.speculative_generate

  def wrong(*args, **kwargs):
    out, stats = real(*args, **kwargs)
    out = out.copy()
    out[:, -1] = (out[:, -1] + 1) % 259
    return out, stats

  monkeypatch.setattr(bench_speculative, "speculative_generate", wrong)
  assert bench_speculative.main(SPECULATIVE_SMOKE + ["--temperature", "0", "--no-engine",
                                                     "--out", str(tmp_path / "bad")]) == 1
  saved = _strict_load(tmp_path / "bad" / "results.json")
  assert saved["greedy_mismatches"] == {"ngram k=2": 2, "draft k=2": 2, "mtp k=2": 2}
  assert saved["engine_rows"] == []
  out = capsys.readouterr().out
  assert "NO 2/2" in out and "ERROR: greedy speculative output differs" in out


def test_bench_speculative_reads_the_last_evaluation(tmp_path):
  """The header's held-out figures: the last record of a run's metrics.jsonl that has
  ``eval_loss`` (training records between them skipped); nothing when there is no file."""
  from experiments.bench_speculative import last_eval
  (tmp_path / "metrics.jsonl").write_text("\n".join([
      '{"step": 1, "loss": 3.0}', '{"step": 2, "eval_loss": 2.5}',
      '{"step": 3, "eval_loss": 2.25, "eval_mtp_accuracy": [0.5, 0.25]}',
      '{"step": 3, "loss": 2.0}']))
  assert last_eval(tmp_path) == {"step": 3, "eval_loss": 2.25, "eval_mtp_accuracy": [0.5, 0.25]}
  assert last_eval(tmp_path / "none") == {}
