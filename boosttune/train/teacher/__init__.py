"""The teacher phase: the LLM's continuations of every prompt, written as resumable shards.
``shards`` (the shard files: writing, reading, listing), ``base`` (``TeacherBackend``, what every
backend implements: a preflight before the LLM loads, then the shards), ``local`` (the LLM in this
process: ``auto``, ``batched``, ``hf``), ``openai_server`` (an OpenAI-compatible server: ``openai``),
``backends`` (the registry, ``teacher.backend`` name -> class, and ``run_teacher``). Imports point
from the registry to the backends to ``base`` and ``shards``, never back, and nothing imports this file.
"""
