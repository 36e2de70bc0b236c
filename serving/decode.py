"""Plain incremental decoding with a KV cache: the reference for correctness and the speed baseline.

It uses the model's own attention (sdpa), not our tree attention, so comparing the engine with it
checks the tree masks, positions, cache compaction and verification all at once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from boosttune.serving.engine import GenerationResult, TokenCallback
from boosttune.serving.runner import cache_keyword
from boosttune.serving.sampling import SamplingParams, greedy_tokens, logits_to_probs, sample
from boosttune.serving.stops import StopCriteria


@torch.inference_mode()
def incremental_generate(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    stop: StopCriteria,
    sampling: SamplingParams | None = None,
    on_tokens: TokenCallback | None = None,
) -> GenerationResult:
    """One LLM forward per token; greedy or sampled with the same processing as the engine."""
    sampling = sampling or SamplingParams()
    start = time.perf_counter()
    gen = sampling.generator(model.device)
    cache_kw = cache_keyword(model.forward)
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    generated: list[int] = []
    finish = None
    while finish is None:
        logits = model(input_ids=ids, use_cache=True, **{cache_kw: cache}).logits[0, -1:].float()  # (1, V)
        if sampling.greedy:
            tok = int(greedy_tokens(logits)[0])
        else:
            tok = int(sample(logits_to_probs(logits, sampling), gen)[0])
        new, finish = stop.cut(generated, [tok])
        generated += new
        if on_tokens is not None:
            on_tokens(new)
        ids = torch.tensor([[tok]], device=model.device)
    return GenerationResult(generated, [1] * len(generated), time.perf_counter() - start, finish)
