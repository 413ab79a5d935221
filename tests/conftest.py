"""Shared test set-up: the gpu marker, and the sys.path for the helpers module."""

import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.dirname(__file__))

ON_GPU = jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU (compiled Triton kernels)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
