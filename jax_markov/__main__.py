"""Command line: ``python -m jax_markov demo [options]`` or ``bench [options]``."""

from __future__ import annotations

import sys

USAGE = """usage: python -m jax_markov {demo,bench} [options]

  demo   draft text with a Markov head and verify it against a target model
         (the main job; runs on CPU in Pallas interpret mode, or on a GPU)
  bench  time the sampler against the reference design, vLLM's loop and
         plain JAX on a GPU, with the HBM floor (benchmarks/run.py)

'python -m jax_markov COMMAND --help' lists each command's options."""


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(USAGE)
    return 0 if argv else 2
  command, rest = argv[0], argv[1:]
  if command == "demo":
    from jax_markov import demo
    return demo.main(rest)
  if command == "bench":
    try:
      from benchmarks import run
    except ImportError:
      print("bench: the benchmarks/ folder is not importable; run from the "
            "repository root", file=sys.stderr)
      return 2
    return run.main(rest)
  print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main())
