"""The floor every other layer stands on: model loading, run directories, trustworthy files, prompts.

``models`` (the embedded default LLM, local directories, hub ids), ``rundir`` (``RunDir``: every
path of a training run), ``files`` (atomic writes, the completion marker, hashes), ``prompts``
(prompt files and chat templating). Nothing here imports another boosttune package.
"""
