"""Examples of jax_markov, run from a source checkout (not part of the wheel).

* :mod:`examples.demo`: draft text with a Markov head and verify it against a
  target model (``python -m jax_markov demo``, the README's main job).
* :mod:`examples.corpus`: the demo's text and character vocabulary.
"""
