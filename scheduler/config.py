"""What training the scheduler does: one typed dataclass, the ``scheduler:`` section of a training YAML.

Every field has a default except the prompt file, which must be held out from SSM training (the
labels would otherwise flatter the SSMs). ``boosttune.config.from_dict`` reads it from YAML, refusing
unknown keys by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

POLICY_NAMES = ("learned", "all", "best_fixed", "none")
"""Policies that ``real_policies`` may name (run for real through the engine on the eval prompts)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """How `boosttune train-scheduler` collects labels, fits and evaluates the scheduler.

    Attributes:
        prompts: JSONL/text file of prompts held out from SSM training (MT-bench's question.jsonl
            works: first turns are used). Required.
        eval_prompts: a separate file for the evaluation requests; None splits ``prompts``.
        limit: use the first ``limit`` prompts of ``prompts`` (0 = all).
        eval_limit: use the first ``eval_limit`` prompts of ``eval_prompts`` (0 = all).
        train_fraction: share of ``prompts`` used to fit (the rest evaluates) when
            ``eval_prompts`` is None; the split is a seeded shuffle.
        seed: seed of the split and of the random-subset policy.
        max_new_tokens: tokens generated per request (labels, calibration and evaluation).
        chat: apply the LLM's chat template to the prompts (also a request feature).
        depths: tree budgets the policy chooses from: how many levels of ``widths`` each chosen
            SSM drafts (1 = one token per SSM; all of ``widths`` beyond its length), and how many
            tokens prompt lookup may propose. Labels are collected at ``max(depths)``.
        widths: expansion widths per depth (None: the run's tree if it is an expansion tree,
            else SpecInfer's 1,1,3,1,1,1,1,1); SSMs never draft deeper than its length.
        dtype: LLM dtype (None: the run's, from report.json).
        ssm_dtype: SSM dtype (None: ``dtype``).
        draft_vocab: SSMs draft over the run's K most frequent tokens (``TreeConfig.draft_vocab``;
            cheaper drafts); 0 = the whole vocabulary. Labels, costs and served trees all use it.
        prompt_lookup: add a prompt-lookup drafter (``serving/lookup.py``: copies what followed the
            newest 1-3 tokens' earlier occurrence; no model, microseconds per draft) to the choice,
            as one more member of the subsets; at depth k it proposes up to k tokens.
        stepwise_lookup: also learn prompt lookup's chain length per step from the matched n-gram's
            length (``stepwise.py``); the learned policy then drafts that length whenever its choice
            includes prompt lookup.
        ngram_buckets: size of the hashed token n-gram feature block.
        pca_components: most principal components of the standardized features fed to the
            ridge regression; 1, 2, 4, ... up to it are tried by 5-fold cross-validation.
        ridge_alphas: L2 penalties tried by the same cross-validation.
        margin: the learned choice replaces the fallback (the best fixed choice on the training
            requests) only when predicted to be at least this much faster for the request
            (relative, 0.02 = 2 %): small predicted edges from few requests are mostly noise.
        z_max: a request whose feature projection lies more than ``z_max`` standard deviations
            from the training data gets the fallback choice.
        calib_prompts: prompts used to time every (SSM, depth) and plain decoding.
        calib_tokens: tokens generated per calibration run.
        real_policies: policies evaluated by real engine runs on the eval prompts (the others,
            and these too, are evaluated by full-information replay). Among learned, all,
            best_fixed, none.
    """

    prompts: str | None = None
    eval_prompts: str | None = None
    limit: int = 80
    eval_limit: int = 0
    train_fraction: float = 0.5
    seed: int = 0
    max_new_tokens: int = 64
    chat: bool = True
    depths: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)
    widths: tuple[int, ...] | None = None
    dtype: str | None = None
    ssm_dtype: str | None = None
    draft_vocab: int = 0
    prompt_lookup: bool = True
    stepwise_lookup: bool = True
    ngram_buckets: int = 64
    pca_components: int = 8
    ridge_alphas: tuple[float, ...] = (0.1, 1.0, 10.0, 100.0, 1000.0)
    margin: float = 0.02
    z_max: float = 6.0
    calib_prompts: int = 2
    calib_tokens: int = 24
    real_policies: tuple[str, ...] = ("learned", "all", "best_fixed")

    def __post_init__(self) -> None:
        for name in ("depths", "ridge_alphas", "real_policies"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.widths is not None:
            object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        _check(self.limit >= 0 and self.eval_limit >= 0, "limit/eval_limit", "must be >= 0 (0 = all)")
        _check(
            0.0 < self.train_fraction < 1.0, "train_fraction", f"must be in (0, 1), got {self.train_fraction}"
        )
        _check(self.draft_vocab >= 0, "draft_vocab", f"must be >= 0 (0 = the whole vocabulary), got {self.draft_vocab}")
        _check(self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        _check(
            bool(self.depths) and min(self.depths) >= 1, "depths", f"must be positive ints, got {self.depths}"
        )
        _check(len(set(self.depths)) == len(self.depths), "depths", f"must be distinct, got {self.depths}")
        if self.widths is not None:
            _check(
                len(self.widths) >= 1 and min(self.widths) >= 1,
                "widths",
                f"needs positive entries, got {self.widths}",
            )
        _check(
            self.ngram_buckets >= 1 and self.pca_components >= 1,
            "ngram_buckets/pca_components",
            "must be >= 1",
        )
        _check(
            bool(self.ridge_alphas) and min(self.ridge_alphas) > 0, "ridge_alphas", "must be positive floats"
        )
        _check(self.z_max > 0, "z_max", f"must be > 0, got {self.z_max}")
        _check(0.0 <= self.margin < 1.0, "margin", f"must be in [0, 1), got {self.margin}")
        _check(
            self.calib_prompts >= 1 and self.calib_tokens >= 2,
            "calib_prompts/calib_tokens",
            "must be >= 1 / >= 2",
        )
        unknown = sorted(set(self.real_policies) - set(POLICY_NAMES))
        _check(not unknown, "real_policies", f"unknown {unknown}; choose from {list(POLICY_NAMES)}")

    @property
    def label_depth(self) -> int:
        """Depth of the tree every SSM drafts while labels are collected."""
        return max(self.depths)

    def to_dict(self) -> dict[str, Any]:
        """JSON/YAML-ready mapping (tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    def replace(self, **changes: Any) -> SchedulerConfig:
        """A copy with ``changes`` applied (None values are ignored: unset command-line flags)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"scheduler.{name} {message}")
