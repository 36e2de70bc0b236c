"""A leaner runner for llama-architecture models: their forward without transformers' module stack.

Shape legend: T tokens fed in one forward, S cached positions after it, H hidden width, Q query
heads, G kv heads, C head dim, L layers.

A drafter's forward is small (a feature head: one decoder layer and an 8k-row head, about 1 ms of
matrix products in bf16 on this project's CPU), so the Python around it dominates: transformers'
model forward builds masks and output objects, its ``DynamicCache`` concatenates every layer's keys
at every step, and each of a layer's dozen modules is a call through ``nn.Module``. Measured on an
AVX512-BF16 EPYC (2 threads, bf16), a feature head's draft of one level took 2.5 ms in the engine,
of which ~1 ms were matrix products.

:class:`LeanRunner` is a :class:`~boosttune.serving.runner.ModelRunner` that computes the same
function from the same modules' weights with fewer calls: the q/k/v and the gate/up projections
each fused into one packed product, rotary embeddings from the model's own rotary module, the
model's own RMSNorm modules, tree attention over a preallocated cache written in place (grown by
doubling; compaction gathers in place, as ``kv.compact_cache`` does). Fused weights are rebuilt when
a source weight changes (version counters).

Drafters use it everywhere (their numerics never change the output: verification decides). The LLM
uses it on CPU (:func:`llm_runner`), for its verification forwards and for plain decoding alike, so
that speed-ups compare speculation with plain decoding through the same forward: on 12 MT-bench
questions (bf16, 2 cores of an AMX Xeon, the demo's feature head, tree [3]) plain decoding ran at
26.5 tok/s through transformers' forward, 23.9 through ``ModelRunner`` (its ``DynamicCache``
concatenates at every step, and a 4-token feed concatenates more) and 28.6 through ``LeanRunner``;
speculation at 30.6 and 35.3 tok/s through the last two (1.28× and 1.24× their own plain decoding).
The greedy-identity tests compare it, as the LLM, with transformers' forward (``decode.py``). On CUDA
the LLM keeps ``ModelRunner``, the path the GPU checks measured.

Only plain llama layers qualify (:func:`lean_reason`): no attention or MLP bias, SiLU gate,
``pretraining_tp`` 1, full attention. Others keep ``ModelRunner``. ``BOOSTTUNE_LEAN=0`` turns it off.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from boosttune.kernels.tree_attention import full_mask, tree_attention
from boosttune.serving import cpu_linear
from boosttune.serving import quantize as quantize_mod
from boosttune.serving.pooled import KVPool, PooledStep, sdpa, shared_pool
from boosttune.serving.runner import ModelRunner

ENV_VAR = "BOOSTTUNE_LEAN"


def lean_reason(model: PreTrainedModel) -> str | None:
    """Why ``model`` cannot run through :class:`LeanRunner` (None: it can)."""
    cfg = model.config
    if os.environ.get(ENV_VAR, "").strip() == "0":
        return f"{ENV_VAR}=0"
    if cfg.model_type != "llama":
        return f"model_type {cfg.model_type!r} is not llama"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "attention or MLP biases"
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        return "an activation other than SiLU, or pretraining_tp > 1"
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and set(layer_types) != {"full_attention"}:
        return f"layers other than full attention ({sorted(set(layer_types))})"
    body = model.base_model
    if not all(hasattr(body, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(body).__name__} lacks embed_tokens/layers/norm/rotary_emb"
    return None


def drafter_runner(model: PreTrainedModel, head_ids: Tensor | None = None) -> ModelRunner:
    """The runner a drafter gets: :class:`LeanRunner` where the model qualifies, else ``ModelRunner``."""
    return ModelRunner(model, head_ids) if lean_reason(model) else LeanRunner(model, head_ids)


def llm_runner(model: PreTrainedModel) -> ModelRunner:
    """The runner the LLM gets: :class:`LeanRunner` on CPU where the model qualifies, else ``ModelRunner``
    (on CUDA too: the GPU checks measured the LLM through it)."""
    return drafter_runner(model) if model.device.type == "cpu" else ModelRunner(model)


Product = nn.Linear | quantize_mod.QuantLinear
"""One matrix product of the lean forward: a (CPU-packed) Linear, or its quantized form."""


def _weight(p: Product) -> Tensor:
    assert isinstance(p, nn.Linear), "quantized already"
    return p.weight.detach()


def _version(t: Tensor) -> tuple[int, int]:
    return t.data_ptr(), -1 if t.is_inference() else t._version


class _Fused:
    """One Linear computing several bias-free Linears of the same input, concatenated; rebuilt when
    any of them changes."""

    def __init__(self, parts: list[nn.Linear]):
        self.parts = parts
        self.key: tuple | None = None
        self.linear: nn.Linear | None = None

    def __call__(self, x: Tensor) -> Tensor:
        return self.current()(x)

    def current(self) -> nn.Linear:
        """The fused Linear of the parts' current weights (a ``CpuLinear`` on the CPU)."""
        key = tuple(_version(p.weight) for p in self.parts)
        if key != self.key:
            w = torch.cat([p.weight.detach() for p in self.parts])  # (sum O, I)
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
            lin.weight = nn.Parameter(w, requires_grad=False)
            if w.device.type == "cpu":
                cpu_linear.install(lin)
            self.linear, self.key = lin, key
        assert self.linear is not None
        return self.linear


class Compiled(Protocol):
    """What ``compiled.CompiledForward`` gives a runner (named here: compiled.py imports this module)."""

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, keys: list[Tensor],
                 values: list[Tensor], length: int, mask: Tensor | None) -> tuple[Tensor, Tensor]: ...

    def pooled(self, x: Tensor, cos: Tensor, sin: Tensor, step: PooledStep) -> tuple[Tensor, Tensor]: ...

    prefills: bool
    """Whether ``prefill`` and ``pooled_prefill`` may be called (prompts into empty caches, no logits)."""

    def prefill(self, x: Tensor, cos: Tensor, sin: Tensor, keys: list[Tensor], values: list[Tensor],
                mask: Tensor) -> Tensor: ...

    def pooled_prefill(self, x: Tensor, cos: Tensor, sin: Tensor, step: PooledStep) -> Tensor: ...

    def rebuilt(self, runner: LeanRunner) -> Compiled:
        """A compiled forward of ``runner`` as it is now (its LM head cut to another draft vocabulary);
        its graphs compile at their first call."""
        ...


class LeanRunner(ModelRunner):
    """``ModelRunner`` for a plain llama model, computed layer by layer over a preallocated cache."""

    def __init__(self, model: PreTrainedModel, head_ids: Tensor | None = None):
        why = lean_reason(model)
        if why is not None:
            raise ValueError(f"LeanRunner cannot run {type(model).__name__}: {why}")
        super().__init__(model)  # the head is cut last, once this runner's own attributes exist
        cfg = model.config
        body = model.base_model
        self._body = body
        self._q, self._g = cfg.num_attention_heads, cfg.num_key_value_heads
        self._c = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._qkv = [_Fused([ly.self_attn.q_proj, ly.self_attn.k_proj, ly.self_attn.v_proj]) for ly in body.layers]
        self._gate_up = [_Fused([ly.mlp.gate_proj, ly.mlp.up_proj]) for ly in body.layers]
        self._o: list[Product] = [ly.self_attn.o_proj for ly in body.layers]
        self._down: list[Product] = [ly.mlp.down_proj for ly in body.layers]
        self._lm: Product = model.get_output_embeddings()
        self.quantized: str | None = None  # "int8" / "int4" / "w8a8" after ``quantize``
        # each row's attention computed alone (``pooled.sdpa``), bit for bit a plain step's: w8a8 in fp32
        self.exact_attention = False
        # after ``quantize``: per kind of product (q/k/v, o, gate/up, down, LM head) every layer's quantized
        # weights and scales stacked along dim 0 (``quantize.stack``); the products are their slices
        self.quant_stacks: tuple[tuple[Tensor, Tensor], ...] = ()
        self._scale = body.layers[0].self_attn.scaling if body.layers else 1.0
        self._len = 0
        self._keys: list[Tensor] = []  # per layer (G, capacity, C)
        self._values: list[Tensor] = []
        self._pool: KVPool | None = None  # where the cache lives when it is a slot of a pool (``spawn``)
        self._slot = -1
        # the compiled forward (``compiled.CompiledForward``, given by ``compiled.compile_runner``): a single
        # request's, and several requests' over a pool
        self.compiled: Compiled | None = None
        if head_ids is not None:
            self.restrict_head(head_ids)

    @property
    def cached_len(self) -> int:
        return self._len

    def reset(self) -> None:
        self._len = 0

    def _reserve(self, n: int, dtype: torch.dtype) -> None:
        """Room for ``n`` cached positions (doubling: a request's growth costs O(S) copies in all)."""
        if self._pool is not None:
            self._pool.reserve(n, dtype)
            return
        cap = self._keys[0].shape[1] if self._keys else 0
        if n < cap and self._keys and self._keys[0].dtype == dtype:  # above n: as KVPool.reserve says
            return
        new_cap = max(n + 1, 2 * cap, 256)
        dev = self.device
        shape = (self._g, new_cap, self._c)
        keys = [torch.empty(shape, device=dev, dtype=dtype) for _ in self._qkv]
        values = [torch.empty(shape, device=dev, dtype=dtype) for _ in self._qkv]
        if self._keys:
            for old, new in zip(self._keys + self._values, keys + values, strict=True):
                new[:, : self._len] = old[:, : self._len]
        self._keys, self._values = keys, values

    def set_taps(self, layers: Sequence[int]) -> None:
        """``ModelRunner.set_taps``; before the forward is compiled (the graph returns the taps it had)."""
        before = self.taps
        super().set_taps(layers)
        if self.compiled is not None and self.taps != before:
            self.taps = before
            raise ValueError("set the taps before compiling the forward (compile_runner): its graph returns "
                             "the layer inputs it was built with")

    def products(self, i: int) -> tuple[Product, Product, Product, Product]:
        """Layer ``i``'s matrix products as this runner computes them: fused q/k/v, o, fused gate/up, down
        (``nn.Linear`` modules, or ``QuantLinear`` after ``quantize``)."""
        qkv, gate_up = self._qkv[i], self._gate_up[i]
        return (qkv.current() if isinstance(qkv, _Fused) else qkv, self._o[i],
                gate_up.current() if isinstance(gate_up, _Fused) else gate_up, self._down[i])

    def lm_product(self) -> Product:
        """The LM head's product over the whole vocabulary (a drafter's restricted head is ``_head``)."""
        return self._lm

    @torch.inference_mode()
    def quantize(self, scheme: str, group: int = quantize_mod.DEFAULT_GROUP) -> int:
        """Compute every matrix product of the model (the fused ones, o, down and the LM head) with
        weight-only ``scheme`` weights (``serving/quantize.py``) from now on; returns the bytes of the
        quantized weights a forward reads (of a head cut to a draft vocabulary, its rows alone). For a
        frozen model being served, before any runner is spawned or the forward compiled: the quantized
        weights are taken once, and the model's own weights stay as they are
        (transformers' forward and training still use them). Raises ValueError naming ``--quantize``
        where it cannot (a GPU model, a compiled forward, quantized already, or a
        weight shape the kernel refuses), before anything changes."""
        quantize_mod.check_scheme(scheme, group)
        if self.device.type != "cpu":
            raise ValueError(f"--quantize {scheme}: the quantized kernels are for CPUs; the LLM is on {self.device}")
        if self.compiled is not None or self.quantized is not None:
            raise ValueError(f"--quantize {scheme}: quantize a runner before compiling it, once")
        dtype = self._body.embed_tokens.weight.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"--quantize {scheme}: the LLM's dtype must be fp32 or bf16, got {dtype}")
        weights = [[_weight(p) for p in self.products(i)] for i in range(len(self._qkv))]
        head = _weight(self._lm)
        shapes = [w.shape for w in [head, *(w for layer in weights for w in layer)]]
        if self.head_ids is not None:  # a cut head is quantized too, after the products
            shapes.append(torch.Size((self.head_ids.numel(), head.shape[1])))
        for shape in shapes:
            why = quantize_mod.shape_reason(shape[0], shape[1], scheme, group)
            if why is not None:
                raise ValueError(f"--quantize {scheme}: {why}; this LLM takes int8 or no --quantize")
        layers = [[quantize_mod.QuantLinear.from_weight(w, scheme, group) for w in layer] for layer in weights]
        lm = quantize_mod.QuantLinear.from_weight(head, scheme, group)
        kinds = [list(products) for products in zip(*layers, strict=True)]
        self.quant_stacks = tuple(quantize_mod.stack(products) for products in [*kinds, [lm]])
        self._qkv, self._o, self._gate_up, self._down = kinds
        self._lm = lm
        self.quantized = scheme
        # fp32 is where token identity is promised; in bf16 a compiled graph's fusions round rows apart anyway
        self.exact_attention = scheme == "w8a8" and dtype == torch.float32
        if self.head_ids is not None:  # a drafter's head cut to a draft vocabulary: its rows quantized too
            self.restrict_head(self.head_ids)
        read = self._head if self._head is not None else lm
        return read.nbytes + sum(p.nbytes for layer in layers for p in layer)

    def restrict_head(self, head_ids: Tensor | None) -> None:
        """``ModelRunner.restrict_head``; a compiled forward is rebuilt for the new head (it compiles again at
        its first call: cut the head before compiling, ``SSMDrafter.prepare``, to compile once)."""
        super().restrict_head(head_ids)
        if self.compiled is not None:
            self.compiled = self.compiled.rebuilt(self)

    def _head_product(self, rows: Tensor) -> Product:  # type: ignore[override]
        """``ModelRunner._head_product``; a quantized runner's cut head is quantized as its whole one is."""
        lm = self._lm
        if isinstance(lm, quantize_mod.QuantLinear):
            return quantize_mod.QuantLinear.from_weight(rows, lm.scheme, lm.group)
        return super()._head_product(rows)

    def spawn(self, pool: KVPool | None = None) -> LeanRunner:
        """A runner of the same model and fused weights with an empty cache of its own (one per
        request of a batch: :func:`run_many` feeds several at once), in a slot of ``pool`` if given
        (``new_pool``: then a forward of several attends in one call per layer)."""
        other = copy.copy(self)
        other._keys, other._values, other._len, other._pool, other._slot = [], [], 0, None, -1
        if pool is not None:
            other._pool, other._slot = pool, pool.attach(other)
        return other

    def new_pool(self, slots: int) -> KVPool:
        """An empty :class:`~boosttune.serving.pooled.KVPool` of ``slots`` caches of this model."""
        return KVPool(slots, len(self._qkv), self._g, self._c, self.device)

    @torch.inference_mode()
    def _run(
        self, input_ids: Tensor, position_ids: Tensor, prefix_len: int, tree_mask: Tensor, hidden: bool
    ) -> tuple[Tensor, Tensor | None]:
        """What ``ModelRunner._run`` returns, computed layer by layer."""
        logits, states = run_many([(self, Feed(input_ids, position_ids, prefix_len, tree_mask, hidden))])[0]
        assert logits is not None
        return logits, states

    def chain_hidden(self, tokens: Tensor) -> Tensor:
        """``ModelRunner.chain_hidden`` without the LM head."""
        hidden = self._prefill(tokens, hidden=True)
        assert hidden is not None
        return hidden

    def prefill(self, tokens: Tensor) -> None:
        """``ModelRunner.prefill`` without the LM head."""
        self._prefill(tokens, hidden=False)

    def _prefill(self, tokens: Tensor, hidden: bool) -> Tensor | None:
        p, t = self.cached_len, tokens.shape[0]
        feed = Feed(tokens.unsqueeze(0), torch.arange(p, p + t).unsqueeze(0), p,
                    torch.ones(t, t, dtype=torch.bool).tril(), hidden=hidden, logits=False)
        return run_many([(self, feed)])[0][1]


    @torch.inference_mode()  # the cache was made under inference mode
    def keep(self, start: int, offsets: Tensor) -> None:
        """Keep cache entries ``start + offsets`` (moved to ``start...``) and drop the rest."""
        k = offsets.shape[0]
        moved = (offsets != torch.arange(k)).nonzero()
        if moved.numel():  # entries before the first moved one are in place already (a plain step: all)
            j = int(moved[0, 0])
            idx = (offsets[j:] + start).to(self.device)
            for cache in (*self._keys, *self._values):
                cache[:, start + j : start + k] = cache.index_select(1, idx)
        self._len = start + k

    def crop(self, length: int) -> None:
        self._len = min(self._len, length)


@dataclass(frozen=True)
class Feed:
    """What one runner is fed in a forward (the arguments of ``ModelRunner._run``).

    Attributes:
        inputs: (1, T) token ids, or (1, T, H) input embeddings.
        position_ids: (1, T) positions.
        prefix_len: P, cached positions every fed token sees.
        tree_mask: (T, S - P) bool over the positions after the prefix, S = cached length + T.
        hidden: also return the (T, H) fp32 last-layer hidden states (and the runner's ``taps``).
        logits: return the logits (False: skip the LM head for these rows, as a prefill may: for the
            135M LLM's 49,152-row head that is about a quarter of a prompt's forward).
    """

    inputs: Tensor
    position_ids: Tensor
    prefix_len: int
    tree_mask: Tensor
    hidden: bool = False
    logits: bool = True


@dataclass(frozen=True)
class _Mask:
    """One feed's attention mask, made once per forward rather than once per layer.

    Attributes:
        folded: the (rep T, S) bool mask of ``tree_attention_reference``'s head folding for the CPU
            shortcut, None where every query sees every key (no mask at all).
        raw: the feed's tree mask for ``tree_attention`` instead (no shortcut: not on the CPU, or
            rows that see no key, which ``tree_attention`` handles).
    """

    folded: Tensor | None = None
    raw: Tensor | None = None


def _mask(prefix_len: int, tree_mask: Tensor, s: int, rep: int) -> _Mask:
    """``_Mask`` of a feed; ``rep``: query heads per kv head (0: no CPU shortcut)."""
    if not rep:
        return _Mask(raw=tree_mask)
    if bool(tree_mask.all()):
        return _Mask()
    mask = full_mask(prefix_len, tree_mask, s)  # (T, S)
    if prefix_len == 0 and not bool(mask.any(dim=1).all()):
        return _Mask(raw=tree_mask)
    return _Mask(folded=mask.repeat(rep, 1))


def _attend_each(feeds: Sequence[tuple[LeanRunner, Feed]], spans: Sequence[tuple[int, int, int, int]],
                 masks: Sequence[_Mask | None], i: int, q: Tensor, k: Tensor, v: Tensor, rep: int, scale: float,
                 exact: bool = False) -> Tensor:
    """Layer ``i``'s attention feed by feed, each over its runner's own cache: writes the fed (1, G, sum T, C)
    keys ``k`` and values ``v`` and returns the (1, Q, sum T, C) output of the queries ``q`` (``exact``: each
    row alone, as ``pooled.sdpa``'s; a feed with rows that see no key attends in fp64)."""
    q_n, g_n, c = q.shape[1], k.shape[1], q.shape[3]
    outs = []
    for (runner, f), (a, b, s0, s), mask in zip(feeds, spans, masks, strict=True):
        assert mask is not None
        keys, values = runner._keys[i], runner._values[i]
        keys[:, s0:s] = k[0, :, a:b]
        values[:, s0:s] = v[0, :, a:b]
        if mask.raw is None:  # tree_attention_reference's computation, its mask made once per forward
            qg = q[:, :, a:b].reshape(1, g_n, rep * (b - a), c)  # (1, G, rep T, C)
            att = sdpa(qg, keys[None, :, :s], values[None, :, :s], mask.folded, scale, exact)
            outs.append(att.reshape(1, q_n, b - a, c))
        elif exact:
            outs.append(tree_attention(q[:, :, a:b].double(), keys[None, :, :s].double(), values[None, :, :s].double(),
                                       f.prefix_len, mask.raw, scale).to(q.dtype))
        else:
            outs.append(tree_attention(q[:, :, a:b], keys[None, :, :s], values[None, :, :s], f.prefix_len,
                                       mask.raw, scale))  # (1, Q, T, C)
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


@torch.inference_mode()
def run_many(feeds: Sequence[tuple[LeanRunner, Feed]]) -> list[tuple[Tensor | None, Tensor | None]]:
    """Feed several runners of one model (each its own request's cache) in one forward: the tokens of
    all feeds go through every matrix product together, attention reads each runner's own cache (in
    one call per layer where the runners' caches are slots of one pool, ``serving/pooled.py``).

    Per feed, returns what that runner's ``_run`` would: the (T, V) fp32 logits (None without
    ``Feed.logits``) and, with ``Feed.hidden``, the (T, H) fp32 last-layer hidden states (then the
    inputs of the runners' ``taps`` layers: (T, (1 + taps) H)). One verification forward costs about
    as much for a few tokens as for one on a CPU (weights are read once per product), so several
    requests' trees verify for little more than one's (``serving/batch.py``)."""
    first = feeds[0][0]
    if any(r.model is not first.model or r._head is not first._head or r.taps != first.taps
           or r.quantized != first.quantized for r, _ in feeds):
        raise ValueError("run_many feeds runners of one model with one LM head, the same taps and the same quantization")
    if len({id(r) for r, _ in feeds}) != len(feeds):
        raise ValueError("run_many feeds each runner once")
    dev, body = first.device, first._body
    q_rep = first._q // first._g if dev.type == "cpu" else 0  # query heads per kv head; 0: no CPU shortcut
    positions, spans = [], []
    off = 0
    for runner, f in feeds:
        t = f.inputs.shape[1]
        s = runner._len + t
        assert f.position_ids.shape == f.inputs.shape[:2], "position_ids must be (1, T)"
        assert f.tree_mask.shape == (t, s - f.prefix_len), f"tree_mask must be ({t}, {s - f.prefix_len})"
        positions.append(f.position_ids.to(dev))
        spans.append((off, off + t, runner._len, s))
        off += t
    dtype = body.embed_tokens.weight.dtype
    if all(f.inputs.dim() == 2 for _, f in feeds):  # token ids: one lookup for all feeds
        ids = torch.cat([f.inputs for _, f in feeds], dim=1) if len(feeds) > 1 else feeds[0][1].inputs
        embeds = [body.embed_tokens(ids.to(dev)).to(dtype)]  # (1, sum T, H)
    else:
        embeds = [(body.embed_tokens(f.inputs.to(dev)) if f.inputs.dim() == 2 else f.inputs.to(dev)).to(dtype)
                  for _, f in feeds]  # (1, T, H) each
    pool = shared_pool([r for r, _ in feeds]) if len(feeds) > 1 and q_rep else None
    pooled = None if pool is None else PooledStep.plan(
        pool, [(r, f.prefix_len, f.tree_mask, *span) for (r, f), span in zip(feeds, spans, strict=True)], q_rep)
    masks = [None if pooled is not None else _mask(f.prefix_len, f.tree_mask.to(dev), s, q_rep)
             for (_, f), (_, _, _, s) in zip(feeds, spans, strict=True)]
    x = torch.cat(embeds, dim=1) if len(embeds) > 1 else embeds[0]  # (1, sum T, H)
    cos, sin = body.rotary_emb(x, torch.cat(positions, dim=1) if len(positions) > 1 else positions[0])
    for (runner, _), (_, _, _, s) in zip(feeds, spans, strict=True):
        runner._reserve(s, x.dtype)
    graph = first.compiled
    # prompts into empty caches (no logits) run compiled where the runner's graphs include them, at least
    # two tokens long (dynamo specialises a size of 1)
    prompts = (graph is not None and graph.prefills and not any(f.logits for _, f in feeds)
               and all(s0 == 0 for _, _, s0, _ in spans) and max(b - a for a, b, _, _ in spans) > 1)
    if pooled is not None and graph is not None and ((prompts and pooled.starts is not None)
                                                      or all(f.logits for _, f in feeds)):
        if prompts:  # (sum T, (1 + taps) H)
            logits, hidden = None, graph.pooled_prefill(x, cos, sin, pooled)
        else:  # (sum T, V), (sum T, (1 + taps) H)
            logits, hidden = graph.pooled(x, cos, sin, pooled)
        for (runner, _), (_, _, _, s) in zip(feeds, spans, strict=True):
            runner._len = s
        return [(None if logits is None else logits[a:b], hidden[a:b] if f.hidden else None)
                for (_, f), (a, b, _, _) in zip(feeds, spans, strict=True)]
    only = feeds[0][1]
    if len(feeds) == 1 and graph is not None and masks[0].raw is None and (
            only.logits or (prompts and masks[0].folded is not None)):
        s0, s = spans[0][2], spans[0][3]
        if only.logits:
            logits, last = graph(x, cos, sin, torch.arange(s0, s, device=dev), first._keys, first._values, s,
                                 masks[0].folded)
        else:
            assert masks[0].folded is not None
            logits, last = None, graph.prefill(x, cos, sin, first._keys, first._values, masks[0].folded)
        first._len = s
        return [(logits, last if only.hidden else None)]
    q_n, g_n, c, n = first._q, first._g, first._c, x.shape[1]
    tapped: dict[int, Tensor] = {}
    for i, layer in enumerate(body.layers):
        if i in first.taps:
            tapped[i] = x[0]  # the layer's input (sum T, H)
        h = layer.input_layernorm(x)
        qkv = first._qkv[i](h)  # (1, sum T, (Q + 2G) C)
        q = qkv[..., : q_n * c].view(1, n, q_n, c).transpose(1, 2)  # (1, Q, sum T, C)
        k = qkv[..., q_n * c : (q_n + g_n) * c].view(1, n, g_n, c).transpose(1, 2)  # (1, G, sum T, C)
        v = qkv[..., (q_n + g_n) * c :].view(1, n, g_n, c).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if pooled is not None:
            att = pooled.attend(i, q, k, v, first._scale, first.exact_attention)  # (1, Q, sum T, C)
        else:
            att = _attend_each(feeds, spans, masks, i, q, k, v, q_rep, first._scale, first.exact_attention)
        x = x + first._o[i](att.transpose(1, 2).reshape(1, n, q_n * c))
        h = layer.post_attention_layernorm(x)
        gate, up = first._gate_up[i](h).chunk(2, dim=-1)
        x = x + first._down[i](F.silu(gate) * up)
    for (runner, _), (_, _, _, s) in zip(feeds, spans, strict=True):
        runner._len = s
    last = body.norm(x)[0]  # (sum T, H)
    hidden = (torch.cat([last, *(tapped[i] for i in first.taps)], -1).float()
              if any(f.hidden for _, f in feeds) else None)  # (sum T, (1 + taps) H)
    heads = [(a, b) for (_, f), (a, b, *_) in zip(feeds, spans, strict=True) if f.logits]
    if len(heads) == len(feeds):
        rows, at = last, {a: a for a, _ in heads}
    else:  # only the rows whose logits are wanted go through the LM head
        rows = torch.cat([last[a:b] for a, b in heads]) if heads else last[:0]
        at, off = {}, 0
        for a, b in heads:
            at[a], off = off, off + b - a
    logits = first._restricted_logits(rows) if first._head is not None else first._lm(rows).float()
    return [(logits[at[a] : at[a] + b - a] if f.logits else None, hidden[a:b] if f.hidden and hidden is not None else None)
            for (_, f), (a, b, _, _) in zip(feeds, spans, strict=True)]
