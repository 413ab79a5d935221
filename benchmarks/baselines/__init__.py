"""Baselines the sampler is timed against.

* :mod:`benchmarks.baselines.seed_design`: vLLM's FusedMarkovSampler as it is
  (nn.Linear bias in bf16, then a Triton block kernel and a Triton select
  kernel a step), eager or in a CUDA graph. ``seed_design_graph`` is the
  baseline every speed claim is made against.
* :mod:`benchmarks.baselines.f32_bias_design`: a float32-bias variant (bias
  GEMM into a float32 [B, V] buffer in HBM, then Triton block and select
  passes), eager or in a CUDA graph; formerly ``reference_triton``.
* :mod:`benchmarks.baselines.vllm_loop`: vLLM's unfused PyTorch loop
  (embedding, linear, add, Gumbel-max draw), eager or in a CUDA graph.
* :mod:`benchmarks.baselines.plain_jax`: jnp ops and jax.random.categorical
  inside lax.scan under one jit.

The torch modules never import JAX and the JAX module never imports torch, so
each family can run in its own process. Nothing here is imported by
``import benchmarks``; the Triton modules are imported only where triton is.
"""
