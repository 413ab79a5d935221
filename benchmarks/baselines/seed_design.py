"""The seed design: vLLM's FusedMarkovSampler as it is, in torch + Triton.

This is the baseline every speed claim is made against (``seed_design_graph``).
Per step s, with every scratch buffer allocated once at construction (fixed
addresses, so the S-step draft can be captured in a CUDA graph):

1. bias: ``bias = model.markov_bias(markov_embed)``, a torch ``nn.Linear`` in
   the weights' dtype: ``embed[prev] @ proj.T`` with a bf16 (the weights'
   dtype) [B, V] output, one cuBLAS GEMM (``F.linear``, a new tensor each
   step as the module returns it);
2. block kernel (Triton), grid ``(num_reqs, cdiv(V, 1024))``, 1024-wide
   vocabulary blocks, ``num_warps=2``: reads a block of the base logits and
   of the bf16 bias, writes the pre-temperature float32 logits ``x = base +
   bias`` into the cache [B, S, V] at step s, and per block the max and the
   sum of exp of ``y = x / T`` (x at T = 0);
3. select kernel (Triton), grid ``(num_reqs,)``: over the next_pow2(#blocks)
   partial entries, picks the block by inverse CDF with the request's
   uniform (at T = 0: the first block holding the row maximum), re-reads that
   block's logits from the cache and finds the token inside it (one exp per
   logit of the chosen block; the lowest index of the maximum at T = 0),
   writes the token, and copies the token's embedding row into the [B, R]
   ``markov_embed`` buffer the next step's GEMM reads.

So a step is three launches (GEMM, block, select) plus, once per draft, the
anchors' embedding gather: 3 * S + 1 launches a draft.

The uniforms are an input tensor [B, S] computed before timing (the benchmark
passes jax_markov's, from the RNG contract, so the tokens can be checked; no
JAX runs in the timed loop). NaN logits count as -inf and a -inf logit is
never drawn, as in jax_markov's rule; the float32 sums are two-level (blocks,
then the lanes of one block), so a draw at a CDF boundary may differ from a
flat cumulative sum.

Differences from :mod:`benchmarks.baselines.f32_bias_design`: the bias here
is the nn.Linear's bf16 output (half the bytes, rounded to bf16), the blocks
are fixed at 1024 with 2 warps, and the block kernel keeps no per-block
argmax (the select kernel finds it in the chosen block).

Importing this module needs torch only; without triton the kernels are not
defined and :class:`SeedDesignSampler` raises ImportError when constructed
(:mod:`benchmarks.run` skips the rows with a notice).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
  import triton
  import triton.language as tl
  TRITON_ERROR = None
except ImportError as _e:  # CPU machines without triton: import still works
  triton = tl = None
  TRITON_ERROR = f"{type(_e).__name__}: {_e}"

BLOCK = 1024
NUM_WARPS = 2


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _next_pow2(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


if triton is not None:

  @triton.jit
  def _seed_block_kernel(base_ptr, bias_ptr, cache_ptr, temp_ptr, bmax_ptr,
                         bsum_ptr, step, S, V, NB, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    row = (b.to(tl.int64) * S + step) * V
    x = tl.load(base_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(bias_ptr + b.to(tl.int64) * V + offs, mask=mask,
                 other=0.0).to(tl.float32)
    tl.store(cache_ptr + row + offs, x, mask=mask)
    t = tl.load(temp_ptr + b)
    greedy = t == 0.0
    scale = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
    y = x * scale
    # NaN and the lanes past V count as -inf.
    y = tl.where(mask & (y == y), y, float("-inf"))
    m = tl.max(y, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    ssum = tl.sum(tl.exp(y - m_safe), axis=0)
    tl.store(bmax_ptr + b * NB + j, m)
    tl.store(bsum_ptr + b * NB + j, ssum)


  @triton.jit
  def _seed_select_kernel(bmax_ptr, bsum_ptr, cache_ptr, temp_ptr, u_ptr,
                          tokens_ptr, embed_ptr, emb_ptr, step, S, V, NB, R,
                          NB_POW2: tl.constexpr, BLOCK: tl.constexpr,
                          R_POW2: tl.constexpr):
    b = tl.program_id(0)
    jb = tl.arange(0, NB_POW2)
    jmask = jb < NB
    bm = tl.load(bmax_ptr + b * NB + jb, mask=jmask, other=float("-inf"))
    bs = tl.load(bsum_ptr + b * NB + jb, mask=jmask, other=0.0)
    M = tl.max(bm, axis=0)
    t = tl.load(temp_ptr + b)
    greedy = t == 0.0
    not_finite = (M == float("-inf")) | (M == float("inf"))
    argmax_mode = greedy | not_finite

    # Inverse CDF over blocks: w_j = sum_{i in j} exp(y_i - M).
    M_safe = tl.where(not_finite, 0.0, M)
    w = tl.where(jmask & (bs > 0), bs * tl.exp(bm - M_safe), 0.0)
    cw = tl.cumsum(w, axis=0)
    Z = tl.sum(w, axis=0)
    u = tl.load(u_ptr + b * S + step)
    target = u * Z
    blk = tl.sum((cw <= target).to(tl.int32), axis=0)
    # Rounding may put target at or past the last partial sum: clamp to the
    # last block with mass, so a -inf logit is never drawn.
    blk = tl.minimum(blk, tl.max(tl.where(w > 0, jb, 0), axis=0))
    before = tl.sum(tl.where(jb < blk, w, 0.0), axis=0)
    # Argmax: the first block that attains M (block 0 if the row has none).
    first_blk = tl.min(tl.where(bm == M, jb, NB_POW2), axis=0)
    first_blk = tl.where(first_blk < NB, first_blk, 0)
    blk = tl.where(argmax_mode, first_blk, blk)

    # Inside the chosen block, from the logits the block kernel cached.
    scale = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
    lanes = tl.arange(0, BLOCK)
    offs = blk * BLOCK + lanes
    vmask = offs < V
    row = (b.to(tl.int64) * S + step) * V
    y = tl.load(cache_ptr + row + offs, mask=vmask, other=0.0) * scale
    y = tl.where(vmask & (y == y), y, float("-inf"))
    # Argmax: the lowest lane holding the block's maximum (lane 0 if none).
    ymax = tl.max(y, axis=0)
    arg = tl.min(tl.where(y == ymax, lanes, BLOCK), axis=0)
    arg = tl.where(arg < BLOCK, arg, 0)
    # Draw: one exp per logit of the block.
    p = tl.exp(y - M_safe)
    cp = tl.cumsum(p, axis=0) + before
    i = tl.sum((cp <= target).to(tl.int32), axis=0)
    i = tl.minimum(i, tl.max(tl.where(p > 0, lanes, 0), axis=0))
    tok = blk * BLOCK + tl.where(argmax_mode, arg, i)
    tl.store(tokens_ptr + b * S + step, tok)
    # The next step's markov_embed row.
    r = tl.arange(0, R_POW2)
    rmask = r < R
    e = tl.load(embed_ptr + tok.to(tl.int64) * R + r, mask=rmask)
    tl.store(emb_ptr + b * R + r, e, mask=rmask)


class SeedDesignSampler:
  """The seed design bound to fixed input, output and scratch buffers.

  Args:
    embed: [V_in, R] Markov embedding ("markov_w1"), bf16/fp16/fp32.
    proj: [V, R] Markov projection ("markov_w2", the nn.Linear's weight),
      same dtype.
    base: [B, S, V] base logits, same dtype.
    anchors: int [B] anchor tokens.
    temperature: float32 [B], >= 0 (0 = argmax), per request.
    uniforms: float32 [B, S] in [0, 1), the uniform of each draw (computed
      before timing).

  Attributes:
    cache: float32 [B, S, V], the pre-temperature logits of each step.
    tokens: int32 [B, S], the drawn tokens.
    bias: [B, V] in the weights' dtype, the last step's nn.Linear output
      (None before the first run).
    launches_per_draft: GEMM + block + select a step, plus the anchor gather.
  """

  block = BLOCK
  num_warps = NUM_WARPS

  def __init__(self, embed, proj, base, anchors, temperature, uniforms):
    if TRITON_ERROR is not None:
      raise ImportError(f"the seed design needs triton ({TRITON_ERROR})")
    B, S, V = base.shape
    R = proj.shape[1]
    dev = base.device
    assert embed.shape[1] == R and proj.shape[0] == V
    assert embed.dtype == proj.dtype, (embed.dtype, proj.dtype)
    self.B, self.S, self.V, self.R = B, S, V, R
    self.embed = embed.contiguous()
    self.proj = proj.contiguous()
    self.base = base.contiguous()
    self.anchors = anchors.to(torch.int64)
    self.temperature = temperature.to(torch.float32).contiguous()
    self.uniforms = uniforms.to(torch.float32).contiguous()
    self.nb = _cdiv(V, BLOCK)
    self.nb_pow2 = _next_pow2(self.nb)
    self.r_pow2 = _next_pow2(R)
    # Scratch, allocated once (CUDA graphs keep these addresses).
    self.cache = torch.empty((B, S, V), dtype=torch.float32, device=dev)
    self.tokens = torch.empty((B, S), dtype=torch.int32, device=dev)
    self.markov_embed = torch.empty((B, R), dtype=embed.dtype, device=dev)
    self.bias = None  # markov_bias's output, a new tensor each step
    self.bmax = torch.empty((B, self.nb), dtype=torch.float32, device=dev)
    self.bsum = torch.empty((B, self.nb), dtype=torch.float32, device=dev)
    self.launches_per_draft = 3 * S + 1
    self.graph = None

  def markov_bias(self) -> torch.Tensor:
    """``model.markov_bias(markov_embed)``: what nn.Linear(R, V, bias=False)
    computes, a fresh [B, V] tensor in the weights' dtype (from torch's
    caching allocator; inside a CUDA graph, from the graph's pool)."""
    return F.linear(self.markov_embed, self.proj)

  def run_steps(self) -> None:
    """Runs all S steps, writing ``self.cache`` and ``self.tokens``."""
    torch.index_select(self.embed, 0, self.anchors, out=self.markov_embed)
    B = self.B
    for s in range(self.S):
      self.bias = self.markov_bias()
      _seed_block_kernel[(B, self.nb)](
          self.base, self.bias, self.cache, self.temperature, self.bmax,
          self.bsum, s, self.S, self.V, self.nb, BLOCK=BLOCK,
          num_warps=NUM_WARPS)
      _seed_select_kernel[(B,)](
          self.bmax, self.bsum, self.cache, self.temperature, self.uniforms,
          self.tokens, self.embed, self.markov_embed, s, self.S, self.V,
          self.nb, self.R, NB_POW2=self.nb_pow2, BLOCK=BLOCK,
          R_POW2=self.r_pow2, num_warps=NUM_WARPS)

  def capture(self, warmup: int = 2) -> "torch.cuda.CUDAGraph":
    """Captures :meth:`run_steps` in a CUDA graph (after ``warmup`` eager
    runs on a side stream); replay with ``.replay()``."""
    from benchmarks.baselines.vllm_loop import capture_graph
    self.graph = capture_graph(self.run_steps, warmup)
    return self.graph
