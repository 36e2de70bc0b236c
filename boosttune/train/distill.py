"""Distillation of one SSM on teacher samples, as a LightningModule.

A sample is ``prompt + LLM continuation``; the prompt is context only. The loss positions are the
continuation's: position t predicts token t+1 for t in [len(prompt) - 1, len(sample) - 1). The LM head
runs only at those positions (with a 49k vocabulary it dominates a small SSM's cost).

Losses: cross-entropy on the LLM's tokens; optionally plus ``distill_weight`` times
- ``kl``: KL(p_topk || q) where p_topk is the teacher's top-k distribution renormalised, or
- ``tv``: the total variation distance between p_topk and q, 0.5 * (sum_topk |p - q| + q outside),
  the quantity that sets speculative acceptance (acceptance = 1 - TV; Leviathan et al. 2023, §3).

Batches are length-bucketed to a padded-token budget and served as a dataset of whole batches, in
the endless order of :class:`BatchOrder`: each DDP rank takes its own share, and a resumed stage
continues exactly where its checkpoint was taken.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Sampler

from boosttune.config import OptimConfig


@dataclass
class Sample:
    ids: list[int]
    """prompt + continuation tokens."""
    prompt_len: int
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None
    weights: list[float] | None = None
    """Per continuation token, the weight of its loss (None: 1 everywhere, today's unweighted mean;
    ``boost.mode: weighted`` sets them, ``boosttune/train/coverage.py`` ``token_weights``)."""


def samples_from_teacher(ds, indices: Sequence[int], max_len: int = 0) -> list[Sample]:
    """Samples for the given rows of the teacher dataset (continuations truncated to ``max_len``)."""
    cols = ds.column_names
    sub = ds.select(list(indices))
    out = []
    for row in sub:
        cont = row["output_ids"][:max_len] if max_len else row["output_ids"]
        if not cont:
            continue
        tk = row["topk_ids"][: len(cont)] if "topk_ids" in cols else None
        tl = row["topk_logprobs"][: len(cont)] if "topk_logprobs" in cols else None
        out.append(Sample(list(row["input_ids"]) + list(cont), len(row["input_ids"]), tk, tl))
    return out


def plan_batches(lengths: Sequence[int], batch_tokens: int, seed: int | None) -> list[list[int]]:
    """Sample indices per batch: sorted by length, cut at ``batch_tokens`` padded tokens, shuffled."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, cur, cur_max = [], [], 0
    for i in order:
        if cur and max(cur_max, lengths[i]) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, lengths[i])
    if cur:
        batches.append(cur)
    if seed is not None:
        random.Random(seed).shuffle(batches)
    return batches


def collate(samples: Sequence[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ids, attention mask, loss mask and targets (+ teacher top-k at loss positions)."""
    width = max(len(s.ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(samples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for r, s in enumerate(samples):
        ids[r, : len(s.ids)] = torch.tensor(s.ids)
        att[r, : len(s.ids)] = 1
        loss_mask[r, s.prompt_len - 1 : len(s.ids) - 1] = True
    batch = {"input_ids": ids, "attention_mask": att, "loss_mask": loss_mask,
             "targets": torch.roll(ids, -1, dims=1)}
    if samples[0].topk_ids is not None:
        # rows in the same order as loss_mask's True entries (row-major)
        batch["topk_ids"] = torch.tensor([t for s in samples for t in s.topk_ids], dtype=torch.long)
        batch["topk_logprobs"] = torch.tensor([t for s in samples for t in s.topk_logprobs], dtype=torch.float32)
    if samples[0].weights is not None:  # same row order; absent, the loss is the plain mean (bit for bit)
        batch["weights"] = torch.tensor([w for s in samples for w in s.weights], dtype=torch.float32)
    return batch


class BatchDataset(Dataset):
    """Each item is one pre-planned, collated batch."""

    def __init__(self, samples: Sequence[Sample], batch_tokens: int, pad_id: int, seed: int):
        self.samples, self.pad_id = list(samples), pad_id
        self.batches = plan_batches([len(s.ids) for s in self.samples], batch_tokens, seed)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return collate([self.samples[j] for j in self.batches[i]], self.pad_id)


class BatchOrder(Sampler[int]):
    """The batches one rank trains on, in order: endless, and a pure function of the position in it.

    Pass ``e`` over the ``n`` batches is the permutation drawn from ``seed + e``; rank ``rank`` of
    ``world`` takes positions ``rank, rank + world, ...`` of the passes laid end to end. Iteration
    begins at ``start``, this rank's position: a resumed stage sets it to the batches its checkpoint
    had consumed (:meth:`resume_at`), so it trains on exactly the batches a run never interrupted
    does. (A shuffling DataLoader instead draws each pass from a generator whose state no checkpoint
    holds: a run resumed after the first pass repeated the first pass's order.)
    """

    def __init__(self, n: int, seed: int, rank: int = 0, world: int = 1):
        assert n > 0 and 0 <= rank < world
        self.n, self.seed, self.rank, self.world = n, seed, rank, world
        self.start = 0

    def resume_at(self, global_step: int, grad_accum: int) -> None:
        """Continue after ``global_step`` optimizer steps of ``grad_accum`` batches each (micro-batches
        of an unfinished accumulation are not in a checkpoint: they are trained again)."""
        self.start = global_step * grad_accum

    def permutation(self, epoch: int) -> list[int]:
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def __iter__(self):
        position, epoch, order = self.start, -1, []
        while True:
            e, i = divmod(position * self.world + self.rank, self.n)
            if e != epoch:
                epoch, order = e, self.permutation(e)
            yield order[i]
            position += 1


def distill_losses(logits: torch.Tensor, targets: torch.Tensor, batch: dict, kind: str) -> dict[str, torch.Tensor]:
    """CE (+ KL/TV against the teacher's renormalised top-k) at the loss positions; logits (n, V).

    Each term is the mean over the n positions, or, when the batch has per-token ``weights`` (n,) not all
    1, the weighted mean ``sum(w * loss) / sum(w)`` (tokens of weight 0 drop out; a batch of weight 0 only
    gives 0). Weights all 1 take the plain mean's path: ``F.cross_entropy``'s mean sums in another order
    than ``(w * x).sum()``, which differs in the last bits, and all-ones must train exactly as no weights."""
    logits = logits.float()
    weights = batch.get("weights")
    if weights is None or bool((weights == 1).all()):  # host sync, once per batch
        def reduce(x: torch.Tensor) -> torch.Tensor:
            return x.mean()
        out = {"ce": F.cross_entropy(logits, targets)}
    else:
        w = weights.to(logits.device, torch.float32)
        assert w.shape == targets.shape, (w.shape, targets.shape)

        def reduce(x: torch.Tensor) -> torch.Tensor:
            return (x * w).sum() / w.sum().clamp_min(torch.finfo(torch.float32).tiny)
        out = {"ce": reduce(F.cross_entropy(logits, targets, reduction="none"))}
    if kind != "ce" and "topk_ids" in batch:
        logq = torch.log_softmax(logits, dim=-1)
        logq_k = logq.gather(1, batch["topk_ids"])  # (n, k)
        logp_k = torch.log_softmax(batch["topk_logprobs"], dim=-1)  # renormalised top-k
        if kind == "ce+kl":
            out["kl"] = reduce((logp_k.exp() * (logp_k - logq_k)).sum(-1))
        else:
            out["tv"] = reduce(total_variation(logp_k.exp(), logq_k.exp()))
    return out


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(n,) total variation between (n, k) distributions ``p`` and ``q``'s mass on the same k tokens,
    q's mass outside them (where p is 0) counted too: 1 - sum(min(p, q)) when p sums to 1."""
    return 0.5 * ((p - q).abs().sum(-1) + (1 - q.sum(-1)).clamp_min(0))


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to ``min_ratio`` at ``total`` steps."""
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


class DistillModule(L.LightningModule):
    """One SSM learning the LLM's continuations."""

    def __init__(self, model, cfg: OptimConfig):
        super().__init__()
        self.model = model
        self.cfg = cfg
        self.tokens_seen = 0
        """Loss tokens over the whole stage (restored on resume)."""
        self.resumed_from_step: int | None = None
        """The optimizer step of the checkpoint this stage resumed from (None: a fresh start)."""
        self.seconds_before = 0.0
        """Training seconds of the earlier runs of this stage, up to the checkpoint resumed from."""
        self.restored_loss: float | None = None
        """The last logged training loss as of the checkpoint resumed from (a run that resumes from
        the final checkpoint trains no step, and logs none)."""
        self._fit_t0 = time.perf_counter()

    def on_fit_start(self) -> None:
        self._fit_t0 = time.perf_counter()

    def train_seconds(self) -> float:
        """Training seconds of this stage over every run of it (a killed run's up to its last checkpoint)."""
        return self.seconds_before + (time.perf_counter() - self._fit_t0)

    def last_loss(self) -> float | None:
        """The last logged training loss: this run's, else the one restored from the checkpoint."""
        loss = self.trainer.callback_metrics.get("train/loss")
        return float(loss) if loss is not None else self.restored_loss

    def _base(self):
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        base = self._base()
        hidden = base.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        mask = batch["loss_mask"]
        logits = base.get_output_embeddings()(hidden[mask])
        targets = batch["targets"][mask]
        parts = distill_losses(logits, targets, batch, self.cfg.loss)
        loss = parts["ce"] + self.cfg.distill_weight * sum(v for k, v in parts.items() if k != "ce")
        n = int(targets.numel())
        self.tokens_seen += n
        acc = (logits.argmax(-1) == targets).float().mean()
        self.log_dict({"train/loss": loss.detach(), "train/top1": acc, **{f"train/{k}": v.detach() for k, v in parts.items()}},
                      prog_bar=True, on_step=True, batch_size=n, sync_dist=False)
        return loss

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay, betas=(0.9, 0.98))
        c = self.cfg
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_lambda(s, c.warmup_steps, c.max_steps, c.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen
        checkpoint["train_seconds"] = self.train_seconds()
        checkpoint["train_loss"] = self.last_loss()
        # Dropout (e.g. lora.dropout) draws from the global RNG: a resumed stage continues its stream. Each
        # DDP rank draws its own, and the file is rank 0's: every rank's state goes into it (this hook runs on
        # every rank when Lightning saves), and each rank takes its own back.
        checkpoint["rng"] = rng_state()
        checkpoint["rng_per_rank"] = gather_rng_states(checkpoint["rng"])

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Lightning hands over the checkpoint it loads to resume: read the step here instead of
        # unpickling the whole file a second time
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))
        self.resumed_from_step = int(checkpoint.get("global_step", 0))
        self.seconds_before = float(checkpoint.get("train_seconds", 0.0))
        loss = checkpoint.get("train_loss")
        self.restored_loss = float(loss) if loss is not None else None
        per_rank = checkpoint.get("rng_per_rank")
        rank, world = _rank_and_world()
        # a checkpoint of another world size (or from before per-rank states): rank 0's, as before
        rng = per_rank[rank] if per_rank is not None and len(per_rank) == world else checkpoint.get("rng")
        if rng is not None:
            set_rng_state(rng)


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


def rng_state() -> dict:
    """This process's torch RNG states (CPU, and every CUDA device's)."""
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(rng: dict) -> None:
    """Restore what :func:`rng_state` returned (CUDA states only onto as many devices)."""
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])


def gather_rng_states(mine: dict) -> list[dict]:
    """Every rank's :func:`rng_state`, by rank (a collective: every rank calls it; one process: ``[mine]``)."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return [mine]
    out: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, mine)
    return out
