"""Shared test setup: an 8-device simulated CPU mesh (must be configured before JAX initializes)."""

import os

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
