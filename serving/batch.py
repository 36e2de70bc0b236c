"""Continuous batching: several requests decode at once, one LLM forward verifying all their trees per step.

Shape legend: B requests in the batch, N_b the merged tree nodes of request b, V vocabulary.

On a CPU one verification forward costs about as much for a few tokens as for one (the weights are
read once per product): measured on an AVX512-bf16 EPYC (2 cores, bf16, the 135M LLM) about 25 ms
for 1 token, 33 for 16 and 44 for 32. So a step that feeds every active request's pending token and
tree through one forward (``lean.run_many``: the products over all B requests' tokens at once, one
attention call per layer over the requests' caches in one pool) commits tokens for B requests for little
more than one's cost. Orca (Yu et al., OSDI 2022) schedules at this granularity, "iteration-level scheduling":
requests join and leave the batch between steps, and vLLM, SGLang and llama-server batch so too.

Each request is a :class:`~boosttune.serving.engine.Stream` with caches of its own: an LLM runner
and a set of drafters spawned from the engine's (same weights, ``LeanRunner.spawn``,
``Drafter.spawn``), taken from a pool and given back when the request leaves, so their buffers are
reused. The LLM caches are slots of one pool (``serving/pooled.py``), so that a step's attention is
one call per layer for all requests. Requests that join at once prefill in one forward (``add_many``):
with 16 clients whose requests start and end together, 16 prefills one after another stalled every
other request for their sum. From then on a request steps with the others.
Each request verifies its own tree against its own rows of the shared forward with its own sampling
generator, so its output is what it would be alone: in fp32 token-identical for greedy decoding
(``tests/test_batch.py``), and from the same distribution when sampled.

Drafting stays per request (each drafter walks its own cache), so it pays only in small batches:
above ``draft_max_batch`` requests every step is a plain one (``DRAFT_MAX_BATCH``). What a step
verifies is also capped by ``max_tokens``: requests draft in turn, starting one further each step; once a full tree no longer
fits, a greedy request's tree is cut to its first nodes (nodes are in topological order, so any
prefix of them is a tree, and greedy verification accepts from any tree); a sampled request's tree
stays whole (the cap is soft there: cutting would be exact too, but its draws would then differ from
the request's alone). Requests after the budget is spent take a step without drafting (their pending
token only), which every request can always afford.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from boosttune.serving.drafter import Drafter
from boosttune.serving.engine import Opening, Planner, SpeculativeEngine, Stream, TokenCallback
from boosttune.serving.lean import Feed, LeanRunner, run_many
from boosttune.serving.sampling import SamplingParams
from boosttune.serving.stops import StopCriteria

DRAFT_MAX_BATCH = 2
"""Requests draft only while the batch holds at most this many. Drafting stays per request, so its cost
grows with the batch while a plain step's barely does: measured on an AVX512-bf16 EPYC (2 cores, bf16,
MT-bench first turns, 64 tokens, the demo bundle's feature head and prompt lookup), speculation gave
72 against 67 tok/s for 2 requests, but 83 against 96 for 3, 93 against 117 for 4 and 121 against 186
for 16 (``scripts/bench_server.py`` has the served figures). vLLM turns speculation off above a batch
size in the same way (its ``speculative_disable_by_batch_size``)."""

PREFILL_TOKENS = 2048
"""Prompt tokens that requests joining at once prefill in one forward (``BatchedDecoder.add_many``). A forward
of more rows reads the weights fewer times, and the padding of the pooled attention costs less than that:
16 MT-bench prompts (1,319 tokens, 52-138 each) took 0.61 / 0.56 / 0.47 s in forwards of up to 512 / 1,024
/ 2,048 tokens compiled, 0.88 / 0.78 / 0.68 s eager (AMX Xeon, 2 threads, bf16, w8a8)."""


def batch_reason(engine: SpeculativeEngine) -> str | None:
    """Why ``engine`` cannot decode several requests at once (None: it can)."""
    if not isinstance(engine.llm, LeanRunner):
        return (f"its LLM runs through {type(engine.llm).__name__}, and only the lean llama forward "
                "(serving/lean.py) feeds several requests at once")
    return None


@dataclass
class Request:
    """A request to add (``BatchedDecoder.add``'s arguments)."""

    prompt_ids: Sequence[int]
    stop: StopCriteria
    sampling: SamplingParams | None = None
    on_tokens: TokenCallback | None = None
    planner: Planner | None = None
    tag: object = None


def _prefill_feed(o: Opening) -> Feed:
    """The prefill of ``o``'s prompt (all but its pending token) as a feed of its runner."""
    t = o.prefix.numel()
    return Feed(o.prefix.unsqueeze(0), torch.arange(t).unsqueeze(0), 0, torch.ones(t, t, dtype=torch.bool).tril(),
                hidden=o.wants_hidden, logits=False)


def _groups(sizes: Sequence[tuple[int, int]], cap: int) -> list[set[int]]:
    """Requests ``(index, prompt tokens)`` with a prompt, in order, grouped so that a group's tokens stay
    within ``cap`` (a larger prompt alone)."""
    groups: list[set[int]] = []
    total = cap + 1
    for j, n in sizes:
        if n == 0:
            continue
        if total + n > cap:
            groups.append(set())
            total = 0
        groups[-1].add(j)
        total += n
    return groups


@dataclass
class Member:
    """One request in the batch.

    Attributes:
        stream: the request's decoding state.
        caches: its LLM runner and drafters (returned to the pool when it leaves).
        error: what failed it (None: still running or finished normally).
    """

    stream: Stream
    caches: tuple[LeanRunner, dict[str, Drafter]]
    error: BaseException | None = None
    tag: object = field(default=None)


class BatchedDecoder:
    """Decodes up to ``max_batch`` requests at once over one engine's LLM and drafters."""

    def __init__(self, engine: SpeculativeEngine, max_batch: int = 16, max_tokens: int = 64,
                 draft_max_batch: int = DRAFT_MAX_BATCH, prefill_tokens: int = PREFILL_TOKENS):
        """``max_batch``: requests decoding at once; ``max_tokens``: tokens one step may verify in all
        (each request's pending token counts, so at least ``max_batch``); ``draft_max_batch``: requests
        draft only while the batch holds at most this many (0: never); ``prefill_tokens``: prompt tokens
        that joining requests prefill in one forward (``add_many``)."""
        why = batch_reason(engine)
        if why is not None:
            raise ValueError(f"this engine cannot batch requests: {why}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_tokens < max_batch:
            raise ValueError(f"max_tokens ({max_tokens}) must be at least max_batch ({max_batch}): every request "
                             "feeds its pending token each step")
        if draft_max_batch < 0:
            raise ValueError(f"draft_max_batch must be >= 0, got {draft_max_batch}")
        if prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        self.engine, self.max_batch, self.max_tokens = engine, max_batch, max_tokens
        self.draft_max_batch, self.prefill_tokens = draft_max_batch, prefill_tokens
        self.members: list[Member] = []
        self._pool: list[tuple[LeanRunner, dict[str, Drafter]]] = []
        llm = engine.llm
        assert isinstance(llm, LeanRunner)
        self._kv = llm.new_pool(max_batch)  # every request's LLM cache, a slot each (``serving/pooled.py``)
        self._turn = 0  # which member drafts first this step

    def __len__(self) -> int:
        return len(self.members)

    @property
    def full(self) -> bool:
        return len(self.members) >= self.max_batch

    def _caches(self) -> tuple[LeanRunner, dict[str, Drafter]]:
        if self._pool:
            return self._pool.pop()
        llm = self.engine.llm
        assert isinstance(llm, LeanRunner)
        memo: dict[int, object] = {}
        return llm.spawn(self._kv), {name: d.spawn(memo) for name, d in self.engine.drafters.items()}

    def add(
        self, prompt_ids: Sequence[int], stop: StopCriteria, sampling: SamplingParams | None = None,
        on_tokens: TokenCallback | None = None, *, planner: Planner | None = None, tag: object = None,
    ) -> Member:
        """Prefill a request and add it to the batch (``SpeculativeEngine.generate``'s arguments;
        ``tag``: the caller's handle, kept on the member). Raises what its prefill raised."""
        out = self.add_many([Request(prompt_ids, stop, sampling, on_tokens, planner, tag)])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    @torch.inference_mode()
    def add_many(self, requests: Sequence[Request]) -> list[Member | Exception]:
        """Prefill ``requests`` and add them to the batch; per request, its member or what failed it
        (a failed request is not added; the others are). Their prompts are prefilled together, one
        forward per ``prefill_tokens`` prompt tokens (a prompt longer than that alone): on a CPU a
        forward of many tokens costs less than the same tokens in several forwards."""
        if len(self.members) + len(requests) > self.max_batch:
            raise RuntimeError(f"the batch holds {len(self.members)} of {self.max_batch} requests: "
                               f"{len(requests)} more do not fit")
        out: list[Member | Exception | None] = [None] * len(requests)
        openings: list[tuple[int, Opening, tuple[LeanRunner, dict[str, Drafter]]]] = []
        for j, r in enumerate(requests):
            caches = self._caches()
            try:
                openings.append((j, self.engine.begin(r.prompt_ids, r.stop, r.sampling, r.on_tokens,
                                                      planner=r.planner, llm=caches[0], drafters=caches[1]), caches))
            except Exception as e:
                self._pool.append(caches)
                out[j] = e
        hidden: dict[int, Tensor | None] = {}
        for group in _groups([(j, o.prefix.numel()) for j, o, _ in openings], self.prefill_tokens):
            feeds = [(o.llm, _prefill_feed(o)) for j, o, _ in openings if j in group]
            try:
                outs = run_many(feeds) if feeds else []
            except Exception as e:  # the shared prefill failed: every request in it fails
                for j in group:
                    out[j] = e
                continue
            hidden.update(zip(sorted(group), (h for _, h in outs), strict=True))
        for j, o, caches in openings:
            if out[j] is None:
                try:
                    member = Member(self.engine.opened(o, hidden.get(j)), caches, tag=requests[j].tag)
                except Exception as e:
                    out[j] = e
                else:
                    self.members.append(member)
                    out[j] = member
                    continue
            self._pool.append(caches)
        assert all(m is not None for m in out)
        return out  # type: ignore[return-value]

    def remove(self, member: Member) -> None:
        """Take ``member`` out of the batch (finished, failed or cancelled)."""
        self.members.remove(member)
        self._pool.append(member.caches)
        self._kv.shrink(max((m.caches[0].cached_len for m in self.members), default=0))

    @torch.inference_mode()
    def step(self) -> list[Member]:
        """One step for every request in the batch; returns the members that left it (finished, or
        failed: ``Member.error``), already removed."""
        if not self.members:
            return []
        n = len(self.members)
        order = [self.members[(self._turn + i) % n] for i in range(n)]
        self._turn = (self._turn + 1) % max(1, n)
        budget = self.max_tokens - n if n <= self.draft_max_batch else 0  # tokens left for trees
        feeds: dict[int, tuple[LeanRunner, Feed]] = {}
        for m in order:
            try:
                feeds[id(m)] = (m.caches[0], self._draft(m.stream, budget))
                budget -= feeds[id(m)][1].inputs.shape[1] - 1
            except Exception as e:  # one request's failure leaves the others decoding
                m.error = e
        live = [m for m in self.members if m.error is None]
        if live:
            t0 = time.perf_counter()
            outs = run_many([feeds[id(m)] for m in live])
            verify_s = time.perf_counter() - t0
            for m, (logits, hidden) in zip(live, outs, strict=True):
                assert logits is not None
                try:
                    m.stream.commit(logits, hidden, verify_s)
                except Exception as e:
                    m.error = e
        left = [m for m in self.members if m.error is not None or m.stream.finished]
        for m in left:
            self.remove(m)
        return left

    def _draft(self, stream: Stream, budget: int) -> Feed:
        """``stream``'s feed for this step, its tree cut to ``budget`` nodes where that keeps it exact."""
        if budget <= 0:
            ids, pos, prefix_len, mask = stream.draft(drafting=False)
        else:
            ids, pos, prefix_len, mask = stream.draft()
            if ids.shape[1] - 1 > budget and stream.sampling.greedy:
                ids, pos, prefix_len, mask = stream.cut(budget)
        return Feed(ids, pos, prefix_len, mask, hidden=stream.wants_hidden)
