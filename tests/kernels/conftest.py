"""Fixtures shared by the kernel tests."""

import pytest


@pytest.fixture
def race_states(monkeypatch):
  """Records every race-detection state the TPU interpreter creates (one per kernel launch), so a
  test can assert that ``InterpretParams(detect_races=True)`` found no race in any of them."""
  try:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc  # noqa: PLC0415
  except ImportError:  # pragma: no cover - moved in another jax release
    pytest.skip("TPU interpret-mode race state not found in this jax release")
  states = []

  class Recording(ipc.RaceDetectionState):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      states.append(self)

  monkeypatch.setattr(ipc, "RaceDetectionState", Recording)
  return states


@pytest.fixture
def triton_kernels():
  """The GPU entry point on its Triton kernels for the test (on an sm_90 GPU the default sends
  bf16 band-mask calls to the Hopper kernels, which test_flash_hopper.py tests); the options are
  restored afterwards."""
  from pallas_kernels.flash_attention import gpu as gpu_kernel  # noqa: PLC0415

  saved = gpu_kernel.get_options()
  gpu_kernel.set_options(forward="triton", backward="triton")
  yield
  gpu_kernel.set_options(**saved)


@pytest.fixture
def cuda_target(monkeypatch):
  """Lowering the Triton kernels for CUDA on a machine without a GPU.  From jax 0.11 the Triton
  lowering reads the target GPU from the local device (or an abstract mesh's); where there is no
  GPU, this names an H200 (sm_90), the target the lowering tests are written for.  On a GPU, and
  on jax releases that lower without device information, it changes nothing."""
  import jax  # noqa: PLC0415

  try:
    from jax._src.pallas.triton import gpu_info  # noqa: PLC0415
  except ImportError:
    return
  if jax.default_backend() == "gpu" or not hasattr(gpu_info, "get_gpu_info_from_version"):
    return
  h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: h200)


@pytest.fixture
def tpu_target():
  """Lowering the TPU kernels to Mosaic on a machine without a TPU: registers a TPU v5e (one
  core) as this device's chip description for the duration of the test, and removes it (and any
  cached lookup) afterwards."""
  import jax  # noqa: PLC0415

  try:
    from jax._src.pallas.mosaic import tpu_info  # noqa: PLC0415
    info = tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)
  except (ImportError, AttributeError, TypeError):  # pragma: no cover - other jax releases
    pytest.skip("no TPU chip description to lower against in this jax release")
  kind = jax.devices()[0].device_kind
  tpu_info.registry[kind] = lambda: info
  yield info
  tpu_info.registry.pop(kind, None)
  getattr(tpu_info.get_tpu_info, "cache_clear", lambda: None)()
