"""Command line: ``python -m jax_markov demo [options]``.

The demo is an example, not part of the library: it lives in ``examples/`` of
a source checkout and is imported only when the command runs (the wheel holds
``jax_markov`` and ``torch_bridge`` only). The benchmarks are
``python -m benchmarks`` from a checkout.
"""

from __future__ import annotations

import sys

USAGE = """usage: python -m jax_markov demo [options]

  demo   draft text with a Markov head and verify it against a target model
         (the main job; runs on CPU in Pallas interpret mode, or on a GPU;
         examples/demo.py, run from the repository root of a checkout)

'python -m jax_markov demo --help' lists its options. The benchmarks are
'python -m benchmarks' from the repository root."""

_NO_EXAMPLES = """demo: the examples/ folder is not importable here.
The demo ships with the source checkout, not with the wheel: run it from the
repository root (git clone, then 'pip install -e .' and
'python -m jax_markov demo' there)."""


def _load_demo():
  """examples.demo, or None when no checkout's examples/ is importable."""
  try:
    from examples import demo  # pylint: disable=import-outside-toplevel
  except ModuleNotFoundError as e:
    if e.name not in ("examples", "examples.demo"):
      raise  # the demo itself failed to import: show why
    return None
  if not hasattr(demo, "main"):  # some other package called ``examples``
    return None
  return demo


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(USAGE)
    return 0 if argv else 2
  command, rest = argv[0], argv[1:]
  if command == "demo":
    demo = _load_demo()
    if demo is None:
      print(_NO_EXAMPLES, file=sys.stderr)
      return 2
    return demo.main(rest)
  if command == "bench":
    print("bench: the benchmarks moved to 'python -m benchmarks' (from the "
          "repository root of a checkout)", file=sys.stderr)
    return 2
  print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main())
