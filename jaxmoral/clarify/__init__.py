"""ClarifyDelphi (Pyatkin et al., ACL 2023): clarification questions tuned by PPO with a
defeasibility (Jensen-Shannon) reward.

Modules: `formats` (text formats of the five models), `data` (training pairs, silver labels),
`models` (loading and batched jitted inference), `judge` (class distribution), `nli` (answer
filter), `reward` (`DefeasibilityReward`, the PPO reward_fn), `training` (gin entry points
`train_clarify_model`, `train_clarify_ppo`), `baselines`, `evaluate` (and its entry point
`evaluate_model_dirs`), `chat` (`chat`, `chat_from_file`), `demo` (`run_demo`), `commands`
(`jaxmoral clarify <action> --NAME=VALUE ...`: the table of those gin entry points, whose
arguments the flags bind), `testing` (random tiny models).
"""
