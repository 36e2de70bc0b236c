"""The teacher backends by name: the one place where ``teacher.backend`` becomes a class.

The names are :data:`boosttune.config.TEACHER_BACKENDS` (config sits below training and cannot
import this; a test holds the two equal). A new backend is a :class:`TeacherBackend` subclass in
its own module, registered here and named there.
"""

from __future__ import annotations

from collections.abc import Sequence

from boosttune.config import ConfigError, TeacherConfig
from boosttune.core.rundir import RunDir
from boosttune.train.sources import TrainPrompt
from boosttune.train.teacher.base import TeacherBackend
from boosttune.train.teacher.local import BatchedBackend, HFBackend, LocalBackend
from boosttune.train.teacher.openai_server import OpenAIBackend

BACKENDS: dict[str, type[TeacherBackend]] = {
    "auto": LocalBackend,
    "batched": BatchedBackend,
    "hf": HFBackend,
    "openai": OpenAIBackend,
}


def backend_for(cfg: TeacherConfig) -> TeacherBackend:
    """The backend that ``cfg.backend`` names, holding ``cfg``."""
    try:
        cls = BACKENDS[cfg.backend]
    except KeyError:
        raise ConfigError(f"teacher.backend: {cfg.backend!r} is not a teacher backend; "
                          f"set it to one of {', '.join(BACKENDS)}") from None
    return cls(cfg)


def run_teacher(
    model, tokenizer, prompts: Sequence[TrainPrompt], cfg: TeacherConfig, run: RunDir,
    eos_ids: frozenset[int], rank: int = 0, world: int = 1, seed: int = 0, features: bool = False,
) -> dict:
    """Write this rank's missing shards by ``cfg.backend`` (:meth:`TeacherBackend.run`: with
    ``features``, the batched decoder's features files too); returns what this call generated."""
    return backend_for(cfg).run(model, tokenizer, prompts, run, eos_ids, rank=rank, world=world, seed=seed,
                                features=features)
