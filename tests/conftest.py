"""Shared test set-up: the gpu marker.

Imports: pyproject.toml's pytest ``pythonpath`` puts the repository root
(``benchmarks``, ``examples``, this checkout's ``jax_markov``) and ``tests/``
(``helpers``, ``_sharded_worker``) on sys.path; nothing here edits it.
"""

import os

# Torch and JAX share the GPU in the bridge tests: no preallocation (see docs/torch_bridge.md).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU (compiled Triton kernels)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
