"""Tests of torch_bridge.FusedMarkovSampler against jm.sample_draft_into and a
plain-torch loop of the chain, on a speculator double built from torch modules.

CPU tests use torch CPU tensors (DLPack into JAX on CPU, jax_markov in
interpret mode). GPU tests (marked ``gpu``) run the same on CUDA tensors, plus
the stream-ordering, device-mismatch and capture tests.
"""

import os

import torch_bridge as tb  # first: sets XLA_PYTHON_CLIENT_PREALLOCATE
from torch_bridge import buckets as tbb

import chex
import jax
import numpy as np
import pytest
import torch

from helpers import torch_and_jax_gpu
from torch_bridge import testing as sd  # pylint: disable=g-import-not-at-top




_GPU = torch_and_jax_gpu()

M, S, V, R = 8, 3, 96, 8

# (spec kwargs, [(num_reqs, padding requests, greedy requests), ...])
CONFIGS = {
    # vLLM's dtypes: int32 mapping and input ids, int64 positions and seeds.
    "fp32-vllm": (dict(dtype=torch.float32),
                  [(5, (1,), (2,)), (8, (), (0, 7)), (3, (), ()),
                   (1, (0,), ())]),
    # bf16 head and logits, int64 [M, S] mapping, int32 positions, int64 ids;
    # 6 requests pad to the bucket of 8 (the padded-copy path).
    "bf16-wide": (dict(dtype=torch.bfloat16, vocab=130, idx_dtype=torch.int64,
                       idx_2d=True, pos_dtype=torch.int32,
                       ids_dtype=torch.int64, seed=1),
                  [(6, (4,), (1,))]),
}


def _sync(device):
  if torch.device(device).type == "cuda":
    torch.cuda.synchronize()


def _run_and_check(spec, sampler, n, padding=(), greedy=(), platform="cpu"):
  """One hook call, checked against jm.sample_draft_into and the torch loop."""
  hidden = spec.prepare(n, padding=padding, greedy=greedy)
  x = spec.inputs(n, hidden)
  cache0 = spec.draft_logits.values.clone()
  tokens0 = spec.draft_tokens.clone()
  assert sampler(spec, n, hidden) is True
  _sync(spec.device)
  got_tokens = spec.draft_tokens.cpu()
  got_cache = spec.draft_logits.values.cpu()
  cache0, tokens0 = cache0.cpu(), tokens0.cpu()
  _check(spec, x, n, got_tokens, got_cache, cache0, tokens0, platform)


def _check(spec, x, n, got_tokens, got_cache, cache0, tokens0, platform):
  vocab = spec.vocab
  idx = x["idx"]
  valid = idx >= 0
  chex.assert_shape(got_tokens.numpy(), tokens0.shape)
  chex.assert_type(got_tokens.numpy(), tokens0.numpy().dtype)
  chex.assert_shape(got_cache.numpy(), cache0.shape)
  chex.assert_type(got_cache.numpy(), np.float32)
  # 1. The same tokens and cache as jm.sample_draft_into on the same inputs.
  want_tokens, want_cache = sd.jm_sample_draft_into(cache0, x, platform)
  np.testing.assert_array_equal(got_tokens[:n][valid], want_tokens[valid])
  np.testing.assert_allclose(got_cache, want_cache, rtol=1e-6, atol=1e-6)
  # Padding steps still draw valid ids.
  assert bool(((got_tokens[:n] >= 0) & (got_tokens[:n] < vocab)).all())
  # 2. Nothing else is touched: later requests' tokens, unwritten cache rows.
  assert torch.equal(got_tokens[n:], tokens0[n:])
  written = torch.zeros(cache0.shape[:2], dtype=torch.bool)
  steps = torch.arange(idx.shape[1]).expand_as(idx)
  written[idx[valid], steps[valid]] = True
  assert torch.equal(got_cache[~written], cache0[~written])
  # 3. The plain-torch loop of the chain.
  torch_tokens, torch_logits = sd.torch_chain(spec, x)
  np.testing.assert_array_equal(got_tokens[:n][valid], torch_tokens[valid])
  np.testing.assert_allclose(got_cache[idx[valid], steps[valid]],
                             torch_logits[valid], rtol=1e-5, atol=1e-4)


def _sampler_for(spec, **kwargs):
  mh = spec.model.model.markov_head
  return tb.FusedMarkovSampler(spec.max_num_reqs, spec.vocab,
                               mh.markov_w2.weight.shape[1],
                               mh.markov_w2.weight.dtype, **kwargs)


def _matches(config, device, platform, **sampler_kwargs):
  kwargs, calls = CONFIGS[config]
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, rank=R,
                             device=device, **{"vocab": V, **kwargs})
  sampler = _sampler_for(spec, **sampler_kwargs)
  for n, padding, greedy in calls:
    _run_and_check(spec, sampler, n, padding, greedy, platform)
  return spec, sampler


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_matches_jm_and_torch_loop(config):
  _matches(config, "cpu", "cpu")


def test_buckets():
  assert tbb.default_buckets(1) == (1,)
  assert tbb.default_buckets(8) == (1, 2, 4, 8)
  assert tbb.default_buckets(6) == (1, 2, 4, 6)
  assert tbb.normalize_buckets([4, 2, 2], 8) == (2, 4, 8)
  with pytest.raises(ValueError):
    tbb.normalize_buckets([0, 4], 8)
  with pytest.raises(ValueError):
    tbb.normalize_buckets([16], 8)
  got = [tbb.bucket_for((1, 2, 4, 8), n) for n in range(1, 9)]
  assert got == [1, 2, 4, 4, 8, 8, 8, 8]


def test_no_recompile_per_num_reqs():
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  sampler = _sampler_for(spec)
  assert sampler.warmup(spec) == len(sampler.buckets) == 4
  traces = tb.trace_count()
  for n in range(1, M + 1):
    hidden = spec.prepare(n)
    assert sampler(spec, n, hidden)
  assert tb.trace_count() == traces


def test_custom_buckets_pad_rows_write_nothing():
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  sampler = _sampler_for(spec, buckets=[8])
  assert sampler.buckets == (8,)
  _run_and_check(spec, sampler, 3, padding=(2,))


def test_noncontiguous_base_logits():
  # An LM head whose output is a transposed view: imported through the
  # padded buffer even when num_reqs is a bucket.
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  lm_head = spec.model.lm_head
  spec.model.compute_draft_logits = lambda h: (lm_head.weight @ h.T).T
  sampler = _sampler_for(spec)
  _run_and_check(spec, sampler, 4, padding=(3,))


def test_all_padding_writes_no_logits():
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  sampler = _sampler_for(spec)
  _run_and_check(spec, sampler, 3, padding=(0, 1, 2))


def test_imports_are_cached_and_refreshed():
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  sampler = _sampler_for(spec)
  _run_and_check(spec, sampler, 8)
  first = sampler.import_count
  _run_and_check(spec, sampler, 8)
  # Fixed buffers are imported once; only the base logits are per call.
  assert sampler.import_count == first + 1
  for slot in ("spec.seeds", "spec.sample_idx_mapping",
               "spec.model.model.markov_head.markov_w1.weight"):
    assert sampler.is_zero_copy(slot)
  # A new tensor in a slot is imported and used.
  spec.seeds = spec.seeds.clone()
  _run_and_check(spec, sampler, 8)
  assert sampler.import_count == first + 3
  # A misaligned buffer is imported as a copy; torch's in-place writes bump
  # its version, so the copy is refreshed before it is used again.
  storage = torch.zeros(M + 1)
  storage[1:] = spec.temperature
  spec.temperature = storage[1:]
  _run_and_check(spec, sampler, 8)  # prepare() writes it in place
  copied = not sampler.is_zero_copy("spec.temperature")
  count = sampler.import_count
  _run_and_check(spec, sampler, 8)
  assert sampler.import_count == count + 1 + int(copied)


def test_inference_tensors():
  # vLLM runs under inference_mode: its tensors have no version counter.
  with torch.inference_mode():
    spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
    sampler = _sampler_for(spec)
    _run_and_check(spec, sampler, 5, padding=(3,))
    _run_and_check(spec, sampler, 8)


def test_num_reqs_zero_and_incomplete_modes():
  """num_reqs = 0 writes nothing; a mode whose buffers are missing is an
  error naming them, before anything is written (every DSpark mode is
  covered: tests/test_hook_modes.py)."""
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  sampler = _sampler_for(spec)
  hidden = spec.prepare(4)
  cache0 = spec.draft_logits.values.clone()
  tokens0 = spec.draft_tokens.clone()
  assert sampler(spec, 0, hidden) is True
  spec.confidence_config = type("C", (), {"enabled": True, "threshold": 0.5})()
  with pytest.raises(tb.BridgeInputError, match="compute_confidence_logits"):
    sampler(spec, 4, hidden)
  spec.confidence_config = None
  spec.model.draft_id_to_target_id = torch.zeros(3, dtype=torch.int64)
  with pytest.raises(tb.BridgeInputError, match="draft_id_to_target_id"):
    sampler(spec, 4, hidden)
  assert torch.equal(spec.draft_logits.values, cache0)
  assert torch.equal(spec.draft_tokens, tokens0)
  assert sampler.import_count == 0


def _mutations():
  """(attribute named in the error, mutation of a fresh spec) pairs."""
  m_s = M * S

  def setter(path, value_fn):
    def mutate(spec):
      obj = spec
      *parents, last = path.split(".")
      for p in parents:
        obj = getattr(obj, p)
      setattr(obj, last, value_fn(spec))
    return mutate

  def set_weight(which, value_fn):
    def mutate(spec):
      layer = getattr(spec.model.model.markov_head, which)
      layer.weight = torch.nn.Parameter(value_fn(spec), requires_grad=False)
    return mutate

  meta = torch.device("meta")
  return [
      ("spec.sample_idx_mapping",
       setter("sample_idx_mapping", lambda s: torch.zeros(m_s))),
      ("spec.sample_idx_mapping",
       setter("sample_idx_mapping",
              lambda s: torch.zeros(m_s - 1, dtype=torch.int32))),
      ("spec.sample_idx_mapping",
       setter("sample_idx_mapping",
              lambda s: torch.zeros(M, S + 1, dtype=torch.int32))),
      ("spec.sample_pos",
       setter("sample_pos",
              lambda s: torch.zeros(2 * m_s, dtype=torch.int64)[::2])),
      ("spec.seeds", setter("seeds", lambda s: torch.zeros(M))),
      ("spec.temperature", setter("temperature", lambda s: torch.zeros(M + 1))),
      ("spec.temperature",
       setter("temperature", lambda s: torch.zeros(M, dtype=torch.float64))),
      ("spec.input_buffers.input_ids",
       setter("input_buffers.input_ids",
              lambda s: torch.zeros(30, dtype=torch.int32, device=meta))),
      ("spec._anchor_idx",
       setter("_anchor_idx", lambda s: torch.zeros(M - 1, dtype=torch.int64))),
      ("spec.draft_logits.values",
       setter("draft_logits.values", lambda s: torch.zeros(M, S, V + 1))),
      ("spec.draft_logits.values",
       setter("draft_logits.values",
              lambda s: torch.zeros(M, S, V, dtype=torch.float16))),
      ("spec.draft_tokens",
       setter("draft_tokens",
              lambda s: torch.zeros(M, S - 1, dtype=torch.int64))),
      ("spec.draft_tokens",
       setter("draft_tokens", lambda s: torch.zeros(M, S))),
      ("spec.sample_indices",
       setter("sample_indices", lambda s: torch.zeros(m_s))),
      ("spec.model.model.markov_head.markov_w2.weight",
       set_weight("markov_w2",
                  lambda s: torch.zeros(V, R, dtype=torch.bfloat16))),
      ("spec.model.model.markov_head.markov_w1.weight",
       set_weight("markov_w1", lambda s: torch.zeros(V - 1, R))),
      ("spec.model.compute_draft_logits",
       setter("model.compute_draft_logits",
              lambda s: (lambda h: torch.zeros(h.shape[0], V + 2)))),
      ("spec.num_speculative_steps", setter("num_speculative_steps",
                                            lambda s: 0)),
      # Issue 16 probes.
      ("spec.draft_logits.values",
       setter("draft_logits.values",
              lambda s: torch.zeros(M, V, S).transpose(1, 2))),
      ("spec.draft_tokens",  # one memory location for every request
       setter("draft_tokens",
              lambda s: torch.zeros(1, S, dtype=torch.int64).expand(M, S))),
      ("spec.sample_idx_mapping",
       setter("sample_idx_mapping", lambda s: [0] * m_s)),
      ("spec.temperature", setter("temperature", lambda s: torch.ones(M - 1))),
      ("spec.seeds",
       setter("seeds", lambda s: torch.zeros(M, dtype=torch.float64))),
      ("spec.sample_pos", setter("sample_pos", lambda s: torch.ones(m_s))),
  ]


@pytest.mark.parametrize("name,mutate", _mutations(),
                         ids=[f"{i}-{n}" for i, (n, _) in
                              enumerate(_mutations())])
def test_bad_input_names_the_attribute(name, mutate):
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  sampler = _sampler_for(spec)
  hidden = spec.prepare(4)
  mutate(spec)
  snap = [t.clone() if isinstance(t, torch.Tensor) else None for t in
          (spec.draft_logits.values, spec.draft_tokens)]
  with pytest.raises(tb.BridgeInputError, match=name.replace(".", r"\.")):
    sampler(spec, 4, hidden)
  for t, t0 in zip((spec.draft_logits.values, spec.draft_tokens), snap):
    assert t0 is None or torch.equal(t, t0)  # nothing written


def test_bad_num_reqs_and_constructor_args():
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  sampler = _sampler_for(spec)
  hidden = spec.prepare(4)
  with pytest.raises(tb.BridgeInputError, match="num_reqs"):
    sampler(spec, M + 1, hidden)
  with pytest.raises(ValueError, match="dtype"):
    tb.FusedMarkovSampler(M, V, R, torch.int32)
  with pytest.raises(ValueError, match="on_capture"):
    tb.FusedMarkovSampler(M, V, R, "float32", on_capture="ignore")


def test_check_values():
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  sampler = _sampler_for(spec, check_values=True)
  _run_and_check(spec, sampler, 4, padding=(1,))
  hidden = spec.prepare(4)
  spec.sample_idx_mapping[S + 1] = 7  # request 1 would use two state rows
  with pytest.raises(tb.BridgeInputError, match="spec.sample_idx_mapping"):
    sampler(spec, 4, hidden)
  hidden = spec.prepare(4)
  spec.input_buffers.input_ids[spec._anchor_idx[2]] = V + 5  # past V_in
  with pytest.raises(tb.BridgeInputError, match="input_ids"):
    sampler(spec, 4, hidden)


# ----------------------------------------------------------------------------
# Issue 16: inputs that got a silent wrong answer or an error after writing.
# Each test below failed on the bridge before the fix (noted per test).
# ----------------------------------------------------------------------------


def _snapshot(spec):
  return spec.draft_logits.values.clone(), spec.draft_tokens.clone()


def _assert_nothing_written(spec, snap):
  cache0, tokens0 = snap
  assert torch.equal(spec.draft_logits.values, cache0)
  assert torch.equal(spec.draft_tokens, tokens0)


def _call_and_check(spec, sampler, n, hidden, x):
  """One hook call checked against the references on the inputs ``x``."""
  cache0, tokens0 = _snapshot(spec)
  assert sampler(spec, n, hidden) is True
  _check(spec, x, n, spec.draft_tokens.clone(), spec.draft_logits.values.clone(),
         cache0, tokens0, "cpu")


def _raises_nothing_written(spec, sampler, n, hidden, match):
  snap = _snapshot(spec)
  with pytest.raises(tb.BridgeInputError, match=match):
    sampler(spec, n, hidden)
  _assert_nothing_written(spec, snap)


ROWS4 = [5, 0, 3, 6]  # the state rows of requests 0..3


@pytest.mark.parametrize("bad", [-1.0, -1e-30, float("nan"), -float("inf")])
def test_i16_bad_temperature_checked(bad):
  # Before: no temperature check; the draw used the inverted (T < 0) or a
  # NaN distribution.
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  sampler = _sampler_for(spec, check_values=True)
  hidden = spec.prepare(4, rows=ROWS4)
  spec.temperature[ROWS4[2]] = bad
  _raises_nothing_written(spec, sampler, 4, hidden, r"spec\.temperature")
  # A bad temperature on a state row no request uses is not read.
  hidden = spec.prepare(4, rows=ROWS4)
  spec.temperature[7] = bad
  x = spec.inputs(4, hidden)
  t = x["temperature"].clone()
  x["temperature"] = t.masked_fill(~(t > 0), 0.0)  # row 7: for jm's checks
  _call_and_check(spec, sampler, 4, hidden, x)


def test_i16_bad_temperature_unchecked_is_greedy():
  # Before: T = -1 drew from the inverted distribution, NaN gave token 0.
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  sampler = _sampler_for(spec)
  hidden = spec.prepare(6, rows=[5, 0, 3, 6, 1, 2])
  spec.temperature[5] = -1.0
  spec.temperature[0] = float("nan")
  spec.temperature[3] = -float("inf")
  spec.temperature[6] = -0.25
  x = spec.inputs(6, hidden)
  t = x["temperature"]
  x["temperature"] = torch.where(t > 0, t, torch.zeros_like(t))
  assert int((x["temperature"] > 0).sum()) == M - 4
  _call_and_check(spec, sampler, 6, hidden, x)


def test_i16_duplicate_state_row_checked():
  # Before: accepted; the cache row kept one of the two requests' logits.
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  sampler = _sampler_for(spec, check_values=True)
  hidden = spec.prepare(4, rows=ROWS4)
  spec.sample_idx_mapping[2 * S:3 * S] = ROWS4[1]  # requests 1 and 2: row 0
  _raises_nothing_written(spec, sampler, 4, hidden,
                          r"spec\.sample_idx_mapping.*two requests")
  # One step only, the rest distinct (a mapping outside vLLM's layout that the
  # per-request check alone would not see as a duplicate).
  hidden = spec.prepare(4, rows=ROWS4)
  spec.sample_idx_mapping[3 * S:4 * S] = -1
  spec.sample_idx_mapping[3 * S + 1] = ROWS4[0]
  sampler_native_rule = _sampler_for(spec, check_values=True)
  sampler_native_rule._impl.one_row_per_request = False  # only the dup check
  _raises_nothing_written(spec, sampler_native_rule, 4, hidden,
                          r"spec\.sample_idx_mapping.*step 1 maps two")


def test_i16_duplicate_state_row_unchecked():
  # Documented (limitations.md): without check_values both requests draw
  # their own chain with the row's temperature and seed, and the row keeps
  # the logits of one of them (which one is unspecified).
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  sampler = _sampler_for(spec)
  hidden = spec.prepare(4, rows=[5, 0, 0, 6])
  x = spec.inputs(4, hidden)
  cache0, tokens0 = _snapshot(spec)
  assert sampler(spec, 4, hidden)
  want_tokens, want_logits = sd.torch_chain(spec, x)
  np.testing.assert_array_equal(spec.draft_tokens[:4], want_tokens)
  got = spec.draft_logits.values
  assert any(torch.allclose(got[0], want_logits[b], rtol=1e-5, atol=1e-4)
             for b in (1, 2))
  for row in (1, 2, 3, 4, 7):
    assert torch.equal(got[row], cache0[row])
  assert torch.equal(spec.draft_tokens[4:], tokens0[4:])


def test_i16_one_sampler_many_threads():
  # Before: 19-29 of 40-60 results were wrong (a shared padding buffer).
  import threading  # pylint: disable=g-import-not-at-top
  n_threads, calls = 4, 6
  specs = [sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R,
                               seed=10 + i) for i in range(n_threads)]
  sampler = _sampler_for(specs[0])
  sampler.warmup(specs[0])
  barrier = threading.Barrier(n_threads)
  records = [[] for _ in range(n_threads)]
  errors = []

  def work(i):
    try:
      spec = specs[i]
      barrier.wait()
      for k in range(calls):
        n = (3, 5, 6, 7, 8, 2)[(i + k) % 6]  # mostly padded buckets
        hidden = spec.prepare(n, padding=(k % n,) if k % 3 == 0 else ())
        # On CPU inputs() aliases temperature and seeds: copies, as the next
        # prepare() rewrites them.
        x = {k: v.clone() for k, v in spec.inputs(n, hidden).items()}
        cache0, tokens0 = _snapshot(spec)
        assert sampler(spec, n, hidden)
        records[i].append((n, x, spec.draft_tokens.clone(),
                           spec.draft_logits.values.clone(), cache0, tokens0))
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  assert sum(map(len, records)) == n_threads * calls
  for i, recs in enumerate(records):
    for n, x, tokens, cache, cache0, tokens0 in recs:
      _check(specs[i], x, n, tokens, cache, cache0, tokens0, "cpu")


@pytest.mark.parametrize("which", ["cache", "draft_tokens"])
def test_i16_inference_tensor_written_outside_inference_mode(which):
  # Before: torch raised RuntimeError after draft_tokens (and, for an
  # inference draft_tokens, nothing else) had been written.
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  sampler = _sampler_for(spec)
  name = r"spec\.draft_logits\.values" if which == "cache" else \
      r"spec\.draft_tokens"
  with torch.inference_mode():
    if which == "cache":
      spec.draft_logits.values = spec.draft_logits.values.clone()
    else:
      spec.draft_tokens = spec.draft_tokens.clone()
  hidden = spec.prepare(4)
  _raises_nothing_written(spec, sampler, 4, hidden, name + ".*inference")
  # Inside inference mode it works ...
  with torch.inference_mode():
    _run_and_check(spec, sampler, 5, padding=(2,))
  # ... and a buffer checked there is checked again outside.
  hidden = spec.prepare(4)
  _raises_nothing_written(spec, sampler, 4, hidden, name + ".*inference")


@pytest.mark.parametrize("bad", [0, -3, 2**31 + 1, 2**32 + 3, -2**32 + 5])
def test_i16_positions_checked(bad):
  # Before: only positions < 1 were refused; 2**31 + 1 and up were cut to
  # their low 32 bits.
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  sampler = _sampler_for(spec, check_values=True)
  hidden = spec.prepare(4)
  spec.sample_pos[S + 2] = bad
  _raises_nothing_written(spec, sampler, 4, hidden, r"spec\.sample_pos")


def test_i16_positions_unchecked_are_clamped():
  # Before: 2**32 + p drew with p's uniform (the low word).
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  sampler = _sampler_for(spec)
  hidden = spec.prepare(M)
  spec.temperature.fill_(30.0)  # nearly uniform draws: tokens follow u
  # Valid edge: 2**31 (key 2**31 - 1) is taken as is, also when checked.
  spec.sample_pos[:S] = 2**31
  x = spec.inputs(M, hidden)
  _call_and_check(spec, sampler, M, hidden, x)
  _call_and_check(spec, _sampler_for(spec, check_values=True), M, hidden, x)
  # Out of range: 2**32 + p, 2**31 + p, and <= 0 for some requests.
  pos = spec.sample_pos.view(M, S)
  wrapped = pos.clone()
  pos[1:5] += 2**32
  pos[5] += 2**31
  pos[6] = 0
  pos[7] = -2**32 + 7
  x = spec.inputs(M, hidden)
  x_clamped = dict(x, positions=x["positions"].clamp(0, 2**31 - 1))
  _call_and_check(spec, sampler, M, hidden, x_clamped)
  # ... and not the low word's uniforms.
  x_wrapped = dict(x, positions=(wrapped - 1).clamp(min=0))
  low_word, _ = sd.torch_chain(spec, x_wrapped)
  assert not torch.equal(spec.draft_tokens[1:6], low_word[1:6])


@pytest.mark.parametrize("num_reqs", [True, np.bool_(True), 3.0, np.float64(3),
                                      torch.tensor(True), "3", None])
def test_i16_num_reqs_must_be_an_int(num_reqs):
  # Before: True and np.bool_(True) were taken as 1.
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  sampler = _sampler_for(spec)
  hidden = spec.prepare(4)
  _raises_nothing_written(spec, sampler, num_reqs, hidden, "num_reqs")


def test_i16_out_of_range_rows_are_padding_unchecked():
  # Without check_values a state row outside [0, M) is padding: that request
  # writes nothing. Before: an int64 row 2**32 + r was cut to r and wrote
  # row r.
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R,
                             idx_dtype=torch.int64)
  sampler = _sampler_for(spec)
  hidden = spec.prepare(7, rows=[0, 1, 2, 3, 4, 5, 6])
  idx = spec.sample_idx_mapping.view(M, S)
  idx[1] = M
  idx[3] = M + 100
  idx[4] = -2
  idx[5] = 2**32 + 7   # row 7 is free: writing it would be seen
  idx[6] = -2**32 + 6
  x = spec.inputs(7, hidden)
  x["idx"] = torch.where((x["idx"] >= 0) & (x["idx"] < M), x["idx"], -1)
  assert int((x["idx"][:, 0] >= 0).sum()) == 2
  _call_and_check(spec, sampler, 7, hidden, x)
  # With check_values the same mapping is refused.
  _raises_nothing_written(spec, _sampler_for(spec, check_values=True), 7,
                          hidden, r"spec\.sample_idx_mapping")


def test_i16_wide_anchor_tokens_are_clamped_unchecked():
  # Before: an int64 anchor token 2**32 + t was cut to t.
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R,
                             ids_dtype=torch.int64)
  sampler = _sampler_for(spec)
  hidden = spec.prepare(4)
  v_in = spec.model.model.markov_head.markov_w1.weight.shape[0]
  ids = spec.input_buffers.input_ids
  aidx = spec._anchor_idx  # pylint: disable=protected-access
  ids[aidx[0]] = 2**32 + 3
  ids[aidx[1]] = -2**32 + 3
  ids[aidx[2]] = v_in + 1
  x = spec.inputs(4, hidden)
  x["anchors"] = x["anchors"].clamp(0, v_in - 1)
  assert x["anchors"][:3].tolist() == [v_in - 1, 0, v_in - 1]
  _call_and_check(spec, sampler, 4, hidden, x)
  _raises_nothing_written(spec, _sampler_for(spec, check_values=True), 4,
                          hidden, r"spec\.input_buffers\.input_ids")


@pytest.mark.parametrize("name,mutate", _mutations(),
                         ids=[f"{i}-{n}" for i, (n, _) in
                              enumerate(_mutations())])
def test_i16_bad_layout_with_check_values(name, mutate):
  # The layout is checked before the values are read. Before: a non-tensor
  # or short buffer gave an AttributeError or IndexError from the value
  # checks.
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R)
  sampler = _sampler_for(spec, check_values=True)
  hidden = spec.prepare(4)
  mutate(spec)
  with pytest.raises(tb.BridgeInputError, match=name.replace(".", r"\.")):
    sampler(spec, 4, hidden)


def test_preallocation_env_is_set():
  # Set on import unless the user chose a value.
  assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") is not None
  assert tb.check_preallocation() in (True, False)
  if jax.default_backend() == "cpu":
    assert tb.check_preallocation()


# ----------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU for torch and JAX")
@pytest.mark.parametrize("runtime", ["native", "jax"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_gpu_matches_jm_and_torch_loop(config, runtime):
  _, sampler = _matches(config, "cuda", "gpu", runtime=runtime)
  assert sampler.runtime == runtime
  if runtime == "jax":
    for slot in ("spec.seeds", "spec.sample_idx_mapping", "spec.temperature",
                 "spec.draft_logits.values",
                 "spec.model.model.markov_head.markov_w2.weight"):
      assert sampler.is_zero_copy(slot), slot


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU for torch and JAX")
@pytest.mark.parametrize("runtime", ["native", "jax"])
@pytest.mark.parametrize("side_stream", [False, True])
def test_gpu_stream_ordering(side_stream, runtime):
  """Torch writes queued right before the call are seen; results are seen
  by torch work queued right after; writes right after do not leak in."""
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R,
                             device="cuda")
  sampler = _sampler_for(spec, runtime=runtime)
  stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
  n = 6
  for trial in range(3):
    hidden = spec.prepare(n, padding=(trial,))
    x = spec.inputs(n, hidden)
    names = ("seeds", "temperature", "sample_idx_mapping", "sample_pos")
    real = {k: getattr(spec, k).clone() for k in names}
    real_ids = spec.input_buffers.input_ids.clone()
    cache0 = spec.draft_logits.values.clone()
    tokens0 = spec.draft_tokens.clone()
    # Garbage in every input, then the real values behind a long GPU sleep.
    spec.seeds.fill_(12345)
    spec.temperature.fill_(0.0)
    spec.sample_idx_mapping.fill_(0)
    spec.sample_pos.fill_(1)
    spec.input_buffers.input_ids.fill_(0)
    torch.cuda.synchronize()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
      torch.cuda._sleep(100_000_000)  # pylint: disable=protected-access
      for k in names:
        getattr(spec, k).copy_(real[k])
      spec.input_buffers.input_ids.copy_(real_ids)
      assert sampler(spec, n, hidden)
      # Right after: read the results, then clobber the inputs.
      got_tokens = spec.draft_tokens.clone()
      got_cache = spec.draft_logits.values.clone()
      spec.seeds.fill_(-1)
      spec.temperature.fill_(7.0)
      spec.input_buffers.input_ids.fill_(1)
    torch.cuda.synchronize()
    _check(spec, x, n, got_tokens.cpu(), got_cache.cpu(), cache0.cpu(),
           tokens0.cpu(), "gpu")
    for k in names:
      getattr(spec, k).copy_(real[k])


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU for torch and JAX")
def test_gpu_cpu_tensor_beside_cuda_ones():
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R,
                             device="cuda")
  sampler = _sampler_for(spec)
  hidden = spec.prepare(4)
  spec.seeds = spec.seeds.cpu()
  with pytest.raises(tb.BridgeInputError, match=r"spec\.seeds.*cpu"):
    sampler(spec, 4, hidden)


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU for torch and JAX")
def test_gpu_capture_is_refused_by_the_jax_runtime():
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R,
                             device="cuda")
  hidden = spec.prepare(4)
  torch.cuda.synchronize()
  for on_capture in ("raise", "fallback"):
    sampler = _sampler_for(spec, on_capture=on_capture, runtime="jax")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    result = []
    with torch.cuda.stream(stream):
      graph.capture_begin()
      try:
        result.append(sampler(spec, 4, hidden))
      except RuntimeError as e:
        result.append(e)
      finally:
        graph.capture_end()
    if on_capture == "raise":
      assert isinstance(result[0], RuntimeError)
      assert "capture" in str(result[0])
    else:
      assert result[0] is False
