"""Training an EAGLE-3 head (``boosttune/core/eagle3_head.py``) on the teacher's samples.

Shape legend: B samples per batch, n positions, H the width, K draft vocabulary, D draft steps.
p is the LLM's distribution, q the head's.

Data: each sample (prompt + the LLM's continuation) and, from one fp32 LLM forward over it, the
inputs of the head's three LLM layers (``aux``, (L, 3H)) and the LLM's last hidden state after its
final norm (``final``, (L, H)), whose LM-head rows over the draft vocabulary give p there.

Loss, as EAGLE-3 trains (Li et al. 2025, arXiv 2503.01840, §3): no feature regression; at each of D
unrolled draft steps (the "training-time test": step s reads step s-1's own states), the
cross-entropy of q against p over the draft vocabulary (soft targets), step s weighted
``step_decay ** s``. Answer positions weigh 1, prompt positions ``prompt_weight``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from boosttune.config import Eagle3Config
from boosttune.core.eagle3_head import Eagle3Head, Eagle3Spec
from boosttune.core.ranks import NOT_DRAFTABLE, token_ranks
from boosttune.train.budget import train_for
from boosttune.train.distill import Sample


@dataclass
class LayerFeatures:
    """One sample's LLM states (bf16 to halve their memory; the forward ran in fp32)."""

    aux: Tensor
    """(L, 3H) the inputs of the head's three layers, concatenated low, middle, high."""
    final: Tensor
    """(L, H) the LLM's last hidden state after its final norm (its LM head's input)."""


@torch.no_grad()
def layer_features(llm, samples: Sequence[Sample], layers: Sequence[int],
                   progress: Callable[[int], None] | None = None) -> list[LayerFeatures]:
    """Per sample, the inputs of decoder layers ``layers`` (as llama.cpp's
    ``llama_get_embeddings_layer_inp`` gives them) and the final normed state, from one forward."""
    blocks = llm.base_model.layers
    seen: dict[int, Tensor] = {}

    def grab(i: int):
        def hook(_mod, args, kwargs):
            seen[i] = (args[0] if args else kwargs["hidden_states"])[0]
        return hook

    handles = [blocks[i].register_forward_pre_hook(grab(i), with_kwargs=True) for i in layers]
    out = []
    try:
        for s in samples:
            ids = torch.tensor([s.ids], device=llm.device)
            final = llm.base_model(input_ids=ids, use_cache=False).last_hidden_state[0]
            aux = torch.cat([seen[i] for i in layers], -1)
            out.append(LayerFeatures(aux=aux.to(torch.bfloat16).cpu(), final=final.to(torch.bfloat16).cpu()))
            if progress is not None:
                progress(1)
    finally:
        for h in handles:
            h.remove()
    return out


def init_head(llm, spec: Eagle3Spec, rows: Tensor) -> Eagle3Head:
    """A head (fp32, train mode) started from the LLM's last decoder layer: ``fc`` passes the high
    layer's input through, q/k/v read both halves of ``[norm(e), norm(g)]`` with that layer's
    weights, its MLP and norms; the final norm is the LLM's and the LM head the LLM's rows ``rows``.
    (EAGLE-3's own heads start from random weights and train for days; minutes on a CPU want a
    start that already computes something like the LLM.)"""
    head = Eagle3Head(spec, llm.get_input_embeddings().weight, rows)
    last = llm.base_model.layers[-1]
    with torch.no_grad():
        h = spec.hidden
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * spec.target_hidden :].copy_(torch.eye(h, spec.target_hidden))
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(last.self_attn, name).weight.detach().float()
            getattr(head, name).weight.copy_(torch.cat([w, w], 1) * 0.5)
        head.o_proj.weight.copy_(last.self_attn.o_proj.weight.float())
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(head, name).weight.copy_(getattr(last.mlp, name).weight.float())
        for mine in (head.input_layernorm, head.hidden_norm):
            mine.weight.copy_(last.input_layernorm.weight.float())
        head.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight.float())
        head.norm.weight.copy_(llm.base_model.norm.weight.float())
        head.lm_head.weight.copy_(llm.get_output_embeddings().weight.detach().float()[rows])
    return head.train()


@dataclass
class Batch:
    """Padded tensors of a batch (right padding)."""

    aux: Tensor  # (B, n, 3H)
    tokens: Tensor  # (B, n) tokens[:, j] = t_{j+1}
    final: Tensor  # (B, n + 1, H) the LLM's states at positions 0..n
    valid: Tensor  # (B, n + 1) a real position
    answer: Tensor  # (B, n + 1) position i's next token t_{i+1} is the LLM's continuation


def make_batch(samples: Sequence[Sample], feats: Sequence[LayerFeatures]) -> Batch:
    """Pad ``samples`` (L_i tokens each) into pairs j = 0..L_i-2 and positions 0..L_i-1."""
    n = max(len(s.ids) for s in samples) - 1
    b, w3, w = len(samples), feats[0].aux.shape[1], feats[0].final.shape[1]
    aux = torch.zeros(b, n, w3)
    final = torch.zeros(b, n + 1, w)
    tokens = torch.zeros(b, n, dtype=torch.long)
    valid = torch.zeros(b, n + 1, dtype=torch.bool)
    answer = torch.zeros(b, n + 1, dtype=torch.bool)
    for i, (s, f) in enumerate(zip(samples, feats, strict=True)):
        m = len(s.ids) - 1
        assert f.aux.shape[0] == m + 1, (f.aux.shape, m)
        aux[i, :m] = f.aux[:m].float()
        final[i, : m + 1] = f.final.float()
        tokens[i, :m] = torch.tensor(s.ids[1:])
        valid[i, : m + 1] = True
        answer[i, max(0, s.prompt_len - 1) : m + 1] = True  # p at m: the LLM's next token after the sample
    return Batch(aux=aux, tokens=tokens, final=final, valid=valid, answer=answer)


def ttt_losses(head: Eagle3Head, batch: Batch, w: Tensor, depth: int, step_decay: float = 0.8,
               prompt_weight: float = 0.0) -> dict[str, Tensor]:
    """Per-step soft cross-entropy (``ce0`` ...) and their weighted sum (``loss``) on one batch.

    Step s from pair j guesses t_{j+s+2}, which the LLM drew from p at position j + s + 1.

    Args:
        head: the head.
        batch: :func:`make_batch`'s tensors.
        w: (K, H) the LLM's LM-head rows of the draft vocabulary (p over the draft vocabulary).
        depth: D, steps unrolled.
        step_decay: step s's weight is ``step_decay ** s``.
        prompt_weight: the weight of positions whose target token is in the prompt.
    """
    dev = head.fc.weight.device
    states = head.unroll(batch.aux.to(dev), batch.tokens.to(dev), depth)
    weight_all = (torch.where(batch.answer, 1.0, prompt_weight) * batch.valid).to(dev)  # (B, n + 1)
    with torch.no_grad(), torch.autocast(dev.type, enabled=False):  # p at every scored position once, in fp32
        p_all = torch.zeros(*weight_all.shape, w.shape[0], device=dev)  # (B, n + 1, K)
        used = weight_all > 0
        p_all[used] = torch.softmax(batch.final.to(dev)[used].float() @ w.T.float(), -1)  # step s reads it s positions on
    out: dict[str, Tensor] = {}
    total = torch.zeros((), device=dev)
    for s, st in enumerate(states):
        m = st.shape[1]
        at = slice(s + 1, s + 1 + m)  # the LLM's position whose p each step-s state is scored against
        weight = weight_all[:, at]  # (B, m)
        pick = weight > 0
        if not bool(pick.any()):  # host sync: skips a step no sample is long enough for
            continue
        logq = torch.log_softmax(head.logits(st[pick]).float(), -1)  # (C, K)
        ce = -(p_all[:, at][pick] * logq).sum(-1)
        out[f"ce{s}"] = (ce * weight[pick]).sum() / weight[pick].sum()
        total = total + step_decay**s * out[f"ce{s}"]
    out["loss"] = total
    return out


def train_eagle3(head: Eagle3Head, samples: Sequence[Sample], feats: Sequence[LayerFeatures], w: Tensor,
                 cfg: Eagle3Config, on_step: Callable[[int, dict], None] | None = None, seed: int = 0,
                 autocast: torch.dtype | None = None) -> dict:
    """AdamW on the head's trainable weights until ``cfg.minutes`` or ``cfg.max_steps``
    (``train/budget.py``); returns the training statistics. ``w``: (K, H) the LLM's LM-head rows of
    the draft vocabulary; ``autocast``: the forward's mixed-precision dtype (weights, gradients and
    optimiser stay fp32)."""

    def step_losses(idx: list[int], step: int) -> tuple[Tensor, dict]:
        amp = torch.autocast(head.fc.weight.device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with amp:
            losses = ttt_losses(head, make_batch([samples[i] for i in idx], [feats[i] for i in idx]), w, cfg.depth,
                                cfg.step_decay, cfg.prompt_weight)
        return losses["loss"], losses

    return train_for([p for p in head.parameters() if p.requires_grad], [len(s.ids) for s in samples],
                     minutes=cfg.minutes, max_steps=cfg.max_steps, lr=cfg.lr, weight_decay=cfg.weight_decay,
                     batch_tokens=cfg.batch_tokens, step_losses=step_losses, on_step=on_step, seed=seed,
                     precision=str(autocast).removeprefix("torch.") if autocast is not None else "float32")


def chain_accepts(head: Eagle3Head, sample: Sample, feats: LayerFeatures, depth: int) -> Tensor:
    """(A,) how many tokens a greedy chain of ``depth`` drafts from each answer position would have
    accepted (leading drafts equal to the LLM's tokens), teacher forced as serving drafts: the chain
    from pair j (committed text up to t_{j+1}) guesses t_{j+2}, t_{j+3}, ... One value per pair j
    whose t_{j+2} is an answer token."""
    batch = make_batch([sample], [feats])
    dev = head.fc.weight.device
    states = head.unroll(batch.aux.to(dev), batch.tokens.to(dev), depth)
    n = batch.tokens.shape[1]
    first = max(0, sample.prompt_len - 2)
    if first >= n:
        return torch.zeros(0, dtype=torch.long)
    hits = torch.zeros(n - first, depth, dtype=torch.bool)
    truth = torch.tensor([*sample.ids[1:], -1])  # (n + 1,) t_{i+1}, the token after position i (-1: none)
    for s, st in enumerate(states):
        guess = head.d2t[head.logits(st[0]).argmax(-1)].cpu()  # (n - s,) guesses for t_{j+s+2}
        m = st.shape[1]
        want = truth[s + 1 : s + 1 + m]  # t_{j+s+2}
        got = (guess == want) & (want >= 0)
        hits[: max(0, m - first), s] = got[first:]
    return hits.long().cumprod(1).sum(1)  # (A,) leading hits


@torch.no_grad()
def eagle3_ranks(head: Eagle3Head, aux: Tensor, ids: Sequence[int], prompt_len: int) -> Tensor:
    """(O,) where each answer token ranks among the head's depth-1 guesses (0: its argmax;
    ``NOT_DRAFTABLE`` outside its draft vocabulary, or with nothing to draft from), teacher forced as a
    draft after the true prefix sees it: answer token t is guessed by pair ``prompt_len + t - 2``, as
    a feature head's (``core/feature_head.py`` ``teacher_forced_ranks``).

    Args:
        head: the head.
        aux: (>= len(ids) - 1, 3H) the LLM's layer inputs at positions 0 .. len(ids) - 2.
        ids: prompt then answer token ids.
        prompt_len: P >= 1.
    """
    m, o = len(ids) - 1, len(ids) - prompt_len
    ranks = torch.full((max(o, 0),), NOT_DRAFTABLE, dtype=torch.long)
    if m < 1 or o < 1:
        return ranks
    dev = head.fc.weight.device
    tokens = torch.tensor(list(ids[1:]), device=dev)[None]  # (1, m)
    state = head.unroll(aux[:m].to(dev, head.fc.weight.dtype)[None], tokens, 1)[0][0]  # (m, H)
    first = max(0, 2 - prompt_len)
    lo = prompt_len - 2 + first
    where = torch.full((head.spec.vocab,), -1, dtype=torch.long)
    where[head.d2t.cpu()] = torch.arange(head.spec.draft_vocab)
    truth = where[torch.tensor(list(ids[lo + 2 :]))]  # (n,) draft rows of the answer tokens guessed
    got = token_ranks(head.norm(state[lo : m - 1]), head.lm_head.weight, None, truth.clamp(min=0))
    ranks[first:] = torch.where(truth >= 0, got, torch.full_like(got, NOT_DRAFTABLE))
    return ranks


@torch.no_grad()
def evaluate_eagle3(head: Eagle3Head, samples: Sequence[Sample], feats: Sequence[LayerFeatures], depth: int) -> dict:
    """Held-out greedy chain figures: ``accept_rate`` per depth (the share of chains whose first s+1
    drafts all match) and ``tau`` (1 + mean accepted: tokens per LLM step for a chain of ``depth``)."""
    was = head.training
    head.eval()
    acc = torch.cat([chain_accepts(head, s, f, depth) for s, f in zip(samples, feats, strict=True)])
    head.train(was)
    if not acc.numel():
        return {"chains": 0, "depth": depth, "accept_rate": [], "tau": float("nan")}
    rates = [round(float((acc > s).float().mean()), 4) for s in range(depth)]
    return {"chains": int(acc.numel()), "depth": depth, "accept_rate": rates, "tau": round(1 + float(acc.float().mean()), 4)}
