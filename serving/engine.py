"""The speculative engine: draft trees, verify them in one LLM forward, commit, compact caches.

Shape legend: T committed tokens, N merged tree nodes, V vocabulary, H the LLM's hidden size.

Glossary (p = the LLM's distribution, q = a drafter's):
- *drafter*: proposes a token tree for the committed text (``drafter.py``: an SSM; ``lookup.py``:
  prompt lookup; ``feature_drafter.py``: a feature head, which also reads the LLM's last hidden
  states: the engine then keeps them from the prefill and every verification forward and hands
  those of each newly committed position to the drafter's ``observe``). The engine holds its drafters by name; a drafter keeps its KV cache between the
  steps of a request but no configuration: its tree comes with every ``draft`` call.
- *plan* (``Plan``): the drafters one request drafts with, each with its tree. The engine has a
  default plan; a request may bring its own, or a *planner* chooses one from the LLM's prefill
  hidden states (the learned scheduler, ``scheduler/policy.py``).
- *step*: one LLM forward that verifies the merged tree and commits the accepted path plus the
  LLM's own next token (the bonus token).

One step:
1. every drafter of the plan proposes a tree rooted at the pending token (the last committed one,
   which is not yet in the LLM's cache); the trees are merged (common prefixes shared for greedy);
2. the LLM feeds ``[pending] + nodes`` in ONE forward with tree attention (positions are the
   prefix length plus depth);
3. greedy or stochastic verification picks the accepted path and the LLM's bonus token;
4. the LLM's cache keeps the pending token and the accepted path (gathered into place), each
   drafter keeps what it fed of that path; the bonus token becomes the next pending token.

τ (accepted tokens per step) counts the bonus, so plain decoding has τ = 1 (Spec-Bench).
``record=True`` logs per-step timings and, for greedy decoding, every drafter's counterfactual
accepted length (full-information labels: one verification scores every branch at once).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from boosttune.serving.builders import merge_trees, subtree
from boosttune.serving.drafter import Drafter
from boosttune.serving.runner import ModelRunner
from boosttune.serving.sampling import SamplingParams, logits_to_probs, sample
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TokenTree, TreeConfig, verification_inputs
from boosttune.serving.verify import greedy_branch_accepts, greedy_verify
from boosttune.serving.verify_stochastic import stochastic_verify


@dataclass
class StepRecord:
    """Measurements of one speculative step (``generate(record=True)``).

    Attributes:
        nodes: merged tree nodes the LLM verified (0 for a plain decoding step).
        accepts: per drafter of the plan (``GenerationResult.active`` order), draft tokens its branch
            alone would have had accepted (greedy only; empty under sampling). The step accepted
            the maximum of them (before stop strings / max tokens cut it).
        draft_s: per drafter of the plan, seconds in its ``draft`` call (the first step includes its
            catch-up over the whole prompt).
        verify_s: seconds of the LLM's verification forward.
        step_s: seconds of the whole step (drafting, merge, verification, cache compaction, stops).
    """

    nodes: int
    accepts: list[int]
    draft_s: list[float]
    verify_s: float
    step_s: float


@dataclass
class GenerationResult:
    """What one request produced.

    Attributes:
        tokens: generated token ids (prompt excluded).
        accept_lengths: tokens committed by each LLM forward after the prefill (bonus included).
        wall_time: seconds from the call to the last token, prefill included.
        finish_reason: "stop" (EOS or stop string) or "length".
        proposer_hits: per drafter of the plan (by name), accepted nodes it had proposed (merged
            trees credit every drafter that proposed a shared node).
        active: the names of the drafters this request drafted with, in the engine's order (None: not
            recorded, e.g. incremental decoding).
        prefill_s: seconds of the LLM's prefill forward.
        plan_s: seconds spent in the planner (the scheduler's serve-time cost).
        records: per-step measurements when ``generate(record=True)``, else empty.
        plan: the plan this request drafted with (the engine's default, its own, or its planner's
            choice; None: not recorded, e.g. incremental decoding).
    """

    tokens: list[int]
    accept_lengths: list[int]
    wall_time: float
    finish_reason: str
    proposer_hits: dict[str, int] = field(default_factory=dict)
    active: list[str] | None = None
    prefill_s: float = 0.0
    plan_s: float = 0.0
    records: list[StepRecord] = field(default_factory=list)
    plan: Plan | None = None

    @property
    def steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(1, self.steps)


TokenCallback = Callable[[list[int]], None]


@dataclass(frozen=True)
class Plan:
    """The drafters one request drafts with, each with its tree (no drafter: plain decoding).

    Attributes:
        trees: drafter name → the tree it drafts this request. The engine drafts and merges them in
            its own drafter order, whatever the order here.
    """

    trees: Mapping[str, TreeConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, tree in self.trees.items():
            if not isinstance(name, str) or not isinstance(tree, TreeConfig):
                raise TypeError(f"a plan maps drafter names to TreeConfig, got {name!r}: {type(tree).__name__}")

    @property
    def drafters(self) -> tuple[str, ...]:
        """The names of the drafters the plan drafts with."""
        return tuple(self.trees)

    @property
    def label(self) -> str:
        """A short name for tables, e.g. "feature[3] + prompt-lookup[1x4]" ("plain": no drafter)."""
        return " + ".join(f"{name}[{tree.label}]" for name, tree in self.trees.items()) or "plain"


Planner = Callable[[Tensor], Plan | None]
"""Chooses a request's plan once, after the prefill, from the (T - 1, H) fp32 last-layer hidden
states of the prompt without its pending token ((0, H) for a one-token prompt); None: the engine's
default plan."""


class SpeculativeEngine:
    """Token-tree speculative decoding of one LLM with any number of named drafters (0 = incremental).

    ``plan`` is the default plan: what a request drafts with when it brings no plan or planner.
    Engines are assembled in one place (``boosttune/assemble.py``); tests build them directly.
    """

    def __init__(self, llm: ModelRunner, drafters: Mapping[str, Drafter], plan: Plan):
        self.llm = llm
        self.drafters = dict(drafters)
        self.plan = self._checked(plan)
        llm.set_taps(feature_taps(self.drafters.values()))  # the layer inputs EAGLE-3 heads read

    def _checked(self, plan: Plan) -> Plan:
        unknown = [name for name in plan.trees if name not in self.drafters]
        if unknown:
            raise ValueError(f"the plan names drafters {unknown} this engine does not have ({list(self.drafters)})")
        return plan

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: Sequence[int],
        stop: StopCriteria,
        sampling: SamplingParams | None = None,
        on_tokens: TokenCallback | None = None,
        *,
        plan: Plan | None = None,
        planner: Planner | None = None,
        record: bool = False,
    ) -> GenerationResult:
        """Generate after ``prompt_ids``; ``on_tokens`` receives each step's committed tokens.

        Args:
            prompt_ids: the prompt's token ids (at least one).
            stop: when to stop (max new tokens, EOS, stop strings).
            sampling: greedy (default) or sampled decoding.
            on_tokens: receives each step's committed tokens.
            plan: the drafters and trees of this request (None: the engine's default plan).
            planner: chooses the plan from the prefill hidden states instead (``Planner``).
            record: log a ``StepRecord`` per step in ``GenerationResult.records``.
        """
        stream = self.open(prompt_ids, stop, sampling, on_tokens, plan=plan, planner=planner, record=record)
        while not stream.finished:
            stream.step()
        return stream.result()

    @torch.inference_mode()
    def open(self, *args: Any, **kwargs: Any) -> Stream:
        """Prefill a request and return its :class:`Stream`, ready to step (``begin``'s arguments).
        ``begin`` and ``opened`` are its two halves, for a caller that prefills several requests in one
        forward (``serving/batch.py``)."""
        opening = self.begin(*args, **kwargs)
        hidden = None
        if opening.prefix.numel() and not opening.wants_hidden:  # prefill all but the pending token
            opening.llm.prefill(opening.prefix)
        elif opening.wants_hidden:
            hidden = opening.llm.chain_hidden(opening.prefix) if opening.prefix.numel() else None
        return self.opened(opening, hidden)

    def begin(
        self,
        prompt_ids: Sequence[int],
        stop: StopCriteria,
        sampling: SamplingParams | None = None,
        on_tokens: TokenCallback | None = None,
        *,
        plan: Plan | None = None,
        planner: Planner | None = None,
        record: bool = False,
        llm: ModelRunner | None = None,
        drafters: Mapping[str, Drafter] | None = None,
    ) -> Opening:
        """``open``'s first half (``generate``'s arguments): checks the request and resets its caches; the
        caller then prefills ``Opening.prefix`` into ``Opening.llm`` (keeping the hidden states where
        ``Opening.wants_hidden``) and hands them to ``opened``.

        ``llm`` and ``drafters`` hold the request's caches: the engine's own by default, or a spawned
        set (``ModelRunner.spawn``, ``Drafter.spawn``) when several requests decode at once
        (``serving/batch.py``). Both are reset here."""
        sampling = sampling or SamplingParams()
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids must hold at least one token")
        if plan is not None and planner is not None:
            raise ValueError("a request takes a plan or a planner, not both")
        llm = llm if llm is not None else self.llm
        drafters = drafters if drafters is not None else self.drafters
        start = time.perf_counter()
        llm.reset()
        for d in drafters.values():
            d.reset()
        committed = list(prompt_ids)
        return Opening(llm, drafters, committed, torch.tensor(committed[:-1], dtype=torch.long), stop, sampling,
                       on_tokens, plan, planner, record, start)

    @torch.inference_mode()
    def opened(self, opening: Opening, hidden: Tensor | None) -> Stream:
        """``open``'s second half, after the prefill: ``hidden`` are the prefix's (P, (1 + taps) H) LLM
        hidden states where ``opening.wants_hidden`` (None otherwise, or for an empty prefix)."""
        o = opening
        plan, plan_s = o.plan, 0.0
        if o.wants_hidden:
            width = o.llm.model.get_output_embeddings().weight.shape[1]
            if hidden is None:  # on chain_hidden's device
                hidden = torch.zeros(0, width * (1 + len(o.llm.taps)), device=o.llm.device)
            for d in o.drafters.values():
                if d.observes_features():
                    d.observe(reader_features(hidden, width, o.llm.taps, d.feature_layers()))
            if o.planner is not None:
                t0 = time.perf_counter()
                plan = o.planner(hidden[:, :width])
                plan_s = time.perf_counter() - t0
        prefill_s = time.perf_counter() - o.start - plan_s
        plan = self._checked(plan) if plan is not None else self.plan
        return Stream(o.llm, o.drafters, o.committed, o.stop, o.sampling, o.on_tokens, plan, o.record, o.start,
                      prefill_s, plan_s)


@dataclass
class Opening:
    """A request between ``SpeculativeEngine.begin`` and ``opened``: its caches (reset), its prompt and
    what the prefill must give. ``prefix``: the (P,) prompt tokens but the last (the pending one)."""

    llm: ModelRunner
    drafters: Mapping[str, Drafter]
    committed: list[int]
    prefix: Tensor
    stop: StopCriteria
    sampling: SamplingParams
    on_tokens: TokenCallback | None
    plan: Plan | None
    planner: Planner | None
    record: bool
    start: float

    @property
    def wants_hidden(self) -> bool:
        """Whether the prefill must keep the LLM's hidden states (for feature heads or the planner)."""
        return self.planner is not None or any(d.observes_features() for d in self.drafters.values())


class Stream:
    """One request between steps: its caches (an LLM runner and drafters), its plan, what it has produced.

    ``step`` runs one speculative step on the stream's own LLM runner. A batch of streams splits it:
    every stream's ``draft`` names what the LLM must be fed, one forward feeds all of them, and every
    stream's ``commit`` verifies its tree against its rows of that forward (``serving/batch.py``).
    """

    def __init__(
        self, llm: ModelRunner, drafters: Mapping[str, Drafter], committed: list[int], stop: StopCriteria,
        sampling: SamplingParams, on_tokens: TokenCallback | None, plan: Plan, record: bool, start: float,
        prefill_s: float, plan_s: float,
    ):
        self.llm, self.stop, self.sampling, self.on_tokens, self.plan = llm, stop, sampling, on_tokens, plan
        self.record, self.start, self.prefill_s, self.plan_s = record, start, prefill_s, plan_s
        self.committed = committed
        self.gen = sampling.generator(llm.device)  # the verifier samples from p on the LLM's device
        self.names = [name for name in drafters if name in plan.trees]
        self.drafting = [(drafters[name], plan.trees[name]) for name in self.names]
        self.readers = [d for d, _ in self.drafting if d.observes_features()]
        self._width = llm.model.get_output_embeddings().weight.shape[1] if self.readers else 0  # H
        self.records: list[StepRecord] = []
        self.generated: list[int] = []
        self.accept_lengths: list[int] = []
        self.hits = dict.fromkeys(self.names, 0)
        self.finish: str | None = None
        self._tree: TokenTree | None = None
        self._maps: list[Tensor] = []
        self._draft_s: list[float] = []
        self._drafted = True
        self._t_step = 0.0

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def wants_hidden(self) -> bool:
        """Whether the verification forward must also return the LLM's last hidden states."""
        return bool(self.readers)

    def step(self) -> None:
        """One speculative step: draft, verify in one forward of the stream's LLM, commit."""
        input_ids, pos, prefix_len, mask = self.draft()
        t0 = time.perf_counter()
        if self.readers:  # the same forward, keeping the LLM's last hidden states for the feature heads
            logits, hidden = self.llm.forward_hidden(input_ids, pos, prefix_len, mask)  # (N + 1, V), (N + 1, H)
        else:
            logits, hidden = self.llm.forward(input_ids, pos, prefix_len, mask), None  # (N + 1, V)
        self.commit(logits, hidden, time.perf_counter() - t0)

    def draft(self, drafting: bool = True) -> tuple[Tensor, Tensor, int, Tensor]:
        """Draft this step's merged tree; returns what the LLM must be fed to verify it: (1, N + 1)
        token ids, (1, N + 1) positions, the prefix length and the tree mask (``verification_inputs``).
        ``drafting=False``: no tree this step (a plain decoding step; a busy batch may choose it)."""
        if self.finished:
            raise RuntimeError("this stream has finished")
        self._t_step = time.perf_counter()
        self._draft_s = []
        self._drafted = drafting
        prefix_len = len(self.committed) - 1
        if not (drafting and self.drafting):  # a plain step: ``verification_inputs`` of no tree, made directly
            self._tree, self._maps = _NO_TREE, []
            return (torch.tensor([[self.committed[-1]]]), torch.tensor([[prefix_len]]), prefix_len,
                    torch.ones(1, 1, dtype=torch.bool))
        self._tree, self._maps = _draft(self.committed, self.sampling, self.gen, self.drafting, self._draft_s)
        input_ids, pos, mask = verification_inputs(self._tree, self.committed[-1], prefix_len)
        return input_ids, pos, prefix_len, mask

    def cut(self, nodes: int) -> tuple[Tensor, Tensor, int, Tensor]:
        """Keep the drafted tree's first ``nodes`` nodes (an ancestor-closed set: nodes are in
        topological order, and the drafters' maps still hold, the kept nodes keeping their indices);
        returns the smaller tree's verification inputs, as ``draft`` does."""
        assert self._tree is not None, "cut follows draft"
        keep = torch.zeros(self._tree.size, dtype=torch.bool)
        keep[:nodes] = True
        self._tree, _ = subtree(self._tree, keep)
        prefix_len = len(self.committed) - 1
        input_ids, pos, mask = verification_inputs(self._tree, self.committed[-1], prefix_len)
        return input_ids, pos, prefix_len, mask

    def commit(self, logits: Tensor, hidden: Tensor | None, verify_s: float = 0.0) -> None:
        """Verify the drafted tree against the LLM's (N + 1, V) ``logits`` of this step's feed (and its
        (N + 1, H) ``hidden`` states when ``wants_hidden``), commit, and hand the tokens on."""
        tree, maps, sampling = self._tree, self._maps, self.sampling
        assert tree is not None, "commit follows draft"
        self._tree = None
        prefix_len = len(self.committed) - 1
        if sampling.greedy:
            path, bonus = greedy_verify(tree, logits)
        else:
            p = logits_to_probs(logits, sampling)  # (N + 1, V)
            path, bonus = stochastic_verify(tree, p, self.gen) if tree.size else ([], int(sample(p, self.gen)[0]))
        if path:
            self.llm.keep(prefix_len, torch.tensor([0] + [n + 1 for n in path], dtype=torch.long))
        else:  # the pending token's entry alone, in place: keep's work without its tensors
            self.llm.crop(prefix_len + 1)
        for j, (d, _) in enumerate(self.drafting if self._drafted else []):  # an undrafted step leaves them be
            local = _local_path(maps[j], path)
            self.hits[self.names[j]] += len(local)
            d.accept(local)
        new, self.finish = self.stop.cut(self.generated, tree.tokens[path].tolist() + [bonus])
        if self.readers:  # features of the pending token and the accepted path: positions now committed
            assert hidden is not None, "a stream whose drafters read features needs the LLM's hidden states"
            if path:
                rows = hidden[torch.tensor([0] + [n + 1 for n in path], dtype=torch.long)[: len(new)].to(hidden.device)]
            else:
                rows = hidden[: len(new)]
            for d in self.readers:
                d.observe(reader_features(rows, self._width, self.llm.taps, d.feature_layers()))
        self.generated += new
        self.committed += new
        self.accept_lengths.append(len(new))
        if self.record:
            accepts = greedy_branch_accepts(tree, logits, maps) if sampling.greedy and self._drafted else []
            step_s = time.perf_counter() - self._t_step
            self.records.append(StepRecord(tree.size, accepts, self._draft_s, verify_s, step_s))
        if self.on_tokens is not None:
            self.on_tokens(new)

    def result(self) -> GenerationResult:
        """What the request produced so far (all of it once ``finished``)."""
        res = GenerationResult(self.generated, self.accept_lengths, time.perf_counter() - self.start,
                               self.finish or "cancelled", self.hits, active=self.names, records=self.records)
        res.prefill_s, res.plan_s, res.plan = self.prefill_s, self.plan_s, self.plan
        return res


_NO_TREE = TokenTree.empty()  # a plain step's tree (size-0 tensors: nothing to change in them)


def feature_taps(drafters: Iterable[Drafter]) -> tuple[int, ...]:
    """The LLM layers whose inputs some drafter reads (``Drafter.feature_layers``), in order."""
    return tuple(sorted({i for d in drafters if d.observes_features() for i in d.feature_layers()}))


def reader_features(hidden: Tensor, width: int, taps: Sequence[int], layers: Sequence[int]) -> Tensor:
    """What one drafter reads of the LLM's (n, (1 + len(taps)) H) hidden-state result (the last-layer
    states, then the inputs of the ``taps`` layers): the (n, H) last-layer states where ``layers`` is
    empty, else the (n, len(layers) H) inputs of ``layers`` in their order."""
    if not layers:
        return hidden[:, :width]
    n = hidden.shape[0]  # 0 for a one-token prompt's prefill
    blocks = hidden.view(n, 1 + len(taps), width)
    return blocks[:, [1 + list(taps).index(i) for i in layers]].reshape(n, len(layers) * width)


def _draft(
    committed: list[int], sampling: SamplingParams, gen: torch.Generator,
    drafters: Sequence[tuple[Drafter, TreeConfig]], times: list[float],
) -> tuple[TokenTree, list[Tensor]]:
    """Merged tree of ``drafters`` (at least one), each drafting its tree; appends each draft's seconds to
    ``times``."""
    ids = torch.tensor(committed)
    trees = []
    for d, tree in drafters:
        t0 = time.perf_counter()
        trees.append(d.draft(ids, tree, sampling, gen))
        times.append(time.perf_counter() - t0)
    return merge_trees(trees, dedupe=sampling.greedy)


def _local_path(merged_of_local: Tensor, path: list[int]) -> list[int]:
    """The drafter's own node indices along the accepted (merged) path, up to where it leaves."""
    local_of_merged = {m: i for i, m in enumerate(merged_of_local.tolist())}
    out = []
    for node in path:
        if node not in local_of_merged:
            break
        out.append(local_of_merged[node])
    return out
