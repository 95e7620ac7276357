"""Test setup: 8 simulated CPU devices, so every sharding layout runs on one host."""

import os

# Must be set before jax initialises its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
