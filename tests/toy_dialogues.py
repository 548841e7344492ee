"""Deterministic toy dialogues in the Diamante format, for the tests.

Each dialogue talks about one thing; the human responses stay on it, the "model" candidates
are the generic or slightly off replies a weak generator gives. Not a substitute for real data
(the demo uses the bundled sample, the benchmark real dialogues).
"""

from __future__ import annotations

import numpy as np

from jaxmoral.diamante.data import Turn
from jaxmoral.diamante.data import parse_dialogue

_THINGS = ["pizza", "jazz", "hiking", "cats", "football", "chess", "coffee", "rain", "paris",
           "guitars", "movies", "gardens", "trains", "the ocean", "winter", "books"]
_GENERIC = ["i do not know.", "ok.", "maybe.", "what do you mean?", "i am not sure about that.",
            "that is nice.", "yes.", "no."]


def toy_dialogue(rng: np.random.Generator) -> dict:
  """One dialogue object (`{"conversation": [...]}`) with candidates."""
  thing = _THINGS[int(rng.integers(len(_THINGS)))]
  other = _THINGS[int(rng.integers(len(_THINGS)))]
  lines = [f"hi! do you like {thing}?",
           f"yes, i really like {thing}. do you?",
           f"i love {thing} too. what do you like most about {thing}?",
           f"everything about {thing} makes me happy.",
           "nice talking to you, bye!"]
  conversation = []
  for i, text in enumerate(lines):
    cands = [] if i == 0 else [str(c) for c in rng.choice(_GENERIC, size=3, replace=False)]
    if i > 0 and rng.random() < 0.5:
      cands.append(f"i like {other} more.")
    conversation.append({"utterance": text, "response_candidates": cands})
  return {"conversation": conversation}


def toy_turns(num_dialogues: int, *, seed: int = 0) -> list[Turn]:
  """Turns of `num_dialogues` toy dialogues."""
  rng = np.random.default_rng(seed)
  turns: list[Turn] = []
  for d in range(num_dialogues):
    turns.extend(parse_dialogue(toy_dialogue(rng), dialogue=d))
  return turns
