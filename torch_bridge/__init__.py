"""PyTorch bridge: jax_markov as the Markov-step hook of a torch serving engine.

:class:`FusedMarkovSampler` is vLLM's DSpark ``sampler(spec, num_reqs,
head_hidden) -> bool`` hook. The files, one job each:

* hook.py: the hook (modes, checks, runtime choice);
* native_runtime.py, native_plan.py, native.py: the native runtime (Pallas
  kernels lowered to Triton IR, compiled by triton, launched on torch's
  stream; capturable);
* jax_runtime.py, dlpack.py: the JAX runtime over DLPack;
* checks.py: what each spec buffer must be (BridgeInputError);
* buckets.py: the batch sizes compiled for;
* testing.py: a vLLM-shaped speculator double and plain-torch references.

See docs/torch_bridge.md.
"""

# First: sets XLA_PYTHON_CLIENT_PREALLOCATE before anything starts JAX's GPU.
from torch_bridge.jax_runtime import check_preallocation, trace_count
from torch_bridge.checks import BridgeInputError
from torch_bridge.hook import FusedMarkovSampler

__all__ = ["BridgeInputError", "FusedMarkovSampler", "check_preallocation",
           "trace_count"]
