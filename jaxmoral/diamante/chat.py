"""Talking to a Diamante model: interactive chat and self-chat, both writing transcripts.

Every bot turn answers with the best-scored of N candidates (`inference.respond`). Transcripts
are JSON lines, one turn a line: `{"turn", "speaker" ("user"|"bot"|"bot_a"|"bot_b"), "text"}`,
bot turns with their "score" and "candidates" ([[text, score], ...], best first).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Optional, TextIO

import gin
import jax

from jaxmoral import fileio
from jaxmoral import partitioning
from jaxmoral.data import readers
from jaxmoral.diamante import bundle as bundle_lib
from jaxmoral.diamante import inference

QUIT_WORDS = ("/quit", "/exit")
NOT_UTF8 = "input is not valid UTF-8; skipped"


def read_line(prompt: str) -> str:
  """`input(prompt)` for chats (clarify's too): a line that is not UTF-8 raises UnicodeError
  for that line alone (end of input: EOFError). Piped input is decoded line by line: `input()`
  would give undecodable bytes as surrogates (SentencePiece then fails), or, with strict
  decoding, lose the whole buffered chunk. A terminal keeps `input()` (line editing); its
  surrogates are caught here.
  """
  stdin = sys.stdin
  if stdin is None:
    raise EOFError
  raw_stdin = getattr(stdin, "buffer", None)
  if raw_stdin is None or stdin.isatty():
    line = input(prompt)
  else:
    print(prompt, end="", flush=True)
    raw = raw_stdin.readline()
    if not raw:
      raise EOFError
    line = raw.decode("utf-8").rstrip("\r\n")
  line.encode("utf-8")  # Surrogates (undecodable bytes) raise here.
  return line


def _bot_turn(bundle: bundle_lib.Bundle, history: list[str], records: list[dict], speaker: str,
              rng: jax.Array, rerank: Optional[inference.RerankConfig],
              output: Optional[TextIO]) -> inference.Reply:
  """The best-scored reply to `history`, added to it and (with its candidates) to `records`,
  and printed to `output` (None: silent)."""
  reply = inference.respond(bundle, [history], rng=rng,
                            config=rerank or inference.RerankConfig())[0]
  history.append(reply.text)
  records.append({"turn": len(records), "speaker": speaker, "text": reply.text,
                  "score": reply.score,
                  "candidates": [[c.text, c.score] for c in reply.candidates]})
  if output is not None:
    print(f"{speaker}> {reply.text}  [score {reply.score:.3f}]", file=output)
  return reply


@gin.configurable
def chat(*, model_dir: str, transcript_path: str,
         rerank: Optional[inference.RerankConfig] = None, seed: int = 0,
         max_turns: int = 100, show_candidates: int = 0, input_fn: Callable[[str], str] = read_line,
         output: Optional[TextIO] = None, partitioner: Any = None) -> list[dict]:
  """Interactive conversation on the terminal; `/quit` (or end of input) ends it.

  Args:
    model_dir: A run directory (its `export/`) or an export directory.
    transcript_path: JSONL transcript to write.
    rerank: Candidates, top-k, n-gram blocking, length (None: `RerankConfig()`, made at
      call time so that `--gin.RerankConfig.*` bindings apply).
    max_turns: User turns at most.
    show_candidates: Also print this many top candidates with their scores.
    input_fn: Reads a user line (tests pass a scripted one); a line that is not UTF-8
      (UnicodeError, or undecodable bytes as surrogates) is skipped with a note on stderr.
    output: Where replies are printed (None: standard output as it is at call time).
    partitioner: The mesh the model runs on (the run's PARTITIONER; None: `inference_partitioner`).
  """
  output = sys.stdout if output is None else output
  bundle = bundle_lib.load(model_dir, partitioner=partitioning.inference_partitioner(partitioner))
  key = jax.random.PRNGKey(seed)
  history: list[str] = []
  records: list[dict] = []
  with fileio.open_text_writer(transcript_path) as transcript:
    for _ in range(max_turns):
      try:
        line = input_fn("you> ").strip()
        line.encode("utf-8")  # A scripted input_fn may hand surrogates too.
      except EOFError:
        break
      except UnicodeError:  # SentencePiece would fail on it: say so, keep the conversation.
        print(NOT_UTF8, file=sys.stderr)
        continue
      if line in QUIT_WORDS:
        break
      if not line:
        continue
      history.append(line)
      records.append({"turn": len(records), "speaker": "user", "text": line})
      key, sub = jax.random.split(key)
      reply = _bot_turn(bundle, history, records, "bot", sub, rerank, output)
      for c in reply.candidates[1:1 + show_candidates]:
        print(f"     ({c.score:.3f}) {c.text}", file=output)
      for record in records[-2:]:
        transcript.write(json.dumps(record, ensure_ascii=False) + "\n")
      transcript.flush()
  return records


@gin.configurable
def self_chat(*, model_dir: str, opening: str, num_rounds: int, transcript_path: str,
              rerank: Optional[inference.RerankConfig] = None, seed: int = 0,
              output: Optional[TextIO] = sys.stdout, partitioner: Any = None) -> list[dict]:
  """The model talks to itself for `num_rounds` turns after an opening line.

  Args:
    opening: The first utterance (speaker "bot_b").
    num_rounds: Generated turns, alternating bot_a, bot_b.
    model_dir, transcript_path, rerank, partitioner: As `chat`'s.
    output: Where turns are printed (None: silent).
  """
  if not opening.strip():
    raise ValueError("self_chat: opening must be a non-empty line")
  if num_rounds < 1:
    raise ValueError(f"self_chat: num_rounds must be >= 1, got {num_rounds}")
  bundle = bundle_lib.load(model_dir, partitioner=partitioning.inference_partitioner(partitioner))
  key = jax.random.PRNGKey(seed)
  history = [opening.strip()]
  records = [{"turn": 0, "speaker": "bot_b", "text": history[0]}]
  if output is not None:
    print(f"bot_b> {history[0]}", file=output)
  for i in range(num_rounds):
    key, sub = jax.random.split(key)
    _bot_turn(bundle, history, records, "bot_a" if i % 2 == 0 else "bot_b", sub, rerank, output)
  readers.write_jsonl(transcript_path, records)
  return records
