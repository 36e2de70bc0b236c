"""An ensemble at the cost of one: N same-shape SSMs drafting in one batched forward per depth.

Shape legend: M stacked drafters (the SSMs of one group), T committed tokens, R rows fed in one
forward (per drafter), S cached positions after it, P the prefix every fed row sees, H hidden width,
Q query heads, G kv heads, C head dim, I/O a product's in/out width, V vocabulary, K draft vocabulary,
N tree nodes (one drafter's), F frontier nodes (one drafter's, at one depth).

p = the LLM's distribution, q = a drafter's, as everywhere in serving.

Why: a merged tree accepts a position when *any* drafter holds the LLM's token, so an ensemble pays
only if drafting with N SSMs costs little more than with one. A small SSM's draft forward on this
project's CPU is a few ms, much of it per-op work outside the matrix products (norms, rotary,
attention, reshapes, the Python around them); N separate forwards repeat all of it N times.

Members that differ from the first by low-rank deltas (``core/low_rank.py``, trained with
``boost.delta_rank``) also share the weight reads: each product is the first member's weight with every
member's ``A`` appended as rows (one packed product gives the first member's output and each member's
``A x``), plus one product of all members' ``B`` over each row's own ``A x``. Measured on this project's
CPU (``scripts/bench_stacked.py --delta-rank 64``, bf16, 8,192-row head): 3 such SSMs draft at 1.46x one
SSM's cost, against 2.47x stacked with full weights and 3.0x separately.

Design: :class:`StackedSSMs` holds the N models' weights per layer (fused q/k/v and gate/up as in
``lean.py``), their N KV caches as one (M, G, S, C) cache per layer, and runs ONE forward for all N
drafters at each depth: every non-product op runs once over an (M, R, ...) batch, every product is a
batched product over the M weights (``products``: "packed", M oneDNN-packed products, the fastest form
measured here, see ``scripts/bench_stacked.py``; or "bmm", one ``torch.bmm``; a weight all members
share, e.g. one frozen LM head, is one product over all members' rows). It exposes N logical
drafters (:class:`StackedMember`, one per SSM, each under the SSM's own name), so the engine, its
plans, the learned scheduler's per-drafter labels and ``proposer_hits`` see N drafters as before and
the engine stays untouched: the first member the engine asks for a tree at a step drafts all N trees
in one go; the others return theirs. Each member's tree is grown exactly as ``SSMDrafter`` grows it
(``builders.TreeGrowth``: same children, same q, same node order, same subtree cut), so the engine merges
them exactly as it merges separate SSM drafters' trees (``tests/test_stacked.py`` compares both).

Cache bookkeeping: all members share one cache length. Member m's committed entries are valid up to
``synced[m]`` (it keeps the nodes it fed of the accepted path, gathered into place, as ``SSMDrafter``
does); the next draft crops the shared length to the smallest ``synced`` and feeds the committed
tokens after it to every member (a member that was ahead recomputes entries it had: the same values,
a few more rows in one forward). At each depth the members' frontiers are padded to the largest one;
a padding row sees the prefix and itself only, and no real node ever sees a padding slot.

Limits:
- one tree per step for the whole group (a plan giving two members different trees is refused);
- every member is drafted at every step even if the plan names only some of them (the forward is
  shared; a member whose tree the engine never asks for is not accepted and its nodes are dropped);
- under sampling the children are drawn depth by depth across members, so the random stream is
  consumed in another order than by separate drafters: other samples, the same distributions
  (verification stays exact; greedy trees are identical);
- weights are copied at construction: a group built before a model changes drafts with the old weights;
- only plain llama SSMs (``lean.lean_reason``) of one shape, dtype and device stack; others are refused
  with an error naming the drafters (``engine_from_models(stack_ssms=True)`` then keeps them separate).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from boosttune.core.low_rank import Factors, rebuilds
from boosttune.serving import cpu_linear
from boosttune.serving.builders import TreeGrowth
from boosttune.serving.drafter import Features, Replay, SSMDrafter, draft_probs, greedy_vocab
from boosttune.serving.lean import drafter_runner, lean_reason
from boosttune.serving.runner import restricted_head_error
from boosttune.serving.sampling import SamplingParams
from boosttune.serving.tree import TokenTree, TreeConfig

PRODUCTS = ("packed", "bmm")

# config fields two SSMs must share to stack (the weights' shapes and the forward's constants)
_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_parameters",
                 "rope_theta", "rope_scaling")


def stack_reason(models: Sequence[PreTrainedModel], names: Sequence[str]) -> str | None:
    """Why ``models`` (named ``names``) cannot draft stacked (None: they can)."""
    if len(models) != len(names) or not models:
        return "a stack needs at least one model, each with a name"
    for name, m in zip(names, models, strict=True):
        why = lean_reason(m)
        if why is not None:
            return f"{name} is not a plain llama model ({why})"
    first, ref = names[0], models[0]
    for name, m in zip(names[1:], models[1:], strict=True):
        for f in _SHAPE_FIELDS:
            a, b = getattr(ref.config, f, None), getattr(m.config, f, None)
            if a != b:
                return f"{first} has {f}={a!r} but {name} has {f}={b!r}"
        for what, a, b in (("dtype", ref.dtype, m.dtype), ("device", ref.device, m.device),
                           ("LM head rows", ref.get_output_embeddings().weight.shape[0],
                            m.get_output_embeddings().weight.shape[0])):
            if a != b:
                return f"{first} has {what} {a} but {name} has {b}"
    return None


class _StackedLinear:
    """M bias-free linear maps of one shape applied to M inputs: (M, R, I) → (M, R, O).

    Where all M weights are one tensor, or equal (SSMs sharing a module, e.g. one frozen LM head), the
    map is one product over all M R rows: the weight, the costly part of a few-row product, is read
    once. Where ``deltas`` gives members 1.. as member 0's weight plus ``B @ A`` (``core/low_rank.py``),
    it is one product with every member's ``A`` appended to member 0's weight as rows, and one with all
    members' ``B`` over each row's own ``A x`` (the others masked out): two products, whatever M.
    """

    def __init__(self, weights: list[Tensor], products: str, deltas: list[tuple[Tensor, Tensor]] | None = None):
        """``deltas``: (A (R, I), B (O, R)) for each member after the first (None: full weights)."""
        self.products = products
        w0 = weights[0]
        self.shared = all(w is w0 or (w.data_ptr() == w0.data_ptr() and w.shape == w0.shape
                                      and w.stride() == w0.stride()) or torch.equal(w, w0) for w in weights)
        self.low_rank: tuple[Tensor, Tensor] | None = None
        if not self.shared and deltas is not None:
            self.rank = rank = max(a.shape[0] for a, _ in deltas)
            a_all = w0.new_zeros(len(deltas) * rank, w0.shape[1])  # (M-1) R rows, each member's padded to R
            b_all = w0.new_zeros(w0.shape[0], len(deltas) * rank)  # (O, (M-1) R)
            for j, (a, b) in enumerate(deltas):
                a_all[j * rank : j * rank + a.shape[0]] = a.to(w0.dtype)
                b_all[:, j * rank : j * rank + b.shape[1]] = b.to(w0.dtype)
            self.low_rank, self.shared = (a_all, b_all), True
            self._masks: dict[int, Tensor] = {}
        if self.shared:
            weights = weights[:1]
        if products == "packed":
            if self.low_rank is not None:  # one product gives member 0's outputs and every member's A x
                weights = [torch.cat([w0, self.low_rank[0]])]
                self.packed_b = cpu_linear.pack(self.low_rank[1])
            self.packed = [cpu_linear.pack(w) for w in weights]  # each (O, I), oneDNN's blocked layout
        else:
            self.wt = torch.stack([w.t() for w in weights]).contiguous()  # (M, I, O), (1, I, O) shared

    def _mask(self, m: int, r: int) -> Tensor:
        """(M R, (M-1) R_delta): 1 where a row's member owns the column of ``A x`` (its own delta's)."""
        if r not in self._masks:
            rank, dev = self.rank, self.low_rank[0].device  # type: ignore[index]
            row = torch.arange(m, device=dev).repeat_interleave(r)  # each row's member
            col = torch.arange((m - 1) * rank, device=dev) // rank + 1  # each column's member
            self._masks[r] = (row[:, None] == col[None, :]).to(self.low_rank[0].dtype)  # type: ignore[index]
        return self._masks[r]

    def __call__(self, x: Tensor) -> Tensor:
        m, r, i = x.shape
        if self.shared:
            flat = x.reshape(m * r, i)  # (M R, I)
            if self.low_rank is None:
                out = cpu_linear.packed_linear(flat, self.packed[0]) if self.products == "packed" else \
                    torch.mm(flat, self.wt[0])
                return out.view(m, r, -1)  # (M, R, O)
            a_all, b_all = self.low_rank
            o = b_all.shape[0]
            if self.products == "packed":  # W x and every A x in one product, then B over each row's own A x
                y = cpu_linear.packed_linear(flat, self.packed[0])  # (M R, O + (M-1) R_delta)
                out = y[:, :o] + cpu_linear.packed_linear(y[:, o:] * self._mask(m, r), self.packed_b)
            else:
                out = torch.mm(flat, self.wt[0]) + torch.mm(torch.mm(flat, a_all.t()) * self._mask(m, r), b_all.t())
            return out.view(m, r, o)
        if self.products == "packed":
            return torch.stack([cpu_linear.packed_linear(x[j], p) for j, p in enumerate(self.packed)])
        return torch.bmm(x, self.wt)  # (M, R, O)


def _fused_deltas(
    parts: list[list[Tensor]], factors: list[Factors], names: list[list[str]],
) -> list[tuple[Tensor, Tensor]] | None:
    """Members 1..'s deltas from member 0 of a product whose weight is ``parts`` concatenated by rows
    (q, k, v fused), as one (A, B) each: the parts share one ``A`` (cut together,
    ``low_rank.cut_to_rank``), so B's rows stack, zero where a part equals member 0's. None (full weights)
    where a part is neither equal nor rebuilt by its factors (``low_rank.rebuilds``), or where the parts'
    ``A`` differ."""
    out = []
    for j in range(1, len(parts)):
        pairs: list[tuple[Tensor, Tensor] | None] = []
        for p0, p, name in zip(parts[0], parts[j], names[j], strict=True):
            if torch.equal(p, p0):
                pairs.append(None)
                continue
            ab = factors[j].get(name)
            if ab is None or not rebuilds(p0, p, *ab):
                return None
            pairs.append(ab)
        given = [ab for ab in pairs if ab is not None]
        a = given[0][0].float() if given else parts[j][0].new_zeros(0, parts[j][0].shape[1], dtype=torch.float32)
        if any(not torch.equal(g[0], given[0][0]) for g in given):
            return None
        bs = [ab[1].float() if ab else p.new_zeros(p.shape[0], a.shape[0], dtype=torch.float32)
              for ab, p in zip(pairs, parts[j], strict=True)]
        out.append((a, torch.cat(bs)))  # (R, I), (sum O, R)
    return out


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama's RMSNorm over (M, R, H) with (M, 1, H) weights (fp32 statistics, as transformers')."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _attend(q: Tensor, k: Tensor, v: Tensor, prefix_len: int, mask: Tensor, scale: float) -> Tensor:
    """Tree attention with one mask per drafter (``tree_attention_reference`` shares one mask).

    q: (M, Q, R, C); k, v: (M, G, S, C); mask: (M, R, S - P) bool. Returns (M, Q, R, C). Every row
    sees at least itself (padding rows included), so no row is empty.
    """
    m, qh, r, c = q.shape
    g = k.shape[1]
    rep = qh // g
    full = torch.cat([mask.new_ones(m, r, prefix_len), mask], dim=2)  # (M, R, S)
    assert full.shape[2] == k.shape[2], "prefix_len + mask width must be the cached length S"
    qg = q.reshape(m, g, rep * r, c)  # row j*R + t: query head kvh*rep + j, row t
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=full.repeat(1, rep, 1).unsqueeze(1), scale=scale)
    return out.reshape(m, qh, r, c)


class StackedSSMs:
    """N same-shape SSMs with their weights stacked and their KV caches as one; see the module doc."""

    def __init__(
        self, models: Sequence[PreTrainedModel], names: Sequence[str], vocab_size: int | None = None,
        ranking: Tensor | None = None, products: str | None = None,
    ):
        """Args:
            models: the SSMs (plain llama, one shape, dtype and device).
            names: their drafter names (errors name them).
            vocab_size: the LLM's logit width (as ``SSMDrafter``'s).
            ranking: the draft vocabulary ranking, for trees with ``draft_vocab`` > 0.
            products: "packed" or "bmm" (None: packed where oneDNN packs this dtype, else bmm).
        """
        why = stack_reason(models, names)
        if why is not None:
            raise ValueError(f"cannot stack drafters {list(names)}: {why}; draft them separately "
                             "(engine_from_models(stack_ssms=False))")
        ref = models[0]
        dev, dtype = ref.device, ref.dtype
        if products is None:
            products = "packed" if dev.type == "cpu" and cpu_linear.can_pack(dtype) else "bmm"
        if products not in PRODUCTS:
            raise ValueError(f"products must be one of {PRODUCTS}, got {products!r}")
        if products == "packed" and not (dev.type == "cpu" and cpu_linear.can_pack(dtype)):
            raise ValueError(f"products='packed' needs CPU weights oneDNN can pack; these are {dtype} on {dev}: "
                             "use products='bmm'")
        self.models, self.names, self.products = list(models), list(names), products
        # one SSMDrafter per member for what is not drafting: replay, the draft vocabulary ids, the
        # logits' fit to the LLM's width (so these stay exactly SSMDrafter's)
        self.solo = [SSMDrafter(drafter_runner(m), vocab_size=vocab_size, ranking=ranking) for m in models]
        cfg = ref.config
        self._q, self._g = cfg.num_attention_heads, cfg.num_key_value_heads
        self._c = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._eps = cfg.rms_norm_eps
        bodies = [m.base_model for m in models]
        self._rotary = bodies[0].rotary_emb  # one config: one rotary table
        self._scale = bodies[0].layers[0].self_attn.scaling if bodies[0].layers else 1.0
        factors = [getattr(m, "low_rank_delta", None) or {} for m in models]  # core/low_rank.py
        param_names = [{id(p): n for n, p in m.named_parameters()} for m in models]
        with torch.no_grad():
            embed = torch.stack([b.embed_tokens.weight.detach() for b in bodies])  # (M, V, H)
            self._embed = embed.reshape(-1, embed.shape[-1])  # (M V, H): one lookup for all members
            self._rows = embed.shape[1]

            def stacked(get) -> _StackedLinear:  # get(body): the weights fused into one product, by rows
                params = [list(get(b)) for b in bodies]
                parts = [[w.detach() for w in ws] for ws in params]
                names = [[param_names[j].get(id(w), "") for w in ws] for j, ws in enumerate(params)]
                weights = [torch.cat(ws) if len(ws) > 1 else ws[0] for ws in parts]
                return _StackedLinear(weights, products, _fused_deltas(parts, factors, names))

            def norm(get) -> Tensor:
                return torch.stack([get(b).detach() for b in bodies]).unsqueeze(1)  # (M, 1, H)

            self._layers = []
            for i in range(len(bodies[0].layers)):
                def attn(b, i=i):
                    return b.layers[i].self_attn

                def mlp(b, i=i):
                    return b.layers[i].mlp

                self._layers.append(dict(
                    ln1=norm(lambda b, i=i: b.layers[i].input_layernorm.weight),
                    qkv=stacked(lambda b: [attn(b).q_proj.weight, attn(b).k_proj.weight, attn(b).v_proj.weight]),
                    o=stacked(lambda b: [attn(b).o_proj.weight]),
                    ln2=norm(lambda b, i=i: b.layers[i].post_attention_layernorm.weight),
                    gate_up=stacked(lambda b: [mlp(b).gate_proj.weight, mlp(b).up_proj.weight]),
                    down=stacked(lambda b: [mlp(b).down_proj.weight]),
                ))
            self._norm = norm(lambda b: b.norm.weight)
            self._full_head = _StackedLinear([m.get_output_embeddings().weight.detach() for m in models], products)
        self._head_k = 0  # draft vocabulary the head is cut to (0: whole)
        self._head: _StackedLinear = self._full_head
        self._head_ids: Tensor | None = None
        self._greedy_ids: Tensor | None = None  # ``greedy_vocab`` of the cut head
        self.device, self.dtype = dev, dtype
        self._len = 0
        self._keys: list[Tensor] = []  # per layer (M, G, capacity, C)
        self._values: list[Tensor] = []
        self._synced = [0] * len(models)  # per member: committed entries valid at the start of its cache
        self._committed_len = 0
        self._slots: list[Tensor] = []  # per member: (N,) cache offset after the committed tokens, -1 unfed
        self._pending: dict[int, TokenTree] = {}  # this step's trees not yet handed out, by member
        self._pending_key: tuple | None = None

    @property
    def size(self) -> int:
        return len(self.models)

    # the stacked forward ------------------------------------------------------------------------

    def _reserve(self, n: int) -> None:
        cap = self._keys[0].shape[2] if self._keys else 0
        if n <= cap:
            return
        new_cap = max(n, 2 * cap, 256)
        shape = (self.size, self._g, new_cap, self._c)
        keys = [torch.empty(shape, device=self.device, dtype=self.dtype) for _ in self._layers]
        values = [torch.empty(shape, device=self.device, dtype=self.dtype) for _ in self._layers]
        for old, new in zip(self._keys + self._values, keys + values, strict=False):
            new[:, :, : self._len] = old[:, :, : self._len]
        self._keys, self._values = keys, values

    @torch.inference_mode()
    def forward(self, ids: Tensor, positions: Tensor, prefix_len: int, mask: Tensor, scatter: bool = True) -> Tensor:
        """Feed (M, R) tokens, one row set per member, at (R,) positions shared by all members, after
        the shared cache; ``mask``: (M, R, S - P) with S the cache length after the feed. Returns the
        (M, R, V) fp32 logits (-inf outside a draft vocabulary), as each member's runner would; without
        ``scatter``, a draft vocabulary's (M, R, K) logits alone."""
        m, r = ids.shape
        s0, s = self._len, self._len + r
        assert m == self.size and positions.shape == (r,), "ids must be (M, R) and positions (R,)"
        assert mask.shape == (m, r, s - prefix_len), f"mask must be ({m}, {r}, {s - prefix_len})"
        dev = self.device
        offset = (torch.arange(m, device=dev) * self._rows).unsqueeze(1)  # (M, 1)
        x = F.embedding(ids.to(dev) + offset, self._embed)  # (M, R, H)
        cos, sin = self._rotary(x, positions.to(dev).unsqueeze(0))  # (1, R, C) each
        self._reserve(s)
        mask = mask.to(dev)
        qn, gn, c = self._q, self._g, self._c
        for i, ly in enumerate(self._layers):
            h = _rms_norm(x, ly["ln1"], self._eps)
            qkv = ly["qkv"](h)  # (M, R, (Q + 2G) C)
            q = qkv[..., : qn * c].view(m, r, qn, c).transpose(1, 2)  # (M, Q, R, C)
            k = qkv[..., qn * c : (qn + gn) * c].view(m, r, gn, c).transpose(1, 2)  # (M, G, R, C)
            v = qkv[..., (qn + gn) * c :].view(m, r, gn, c).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self._keys[i][:, :, s0:s] = k
            self._values[i][:, :, s0:s] = v
            att = _attend(q, self._keys[i][:, :, :s], self._values[i][:, :, :s], prefix_len, mask, self._scale)
            x = x + ly["o"](att.transpose(1, 2).reshape(m, r, qn * c))
            h = _rms_norm(x, ly["ln2"], self._eps)
            gate, up = ly["gate_up"](h).chunk(2, dim=-1)
            x = x + ly["down"](F.silu(gate) * up)
        self._len = s
        last = _rms_norm(x, self._norm, self._eps)  # (M, R, H)
        logits = self._head(last).float()  # (M, R, V) or (M, R, K)
        if self._head_ids is None or not scatter:
            return logits
        full = logits.new_full((m, r, self._vocab), float("-inf"))
        full[:, :, self._head_ids] = logits
        return full  # (M, R, V)

    def _sync_head(self, k: int) -> None:
        """Cut the stacked head to a draft vocabulary of ``k`` tokens (on a change only)."""
        if k == self._head_k:
            return
        ids = self.solo[0]._head(k)  # (K,) or None, with SSMDrafter's errors
        if ids is None:
            self._head, self._head_ids = self._full_head, None
        else:
            why = restricted_head_error(self.models[0])
            if why is not None:
                raise ValueError(f"cannot restrict the draft vocabulary: {why}; use the full vocabulary")
            ids = ids.to(self.device)
            if self._full_head.shared:  # one head: cut once, still one product
                heads = [self.models[0].get_output_embeddings().weight.detach()[ids].contiguous()] * self.size
            else:
                heads = [m.get_output_embeddings().weight.detach()[ids].contiguous() for m in self.models]  # (K, H)
            self._head, self._head_ids = _StackedLinear(heads, self.products), ids
            self._vocab = self.models[0].get_output_embeddings().weight.shape[0]
        self._greedy_ids = greedy_vocab(self._head_ids, self.solo[0].vocab_size)
        self._head_k = k

    # drafting ----------------------------------------------------------------------------------

    def reset(self) -> None:
        self._len = 0
        self._synced = [0] * self.size
        self._pending, self._pending_key = {}, None

    def spawn(self) -> StackedSSMs:
        """The same stacked weights with caches of their own (another request's)."""
        other = copy.copy(self)
        other._keys, other._values, other._slots = [], [], []
        other.reset()
        return other

    def tree_for(
        self, member: int, committed: Tensor, tree: TreeConfig, sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> TokenTree:
        """Member ``member``'s tree for this step: drafted with all the others' in one go by the first
        member asked, handed out to the rest."""
        key = self._pending_key
        if member in self._pending and key is not None and key[0] is committed:
            if (key[1], key[2]) != (tree, sampling):
                asked = next(iter(n for j, n in enumerate(self.names) if j not in self._pending))
                raise ValueError(
                    f"stacked drafters draft one tree per step: {asked} drafted [{key[1].label}] but "
                    f"{self.names[member]} asks for [{tree.label}]; give the stacked SSMs {self.names} one "
                    "tree, or assemble without stack_ssms")
            return self._pending.pop(member)
        trees = self.draft_all(committed, tree, sampling, generator)
        self._pending = {j: t for j, t in enumerate(trees) if j != member}
        self._pending_key = (committed, tree, sampling)  # holds committed: its identity is this step's
        return trees[member]

    @torch.inference_mode()
    def draft_all(
        self, committed: Tensor, tree: TreeConfig, sampling: SamplingParams, generator: torch.Generator | None
    ) -> list[TokenTree]:
        """Every member's tree of shape ``tree`` for the (T,) committed tokens, as ``SSMDrafter``
        would draft each (node proposers 0), in one stacked forward per depth."""
        t, n = committed.shape[0], self.size
        self._committed_len = t
        self._sync_head(tree.draft_vocab)
        ids_k = self._greedy_ids if sampling.greedy else None  # greedy trees rank the draft vocabulary alone

        def probs(j: int, logits: Tensor) -> Tensor:
            """Member ``j``'s (F, V) q from its logits, or (F, K) over the draft vocabulary ``ids_k``."""
            return draft_probs(self.solo[j]._fit(logits) if ids_k is None else logits, sampling)

        # catch up: crop to what every member has, feed the rest to all (one chain forward)
        start = min(min(self._synced), t - 1, self._len)
        self._len = start
        chain = committed[start:].to(self.device)  # (R,)
        r = chain.shape[0]
        mask = torch.ones(r, r, dtype=torch.bool).tril().expand(n, r, r)
        logits = self.forward(chain.expand(n, r), torch.arange(start, t), start, mask,
                              scatter=ids_k is None)[:, -1]  # (M, V) or (M, K)
        self._synced = [t] * n
        growths = [TreeGrowth(tree, sampling.greedy, probs(j, logits[j : j + 1]), ids_k) for j in range(n)]
        fed = 0  # padded slots fed after the committed tokens
        for d in range(tree.max_depth):
            feeds = [g.expand(d, generator) for g in growths]  # per member: (F,) new nodes to feed, or None
            if all(f is None for f in feeds):
                break
            width = max(f.numel() for f in feeds if f is not None)
            ids = torch.zeros(n, width, dtype=torch.long)
            mask = torch.zeros(n, width, fed + width, dtype=torch.bool)
            mask[:, :, fed:].diagonal(dim1=1, dim2=2).fill_(True)  # padding rows see themselves
            for j, (g, f) in enumerate(zip(growths, feeds, strict=True)):
                if f is not None:
                    ids[j, : f.numel()] = g.tokens_of(f)
                    mask[j, : f.numel()] = g.feed_mask(f, fed, width)
            positions = torch.full((width,), t + d, dtype=torch.long)  # depth d + 1 sits at t - 1 + d + 1
            logits = self.forward(ids, positions, t, mask, scatter=ids_k is None)  # (M, width, V or K)
            for j, (g, f) in enumerate(zip(growths, feeds, strict=True)):
                if f is not None:
                    g.fed(f, fed, probs(j, logits[j, : f.numel()]))
            fed += width
        trees, self._slots = [], []
        for g in growths:
            drafted, slots = g.finish()
            trees.append(drafted)
            self._slots.append(slots)
        return trees

    @torch.inference_mode()  # the cache was made under inference mode
    def accept(self, member: int, accepted: list[int]) -> None:
        """Member ``member`` keeps the nodes it fed of the accepted path (as ``SSMDrafter.accept``)."""
        keep = []
        for node in accepted:
            slot = int(self._slots[member][node])
            if slot < 0:
                break
            keep.append(slot)
        start = self._committed_len
        if keep:
            idx = torch.tensor(keep, dtype=torch.long, device=self.device) + start
            for cache in (*self._keys, *self._values):
                cache[member, :, start : start + len(keep)] = cache[member].index_select(1, idx)
        self._synced[member] = start + len(keep)


@dataclass(eq=False)  # drafters compare and hash by identity, as SSMDrafter does
class StackedMember:
    """One SSM of a :class:`StackedSSMs` group, as a ``Drafter`` of its own (the engine holds one per SSM).

    Attributes:
        group: the stacked group.
        index: this SSM's place in it.
    """

    group: StackedSSMs
    index: int

    def reset(self) -> None:
        self.group.reset()  # every member's: the engine resets all drafters at a request's start

    def spawn(self, memo: dict[int, object]) -> StackedMember:
        if id(self.group) not in memo:
            memo[id(self.group)] = self.group.spawn()
        group = memo[id(self.group)]
        assert isinstance(group, StackedSSMs)
        return StackedMember(group, self.index)

    def observes_features(self) -> bool:
        return False

    def observe(self, features: Tensor) -> None:
        raise TypeError(f"{type(self).__name__} does not read the LLM's features")

    def feature_layers(self) -> tuple[int, ...]:
        return ()

    def draft(
        self, committed: Tensor, tree: TreeConfig, sampling: SamplingParams, generator: torch.Generator | None
    ) -> TokenTree:
        return self.group.tree_for(self.index, committed, tree, sampling, generator)

    def accept(self, accepted: list[int]) -> None:
        self.group.accept(self.index, accepted)

    def replay(self, prompt: Sequence[int], out: Sequence[int], tree: TreeConfig, features: Features | None = None) -> Replay:
        return self.group.solo[self.index].replay(prompt, out, tree, features)


def stacked_drafters(
    models: Sequence[PreTrainedModel], names: Sequence[str], vocab_size: int | None = None,
    ranking: Tensor | None = None, products: str | None = None,
) -> dict[str, StackedMember]:
    """One drafter per SSM, by name, all drafting through one :class:`StackedSSMs` (its arguments)."""
    group = StackedSSMs(models, names, vocab_size, ranking, products)
    return {name: StackedMember(group, j) for j, name in enumerate(names)}
