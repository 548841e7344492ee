"""ClarifyDelphi (Pyatkin et al., ACL 2023): clarification questions tuned by PPO with a
defeasibility (Jensen-Shannon) reward; `commands` is `jaxmoral clarify <action>`.
"""
