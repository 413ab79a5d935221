"""Host overhead per call of torch_bridge.FusedMarkovSampler (run on a GPU).

Builds the speculator double of torch_bridge/testing.py on CUDA at serving
sizes (default: DeepSeek-V4-Flash-like V = 129280, R = 256; S = 5; bf16) and
measures, per batch size B:

* host_us: the hook's host time per call, GPU idle at the start of each call
  (synchronized before, never inside): what the call costs the CPU thread.
* base_us: the host time of the part the reference hook does as well (the
  ``head_hidden`` gather and ``compute_draft_logits``); bridge_us =
  host_us - base_us is what the bridge adds.
* phases_us: the same call split into its phases (a replica of __call__ that
  uses the sampler's internals): base logits (+ padding copy), cached-import
  lookups, the base import, the JAX dispatch, the two exports, the torch
  copies, the event.
* pipelined_us / gpu_us: back-to-back calls without synchronizing: wall time
  and GPU time (CUDA events) per call.
* eager_host_us / eager_pipelined_us: an eager torch loop of the same chain
  (S steps of embedding, GEMV, sampling, cache write), for scale.

Also reports which transfer fast paths are active, whether every cached
import is zero copy, and (with --probe-donation, in a subprocess) whether JAX
buffer donation can update a DLPack-imported torch buffer in place.

Run from the repository root on the GPU machine:

  python -m benchmarks.bridge_overhead \
      --out benchmarks/results/bridge_overhead.json

Options: --batches 1 64 48 (48 pads to the bucket 64), --vocab, --rank,
--steps, --hidden, --max-num-reqs, --dtype, --iters, --probe-donation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# torch_bridge first: it sets XLA_PYTHON_CLIENT_PREALLOCATE before JAX starts.
import torch_bridge as tb  # pylint: disable=g-import-not-at-top
from torch_bridge import dlpack as tbdl  # pylint: disable=g-import-not-at-top

import jax  # pylint: disable=g-import-not-at-top
import torch  # pylint: disable=g-import-not-at-top

from torch_bridge import testing as sd  # pylint: disable=g-import-not-at-top


_CUDA = True


def _sync():
  if _CUDA:
    torch.cuda.synchronize()


def _stats(samples_s):
  us = sorted(x * 1e6 for x in samples_s)
  return {"median": round(statistics.median(us), 2),
          "p10": round(us[len(us) // 10], 2),
          "p90": round(us[(9 * len(us)) // 10], 2)}


def host_time(fn, iters):
  """Host seconds per call of fn, with the GPU idle when each call starts."""
  out = []
  for _ in range(iters):
    _sync()
    t0 = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t0)
  _sync()
  return _stats(out)


def pipelined(fn, iters):
  """(wall us, GPU us) per call of back-to-back calls (GPU us: None on CPU)."""
  _sync()
  if _CUDA:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
        enable_timing=True)
    start.record()
  t0 = time.perf_counter()
  for _ in range(iters):
    fn()
  if _CUDA:
    end.record()
  _sync()
  wall = (time.perf_counter() - t0) / iters * 1e6
  if not _CUDA:
    return round(wall, 2), None
  return round(wall, 2), round(start.elapsed_time(end) * 1e3 / iters, 2)


def phases(sampler, spec, n, hidden, iters):  # pylint: disable=protected-access
  """Host time of each phase of a call (mirrors FusedMarkovSampler.__call__)."""
  names = ["base_logits", "cached_args", "import_base", "jax_dispatch",
           "exports", "torch_copies", "event"]
  acc = {k: [] for k in names}
  s_len = spec.num_speculative_steps
  held = []
  for _ in range(iters):
    _sync()
    held.clear()
    t = [time.perf_counter()]
    with torch.no_grad():
      base_src, base = sampler._base_logits(spec, n, s_len, hidden)
      t.append(time.perf_counter())
      args, layout = sampler._cached_args(spec, s_len)
      t.append(time.perf_counter())
      base_j = tbdl.import_tensor(base_src)
      t.append(time.perf_counter())
      ints, logits = tb._step(base_j, *args,
                              sampler._n_array(base_j.device, n),
                              layout=layout)
      t.append(time.perf_counter())
      ints_t = tbdl.export_array(ints)
      logits_t = tbdl.export_array(logits)
      t.append(time.perf_counter())
      bp = base_src.shape[0]
      rows = n * s_len
      dst = ints_t[:2 * bp * s_len].view(torch.int64)[:rows]
      tokens = ints_t[2 * bp * s_len:].view(bp, s_len)[:n]
      spec.draft_tokens[:n, :s_len].copy_(tokens)
      sampler._flat_cache(spec.draft_logits).index_copy_(0, dst,
                                                         logits_t[:rows])
      t.append(time.perf_counter())
      if _CUDA:
        torch.cuda.Event().record()
      t.append(time.perf_counter())
    held.append((base, base_src, base_j, ints, logits, ints_t, logits_t))
    for k, a, b in zip(names, t, t[1:]):
      acc[k].append(b - a)
  _sync()
  return {k: _stats(v)["median"] for k, v in acc.items()}


def eager_loop(spec, n, hidden):
  """An eager torch loop of the chain (the shape of the reference hook)."""
  s_len = spec.num_speculative_steps
  with torch.no_grad():
    base = spec.model.compute_draft_logits(
        hidden[spec.sample_indices[:n * s_len]]).view(n, s_len, -1)
    idx = spec.sample_idx_mapping.view(-1)[:n * s_len].view(n, s_len)
    prev = spec.input_buffers.input_ids[spec._anchor_idx[:n]]
    cache = spec.draft_logits.values
    for i in range(s_len):
      logits = base[:, i].float() + spec.model.markov_bias(
          spec.model.markov_embed(prev)).float()
      rows = idx[:, i].long().clamp_min(0)
      cache[rows, i] = logits
      y = logits / spec.temperature[rows].clamp_min(1e-5)[:, None]
      gumbel = -torch.log(-torch.log(torch.rand_like(y)))
      tok = (y + gumbel).argmax(dim=-1)
      spec.draft_tokens[:n, i] = tok
      prev = tok


def probe_donation():
  """Can a jitted update donate a DLPack-imported torch buffer in place?"""
  import warnings  # pylint: disable=g-import-not-at-top
  t = torch.zeros(1 << 20, device="cuda")
  ptr = t.data_ptr()
  arr = tbdl.import_tensor(t)
  fn = jax.jit(lambda c: c.at[0].set(1.0), donate_argnums=0)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      out = fn(arr)
      out.block_until_ready()
      res = {"error": None,
             "out_aliases_torch": out.unsafe_buffer_pointer() == ptr,
             "input_deleted": arr.is_deleted()}
      torch.cuda.synchronize()
      res["torch_sees_write"] = bool(t[0].item() == 1.0)
      globals()["_keep_alive"] = (out, t)  # never freed by JAX before exit
    except Exception as e:  # pylint: disable=broad-except
      res = {"error": f"{type(e).__name__}: {e}"}
  res["warnings"] = [str(w.message)[:200] for w in caught]
  return res


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 48])
  p.add_argument("--vocab", type=int, default=129280)
  p.add_argument("--rank", type=int, default=256)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--hidden", type=int, default=4096)
  p.add_argument("--max-num-reqs", type=int, default=256)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--iters", type=int, default=200)
  p.add_argument("--out", default=None)
  p.add_argument("--device", default="cuda",
                 help="cuda, or cpu to smoke-test the script")
  p.add_argument("--probe-donation", action="store_true")
  p.add_argument("--probe-donation-only", action="store_true",
                 help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.probe_donation_only:
    print(json.dumps(probe_donation()))
    return

  global _CUDA
  _CUDA = a.device == "cuda"
  dtype = getattr(torch, a.dtype)
  spec = sd.SpeculatorDouble(max_num_reqs=a.max_num_reqs, num_steps=a.steps,
                             vocab=a.vocab, rank=a.rank, hidden=a.hidden,
                             dtype=dtype, device=a.device)
  sampler = tb.FusedMarkovSampler(a.max_num_reqs, a.vocab, a.rank, dtype)
  report = {
      "device": torch.cuda.get_device_name() if _CUDA else "cpu",
      "jax": jax.__version__, "torch": torch.__version__,
      "shape": {"V": a.vocab, "R": a.rank, "S": a.steps, "H": a.hidden,
                "max_num_reqs": a.max_num_reqs, "dtype": a.dtype},
      "buckets": list(sampler.buckets),
      "env_XLA_PYTHON_CLIENT_PREALLOCATE":
          os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
      "batches": {},
  }
  for n in a.batches:
    hidden = spec.prepare(n)
    t0 = time.perf_counter()
    sampler(spec, n, hidden)  # compiles this bucket
    _sync()
    compile_s = time.perf_counter() - t0
    for _ in range(10):
      sampler(spec, n, hidden)
    s_len = a.steps

    def base_only(n=n, hidden=hidden):
      with torch.no_grad():
        spec.model.compute_draft_logits(hidden[spec.sample_indices[:n * s_len]])

    def hook(n=n, hidden=hidden):
      sampler(spec, n, hidden)

    def eager(n=n, hidden=hidden):
      eager_loop(spec, n, hidden)

    base_only()
    eager()
    host = host_time(hook, a.iters)
    base = host_time(base_only, a.iters)
    wall, gpu = pipelined(hook, a.iters)
    e_host = host_time(eager, max(a.iters // 4, 10))
    e_wall, e_gpu = pipelined(eager, max(a.iters // 4, 10))
    report["batches"][str(n)] = {
        "bucket": tb.buckets.bucket_for(sampler.buckets, n),
        "first_call_s": round(compile_s, 2),
        "host_us": host,
        "base_us": base,
        "bridge_us": round(host["median"] - base["median"], 2),
        "phases_us": phases(sampler, spec, n, hidden, a.iters),
        "pipelined_us": wall, "gpu_us": gpu,
        "eager_host_us": e_host, "eager_pipelined_us": e_wall,
        "eager_gpu_us": e_gpu,
    }
    print(f"B={n}: host {host['median']} us (base {base['median']}, bridge "
          f"+{report['batches'][str(n)]['bridge_us']}), pipelined {wall} us, "
          f"GPU {gpu} us; eager torch loop host {e_host['median']} us, "
          f"GPU {e_gpu} us", flush=True)
  report["imports_total"] = sampler.import_count
  report["zero_copy"] = {
      slot: sampler.is_zero_copy(slot) for slot in (
          "spec.model.model.markov_head.markov_w1.weight",
          "spec.model.model.markov_head.markov_w2.weight",
          "spec.input_buffers.input_ids", "spec._anchor_idx",
          "spec.temperature", "spec.seeds", "spec.sample_idx_mapping",
          "spec.sample_pos", "spec.draft_logits.values")}
  report["fast_import"] = tbdl._fast_import_ok
  report["fast_export"] = tbdl._fast_export_ok
  if a.probe_donation:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bridge_overhead",
                           "--probe-donation-only"], cwd=_ROOT,
                          capture_output=True, text=True, timeout=300,
                          check=False)
    lines = proc.stdout.strip().splitlines()
    try:
      report["donation_probe"] = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
      report["donation_probe"] = {"returncode": proc.returncode,
                                  "stderr": proc.stderr[-2000:]}
  text = json.dumps(report, indent=1)
  print(text)
  if a.out:
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
