"""Baselines the sampler is timed against.

* :mod:`benchmarks.baselines.reference_triton`: the reference design (bias GEMM
  plus a Triton block pass and select pass a step), eager or in a CUDA graph.
* :mod:`benchmarks.baselines.vllm_loop`: vLLM's unfused PyTorch loop
  (embedding, linear, add, Gumbel-max draw), eager or in a CUDA graph.
* :mod:`benchmarks.baselines.plain_jax`: jnp ops and jax.random.categorical
  inside lax.scan under one jit.

The torch modules never import JAX and the JAX module never imports torch, so
each family can run in its own process.
"""
