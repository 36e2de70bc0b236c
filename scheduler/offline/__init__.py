"""Training the scheduler (`boosttune train-scheduler`): it loads models and runs engines; serving never imports it.

``labels`` (full-information labels per output position and drafter), ``walk`` (replaying a policy
step by step over them), ``calibrate`` (the cost model, measured with the engine), ``stepwise``
(prompt lookup's learned per-match chain lengths), ``evaluate`` (replay and real runs of every
policy), ``train`` (``train_scheduler``), ``report`` and ``plot`` (scheduler_report.json / .png).
"""
