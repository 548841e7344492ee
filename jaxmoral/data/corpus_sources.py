"""Text sources that method packages add to the pretraining corpus (`pretraining_corpus`).

A method package registers the reader of its texts when it is imported (PERSPECTRUM in
`jaxmoral.npov.knowledge_base`, chitchat in `jaxmoral.diamante.chitchat`), so the core corpus
reads them without importing the methods; a gin config imports the modules whose sources it
uses.
"""

from __future__ import annotations

from typing import Callable, Iterator

# reader(data_dir, *, splits) -> texts; `splits` is None where the corpus gives no splits.
TextReader = Callable[..., Iterator[str]]

_READERS: dict[str, tuple[TextReader, bool]] = {}


def register(name: str, reader: TextReader, *, needs_data_dir: bool = True) -> None:
  """Adds source `name`: `reader(data_dir, splits=...)` yields its texts; `needs_data_dir`:
  it reads files under the corpus's `data_dir` (else it finds its data itself)."""
  _READERS[name] = (reader, needs_data_dir)


def registered() -> dict[str, tuple[TextReader, bool]]:
  """{name: (reader, needs_data_dir)} of every source registered so far."""
  return dict(_READERS)
