"""Diamante: generation–evaluation joint training of a dialogue model (Lu, Bao et al., ACL 2023).

One T5 with a scalar head generates responses and scores them: `data` (the Diamante format,
per-epoch quadruples), `model` and `loss` (the joint pass and NLL + PE loss), `diamante_model`
(what `runs.train_run` trains), `candidates`, `inference` (sample, score, answer with the
best), `evaluate`, `chat`; `commands` is `jaxmoral diamante <action>`.
"""
