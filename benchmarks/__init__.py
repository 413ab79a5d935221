"""Benchmarks of the S-step Markov sampling: jax_markov against its baselines.

Run ``python -m jax_markov bench`` (or ``python -m benchmarks.run``); see
:mod:`benchmarks.run` for the options and docs/benchmarks.md for the results.
"""
