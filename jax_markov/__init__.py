"""jax-markov: DSpark's sequential Markov sampling as JAX Pallas kernels.

Public API::

    import jax_markov as jm
    head = jm.MarkovHead(embed, proj)
    draft = jm.sample_draft(base_logits, anchor_tokens, head, temperature,
                            seeds, positions)
    tokens, cache = jm.sample_draft_into(cache, base_logits, anchor_tokens,
                                         head, temperature, seeds, idx_map,
                                         positions)
    tokens = jm.greedy_draft(base_logits, anchor_tokens, head)  # no cache
    u = jm.draft_uniforms(seeds, positions)
    jm.reference  # the same sampler in plain jnp: the executable spec
    jm.sample_draft_sharded(..., mesh=mesh, axis="vocab")  # V over devices
    jm.sample_draft_into_sharded(cache, ..., mesh=mesh)  # the same, in place
"""

from jax_markov import reference, rng
from jax_markov.head import Draft, MarkovHead
from jax_markov.kernels.config import KernelConfig
from jax_markov.rng import draft_uniforms
from jax_markov.sampler import greedy_draft, sample_draft, sample_draft_into
from jax_markov.sharded import sample_draft_into_sharded, sample_draft_sharded

__all__ = [
    "Draft", "KernelConfig", "MarkovHead", "draft_uniforms", "greedy_draft",
    "reference", "rng",
    "sample_draft", "sample_draft_into", "sample_draft_sharded",
    "sample_draft_into_sharded",
]
__version__ = "0.1.0"
