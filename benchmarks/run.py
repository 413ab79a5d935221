"""The benchmark: S-step Markov sampling, jax_markov against its baselines.

Times, on one device, the whole S-step draft from given base logits (the
backbone forward is not timed) for each implementation:

  jax_markov              jm.sample_draft, one jitted call for all steps
  torch_bridge            torch_bridge.FusedMarkovSampler (the speculator
                          hook), eager, end to end from torch tensors through
                          torch_bridge.testing's speculator double
  torch_bridge_graph      the same hook captured in a torch.cuda.CUDAGraph
                          per batch size and replayed (native runtime only)
  seed_design             vLLM's FusedMarkovSampler as it is: nn.Linear bias
                          (bf16) + Triton block and select kernels, eager
  seed_design_graph       the same captured in a CUDA graph: THE baseline
                          speed claims are made against
  f32_bias_design         a float32-bias variant (bias GEMM to a float32
                          [B, V] buffer in HBM) + Triton passes, eager
  f32_bias_design_graph   the same captured in a CUDA graph
  vllm_loop               vLLM's unfused torch loop (Gumbel-max), eager
  vllm_loop_graph         the same captured in a CUDA graph
  plain_jax               jnp ops + jax.random.categorical in lax.scan, jit

Not in the defaults, for A/B rows in one run: jax_markov_xla_bias
(method="xla_bias"), jax_markov_fused (method="fused": the Triton block pass
where the table picks Mosaic GPU), jax_markov_mosaic (the configuration the
native runtime plans, where that is the Mosaic GPU pass: below the 256
bucket a JAX call takes the Triton pass by itself), jax_markov_into
(jm.sample_draft_into, the cache donated back call after call),
torch_bridge_mosaic_graph (the captured
hook with mosaic=True: the Mosaic GPU block pass, Hopper only) and
torch_bridge_triton_graph (mosaic=False: the Triton block pass everywhere).

Greedy drafting (tokens only, no cache; timed once, at temperature 0, and by
default only on dsv4 and dsv4r):

  jax_markov_greedy          jm.greedy_draft
  torch_bridge_greedy        the hook with spec.draft_logits = None, eager
                             (not in the defaults: the CPU tests' path)
  torch_bridge_greedy_graph  the same captured in a CUDA graph

A shape with a reduced draft vocabulary (Vd, e.g. dsv4r) runs jax_markov(_greedy)
with draft_to_target, the hook on a speculator double in vLLM's d2t mode
(its vocab_size Vd) and vllm_loop(_graph) over the Vd draft ids (vLLM runs
its unfused loop in this mode); seed_design, f32_bias_design and plain_jax
have no reduced-vocabulary form and are skipped there with a notice.

For torch_bridge and seed_design the row also has ``host_ms``: the host time
of one eager call (perf_counter around the call, no synchronize, the queue
drained before each call), median.

and the HBM floor: the bytes that must move (proj read once a step, base
read once, the float32 cache written once) over the device-to-device copy
bandwidth measured in the same run.

Each family runs in its own process (JAX; torch + Triton + CUDA graphs; the
torch bridge, which needs both), one after the other, each writing its rows to
a JSON file the parent merges into ``benchmarks/results/<device>.json``.
Before anything of a (shape, batch) is timed, every implementation's
temperature-0 tokens are checked against those of the first implementation
that ran (jax_markov when it runs): the synthetic inputs make every logit exact
in float32 (see :mod:`benchmarks.common`), so they must agree exactly.

Timing: warm-up calls first; then ``repeats`` calls in groups of ``group``
back-to-back calls; a group is timed with CUDA events (torch; the bridge with
its native runtime, whose launches are on torch's stream) or with
perf_counter up to block_until_ready of its last result (JAX; the bridge with
the JAX runtime, up to torch.cuda.synchronize()); the result is the median over groups of the
per-call time. Inputs smaller than twice the L2 cache are replicated and the
calls rotate through the copies, so no call reads operands left in L2.

Usage: ``python -m benchmarks [options]`` from the repository root.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

from benchmarks import common
from benchmarks.common import (ALL_IMPLS, BRIDGE_MOSAIC, FAMILIES,
                               FAMILY_ORDER, GREEDY_IMPLS, IMPLS, SHAPES,
                               Progress)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Without a GPU (interpret-mode Pallas, eager torch on CPU) larger shapes
# would take hours: they are skipped with a notice.
CPU_MAX_VOCAB = 32000
CPU_MAX_BATCH = 16
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m benchmarks",
      description="Time the S-step Markov sampling: jax_markov, the torch "
      "bridge, the seed design (vLLM's FusedMarkovSampler), its float32-bias "
      "variant, vLLM's loop and plain JAX, "
      "against the HBM floor.")
  p.add_argument("--shapes", default=None,
                 help="comma-separated of " + ",".join(SHAPES) +
                 " (default: " + ",".join(common.DEFAULT_SHAPES) + ")")
  p.add_argument("--batches", default=None,
                 help="comma-separated batch sizes (default: 1,4,16,64,256)")
  p.add_argument("--temperatures", default=None,
                 help="comma-separated temperatures (default: 0,1)")
  p.add_argument("--impls", default=None,
                 help="comma-separated of " + ",".join(ALL_IMPLS) +
                 " (default: all but jax_markov_xla_bias, "
                 "jax_markov_fused, jax_markov_mosaic, jax_markov_into, "
                 "torch_bridge_mosaic_graph, "
                 "torch_bridge_triton_graph and torch_bridge_greedy; the greedy ones only on " +
                 ",".join(common.GREEDY_DEFAULT_SHAPES) + " unless named)")
  p.add_argument("--repeats", type=int, default=None,
                 help="timed calls per point (default 100; 10 with --quick)")
  p.add_argument("--group", type=int, default=5,
                 help="back-to-back calls per timed group (default 5)")
  p.add_argument("--warmup", type=int, default=3,
                 help="untimed calls before timing (default 3)")
  p.add_argument("--warmup-s", type=float, default=common.WARMUP_S,
                 help="and at least this many seconds of untimed calls, so "
                 f"the GPU's clocks are up (default {common.WARMUP_S})")
  p.add_argument("--out", default=None,
                 help="results JSON (default: benchmarks/results/<device>.json;"
                 " <device>-quick.json with --quick)")
  p.add_argument("--merge", action="store_true",
                 help="add the new rows to an existing results file (rows of "
                 "the same impl, shape, batch and temperature are replaced), "
                 "so a long benchmark can run in parts")
  p.add_argument("--budget-s", type=float, default=None,
                 help="wall-clock budget in seconds: no new (shape, batch) or "
                 "process starts after it; what ran is written")
  p.add_argument("--quick", action="store_true",
                 help="smoke test: small shape, batches 1,4, few repeats")
  p.add_argument("--report", dest="report", action="store_true", default=None,
                 help="write docs/benchmarks.md (default: on, "
                 "except with --quick)")
  p.add_argument("--no-report", dest="report", action="store_false")
  p.add_argument("--plot", action="store_true",
                 help="with the report, also write docs/benchmarks.png "
                 "(matplotlib; not committed: over 100 KB)")
  p.add_argument("--docs-dir", default=os.path.join(ROOT, "docs"),
                 help="where the report goes (default: docs/)")
  # Internal: run one family in this process.
  p.add_argument("--worker", choices=sorted(set(FAMILIES.values())),
                 help=argparse.SUPPRESS)
  p.add_argument("--config", help=argparse.SUPPRESS)
  p.add_argument("--result", help=argparse.SUPPRESS)
  return p


def main(argv=None) -> int:
  """Runs the benchmark (see the module docstring); returns the exit status.

  0: all ran and every checked implementation drew the reference tokens at
  temperature 0; 1: some temperature-0 tokens disagreed (results still
  written); 2: bad arguments; 3: no family produced any result.
  """
  args = _parser().parse_args(argv)
  if args.worker:
    return _worker_main(args)
  return _parent_main(args)


# ---------------------------------------------------------------------------
# The parent: spawns one process per family, merges, writes, reports.

def _parent_main(args) -> int:
  start = time.time()
  progress = Progress(start)
  quick = args.quick
  plan = dict(
      shapes=common.parse_list(args.shapes, ("small",) if quick
                               else common.DEFAULT_SHAPES),
      batches=common.parse_list(args.batches, (1, 4) if quick
                                else common.DEFAULT_BATCHES, int),
      temperatures=common.parse_list(args.temperatures,
                                     common.DEFAULT_TEMPERATURES, float),
      repeats=args.repeats or (10 if quick else 100),
      warmup=min(args.warmup, 2) if quick else args.warmup,
      warmup_s=0.0 if quick else args.warmup_s,
      group=args.group, start_time=start,
      # Greedy impls from the defaults run only on these shapes.
      greedy_shapes=(None if args.impls is not None
                     else list(common.GREEDY_DEFAULT_SHAPES)),
      deadline=start + args.budget_s if args.budget_s else None)
  impls = common.parse_list(args.impls, IMPLS)
  bad = ([s for s in plan["shapes"] if s not in SHAPES]
         + [i for i in impls if i not in FAMILIES])
  if (bad or not plan["batches"] or not plan["temperatures"]
      or any(t < 0 for t in plan["temperatures"])
      or any(b < 1 for b in plan["batches"])):
    print(f"bench: unknown or bad arguments: "
          f"{bad or (plan['batches'], plan['temperatures'])}", file=sys.stderr)
    return 2
  families = [f for f in FAMILY_ORDER if any(FAMILIES[i] == f for i in impls)]
  # The bandwidth comes from the torch process when there is one.
  bw_family = "torch" if "torch" in families else families[0]
  merged = dict(rows=[], tokens={}, notices=[], mismatches=[],
                sampled_mismatches=[], uniforms={}, devices={}, backends={},
                bandwidth_gbs=None)
  progress(f"shapes {plan['shapes']}, batches {plan['batches']}, "
           f"temperatures {plan['temperatures']}, repeats {plan['repeats']}; "
           f"families in order: {families}")
  with tempfile.TemporaryDirectory(prefix="jax_markov_bench_") as workdir:
    for fam in families:
      if plan["deadline"] and time.time() > plan["deadline"]:
        merged["notices"].append(f"time budget reached: the {fam} process "
                                 "was not started")
        progress(merged["notices"][-1])
        continue
      cfg = dict(plan, family=fam,
                 impls=[i for i in impls if FAMILIES[i] == fam],
                 ref_tokens=merged["tokens"], uniforms=merged["uniforms"],
                 measure_bandwidth=(fam == bw_family))
      res = _run_worker(fam, cfg, workdir, progress, merged["notices"])
      if res is None:
        continue
      merged["rows"] += res["rows"]
      merged["tokens"].update(res["tokens"])
      merged["uniforms"].update(res["uniforms"])
      merged["notices"] += [n for n in res["notices"]
                            if n not in merged["notices"]]
      merged["mismatches"] += res["mismatches"]
      merged["sampled_mismatches"] += res["sampled_mismatches"]
      merged["devices"][fam] = res.get("device")
      merged["backends"][fam] = res.get("backend")
      if res.get("bandwidth_gbs"):
        merged["bandwidth_gbs"] = res["bandwidth_gbs"]
      if merged["rows"]:  # what ran so far survives a later crash or kill
        _write_rows(args, merged, progress)
  return _finish(args, merged, progress)


def _run_worker(fam, cfg, workdir, progress, notices):
  """Runs one family's process; returns its result dict (None if it wrote
  none). Rows written before a crash are kept."""
  cfg_path = os.path.join(workdir, f"{fam}.config.json")
  res_path = os.path.join(workdir, f"{fam}.result.json")
  common.write_json(cfg_path, cfg)
  env = dict(os.environ)  # ``-m`` from ROOT: this checkout's packages
  if fam == "bridge":
    # torch and JAX share the GPU: JAX must not grab 75% of it up front.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  progress(f"starting the {fam} process")
  rc = subprocess.run(
      [sys.executable, "-m", "benchmarks.run", "--worker", fam,
       "--config", cfg_path, "--result", res_path],
      cwd=ROOT, env=env).returncode
  if rc != 0:
    notices.append(f"the {fam} process exited with status {rc}; its rows so "
                   "far are kept")
    progress(notices[-1])
  if not os.path.exists(res_path):
    return None
  with open(res_path) as f:
    return json.load(f)


def _write_rows(args, merged, progress):
  """Completes the rows (device, floor) and writes the results file.

  Returns (path, rows written).
  """
  device = (merged["devices"].get("torch") or merged["devices"].get("jax")
            or merged["devices"].get("bridge") or "unknown")
  bw = merged["bandwidth_gbs"]
  for row in merged["rows"]:
    row["device"] = device
    shape = SHAPES[row["shape"]]
    row["floor_bytes"] = common.floor_bytes(
        shape, row["batch"], cache=row["impl"] not in GREEDY_IMPLS)
    row["copy_bw_gbs"] = bw
    row["floor_ms"] = (row["floor_bytes"] / (bw * 1e9) * 1e3) if bw else None
  out = args.out or os.path.join(
      RESULTS_DIR, common.device_slug(device) + ("-quick" if args.quick else "")
      + ".json")
  rows = merged["rows"]
  if args.merge and os.path.exists(out):
    with open(out) as f:
      old = json.load(f)
    new_keys = {_row_key(r) for r in rows}
    kept = [r for r in old if _row_key(r) not in new_keys]
    progress(f"merging with {len(kept)} rows kept from {out}")
    rows = kept + rows
  shape_order = {n: k for k, n in enumerate(SHAPES)}
  order = {n: k for k, n in enumerate(ALL_IMPLS)}
  rows.sort(key=lambda r: (shape_order.get(r["shape"], 99), r["temperature"],
                           r["batch"], order.get(r["impl"], 99)))
  common.write_json(out, rows)
  progress(f"wrote {len(rows)} rows to {out}")
  return out, rows


def _finish(args, merged, progress) -> int:
  """Writes the merged rows (and the report); returns the exit status."""
  if not merged["rows"]:
    progress("no results: nothing was timed")
    for n in merged["notices"]:
      print("  notice: " + n, file=sys.stderr)
    return 3
  out, rows = _write_rows(args, merged, progress)
  bw = merged["bandwidth_gbs"]

  from benchmarks import report
  print(report.text_summary(rows))
  if bw:
    print(f"copy bandwidth measured in this run: {bw / 1e3:.2f} TB/s")
  if "cpu" in merged["backends"].values():
    print("NOTICE: no GPU here; these are CPU timings of what can run on CPU "
          "(interpret-mode Pallas, eager torch). GPU timings need a GPU.")
  for n in merged["notices"]:
    print("notice: " + n)
  on_cpu = "cpu" in merged["backends"].values()
  # By default only a full GPU run rewrites docs/benchmarks.md.
  if args.report if args.report is not None else not (args.quick or on_cpu):
    md, png = report.write_report(out, args.docs_dir,
                                 with_plot=args.plot)
    progress(f"wrote {md}" + (f" and {png}" if png else ""))
  for m in merged["sampled_mismatches"]:
    print(f"note: sampled tokens (same uniforms) differ: {m}")
  if merged["mismatches"]:
    print(f"TOKEN MISMATCH at temperature 0 ({len(merged['mismatches'])}):")
    for m in merged["mismatches"]:
      print(f"  {m}")
    return 1
  checked = sum(1 for r in merged["rows"] if r.get("tokens_match") is not None)
  print(f"temperature-0 tokens: all implementations agree ({checked} rows "
        "checked)")
  return 0


def _row_key(row):
  return (row["impl"], row["shape"], row["batch"], row["temperature"])


# ---------------------------------------------------------------------------
# The workers.

class _Result:
  """A worker's results, rewritten to disk after every change."""

  def __init__(self, path, ref_tokens):
    self.path = path
    self.data = dict(rows=[], tokens=dict(ref_tokens), notices=[],
                     mismatches=[], sampled_mismatches=[], uniforms={},
                     device=None, backend=None, bandwidth_gbs=None)

  def save(self):
    common.write_json(self.path, self.data)

  def notice(self, msg, progress):
    if msg not in self.data["notices"]:
      self.data["notices"].append(msg)
      progress("notice: " + msg)
    self.save()


class _Prepared:
  """One implementation bound to its inputs at one (shape, batch, T).

  calls: zero-argument callables, one per input set, rotated while timing;
  tokens(): runs the call on input set 0 and returns its tokens as a nested
  list [B][S]; meta: extra row fields; host_timed: also measure the host
  time of one call (``host_ms``), for the eager torch_bridge and seed_design.
  keep: what the calls use but do not reference. A captured graph's replay
  holds the graph, not the objects whose buffers it reads and writes (a
  hook's scratch): they must live as long as the call does, or their memory
  goes back to the allocator and a replay writes into whatever holds it next
  (or, after ``empty_cache``, faults with an illegal memory access).
  """

  def __init__(self, calls, tokens, meta=None, host_timed=False, keep=()):
    self.calls, self.tokens, self.meta = calls, tokens, meta or {}
    self.host_timed = host_timed
    self.keep = keep


# Eager rows that also get ``host_ms``: the host time of one call.
_HOST_TIMED = ("torch_bridge", "seed_design")


def _worker_main(args) -> int:
  with open(args.config) as f:
    cfg = json.load(f)
  fam = cfg["family"]
  progress = Progress(cfg["start_time"], prefix=f" [{fam}]")
  result = _Result(args.result, cfg["ref_tokens"])
  result.save()
  try:
    runner = {"jax": _JaxFamily, "torch": _TorchFamily,
              "bridge": _BridgeFamily}[fam](cfg, result, progress)
    if runner.available:
      _run_family(cfg, runner, result, progress)
  except Exception:  # noqa: BLE001 -- report, keep the rows so far
    result.notice(f"{fam} process failed: {traceback.format_exc(limit=8)}",
                  progress)
    return 1
  return 0


def _run_family(cfg, runner, result, progress):
  """Checks and times every (shape, batch, temperature, impl) of a family."""
  if cfg["measure_bandwidth"]:
    bw = runner.bandwidth_gbs()
    result.data["bandwidth_gbs"] = bw
    progress(f"copy bandwidth {bw / 1e3:.3f} TB/s")
    result.save()
  temps = cfg["temperatures"]
  greedy_shapes = cfg.get("greedy_shapes")
  for shape_name in cfg["shapes"]:
    shape = SHAPES[shape_name]
    impls = [i for i in cfg["impls"]
             if i not in GREEDY_IMPLS or greedy_shapes is None
             or shape_name in greedy_shapes]
    if not runner.is_gpu and shape.V > CPU_MAX_VOCAB:
      result.notice(f"shape {shape.name} skipped: no GPU, and on CPU only "
                    f"shapes with V <= {CPU_MAX_VOCAB} run", progress)
      continue
    for batch in cfg["batches"]:
      if cfg.get("deadline") and time.time() > cfg["deadline"]:
        result.notice("time budget reached: the remaining shapes and "
                      "batches were not run", progress)
        return
      if not runner.is_gpu and batch > CPU_MAX_BATCH:
        result.notice(f"B={batch} skipped: no GPU, and on CPU only B <= "
                      f"{CPU_MAX_BATCH} runs", progress)
        continue
      n_sets = common.num_input_sets(shape, batch) if runner.is_gpu else 1
      runner.make_inputs(shape, batch, n_sets)
      key = f"{shape.name}|{batch}"
      # 1. The temperature-0 tokens of every impl, before any timing.
      prepared, match = {}, {}
      for impl in impls:
        try:
          prep = runner.prepare(impl, shape, batch, 0.0)
          tokens = prep.tokens()
        except _Skip as e:
          result.notice(f"{impl} skipped: {e}", progress)
          continue
        except Exception:  # noqa: BLE001 -- one impl failing is reported
          _failed(result, progress, impl, key, 0.0)
          continue
        match[impl] = _check_tokens(result, key, impl, tokens, progress)
        if 0.0 in temps or impl in GREEDY_IMPLS:
          prepared[impl] = prep
      # 2. Timing.
      for temp_k, temp in enumerate(temps):
        for impl in impls:
          if impl not in match:
            continue
          greedy = impl in GREEDY_IMPLS
          if greedy and temp_k:
            continue  # tokens only: timed once, as temperature 0
          prep = (prepared.pop(impl, None) if temp == 0.0 or greedy
                  else None)
          try:
            if prep is None:
              prep = runner.prepare(impl, shape, batch, temp)
            sampled = None
            if temp > 0 and not greedy and runner.same_rng(impl, key):
              # Same RNG contract (uniforms from seeds and positions): the
              # sampled tokens are comparable too; a difference is reported,
              # not fatal (float32 rounding of the CDF may differ at a
              # boundary).
              sampled = _check_tokens(result, f"{key}|T={temp:g}", impl,
                                      prep.tokens(), progress, hard=False)
            ms, groups = runner.time(prep, cfg["repeats"], cfg["group"],
                                     cfg["warmup"], cfg.get("warmup_s", 0.0))
          except Exception:  # noqa: BLE001 -- one impl failing is reported
            _failed(result, progress, impl, key, temp)
            prep = None
            runner.release()
            continue
          timed = groups * max(1, min(cfg["group"], cfg["repeats"]))
          row = dict(impl=impl, shape=shape.name, V=shape.V, R=shape.R,
                     S=shape.S, dtype=shape.dtype, batch=batch,
                     temperature=0.0 if greedy else temp, median_ms=ms,
                     floor_ms=None,
                     device=result.data["device"], tokens_match=match[impl],
                     sampled_match=sampled,
                     n_input_sets=len(prep.calls), repeats=timed,
                     **prep.meta)
          if shape.Vd is not None:
            row["Vd"] = shape.Vd
          result.data["rows"].append(row)
          result.save()
          progress(f"{shape.name} B={batch:<3d} "
                   f"T={'-' if greedy else f'{temp:g}'} {impl:<25s} "
                   f"{ms:9.4f} ms")
          del prep
          runner.release()
      runner.release(inputs=True)


def _failed(result, progress, impl, key, temp):
  """Records that ``impl`` raised at (key, temp); the run goes on."""
  result.notice(f"{impl} failed at {key} T={temp:g}: "
                f"{traceback.format_exc(limit=6)}", progress)


def _check_tokens(result, key, impl, tokens, progress, hard=True):
  """Compares ``tokens`` with the first recorded for ``key``; records them.

  Args:
    result: the worker's results (holds the tokens recorded so far).
    key: what was drawn ("shape|batch", "|T=..." for sampled draws).
    impl: the implementation that drew ``tokens`` (nested list [B][S]).
    progress: the progress printer.
    hard: a difference is a failure (temperature 0) rather than a note.

  Returns:
    True when the tokens equal the first recorded (or are the first).
  """
  ref = result.data["tokens"].get(key)
  if ref is None:
    result.data["tokens"][key] = dict(impl=impl, tokens=tokens)
    result.save()
    return True
  diff = sum(a != b for ra, rb in zip(tokens, ref["tokens"])
             for a, b in zip(ra, rb))
  if len(tokens) != len(ref["tokens"]):
    diff = max(diff, 1)
  if diff:
    what = "temperature-0" if hard else "sampled"
    msg = (f"{key}: {impl} differs from {ref['impl']} in {diff} of "
           f"{len(tokens) * len(tokens[0])} {what} tokens")
    result.data["mismatches" if hard else "sampled_mismatches"].append(msg)
    progress(("TOKEN MISMATCH " if hard else "note: ") + msg)
  result.save()
  return diff == 0


class _Skip(Exception):
  """An implementation that cannot run here; the message says why."""


class _TorchFamily:
  """seed_design, f32_bias_design and vllm_loop (each also _graph); never
  imports JAX."""

  def __init__(self, cfg, result, progress):
    import torch
    self.torch = torch
    self.available = True
    self.is_gpu = torch.cuda.is_available()
    self.device = torch.device("cuda" if self.is_gpu else "cpu")
    result.data["backend"] = "gpu" if self.is_gpu else "cpu"
    result.data["device"] = (torch.cuda.get_device_name(self.device)
                             if self.is_gpu else "cpu")
    self.result, self.progress = result, progress
    self.uniforms = cfg["uniforms"]
    self.sets = []
    self.triton_error = None
    try:
      import triton  # noqa: F401 -- the Triton baselines need it
    except Exception as e:  # noqa: BLE001 -- no triton: skip its impls
      self.triton_error = f"{type(e).__name__}: {e}"
    if not self.is_gpu:
      result.notice("torch sees no GPU: CUDA graphs and compiled Triton "
                    "kernels are skipped; GPU timings need a GPU", progress)

  def bandwidth_gbs(self) -> float:
    torch = self.torch
    if not self.is_gpu:
      n = 1 << 27
      src = torch.ones(n, dtype=torch.uint8)
      dst = torch.empty_like(src)
      times = []
      for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
      return 2 * n / min(times) / 1e9
    n = 1 << 30  # 1 GiB read + 1 GiB written per copy
    src = torch.ones(n, dtype=torch.uint8, device=self.device)
    dst = torch.empty_like(src)
    for _ in range(3):
      dst.copy_(src)
    ev = [(torch.cuda.Event(enable_timing=True),
           torch.cuda.Event(enable_timing=True)) for _ in range(20)]
    for a, b in ev:
      a.record()
      dst.copy_(src)
      b.record()
    torch.cuda.synchronize()
    ms = sorted(a.elapsed_time(b) for a, b in ev)[len(ev) // 2]
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3) / 1e9

  def make_inputs(self, shape, batch, n_sets):
    torch = self.torch
    self.sets = []
    gen = torch.Generator(device=self.device).manual_seed(0)
    # jax_markov's uniforms when its process recorded them (the Triton
    # designs then draw the same tokens), else any uniforms: the time of a
    # draw does not depend on them.
    u = self.uniforms.get(f"{shape.name}|{batch}")
    for k in range(n_sets):
      d = common.torch_inputs(shape, batch, k, self.device)
      d["uniforms"] = (
          torch.tensor(u, dtype=torch.float32, device=self.device)
          if u is not None else torch.rand((batch, shape.S), generator=gen,
                                           device=self.device))
      self.sets.append(d)

  def same_rng(self, impl, key):
    """Whether ``impl`` draws with jax_markov's uniforms for ``key``."""
    return (impl.startswith(("seed_design", "f32_bias_design"))
            and key in self.uniforms)

  def prepare(self, impl, shape, batch, temp):
    torch = self.torch
    graph = impl.endswith("_graph")
    if graph and not self.is_gpu:
      raise _Skip("CUDA graphs need a GPU")
    temperature = torch.full((batch,), temp, dtype=torch.float32,
                             device=self.device)
    if shape.Vd is not None and impl.startswith("seed_design"):
      raise _Skip(f"no reduced-vocabulary form on {shape.name}: vLLM's fused "
                  "sampler does not cover this mode (it declines a d2t "
                  "map); vllm_loop is the baseline there")
    if shape.Vd is not None and impl.startswith("f32_bias_design"):
      raise _Skip(f"no reduced-vocabulary form on {shape.name} (a variant "
                  "of vLLM's fused sampler, which declines this mode)")
    if impl.startswith(("seed_design", "f32_bias_design")):
      if self.triton_error:
        raise _Skip(f"triton is not importable ({self.triton_error})")
      if not self.is_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise _Skip("the Triton kernels need a GPU (or TRITON_INTERPRET=1)")
      if impl.startswith("seed_design"):
        from benchmarks.baselines.seed_design import SeedDesignSampler
        samplers = [SeedDesignSampler(d["embed"], d["proj"], d["base"],
                                      d["anchors"], temperature, d["uniforms"])
                    for d in self.sets]
        meta = dict(block=samplers[0].block, num_warps=samplers[0].num_warps,
                    launches=samplers[0].launches_per_draft)
      else:
        from benchmarks.baselines.f32_bias_design import F32BiasDesignSampler
        samplers = [F32BiasDesignSampler(d["embed"], d["proj"], d["base"],
                                         d["anchors"], temperature,
                                         d["uniforms"]) for d in self.sets]
        meta = dict(block=samplers[0].block, bias_gemm=samplers[0].gemm)
    else:
      from benchmarks.baselines.vllm_loop import VllmLoopSampler
      samplers = [VllmLoopSampler(d["embed"], d["proj"], d["base"],
                                  d["anchors"], temperature, temp == 0.0,
                                  targets=d.get("targets"),
                                  target_vocab=shape.V)
                  for d in self.sets]
      meta = {}
      if shape.Vd is not None:
        meta["note"] = ("vLLM's unfused loop in its d2t mode: draft logits "
                        "scattered into a -inf target row of the cache, "
                        "argmax / Gumbel-max over the Vd draft logits, token "
                        "mapped to its target id")
    if graph:
      calls = [s.capture().replay for s in samplers]
    else:
      calls = [s.run_steps for s in samplers]

    def tokens():
      calls[0]()
      return samplers[0].tokens.cpu().tolist()
    return _Prepared(calls, tokens, meta,
                     host_timed=impl in _HOST_TIMED and self.is_gpu,
                     keep=samplers)

  def time(self, prep, repeats, group, warmup, warmup_s):
    torch = self.torch
    run = common.round_robin(prep.calls)
    common.warm_up(run, warmup, warmup_s,
                   sync=torch.cuda.synchronize if self.is_gpu else None)
    if not self.is_gpu:
      return common.wall_clock_median(run, repeats, group)
    torch.cuda.synchronize()
    group = max(1, min(group, repeats))
    events = []
    for _ in range(max(1, repeats // group)):
      a = torch.cuda.Event(enable_timing=True)
      b = torch.cuda.Event(enable_timing=True)
      a.record()
      run(group)
      b.record()
      events.append((a, b))
    torch.cuda.synchronize()
    ms = statistics.median(a.elapsed_time(b) / group for a, b in events)
    self._host_time(prep, repeats)
    return ms, len(events)

  def _host_time(self, prep, repeats):
    """Adds ``host_ms`` to the row of an eager impl that asks for it."""
    if prep.host_timed:
      prep.meta["host_ms"] = common.host_call_median_ms(
          prep.calls, repeats, self.torch.cuda.synchronize)

  def release(self, inputs=False):
    if inputs:
      self.sets = []
    if self.is_gpu:
      self.torch.cuda.synchronize()
      self.torch.cuda.empty_cache()


class _JaxFamily:
  """jax_markov and plain_jax; never imports torch."""

  def __init__(self, cfg, result, progress):
    import jax
    self.jax = jax
    self.available = True
    self.is_gpu = jax.default_backend() == "gpu"
    dev = jax.devices()[0]
    result.data["backend"] = "gpu" if self.is_gpu else jax.default_backend()
    result.data["device"] = dev.device_kind if self.is_gpu else "cpu"
    self.result, self.progress = result, progress
    self.sets = []
    self.jm_error = None
    try:
      import jax_markov as jm
      if not hasattr(jm, "sample_draft"):
        raise ImportError("jax_markov has no sample_draft")
      self.jm = jm
    except Exception as e:  # noqa: BLE001 -- report and skip jax_markov
      self.jm_error = f"{type(e).__name__}: {e}"
    if not self.is_gpu:
      result.notice("JAX sees no GPU: jax_markov runs its Pallas kernels in "
                    "interpret mode; GPU timings need a GPU", progress)

  def bandwidth_gbs(self) -> float:
    jax = self.jax
    import jax.numpy as jnp
    n = (1 << 28) if self.is_gpu else (1 << 25)  # uint32 words
    x = jnp.ones((n,), jnp.uint32)
    f = jax.jit(lambda v: v + 1)
    f(x).block_until_ready()
    times = []
    for _ in range(10):
      t0 = time.perf_counter()
      f(x).block_until_ready()
      times.append(time.perf_counter() - t0)
    return 2 * 4 * n / sorted(times)[len(times) // 2] / 1e9

  def make_inputs(self, shape, batch, n_sets):
    import numpy as np
    import jax.numpy as jnp
    self.sets = [common.jax_inputs(shape, batch, k) for k in range(n_sets)]
    seeds, positions = common.seeds_and_positions(batch, shape.S)
    self.positions = jnp.asarray(positions)
    self.seeds = seeds
    self.words = None
    if self.jm_error is None:
      from jax_markov import rng
      # Already split on the host once: no host work inside the timed calls.
      self.words = rng.seed_words(np.asarray(seeds))
      self.result.data["uniforms"][f"{shape.name}|{batch}"] = np.asarray(
          rng.uniforms_from_words(self.words, self.positions)).tolist()
    self.jax.block_until_ready(self.sets)

  def same_rng(self, impl, key):
    """Whether ``impl`` follows the RNG contract (jax_markov's uniforms)."""
    del key
    return impl.startswith("jax_markov")

  def prepare(self, impl, shape, batch, temp):
    import numpy as np
    import jax.numpy as jnp
    temperature = jnp.full((batch,), temp, jnp.float32)
    if impl == "jax_markov_greedy" or (impl == "jax_markov"
                                       and shape.Vd is not None):
      if self.jm_error:
        raise _Skip(f"jax_markov is not available ({self.jm_error})")
      return self._prepare_mapped(impl == "jax_markov_greedy", shape, batch,
                                  temperature)
    if impl.startswith("jax_markov"):
      if self.jm_error:
        raise _Skip(f"jax_markov.sample_draft is not available "
                    f"({self.jm_error})")
      if shape.Vd is not None:
        raise _Skip(f"{impl} has no reduced-vocabulary form here")
      jm = self.jm
      kwargs, meta = _jm_kwargs(jm.sample_draft, shape, batch)
      for forced in ("xla_bias", "fused"):
        if impl == f"jax_markov_{forced}":
          kwargs["method"] = forced
          meta = _jm_kwargs(jm.sample_draft, shape, batch, forced)[1]
      if impl == "jax_markov_mosaic":
        cfg = _native_mosaic_config(shape, batch)
        kwargs["config"] = cfg
        meta = dict(meta, config=str(cfg), method=cfg.method)
      heads = [jm.MarkovHead(d["embed"], d["proj"]) for d in self.sets]
      if impl == "jax_markov_into":
        calls, tok = self._into_calls(shape, batch, temperature, heads,
                                      kwargs)
        meta = dict(meta, timed="jm.sample_draft_into (cache donated back "
                    "call after call)")
      else:
        calls = [
            (lambda d=d, h=h: jm.sample_draft(d["base"], d["anchors"], h,
                                              temperature, self.words,
                                              self.positions, **kwargs))
            for d, h in zip(self.sets, heads)]
        tok = lambda out: out.tokens  # noqa: E731
    else:
      if shape.Vd is not None:
        raise _Skip(f"no reduced-vocabulary form on {shape.name}")
      from benchmarks.baselines import plain_jax
      key = self.jax.random.PRNGKey(0)
      calls = [
          (lambda d=d: plain_jax.sample(d["base"], d["anchors"], d["embed"],
                                        d["proj"], temperature, key,
                                        greedy=temp == 0.0))
          for d in self.sets]
      tok = lambda out: out[0]  # noqa: E731
      meta = {}

    def tokens():
      return np.asarray(tok(calls[0]())).tolist()
    return _Prepared(calls, tokens, meta)

  def _into_calls(self, shape, batch, temperature, heads, kwargs):
    """jm.sample_draft_into over one float32 [B, S, V] cache that every call
    donates and gets back (identity idx_map, one state row a request): the
    cache stays at one address, as in a serving loop, where jax_markov's
    rows allocate a new cache a call. The calls share that cache, so they
    run in order (round_robin does)."""
    import jax.numpy as jnp
    jm = self.jm
    S, V = shape.S, shape.V
    idx_map = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None],
                               (batch, S))
    state = {"cache": jnp.zeros((batch, S, V), jnp.float32)}

    def call(d, h):
      tokens, state["cache"] = jm.sample_draft_into(
          state["cache"], d["base"], d["anchors"], h, temperature,
          self.words, idx_map, self.positions, **kwargs)
      return tokens
    calls = [(lambda d=d, h=h: call(d, h)) for d, h in zip(self.sets, heads)]
    return calls, (lambda out: out)

  def _prepare_mapped(self, greedy, shape, batch, temperature):
    """jax_markov with a reduced vocabulary (jm.sample_draft with
    draft_to_target, target_vocab=V) or greedy (jm.greedy_draft, either
    vocabulary).

    The tokens come from the public call. With a map, the timed calls are the
    jitted draft behind it with the map checked once and on the device (for
    greedy_draft known increasing, permute=False): the public call re-checks
    a NumPy map on the host every call (np.unique over Vd ids, ~1.5 ms at
    Vd = 32768 on a 2-core host) and re-uploads it; a serving loop holds its
    map fixed, as the hook does (it checks d2t once per identity). The row's
    ``timed`` field says which ran.
    """
    import numpy as np
    import jax.numpy as jnp
    jm = self.jm
    fn = jm.greedy_draft if greedy else jm.sample_draft
    kwargs, meta = _jm_kwargs(fn, shape, batch)
    targets = self.sets[0].get("targets")
    heads = [jm.MarkovHead(d["embed"], d["proj"]) for d in self.sets]
    if greedy:
      public = [(lambda d=d, h=h: fn(d["base"], d["anchors"], h, **kwargs,
                                     **({} if targets is None else dict(
                                         draft_to_target=targets,
                                         target_vocab=shape.V))))
                for d, h in zip(self.sets, heads)]
    else:
      public = [(lambda d=d, h=h: fn(d["base"], d["anchors"], h, temperature,
                                     self.words, self.positions, **kwargs,
                                     draft_to_target=targets,
                                     target_vocab=shape.V))
                for d, h in zip(self.sets, heads)]
    calls, meta["timed"] = public, fn.__name__
    sampler = getattr(jm, "sampler", None)
    inner = getattr(sampler, "_greedy_draft" if greedy else "_sample_draft",
                    None)
    if targets is not None and inner is not None:
      assert (np.diff(targets) > 0).all()
      d2t = jnp.asarray(targets)
      interpret = not self.is_gpu
      # The configuration the public call picks: sampling walks the target
      # columns, greedy drafting the draft columns.
      cfg = sampler._config(None, None, batch,
                            shape.draft_vocab if greedy else shape.V,
                            shape.R, interpret, stepwise=True)
      if greedy:
        calls = [(lambda d=d, h=h: inner(
            d["base"], d["anchors"], h, config=cfg, interpret=interpret,
            draft_to_target=d2t, permute=False))
                 for d, h in zip(self.sets, heads)]
      else:
        calls = [(lambda d=d, h=h: inner(
            d["base"], d["anchors"], h, temperature, self.words,
            self.positions, config=cfg, interpret=interpret,
            draft_to_target=d2t, target_vocab=shape.V))
                 for d, h in zip(self.sets, heads)]
      name = getattr(inner, "__name__", "the inner draft")
      meta["timed"] = (f"jax_markov.sampler.{name} (the jitted "
                       f"draft behind jm.{fn.__name__}, map checked once)")
    tok = (lambda out: out) if greedy else (lambda out: out.tokens)  # noqa: E731

    def tokens():
      want = np.asarray(tok(public[0]())).tolist()
      got = np.asarray(tok(calls[0]())).tolist()
      if got != want:
        raise RuntimeError("the timed call's tokens differ from the public "
                           f"jm.{fn.__name__}'s")
      return got
    return _Prepared(calls, tokens, meta)

  def time(self, prep, repeats, group, warmup, warmup_s):
    run = common.round_robin(prep.calls, finish=self.jax.block_until_ready)
    common.warm_up(run, max(1, warmup), warmup_s)
    return common.wall_clock_median(run, repeats, group)

  def release(self, inputs=False):
    if inputs:
      self.sets = []


def _native_mosaic_config(shape, batch):
  """jax_markov_mosaic's configuration: what the native runtime plans for
  this batch on this GPU (tuning.choose with hopper=True), where that is
  the Mosaic GPU pass; else the row is skipped."""
  from jax_markov import sampler as jm_sampler
  from jax_markov.kernels import tuning
  if shape.Vd is not None or shape.dtype != "bfloat16":
    raise _Skip("the Mosaic GPU pass takes bfloat16, full vocabulary only")
  if not jm_sampler._mosaic_available():  # noqa: SLF001
    raise _Skip("no Hopper GPU with Pallas Mosaic GPU")
  cfg = tuning.choose(None, batch, shape.V, shape.R, interpret=False,
                      hopper=True, gpu=jm_sampler._gpu_name())  # noqa: SLF001
  if cfg.method != "mosaic":
    raise _Skip(f"the native runtime plans the {cfg.method} pass at "
                f"B = {batch}")
  return cfg


def _jm_kwargs(fn, shape, batch, method=None):
  """Keyword arguments for timing a jax_markov entry point, and row fields.

  ``check_values=False`` where the API has it: the value checks read concrete
  arguments back to the host (a sync per call), which a serving loop whose
  inputs are already validated skips. The row records the kernel config.
  """
  import inspect
  kwargs, meta = {}, {}
  params = inspect.signature(fn).parameters
  if "check_values" in params:
    kwargs["check_values"] = False
    meta["check_values"] = False
  try:
    import jax
    from jax_markov import sampler as jm_sampler
    # The sampler's own choice (the Mosaic GPU entry where it runs).
    cfg = jm_sampler._config(  # noqa: SLF001
        None, method, batch, shape.draft_vocab, shape.R,
        jax.default_backend() != "gpu",
        hopper=shape.Vd is None and shape.dtype == "bfloat16")
    meta["config"] = str(cfg)
    meta["method"] = cfg.method
  except Exception:  # noqa: BLE001 -- the config is informational
    pass
  return kwargs, meta


class _BridgeFamily(_TorchFamily):
  """torch_bridge(_graph): the speculator hook from torch tensors (torch and
  JAX in one process).

  The hook is ``torch_bridge.FusedMarkovSampler(B, V, R, dtype,
  check_values=False)`` with the default runtime (native where CUDA and
  triton exist, else the JAX runtime), warmed up on every bucket, then called
  as vLLM calls it, ``sampler(spec, B, head_hidden)``, on
  torch_bridge.testing's speculator double over the synthetic inputs.
  torch_bridge_graph captures that call in a CUDA graph per batch size (the
  native runtime only: the JAX runtime cannot be captured). Without a usable
  FusedMarkovSampler the eager row times the same path by hand: the torch
  tensors into JAX through DLPack, jm.sample_draft_into, and the tokens back
  to torch (the row's ``note`` says so).
  """

  def __init__(self, cfg, result, progress):
    super().__init__(cfg, result, progress)
    self.available = False
    try:
      import jax
      import jax_markov as jm
      if not hasattr(jm, "sample_draft_into"):
        raise ImportError("jax_markov has no sample_draft_into")
    except Exception as e:  # noqa: BLE001
      result.notice(f"torch_bridge skipped: jax_markov is not usable "
                    f"({type(e).__name__}: {e})", progress)
      return
    self.jax, self.jm = jax, jm
    self.available = True
    self.bridge_error = None
    try:
      from torch_bridge import FusedMarkovSampler
      from torch_bridge.testing import speculator_from_tensors
      self.FusedMarkovSampler = FusedMarkovSampler
      self.speculator_from_tensors = speculator_from_tensors
    except Exception as e:  # noqa: BLE001
      self.bridge_error = f"{type(e).__name__}: {e}"

  def same_rng(self, impl, key):
    """The bridge keys its draws by seeds and positions, as jax_markov."""
    del impl, key
    return True

  def prepare(self, impl, shape, batch, temp):
    torch = self.torch
    temperature = torch.full((batch,), temp, dtype=torch.float32,
                             device=self.device)
    seeds, positions = common.seeds_and_positions(batch, shape.S)
    graph = impl.endswith("_graph")
    greedy = impl in GREEDY_IMPLS
    if graph and not self.is_gpu:
      raise _Skip("CUDA graphs need a GPU")
    if (greedy or shape.Vd is not None) and self.bridge_error:
      raise _Skip("torch_bridge.FusedMarkovSampler not usable "
                  f"({self.bridge_error}); no DLPack fallback for this mode")
    if self.bridge_error is None:
      try:
        return self._prepare_bridge(
            shape, batch, temperature, seeds, positions, graph, greedy,
            mosaic=BRIDGE_MOSAIC.get(impl))
      except _Skip:
        raise
      except Exception as e:  # noqa: BLE001 -- fall back, say why
        if graph or greedy or shape.Vd is not None:
          raise
        self.bridge_error = f"{type(e).__name__}: {e}"
    if graph:
      raise _Skip("torch_bridge.FusedMarkovSampler not usable "
                  f"({self.bridge_error})")
    self.result.notice(
        "torch_bridge.FusedMarkovSampler not usable "
        f"({self.bridge_error}); timing the DLPack path by hand instead",
        self.progress)
    return self._prepare_dlpack(shape, batch, temperature, seeds, positions)

  def _make_sampler(self, shape, batch, dtype, mosaic=None):
    """The hook with the default runtime (and its mosaic argument when not
    None); its constructor before the runtime argument existed is accepted
    too (then the row says so)."""
    extra = {} if mosaic is None else dict(mosaic=mosaic)
    try:
      return self.FusedMarkovSampler(batch, shape.draft_vocab, shape.R,
                                     dtype, runtime=None, check_values=False,
                                     **extra)
    except TypeError as e:
      if "runtime" not in str(e):
        raise
      return self.FusedMarkovSampler(batch, shape.draft_vocab, shape.R,
                                     dtype, check_values=False)

  def _prepare_bridge(self, shape, batch, temperature, seeds, positions,
                      graph, greedy=False, mosaic=None):
    torch = self.torch
    dtype = getattr(torch, shape.dtype)
    # A reduced vocabulary: the double in vLLM's d2t mode over the synthetic
    # tensors (speculator_from_tensors' draft_to_target; add_modes would
    # replace the weights by random ones); greedy: spec.draft_logits = None.
    mode_kw = {}
    if shape.Vd is not None:
      mode_kw["draft_to_target"] = self.sets[0]["targets"]
    if greedy:
      mode_kw["greedy"] = True
    specs = [self.speculator_from_tensors(d["base"], d["embed"], d["proj"],
                                          d["anchors"], temperature, seeds,
                                          positions, **mode_kw)
             for d in self.sets]
    samplers = [self._make_sampler(shape, batch, dtype, mosaic)
                for _ in specs]
    runtime = getattr(samplers[0], "runtime", "jax (no runtime attribute)")
    if graph and runtime != "native":
      raise _Skip(f"the hook's {runtime!r} runtime cannot be captured in a "
                  "CUDA graph (only the native runtime can)")
    for sampler, spec in zip(samplers, specs):
      if hasattr(sampler, "warmup"):
        sampler.warmup(spec)  # compiles every bucket, before any timing

    def make_call(sampler, spec):
      def call():
        if not sampler(spec, batch, spec.head_hidden):
          raise RuntimeError("FusedMarkovSampler returned False")
      return call
    calls = [make_call(s, sp) for s, sp in zip(samplers, specs)]
    calls[0]()  # fails here, not while timing, if the double does not fit
    if graph:
      from benchmarks.baselines.vllm_loop import capture_graph
      calls = [capture_graph(c).replay for c in calls]
    meta = dict(runtime=runtime,
                timer="cuda_events" if runtime == "native" and self.is_gpu
                else "wall_clock",
                note="torch_bridge.FusedMarkovSampler on "
                "torch_bridge.testing.speculator_from_tensors"
                + (" (greedy: draft_logits None)" if greedy else "")
                + (", captured in a CUDA graph" if graph else ""))

    def tokens():
      calls[0]()
      return specs[0].draft_tokens[:batch, :shape.S].cpu().tolist()
    # The hooks own the scratch their captured graphs use (docs/limitations).
    return _Prepared(calls, tokens, meta,
                     host_timed=not graph and self.is_gpu,
                     keep=(samplers, specs))

  def _prepare_dlpack(self, shape, batch, temperature, seeds, positions):
    torch, jax, jm = self.torch, self.jax, self.jm
    from jax_markov import rng
    import numpy as np
    words = torch.from_numpy(np.array(rng.seed_words(seeds))).to(self.device)
    pos_t = torch.as_tensor(positions, device=self.device)
    idx_map = torch.arange(batch, dtype=torch.int32, device=self.device)[
        :, None].repeat(1, shape.S)
    caches = [torch.zeros((batch, shape.S, shape.V), dtype=torch.float32,
                          device=self.device) for _ in self.sets]
    out_tokens = torch.zeros((batch, shape.S), dtype=torch.int64,
                             device=self.device)
    j = jax.dlpack.from_dlpack
    kwargs, meta = _jm_kwargs(jm.sample_draft_into, shape, batch)
    if "donate" in inspect.signature(jm.sample_draft_into).parameters:
      # A buffer imported through DLPack is torch's: JAX may not donate it.
      kwargs["donate"] = False

    def make_call(d, cache):
      def call():
        head = jm.MarkovHead(j(d["embed"]), j(d["proj"]))
        toks, _ = jm.sample_draft_into(
            j(cache), j(d["base"]), j(d["anchors"]), head, j(temperature),
            j(words), j(idx_map), j(pos_t), **kwargs)
        out_tokens.copy_(torch.from_dlpack(toks))
      return call
    calls = [make_call(d, c) for d, c in zip(self.sets, caches)]

    def tokens():
      calls[0]()
      return out_tokens.cpu().tolist()
    meta["note"] = ("DLPack by hand: jm.sample_draft_into on torch tensors "
                    "(cache not donated)")
    return _Prepared(calls, tokens, meta)

  def time(self, prep, repeats, group, warmup, warmup_s):
    if prep.meta.get("timer") == "cuda_events":
      # Native runtime: every launch is on torch's current stream.
      return super().time(prep, repeats, group, warmup, warmup_s)
    # The whole device: JAX's streams too.
    sync = (lambda _: self.torch.cuda.synchronize()) if self.is_gpu else None
    run = common.round_robin(prep.calls, finish=sync)
    common.warm_up(run, max(1, warmup), warmup_s)
    ms, groups = common.wall_clock_median(run, repeats, group)
    self._host_time(prep, repeats)
    return ms, groups


if __name__ == "__main__":
  sys.exit(main())
