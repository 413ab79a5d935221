"""Benchmarks of the S-step Markov sampling: jax_markov against its baselines.

Run ``python -m benchmarks`` from the repository root (benchmarks/ is not part
of the wheel); see :mod:`benchmarks.run` for the options and docs/benchmarks.md
for the results.
"""
