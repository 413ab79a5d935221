"""Property-based tests of torch_bridge.FusedMarkovSampler on CPU (jax runtime).

Valid batches (test_valid_batch): over a fixed set of small layouts (compile
cost dominates, so shapes come from ``sampled_from``), fp32/bf16 heads,
int32/int64 index buffers, ``[M * S]`` and ``[M, S]`` mappings, int64/int32
draft_tokens with S or S + 1 columns, num_reqs 0..M, padding requests,
temperatures (0 included), full-range int64 seeds and positions in
[1, 2**31] (2**31 - 1 for int32 positions). Checked per call:

* tokens of live requests are in [0, V); later requests' tokens and the
  columns past S are untouched;
* cache rows no valid step maps to are bit-equal to what they were;
* at valid steps the written logits equal base + bias within Higham's
  float32 bound (R + 2) * 2^-24 * (|base| + sum_k |embed_k proj_k|), with
  teacher forcing, and each token is the draw of its own logits
  (helpers.check_draft);
* the tokens and logits agree with ``torch_bridge.testing.jm_sample_draft_into``
  on the same inputs: logits within twice the bound, tokens equal wherever
  the draw is decided beyond float32 rounding (helpers.assert_drafts_agree;
  in practice at these sizes they are equal everywhere).

Invalid inputs (test_invalid_layout, test_invalid_values): a wrong dtype,
shape, layout, device or a non-tensor object in one spec attribute (with and
without check_values), or a bad value with check_values=True, raise
BridgeInputError naming the attribute, with nothing written.
"""

from __future__ import annotations

import torch_bridge as tb  # first: sets XLA_PYTHON_CLIENT_PREALLOCATE

import jax
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import helpers
import jax_markov as jm
from torch_bridge import testing as sd

I32, I64 = torch.int32, torch.int64

# (M, S, V, R, head dtype, mapping dtype, mapping [M, S], positions dtype,
# input_ids dtype, buckets). Each is compiled once per bucket it uses.
LAYOUTS = [
    (4, 2, 40, 4, torch.float32, I32, False, I64, I32, None),
    (4, 2, 40, 4, torch.bfloat16, I64, True, I32, I64, (4,)),
    (3, 3, 33, 8, torch.float32, I64, False, I32, I32, (3,)),
    (3, 3, 33, 8, torch.bfloat16, I32, True, I64, I64, None),
]

SETTINGS = settings(derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))

TEMPERATURES = st.one_of(st.floats(0.0625, 8.0, width=32),  # 1/3 greedy
                         st.floats(0.25, 2.0, width=32), st.just(0.0))


def _spec(layout, seed):
  m, s, v, r, dtype, idx_dtype, idx_2d, pos_dtype, ids_dtype, _ = layout
  return sd.SpeculatorDouble(max_num_reqs=m, num_steps=s, vocab=v, rank=r,
                             hidden=8, dtype=dtype, idx_dtype=idx_dtype,
                             idx_2d=idx_2d, pos_dtype=pos_dtype,
                             ids_dtype=ids_dtype, seed=seed)


def _sampler(spec, layout, **kwargs):
  mh = spec.model.model.markov_head
  return tb.FusedMarkovSampler(spec.max_num_reqs, spec.vocab,
                               mh.markov_w2.weight.shape[1],
                               mh.markov_w2.weight.dtype, runtime="jax",
                               buckets=layout[-1], **kwargs)


@st.composite
def batches(draw):
  layout = draw(st.sampled_from(LAYOUTS))
  m, s = layout[0], layout[1]
  n = draw(st.sampled_from(range(m, -1, -1)))  # near uniform, unlike integers
  rows = draw(st.permutations(range(m)))[:n]
  padding = draw(st.lists(st.sampled_from([False, True, False]), min_size=n,
                           max_size=n))
  temps = draw(st.lists(TEMPERATURES, min_size=m, max_size=m))
  seeds = draw(st.lists(st.integers(-2**63, 2**63 - 1), min_size=m,
                        max_size=m))
  pos_max = 2**31 if layout[7] == I64 else 2**31 - 1
  positions = draw(st.lists(
      st.one_of(st.integers(1, 5000), st.integers(1, pos_max),
                st.sampled_from([1, pos_max])),
      min_size=n * s, max_size=n * s))
  tokens_dtype = draw(st.sampled_from([I64, I32]))
  extra_cols = draw(st.integers(0, 1))
  seed = draw(st.integers(0, 2**16))
  return dict(layout=layout, n=n, rows=rows, padding=padding, temps=temps,
              seeds=seeds, positions=positions, tokens_dtype=tokens_dtype,
              extra_cols=extra_cols, seed=seed)


def _prepare(b):
  """A spec filled with the batch b, and its head_hidden."""
  layout, n = b["layout"], b["n"]
  m, s = layout[0], layout[1]
  spec = _spec(layout, b["seed"])
  hidden = spec.prepare(n, rows=list(b["rows"]))
  spec.draft_tokens = torch.full((m, s + b["extra_cols"]), -7,
                                 dtype=b["tokens_dtype"])
  idx = torch.full((m, s), -1, dtype=torch.int64)
  for i, (row, pad) in enumerate(zip(b["rows"], b["padding"])):
    if not pad:
      idx[i] = row
  spec.sample_idx_mapping.copy_(idx.view(spec.sample_idx_mapping.shape))
  pos = torch.full((m * s,), -1, dtype=torch.int64)
  pos[:n * s] = torch.tensor(b["positions"], dtype=torch.int64)
  spec.sample_pos.copy_(pos)
  spec.temperature.copy_(torch.tensor(b["temps"], dtype=torch.float32))
  spec.seeds.copy_(torch.tensor(b["seeds"], dtype=torch.int64))
  return spec, hidden


def _uniforms(x):
  """u [n, S] of each draw (row 0's seed for padding: not checked)."""
  idx = x["idx"]
  n, s_len = idx.shape
  m = x["temperature"].shape[0]
  rows = torch.where(idx >= 0, idx, 0).reshape(-1)
  seeds = np.zeros(m * s_len, np.int64)
  seeds[:n * s_len] = x["seeds"][rows].numpy()
  pos = np.zeros((m * s_len, 1), np.int64)
  pos[:n * s_len, 0] = x["positions"].clamp(min=0).reshape(-1).numpy()
  u = np.asarray(jm.draft_uniforms(seeds, pos))[:n * s_len, 0]
  return u.reshape(n, s_len)


def _gather(cache, idx):
  """cache[idx[b, s], s] as [n, S, V] float32 (zeros where idx < 0)."""
  n, s_len = idx.shape
  steps = torch.arange(s_len).expand(n, s_len)
  out = cache[idx.clamp(min=0), steps].clone()
  out[idx < 0] = 0.0
  return out.numpy()


@settings(SETTINGS, max_examples=60)
@given(b=batches())
def test_valid_batch(b):
  layout, n = b["layout"], b["n"]
  m, s_len, vocab = layout[0], layout[1], layout[2]
  event(f"layout {LAYOUTS.index(layout)}, n = {n}"
        f"{' (all)' if n == m else ''}")
  event(f"padded requests: {sum(b['padding'])}")
  event(f"greedy rows: {sum(t == 0 for t in b['temps'])}")
  spec, hidden = _prepare(b)
  sampler = _sampler(spec, layout)
  cache0 = spec.draft_logits.values.clone()
  tokens0 = spec.draft_tokens.clone()
  if n == 0:
    assert sampler(spec, n, hidden) is True
    assert torch.equal(spec.draft_tokens, tokens0)
    assert torch.equal(spec.draft_logits.values.view(torch.int32),
                       cache0.view(torch.int32))
    return
  x = {k: v.clone() for k, v in spec.inputs(n, hidden).items()}
  assert sampler(spec, n, hidden) is True
  cache = spec.draft_logits.values
  tokens = spec.draft_tokens
  # Untouched: later requests, columns past S, unmapped cache rows (bits).
  assert torch.equal(tokens[n:], tokens0[n:])
  assert torch.equal(tokens[:, s_len:], tokens0[:, s_len:])
  idx = x["idx"]
  valid = idx >= 0
  written = torch.zeros((m, s_len), dtype=torch.bool)
  steps = torch.arange(s_len).expand(n, s_len)
  written[idx[valid], steps[valid]] = True
  assert torch.equal(cache[~written].view(torch.int32),
                     cache0[~written].view(torch.int32))
  got_tokens = tokens[:n, :s_len].long()
  assert bool(((got_tokens >= 0) & (got_tokens < vocab)).all())
  # The contract (Higham's bound, each draw from its own logits), and
  # agreement with jm.sample_draft_into on the same inputs.
  want_tokens, want_cache = sd.jm_sample_draft_into(cache0, x)
  assert torch.equal(want_cache[~written].view(torch.int32),
                     cache0[~written].view(torch.int32))
  rows = torch.where(valid, idx, 0)
  temp_bs = torch.where(valid, x["temperature"][rows], 0.0).numpy()
  head = jm.MarkovHead(x["w1"].float().numpy(), x["w2"].float().numpy())
  base = x["base"].float().numpy()
  anchors = x["anchors"].numpy()
  helpers.assert_drafts_agree(
      (got_tokens.int().numpy(), _gather(cache, idx)),
      (want_tokens.int().numpy(), _gather(want_cache, idx)),
      base, anchors, head, temp_bs, _uniforms(x), rows=valid.numpy())


# -- invalid input -------------------------------------------------------------


def _set(path, make):
  def mutate(spec, d):
    obj = spec
    *parents, last = path.split(".")
    for p in parents:
      obj = getattr(obj, p)
    setattr(obj, last, make(spec, d))
  return path, mutate


def _weight(which, make):
  def mutate(spec, d):
    layer = getattr(spec.model.model.markov_head, which)
    layer.weight = torch.nn.Parameter(make(spec, d), requires_grad=False)
  return f"spec.model.model.markov_head.{which}.weight", mutate


def _dims(spec):
  mh = spec.model.model.markov_head
  return (spec.max_num_reqs, spec.num_speculative_steps, spec.vocab,
          mh.markov_w2.weight.shape[1], mh.markov_w1.weight.shape[0])


def _bad_layouts():
  """(attribute, mutation(spec, drawn_value)) for layouts the hook refuses."""
  meta = torch.device("meta")
  out = []
  # Wrong dtype (d picks one of the wrong dtypes).
  float_bad = [torch.float64, torch.int32, torch.bool]
  int_bad = [torch.float32, torch.int16, torch.uint8, torch.bool]
  for path, shape, bad in [
      ("sample_idx_mapping", lambda m, s: (m * s,), int_bad),
      ("sample_pos", lambda m, s: (m * s,), int_bad),
      ("seeds", lambda m, s: (m,), int_bad),
      ("temperature", lambda m, s: (m,), float_bad),
      ("_anchor_idx", lambda m, s: (m,), int_bad),
      ("input_buffers.input_ids", lambda m, s: (m * s + 4,), int_bad),
      ("sample_indices", lambda m, s: (m * s,), int_bad),
      ("draft_tokens", lambda m, s: (m, s), int_bad),
      ("draft_logits.values", lambda m, s: None,
       [torch.float64, torch.bfloat16, torch.float16, torch.int32])]:
    def make(spec, d, shape=shape, bad=bad, path=path):
      m, s, v, _, _ = _dims(spec)
      shp = shape(m, s) or (m, s, v)
      return torch.zeros(shp, dtype=bad[d % len(bad)])
    out.append(_set(path, make))
  # Wrong shape.
  out += [
      _set("sample_idx_mapping",
           lambda sp, d: torch.zeros(_dims(sp)[0] * _dims(sp)[1] - 1 - d % 2,
                                     dtype=I32)),
      _set("sample_idx_mapping",
           lambda sp, d: torch.zeros(_dims(sp)[0], _dims(sp)[1] + 1,
                                     dtype=I64)),
      _set("sample_pos",
           lambda sp, d: torch.zeros(_dims(sp)[0] - 1, _dims(sp)[1],
                                     dtype=I64)),
      _set("temperature",
           lambda sp, d: torch.ones(_dims(sp)[0] + (1 if d % 2 else -1))),
      _set("seeds", lambda sp, d: torch.zeros(_dims(sp)[0] + 1 + d % 3,
                                              dtype=I64)),
      _set("_anchor_idx", lambda sp, d: torch.zeros(_dims(sp)[0] - 1,
                                                    dtype=I64)),
      _set("input_buffers.input_ids",
           lambda sp, d: torch.zeros(2, 8, dtype=I32)),
      _set("draft_tokens",
           lambda sp, d: torch.zeros(_dims(sp)[0], _dims(sp)[1] - 1,
                                     dtype=I64)),
      _set("draft_tokens",
           lambda sp, d: torch.zeros(_dims(sp)[0] - 1, _dims(sp)[1],
                                     dtype=I64)),
      _set("draft_logits.values",
           lambda sp, d: torch.zeros(_dims(sp)[0], _dims(sp)[1],
                                     _dims(sp)[2] + 1 + d % 2)),
      _set("sample_indices",
           lambda sp, d: torch.zeros(_dims(sp)[0] * _dims(sp)[1] - 1,
                                     dtype=I64)),
      _weight("markov_w1",
              lambda sp, d: torch.zeros(_dims(sp)[2] - 1, _dims(sp)[3],
                                        dtype=sp.model.lm_head.weight.dtype)),
      _weight("markov_w2",
              lambda sp, d: torch.zeros(_dims(sp)[2], _dims(sp)[3] + 1,
                                        dtype=sp.model.lm_head.weight.dtype)),
      _weight("markov_w2",
              lambda sp, d: torch.zeros(_dims(sp)[2], _dims(sp)[3],
                                        dtype=torch.float64)),
  ]
  # Non-contiguous, overlapping, another device, not a tensor.
  out += [
      _set("draft_logits.values",
           lambda sp, d: torch.zeros(_dims(sp)[0], _dims(sp)[2],
                                     _dims(sp)[1]).transpose(1, 2)),
      _set("draft_tokens",
           lambda sp, d: torch.zeros(1, _dims(sp)[1], dtype=I64).expand(
               _dims(sp)[0], _dims(sp)[1])),
      _set("sample_idx_mapping",
           lambda sp, d: torch.zeros(2 * _dims(sp)[0] * _dims(sp)[1],
                                     dtype=I32)[::2]),
      _set("temperature", lambda sp, d: torch.ones(2 * _dims(sp)[0])[::2]),
  ]
  not_tensors = [lambda sp: [0] * 64, lambda sp: None, lambda sp: 3,
                 lambda sp: np.zeros(64, np.int32), lambda sp: object()]
  for path in ("sample_idx_mapping", "sample_pos", "seeds", "temperature",
               "_anchor_idx", "input_buffers.input_ids", "sample_indices",
               "draft_tokens", "draft_logits.values"):
    out.append(_set(path, lambda sp, d: not_tensors[d % len(not_tensors)](sp)))
    out.append(_set(path, lambda sp, d, path=path: torch.zeros(
        8, dtype=I64, device=meta)))
  return out


BAD_LAYOUTS = _bad_layouts()


def _snapshot(spec):
  out = []
  for get in (lambda: spec.draft_logits.values, lambda: spec.draft_tokens):
    t = get()
    out.append((t, t.clone() if isinstance(t, torch.Tensor) and
                t.device.type == "cpu" else None))
  return out


def _assert_unchanged(snap):
  for t, t0 in snap:
    if t0 is not None:
      assert torch.equal(t, t0)


def _refused(spec, sampler, n, hidden, name):
  snap = _snapshot(spec)
  with pytest.raises(tb.BridgeInputError) as e:
    sampler(spec, n, hidden)
  assert str(e.value).startswith(name), (name, str(e.value))
  _assert_unchanged(snap)


@pytest.mark.parametrize("bad", BAD_LAYOUTS,
                         ids=[f"{i}-{n.removeprefix('spec.')}" for i, (n, _) in
                              enumerate(BAD_LAYOUTS)])
@settings(SETTINGS, max_examples=8)
@given(layout=st.sampled_from(LAYOUTS), d=st.integers(0, 11),
       n=st.integers(1, 3), check_values=st.booleans(),
       seed=st.integers(0, 2**16))
def test_invalid_layout(bad, layout, d, n, check_values, seed):
  name, mutate = bad
  spec = _spec(layout, seed)
  sampler = _sampler(spec, layout, check_values=check_values)
  hidden = spec.prepare(n)
  mutate(spec, d)
  _refused(spec, sampler, n, hidden, "spec." + name.removeprefix("spec."))


def _bad_values():
  """(attribute, mutation(spec, n, d)) for values check_values refuses."""

  def idx_of(spec):
    return spec.sample_idx_mapping.view(-1)

  def set_row(value):
    def mutate(spec, n, d):
      idx_of(spec)[(d % n) * spec.num_speculative_steps] = value(spec, d)
    return mutate

  def duplicate(spec, n, d):  # request b takes request a's rows
    s = spec.num_speculative_steps
    a, b = d % n, (d + 1) % n
    idx_of(spec)[b * s:(b + 1) * s] = idx_of(spec)[a * s:(a + 1) * s].clone()

  def set_pos(value):
    def mutate(spec, n, d):
      spec.sample_pos[(d % (n * spec.num_speculative_steps))] = value(spec, d)
    return mutate

  def set_temp(value):
    def mutate(spec, n, d):
      row = int(idx_of(spec)[(d % n) * spec.num_speculative_steps])
      spec.temperature[row] = value
    return mutate

  def set_anchor_idx(value):
    def mutate(spec, n, d):
      spec._anchor_idx[d % n] = value(spec, d)  # pylint: disable=protected-access
    return mutate

  def set_anchor(value):
    def mutate(spec, n, d):
      ids = spec.input_buffers.input_ids
      ids[spec._anchor_idx[d % n]] = value(spec, d)  # pylint: disable=protected-access
    return mutate

  big = [2**31 + 1, 2**32 + 1, 2**40]
  return [
      ("spec.sample_idx_mapping",
       set_row(lambda sp, d: sp.max_num_reqs + d % 3)),
      ("spec.sample_idx_mapping", set_row(lambda sp, d: -2 - d % 3)),
      ("spec.sample_idx_mapping", duplicate),
      ("spec.sample_pos", set_pos(lambda sp, d: -(d % 3))),
      ("spec.sample_pos",
       set_pos(lambda sp, d: big[d % 3] if sp.sample_pos.dtype == I64
               else -5)),
      ("spec.temperature", set_temp(-1.0)),
      ("spec.temperature", set_temp(-1e-30)),
      ("spec.temperature", set_temp(float("nan"))),
      ("spec.temperature", set_temp(-float("inf"))),
      ("spec._anchor_idx",
       set_anchor_idx(lambda sp, d: sp.input_buffers.input_ids.shape[0] + d)),
      ("spec._anchor_idx", set_anchor_idx(lambda sp, d: -1 - d)),
      ("spec.input_buffers.input_ids", set_anchor(lambda sp, d: -1 - d)),
      ("spec.input_buffers.input_ids",
       set_anchor(lambda sp, d: _dims(sp)[4] + d)),
  ]


BAD_VALUES = _bad_values()


@pytest.mark.parametrize("bad", BAD_VALUES,
                         ids=[f"{i}-{n}" for i, (n, _) in
                              enumerate(BAD_VALUES)])
@settings(SETTINGS, max_examples=8)
@given(layout=st.sampled_from(LAYOUTS), d=st.integers(0, 11),
       n=st.integers(2, 3), seed=st.integers(0, 2**16))
def test_invalid_values(bad, layout, d, n, seed):
  name, mutate = bad
  spec = _spec(layout, seed)
  sampler = _sampler(spec, layout, check_values=True)
  hidden = spec.prepare(n)
  mutate(spec, n, d)
  _refused(spec, sampler, n, hidden, name)
