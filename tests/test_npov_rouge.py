"""ROUGE-1 detector and word splitting: checked against the `rouge-score` package."""

import pytest
from rouge_score import rouge_scorer

from jaxmoral.npov import task
from jaxmoral.npov import text as text_lib
from jaxmoral.npov.detectors import rouge


class _ContentTokenizer:
  """`rouge_score`-compatible tokenizer object producing `text.content_stems`."""

  def tokenize(self, text):
    return text_lib.content_stems(text)


def _example(response, pro, con, query="Should homework be banned?"):
  return task.NpovExample(id="x", topic="t", query=query, pro=tuple(pro), con=tuple(con),
                          response=response)


EXAMPLES = [
    _example("Some say homework builds discipline and discipline matters. Others worry that "
             "children are stressed and tired.",
             ["Homework builds discipline", "It reinforces what was learned in class"],
             ["Children are stressed by homework", "Kids need time to play"]),
    _example("Uniforms reduce bullying. Uniforms are cheap, cheap, cheap.",
             ["Uniforms reduce bullying at schools"], ["Uniforms limit self-expression"]),
    _example("Nothing here overlaps.", ["Vaccines save lives"], ["Mandates violate liberty"]),
]


def test_stopword_list_is_nltk_classic_179():
  assert len(text_lib.STOPWORDS) == 179
  assert {"the", "mustn't", "ourselves", "y"} <= text_lib.STOPWORDS
  assert "homework" not in text_lib.STOPWORDS


def test_words_split_on_whitespace_and_punctuation():
  got = [(w.text, w.stem, w.is_stopword) for w in text_lib.words("Kids' well-being, e.g. 2x!")]
  assert got == [("Kids", "kid", False), ("well", "well", False), ("being", "be", True),
                 ("e", "e", False), ("g", "g", False), ("2x", "2x", False)]
  assert text_lib.content_stems("The children are running") == ["children", "run"]


@pytest.mark.parametrize("example", EXAMPLES)
def test_scores_equal_rouge_score_package(example):
  scorer = rouge_scorer.RougeScorer(["rouge1"], tokenizer=_ContentTokenizer())
  detection = rouge.RougeDetector().detect(example)
  ref_all = scorer.score(" ".join(example.arguments), example.response)["rouge1"]
  assert detection.hallucination == pytest.approx(1.0 - ref_all.precision, abs=1e-12)
  recalls = [scorer.score(" ".join(getattr(example, side)), example.response)["rouge1"].recall
             for side in ("pro", "con")]
  assert detection.coverage == pytest.approx(1.0 - min(recalls), abs=1e-12)


def test_word_scores_mark_unmatched_words():
  detection = rouge.RougeDetector().detect(EXAMPLES[1])
  by_word = {(w.text, w.start): w.score for w in detection.response_words}
  assert by_word[("bullying", 16)] == 0.0 and by_word[("cheap", 39)] == 1.0
  assert all(EXAMPLES[1].response[w.start:w.end] == w.text for w in detection.response_words)
  missed = {w.text for w in detection.argument_words if w.score == 1.0}
  assert missed == {"schools", "limit", "self", "expression"}
  assert all(getattr(EXAMPLES[1], w.field)[w.index][w.start:w.end] == w.text
             for w in detection.argument_words)


def test_include_query_raises_precision():
  example = _example("Homework should be banned, say some.", ["Homework is useless"], ["No"])
  assert (rouge.RougeDetector(include_query=True).detect(example).hallucination
          < rouge.RougeDetector().detect(example).hallucination)
