"""Demo text that needs no download, and its character vocabulary.

The text is the Zen of Python (the ``this`` module, rot13-decoded) followed by
the docstrings of a fixed list of standard-library modules and of their public
members, so it ships with every Python. Its exact content depends on the
Python version (docstrings change between releases); nothing in the project
depends on the exact text. Under ``python -OO`` docstrings are stripped, and
the embedded paragraph below keeps the text from being empty.

The text is normalized (:func:`normalize`). The vocabulary is character
level: ``"\\n"`` and the 95 printable ASCII characters, ``V = 96``.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib
import inspect
import io
import re

import numpy as np

# Token 0 is the newline, tokens 1..95 are chr(32)..chr(126).
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(ALPHABET)
_INDEX = {c: i for i, c in enumerate(ALPHABET)}

# Pure-Python modules with long, prose-like docstrings. Order matters: it fixes
# the text (and so the demo's numbers) for a given Python version.
MODULES = ("argparse", "textwrap", "json", "collections", "functools",
           "itertools", "string", "random", "statistics", "fractions",
           "contextlib", "dataclasses", "heapq", "bisect", "shlex",
           "difflib", "pathlib", "logging", "unittest", "typing", "re")

_EMBEDDED = """\
A draft model proposes several tokens at once; the target model checks them
in a single pass and keeps the longest prefix it agrees with. Speculative
sampling accepts each drafted token with probability min(1, p / q), where p is
the target's probability and q the draft's, and on the first rejection draws a
replacement from the normalized residual max(0, p - q). The tokens it emits
follow the target's distribution exactly, whatever the draft: a better draft
only makes the accepted blocks longer. A Markov head lets the draft condition
each token on the one before it, which a draft whose base logits ignore the
previous token cannot do.
"""


def zen_of_python() -> str:
  """The Zen of Python, decoded from the ``this`` module's rot13 text."""
  # Importing `this` prints the Zen on first import; keep stdout clean.
  with contextlib.redirect_stdout(io.StringIO()):
    this = importlib.import_module("this")
  return codecs.decode(this.s, "rot13")


def _docstrings(module_name: str) -> list[str]:
  try:
    module = importlib.import_module(module_name)
  except ImportError:
    return []
  docs = [inspect.getdoc(module) or ""]
  for name in sorted(getattr(module, "__all__", None) or dir(module)):
    if name.startswith("_"):
      continue
    member = getattr(module, name, None)
    if inspect.isclass(member) or inspect.isfunction(member):
      # Only members defined in the module, not re-exported ones.
      if getattr(member, "__module__", None) == module_name:
        docs.append(inspect.getdoc(member) or "")
  return [d for d in docs if d]


def load_text(max_chars: int = 200_000) -> str:
  """The demo text: the Zen, an embedded paragraph and stdlib docstrings.

  Args:
    max_chars: the text is cut to at most this many characters.

  Returns:
    str, normalized to the vocabulary (see :func:`normalize`).
  """
  parts = [zen_of_python(), _EMBEDDED]
  for name in MODULES:
    parts.extend(_docstrings(name))
  return normalize("\n\n".join(parts))[:max_chars]


def normalize(text: str) -> str:
  """Fits text to the vocabulary and makes it read more like prose.

  Tabs become spaces, characters outside the vocabulary are dropped, and runs
  of spaces (the indentation of code examples) become one space, as do runs of
  blank lines: otherwise a bigram model's most likely token after a space is
  another space.
  """
  text = text.replace("\t", " ").replace("\r\n", "\n")
  text = "".join(c for c in text if c in _INDEX)
  text = re.sub(r" +", " ", text)
  text = re.sub(r" ?\n ?", "\n", text)
  return re.sub(r"\n{3,}", "\n\n", text)


def encode(text: str) -> np.ndarray:
  """Characters -> int32 token ids [len(text)].

  Raises:
    ValueError: a character is outside the vocabulary.
  """
  try:
    return np.asarray([_INDEX[c] for c in text], dtype=np.int32)
  except KeyError as e:
    raise ValueError(f"character {e.args[0]!r} is not in the demo vocabulary "
                     "(printable ASCII and newline)") from None


def decode(tokens) -> str:
  """Token ids -> characters."""
  return "".join(ALPHABET[int(t)] for t in np.asarray(tokens).ravel())


def printable(text: str) -> str:
  """Escapes newlines and other unprintable characters for one-line display."""
  return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
