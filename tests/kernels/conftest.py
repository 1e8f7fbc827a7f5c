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
