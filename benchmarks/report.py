"""The benchmark report: docs/benchmarks.md (and, asked for, a .png plot)
from the results JSON.

Usage: ``python -m benchmarks.report benchmarks/results/<device>.json
[--docs-dir docs] [--plot]`` (``python -m benchmarks`` calls it after a full
run). The plot is not committed (over 100 KB at every resolution that stays
readable); ``--plot`` writes it for a local look.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from benchmarks.common import ALL_IMPLS, BASELINE_IMPL, GREEDY_IMPLS, SHAPES

# Every ratio (and every speed claim) is against vLLM's sampler as it is,
# captured in a CUDA graph.
REF_IMPL = BASELINE_IMPL
# With a reduced draft vocabulary there is no seed design: vLLM runs its
# unfused loop, the baseline there (ratio ``x loop``).
LOOP_IMPL = "vllm_loop_graph"
NO_SEED = ("n/a (vLLM's fused sampler does not cover this mode; vllm_loop is "
           "the baseline)")

INTRO = """\
What is timed: the whole S-step draft from given base logits (the backbone
forward is not timed): S times the Markov bias `proj @ embed[prev]`, the
logits `base + bias` written to a float32 cache [B, S, V], and one token drawn
per request, on one GPU, in one run.
"""

DESCRIPTIONS = {
    "jax_markov": "`jm.sample_draft`: Pallas kernels, all steps in one jitted "
                  "call",
    "torch_bridge": "`torch_bridge.FusedMarkovSampler` (the speculator "
                    "hook) eager, end to end from torch tensors (speculator "
                    "double; the base logits are preallocated); `host_ms`: "
                    "host time of one call",
    "torch_bridge_graph": "the same hook captured in a CUDA graph per batch "
                          "size, replayed (native runtime only)",
    "seed_design": "vLLM's FusedMarkovSampler as it is: nn.Linear bias (bf16 "
                   "[B, V]) + Triton block kernel (1024-wide blocks, 2 warps) "
                   "+ Triton select kernel (inverse CDF) a step, scratch "
                   "preallocated; eager; `host_ms`: host time of one call",
    "seed_design_graph": "the same, captured in a CUDA graph: the baseline "
                         "(`x seed`)",
    "f32_bias_design": "a float32-bias variant: bias GEMM (cuBLAS, float32 "
                       "[B, V] out, through HBM) + Triton block pass + Triton "
                       "select pass a step, block chosen per batch; eager",
    "f32_bias_design_graph": "the same, captured in a CUDA graph",
    "vllm_loop": "vLLM's unfused loop: embedding, linear, add, cache write, "
                 "Gumbel-max draw; eager torch",
    "vllm_loop_graph": "the same, captured in a CUDA graph",
    "plain_jax": "jnp ops + `jax.random.categorical` inside `lax.scan`, one "
                 "jit",
    "jax_markov_xla_bias": "jax_markov with `method=\"xla_bias\"`: XLA "
                            "bias GEMM, then the Pallas block pass",
    "jax_markov_fused": "jax_markov with `method=\"fused\"`: the Triton "
                        "block pass where the table would pick Mosaic GPU",
    "jax_markov_mosaic": "jax_markov with the configuration the native "
                         "runtime plans where that is the Mosaic GPU pass "
                         "(partial last tiles included)",
    "jax_markov_into": "`jm.sample_draft_into` with the cache donated back "
                       "call after call (fixed buffers, identity idx_map)",
    "torch_bridge_mosaic_graph": "the hook with `mosaic=True` (the Mosaic "
                                 "GPU block pass where the table has it), "
                                 "captured in a CUDA graph",
    "torch_bridge_triton_graph": "the hook with `mosaic=False` (the Triton "
                                 "block pass at every batch), captured in a "
                                 "CUDA graph",
    "jax_markov_greedy": "`jm.greedy_draft`: greedy drafting, tokens only "
                         "(no cache)",
    "torch_bridge_greedy": "the hook in greedy mode (`spec.draft_logits = "
                           "None`: tokens only), eager",
    "torch_bridge_greedy_graph": "the hook in greedy mode, captured in a "
                                 "CUDA graph",
}

METHOD = """\
Method: each family runs in its own process (JAX; torch + Triton; the bridge).
Warm-up calls (at least 3 and 0.2 s of them, so an idle GPU's clocks are up),
then groups of back-to-back calls, each group timed with CUDA
events (torch; the bridge's native runtime) or with `perf_counter` up to
`block_until_ready` of the group's last result (JAX; the bridge's JAX runtime
up to `torch.cuda.synchronize()`); the time is
the median over groups of the per-call time. Inputs smaller than twice the L2
cache are replicated and the calls rotate through the copies. jax_markov is
called with `check_values=False` (no host read-back of the inputs per call).
Before timing, every implementation's temperature-0 tokens were checked
against the first one's: the synthetic inputs make every logit exact in
float32, so they must agree exactly (see `benchmarks/common.py`).
"""


def _load(path):
  with open(path) as f:
    return json.load(f)


def _groups(rows):
  """Yields (shape name, temperature, rows of it) in a stable order."""
  shapes = []
  for r in rows:
    if r.get("shape") not in shapes:
      shapes.append(r.get("shape"))
  for shape in shapes:
    sub = [r for r in rows if r.get("shape") == shape]
    for temp in sorted({r["temperature"] for r in sub}):
      yield shape, temp, [r for r in sub if r["temperature"] == temp]


def _reduced(rows) -> bool:
  """Whether the rows are of a reduced-draft-vocabulary shape."""
  return any(r.get("Vd") for r in rows)


def _shape_title(shape, rows):
  r = rows[0]
  label = SHAPES[shape].label if shape in SHAPES else shape
  vd = f", Vd={r['Vd']}" if r.get("Vd") else ""
  return f"{label} (V={r['V']}{vd}, R={r['R']}, S={r['S']}, {r['dtype']})"


def _split(rows):
  """(the sampling rows, the greedy rows: tokens only, their own table)."""
  return ([r for r in rows if r["impl"] not in GREEDY_IMPLS],
          [r for r in rows if r["impl"] in GREEDY_IMPLS])


def _impls(rows):
  present = {r["impl"] for r in rows}
  return [i for i in ALL_IMPLS if i in present]


def _table(rows):
  """Markdown table of one (shape, temperature): batch x impl.

  Ratios: over the floor, and over seed_design_graph (``x seed``); on a
  reduced-vocabulary shape, where there is no seed design, over
  vllm_loop_graph (``x loop``).
  """
  impls = _impls(rows)
  batches = sorted({r["batch"] for r in rows})
  cell = {(r["batch"], r["impl"]): r for r in rows}
  ref_impl, ref_tag = ((LOOP_IMPL, "loop") if _reduced(rows)
                       else (REF_IMPL, "seed"))
  lines = ["| B | floor ms | " + " | ".join(impls) + " |",
           "| ---: | ---: | " + " | ".join("---:" for _ in impls) + " |"]
  for b in batches:
    any_row = next(r for r in rows if r["batch"] == b)
    floor = any_row.get("floor_ms")
    ref = cell.get((b, ref_impl))
    cells = []
    for impl in impls:
      r = cell.get((b, impl))
      if r is None:
        cells.append("")
        continue
      ms = r["median_ms"]
      parts = []
      if floor:
        parts.append(f"{ms / floor:.2f}x fl")
      if ref is not None:
        parts.append(f"{ms / ref['median_ms']:.2f}x {ref_tag}")
      txt = f"{ms:.3f}" + (f" ({', '.join(parts)})" if parts else "")
      if r.get("tokens_match") is False:
        txt += " **tokens differ**"
      cells.append(txt)
    floor_txt = f"{floor:.3f}" if floor else "n/a"
    lines.append(f"| {b} | {floor_txt} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _host_table(rows) -> str:
  """Markdown table batch x impl of ``host_ms`` (us), or "" if none."""
  host = [r for r in rows if r.get("host_ms") is not None]
  if not host:
    return ""
  impls = _impls(host)
  cell = {(r["batch"], r["impl"]): r["host_ms"] for r in host}
  lines = ["| B | " + " | ".join(impls) + " |",
           "| ---: | " + " | ".join("---:" for _ in impls) + " |"]
  for b in sorted({r["batch"] for r in host}):
    lines.append(f"| {b} | " + " | ".join(
        f"{cell[(b, i)] * 1e3:.0f}" if (b, i) in cell else "" for i in impls)
        + " |")
  return "\n".join(lines)


def _greedy_table(rows, all_rows) -> str:
  """Markdown table of the greedy rows: (shape, batch) x impl, and the
  baseline: seed_design_graph at T = 0 (vllm_loop_graph at T = 0 on a
  reduced-vocabulary shape, where x seed is n/a)."""
  impls = _impls(rows)
  base_rows = {(r["shape"], r["batch"], r["impl"]): r for r in all_rows
               if r["temperature"] == 0.0
               and r["impl"] in (REF_IMPL, LOOP_IMPL)}
  lines = ["| shape | B | floor ms (no cache) | " + " | ".join(impls)
           + " | baseline at T = 0 (writes the cache) |",
           "| --- | ---: | ---: | " + " | ".join("---:" for _ in impls)
           + " | ---: |"]
  cell = {(r["shape"], r["batch"], r["impl"]): r for r in rows}
  keys = []
  for r in rows:
    if (r["shape"], r["batch"]) not in keys:
      keys.append((r["shape"], r["batch"]))
  keys.sort(key=lambda k: (list(SHAPES).index(k[0]) if k[0] in SHAPES
                           else 99, k[1]))
  for shape, b in keys:
    reduced = _reduced([r for r in rows if r["shape"] == shape])
    ref_impl, tag = (LOOP_IMPL, "loop") if reduced else (REF_IMPL, "seed")
    ref = base_rows.get((shape, b, ref_impl))
    floor = next(r for r in rows if r["shape"] == shape
                 and r["batch"] == b).get("floor_ms")
    cells = []
    for impl in impls:
      r = cell.get((shape, b, impl))
      if r is None:
        cells.append("")
        continue
      ms = r["median_ms"]
      parts = [f"{ms / floor:.2f}x fl"] if floor else []
      if ref is not None:
        parts.append(f"{ms / ref['median_ms']:.2f}x {tag}")
      txt = f"{ms:.3f}" + (f" ({', '.join(parts)})" if parts else "")
      if r.get("tokens_match") is False:
        txt += " **tokens differ**"
      cells.append(txt)
    ref_txt = (f"{ref_impl} {ref['median_ms']:.3f}" if ref is not None
               else "x seed: " + NO_SEED if reduced else "")
    label = SHAPES[shape].name if shape in SHAPES else shape
    lines.append(f"| {label} | {b} | "
                 + (f"{floor:.3f}" if floor else "n/a") + " | "
                 + " | ".join(cells) + f" | {ref_txt} |")
  return "\n".join(lines)


GREEDY_CAPTION = """\
Tokens only: the greedy rows draw the temperature-0 argmax chain and write no
logit cache (the floor counts proj and base only); temperature does not enter
them, so they are timed once. The baseline column is {ref} at temperature 0,
which also writes the float32 cache [B, S, V] (`x seed`); on a
reduced-vocabulary shape it is {loop} at temperature 0 (`x loop`), the cache
written too, and `x seed` is {no_seed}.
""".format(ref=REF_IMPL, loop=LOOP_IMPL, no_seed=NO_SEED)


def text_summary(rows) -> str:
  """A plain-text table per (shape, temperature): batch x impl, median ms
  (the greedy rows in one table of their own)."""
  out = []
  rows, greedy = _split(rows)
  if greedy:
    out.append("greedy drafting (tokens only, no cache), T irrelevant: "
               "median ms")
    for shape in dict.fromkeys(r["shape"] for r in greedy):
      sub = [r for r in greedy if r["shape"] == shape]
      impls = _impls(sub)
      out.append(f"{_shape_title(shape, sub)}")
      out.append(f"{'B':>5} " + " ".join(f"{i:>{max(10, len(i))}}"
                                         for i in impls))
      cell = {(r["batch"], r["impl"]): r for r in sub}
      for b in sorted({r["batch"] for r in sub}):
        out.append(f"{b:>5} " + " ".join(
            f"{cell[(b, i)]['median_ms']:>{max(10, len(i))}.4f}"
            if (b, i) in cell else " " * max(10, len(i)) for i in impls))
    out.append("")
  for shape, temp, sub in _groups(rows):
    impls = _impls(sub)
    out.append(f"{_shape_title(shape, sub)}, T={temp:g}: median ms")
    widths = [max(10, len(i)) for i in impls]
    out.append(f"{'B':>5} {'floor':>8} " + " ".join(
        f"{i:>{w}}" for i, w in zip(impls, widths)))
    cell = {(r["batch"], r["impl"]): r for r in sub}
    for b in sorted({r["batch"] for r in sub}):
      floor = next(r for r in sub if r["batch"] == b).get("floor_ms")
      vals = []
      for i, w in zip(impls, widths):
        r = cell.get((b, i))
        vals.append(f"{r['median_ms']:>{w}.4f}" if r else " " * w)
      floor_txt = f"{floor:8.4f}" if floor else f"{'n/a':>8}"
      out.append(f"{b:>5} {floor_txt} " + " ".join(vals))
    out.append("")
  return "\n".join(out)


def plot(rows, png_path) -> None:
  """Time against batch per implementation (log-log), floor dashed; one
  subplot per (shape, temperature)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.ticker
  import matplotlib.pyplot as plt

  groups = list(_groups(rows))
  temps = sorted({t for _, t, _ in groups})
  shapes = []
  for s, _, _ in groups:
    if s not in shapes:
      shapes.append(s)
  fig, axes = plt.subplots(len(shapes), len(temps), squeeze=False,
                           figsize=(5.2 * len(temps), 3.6 * len(shapes)))
  cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  colors = dict(zip(ALL_IMPLS, cycle))
  handles = {}
  for shape, temp, sub in groups:
    ax = axes[shapes.index(shape)][temps.index(temp)]
    for impl in _impls(sub):
      pts = sorted((r["batch"], r["median_ms"]) for r in sub
                   if r["impl"] == impl)
      (h,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                     ms=3, color=colors.get(impl), label=impl)
      handles[impl] = h
    floor = sorted({(r["batch"], r["floor_ms"]) for r in sub
                    if r.get("floor_ms")})
    if floor:
      (h,) = ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--",
                     label="HBM floor")
      handles["HBM floor"] = h
    ax.set_xscale("log", base=2)
    batches = sorted({r["batch"] for r in sub})
    ax.set_xticks(batches)
    ax.set_xticklabels([str(b) for b in batches])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_yscale("log")
    ax.set_title(f"{_shape_title(shape, sub)}, T={temp:g}", fontsize=8)
    ax.set_xlabel("batch")
    ax.set_ylabel("ms per S-step draft")
    ax.grid(True, which="both", alpha=0.3)
  fig.legend(list(handles.values()), list(handles.keys()),
             loc="lower center", ncol=min(4, len(handles)), fontsize=8)
  fig.tight_layout(rect=(0, 0.06 + 0.02 * (len(handles) > 4), 1, 1))
  fig.savefig(png_path, dpi=60)  # a small file: the page is committed
  plt.close(fig)


def markdown(rows, json_name: str, png_name: str | None = None) -> str:
  """The text of docs/benchmarks.md for these rows.

  json_name: the results file as the page should name it (relative to the
  repository root); png_name: the plot's path relative to the page, or None
  (no plot).
  """
  device = rows[0].get("device", "unknown")
  bws = sorted({r["copy_bw_gbs"] for r in rows if r.get("copy_bw_gbs")})
  bw = bws[0] if len(bws) == 1 else None
  lines = [
      "# Benchmarks",
      "",
      f"Generated by `python -m benchmarks` on **{device}** "
      f"({datetime.date.today().isoformat()}) from "
      f"`{json_name}`"
      + (f"; copy bandwidth measured in the same run: {bw / 1e3:.2f} TB/s."
         if bw else "" if not bws else
         "; merged from runs whose measured copy bandwidths were "
         + ", ".join(f"{b / 1e3:.2f}" for b in bws) + " TB/s (each row's "
         "floor uses its own run's)."),
      "Regenerate the page with `python -m benchmarks.report "
      f"{json_name}`.",
      "",
      INTRO,
      "| impl | what |",
      "| --- | --- |",
  ] + [f"| {i} | {DESCRIPTIONS[i]} |" for i in _impls(rows)] + [
      "| floor | bytes that must move (proj read once a step, base read "
      "once, float32 cache written once) / copy bandwidth measured in the "
      "same run |",
      "",
      METHOD,
  ] + ([f"![time against batch]({png_name})", ""] if png_name else []) + [
      ("Each cell: median ms per S-step draft (that time over the HBM floor, "
       f"over {REF_IMPL}: `x seed`)."
       if any(r["impl"] == REF_IMPL for r in rows) else
       "Each cell: median ms per S-step draft (that time over the HBM "
       f"floor). {REF_IMPL}, the baseline speed claims are made against, is "
       "not in these rows: ratios to it are to be measured."),
      "",
  ]
  all_rows = rows
  rows, greedy = _split(rows)
  for shape, temp, sub in _groups(rows):
    lines += [f"## {_shape_title(shape, sub)}, temperature {temp:g}", ""]
    if _reduced(sub):
      lines += [f"A reduced draft vocabulary (vLLM's d2t mode): `x seed` is "
                f"{NO_SEED}; the ratio is over {LOOP_IMPL} (`x loop`).", ""]
    lines += [_table(sub), ""]
    host = _host_table(sub)
    if host:
      lines += ["Host time of one eager call (perf_counter around the call, "
                "no synchronize; median us):", "", host, ""]
  if greedy:
    lines += ["## Greedy drafting (tokens only, no cache)", "",
              GREEDY_CAPTION, _greedy_table(greedy, all_rows), ""]
  rows = all_rows
  notes = sorted({f"{r['impl']}: {r['note']}" for r in rows if r.get("note")})
  notes += sorted({f"{r['impl']} timed: {r['timed']}" for r in rows
                   if r.get("timed") and r["timed"].startswith("jax_markov.")})

  gemm = sorted({r["bias_gemm"] for r in rows if r.get("bias_gemm")})
  if gemm:
    notes.append(f"f32_bias_design bias GEMM: {', '.join(gemm)}")
  bad = [r for r in rows if r.get("tokens_match") is False]
  if bad:
    notes.append(f"{len(bad)} rows drew temperature-0 tokens that differ from "
                 "the first implementation's (marked above)")
  if notes:
    lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
  return "\n".join(lines)


def _display_path(path: str) -> str:
  """The path relative to the repository root when inside it."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  rel = os.path.relpath(os.path.abspath(path), root)
  return path if rel.startswith("..") else rel


# Everything from this line on in benchmarks.md is hand-written and kept when
# the tables above it are regenerated.
KEEP_MARKER = "<!-- hand-written below: kept by benchmarks/report.py -->"


def write_report(json_path: str, docs_dir: str,
                 with_plot: bool = False) -> tuple[str, str | None]:
  """Writes docs_dir/benchmarks.md, and docs_dir/benchmarks.png with
  ``with_plot``.

  A hand-written tail of an existing benchmarks.md, from KEEP_MARKER on, is
  kept.

  Args:
    json_path: a results file written by :mod:`benchmarks.run` (a list of
      rows).
    docs_dir: output folder.

  Returns:
    (markdown path, png path or None).
  """
  rows = _load(json_path)
  os.makedirs(docs_dir, exist_ok=True)
  md_path = os.path.join(docs_dir, "benchmarks.md")
  png_path = os.path.join(docs_dir, "benchmarks.png") if with_plot else None
  kept = ""
  if os.path.exists(md_path):
    with open(md_path) as f:
      old = f.read()
    if KEEP_MARKER in old:
      kept = "\n" + old[old.index(KEEP_MARKER):]
  if png_path:
    plot(rows, png_path)
  with open(md_path, "w") as f:
    f.write(markdown(rows, _display_path(json_path),
                     os.path.basename(png_path) if png_path else None) + kept)
  return md_path, png_path


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.report")
  p.add_argument("json_path")
  p.add_argument("--plot", action="store_true",
                 help="also write benchmarks.png (not committed)")
  p.add_argument("--docs-dir", default=os.path.join(
      os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs"))
  args = p.parse_args(argv)
  md, png = write_report(args.json_path, args.docs_dir,
                         with_plot=args.plot)
  print(f"wrote {md}" + (f" and {png}" if png else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
