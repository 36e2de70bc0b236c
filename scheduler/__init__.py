"""Learned SSM scheduler (issue 4): request features, training from logged verifications, policy.

Modules, one job each: ``config`` (SchedulerConfig, the ``scheduler:`` section), ``features``
(what is known before decoding), ``labels`` (full-information labels from the engine),
``positions`` (per output position and drafter: what a step starting there would accept),
``walk`` (replaying a policy step by step over them), ``costs`` (the measured cost model),
``subsets`` (subset bitmasks and survival arithmetic), ``model`` (the linear acceptance model),
``stepwise`` (prompt lookup's learned per-match chain lengths), ``policy`` (``Scheduler.load`` /
``choose``), ``persist`` (the JSON file format, no pickle), ``evaluate`` (replay and real runs of
every policy), ``plot`` and ``train`` (``train_scheduler``, what `boosttune train-scheduler RUN_DIR`
runs).
"""
