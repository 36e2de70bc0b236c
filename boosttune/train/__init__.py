"""`boosttune train`: prompts → teacher shards → boost-tuned SSMs → τ evaluation → scheduler.

``pipeline`` runs the phases and resumes them; ``sources`` and ``grow`` (prompts), ``teacher``
(the LLM's continuations in Arrow shards), ``draft_ranking`` (the run's token ranking), ``ssm_init``
(the SSMs' common start), ``distill`` (the LightningModule, losses, batching), ``stage`` (one
stage's resumable Trainer), ``matching`` (which samples an SSM matches), ``evaluate`` (τ with the
serving engine), ``dist`` (ranks and launching), ``faults`` (crash points for the resume tests).
"""
