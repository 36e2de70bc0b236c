"""The learned scheduler at serve time: which drafters and trees a request gets, before decoding.

``features`` (what is known before decoding), ``model`` (the linear acceptance model),
``subsets`` (subset bitmasks and survival arithmetic), ``costs`` (the measured cost model and the
trees each depth means), ``policy`` (``Scheduler.load`` / ``choose``: the ``Plan`` a request gets),
``persist`` (the JSON file format, no pickle). Training it is ``offline/`` (labels, replay,
calibration, evaluation, reports), which serving never imports.
"""
