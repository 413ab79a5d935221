"""Where a draft's time goes on the GPU: a kernel timeline from JAX's profiler.

  python -m benchmarks.timeline --shape dsv4 --batches 1 256 --out tl.json
  python -m benchmarks.timeline --batches 1 --set serpentine=False

Issues ``--group`` drafts back to back, as the benchmark times them (the host
clock around the group, then a sync), inside ``jax.profiler.trace``, and reads
the GPU activity (CUPTI) back from the trace: each kernel's duration, the idle
gaps between kernels, and the span from the first kernel's start to the last
one's end. Durations are warm-L2 times of a real draft, unlike Nsight
Compute's, which flushes the caches before each kernel.

``--set key=value`` overrides fields of the tuning table's configuration
(``dataclasses.replace``), e.g. ``--set block_v=256 --set num_stages=4``.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import glob
import os
import statistics
import sys
import tempfile
import time

import jax

import jax_markov as jm  # noqa: E402
from benchmarks import common  # noqa: E402


def kernel_events(trace_dir: str) -> list[tuple[str, int, int]]:
  """(name, start_ns, duration_ns) of every GPU kernel in a trace, by start."""
  from jax.profiler import ProfileData
  paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                    recursive=True)
  events = []
  for path in paths:
    for plane in ProfileData.from_file(path).planes:
      if not plane.name.startswith("/device:GPU"):
        continue
      for line in plane.lines:
        # Kernels sit on the stream lines; "XLA Ops" / "XLA Modules" lines
        # repeat them as annotations.
        if not line.name.startswith("Stream"):
          continue
        for e in line.events:
          events.append((e.name, int(e.start_ns), int(e.duration_ns)))
  events.sort(key=lambda e: e[1])
  return events


def summarize(events, drafts: int) -> dict:
  """Span, busy time, gaps and per-kernel durations, per draft."""
  if not events:
    return dict(kernels=0)
  start = events[0][1]
  end = max(s + d for _, s, d in events)
  busy, last_end, gaps = 0, start, []
  for _, s, d in events:
    if s > last_end:
      gaps.append(s - last_end)
    busy += max(0, s + d - max(s, last_end))
    last_end = max(last_end, s + d)
  per_name = collections.defaultdict(list)
  for name, _, d in events:
    per_name[name].append(d)
  return dict(
      kernels=len(events) / drafts,
      span_us=(end - start) / 1e3 / drafts,
      busy_us=busy / 1e3 / drafts,
      gap_us=sum(gaps) / 1e3 / drafts,
      largest_gaps_us=[g / 1e3 for g in sorted(gaps)[-5:]],
      by_kernel={name: dict(count=len(ds) / drafts,
                            mean_us=statistics.mean(ds) / 1e3,
                            total_us=sum(ds) / 1e3 / drafts)
                 for name, ds in sorted(per_name.items(),
                                        key=lambda kv: -sum(kv[1]))},
  )


def parse_overrides(items) -> dict:
  out = {}
  for item in items or []:
    key, _, value = item.partition("=")
    try:
      out[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      out[key] = value
  return out


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--shape", default="dsv4", choices=sorted(common.SHAPES))
  p.add_argument("--batches", type=int, nargs="+", default=[1, 256])
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--group", type=int, default=5)
  p.add_argument("--set", action="append", default=[],
                 help="key=value override of the table's config")
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  shape = common.SHAPES[a.shape]
  overrides = parse_overrides(a.set)
  rows = []
  interpret = jax.default_backend() != "gpu"
  for B in a.batches:
    draft = common.jax_draft(shape, B, a.temperature)
    # The public call's choice (with a map, the block pass walks the target
    # columns).
    cfg = jm.sampler._config(None, None, B, shape.V, shape.R, interpret,  # noqa: SLF001
                             stepwise=shape.Vd is not None)
    cfg = dataclasses.replace(cfg, **overrides)
    calls = draft.calls(cfg, interpret)
    run = common.round_robin(calls, finish=jax.block_until_ready)
    common.warm_up(run, 3 * a.group, common.WARMUP_S)
    wall_ms, _ = common.wall_clock_median(run, 10 * a.group, a.group)
    # The host's share: time to issue one call (the device is kept busy, so
    # this is host work only), for the public function, the jitted function
    # it calls, and a jitted function that returns its first argument (what
    # any jitted call with these arguments costs).
    jitted = lambda: jm.sampler._sample_draft(  # noqa: E731
        *draft.args(), config=cfg, interpret=interpret, **draft.mapped)
    noop = jax.jit(lambda *args: args[1])
    noop_call = lambda: noop(*draft.args())  # noqa: E731
    issue = {}
    for key, fn in (("api", calls[0]), ("jit", jitted), ("noop", noop_call)):
      jax.block_until_ready(fn())
      times = []
      for _ in range(5):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(a.group)]
        times.append((time.perf_counter() - t0) / a.group * 1e6)
        jax.block_until_ready(outs)
      issue[key] = statistics.median(times)
    issue_us = issue["api"]
    trace_dir = tempfile.mkdtemp(prefix="jm-trace-")
    with jax.profiler.trace(trace_dir):
      run(a.group)
    summary = summarize(kernel_events(trace_dir), a.group)
    row = dict(shape=a.shape, batch=B, temperature=a.temperature,
               config=dataclasses.asdict(cfg), wall_ms=wall_ms,
               issue_us=issue_us, issue_jit_us=issue["jit"],
               issue_noop_us=issue["noop"],
               xla_flags=os.environ.get("XLA_FLAGS", ""), **summary)
    rows.append(row)
    print(f"B={B} {cfg}\n  wall {wall_ms * 1e3:.1f} us/draft, host issue "
          f"{issue_us:.1f} us/call (jitted fn {issue['jit']:.1f}, no-op jit "
          f"{issue['noop']:.1f}); GPU span {summary.get('span_us', 0):.1f}, "
          f"busy {summary.get('busy_us', 0):.1f}, gaps "
          f"{summary.get('gap_us', 0):.1f} us/draft, "
          f"{summary.get('kernels', 0):.1f} kernels/draft", flush=True)
    for name, k in summary.get("by_kernel", {}).items():
      print(f"    {k['count']:5.1f} x {k['mean_us']:8.2f} us = "
            f"{k['total_us']:8.1f} us  {name[:90]}", flush=True)
    if a.out:
      common.write_json(a.out, rows)
    del draft
  return 0


if __name__ == "__main__":
  sys.exit(main())
