"""The time- or step-bounded AdamW loop that the feature heads and the EAGLE-3 head train with.

Batches are length-sorted runs of samples cut at a padded-token budget, visited in a random order;
the learning rate warms up over 5 % of the steps, then follows a cosine down to 10 %. When only time
bounds the run, the schedule's length is estimated from the first 8 steps' speed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

ESTIMATE_AFTER = 8
"""Steps timed before a time-bounded run fixes its schedule's length."""


def batches(lengths: Sequence[int], batch_tokens: int, gen: torch.Generator) -> list[list[int]]:
    """Sample indices per batch: length-sorted, cut at ``batch_tokens`` padded tokens, shuffled."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out, cur, longest = [], [], 0
    for i in order:
        longest_if = max(longest, lengths[i])
        if cur and longest_if * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur, longest_if = [], lengths[i]
        cur.append(i)
        longest = longest_if
    if cur:
        out.append(cur)
    perm = torch.randperm(len(out), generator=gen).tolist()
    return [out[i] for i in perm]


def lr_scale(step: int, horizon: int) -> float:
    """The learning rate's factor at ``step`` of ``horizon``: 5 % linear warm-up, cosine from 1 to 0.1."""
    warm = max(1, horizon // 20)
    if step < warm:
        return (step + 1) / warm
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / horizon)))


def train_for(params: list[Tensor], lengths: Sequence[int], *, minutes: float, max_steps: int, lr: float,
              weight_decay: float, batch_tokens: int, step_losses: Callable[[list[int], int], tuple[Tensor, dict]],
              on_step: Callable[[int, dict], None] | None = None, seed: int = 0, precision: str = "float32") -> dict:
    """AdamW on ``params`` until ``minutes`` or ``max_steps`` (whichever is set and comes first).

    Args:
        params: the trained tensors.
        lengths: each sample's length (the batches' padded-token budget counts them).
        minutes: wall-clock budget (0: none); the first step past it is the last.
        max_steps: step budget (0: none).
        lr: peak learning rate.
        weight_decay: AdamW's decoupled weight decay.
        batch_tokens: padded tokens per batch.
        step_losses: ``(sample indices, step) -> (loss to minimise, diagnostics)``; diagnostics are
            tensors or numbers, reported as last seen.
        on_step: called after each step with the step count and the diagnostics.
        seed: the batch order's.
        precision: recorded in the statistics.

    Returns:
        ``steps``, ``tokens``, ``seconds``, ``precision``, ``tokens_per_s`` and ``last`` (diagnostics).
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    budget_s = minutes * 60
    total = max_steps or 0
    order: list[list[int]] = []
    step, tokens, t0 = 0, 0, time.perf_counter()
    last: dict = {}
    while True:
        elapsed = time.perf_counter() - t0
        if (max_steps and step >= max_steps) or (minutes and elapsed >= budget_s):
            break
        if not order:
            order = batches(lengths, batch_tokens, gen)
        idx = order.pop()
        if not total and step == ESTIMATE_AFTER:
            total = max(16, int(budget_s / (elapsed / ESTIMATE_AFTER)))
        for g in opt.param_groups:
            g["lr"] = lr * lr_scale(step, total or 10**6)
        loss, diagnostics = step_losses(idx, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        tokens += sum(lengths[i] for i in idx)
        last |= {k: float(v.detach()) if isinstance(v, Tensor) else float(v) for k, v in diagnostics.items()}
        if on_step is not None:
            on_step(step, last)
    seconds = time.perf_counter() - t0
    return {"steps": step, "tokens": tokens, "seconds": round(seconds, 1), "precision": precision,
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1), "last": last}
