"""Several requests' key/value caches in shared tensors, so that a batched step attends in one call per layer.

Shape legend: R slots (requests a pool can hold), G kv heads, K capacity (positions per slot), C head dim,
Q query heads (``rep`` = Q / G per kv head), N tokens fed in one forward over all requests, T_b those of
request b, Tm the most any request feeds, Sm the longest cache after the forward.

A batched step (``lean.run_many``) computes the products over every request's tokens at once, but with a
cache per request its attention is a loop: per layer and request, two cache writes and one attention
call. For 16 requests of one token each that is 480 attention calls and 960 writes a step, measured on an
AMX Xeon (2 cores, bf16, the 135M LLM, caches of 60-160 tokens) at 12 ms of attention calls and ~13 ms
of small ops around them in a 47 ms step whose products took 17.

:class:`KVPool` keeps every layer's keys and values of R requests in one (R, G, K, C) tensor per layer;
each runner's cache is its slot's view, so the single-request paths (``keep``, ``crop``, the compiled
forward) see a cache like any other. :class:`PooledStep` then writes a forward's new keys with one
indexed copy per layer and attends with one ``scaled_dot_product_attention`` over the slots: each
request's queries padded to Tm rows, its keys padded to Sm by the mask. The padding is masked out, so
each row sees exactly what it sees alone. The capacity K is the same for all slots (the longest
request's, grown by doubling, and given back when it leaves): R times the longest request's cache, where
separate caches would hold the sum of their lengths. A paged cache (vLLM's PagedAttention, Kwon et al., SOSP 2023) avoids that
cost; on a CPU serving a handful of requests of a few thousand tokens it is tens of MB per slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from boosttune.kernels.tree_attention import full_mask
from boosttune.serving import native


class LeanRunner(Protocol):
    """What this module reads and sets of a ``lean.LeanRunner`` (named here: lean.py imports this module)."""

    _keys: list[Tensor]
    _values: list[Tensor]
    _pool: KVPool | None
    _slot: int


class KVPool:
    """Key/value caches of up to ``slots`` runners of one model, one slot each, in shared tensors."""

    def __init__(self, slots: int, layers: int, groups: int, head_dim: int, device: torch.device):
        if slots < 1:
            raise ValueError(f"a KVPool needs at least one slot, got {slots}")
        self.slots, self.layers, self.groups, self.head_dim, self.device = slots, layers, groups, head_dim, device
        self.keys: list[Tensor] = []  # per layer (R, G, K, C)
        self.values: list[Tensor] = []
        self.users: list[LeanRunner] = []  # the runner of each slot taken so far, by slot

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def attach(self, runner: LeanRunner) -> int:
        """Give ``runner`` the next free slot (its cache becomes that slot's views); returns the slot."""
        if len(self.users) >= self.slots:
            raise RuntimeError(f"the KVPool's {self.slots} slots are all taken")
        self.users.append(runner)
        self._point(len(self.users) - 1)
        return len(self.users) - 1

    def _point(self, slot: int) -> None:
        runner = self.users[slot]
        runner._keys = [k[slot] for k in self.keys]
        runner._values = [v[slot] for v in self.values]

    def reserve(self, n: int, dtype: torch.dtype) -> None:
        """Room for ``n`` positions in every slot, in ``dtype`` (doubling; contents kept). New room is
        zeroed: masked positions must hold finite numbers, or the attention's masked sums turn NaN. The
        capacity stays above ``n``: a compiled graph traced with caches shorter than their tensors would
        compile again (~60 s) for a step whose cache fills one exactly."""
        cap = self.capacity
        if self.keys and n < cap and self.keys[0].dtype == dtype:
            return
        new_cap = max(n + 1, 2 * cap, 256)
        shape = (self.slots, self.groups, new_cap, self.head_dim)
        keys = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(self.layers)]
        values = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(self.layers)]
        if self.keys:
            for old, new in zip(self.keys + self.values, keys + values, strict=True):
                new[:, :, :cap] = old
        self.keys, self.values = keys, values
        for slot in range(len(self.users)):
            self._point(slot)

    def shrink(self, n: int) -> None:
        """Give back the room beyond ``n`` positions (at least 256) where the pool holds more than twice
        that: after a long request leaves, the others should not keep its capacity."""
        keep = max(n + 1, 256)
        if self.capacity <= 2 * keep:
            return
        self.keys = [k[:, :, :keep].clone() for k in self.keys]
        self.values = [v[:, :, :keep].clone() for v in self.values]
        for slot in range(len(self.users)):
            self._point(slot)


class PooledStep:
    """One batched forward's attention over a pool: the index and mask tensors, made once per forward
    and used by every layer (``plan``)."""

    def __init__(self, pool: KVPool, writes: tuple[Tensor, Tensor], rows: tuple[Tensor, Tensor],
                 mask: Tensor, starts: Tensor | None = None):
        """``writes``: the (N,) slot and position of each fed token; ``rows``: the (width Tm,) fed row of
        each padded query row and the (N,) padded row of each fed row; ``mask``: (width, 1, rep Tm, Sm)
        bool. The step attends over slots 0 .. width - 1, idle ones included (their rows padding): one
        shape fewer for the compiled graph, and a batch's requests hold the first slots. ``starts``: where
        every request feeds a prompt into an empty slot with a causal mask, the (B + 1,) first fed row of
        each and N (``prompt_attention``); None otherwise."""
        self.pool = pool
        self.write_slot, self.write_pos = writes
        self.src, self.dst = rows
        self.mask = mask
        self.starts = starts

    @property
    def width(self) -> int:
        """Slots attended: 0 .. width - 1."""
        return self.mask.shape[0]

    @classmethod
    def plan(cls, pool: KVPool, feeds: Sequence[tuple[LeanRunner, int, Tensor, int, int, int, int]],
             rep: int) -> PooledStep | None:
        """The step for ``feeds``: per request in feed order, its runner (in a slot of ``pool``), prefix
        length P, (T_b, S_b - P) tree mask, first and end row among the N fed, and cache length before
        and after the forward. None where some row would see no key (``tree_attention`` handles those)."""
        slots = [r._slot for r, *_ in feeds]
        width = max(slots) + 1
        tm, sm = max(b - a for *_, a, b, _, _ in feeds), max(s for *_, s in feeds)
        write_slot: list[int] = []
        write_pos: list[int] = []
        dst: list[int] = []
        src = torch.zeros(width * tm, dtype=torch.long)
        mask = torch.zeros(width, tm, sm, dtype=torch.bool)
        mask[:, :, 0] = True  # padding rows see one key (their output is dropped)
        for (_, prefix_len, tree_mask, a, b, s0, s), slot in zip(feeds, slots, strict=True):
            full = full_mask(prefix_len, tree_mask.cpu(), s)  # (T_b, S_b)
            if prefix_len == 0 and not bool(full.any(dim=1).all()):
                return None
            j, t = slot * tm, b - a
            write_slot += [slot] * t
            write_pos += range(s0, s)
            src[j : j + t] = torch.arange(a, b)
            dst += range(j, j + t)
            mask[slot, :t, :s] = full
        dev = pool.device
        prompts = all(s0 == 0 and prefix_len == 0 and torch.equal(tree_mask.cpu(), torch.ones(b - a, b - a, dtype=torch.bool).tril())
                      for _, prefix_len, tree_mask, a, b, s0, _ in feeds)
        starts = torch.tensor([a for *_, a, _, _, _ in feeds] + [feeds[-1][4]], device=dev) if prompts else None
        return cls(pool, (torch.tensor(write_slot, device=dev), torch.tensor(write_pos, device=dev)),
                   (src.to(dev), torch.tensor(dst, device=dev)), mask.to(dev).repeat(1, rep, 1).unsqueeze(1), starts)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float, exact: bool = False) -> Tensor:
        """Write the fed (1, G, N, C) keys ``k`` and values ``v`` into their slots of ``layer`` and attend
        with the (1, Q, N, C) queries ``q`` (``exact``: as ``sdpa``'s); returns (1, Q, N, C)."""
        keys, values, writes = self.pool.keys[layer], self.pool.values[layer], (self.write_slot, self.write_pos)
        if self.starts is not None and prompts_apart(q, exact):
            return prompt_attention(keys, values, q, k, v, writes, self.starts, scale)
        return pooled_attention(keys, values, q, k, v, writes, (self.src, self.dst), self.mask, scale, exact)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, exact: bool = False,
         native_ok: bool | None = None, batched: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention``; ``exact``: each query row computed alone, bit for bit the same
    whatever rows share the call (``boosttune_native::attend_rows``, or in fp64 where it is not built).
    ``batched`` (a pooled step of several requests) in bf16 on the CPU attends through
    ``boosttune_native::attend`` where built: the same row kernel for up to 9 query rows per kv head (it reads only the keys a row sees, once for a token's heads), torch's
    flash attention for more. 16 one-token requests with caches of 200 positions, each layer's caches out
    of the CPU's caches as in a real step: ~200 µs a layer against ~360 with torch's, which reads every
    slot up to the longest and packs it each call (AMX Xeon, 2 threads; docs/measurements.md, "Serving
    many clients at once"). One request keeps torch's attention: through ``attend`` its trees verified
    slower on MT-bench 1-30 (the bundle 1.21x plain against 1.35x). fp32 keeps torch's attention too: a
    plain step and a tree's verification compute alike enough there that fp32 greedy output stays identical.

    torch's attention sums a row in an order that depends on the other query rows fed with it and on where
    its keys lie in the cache (a tree's nodes sit at scattered slots), so a tree's row and a plain step's
    differ in the last bit. Weight-only products keep that a last-bit difference; w8a8's input quantizer
    can turn it into other codes for a whole block, so the w8a8 LLM's output would depend on how its
    tokens were fed (a prompt fed at once and token by token gave logits 2.7 apart on SmolLM2-135M in fp32).
    ``attend_rows`` sums each row over its visible keys in the order of their positions, so every product's
    input is what a plain step computes and fp32 speculation stays token-identical.
    ``LeanRunner.quantize("w8a8")`` turns it on in fp32. ``native_ok``: whether the native ops are built,
    passed where it must not be asked (a compiled graph); None asks."""
    fast = batched and q.dtype == torch.bfloat16 and q.device.type == "cpu"
    if exact or fast:
        if native_ok is None:
            native_ok = native.available()
        if native_ok:
            op = torch.ops.boosttune_native.attend_rows if exact else torch.ops.boosttune_native.attend
            return op(q, k, v, mask, scale)
        if exact:
            return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                  scale=scale).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def pooled_attention(keys: Tensor, values: Tensor, q: Tensor, k: Tensor, v: Tensor, writes: tuple[Tensor, Tensor],
                     rows: tuple[Tensor, Tensor], mask: Tensor, scale: float, exact: bool = False,
                     native_ok: bool | None = None) -> Tensor:
    """One layer's attention over a pool (``PooledStep``'s tensors; the compiled graph calls it too): writes
    the fed (1, G, N, C) keys ``k`` and values ``v`` into the layer's (R, G, K, C) ``keys``/``values`` and
    attends with the (1, Q, N, C) queries ``q``. Sizes come from tensors, so that a compiled graph keeps
    them symbolic. ``exact``, ``native_ok``: as ``sdpa``'s. Returns (1, Q, N, C)."""
    src, dst = rows
    qn, g, c = q.shape[1], k.shape[1], q.shape[3]
    width, rep = mask.shape[0], qn // g
    tm, sm = mask.shape[2] // rep, mask.shape[3]
    _write(keys, values, k, v, writes)
    qp = q[0].index_select(1, src).view(qn, width, tm, c).transpose(0, 1)  # (width, Q, Tm, C)
    att = sdpa(qp.reshape(width, g, rep * tm, c), keys[:width, :, :sm], values[:width, :, :sm], mask, scale, exact,
               native_ok, batched=True)
    att = att.reshape(width, qn, tm, c).transpose(0, 1).reshape(qn, width * tm, c)
    return att.index_select(1, dst).unsqueeze(0)


def prompts_apart(q: Tensor, exact: bool, native_ok: bool | None = None) -> bool:
    """Whether prompts fed into empty slots attend each over its own rows (``prompt_attention``): in bf16 on
    the CPU where the native ops are built, as ``sdpa``'s ``batched`` path (fp32 keeps the pooled attention,
    whose numerics the one-at-a-time path shares; ``native_ok`` as there)."""
    if exact or q.dtype != torch.bfloat16 or q.device.type != "cpu":
        return False
    return native.available() if native_ok is None else native_ok


def prompt_attention(keys: Tensor, values: Tensor, q: Tensor, k: Tensor, v: Tensor, writes: tuple[Tensor, Tensor],
                     starts: Tensor, scale: float) -> Tensor:
    """One layer's attention of prompts fed into empty slots (``PooledStep.starts``): writes the fed keys and
    values as ``pooled_attention`` does, then each request's rows attend causally over its own fed keys
    (``boosttune_native::attend_prompts``), where the pooled attention pads every request to the longest
    prompt and reads it back from the slots. 16 MT-bench prompts of 52-138 tokens: 16 x 138 padded rows
    where they hold 1,319. Returns (1, Q, N, C)."""
    _write(keys, values, k, v, writes)
    return torch.ops.boosttune_native.attend_prompts(q, k, v, starts, scale)


def _write(keys: Tensor, values: Tensor, k: Tensor, v: Tensor, writes: tuple[Tensor, Tensor]) -> None:
    """The fed (1, G, N, C) keys ``k`` and values ``v`` into their (slot, position) ``writes`` of a layer's
    (R, G, K, C) ``keys``/``values``."""
    write_slot, write_pos = writes
    keys[write_slot, :, write_pos] = k[0].transpose(0, 1)  # (N, G, C)
    values[write_slot, :, write_pos] = v[0].transpose(0, 1)


def shared_pool(runners: Sequence[LeanRunner]) -> KVPool | None:
    """The pool all ``runners`` have their caches in (None: they do not share one)."""
    pool = runners[0]._pool
    return pool if pool is not None and all(r._pool is pool for r in runners) else None
