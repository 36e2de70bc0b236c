"""The local teacher backends: the LLM in this process writes the continuations.

``batched`` is boosttune's own batched decoder (:mod:`boosttune.train.batched_decode`: plain full
causal attention only; it can keep the LLM's features for a feature head as it goes), ``hf`` is
transformers ``generate``, and ``auto`` is batched where the LLM's attention allows it, else hf.
Prompts are decoded in length-sorted batches, which pad less; results go back to prompt order.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import ClassVar

import torch

from boosttune.core.progress import progress
from boosttune.core.rundir import RunDir
from boosttune.train import batched_decode
from boosttune.train.sources import TrainPrompt
from boosttune.train.teacher.base import TeacherBackend
from boosttune.train.teacher.shards import (
    Continuation,
    cut_at_eos,
    pending_shards,
    shard_prompts,
    write_shard,
)


def local_backend(model) -> str:
    """The in-process decoder for ``model``: 'batched' where its attention allows it, else 'hf'."""
    return "batched" if batched_decode.unsupported_reason(model) is None else "hf"


def _left_pad(batch: Sequence[Sequence[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(x) for x in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, x in enumerate(batch):
        ids[r, width - len(x):] = torch.tensor(x, dtype=torch.long)
        mask[r, width - len(x):] = 1
    return ids.to(device), mask.to(device)


def generate_batch(
    model, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float, top_p: float,
    pad_id: int, eos_ids: frozenset[int], topk: int = 0, backend: str = "hf", features: bool = False,
) -> list[Continuation]:
    """The LLM's continuations of a batch of prompts, by ``backend`` ('hf' or 'batched'; with
    ``features``, the batched backend keeps the LLM's features too)."""
    if backend == "batched":
        d = batched_decode.decode_batch(model, prompts, max_new_tokens, eos_ids, pad_id, topk,
                                        temperature=temperature, top_p=top_p, features=features)
        # decode_batch stops each row at its first EOS: cut_at_eos only names the finish
        return [Continuation(*cut_at_eos(o, eos_ids), d.topk_ids[r] if topk else None,
                             d.topk_logprobs[r] if topk else None, d.features[r] if features else None)
                for r, o in enumerate(d.tokens)]
    return _hf_generate(model, prompts, max_new_tokens, temperature, top_p, pad_id, eos_ids, topk)


@torch.inference_mode()
def _hf_generate(
    model, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float, top_p: float,
    pad_id: int, eos_ids: frozenset[int], topk: int = 0,
) -> list[Continuation]:
    """Left-padded HF ``generate``."""
    ids, mask = _left_pad(prompts, pad_id, model.device)
    sample = temperature > 0
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=sample,
        temperature=temperature if sample else None, top_p=top_p if sample else None, top_k=None,
        pad_token_id=pad_id, eos_token_id=sorted(eos_ids), return_dict_in_generate=True, output_logits=topk > 0,
    )
    new = out.sequences[:, ids.shape[1]:].tolist()
    results = []
    for toks in new:
        toks, finish = cut_at_eos(toks, eos_ids)
        results.append(Continuation(toks, finish))
    if topk:
        logits = torch.stack(out.logits, dim=1).float()  # (B, steps, V)
        lp, ti = torch.log_softmax(logits, dim=-1).topk(topk, dim=-1)
        for r, c in enumerate(results):
            n = len(c.output_ids)
            c.topk_ids, c.topk_logprobs = ti[r, :n].tolist(), lp[r, :n].tolist()
    return results


class LocalBackend(TeacherBackend):
    """``teacher.backend: auto``: the LLM in this process, by the batched decoder where it can run."""

    def decoder_for(self, model) -> str:
        """The decoder that writes this run's shards: 'batched' or 'hf'."""
        return local_backend(model)

    def run(self, model, tokenizer, prompts: Sequence[TrainPrompt], run: RunDir, eos_ids: frozenset[int], *,
            rank: int = 0, world: int = 1, seed: int = 0, features: bool = False) -> dict:
        """See :meth:`TeacherBackend.run`; ``features`` only where the batched decoder writes."""
        cfg = self.cfg
        run.teacher_dir.mkdir(parents=True, exist_ok=True)
        todo = pending_shards(run, len(prompts), cfg.shard_size, rank, world)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
        decoder = self.decoder_for(model)
        tokens, t0 = 0, time.perf_counter()
        n_todo = sum(len(shard_prompts(prompts, k, cfg.shard_size)) for k in todo)
        bar = progress(total=n_todo, desc=f"teacher[rank {rank}, {decoder}]", unit="prompt")
        for k in todo:
            shard = shard_prompts(prompts, k, cfg.shard_size)
            order = sorted(range(len(shard)), key=lambda i: len(shard[i].input_ids))
            conts: list[Continuation | None] = [None] * len(shard)
            torch.manual_seed(seed * 100_003 + k)  # sampling teachers: reproducible per shard
            for b in range(0, len(order), cfg.batch_size):
                idx = order[b:b + cfg.batch_size]
                outs = generate_batch(model, [shard[i].input_ids for i in idx], cfg.max_new_tokens, cfg.temperature,
                                      cfg.top_p, pad, eos_ids, cfg.topk_logprobs, decoder, features)
                for i, c in zip(idx, outs, strict=True):
                    conts[i] = c
                    tokens += len(c.output_ids)
                bar.set_postfix(tok=tokens, tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
                bar.update(len(idx))
            write_shard(run.teacher_shard(k), shard, conts, cfg.topk_logprobs)
        bar.close()
        secs = time.perf_counter() - t0
        return {"shards_written": len(todo), "tokens": tokens, "seconds": secs, "backend": decoder,
                "tokens_per_s": tokens / secs if secs > 0 and tokens else 0.0, "token_ids": {"source": "model"}}


class BatchedBackend(LocalBackend):
    """``teacher.backend: batched``: boosttune's batched decoder, refusing an LLM it cannot run."""

    decoder: ClassVar[str] = "batched"

    def decoder_for(self, model) -> str:
        return self.decoder


class HFBackend(LocalBackend):
    """``teacher.backend: hf``: transformers ``generate`` (any LLM, slower)."""

    decoder: ClassVar[str] = "hf"

    def decoder_for(self, model) -> str:
        return self.decoder
