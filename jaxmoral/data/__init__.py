"""Data: readers with line-numbered errors, SentencePiece vocabularies, the bundled demo corpus,
T5X feature conversion with deterministic batching, index caches, and seqio Tasks (the only
modules that import seqio and TensorFlow: `tasks`, `span_corruption`, `pretraining_corpus`)."""
