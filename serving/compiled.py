"""A lean forward compiled (the LLM's, and drafters'): one captured graph per kind of step instead of
~1,500 small ops.

Shape legend: T tokens fed in one forward, S cached positions after it, H hidden width, Q query
heads, G kv heads, C head dim, V vocabulary.

Why: a plain bf16 step of the 135M default LLM through :class:`~boosttune.serving.lean.LeanRunner`
took 23-25 ms on an AVX512-BF16 EPYC (2 threads), of which its 121 matrix products took ~13 ms; the
rest was the ~50 other ops per layer (norms, rotary, cache writes, attention, residuals) and the
Python around them. torch.compile's inductor fuses those ops into a few generated C++ loops per
layer: in one process, a plain step took 19.1 ms compiled against 24.6, a tree of 8 tokens 22.6
against 27.9 (docs/measurements.md, "A compiled forward").

How:
- The matrix products stay oneDNN's packed products (``cpu_linear``), which are faster here than
  what inductor generates for an unpacked weight: the very packed weights of the eager lean forward
  (fused q/k/v and gate/up included), no second copy. The graph calls them through one registered op,
  ``boosttune::packed_linear(x, key, out_features)``, that looks the packed weight up by an integer
  key. The weights thus never enter the graph: inductor's cache on disk serves a second process (the
  LLM's two graphs: ~60 s the first time, ~13 s cached), where freezing the weights into the graph
  would compile again in every process.
- A quantized runner's products (``serving/quantize.py``) are called in the graph itself: its weights,
  stacked per kind of product over the layers by ``LeanRunner.quantize`` (five tensors and their
  scales), are buffers of the module and so inputs of the graph, not constants, and the cache still
  serves the next process.
- Inductor's C++ wrapper runs the graph. Where ``serving/native.py`` could build it, the op is C++ too
  (``boosttune_native::linear``, ``serving/native_ops.cpp``): no Python runs within a step. Otherwise
  the op registered here in Python serves (~9 us a call: 1.4 ms of a bf16 step's 211 products).
- One function covers every single-request forward that wants logits: a plain step (T = 1, no
  mask) and a tree (T > 1, a tree mask). Shapes are dynamic, so the cache length and the tree size
  do not recompile; dynamo specialises T = 1 and "mask or none", so a serving process compiles
  two graphs. Several requests over a pool of caches (``serving/pooled.py``, a batched step) run a
  second pair, the same layers with the pool's attention (``CompiledForward.pooled``; with 16 requests of
  one token over 150-token caches a step took 27.6 ms against 42.6 eager, AMX Xeon, bf16:
  ``scripts/bench_step.py --batch 16 --cache 150 [--compile]``). With ``prefills`` (the LLM of a batching
  server in bf16: ``assemble.compile_served(batched=True)``) prompts into empty caches run compiled too, without the
  LM head, one graph for a single request and one over a pool: a wave of 16 MT-bench prompts (1,319 tokens in
  one forward) took 0.31-0.35 s against 0.40 eager, one prompt of 80 tokens 21 ms against 35, of 500 tokens 130
  against 172 (AMX Xeon, bf16, w8a8; through the tree graph, with the LM head, 25 and 188). Other forwards
  without logits and masks with rows that see no key run the eager lean forward; they share the same caches.
- The weights are read once, when the graph's keys are registered: a compiled forward is for a
  frozen model (a model being served), never for a model in training.

Numerics: fused elementwise ops round differently from the eager ones (bf16 rounding, or fp32
rounding in fp32). Plain decoding and speculative decoding run the same compiled forward, so the
output's exactness is unchanged: ``tests/test_compiled.py`` checks fp32 greedy identity with
transformers' incremental decoding and closeness to the eager lean runner.
"""

from __future__ import annotations

import functools
import itertools
import time
import types
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from boosttune.serving import cpu_linear, native, quantize
from boosttune.serving.lean import Feed, LeanRunner, Product, run_many
from boosttune.serving.pooled import PooledStep, pooled_attention, prompt_attention, prompts_apart, sdpa
from boosttune.serving.quantize import QuantLinear

_LIB = torch.library.Library("boosttune", "DEF")
# the output width is an argument, not only looked up: inductor's cache on disk keys a graph by its code,
# and a graph whose products differ only in their widths (a 64-row LM head against a 49,152-row one
# under the same key) would otherwise be served another model's compiled code
_LIB.define("packed_linear(Tensor x, int key, int out_features) -> Tensor")
_PRODUCTS: dict[int, tuple[int, Callable[[Tensor], Tensor]]] = {}  # key -> (out_features, the product)
_KEYS = itertools.count()


def _packed_linear(x: Tensor, key: int, out_features: int) -> Tensor:
    return _PRODUCTS[key][1](x)


_LIB.impl("packed_linear", _packed_linear, "CPU")


@torch.library.register_fake("boosttune::packed_linear")
def _packed_linear_shape(x: Tensor, key: int, out_features: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def _register(product: Product) -> tuple[int, bool]:
    """A key for ``product``, a Linear: its weight and the packed copy it multiplies with (``cpu_linear``;
    ``F.linear`` where it takes another form), the eager forward's own weights, not copies. Returns the
    key and whether the C++ op ``boosttune_native::linear`` holds it too (where ``serving/native.py``
    could build it)."""
    key = next(_KEYS)
    w = product.weight.detach()
    packed = isinstance(product, cpu_linear.CpuLinear) and product.mode == "packed"
    weight = product.packed_weight() if packed else w
    fn = (functools.partial(cpu_linear.packed_linear, packed=weight) if packed
          else functools.partial(F.linear, weight=weight))
    _PRODUCTS[key] = (w.shape[0], fn)
    if native.available():
        torch.ops.boosttune_native.put(weight, key, packed)
        return key, True
    return key, False


def _drop(keys: list[int], native_keys: frozenset[int]) -> None:
    for key in keys:
        _PRODUCTS.pop(key, None)
        if key in native_keys:
            torch.ops.boosttune_native.drop(key)


def compile_reason(runner: object) -> str | None:
    """Why ``runner``'s forward cannot be compiled (None: it can)."""
    if not isinstance(runner, LeanRunner):
        return f"the model runs through {type(runner).__name__}, not the lean forward"
    if runner.device.type != "cpu":
        return f"the model is on {runner.device}; the compiled forward is for CPUs"
    return None


class CompiledForward(torch.nn.Module):
    """The single-request forward of one :class:`LeanRunner`'s model, compiled (see the module doc).

    An ``nn.Module`` for one reason: dynamo takes the int attributes of a module (the weights' keys,
    head counts) as constants, where those of a plain object become symbols of the dynamic graph,
    which made each compile several times slower."""

    def __init__(self, runner: LeanRunner, prefills: bool = False):
        """``prefills``: prompts from an empty cache (no logits) run compiled graphs too (``prefill``)."""
        super().__init__()
        why = compile_reason(runner)
        if why is not None:
            raise ValueError(f"cannot compile this forward: {why}")
        body = runner._body
        keys: list[int] = []

        native_keys: set[int] = set()

        def reg(product: Product) -> tuple[int, int]:
            key, in_native = _register(product)
            keys.append(key)
            if in_native:
                native_keys.add(key)
            return key, _PRODUCTS[key][0]  # the op's arguments after its input

        layers = [runner.products(i) for i in range(len(body.layers))]
        head = runner._head if runner._head is not None else runner.lm_product()
        # a quantized runner's products are called in the graph itself, on its weights stacked per kind of
        # product (one input per kind: each tensor input costs guards and arguments on every call)
        self._quant: tuple[str, int] | None = None  # (scheme, group)
        self._native_int8 = False  # int8 products on boosttune_native::int8_mm (quantize.native_int8)
        self._native_w8a8 = False  # w8a8 products on boosttune_native::w8a8_mm (quantize.native_w8a8)
        self._exact = runner.exact_attention  # attention row by row (pooled.sdpa), on the native op where built
        self._native_attend = native.available()  # asked here: a compiled graph must not ask
        if runner.quantized is not None:
            first = layers[0][0]
            assert isinstance(first, QuantLinear)
            self._quant = runner.quantized, first.group
            self._native_int8 = quantize.native_int8()  # decided here: the graph holds no call to decide it
            self._native_w8a8 = quantize.native_w8a8()
            stacks = list(runner.quant_stacks)
            if isinstance(head, QuantLinear) and head is not runner.lm_product():  # a drafter's cut head
                stacks[4] = head.packed[None], head.scales[None]
            for j, (packed, scales) in enumerate(stacks):
                self.register_buffer(f"_qw{j}", packed, persistent=False)
                self.register_buffer(f"_qs{j}", scales, persistent=False)
            self._layers_keys = tuple(tuple((-1, p.out_features) for p in ly) for ly in layers)
            self._head = (-1, head.out_features)
        else:
            self._layers_keys = tuple(tuple(reg(p) for p in ly) for ly in layers)
            # a drafter's head may be restricted to a draft vocabulary: (K,) ids, their rows' logits, -inf elsewhere
            self._head = reg(head)
        self._head_ids = runner.head_ids
        self._vocab = runner.lm_product().out_features
        # the norms' weights enter the graph as one input (tensors held as constants defeat the compile
        # cache, and each tensor input adds symbols and guards)
        self._norms = torch.stack([w.detach() for ly in body.layers for w in (ly.input_layernorm.weight,
                                   ly.post_attention_layernorm.weight)] + [body.norm.weight.detach()])  # (2L + 1, H)
        self._eps = float(body.norm.variance_epsilon)
        self._q, self._g, self._c, self._scale = runner._q, runner._g, runner._c, runner._scale
        self.taps = tuple(runner.taps)  # layers whose inputs follow the last hidden states (``set_taps``)
        self._native = frozenset(native_keys)  # keys the C++ op holds
        weakref.finalize(self, _drop, keys, self._native)
        # dynamo caches graphs per code object, at most ``recompile_limit`` (8) of them, and each
        # instance needs its own two: each instance compiles a copy of ``_forward``'s code
        # inductor's C++ wrapper calls the graph's kernels without Python between them: a plain step of the
        # default LLM took 15.4 ms against 17.0 in bf16, 5.9 against 7.3 in int4 (EPYC AVX512-BF16)
        self._fn, self._pooled_fn, self._prefill_fn, self._pooled_prefill_fn = (
            torch.compile(types.MethodType(types.FunctionType(f.__code__.replace(), globals(), f.__name__), self),
                          dynamic=True, fullgraph=True, options={"cpp_wrapper": True})
            for f in (CompiledForward._forward, CompiledForward._pooled_forward, CompiledForward._prefill_forward,
                      CompiledForward._pooled_prefill_forward))
        self.prefills = prefills

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, keys: list[Tensor],
                 values: list[Tensor], length: int, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """Feed ``x`` (1, T, H) embeddings at cache ``slots`` (T,) = S - T .. S - 1 of ``keys``/``values``
        (per layer (G, capacity, C), written in place); ``cos``/``sin`` (1, T, C) their rotary
        factors, ``length`` = S, ``mask`` the (rep T, S) folded attention mask or None (every
        query sees every key). Returns the (T, V) fp32 logits and (T, H) fp32 last hidden states (then
        the inputs of the ``taps`` layers: (T, (1 + taps) H))."""
        return self._fn(x, cos, sin, slots, keys, values, length, mask, self._norms, self._head_ids)

    def rebuilt(self, runner: LeanRunner) -> CompiledForward:
        """``lean.Compiled.rebuilt``: the graph holds the LM head it was built with."""
        return CompiledForward(runner, self.prefills)

    def prefill(self, x: Tensor, cos: Tensor, sin: Tensor, keys: list[Tensor], values: list[Tensor],
                mask: Tensor) -> Tensor:
        """A prompt's forward into an empty cache without the LM head: ``x`` (1, T, H) the embeddings of
        positions 0 .. T - 1, ``mask`` their (rep T, T) folded mask (a prompt's: causal); returns the (T, H) fp32 last
        hidden states (then the ``taps``). Only from an empty cache: dynamo's graph then holds the cache
        length equal to T for good, where a graph traced with the two equal recompiles when they differ."""
        return self._prefill_fn(x, cos, sin, keys, values, mask, self._norms)

    def pooled_prefill(self, x: Tensor, cos: Tensor, sin: Tensor, step: PooledStep) -> Tensor:
        """Several requests' prompts into their empty slots of a pool, without the LM head (``prefill``,
        ``pooled``); returns the (N, H) fp32 last hidden states (then the ``taps``)."""
        pool = step.pool
        assert step.starts is not None, "a pooled prompt graph is for prompts into empty slots (PooledStep.starts)"
        return self._pooled_prefill_fn(x, cos, sin, pool.keys, pool.values, (step.write_slot, step.write_pos),
                                       (step.src, step.dst), step.mask, step.starts, self._norms)

    def pooled(self, x: Tensor, cos: Tensor, sin: Tensor, step: PooledStep) -> tuple[Tensor, Tensor]:
        """Several requests' forward over their caches' pool (``lean.run_many``): ``x`` (1, N, H) the
        embeddings of every request's tokens, ``cos``/``sin`` (1, N, C) their rotary factors, ``step``
        where each goes (``pooled.PooledStep``). Returns the (N, V) fp32 logits and (N, H) fp32 last
        hidden states (then the ``taps``), as ``forward`` does for one request."""
        pool = step.pool
        return self._pooled_fn(x, cos, sin, pool.keys, pool.values,
                               (step.write_slot, step.write_pos), (step.src, step.dst), step.mask, self._norms,
                               self._head_ids)

    def _product(self, x: Tensor, i: int, j: int, key: int, out_features: int) -> Tensor:
        """Layer ``i``'s product ``j`` (q/k/v, o, gate/up, down; j = 4: the head). A Linear's goes through the
        op that finds its weight by ``key``: the C++ one where it holds the key, else the one registered in
        Python. A quantized product (``key`` -1) calls its kernel in the graph itself, which saves a call
        back into Python per product (~1 ms of a 7.7 ms int4 step)."""
        if self._quant is None:
            if key in self._native:
                return torch.ops.boosttune_native.linear(x, key, out_features)
            return torch.ops.boosttune.packed_linear(x, key, out_features)
        scheme, group = self._quant
        packed, scales = getattr(self, f"_qw{j}")[i], getattr(self, f"_qs{j}")[i]
        flat = x.reshape(-1, x.shape[-1])  # (R, I)
        if scheme == "int8":
            out = quantize.int8_mm(flat, packed, scales, self._native_int8)
        elif scheme == "w8a8":
            out = quantize.w8a8_mm(flat, packed, scales, self._native_w8a8)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, group, scales)
        return out.view(*x.shape[:-1], out_features)

    def _rms(self, x: Tensor, weight: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self._eps)
        return weight * h.to(x.dtype)  # transformers' LlamaRMSNorm, step for step

    def _forward(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, keys: list[Tensor],
                 values: list[Tensor], length: int, mask: Tensor | None, norms: Tensor,
                 head_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        q_n, g_n, c = self._q, self._g, self._c
        t = x.shape[1]

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            keys[i].index_copy_(1, slots, k[0])
            values[i].index_copy_(1, slots, v[0])
            qg = q.reshape(1, g_n, (q_n // g_n) * t, c)  # heads folded per kv head, as lean.py folds them
            att = sdpa(qg, keys[i][None, :, :length], values[i][None, :, :length], mask, self._scale, self._exact, self._native_attend)
            return att.reshape(1, q_n, t, c)

        return self._layers(x, cos, sin, norms, head_ids, attend)

    def _prefill_forward(self, x: Tensor, cos: Tensor, sin: Tensor, keys: list[Tensor], values: list[Tensor],
                         mask: Tensor, norms: Tensor) -> Tensor:
        q_n, g_n, c = self._q, self._g, self._c
        t = x.shape[1]

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            keys[i][:, :t] = k[0]
            values[i][:, :t] = v[0]
            qg = q.reshape(1, g_n, (q_n // g_n) * t, c)
            att = sdpa(qg, keys[i][None, :, :t], values[i][None, :, :t], mask, self._scale, self._exact,
                       self._native_attend)
            return att.reshape(1, q_n, t, c)

        return self._layers(x, cos, sin, norms, None, attend, head=False)[1]

    def _pooled_prefill_forward(self, x: Tensor, cos: Tensor, sin: Tensor, keys: list[Tensor], values: list[Tensor],
                                writes: tuple[Tensor, Tensor], rows: tuple[Tensor, Tensor], mask: Tensor,
                                starts: Tensor, norms: Tensor) -> Tensor:
        apart = prompts_apart(x, self._exact, self._native_attend)  # decided when traced: x's dtype is guarded

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if apart:
                return prompt_attention(keys[i], values[i], q, k, v, writes, starts, self._scale)
            return pooled_attention(keys[i], values[i], q, k, v, writes, rows, mask, self._scale, self._exact,
                                    self._native_attend)

        return self._layers(x, cos, sin, norms, None, attend, head=False)[1]

    def _pooled_forward(self, x: Tensor, cos: Tensor, sin: Tensor, keys: list[Tensor], values: list[Tensor],
                        writes: tuple[Tensor, Tensor], rows: tuple[Tensor, Tensor],
                        mask: Tensor, norms: Tensor, head_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return pooled_attention(keys[i], values[i], q, k, v, writes, rows, mask, self._scale, self._exact, self._native_attend)

        return self._layers(x, cos, sin, norms, head_ids, attend)

    def _layers(self, x: Tensor, cos: Tensor, sin: Tensor, norms: Tensor, head_ids: Tensor | None,
                attend: Callable[[int, Tensor, Tensor, Tensor], Tensor], head: bool = True) -> tuple[Tensor | None, Tensor]:
        """The forward of (1, T, H) embeddings ``x`` through every layer, ``attend(i, q, k, v)`` giving layer
        ``i``'s (1, Q, T, C) attention output (and writing its cache); the logits are None without ``head``."""
        q_n, g_n, c = self._q, self._g, self._c
        t = x.shape[1]
        half = c // 2
        cos4 = cos.unsqueeze(2)  # (1, T, 1, C)
        # rotate_half(v) * sin == roll(v, C/2) * (sin with its first half negated): one op for q and k
        sign = torch.cat([-torch.ones(half, dtype=sin.dtype, device=sin.device),
                          torch.ones(half, dtype=sin.dtype, device=sin.device)])
        sin4 = (sin * sign).unsqueeze(2)
        op = self._product
        tapped: dict[int, Tensor] = {}
        for i, (qkv_key, o_key, gate_up_key, down_key) in enumerate(self._layers_keys):
            if i in self.taps:
                tapped[i] = x[0]  # the layer's input (T, H)
            qkv = op(self._rms(x, norms[2 * i]), i, 0, *qkv_key)  # (1, T, (Q + 2G) C)
            qk = qkv[..., : (q_n + g_n) * c].view(1, t, q_n + g_n, c)
            qk = qk * cos4 + qk.roll(half, -1) * sin4
            q = qk[:, :, :q_n].transpose(1, 2)  # (1, Q, T, C)
            k = qk[:, :, q_n:].transpose(1, 2)  # (1, G, T, C)
            v = qkv[..., (q_n + g_n) * c :].view(1, t, g_n, c).transpose(1, 2)
            att = attend(i, q, k, v)
            x = x + op(att.transpose(1, 2).reshape(1, t, q_n * c), i, 1, *o_key)
            gate, up = op(self._rms(x, norms[2 * i + 1]), i, 2, *gate_up_key).chunk(2, dim=-1)
            x = x + op(F.silu(gate) * up, i, 3, *down_key)
        last = self._rms(x, norms[-1])[0]  # (T, H)
        hidden = torch.cat([last, *(tapped[i] for i in self.taps)], -1) if self.taps else last
        if not head:
            return None, hidden.float()
        logits = op(last, 0, 4, *self._head).float()  # (T, V), or (T, K) over a draft vocabulary
        if head_ids is not None:  # ModelRunner._restricted_logits
            logits = logits.new_full((t, self._vocab), float("-inf")).index_copy(1, head_ids, logits)
        return logits, hidden.float()


def compile_runner(runner: LeanRunner, warm_up: bool = True, pooled: bool = False, prefills: bool = False) -> float:
    """Give ``runner`` (the LLM's, or a drafter's) and the runners it spawns later the compiled forward;
    with ``warm_up``, compile its two graphs now (a plain step and a tree) on a scratch runner, and with
    ``pooled`` too the two graphs of several requests over a pool (a server that batches). ``prefills``:
    prompts run compiled too (``CompiledForward.prefill``; one graph more, two with ``pooled``). Returns
    the seconds spent."""
    start = time.perf_counter()
    runner.compiled = CompiledForward(runner, prefills)
    if warm_up:
        scratch = runner.spawn()
        scratch.prefill(torch.arange(1, 38))  # 37 tokens: a size no model constant shares (see _warm_up_pooled)
        for t in (1, 2):  # a plain step, then a tree of two nodes under the root
            p = scratch.cached_len
            scratch.forward(torch.ones(1, t, dtype=torch.long), torch.full((1, t), p), p,
                            torch.eye(t, dtype=torch.bool))
        if pooled:
            _warm_up_pooled(runner, prefills)
    return time.perf_counter() - start


def _warm_up_pooled(runner: LeanRunner, prefills: bool) -> None:
    """Compile the pooled graphs: a plain step and trees of several requests (with ``prefills``, first
    their prompts). Dynamo gives sizes that are equal when it first traces one symbol ("duck sizing"),
    and a graph traced with two sizes equal recompiles when they differ; a size equal to a model
    constant (a head dim of 8) is specialised for good. So the sizes here differ from each other and
    from common model sizes: 10 requests in slots 0-10 of a 13-slot pool, prompts of 5 tokens and one of
    12 (57 in all; a prompt's graph holds its longest prompt equal to the cache length, as it always
    is from empty caches), then trees of 2 and 5 tokens (23 in all), 38-43 cached positions."""
    pool = runner.new_pool(13)
    scratch = [runner.spawn(pool) for _ in range(11)]
    feeding = [r for j, r in enumerate(scratch) if j != 4]
    if prefills:
        feeds = []
        for j, r in enumerate(feeding):
            t = 12 if j == 9 else 5
            feeds.append((r, Feed(torch.arange(1, t + 1).unsqueeze(0), torch.arange(t).unsqueeze(0), 0,
                                  torch.ones(t, t, dtype=torch.bool).tril(), logits=False)))
        run_many(feeds)
        for r in feeding:
            r.reset()
    for r in feeding:
        r.prefill(torch.arange(1, 38))
    for sizes in ([1] * 10, [2] * 9 + [5]):
        feeds = []
        for r, t in zip(feeding, sizes, strict=True):
            p = r.cached_len
            feeds.append((r, Feed(torch.ones(1, t, dtype=torch.long), torch.full((1, t), p), p,
                                  torch.ones(t, t, dtype=torch.bool).tril())))
        run_many(feeds)
