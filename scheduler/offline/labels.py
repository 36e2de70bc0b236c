"""Full-information labels: one engine run per request with every drafter, then labels per position.

Shape legend: T generated tokens of one request, N drafters (the engine plan's, in its order).

The run (every drafter of the engine's plan merged, greedy) writes the request's output, which is
the same for every policy, and logs the measured costs (per-drafter draft seconds, verification
seconds against tree size, per-step overhead) that ``calibrate.py`` folds into the cost model. From
the output, each drafter's ``replay`` (``serving/drafter.py``) then gives, for every position, the
tokens it alone would have had accepted had a step started there (one teacher-forced forward per
SSM; for a feature head, one LLM forward over the request for its features, then one over the
head; the drafter's own string search for prompt lookup), which ``walk.py`` replays for any policy,
step by step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from boosttune.scheduler.features import FeatureSpec, RequestFeatures, request_features
from boosttune.scheduler.offline.walk import Labels
from boosttune.serving.engine import GenerationResult, SpeculativeEngine
from boosttune.serving.stops import StopCriteria

MAX_NGRAM = 3
"""The n-gram length made-up labels without ``ngram`` assume (the drafter's default longest)."""


@dataclass
class RequestRecord:
    """One labelled request.

    Attributes:
        id: the prompt's id.
        features: what the scheduler sees before decoding.
        accepts: (T, N) int, draft tokens drafter j alone would have had accepted by a step
            starting at output position t, at the label depth (the drafter's ``replay``).
        new_tokens: T, tokens generated (the same for every policy: greedy decoding is lossless).
        wall_s: seconds of the whole labelled request.
        prefill_s: seconds of the LLM's prefill.
        lookup: index of the prompt-lookup drafter (-1: none).
        ngram: (T,) prompt lookup's matched n-gram length per position (None: always a match of
            ``MAX_NGRAM`` tokens, for labels made up in tests).
        chain: (T,) tokens prompt lookup's chain holds per position (None: the label depth).
        branch: (T, 3) prompt lookup's phrase-table branch per position (``walk.Labels``; None: no table).
        result: the engine's result (timings per step), not serialized.
    """

    id: str
    features: RequestFeatures
    accepts: np.ndarray
    new_tokens: int
    wall_s: float
    prefill_s: float
    lookup: int = -1
    ngram: np.ndarray | None = None
    chain: np.ndarray | None = None
    branch: np.ndarray | None = None
    result: GenerationResult | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.features.prompt_tokens

    def labels(self) -> Labels:
        """The position-level labels ``walk.walk`` replays."""
        t = self.accepts.shape[0]
        depth = int(self.accepts.max()) if self.accepts.size else 0
        ngram = self.ngram if self.ngram is not None else np.full(t, MAX_NGRAM, dtype=np.int64)
        chain = self.chain if self.chain is not None else np.full(t, max(depth, 1), dtype=np.int64)
        return Labels(self.accepts, ngram, chain, self.branch)

    def to_json(self) -> dict:
        out = {
            "id": self.id,
            "level": "position",
            "features": self.features.to_json(),
            "accepts": self.accepts.tolist(),
            "new_tokens": self.new_tokens,
            "wall_s": self.wall_s,
            "prefill_s": self.prefill_s,
            "lookup": self.lookup,
        }
        if self.ngram is not None and self.chain is not None:
            out.update(ngram=self.ngram.tolist(), chain=self.chain.tolist())
        if self.branch is not None:
            out["branch"] = self.branch.tolist()
        return out

    @classmethod
    def from_json(cls, obj: dict, n_ssms: int) -> RequestRecord:
        if obj.get("level") != "position":
            raise ValueError("labels written before per-position labels (per step of one run); relabel them")
        accepts = np.asarray(obj["accepts"], dtype=np.int64).reshape(-1, n_ssms)
        arrays = {k: np.asarray(obj[k], dtype=np.int64) for k in ("ngram", "chain") if k in obj}
        if "branch" in obj:
            arrays["branch"] = np.asarray(obj["branch"], dtype=np.int64).reshape(-1, 3)
        return cls(
            id=str(obj["id"]),
            features=RequestFeatures.from_json(obj["features"]),
            accepts=accepts,
            new_tokens=int(obj["new_tokens"]),
            wall_s=float(obj["wall_s"]),
            prefill_s=float(obj["prefill_s"]),
            lookup=int(obj.get("lookup", -1)),
            **arrays,
        )


def label_request(
    engine: SpeculativeEngine,
    prompt_id: str,
    ids: Sequence[int],
    stop: StopCriteria,
    chat: bool,
    spec: FeatureSpec,
) -> RequestRecord:
    """Run one request with the engine's default plan (every drafter at the label depth) and label it."""
    captured: dict[str, RequestFeatures] = {}

    def capture(hidden: torch.Tensor) -> None:
        captured["f"] = request_features(ids, hidden, chat, spec)
        return None  # the default plan

    res = engine.generate(ids, stop, planner=capture, record=True)
    columns, lookup, ngram, chain, branch = [], -1, None, None, None
    cached: list[torch.Tensor] = []  # the LLM's features over the request: one forward, on demand

    def features() -> torch.Tensor:
        if not cached:
            engine.llm.reset()
            seen = [*ids, *res.tokens][:-1]  # every position but the last has a feature
            cached.append(engine.llm.chain_hidden(torch.tensor(seen, dtype=torch.long)) if seen
                          else torch.zeros(0, engine.llm.model.config.hidden_size))
        return cached[0]

    for j, name in enumerate(res.active or []):  # the engine's drafter order, as its step records
        drafter, tree = engine.drafters[name], engine.plan.trees[name]
        replay = drafter.replay(ids, res.tokens, tree, features)
        if replay.ngram is not None:  # prompt lookup: its draft depends on the match at each position
            if lookup >= 0:
                raise ValueError(f"labels take one prompt-lookup drafter; the plan has more ({res.active})")
            lookup, ngram, chain, branch = j, replay.ngram, replay.chain, replay.branch
        columns.append(replay.accepted)
    accepts = np.stack(columns, axis=1) if columns else np.zeros((len(res.tokens), 0), dtype=np.int64)
    return RequestRecord(
        id=prompt_id,
        features=captured["f"],
        accepts=accepts,
        new_tokens=len(res.tokens),
        wall_s=res.wall_time,
        prefill_s=res.prefill_s,
        lookup=lookup,
        ngram=ngram,
        chain=chain,
        branch=branch,
        result=res,
    )


def collect_labels(
    engine: SpeculativeEngine,
    requests: Sequence[tuple[str, list[int]]],
    stop: StopCriteria,
    chat: bool,
    spec: FeatureSpec,
    progress=None,
) -> list[RequestRecord]:
    """Label every ``(id, token ids)`` request; ``progress(i, record)`` after each one."""
    out = []
    for i, (pid, ids) in enumerate(requests):
        out.append(label_request(engine, pid, ids, stop, chat, spec))
        if progress is not None:
            progress(i, out[-1])
    return out
