"""Teacher decoding (greedy or sampled) for a batch of prompts, without HF ``generate``'s per-step
overhead.

The teacher phase is the training budget: every SSM token we train on is one the LLM wrote. HF
``generate`` on a left-padded batch re-builds a 4-D mask, grows its cache by concatenation and keeps
stepping rows that already ended. This decoder instead

- preallocates the whole cache (``prompt + max_new_tokens`` positions) and writes each step in place;
- keeps keys transposed, (B, G, C, S), so a decode step's attention is two batched matrix products
  that read the cache where it lies, grouped-query heads folded into rows instead of repeated;
- drops finished rows from the batch every ``compact_every`` steps;
- reads a prompt that several rows share once;
- can keep the LLM's last hidden state (its *feature*, after the final norm) at every position it
  read, prompt and continuation, which is what a feature head trains on (``boosttune/train/feature.py``):
  writing the continuation computes them all anyway.

It calls the model's own decoder layers (rotary embeddings, norms, MLPs) through a registered
attention function, so it is the LLM's computation: on CPU in fp32 its greedy tokens equal HF
``generate``'s (tests/test_teacher_backends.py). Sampling (temperature, top-p) draws each token from
the same distribution as HF's sampling warpers (tested there by a chi-square test), though not the
same random stream.

Shape legend: B rows, T tokens fed, S cache positions, H query heads, G kv heads, C head dim, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface

from boosttune.serving import cpu_linear
from boosttune.serving.sampling import greedy_tokens

ATTENTION = "boosttune_batched_teacher"


@dataclass
class Decoded:
    """What :func:`decode_batch` wrote, per prompt (in the order given)."""

    tokens: list[list[int]]
    topk_ids: list[list[list[int]]] | None = None  # with topk: per output position
    topk_logprobs: list[list[list[float]]] | None = None
    features: list[Tensor] | None = None  # with features: (len(prompt) + len(tokens) - 1, H) fp16, on CPU


@dataclass
class BatchCache:
    keys: list[Tensor]  # per layer (B, G, C, S_max), transposed
    values: list[Tensor]  # per layer (B, G, S_max, C)
    bias: Tensor  # (B, S_max) additive: -inf at left padding, 0 elsewhere
    filled: int = 0  # positions written so far (the same for every row: padding is on the left)
    prefilling: bool = False  # a multi-token feed: its rows hold nothing but padding before ``filled``

    def keep_rows(self, rows: Tensor) -> None:
        self.keys = [x.index_select(0, rows) for x in self.keys]
        self.values = [x.index_select(0, rows) for x in self.values]
        self.bias = self.bias.index_select(0, rows)


def _attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None, dropout=0.0, **kw):
    """query (B, H, T, C), key/value (B, G, T, C) for the T fed tokens; returns (B, T, H, C)."""
    cache: BatchCache = kw["batch_cache"]
    layer = module.layer_idx
    b, h, t, c = query.shape
    g = key.shape[1]
    s0 = cache.filled
    cache.keys[layer][:, :, :, s0:s0 + t] = key.transpose(-1, -2)
    cache.values[layer][:, :, s0:s0 + t] = value
    scale = scaling if scaling is not None else c ** -0.5
    if t == 1:
        bias = cache.bias[:, : s0 + 1]  # (B, S)
        dt = cache.keys[layer].dtype
        keys_t = cache.keys[layer].view(b * g, c, -1)[:, :, : s0 + 1]  # (B*G, C, S), a view
        values = cache.values[layer].view(b * g, -1, c)[:, : s0 + 1]  # (B*G, S, C), a view
        q = query.reshape(b * g, h // g, c).to(dt)  # query head i reads kv head i // (H / G)
        scores = torch.bmm(q, keys_t).view(b, h, s0 + 1) * scale + bias[:, None, :]  # (B, H, S)
        probs = torch.softmax(scores.float(), dim=-1).to(dt).view(b * g, h // g, s0 + 1)
        out = torch.bmm(probs, values).view(b, h, 1, c).to(query.dtype)  # (B, H, 1, C)
    else:  # the prefill: causal within the fed tokens (all before them is padding), padding masked
        if not cache.prefilling:
            raise ValueError("batched decode: multi-token feeds are only supported as the prefill")
        real = cache.bias[:, s0 : s0 + t] == 0  # (B, T)
        mask = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()[None, None] & real[:, None, None, :]
        # a padding row sees nothing and would give NaN; let it see itself (its output is never read)
        mask = mask | torch.eye(t, dtype=torch.bool, device=query.device)[None, None]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=g != h)
    return out.transpose(1, 2), None


AttentionInterface.register(ATTENTION, _attention)


def unsupported_reason(model) -> str | None:
    """Why this decoder cannot run ``model`` (None if it can): it needs plain full causal attention."""
    cfg = model.config
    if not hasattr(cfg, "num_key_value_heads") or not hasattr(cfg, "num_hidden_layers"):
        return f"{type(model).__name__} has no num_key_value_heads/num_hidden_layers in its config"
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True):
        return f"{cfg.model_type} uses sliding-window attention ({window} tokens)"
    if getattr(cfg, "layer_types", None) and any(x != "full_attention" for x in cfg.layer_types):
        return f"{cfg.model_type} has layers other than full attention ({sorted(set(cfg.layer_types))})"
    attn = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    if len(attn) != cfg.num_hidden_layers:
        return f"{type(model).__name__}: found {len(attn)} attention modules with a layer_idx, expected {cfg.num_hidden_layers}"
    return None


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def pick_tokens(logits: Tensor, temperature: float = 0.0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> Tensor:
    """(B, V) fp32 logits → (B,) next tokens: the argmax at temperature 0; else a draw from
    softmax(logits / temperature) cut to its nucleus (the fewest most likely tokens whose probability
    reaches ``top_p``, as HF's top-p warper keeps) and renormalised.

    Sorting and sampling the whole vocabulary each step would cost more than the LLM's step on CPU
    (49k-token rows: ~0.4 s for 96 rows), so the nucleus is looked for among the top 64 tokens first
    (4x more until every row's nucleus fits), and without top-p the draw is an exponential race
    (the argmax of p_i / E_i, E_i ~ Exp(1), falls on i with probability p_i)."""
    if temperature <= 0:
        return greedy_tokens(logits)
    logits = logits / temperature
    if top_p >= 1.0:
        race = -torch.rand(logits.shape, generator=generator, device=logits.device).log()  # Exp(1)
        return (torch.softmax(logits, dim=-1) / race).argmax(-1)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    k = min(64, logits.shape[-1])
    while True:
        top, ids = logits.topk(k, dim=-1)  # most likely first
        probs = (top - lse).exp()
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        if k == logits.shape[-1] or bool((before[:, -1] + probs[:, -1] >= top_p).all()):
            break
        k = min(4 * k, logits.shape[-1])
    probs = probs.masked_fill(before >= top_p, 0.0)  # the most likely token always stays
    return ids.gather(-1, torch.multinomial(probs, 1, generator=generator))[:, 0]


def _prefill_groups(lengths: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of ascending ``lengths``, each padded to its last row's length within
    ``budget`` tokens (a row longer than the budget is a group alone)."""
    groups, lo = [], 0
    for i, n in enumerate(lengths):
        if i > lo and (i + 1 - lo) * n > budget:
            groups.append((lo, i))
            lo = i
    groups.append((lo, len(lengths)))
    return groups


@torch.inference_mode()
def decode_batch(
    model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_ids: frozenset[int], pad_id: int,
    topk: int = 0, compact_every: int = 16, temperature: float = 0.0, top_p: float = 1.0,
    generator: torch.Generator | None = None, features: bool = False, prefill_tokens: int = 4096,
) -> Decoded:
    """Continuations of ``prompts`` (each cut after its first EOS): greedy at ``temperature`` 0, else
    sampled (:func:`pick_tokens`; ``generator``: the random stream, default torch's global one); with
    ``topk`` the LLM's ``topk`` most likely tokens and their log-probabilities (of its own
    distribution, before temperature) at every output position; with ``features`` the LLM's feature
    at every position it read: all but the last token of prompt + continuation (that one is never
    fed back). Prompts are read in groups of similar length of at most ``prefill_tokens`` padded
    tokens each, so a long prompt does not pad the whole batch to its length."""
    reason = unsupported_reason(model)
    if reason:
        raise ValueError(f"teacher.backend=batched: {reason}; use teacher.backend=hf")
    dev, cfg = model.device, model.config
    if dev.type == "cpu":
        cpu_linear.install(model)  # oneDNN-packed weights: fp32 batches of 96-192 rows several times faster
    n_rows, width = len(prompts), max(len(p) for p in prompts)
    # a prompt asked for several times (several samples of one request) is read once
    first: dict[tuple[int, ...], int] = {}
    for p in prompts:
        first.setdefault(tuple(p), len(first))
    unique = sorted(first, key=len)  # by length: the prefill groups of similar lengths pad little
    index = {p: u for u, p in enumerate(unique)}
    copy_of = torch.tensor([index[tuple(p)] for p in prompts], dtype=torch.long)
    s_max = width + max_new_tokens
    # fp32 on CPU: two small batched products read it in place, faster than bf16 there and exact
    cache_dtype = torch.float32 if dev.type == "cpu" else model.dtype
    g, c = cfg.num_key_value_heads, _head_dim(cfg)
    cache = BatchCache(
        keys=[torch.empty(len(unique), g, c, s_max, device=dev, dtype=cache_dtype) for _ in range(cfg.num_hidden_layers)],
        values=[torch.empty(len(unique), g, s_max, c, device=dev, dtype=cache_dtype) for _ in range(cfg.num_hidden_layers)],
        bias=torch.zeros(len(unique), s_max, device=dev, dtype=cache_dtype),
    )
    ids = torch.full((len(unique), width), pad_id, dtype=torch.long)
    offsets = torch.zeros(len(unique), dtype=torch.long)
    for r, p in enumerate(unique):
        ids[r, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        offsets[r] = width - len(p)
        cache.bias[r, : width - len(p)] = float("-inf")
    ids, offsets = ids.to(dev), offsets.to(dev)
    positions = (torch.arange(width, device=dev)[None] - offsets[:, None]).clamp(min=0)  # (B, P)
    body, head = model.get_decoder(), model.get_output_embeddings()
    outs: list[list[int]] = [[] for _ in range(n_rows)]
    top_ids: list[list[list[int]]] = [[] for _ in range(n_rows)]
    top_lps: list[list[list[float]]] = [[] for _ in range(n_rows)]
    feats: list[list[Tensor]] = [[] for _ in range(n_rows)]  # with features: the prompt's, then one per fed token
    old = cfg._attn_implementation
    cfg._attn_implementation = ATTENTION
    try:
        hidden = torch.empty(len(unique), cfg.hidden_size, device=dev, dtype=model.dtype)
        prompt_feats: list[Tensor] = []
        for lo, hi in _prefill_groups([len(p) for p in unique], prefill_tokens):
            w = len(unique[hi - 1])  # the group's longest prompt; the positions before it are padding
            for x in cache.keys:
                x[lo:hi, :, :, : width - w] = 0  # read (masked) by every decode step: no stale NaN
            for x in cache.values:
                x[lo:hi, :, : width - w] = 0
            group = BatchCache([x[lo:hi] for x in cache.keys], [x[lo:hi] for x in cache.values],
                               cache.bias[lo:hi], filled=width - w, prefilling=True)  # views: writes land in cache
            states = body(input_ids=ids[lo:hi, width - w:], position_ids=positions[lo:hi, width - w:],
                          use_cache=False, batch_cache=group).last_hidden_state  # (rows, w, H)
            hidden[lo:hi] = states[:, -1]
            if features:
                states = states.to("cpu", torch.float16)
                prompt_feats += [states[i, w - len(unique[u]):] for i, u in enumerate(range(lo, hi))]
        if features:
            for r in range(n_rows):
                feats[r].append(prompt_feats[int(copy_of[r])])
        cache.filled = width
        next_pos = positions[:, -1] + 1  # (B,)
        # live row j decodes prompt row rows[j]; the cache stays in length order (copied only for repeats)
        rows = sorted(range(n_rows), key=lambda r: int(copy_of[r]))
        if len(unique) < n_rows:
            pick = copy_of[rows].to(dev)
            cache.keep_rows(pick)
            hidden, next_pos = hidden[pick], next_pos[pick]
        done = [False] * n_rows
        for step in range(max_new_tokens):
            logits = head(hidden).float()  # (B, V)
            tok = pick_tokens(logits, temperature, top_p, generator)
            if topk:
                lp, ti = torch.log_softmax(logits, -1).topk(topk, -1)
                lp, ti = lp.tolist(), ti.tolist()
            for j, t in enumerate(tok.tolist()):  # one host sync per step
                if done[j]:
                    continue
                r = rows[j]
                outs[r].append(t)
                if topk:
                    top_ids[r].append(ti[j])
                    top_lps[r].append(lp[j])
                done[j] = t in eos_ids
            if all(done) or step + 1 == max_new_tokens:
                break
            if step % compact_every == compact_every - 1 and any(done):
                live = [j for j, d in enumerate(done) if not d]
                keep = torch.tensor(live, device=dev)
                cache.keep_rows(keep)
                rows, done = [rows[j] for j in live], [False] * len(live)
                tok, next_pos = tok[keep], next_pos[keep]
            hidden = body(input_ids=tok[:, None], position_ids=next_pos[:, None], use_cache=False,
                          batch_cache=cache).last_hidden_state[:, -1]
            if features:
                fed = hidden.to("cpu", torch.float16)
                for j, r in enumerate(rows):
                    if not done[j]:  # a finished row is fed until it is compacted away; not its text
                        feats[r].append(fed[j : j + 1])
            cache.filled += 1
            next_pos = next_pos + 1
    finally:
        cfg._attn_implementation = old
    return Decoded(outs, top_ids if topk else None, top_lps if topk else None,
                   [torch.cat(f) for f in feats] if features else None)
