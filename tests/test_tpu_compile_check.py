"""``experiments.tpu_compile_check``: the HLO copy scan and the command line.  The compile itself
needs libtpu (``pip install -e ".[tpu-compile]"``): it runs in a subprocess when libtpu is
installed, so that the TPU plugin's environment stays out of this process."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from experiments import tpu_compile_check as tcc


def test_big_copies_sizes_copies_and_transposes():
  hlo = "\n".join([
      "  %copy.20 = bf16[32768,1,64]{2,1,0:T(2,128)(2,1)} copy(%bitcast.16), metadata={}",
      "  %copy.2 = s32[8,1]{1,0:T(8,128)} copy(%p)",                          # small: ignored
      "  %transpose.6 = f32[2,1024,256]{2,1,0} transpose(%x), dimensions={0,1,2}",
      "  %copy-start = (bf16[1,8,128,512]{3,2,1,0}, u32[]) copy-start(%ql.1)",  # tuple: ignored
      "  %add.1 = f32[4096,4096]{1,0} add(%a, %b)",                             # not a copy
  ])
  assert tcc.big_copies(hlo) == ["bf16[32768,1,64] (4 MiB)", "f32[2,1024,256] (2 MiB)"]


def test_case_names_with_commas_are_picked_whole():
  known = ["paged GQA decode", "paged GQA decode, int8 cache", "paged GQA decode, int8 cache, "
           "pages of 16", "flash forward"]
  got = tcc.pick_names("paged GQA decode, int8 cache,flash forward, paged GQA decode", known,
                       "--only")
  assert got == {"paged GQA decode, int8 cache", "flash forward", "paged GQA decode"}
  assert tcc.pick_names("paged GQA decode, int8 cache, pages of 16", known, "--only") == {
      "paged GQA decode, int8 cache, pages of 16"}
  assert tcc.pick_names("", known, "--skip") == set()
  with pytest.raises(SystemExit, match="--skip: unknown case 'flash backward'"):
    tcc.pick_names("flash forward,flash backward", known, "--skip")


def test_unknown_chip_is_refused():
  with pytest.raises(SystemExit, match="--chips"):
    tcc.main(["--chips", "v5e,v9"])


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="needs libtpu: pip install -e '.[tpu-compile]'")
def test_kernels_compile_for_tpu_v5e(tmp_path):
  """Every TPU kernel, one chip and sharded over a 2x2 slice, through the real TPU compiler."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.tpu_compile_check", "--chips", "v5e",
       # (the context-parallel cases add a minute of compiling: run by hand, see the script)
       "--skip", "context all_gather fwd + bwd (2x2 mesh),context ring fwd + bwd (2x2 mesh)",
       "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  assert "32 of 32 compiled" in proc.stdout
  # Decode is bandwidth-bound: the dense decode kernels must read the caches as stored, with no
  # relayout copy of a pool or cache around them (paged and contiguous, GQA / MQA / MLA).
  results = json.loads((tmp_path / "results.json").read_text())
  decode = [r for r in results if "decode" in r["case"] and "sparse" not in r["case"]]
  assert len(decode) == 17 and all(r["copies"] == [] for r in decode), decode
  # A quantized cache (int8 / fp8 codes and their scales) is read in place at ~half the bytes.
  by_case = {r["case"]: r for r in results}
  bf16_bytes = by_case["paged GQA decode"]["argument_bytes"]
  for name in ("paged GQA decode, int8 cache", "paged GQA decode, fp8 cache"):
    assert by_case[name]["argument_bytes"] < 0.55 * bf16_bytes, by_case[name]
  # MLA: c_KV in one byte, k^R (padded to 128 columns) in bf16: (512 + 4 + 256) / 1280 = 60%.
  mla_bytes = by_case["paged MLA decode"]["argument_bytes"]
  assert by_case["paged MLA decode, int8 cache"]["argument_bytes"] < 0.62 * mla_bytes
  # A 512-token prefill through the paged caches runs in the kernels too (query rows in blocks
  # that fit VMEM); the only copies are of the queries ([2, 512, ...]), none of a pool.
  prefill = [r for r in results if "paged" in r["case"] and "prefill" in r["case"]]
  assert len(prefill) == 2, prefill
  assert all(c.startswith("bf16[2,512,") for r in prefill for c in r["copies"]), prefill
  # The grouped-matmul kernels read gpt-oss's MXFP4 codes as stored: no copy of a codes array
  # (u8[E, N, code_width(K)], row-major by default; the scales, 1/16 of their bytes, are
  # converted to bf16 once per call).
  (mxfp4,) = [r for r in results if r["case"] == "MoE experts: MXFP4 kernels (gpt-oss)"]
  assert not [c for c in mxfp4["copies"] if c.startswith("u8[32,2880,1536]")], mxfp4
  # ... in less than half the temporaries of dequantizing every expert whole for ragged_dot
  (whole,) = [r for r in results if r["case"] == "MoE experts: MXFP4 dequantized + ragged_dot"]
  assert 2 * mxfp4["temp_bytes"] < whole["temp_bytes"], (mxfp4, whole)
