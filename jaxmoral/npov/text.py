"""Words, stopwords and stems shared by the NPOV detectors.

A *word* is a maximal run of letters and digits: text is split on whitespace and on
punctuation. ROUGE and the salience word maps both use this one definition, so their
word-level scores line up with each other and with the synthetic word labels.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from nltk.stem import PorterStemmer

# NLTK's classic English stopword list (179 words). nltk's corpus data cannot be downloaded
# in every environment, so the list lives here; the words are facts of that list.
STOPWORDS: frozenset[str] = frozenset("""
i me my myself we our ours ourselves you you're you've you'll you'd your yours yourself
yourselves he him his himself she she's her hers herself it it's its itself they them their
theirs themselves what which who whom this that that'll these those am is are was were be been
being have has had having do does did doing a an the and but if or because as until while of at
by for with about against between into through during before after above below to from up down
in out on off over under again further then once here there when where why how all any both each
few more most other some such no nor not only own same so than too very s t can will just don
don't should should've now d ll m o re ve y ain aren aren't couldn couldn't didn didn't doesn
doesn't hadn hadn't hasn hasn't haven haven't isn isn't ma mightn mightn't mustn mustn't needn
needn't shan shan't shouldn shouldn't wasn wasn't weren weren't won won't wouldn wouldn't
""".split())

# Letters and digits; `_` counts as punctuation (it is in \w but not a word character here).
_WORD_RE = re.compile(r"[^\W_]+", re.UNICODE)
_STEMMER = PorterStemmer()


@dataclasses.dataclass(frozen=True)
class Word:
  """One word of a text: as written, its characters [start, end), its lower-cased Porter stem
  (the unit ROUGE matches on) and whether the lower-cased word is in `STOPWORDS`."""
  text: str
  start: int
  end: int
  stem: str
  is_stopword: bool


@functools.lru_cache(maxsize=1 << 16)
def stem(word: str) -> str:
  """Lower-cased Porter stem of one word."""
  return _STEMMER.stem(word.lower())


def words(text: str) -> list[Word]:
  """All words of `text` (split on whitespace and punctuation), with offsets and stems."""
  return [Word(m.group(0), m.start(), m.end(), stem(m.group(0)), m.group(0).lower() in STOPWORDS)
          for m in _WORD_RE.finditer(text)]


def content_stems(text: str) -> list[str]:
  """Stems of the non-stopwords of `text`, in order (ROUGE's token sequence)."""
  return [w.stem for w in words(text) if not w.is_stopword]

