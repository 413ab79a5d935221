"""A stand-in for vLLM's DSparkSpeculator, built from real torch modules.

It holds exactly what the Markov-step hook reads and writes, laid out as
vLLM lays it out (flat request-major ``sample_*`` buffers of length
``max_num_reqs * S``, one state row per request, anchor-as-first query
blocks), plus :func:`torch_chain`, the plain-torch loop of the same chain that
the hook is checked against.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

import jax
import jax.numpy as jnp

try:  # the public API once jax_markov exports it, else the reference
  import jax_markov as jm
  draft_uniforms = jm.draft_uniforms
except (ImportError, AttributeError):
  from jax_markov.rng import draft_uniforms
try:
  from jax_markov import sample_draft_into as _sample_draft_into
  _INTO_TAKES_INTERPRET = True
except ImportError:
  from jax_markov.reference import sample_draft_into as _sample_draft_into
  _INTO_TAKES_INTERPRET = False
from jax_markov.head import MarkovHead


class MarkovHeadModule(nn.Module):
  """markov_w1: nn.Embedding [V_in, R]; markov_w2: nn.Linear R -> V ([V, R])."""

  def __init__(self, v_in: int, vocab: int, rank: int):
    super().__init__()
    self.markov_w1 = nn.Embedding(v_in, rank)
    self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class _Inner(nn.Module):

  def __init__(self, v_in, vocab, rank):
    super().__init__()
    self.markov_head = MarkovHeadModule(v_in, vocab, rank)


class DraftModel(nn.Module):
  """The draft LM head (nn.Linear H -> V) and the Markov head, vLLM-named."""

  def __init__(self, hidden: int, vocab: int, v_in: int, rank: int):
    super().__init__()
    self.lm_head = nn.Linear(hidden, vocab, bias=False)
    self.model = _Inner(v_in, vocab, rank)
    self.draft_id_to_target_id = None

  def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
    return self.lm_head(hidden)

  def markov_embed(self, prev: torch.Tensor) -> torch.Tensor:
    return self.model.markov_head.markov_w1(prev)

  def markov_bias(self, embed: torch.Tensor) -> torch.Tensor:
    return self.model.markov_head.markov_w2(embed)


class SpeculatorDouble:
  """The attributes FusedMarkovSampler reads and writes, vLLM-shaped.

  Buffers (M = max_num_reqs, S = num_steps, V = vocab):
    sample_indices int64 [M*S], sample_pos int64 [M*S] (or pos_dtype),
    sample_idx_mapping int32 [M*S] (or idx_dtype; [M, S] with idx_2d),
    input_buffers.input_ids int32 [M*S + 4] (or ids_dtype), _anchor_idx
    int64 [M], temperature float32 [M], seeds int64 [M], draft_tokens int64
    [M, S], draft_logits.values float32 [M, S, V] (filled with a sentinel
    pattern so untouched rows are recognisable).
  """

  def __init__(self, *, max_num_reqs=8, num_steps=3, vocab=96, v_in=None,
               rank=8, hidden=16, dtype=torch.float32, device="cpu",
               idx_dtype=torch.int32, pos_dtype=torch.int64,
               ids_dtype=torch.int32, idx_2d=False, seed=0):
    m, s = max_num_reqs, num_steps
    self.gen = torch.Generator().manual_seed(seed)
    self.device = torch.device(device)
    self.hidden = hidden
    v_in = vocab + 5 if v_in is None else v_in
    torch.manual_seed(seed)
    with self.device:  # built in place: the benchmark's LM head is large
      model = DraftModel(hidden, vocab, v_in, rank)
    with torch.no_grad():  # logits of a useful scale for sampling
      model.lm_head.weight.mul_(4.0)
    self.model = model.to(device=self.device, dtype=dtype)
    self.num_speculative_steps = s
    self.max_num_reqs = m
    self.vocab = vocab
    self.num_tokens = m * s + 4
    dev = self.device
    self.input_buffers = SimpleNamespace(
        input_ids=torch.zeros(self.num_tokens, dtype=ids_dtype, device=dev))
    self._anchor_idx = torch.arange(m, dtype=torch.int64, device=dev) * s
    self.sample_indices = torch.zeros(m * s, dtype=torch.int64, device=dev)
    self.sample_pos = torch.full((m * s,), -1, dtype=pos_dtype, device=dev)
    shape = (m, s) if idx_2d else (m * s,)
    self.sample_idx_mapping = torch.full(shape, -1, dtype=idx_dtype,
                                         device=dev)
    self.temperature = torch.zeros(m, dtype=torch.float32, device=dev)
    self.seeds = torch.zeros(m, dtype=torch.int64, device=dev)
    self.draft_tokens = torch.full((m, s), -7, dtype=torch.int64, device=dev)
    # Filled on the device (it can be large in benchmarks).
    sentinel = torch.empty((m, s, vocab), dtype=torch.float32, device=dev)
    sentinel.normal_(generator=torch.Generator(dev).manual_seed(seed))
    self.draft_logits = SimpleNamespace(values=sentinel.add_(1000.0))

  def prepare(self, num_reqs: int, *, padding=(), greedy=(),
              rows=None) -> torch.Tensor:
    """Fills the buffers for a batch in place, as vLLM's prepare-inputs does.

    Args:
      num_reqs: requests in the batch.
      padding: request indices whose state row is -1 (all steps).
      greedy: request indices with temperature 0.
      rows: the state row of each request (default: a random permutation).

    Returns:
      head_hidden [num_tokens, H] in the model dtype.
    """
    m, s, g, dev = self.max_num_reqs, self.num_speculative_steps, self.gen, \
        self.device
    if rows is None:
      rows = torch.randperm(m, generator=g)[:num_reqs]
    rows = torch.as_tensor(rows, dtype=torch.int64)
    idx = rows[:, None].repeat(1, s)
    for b in padding:
      idx[b] = -1
    flat_idx = torch.full((m * s,), -1, dtype=torch.int64)
    flat_idx[:num_reqs * s] = idx.reshape(-1)
    self.sample_idx_mapping.copy_(
        flat_idx.view(self.sample_idx_mapping.shape).to(dev))
    # Each request's query block holds S tokens; step s predicts position
    # start + s + 1 (anchor-as-first).
    start = torch.randint(0, 5000, (num_reqs,), generator=g)
    pos = torch.full((m * s,), -1, dtype=torch.int64)
    pos[:num_reqs * s] = (start[:, None] + torch.arange(1, s + 1)).reshape(-1)
    self.sample_pos.copy_(pos.to(dev))
    perm = torch.randperm(self.num_tokens - 4, generator=g)
    self.sample_indices.copy_(perm.to(dev))
    ids = torch.randint(0, self.model.model.markov_head.markov_w1.weight
                        .shape[0], (self.num_tokens,), generator=g)
    self.input_buffers.input_ids.copy_(ids.to(dev))
    temps = torch.rand(m, generator=g) * 1.5 + 0.25
    seeds = torch.randint(-2**62, 2**62, (m,), generator=g, dtype=torch.int64)
    for b in greedy:
      temps[rows[b]] = 0.0
    self.temperature.copy_(temps.to(dev))
    self.seeds.copy_(seeds.to(dev))
    hidden = torch.randn(self.num_tokens, self.hidden, generator=g)
    return hidden.to(device=dev, dtype=self.model.lm_head.weight.dtype)

  # -- views of the inputs, for the references --------------------------------

  def inputs(self, num_reqs: int, head_hidden: torch.Tensor) -> dict:
    """What a batch reads, on the CPU: base [n,S,V] (model dtype), anchors [n],
    idx [n,S], positions [n,S] (sample_pos - 1), temperature [M], seeds [M],
    w1, w2."""
    n, s = num_reqs, self.num_speculative_steps
    with torch.no_grad():
      base = self.model.compute_draft_logits(
          head_hidden[self.sample_indices[:n * s]]).view(n, s, -1)
    anchors = self.input_buffers.input_ids[self._anchor_idx[:n]]
    mh = self.model.model.markov_head
    return dict(
        base=base.detach().cpu(),
        anchors=anchors.cpu().long(),
        idx=self.sample_idx_mapping.reshape(-1)[:n * s].view(n, s).cpu().long(),
        positions=(self.sample_pos.reshape(-1)[:n * s].view(n, s).cpu().long()
                   - 1),
        temperature=self.temperature.cpu(),
        seeds=self.seeds.cpu(),
        w1=mh.markov_w1.weight.detach().cpu(),
        w2=mh.markov_w2.weight.detach().cpu())


def _to_jnp(t: torch.Tensor) -> jax.Array:
  if t.dtype == torch.bfloat16:
    return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)
  return jnp.asarray(t.numpy())


def _pad_rows(t: torch.Tensor, rows: int, value) -> torch.Tensor:
  out = torch.full((rows,) + tuple(t.shape[1:]), value, dtype=t.dtype)
  out[:t.shape[0]] = t
  return out


def jm_sample_draft_into(cache: torch.Tensor, x: dict, platform: str = "cpu"):
  """jm.sample_draft_into (or the reference) on a batch, on a JAX platform.

  The batch is padded to the cache's M rows with state row -1 (rows that
  write nothing), so every batch size reuses one compilation.

  Args:
    cache: the cache before the call, [M, S, V] float32.
    x: :meth:`SpeculatorDouble.inputs`.
    platform: "cpu" (interpret mode) or "gpu" (the compiled kernels).

  Returns:
    torch tokens int64 [n, S] and the new cache float32 [M, S, V], on CPU.
  """
  if _INTO_TAKES_INTERPRET:
    kwargs = {"interpret": True if platform == "cpu" else None}
  else:
    kwargs = {}
  n = x["idx"].shape[0]
  m = cache.shape[0]
  positions = _pad_rows(torch.clamp(x["positions"], min=0), m, 0)
  with jax.default_device(jax.devices(platform)[0]):
    tokens, new_cache = _sample_draft_into(
        _to_jnp(cache.cpu()), _to_jnp(_pad_rows(x["base"], m, 0)),
        _to_jnp(_pad_rows(x["anchors"], m, 0).int()),
        MarkovHead(_to_jnp(x["w1"]), _to_jnp(x["w2"])),
        _to_jnp(x["temperature"]), x["seeds"].numpy(),
        _to_jnp(_pad_rows(x["idx"], m, -1).int()), _to_jnp(positions.int()),
        **kwargs)
  return (torch.from_numpy(np.array(tokens)).long()[:n],
          torch.from_numpy(np.array(new_cache)))


def torch_draw(logits: torch.Tensor, temperature: torch.Tensor,
               u: torch.Tensor) -> torch.Tensor:
  """The draw rule in torch: logits [B, V], temperature [B], u [B] -> [B]."""
  x = logits.float()
  x = torch.where(torch.isnan(x), torch.full_like(x, -torch.inf), x)
  t = temperature.float()
  greedy = t == 0
  scale = torch.where(greedy, 1.0, 1.0 / torch.where(greedy, 1.0, t))
  y = x * scale[:, None]
  m = y.max(dim=-1).values
  first_max = y.argmax(dim=-1)
  p = torch.exp(y - torch.where(torch.isfinite(m), m, 0.0)[:, None])
  cdf = p.cumsum(dim=-1)
  target = u.float() * cdf[:, -1]
  idx = (cdf <= target[:, None]).sum(dim=-1)
  vocab = torch.arange(x.shape[-1])
  last = torch.where(p > 0, vocab, -1).max(dim=-1).values
  idx = torch.minimum(idx, last)
  return torch.where(greedy | ~torch.isfinite(m), first_max, idx)


def torch_chain(spec: SpeculatorDouble, x: dict):
  """The chain as a plain-torch loop (float32 bias, uniforms from jm).

  Returns:
    tokens int64 [n, S] and logits float32 [n, S, V] for every (b, s); only
    the valid ones (x["idx"] >= 0) are defined by the contract.
  """
  idx = x["idx"]
  n, s_len = idx.shape
  valid = idx >= 0
  rows = torch.where(valid, idx, 0)
  positions = torch.clamp(x["positions"], min=0)
  # Padded to a fixed number of draws, so every batch size shares one
  # compilation of the uniforms.
  m = x["temperature"].shape[0]
  seeds = _pad_rows(x["seeds"][rows.reshape(-1)], m * s_len, 0)
  pos = _pad_rows(positions.reshape(-1, 1), m * s_len, 0)
  u = np.array(draft_uniforms(seeds.numpy(), pos.numpy()))
  u = torch.from_numpy(u)[:n * s_len].view(n, s_len)
  temp = torch.where(valid, x["temperature"][rows], 0.0)
  w1, w2 = x["w1"].float(), x["w2"].float()
  prev = x["anchors"]
  tokens, logits = [], []
  fp32 = spec.model.model.markov_head.markov_w2.weight.dtype == torch.float32
  for s in range(s_len):
    if fp32:  # the model's own torch modules
      with torch.no_grad():
        bias = spec.model.markov_bias(
            spec.model.markov_embed(prev.to(spec.device))).cpu()
    else:  # the contract accumulates the bias in float32, unrounded
      bias = w1[prev] @ w2.T
    step = x["base"][:, s].float() + bias
    tok = torch_draw(step, temp[:, s], u[:, s])
    tokens.append(tok)
    logits.append(step)
    prev = tok
  return torch.stack(tokens, 1), torch.stack(logits, 1)


# ============================================================================
# For the benchmarks (benchmarks/run.py): the same double over given tensors.
# Added for the benchmark harness; it changes nothing above, and nothing above
# uses it.


class _FixedRows(nn.Module):
  """An LM head returning preallocated logit rows, whatever the hidden states
  (the backbone is not what the benchmark times)."""

  def __init__(self, rows: torch.Tensor):
    super().__init__()
    self.rows = rows  # a plain attribute: not a parameter, not a buffer

  def forward(self, hidden: torch.Tensor) -> torch.Tensor:
    return self.rows[:hidden.shape[0]]


def speculator_from_tensors(base, embed, proj, anchors, temperature, seeds,
                            positions, *, draft_to_target=None,
                            greedy: bool = False) -> SpeculatorDouble:
  """A :class:`SpeculatorDouble` with M = B that reads the given tensors.

  (:func:`add_modes` cannot turn this double into the reduced-vocabulary
  mode: it replaces the LM head and markov_w2 by random ones. The keywords
  below set the modes over the given tensors instead, as add_modes sets
  them.)

  Args:
    base: [B, S, V] base logits (the model dtype), on the device ([B, S, Vd]
      with draft_to_target).
    embed: [V_in, R] markov_w1 weight; proj: [V, R] markov_w2 weight ([Vd, R]
      with draft_to_target).
    anchors: int [B], request b's anchor token.
    temperature: float [B]; seeds: int64 [B] (tensor or array), per request.
    positions: int [B, S], what draw (b, s) is keyed by (sample_pos - 1).
    draft_to_target: None, or int [Vd]: a reduced draft vocabulary, draft id
      j being target id draft_to_target[j]; the target vocabulary is V_in
      (the cache [B, S, V_in]), ``model.draft_id_to_target_id`` = d2t =
      draft_to_target - arange(Vd), as vLLM holds it.
    greedy: ``spec.draft_logits = None`` (greedy drafting, tokens only).

  Returns:
    The double, with request b on state row b, sample_indices = arange(B * S),
    ``model.compute_draft_logits`` returning ``base`` as [B * S, V] rows
    (zero copy), and ``spec.head_hidden`` a matching [B * S + 4, 8] input:
    call the hook as ``sampler(spec, B, spec.head_hidden)``.
  """
  B, S, V = base.shape
  v_in, rank = embed.shape
  dev = base.device
  vd = V
  if draft_to_target is not None:
    V = v_in  # the target vocabulary: the cache's width
  spec = SpeculatorDouble(max_num_reqs=B, num_steps=S, vocab=V, v_in=v_in,
                          rank=rank, hidden=8, dtype=base.dtype, device=dev)
  head = spec.model.model.markov_head
  spec.draft_vocab = vd
  if draft_to_target is not None:
    with dev:
      w2 = nn.Linear(rank, vd, bias=False)
    head.markov_w2 = w2.to(base.dtype)
    model = spec.model
    targets = torch.as_tensor(draft_to_target, device=dev).to(torch.int64)
    model.draft_id_to_target_id = targets - torch.arange(vd, device=dev)
    model.map_draft_to_target = (
        lambda ids: ids + model.draft_id_to_target_id[ids])
  else:
    spec.model.map_draft_to_target = lambda ids: ids
  if greedy:
    spec.draft_logits = None
  with torch.no_grad():
    head.markov_w1.weight.copy_(embed)
    head.markov_w2.weight.copy_(proj)
  spec.model.requires_grad_(False)
  spec.model.lm_head = _FixedRows(base.reshape(B * S, vd))
  spec.sample_indices.copy_(torch.arange(B * S, device=dev))
  spec.sample_idx_mapping.copy_(
      torch.arange(B, device=dev).repeat_interleave(S)
      .view(spec.sample_idx_mapping.shape))
  pos = torch.as_tensor(positions, device=dev).to(torch.int64) + 1
  spec.sample_pos.copy_(pos.reshape(-1))
  spec.input_buffers.input_ids[spec._anchor_idx] = torch.as_tensor(
      anchors, device=dev).to(spec.input_buffers.input_ids.dtype)
  spec.temperature.copy_(torch.as_tensor(temperature, device=dev))
  spec.seeds.copy_(torch.as_tensor(seeds, device=dev).to(torch.int64))
  spec.head_hidden = torch.zeros((spec.num_tokens, 8), dtype=base.dtype,
                                 device=dev)
  return spec


# ============================================================================
# DSpark's other modes (vLLM's _sample_sequential): greedy drafting, a reduced
# draft vocabulary, the confidence head; and the plain-torch loop of all four.


class ConfidenceHead(nn.Module):
  """A confidence head: a linear score of [hidden, markov_embed(prev)]."""

  def __init__(self, hidden: int, rank: int):
    super().__init__()
    self.proj = nn.Linear(hidden + rank, 1)

  def forward(self, hidden: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    return self.proj(torch.cat([hidden, embed.to(hidden.dtype)], dim=-1))


def add_modes(spec: SpeculatorDouble, *, draft_vocab: int | None = None,
              shuffled: bool = False, greedy: bool = False,
              confidence_threshold: float | None = None,
              seed: int = 0) -> SpeculatorDouble:
  """Turns a double into one of DSpark's other modes, vLLM-shaped.

  Args:
    spec: a double built with ``vocab`` = the TARGET vocabulary V (and
      v_in >= V: markov_w1 is indexed by target ids).
    draft_vocab: Vd < V or = V: the LM head and markov_w2 get Vd rows and
      ``model.draft_id_to_target_id`` (d2t, int64 [Vd]) maps draft id j to
      target id ``j + d2t[j]`` (``model.map_draft_to_target``); increasing
      targets unless ``shuffled``.
    greedy: ``spec.draft_logits = None`` (greedy drafting, tokens only).
    confidence_threshold: enable the confidence head with this threshold:
      ``spec.confidence_config``, ``spec.confidence_logits`` float32 [M, S],
      ``spec.confidence_prefix_lengths`` int64 [M],
      ``model.compute_confidence_logits(hidden [n, H], embed [n, R]) -> [n, 1]``.

  Returns:
    spec, changed in place.
  """
  g = torch.Generator().manual_seed(seed + 1000)
  model, dev = spec.model, spec.device
  dtype = model.lm_head.weight.dtype
  vocab, m, s = spec.vocab, spec.max_num_reqs, spec.num_speculative_steps
  if draft_vocab is not None:
    targets = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab])[0]
    if shuffled:
      targets = targets[torch.randperm(draft_vocab, generator=g)]
    with dev:
      lm_head = nn.Linear(spec.hidden, draft_vocab, bias=False)
      w2 = nn.Linear(model.model.markov_head.markov_w2.in_features,
                     draft_vocab, bias=False)
    with torch.no_grad():
      lm_head.weight.mul_(4.0)
    model.lm_head = lm_head.to(dtype)
    model.model.markov_head.markov_w2 = w2.to(dtype)
    model.draft_id_to_target_id = (
        targets - torch.arange(draft_vocab)).to(device=dev, dtype=torch.int64)
    model.map_draft_to_target = lambda ids: ids + model.draft_id_to_target_id[ids]
    spec.draft_vocab = draft_vocab
  else:
    model.map_draft_to_target = lambda ids: ids
    spec.draft_vocab = vocab
  if greedy:
    spec.draft_logits = None
  if confidence_threshold is not None:
    rank = model.model.markov_head.markov_w1.weight.shape[1]
    with dev:
      model.confidence_head = ConfidenceHead(spec.hidden, rank).to(dtype)
    model.compute_confidence_logits = model.confidence_head
    spec.confidence_config = SimpleNamespace(enabled=True,
                                             threshold=confidence_threshold)
    spec.confidence_logits = torch.full((m, s), -5.0, dtype=torch.float32,
                                        device=dev)
    spec.confidence_prefix_lengths = torch.full((m,), -3, dtype=torch.int64,
                                                device=dev)
  return spec


def torch_dspark_loop(spec: SpeculatorDouble, num_reqs: int,
                      head_hidden: torch.Tensor) -> dict:
  """vLLM's _sample_sequential as a plain-torch loop, every mode, on the CPU.

  The draw (sampling modes) is the inverse CDF of softmax(logits / T) over the
  target vocabulary with the uniforms of ``jm.draft_uniforms``; greedy is the
  lowest index of the max. With a reduced vocabulary, draft column j is target
  column j + d2t[j] and every other target column is -inf; the drawn token is
  a target id, and so is the next step's ``markov_embed(prev)`` index.

  Returns:
    dict(tokens int64 [n, S] (after the confidence mask), logits float32
    [n, S, V] target-vocabulary logits of every step (None when greedy),
    confidence float32 [n, S] or None, prefix int64 [n] or None).
  """
  n, s_len = num_reqs, spec.num_speculative_steps
  model = spec.model
  x = spec.inputs(n, head_hidden)
  idx = x["idx"]
  valid = idx >= 0
  rows = torch.where(valid, idx, 0)
  greedy_mode = spec.draft_logits is None
  d2t = getattr(model, "draft_id_to_target_id", None)
  vocab = spec.vocab
  targets = (torch.arange(spec.draft_vocab) +
             (d2t.cpu() if d2t is not None else 0))
  m = x["temperature"].shape[0]
  seeds = _pad_rows(x["seeds"][rows.reshape(-1)], m * s_len, 0)
  pos = _pad_rows(torch.clamp(x["positions"], min=0).reshape(-1, 1),
                  m * s_len, 0)
  u = np.array(draft_uniforms(seeds.numpy(), pos.numpy()))
  u = torch.from_numpy(u)[:n * s_len].view(n, s_len)
  temp = torch.where(valid, x["temperature"][rows], 0.0)
  temp = torch.where(temp > 0, temp, 0.0)
  w1, w2 = x["w1"].float(), x["w2"].float()
  prev = x["anchors"]
  tokens, logits, prevs = [], [], []
  for step in range(s_len):
    prevs.append(prev)
    draft = x["base"][:, step].float() + w1[prev] @ w2.T  # [n, Vd]
    if greedy_mode:
      tok = targets[draft.argmax(dim=-1)]  # map_draft_to_target
    else:
      full = torch.full((n, vocab), -torch.inf)
      full[:, targets] = draft
      tok = torch_draw(full, temp[:, step], u[:, step])
      logits.append(full)
    tokens.append(tok)
    prev = tok
  tokens = torch.stack(tokens, 1)
  out = dict(tokens=tokens, logits=None if greedy_mode else
             torch.stack(logits, 1), confidence=None, prefix=None)
  conf = getattr(spec, "confidence_config", None)
  if conf is not None and conf.enabled:
    hidden = head_hidden[spec.sample_indices[:n * s_len]].view(n, s_len, -1)
    scores = []
    with torch.no_grad():
      for step in range(s_len):
        emb = model.markov_embed(prevs[step].to(spec.device))
        scores.append(model.compute_confidence_logits(
            hidden[:, step], emb).float().reshape(n).cpu())
    scores = torch.stack(scores, 1)
    below = torch.sigmoid(scores) < conf.threshold
    keep = torch.cumprod((~below).long(), dim=1).bool()
    out["tokens"] = torch.where(keep, tokens, -1)
    out["confidence"] = scores
    out["prefix"] = keep.sum(dim=1)
  return out
