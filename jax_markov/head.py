"""The two pytrees of the public API: the Markov head's weights and a draft."""

from __future__ import annotations

from typing import NamedTuple

import jax


class MarkovHead(NamedTuple):
  """The DSpark Markov head: ``bias = proj @ embed[prev]``.

  Attributes:
    embed: [V_in, R] ("markov_w1"), the embedding of the previous token.
      V_in >= V, since every drawn token is looked up in it at the next step.
    proj: [V, R] ("markov_w2"), the projection to vocabulary logits.
  Both in bf16, fp16 or fp32 (the same dtype); the bias is accumulated in
  float32 and never rounded to that dtype.
  """
  embed: jax.Array
  proj: jax.Array

  @property
  def rank(self) -> int:
    return self.proj.shape[1]

  @property
  def vocab_size(self) -> int:
    return self.proj.shape[0]


class Draft(NamedTuple):
  """A drafted block.

  Attributes:
    tokens: int32 [B, S], the drawn tokens.
    logits: float32 [B, S, V], the pre-temperature logits ``base + bias`` that
      each token was drawn from (what the verifier's rejection sampler reads).
  """
  tokens: jax.Array
  logits: jax.Array
