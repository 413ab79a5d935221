"""The float32-bias design in PyTorch + Triton (formerly ``reference_triton``).

Not vLLM's sampler as it is (that is :mod:`benchmarks.baselines.seed_design`):
this design computes the bias in float32 and round-trips a float32 [B, V]
bias through HBM every step (written by the GEMM, read by the block pass),
twice the bytes of the seed design's bf16 bias, and picks its vocabulary
block per batch. Rows ``f32_bias_design`` and ``f32_bias_design_graph``.

Per step s, with every buffer allocated once (fixed addresses, so the whole
S-step draft can be captured in a CUDA graph):

1. bias GEMM: ``bias = emb @ proj.T`` into a float32 [B, V] buffer (cuBLAS,
   bf16 inputs, float32 output);
2. block pass, a Triton kernel on grid (B, num_blocks): reads a block of the
   base logits and of the bias, writes the float32 logits ``x = base + bias``
   into the cache [B, S, V] at step s, and keeps per block the max m of
   ``y = x / T`` (x at T == 0), the sum of exp(y - m), and the lowest index
   of the maximum;
3. select pass, a Triton kernel on grid (B,): combines the block stats; at
   T == 0 (or a non-finite max) takes the lowest index of the row maximum,
   otherwise draws by inverse CDF with the uniform u[b, s]: finds the block
   where u * Z falls, then the token inside it by a cumulative sum over that
   block's logits re-read from the cache; writes the token and copies the
   token's embedding row into the [B, R] buffer the next step's GEMM reads.

The draw rule is jax_markov's (NaN counts as -inf, -inf never drawn); only
float32 rounding in the two-level cumulative sum differs from the flat one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_pass_kernel(base_ptr, bias_ptr, cache_ptr, temp_ptr, bmax_ptr,
                       bsum_ptr, barg_ptr, step, S, V, NB,
                       BLOCK: tl.constexpr):
  b = tl.program_id(0)
  j = tl.program_id(1)
  offs = j * BLOCK + tl.arange(0, BLOCK)
  mask = offs < V
  row = (b.to(tl.int64) * S + step) * V
  x = tl.load(base_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
  x += tl.load(bias_ptr + b.to(tl.int64) * V + offs, mask=mask, other=0.0)
  tl.store(cache_ptr + row + offs, x, mask=mask)
  t = tl.load(temp_ptr + b)
  greedy = t == 0.0
  scale = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
  y = x * scale
  # NaN and the lanes past V count as -inf.
  y = tl.where(mask & (y == y), y, float("-inf"))
  m = tl.max(y, axis=0)
  arg = tl.argmax(y, axis=0, tie_break_left=True)
  m_safe = tl.where(m == float("-inf"), 0.0, m)
  ssum = tl.sum(tl.exp(y - m_safe), axis=0)
  tl.store(bmax_ptr + b * NB + j, m)
  tl.store(bsum_ptr + b * NB + j, ssum)
  tl.store(barg_ptr + b * NB + j, arg.to(tl.int32))


@triton.jit
def _select_pass_kernel(bmax_ptr, bsum_ptr, barg_ptr, cache_ptr, temp_ptr,
                        u_ptr, tokens_ptr, embed_ptr, emb_ptr, step, S, V, NB,
                        R, NB_POW2: tl.constexpr, BLOCK: tl.constexpr,
                        R_POW2: tl.constexpr):
  b = tl.program_id(0)
  jb = tl.arange(0, NB_POW2)
  jmask = jb < NB
  bm = tl.load(bmax_ptr + b * NB + jb, mask=jmask, other=float("-inf"))
  bs = tl.load(bsum_ptr + b * NB + jb, mask=jmask, other=0.0)
  ba = tl.load(barg_ptr + b * NB + jb, mask=jmask, other=0)
  M = tl.max(bm, axis=0)
  t = tl.load(temp_ptr + b)
  greedy = t == 0.0
  finite = (M > float("-inf")) & (M < float("inf"))

  # Greedy: the first block that attains M, then its lowest index of M.
  first_blk = tl.min(tl.where(bm == M, jb, NB_POW2), axis=0)
  greedy_tok = first_blk * BLOCK + tl.sum(tl.where(jb == first_blk, ba, 0),
                                          axis=0)

  # Inverse CDF over blocks: w_j = sum_{i in j} exp(y_i - M).
  M_safe = tl.where(finite, M, 0.0)
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

  # Inverse CDF inside the block, from the logits the block pass cached.
  scale = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
  lanes = tl.arange(0, BLOCK)
  offs = blk * BLOCK + lanes
  vmask = offs < V
  row = (b.to(tl.int64) * S + step) * V
  y = tl.load(cache_ptr + row + offs, mask=vmask, other=0.0) * scale
  y = tl.where(vmask & (y == y), y, float("-inf"))
  p = tl.exp(y - M_safe)
  cp = tl.cumsum(p, axis=0) + before
  i = tl.sum((cp <= target).to(tl.int32), axis=0)
  i = tl.minimum(i, tl.max(tl.where(p > 0, lanes, 0), axis=0))
  drawn = blk * BLOCK + i

  tok = tl.where(greedy, greedy_tok, tl.where(finite, drawn, greedy_tok))
  tl.store(tokens_ptr + b * S + step, tok)
  # The next step's embedding row.
  r = tl.arange(0, R_POW2)
  rmask = r < R
  e = tl.load(embed_ptr + tok.to(tl.int64) * R + r, mask=rmask)
  tl.store(emb_ptr + b * R + r, e, mask=rmask)


def choose_block(batch: int, vocab: int, num_sms: int) -> int:
  """Vocabulary block of the block pass: the largest (power of two, 512 to
  8192) that still gives at least 4 programs per SM, so small batches fill
  the GPU."""
  for block in (8192, 4096, 2048, 1024):
    if batch * triton.cdiv(vocab, block) >= 4 * num_sms:
      return block
  return 512


def _bias_gemm(emb: torch.Tensor, proj: torch.Tensor, out: torch.Tensor):
  """Picks how to compute ``out = emb @ proj.T`` in float32 on this device.

  Returns (name, fn): fn() writes ``out``. Prefers one cuBLAS GEMM with bf16
  inputs and float32 output (torch.mm's out_dtype); falls back to a GEMM in
  the weights' dtype followed by a cast (the bias is then rounded to that
  dtype), and on CPU to a float32 GEMM.
  """
  pt = proj.t()
  if emb.dtype == torch.float32:
    return "mm_fp32", lambda: torch.mm(emb, pt, out=out)
  if emb.is_cuda:
    try:
      torch.mm(emb, pt, out_dtype=torch.float32, out=out)
      return "mm_out_dtype", lambda: torch.mm(emb, pt, out_dtype=torch.float32,
                                              out=out)
    except (TypeError, RuntimeError, NotImplementedError):
      pass
    tmp = torch.empty(out.shape, dtype=emb.dtype, device=emb.device)

    def cast_fn():
      torch.mm(emb, pt, out=tmp)
      out.copy_(tmp)
    return "mm_then_cast", cast_fn
  pf = proj.float()
  return "mm_fp32_cpu", lambda: torch.mm(emb.float(), pf.t(), out=out)


class F32BiasDesignSampler:
  """The float32-bias design bound to fixed input, output and scratch buffers.

  Args:
    embed: [V_in, R] Markov embedding ("markov_w1"), bf16/fp16/fp32.
    proj: [V, R] Markov projection ("markov_w2"), same dtype.
    base: [B, S, V] base logits, same dtype.
    anchors: int [B] anchor tokens.
    temperature: float32 [B], >= 0 (0 = argmax), per request.
    uniforms: float32 [B, S] in [0, 1), the uniform of each draw.
    block: vocabulary block of the block pass (default: :func:`choose_block`).

  Attributes:
    cache: float32 [B, S, V], the pre-temperature logits of each step.
    tokens: int32 [B, S], the drawn tokens.
    gemm: which bias GEMM is used (see :func:`_bias_gemm`).
  """

  def __init__(self, embed, proj, base, anchors, temperature, uniforms,
               block: int | None = None):
    B, S, V = base.shape
    R = proj.shape[1]
    dev = base.device
    assert embed.shape[1] == R and proj.shape[0] == V
    self.B, self.S, self.V, self.R = B, S, V, R
    self.embed = embed.contiguous()
    self.proj = proj.contiguous()
    self.base = base.contiguous()
    self.anchors = anchors.to(torch.int64)
    self.temperature = temperature.to(torch.float32).contiguous()
    self.uniforms = uniforms.to(torch.float32).contiguous()
    if block is None:
      sms = (torch.cuda.get_device_properties(dev).multi_processor_count
             if dev.type == "cuda" else 1)
      block = choose_block(B, V, sms)
    self.block = block
    self.nb = triton.cdiv(V, block)
    self.num_warps = max(1, min(8, block // 512))
    # Scratch, allocated once.
    self.cache = torch.empty((B, S, V), dtype=torch.float32, device=dev)
    self.tokens = torch.empty((B, S), dtype=torch.int32, device=dev)
    self.bias = torch.empty((B, V), dtype=torch.float32, device=dev)
    self.emb = torch.empty((B, R), dtype=embed.dtype, device=dev)
    self.bmax = torch.empty((B, self.nb), dtype=torch.float32, device=dev)
    self.bsum = torch.empty((B, self.nb), dtype=torch.float32, device=dev)
    self.barg = torch.empty((B, self.nb), dtype=torch.int32, device=dev)
    self.gemm, self._gemm_fn = _bias_gemm(self.emb, self.proj, self.bias)
    self.graph = None

  def run_steps(self) -> None:
    """Runs all S steps, writing ``self.cache`` and ``self.tokens``."""
    torch.index_select(self.embed, 0, self.anchors, out=self.emb)
    nb_pow2 = triton.next_power_of_2(self.nb)
    r_pow2 = triton.next_power_of_2(self.R)
    for s in range(self.S):
      self._gemm_fn()
      _block_pass_kernel[(self.B, self.nb)](
          self.base, self.bias, self.cache, self.temperature, self.bmax,
          self.bsum, self.barg, s, self.S, self.V, self.nb, BLOCK=self.block,
          num_warps=self.num_warps)
      _select_pass_kernel[(self.B,)](
          self.bmax, self.bsum, self.barg, self.cache, self.temperature,
          self.uniforms, self.tokens, self.embed, self.emb, s, self.S, self.V,
          self.nb, self.R, NB_POW2=nb_pow2, BLOCK=self.block, R_POW2=r_pow2,
          num_warps=self.num_warps)

  def capture(self, warmup: int = 2) -> "torch.cuda.CUDAGraph":
    """Captures :meth:`run_steps` in a CUDA graph; replay with ``.replay()``."""
    from benchmarks.baselines.vllm_loop import capture_graph
    self.graph = capture_graph(self.run_steps, warmup)
    return self.graph
