"""The chitchat dialogue corpus (BYU PCC, `pip install jaxmoral[dialogue]`), split by dialogue.

chitchat-dataset holds 7,168 human–human conversations, each a list of turns (a speaker's
consecutive messages, joined into one utterance).

The split is a stable function of the conversation id (`is_test`), not of file order or a
random seed, so span-corruption pretraining (`jaxmoral.data.pretraining_corpus`, source
"chitchat") never reads a conversation that the Diamante experiment tests on.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterator, Optional, Sequence

from jaxmoral import fileio
from jaxmoral.data import corpus_sources
from jaxmoral.diamante import data as data_lib

SPLITS = ("train", "test")
TEST_EVERY = 10


def _dataset(path: Optional[str | os.PathLike] = None) -> dict:
  """{conversation id: conversation}: of the file `path`, else of the installed package."""
  if path is not None:
    return json.loads(fileio.read_text(path))
  try:
    import chitchat_dataset  # pylint: disable=import-outside-toplevel
  except ImportError:
    # A setting of the user's install, not a bug: a ValueError is one line on the command
    # line and in the experiment runners (as for a PyTorch checkpoint without torch).
    raise ValueError("the chitchat corpus needs the dialogue extra: pip install "
                     "'jaxmoral[dialogue]' (in a clone: pip install -e '.[dialogue]')") from None
  return chitchat_dataset.Dataset()


def is_test(conversation_id: str) -> bool:
  """Whether a conversation is held out: 1 in `TEST_EVERY`, by a hash of its id."""
  digest = hashlib.sha256(conversation_id.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") % TEST_EVERY == 0


def dialogues(*, split: str, min_turns: int = 2, max_turns: Optional[int] = None,
              path: Optional[str | os.PathLike] = None) -> list[list[str]]:
  """Utterance lists of the conversations of `split` ("train" | "test"), in id order.

  Conversations with fewer than `min_turns` non-empty turns are dropped, the others cut to
  `max_turns`. `path`: a file (local or a bucket URL) in the package's `dataset.json` layout,
  read instead of the installed package (which needs the extra).
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  out = []
  for conversation_id, conversation in sorted(_dataset(path).items()):
    if is_test(conversation_id) != (split == "test"):
      continue
    utterances = [" ".join(m["text"].strip() for m in turn if m["text"].strip())
                  for turn in conversation["messages"]]
    utterances = [u for u in utterances if u][:max_turns]
    if len(utterances) >= min_turns:
      out.append(utterances)
  return out


def turns(conversations: Sequence[Sequence[str]]) -> list[data_lib.Turn]:
  """Every response position of each conversation as a Diamante turn (no candidates)."""
  return [data_lib.Turn(tuple(utterances[:i]), utterances[i], (), d)
          for d, utterances in enumerate(conversations)
          for i in range(1, len(utterances))]


def texts(*, split: str = "train") -> Iterator[str]:
  """Every utterance of the conversations of `split`, for a pretraining corpus."""
  for utterances in dialogues(split=split, min_turns=1):
    yield from utterances


# The pretraining corpus reads the train conversations only (the test ones stay held out).
corpus_sources.register("chitchat", lambda data_dir, splits: texts(split="train"),
                        needs_data_dir=False)
