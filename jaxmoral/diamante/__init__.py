"""Diamante: generation–evaluation joint training of a dialogue model (Lu, Bao et al., ACL 2023).

One T5 with a scalar head generates responses and scores them. Modules:

- `data`: the Diamante JSONL format, left-truncated contexts, per-epoch (c, r_H, r_M, r_R)
  quadruples (`QuadrupleSource`).
- `model`: one batched pass for K responses per context (logits + preference scores).
- `loss`: NLL(r_H) + the PE loss, in the trainer's loss-fn contract.
- `diamante_model`: `DiamanteModel`, the trainable model `runs.train_run` trains (joint or
  NLL-only ablation).
- `candidates`: sample and store model candidates for a corpus without them.
- `chitchat`: the chitchat dialogue corpus (the `dialogue` extra), split by conversation id.
- `inference`: sample N candidates, score, answer with the best; `bundle`: load a run.
- `evaluate`: rank the human response by preference score vs generation probability.
- `chat`: interactive and self-chat with transcripts; `demo`: the CPU demo;
  `commands`: `jaxmoral diamante <action>`.
"""
