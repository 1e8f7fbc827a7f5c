"""Shared test setup: an 8-device simulated CPU mesh (must be configured before JAX initializes)."""

import os

os.environ.setdefault("XLA_FLAGS", "")


def _gpu_plugin_installed() -> bool:
  """A CUDA / ROCm plugin of JAX is installed (found without importing JAX)."""
  import importlib.util  # noqa: PLC0415
  import pkgutil  # noqa: PLC0415
  spec = importlib.util.find_spec("jax_plugins")
  if spec is None or not spec.submodule_search_locations:
    return False
  return any("cuda" in m.name or "rocm" in m.name
             for m in pkgutil.iter_modules(spec.submodule_search_locations))


# The suite's programs are small and compiled once each: compilation, not execution, dominates its
# time on CPU.  Skipping LLVM's optimizations (XLA's own HLO passes still run, so every program
# computes the same operations) about halves it.  Set the flag in XLA_FLAGS to choose another level.
# Only where the tests run on the CPU: the flag reaches XLA's GPU backend too.  On an H200 (jax
# 0.11.2) the Triton flash kernel's padded / zero-length case gave wrong dK under it (O(1) errors,
# every run), while the same case run as a script at the default level matched the formula to
# 5e-4 (TF32) in every variant tried.
_CPU_ONLY = os.environ.get("JAX_PLATFORMS", "").strip() == "cpu" or not _gpu_plugin_installed()
if _CPU_ONLY and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# XLA's CPU fusion emitters (MLIR) compile each program two to three times slower than its
# element-wise emitters; a test program runs for microseconds, so the older emitters cut the
# suite's time by about 40%.  XLA aborts on a flag it does not know, so the flag is tried once in
# a child process first (the answer is passed on to pytest-xdist's workers in the environment).
_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_knows(flag: str) -> bool:
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415
  env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
  probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                         capture_output=True, timeout=120)
  return probe.returncode == 0


if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
  _known = os.environ.get("JAXATTN_TEST_FUSION_EMITTERS_FLAG")
  if _known is None:
    _known = "1" if _xla_knows(_EMITTERS) else "0"
    os.environ["JAXATTN_TEST_FUSION_EMITTERS_FLAG"] = _known
  if _known == "1":
    os.environ["XLA_FLAGS"] += " " + _EMITTERS
# The CPU client runs asynchronous executions on a pool sized by the core count (2 in CI).
# Mosaic GPU's interpreter runs each warpgroup of a kernel as its own execution, blocked on
# simulated barriers until the others arrive: with the interpreted kernel's own execution holding
# one pool thread and a waiting warpgroup the other, a third warpgroup never gets a thread and the
# kernel deadlocks.  A larger pool (threads mostly asleep) gives every warpgroup one.
os.environ.setdefault("PJRT_NPROC", str(max(16, os.cpu_count() or 1)))
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import gc  # noqa: E402

import pytest  # noqa: E402

# Each compiled CPU program keeps a few memory mappings (its JIT-compiled code) while JAX's caches
# hold it.  A test worker compiles thousands of programs over the suite; past the kernel's limit
# on mappings per process (vm.max_map_count, 65,530 by default) the next compilation cannot map
# its code and the worker dies with a segmentation fault.  Drop the caches between test modules
# once a worker holds many mappings (programs compiled again after that recompile, correctly),
# and between two tests of one module when a module that compiles many programs (the serving
# engine's) would otherwise take a worker past the limit before its end.
_MAPS = "/proc/self/maps"
_MAX_MAPPINGS = 40_000
_LAST_RESORT_MAPPINGS = 52_000


def _mappings() -> int:
  try:
    with open(_MAPS) as f:
      return f.read().count("\n")
  except OSError:                      # not Linux: no such limit to watch
    return 0


def _drop_compiled_programs():
  jax.clear_caches()
  gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _bounded_compiled_programs():
  yield
  if _mappings() > _MAX_MAPPINGS:
    _drop_compiled_programs()


@pytest.fixture(autouse=True)
def _below_the_mapping_limit():
  yield
  if _mappings() > _LAST_RESORT_MAPPINGS:
    _drop_compiled_programs()
