"""Training a feature head (``boosttune/core/feature_head.py``) on the teacher's samples.

Shape legend: B samples per batch, L tokens per sample (pairs: L - 1), H hidden width, K draft
vocabulary.

Data: each teacher sample (prompt + the LLM's continuation) and the LLM's features ``F`` over it:
those the batched teacher recorded while writing it (``boosttune/train/teacher.py``; the sample then
ends one token early: its last token was never fed to the LLM), else one fp32 forward per sample
(:func:`llm_features`). Pair j = ``(F_j, token_{j+1})`` predicts ``F_{j+1}`` and ``token_{j+2}``.

Losses, as EAGLE trains its head (Li et al. 2024, arXiv 2401.15077, §4: a smooth-L1 regression of
the next feature plus 0.1 times a classification loss, with uniform noise U(-0.1, 0.1) added to the
input features so the head tolerates its own errors at later depths):
- ``reg``: smooth-L1 between the predicted and the LLM's next feature, at every pair;
- ``ce``: the classification loss between the head's next-token distribution q and the LLM's own
  distribution p at ``F_{j+1}`` (free: the LLM's head applied to the stored features), over the draft
  vocabulary (the K rows of the LM head the head drafts with), at the continuation's pairs. Which
  one is ``feature.loss`` (:data:`LOSSES`): cross-entropy against p (soft targets: forward KL up to
  p's entropy, the default), against p's argmax (hard targets: the token greedy verification
  accepts), or total variation ``1 - sum(min(p, q))``, which is one minus the probability that
  speculative sampling accepts a draft from q (Leviathan et al. 2023, arXiv 2211.17192, §3.5), so
  minimising it maximises acceptance directly.
The embeddings and the tied LM head stay frozen (they are the LLM's); the projection, the decoder
layers and the final norm train.
"""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from boosttune.config import FeatureConfig, FeatureLoss, SSMInitConfig
from boosttune.core.feature_head import FC_ATTR, new_fc, pair_inputs, second_step, teacher_forced_ranks
from boosttune.serving.runner import cache_keyword
from boosttune.train.budget import train_for
from boosttune.train.distill import Sample, total_variation
from boosttune.train.ssm_init import derive_ssm


@torch.no_grad()
def llm_features(llm: PreTrainedModel, samples: Sequence[Sample], progress: Callable[[int], None] | None = None) -> list[Tensor]:
    """(L, H) fp32 last-layer hidden states (after the final norm: the LM head's input) per sample."""
    out = []
    for s in samples:
        ids = torch.tensor([s.ids], device=llm.device)
        out.append(llm.base_model(input_ids=ids, use_cache=False).last_hidden_state[0].float().cpu())
        if progress is not None:
            progress(1)
    return out


def build_head(llm: PreTrainedModel, layers: Sequence[int]) -> PreTrainedModel:
    """A feature head (fp32, train mode): the LLM's embeddings, ``layers``, final norm and tied head,
    plus a pass-through projection; embeddings (= head) frozen."""
    n = llm.config.num_hidden_layers
    picked = [i % n for i in layers]
    if any(not -n <= i < n for i in layers) or not picked:
        raise ValueError(f"feature.layers: the LLM has {n} layers (0..{n - 1} or -{n}..-1), got {list(layers)}")
    head = derive_ssm(llm, SSMInitConfig(init="derived", layers=picked))
    llm_head, llm_embed = llm.get_output_embeddings().weight, llm.get_input_embeddings().weight
    if llm_head.data_ptr() != llm_embed.data_ptr():  # an untied LLM: the head must be the LLM's own LM head
        head.config.tie_word_embeddings = False
        head.get_output_embeddings().weight = torch.nn.Parameter(llm_head.detach().float().clone(), requires_grad=False)
    setattr(head, FC_ATTR, new_fc(llm.config.hidden_size))
    head.get_input_embeddings().weight.requires_grad_(False)
    return head.train()


LOSSES = typing.get_args(FeatureLoss)
"""``feature.loss``: soft cross-entropy (``kl``), hard cross-entropy on the LLM's argmax (``ce``), total
variation (``tv``), or the sum of the first and the last."""


def classification_loss(pred: Tensor, target: Tensor, kind: str) -> Tensor:
    """(C,) per-pair loss of (C, K) head logits ``pred`` against (C, K) LLM probabilities ``target``."""
    if kind not in LOSSES:
        raise ValueError(f"feature.loss must be one of {LOSSES}, got {kind!r}")
    logq = torch.log_softmax(pred, dim=-1)
    if kind == "ce":
        return -logq.gather(-1, target.argmax(-1, keepdim=True))[:, 0]
    soft = -(target * logq).sum(-1) if kind != "tv" else 0.0
    return soft + (total_variation(target, logq.exp()) if kind != "kl" else 0.0)


def head_losses(
    head: PreTrainedModel, samples: Sequence[Sample], feats: Sequence[Tensor], rows: Tensor, noise: float,
    gen: torch.Generator | None = None, depth2: bool = False, prompt_weight: float = 0.0, top1: bool = True,
    loss: str = "kl", weights: Sequence[Tensor] | None = None,
) -> dict[str, Tensor]:
    """The losses on one batch (and, with ``top1``, top-1 agreement with the LLM's argmax, a diagnostic).

    Args:
        head: the feature head.
        samples: the batch's samples.
        feats: their LLM features, (L_i, H) each.
        rows: (K,) the draft vocabulary's token ids.
        noise: half-width of the uniform input noise (0 for evaluation).
        gen: the noise's generator.
        depth2: also the second draft step's losses (``reg2``, ``ce2``, ``top1_2``; :func:`second_step`).
        prompt_weight: the cross-entropy's weight at prompt pairs relative to the continuation's
            (``top1`` stays the continuation's).
        top1: also ``top1`` (and ``top1_2``): two argmaxes over (pairs, K), which cost a training step
            about 15 % at K = 8,192 (``TOP1_EVERY``), so training asks for it only now and then.
        loss: the classification loss (:data:`LOSSES`), reported as ``ce`` whichever it is.
        weights: per sample, (len(ids) - 1,) each pair's classification weight on top of the rest
            (boosting, :func:`pair_weights`); None: all 1.
    """
    b, width = len(samples), feats[0].shape[1]
    n = max(len(s.ids) for s in samples) - 1  # pairs of the longest sample
    f_in = torch.zeros(b, n, width)
    f_out = torch.zeros(b, n, width)
    tok = torch.zeros(b, n, dtype=torch.long)
    valid = torch.zeros(b, n, dtype=torch.bool)  # a real pair (not padding)
    cont = torch.zeros(b, n, dtype=torch.bool)  # ... whose next token is the LLM's continuation
    boost = torch.ones(b, n)
    for i, (s, f) in enumerate(zip(samples, feats, strict=True)):
        m = len(s.ids) - 1
        if weights is not None:
            boost[i, :m] = weights[i][:m]
        f_in[i, :m] = f[:-1]
        tok[i, :m] = torch.tensor(s.ids[1:])
        f_out[i, :m] = f[1:]
        valid[i, :m] = True
        cont[i, max(0, s.prompt_len - 2) : m] = True
    if noise:
        f_in = f_in + (torch.rand(f_in.shape, generator=gen) * 2 - 1) * noise
    attn = valid.long()
    dev = head.device
    inputs = pair_inputs(head, f_in.to(dev), tok.to(dev))
    pos = torch.arange(n, device=dev).expand(b, n)
    depth2 = depth2 and n > 1
    cache = DynamicCache(config=head.config) if depth2 else None
    body = head.base_model
    hidden = body(inputs_embeds=inputs, attention_mask=attn.to(dev), position_ids=pos, use_cache=depth2,
                  **{cache_keyword(body.forward): cache}).last_hidden_state  # (B, n, H)
    valid, cont, f_out, boost = valid.to(dev), cont.to(dev), f_out.to(dev), boost.to(dev)
    w = head.get_output_embeddings().weight[rows.to(dev)].float()  # (K, H), frozen
    out = _step_losses(hidden, f_out, valid, cont, w, "", prompt_weight, top1, loss, boost)
    if depth2:  # step-2 pair j predicts F_{j+2}: pair j + 1's target
        second = second_step(head, cache, hidden, tok)
        out |= _step_losses(second, f_out[:, 1:], valid[:, 1:], cont[:, 1:], w, "2", prompt_weight, top1, loss,
                            boost[:, 1:])
    return out


def _step_losses(hidden: Tensor, f_out: Tensor, valid: Tensor, cont: Tensor, w: Tensor, suffix: str,
                 prompt_weight: float = 0.0, top1: bool = True, loss: str = "kl",
                 boost: Tensor | None = None) -> dict[str, Tensor]:
    """``reg``, ``ce`` and, with ``top1``, ``top1`` (each name + ``suffix``) of one draft step's (B, n, H)
    outputs against the LLM's next features ``f_out``; ``valid``: real pairs, ``cont``: pairs predicting
    the continuation, the others' classification loss (``loss``) weighted by ``prompt_weight``; ``boost``:
    (B, n) a further weight per pair (None: 1)."""
    reg = F.smooth_l1_loss(hidden[valid].float(), f_out[valid])
    pick = valid if prompt_weight else cont
    pred = hidden[pick].float() @ w.T  # (C, K)
    is_cont = cont[pick]  # (C,)
    with torch.no_grad():
        target = torch.softmax(f_out[pick] @ w.T, dim=-1)
        weight = torch.where(is_cont, 1.0, prompt_weight)
        if boost is not None:
            weight = weight * boost[pick]
    ce_each = classification_loss(pred, target, loss)
    ce = (ce_each * weight).sum() / weight.sum().clamp(min=1e-9)
    out = {f"reg{suffix}": reg, f"ce{suffix}": ce}
    if top1:
        with torch.no_grad():
            agree = (pred[is_cont].argmax(-1) == target[is_cont].argmax(-1)).float().mean()
        out[f"top1{'_' if suffix else ''}{suffix}"] = agree
    return out


TOP1_EVERY = 50
"""Training measures its batches' top-1 agreement (a diagnostic) every this many steps: measured at every
step, its two argmaxes over (pairs, 8,192) held the demo head to 193 steps a minute instead of 222 (two
one-minute runs each, bf16 autocast, 2 cores of an AMX Xeon)."""


def train_head(
    head: PreTrainedModel, samples: Sequence[Sample], feats: Sequence[Tensor], rows: Tensor, cfg: FeatureConfig,
    on_step: Callable[[int, dict], None] | None = None, seed: int = 0, autocast: torch.dtype | None = None,
    weights: Sequence[Tensor] | None = None,
) -> dict:
    """AdamW on the head until ``cfg.minutes`` or ``cfg.max_steps`` (``train/budget.py``); returns training
    statistics. ``weights``: per sample, each pair's classification weight (boosting: :func:`pair_weights`).
    ``autocast``: the forward's mixed-precision dtype (bf16 on CPUs with native bf16 took twice the
    steps per minute of fp32: 188 against 97 in one minute, AVX512-BF16 EPYC, 2 threads); the weights,
    gradients and optimiser stay fp32."""
    gen = torch.Generator().manual_seed(seed)  # the input noise's

    def step_losses(idx: list[int], step: int) -> tuple[Tensor, dict]:
        amp = torch.autocast(head.device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with amp:
            losses = head_losses(head, [samples[i] for i in idx], [feats[i] for i in idx], rows, cfg.noise, gen,
                                 depth2=cfg.depth2_weight > 0, prompt_weight=cfg.prompt_weight,
                                 top1=step % TOP1_EVERY == 0, loss=cfg.loss,
                                 weights=[weights[i] for i in idx] if weights is not None else None)
        loss = cfg.reg_weight * losses["reg"] + cfg.ce_weight * losses["ce"]
        if "ce2" in losses:
            loss = loss + cfg.depth2_weight * (cfg.reg_weight * losses["reg2"] + cfg.ce_weight * losses["ce2"])
        return loss, losses  # top-1: as last measured

    return train_for([p for p in head.parameters() if p.requires_grad], [len(s.ids) for s in samples],
                     minutes=cfg.minutes, max_steps=cfg.max_steps, lr=cfg.lr, weight_decay=cfg.weight_decay,
                     batch_tokens=cfg.batch_tokens, step_losses=step_losses, on_step=on_step, seed=seed,
                     precision=str(autocast).removeprefix("torch.") if autocast is not None else "float32")


@torch.no_grad()
def evaluate_head(head: PreTrainedModel, samples: Sequence[Sample], feats: Sequence[Tensor], rows: Tensor) -> dict:
    """Held-out losses (``ce``: the soft cross-entropy, whatever ``feature.loss`` trained, so that runs
    compare) and top-1 agreement with the LLM over the draft vocabulary: at depth 1 from the
    LLM's features (``reg``, ``ce``, ``top1``), at depth 2 from the head's own (``reg2``, ``ce2``,
    ``top1_2``; whether or not it trained for depth 2)."""
    was = head.training
    head.eval()
    out = {"reg": 0.0, "ce": 0.0, "top1": 0.0, "reg2": 0.0, "ce2": 0.0, "top1_2": 0.0}
    n = n2 = 0
    for s, f in zip(samples, feats, strict=True):
        if len(s.ids) - s.prompt_len < 2:
            continue
        second = len(s.ids) - s.prompt_len >= 3  # depth 2 needs a second continuation token to guess
        losses = head_losses(head, [s], [f], rows, 0.0, depth2=second)
        for k, v in losses.items():
            out[k] += float(v)
        n += 1
        n2 += second
    head.train(was)
    return {k: round(v / max(1, n2 if k.endswith("2") else n), 4) for k, v in out.items()}


@torch.no_grad()
def answer_ranks(head: PreTrainedModel, samples: Sequence[Sample], feats: Sequence[Tensor], rows: Tensor | None,
                 progress: Callable[[int], None] | None = None) -> list[list[int]]:
    """Per sample, the head's rank of each answer token at the first draft depth, teacher forced from
    the LLM's features as serving drafts (:func:`boosttune.core.feature_head.teacher_forced_ranks`)."""
    was = head.training
    head.eval()
    out = []
    for s, f in zip(samples, feats, strict=True):
        out.append(teacher_forced_ranks(head, f, s.ids, s.prompt_len, rows)[0].tolist())
        if progress is not None:
            progress(1)
    head.train(was)
    return out


def pair_weights(samples: Sequence[Sample], answer_weights: Sequence[Sequence[float]]) -> list[Tensor]:
    """Per sample, (len(ids) - 1,) each training pair's weight: ``answer_weights[i][t]`` at the pair that
    guesses answer token t (pair ``prompt_len + t - 2``), 1 at every other pair."""
    out = []
    for s, aw in zip(samples, answer_weights, strict=True):
        w = torch.ones(len(s.ids) - 1)
        for t, x in enumerate(aw):
            j = s.prompt_len + t - 2
            if 0 <= j < len(w):
                w[j] = x
        out.append(w)
    return out
