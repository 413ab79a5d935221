"""Where a captured native draft's time goes: a kernel timeline from torch's profiler.

  python -m benchmarks.timeline_graph --shape dsv4r --batches 16 256 --out tl.json

The GPU side of ``torch_bridge_graph``: a native-runtime hook's draft on the
benchmark's synthetic inputs, captured in a torch CUDA graph, replayed
``--group`` times back to back inside ``torch.profiler`` (CUPTI records the
kernels of graph replays). Reports per draft the span from the first kernel's
start to the last one's end, the busy time, the gaps, and each kernel's
count and mean duration, as benchmarks/timeline.py does for the JAX path
(run both at one shape to compare the same kernels under XLA and under the
native runtime).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from benchmarks import common  # noqa: E402
from benchmarks.timeline import summarize  # noqa: E402
from benchmarks.tune_graph import captured_draft  # noqa: E402


def kernel_events(trace_path: str) -> list[tuple[str, int, int]]:
  """(name, start_ns, duration_ns) of every GPU kernel of a chrome trace."""
  with open(trace_path) as f:
    trace = json.load(f)
  events = [(e["name"], int(float(e["ts"]) * 1e3), int(float(e["dur"]) * 1e3))
            for e in trace.get("traceEvents", [])
            if e.get("cat") == "kernel" and "dur" in e]
  events.sort(key=lambda e: e[1])
  return events


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--shape", default="dsv4r", choices=sorted(common.SHAPES))
  p.add_argument("--batches", type=int, nargs="+", default=[16, 256])
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--group", type=int, default=5)
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  if not torch.cuda.is_available():
    print("timeline_graph needs a CUDA GPU", file=sys.stderr)
    return 2
  shape = common.SHAPES[a.shape]
  rows = []
  for batch in a.batches:
    inputs = common.torch_inputs(shape, batch, 0, torch.device("cuda"))
    graph, _, _ = captured_draft(shape, batch, inputs, a.temperature)
    for _ in range(3 * a.group):
      graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
      for _ in range(a.group):
        graph.replay()
      torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(prefix="jm-graph-trace-"),
                        "trace.json")
    prof.export_chrome_trace(path)
    summary = summarize(kernel_events(path), a.group)
    rows.append(dict(shape=a.shape, batch=batch, temperature=a.temperature,
                     runtime="native (captured)", **summary))
    print(f"B={batch} native, captured: GPU span "
          f"{summary.get('span_us', 0):.1f}, busy "
          f"{summary.get('busy_us', 0):.1f}, gaps "
          f"{summary.get('gap_us', 0):.1f} us/draft, "
          f"{summary.get('kernels', 0):.1f} kernels/draft", flush=True)
    for name, k in summary.get("by_kernel", {}).items():
      print(f"    {k['count']:5.1f} x {k['mean_us']:8.2f} us = "
            f"{k['total_us']:8.1f} us  {name[:90]}", flush=True)
    if a.out:
      common.write_json(a.out, rows)
    del graph, inputs
  return 0


if __name__ == "__main__":
  sys.exit(main())
