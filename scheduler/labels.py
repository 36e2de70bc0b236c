"""Full-information labels: run the engine with every SSM merged and log each branch's acceptance.

Shape legend: S steps of one request, N SSMs.

One greedy verification scores every SSM's branch at once (``greedy_branch_accepts``), so a single
run per request gives, for every step and SSM, the draft tokens that SSM's branch alone would have
had accepted. The same runs log the measured costs (per-SSM draft seconds, verification seconds
against tree size, per-step overhead) that ``costs.calibrate`` folds into the cost model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from boosttune.scheduler.features import FeatureSpec, RequestFeatures, request_features
from boosttune.serving.engine import GenerationResult, SpeculativeEngine
from boosttune.serving.stops import StopCriteria


@dataclass
class RequestRecord:
    """One labelled request.

    Attributes:
        id: the prompt's id.
        features: what the scheduler sees before decoding.
        accepts: (S, N) int, draft tokens each SSM's branch would have had accepted per step, at
            the label depth.
        new_tokens: tokens generated (the same for every policy: greedy decoding is lossless).
        wall_s: seconds of the whole labelled request.
        prefill_s: seconds of the LLM's prefill.
        result: the engine's result (timings per step), not serialized.
    """

    id: str
    features: RequestFeatures
    accepts: np.ndarray
    new_tokens: int
    wall_s: float
    prefill_s: float
    result: GenerationResult | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.features.prompt_tokens

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "features": self.features.to_json(),
            "accepts": self.accepts.tolist(),
            "new_tokens": self.new_tokens,
            "wall_s": self.wall_s,
            "prefill_s": self.prefill_s,
        }

    @classmethod
    def from_json(cls, obj: dict, n_ssms: int) -> RequestRecord:
        accepts = np.asarray(obj["accepts"], dtype=np.int64).reshape(-1, n_ssms)
        return cls(
            id=str(obj["id"]),
            features=RequestFeatures.from_json(obj["features"]),
            accepts=accepts,
            new_tokens=int(obj["new_tokens"]),
            wall_s=float(obj["wall_s"]),
            prefill_s=float(obj["prefill_s"]),
        )


def label_request(
    engine: SpeculativeEngine,
    prompt_id: str,
    ids: Sequence[int],
    stop: StopCriteria,
    chat: bool,
    spec: FeatureSpec,
) -> RequestRecord:
    """Run one request with every drafter (their own trees, the label depth) and label it."""
    n = len(engine.drafters)
    captured: dict[str, RequestFeatures] = {}

    def capture(hidden: torch.Tensor):
        captured["f"] = request_features(ids, hidden, chat, spec)
        return None, None  # every drafter, its own tree

    res = engine.generate(ids, stop, plan=capture, record=True)
    accepts = np.array([r.accepts for r in res.records], dtype=np.int64).reshape(-1, n)
    return RequestRecord(
        id=prompt_id,
        features=captured["f"],
        accepts=accepts,
        new_tokens=len(res.tokens),
        wall_s=res.wall_time,
        prefill_s=res.prefill_s,
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
