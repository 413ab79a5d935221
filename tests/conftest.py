"""Shared test set-up: the gpu marker.

Imports: pyproject.toml's pytest ``pythonpath`` puts the repository root
(``benchmarks``, ``examples``, this checkout's ``jax_markov``) and ``tests/``
(``helpers``, ``_sharded_worker``) on sys.path; nothing here edits it.
"""

import gc
import os

# Torch and JAX share the GPU in the bridge tests: no preallocation (see docs/torch_bridge.md).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"


# Mappings past which the compiled programs are dropped (the kernel's limit,
# vm.max_map_count, is 65530 by default).
_MAX_MAPPINGS = 20_000


def _mappings() -> int:
  """Memory mappings of this process (0 where /proc is not there)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs():
  """Drops JAX's compiled programs once the process maps too much memory.

  Every XLA:CPU executable keeps memory mappings of its own, and the suite
  compiles thousands of programs (each interpret-mode kernel configuration
  is one), none freed while JAX's caches hold them: the process's mappings
  grow ~100 a second. Kept for the whole run, the full suite crashed (a
  segfault inside an XLA:CPU compile at 94%, twice; never with the files
  run alone): most likely at the kernel's limit on mappings. Past
  _MAX_MAPPINGS after a test, the caches are cleared (the next tests
  compile again what they share).
  """
  yield
  if _mappings() > _MAX_MAPPINGS:
    jax.clear_caches()
    gc.collect()


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU (compiled Triton kernels)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
