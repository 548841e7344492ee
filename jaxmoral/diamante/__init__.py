"""Diamante: generation–evaluation joint training of a dialogue model (Lu, Bao et al., ACL 2023).

One T5 with a scalar head generates responses and scores them (`model`, `loss`); at inference
it answers with the best-scored of its samples (`inference`). CLI: `jaxmoral diamante <action>`.
"""
