"""vLLM's unfused Markov loop in PyTorch: eager, or captured in a CUDA graph.

Per step: ``emb = embedding(prev)``, ``bias = linear(emb, proj)`` (in the
weights' dtype, as nn.Linear computes it), ``logits = base[:, s].float() +
bias.float()``, the logits written to the float32 cache, then a Gumbel-max
draw ``argmax(logits / T - log(-log(u)))`` with u from ``torch.rand`` (the
argmax of the logits at temperature 0), and ``prev`` becomes the token.

With a reduced draft vocabulary (``targets``, vLLM's d2t mode, where vLLM
runs this unfused loop: its fused sampler declines the mode) base and proj
are over the Vd draft ids and embed over the target ids: the step's Vd
logits go to their target columns of the cache row, every other column of
which is set to -inf (``fill_`` + ``index_copy_``), the draw is over the Vd
draft logits (the -inf columns can never win, so the same draw) and the
token is mapped to its target id (``targets[j]``) before it indexes embed.

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
    targets: None, or int [Vd]: a reduced draft vocabulary (base [B, S, Vd],
      proj [Vd, R]), draft id j being target id targets[j] (increasing).
    target_vocab: the cache's width V with ``targets`` (default: embed's
      rows).

  Attributes:
    cache: float32 [B, S, V], the pre-temperature logits of each step.
    tokens: int64 [B, S], the drawn tokens (target ids).
  """

  def __init__(self, embed, proj, base, anchors, temperature, greedy: bool,
               targets=None, target_vocab=None):
    B, S, V = base.shape
    self.targets = None
    if targets is not None:
      self.targets = torch.as_tensor(targets, device=base.device).to(
          torch.int64)
      V = embed.shape[0] if target_vocab is None else target_vocab
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
      if self.targets is None:
        self.cache[:, s] = logits
      else:
        row = self.cache[:, s]
        row.fill_(-torch.inf)
        row.index_copy_(1, self.targets, logits)
      if self.greedy:
        tok = torch.argmax(logits, dim=-1)
      else:
        u = torch.rand_like(logits)
        gumbel = -torch.log(-torch.log(u))
        tok = torch.argmax(logits / self.temperature + gumbel, dim=-1)
      if self.targets is not None:
        tok = self.targets[tok]
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
