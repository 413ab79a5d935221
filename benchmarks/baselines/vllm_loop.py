"""vLLM's unfused Markov loop in PyTorch: eager, or captured in a CUDA graph.

Per step: ``emb = embedding(prev)``, ``bias = linear(emb, proj)`` (in the
weights' dtype, as nn.Linear computes it), ``logits = base[:, s].float() +
bias.float()``, the logits written to the float32 cache, then a Gumbel-max
draw ``argmax(logits / T - log(-log(u)))`` with u from ``torch.rand`` (the
argmax of the logits at temperature 0), and ``prev`` becomes the token.

Every op is a separate kernel with its own round trip through memory; that is
the point of this baseline. All tensors it writes outside the loop (cache,
tokens) are allocated once, so a CUDA graph can replay it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class VllmLoopSampler:
  """The unfused loop bound to fixed input and output buffers.

  Args:
    embed: [V_in, R] Markov embedding ("markov_w1"), bf16/fp16/fp32.
    proj: [V, R] Markov projection ("markov_w2"), same dtype.
    base: [B, S, V] base logits, same dtype.
    anchors: int [B] anchor tokens.
    temperature: float32 [B], all > 0 unless ``greedy``.
    greedy: True draws the argmax at every step (temperature 0). One flag for
      the whole batch: a captured graph cannot branch per call.

  Attributes:
    cache: float32 [B, S, V], the pre-temperature logits of each step.
    tokens: int64 [B, S], the drawn tokens.
  """

  def __init__(self, embed, proj, base, anchors, temperature, greedy: bool):
    B, S, V = base.shape
    self.embed, self.proj, self.base = embed, proj, base
    self.anchors = anchors.to(torch.int64)
    self.temperature = temperature.to(torch.float32).view(B, 1)
    self.greedy = greedy
    self.cache = torch.empty((B, S, V), dtype=torch.float32, device=base.device)
    self.tokens = torch.empty((B, S), dtype=torch.int64, device=base.device)
    self.graph = None

  def run_steps(self) -> None:
    """Runs all S steps, writing ``self.cache`` and ``self.tokens``."""
    prev = self.anchors
    for s in range(self.base.shape[1]):
      emb = F.embedding(prev, self.embed)
      bias = F.linear(emb, self.proj)
      logits = self.base[:, s].float() + bias.float()
      self.cache[:, s] = logits
      if self.greedy:
        tok = torch.argmax(logits, dim=-1)
      else:
        u = torch.rand_like(logits)
        gumbel = -torch.log(-torch.log(u))
        tok = torch.argmax(logits / self.temperature + gumbel, dim=-1)
      self.tokens[:, s] = tok
      prev = tok

  def capture(self, warmup: int = 2) -> "torch.cuda.CUDAGraph":
    """Captures :meth:`run_steps` in a CUDA graph; replay with ``.replay()``."""
    self.graph = capture_graph(self.run_steps, warmup)
    return self.graph


def capture_graph(fn, warmup: int = 2) -> "torch.cuda.CUDAGraph":
  """Warms ``fn`` up on a side stream, then captures it in a CUDA graph."""
  stream = torch.cuda.Stream()
  stream.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(stream):
    for _ in range(warmup):
      fn()
  torch.cuda.current_stream().wait_stream(stream)
  torch.cuda.synchronize()
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    fn()
  torch.cuda.synchronize()
  return graph
