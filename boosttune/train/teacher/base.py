"""The interface every teacher backend implements: checks before the LLM loads, then the shards.

Backends differ in where the LLM's continuations come from (this process, or a server); what they
write is the same (:mod:`boosttune.train.teacher.shards`). The pipeline holds one backend, chosen
by ``teacher.backend`` through :func:`boosttune.train.teacher.backends.backend_for`, and never asks
which one it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from boosttune.config import TeacherConfig
from boosttune.core.rundir import RunDir
from boosttune.train.sources import TrainPrompt


class TeacherBackend(ABC):
    """One way of obtaining the LLM's continuations of the run's prompts, as teacher shards."""

    decoder: ClassVar[str] = "auto"
    """The in-process decoder for generation the run does with its own LLM besides the shards (growing
    prompts): 'batched', 'hf', or 'auto' (batched where the LLM's attention allows it, else hf)."""

    def __init__(self, cfg: TeacherConfig) -> None:
        self.cfg = cfg

    def preflight(self, llm_ref: str, run: RunDir) -> None:
        """Checks that fail in seconds, made before the LLM's weights load (``llm_ref``: ``llm.ref``).
        Raises ValueError naming the config field. Nothing to check by default."""
        return None

    @abstractmethod
    def run(self, model, tokenizer, prompts: Sequence[TrainPrompt], run: RunDir, eos_ids: frozenset[int], *,
            rank: int = 0, world: int = 1, seed: int = 0, features: bool = False) -> dict:
        """Write this rank's missing shards (shard ``k`` is rank ``k % world``'s); returns what this call
        generated: ``shards_written``, ``tokens``, ``seconds``, ``tokens_per_s``, ``backend`` (its
        name in the report) and ``token_ids`` (how the token ids were obtained).

        Args:
            model: the LLM, loaded in this process (backends that ask a server leave it unused).
            tokenizer: the LLM's tokenizer.
            prompts: the run's whole prompt set, in order (shards are slices of it).
            run: the run directory the shards go to.
            eos_ids: the LLM's end-of-sequence token ids.
            rank: this process's rank.
            world: the number of ranks.
            seed: the run's seed (sampling teachers draw reproducibly per shard or prompt from it).
            features: also keep the LLM's features beside the shards where the backend can.
        """
