"""The speculative engine: draft trees, verify them in one LLM forward, commit, compact caches.

Shape legend: T committed tokens, N merged tree nodes, V vocabulary.

One step:
1. every drafter proposes a tree rooted at the pending token (the last committed one, which is
   not yet in the LLM's cache); the trees are merged (common prefixes shared for greedy);
2. the LLM feeds ``[pending] + nodes`` in ONE forward with tree attention (positions are the
   prefix length plus depth);
3. greedy or stochastic verification picks the accepted path and the LLM's bonus token;
4. the LLM's cache keeps the pending token and the accepted path (gathered into place), each
   drafter keeps what it fed of that path; the bonus token becomes the next pending token.

τ (accepted tokens per step) counts the bonus, so plain decoding has τ = 1 (Spec-Bench).

Per request, ``generate`` can use a subset of the drafters and another tree (``active``, ``tree``),
or let a ``plan`` hook choose both from the LLM's prefill hidden states (the learned scheduler);
``record=True`` logs per-step timings and, for greedy decoding, every drafter's counterfactual
accepted length (full-information labels: one verification scores every branch at once).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedModel

from boosttune.serving.builders import TreeConfig, merge_trees
from boosttune.serving.drafter import Drafter, SSMDrafter
from boosttune.serving.lookup import PromptLookupDrafter, lookup_tree
from boosttune.serving.runner import ModelRunner
from boosttune.serving.sampling import SamplingParams, logits_to_probs, sample
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TokenTree, verification_inputs
from boosttune.serving.verify import greedy_branch_accepts, greedy_verify
from boosttune.serving.verify_stochastic import stochastic_verify


@dataclass
class StepRecord:
    """Measurements of one speculative step (``generate(record=True)``).

    Attributes:
        nodes: merged tree nodes the LLM verified (0 for a plain decoding step).
        accepts: per active drafter (``GenerationResult.active`` order), draft tokens its branch
            alone would have had accepted (greedy only; empty under sampling). The step accepted
            the maximum of them (before stop strings / max tokens cut it).
        draft_s: per active drafter, seconds in its ``draft`` call (the first step includes its
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
        proposer_hits: per drafter, accepted nodes it had proposed (merged trees credit every
            drafter that proposed a shared node).
        active: drafter indices this request used (None: not recorded, e.g. incremental decoding).
        prefill_s: seconds of the LLM's prefill forward.
        plan_s: seconds spent in the ``plan`` hook (the scheduler's serve-time cost).
        records: per-step measurements when ``generate(record=True)``, else empty.
    """

    tokens: list[int]
    accept_lengths: list[int]
    wall_time: float
    finish_reason: str
    proposer_hits: list[int] = field(default_factory=list)
    active: list[int] | None = None
    prefill_s: float = 0.0
    plan_s: float = 0.0
    records: list[StepRecord] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(1, self.steps)


TokenCallback = Callable[[list[int]], None]
TreeChoice = TreeConfig | Mapping[int, TreeConfig] | None
"""A tree for every active drafter, one per drafter index (drafters not named keep theirs), or None."""
RequestPlan = tuple[Sequence[int] | None, TreeChoice]
"""(drafter indices to use or None for all, trees for them (``TreeChoice``))."""
PlanHook = Callable[[Tensor], RequestPlan]
"""Called once after the prefill with the (T - 1, H) fp32 last-layer hidden states of the prompt
without its pending token ((0, H) for a one-token prompt)."""


class SpeculativeEngine:
    """Token-tree speculative decoding of one LLM with any number of drafters (0 = incremental)."""

    def __init__(self, llm: ModelRunner, drafters: Sequence[Drafter]):
        self.llm = llm
        self.drafters = list(drafters)

    @classmethod
    def from_models(
        cls, llm: PreTrainedModel, ssms: Sequence[PreTrainedModel], tree: TreeConfig, ranking: Tensor | None = None,
        lookup: int = 0,
    ) -> SpeculativeEngine:
        """An engine whose SSMs all draft the same tree shape; ``ranking``: the draft vocabulary
        ranking (``draft_vocab.py``), needed by trees with ``draft_vocab`` > 0; ``lookup`` > 0 adds
        a prompt-lookup drafter (``lookup.py``) proposing up to that many tokens, after the SSMs."""
        v = llm.get_output_embeddings().weight.shape[0]
        drafters: list[Drafter] = [
            SSMDrafter(ModelRunner(m), tree, i, vocab_size=v, ranking=ranking) for i, m in enumerate(ssms)
        ]
        if lookup:
            drafters.append(PromptLookupDrafter(lookup_tree(lookup), len(drafters), vocab_size=v))
        return cls(ModelRunner(llm), drafters)

    def _draft(
        self, committed: Tensor, sampling: SamplingParams, gen: torch.Generator,
        drafters: Sequence[Drafter] | None = None, times: list[float] | None = None,
    ) -> tuple[TokenTree, list[Tensor]]:
        """Merged tree of ``drafters`` (default: all); appends each draft's seconds to ``times``."""
        drafters = self.drafters if drafters is None else drafters
        if not drafters:
            return TokenTree.empty(), []
        trees = []
        for d in drafters:
            t0 = time.perf_counter()
            trees.append(d.draft(committed, sampling, gen))
            if times is not None:
                times.append(time.perf_counter() - t0)
        return merge_trees(trees, dedupe=sampling.greedy)

    def _resolve_active(self, active: Sequence[int] | None) -> list[int]:
        if active is None:
            return list(range(len(self.drafters)))
        out = [int(i) for i in active]
        bad = [i for i in out if not 0 <= i < len(self.drafters)]
        if bad or len(set(out)) != len(out):
            n = len(self.drafters)
            raise ValueError(f"active drafters must be distinct indices in [0, {n}), got {out}")
        return sorted(out)

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: Sequence[int],
        stop: StopCriteria,
        sampling: SamplingParams | None = None,
        on_tokens: TokenCallback | None = None,
        *,
        active: Sequence[int] | None = None,
        tree: TreeChoice = None,
        plan: PlanHook | None = None,
        record: bool = False,
    ) -> GenerationResult:
        """Generate after ``prompt_ids``; ``on_tokens`` receives each step's committed tokens.

        Args:
            prompt_ids: the prompt's token ids (at least one).
            stop: when to stop (max new tokens, EOS, stop strings).
            sampling: greedy (default) or sampled decoding.
            on_tokens: receives each step's committed tokens.
            active: drafter indices to use for this request (None: all; empty: plain decoding).
            tree: tree shape for the active drafters during this request (None: their own), or a
                mapping from drafter index to its tree (an SSM and prompt lookup read depth differently).
            plan: hook deciding ``(active, tree)`` from the prefill hidden states; overrides both.
            record: log a ``StepRecord`` per step in ``GenerationResult.records``.
        """
        sampling = sampling or SamplingParams()
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids must hold at least one token")
        start = time.perf_counter()
        self.llm.reset()
        for d in self.drafters:
            d.reset()
        committed = list(prompt_ids)
        prefix = torch.tensor(committed[:-1], dtype=torch.long)
        plan_s = 0.0
        if plan is None:
            if len(committed) > 1:  # prefill all but the pending token
                self.llm.forward_chain(prefix)
        else:
            width = self.llm.model.get_output_embeddings().weight.shape[1]
            hidden = (self.llm.chain_hidden(prefix) if len(committed) > 1
                      else torch.zeros(0, width, device=self.llm.device))  # on chain_hidden's device
            t0 = time.perf_counter()
            active, tree = plan(hidden)
            plan_s = time.perf_counter() - t0
        prefill_s = time.perf_counter() - start - plan_s
        chosen = self._resolve_active(active)
        saved = [
            (i, d, d.tree_config) for i, d in enumerate(self.drafters) if i in chosen and hasattr(d, "tree_config")
        ]
        try:
            for i, d, _ in saved:
                override = tree.get(i) if isinstance(tree, Mapping) else tree
                if override is not None:
                    d.tree_config = override
            res = self._loop(committed, stop, sampling, on_tokens, chosen, record)
        finally:
            for _, d, own in saved:
                d.tree_config = own
        res.wall_time = time.perf_counter() - start
        res.prefill_s, res.plan_s = prefill_s, plan_s
        return res

    def _loop(
        self, committed: list[int], stop: StopCriteria, sampling: SamplingParams,
        on_tokens: TokenCallback | None, chosen: list[int], record: bool,
    ) -> GenerationResult:
        """The speculative loop after the prefill, drafting with the drafters ``chosen``."""
        gen = sampling.generator(self.llm.device)  # the verifier samples from p on the LLM's device
        drafters = [self.drafters[i] for i in chosen]
        records: list[StepRecord] = []
        generated: list[int] = []
        accept_lengths: list[int] = []
        hits = [0] * len(self.drafters)
        finish = None
        while finish is None:
            t_step = time.perf_counter()
            prefix_len = len(committed) - 1
            draft_s: list[float] = []
            tree, maps = self._draft(torch.tensor(committed), sampling, gen, drafters, draft_s)
            input_ids, pos, mask = verification_inputs(tree, committed[-1], prefix_len)
            t_verify = time.perf_counter()
            logits = self.llm.forward(input_ids, pos, prefix_len, mask)  # (N + 1, V)
            verify_s = time.perf_counter() - t_verify
            if sampling.greedy:
                path, bonus = greedy_verify(tree, logits)
            else:
                p = logits_to_probs(logits, sampling)  # (N + 1, V)
                path, bonus = stochastic_verify(tree, p, gen) if tree.size else ([], int(sample(p, gen)[0]))
            self.llm.keep(prefix_len, torch.tensor([0] + [n + 1 for n in path], dtype=torch.long))
            for j, d in enumerate(drafters):
                local = _local_path(maps[j], path)
                hits[chosen[j]] += len(local)
                d.accept(local)
            new, finish = stop.cut(generated, tree.tokens[path].tolist() + [bonus])
            generated += new
            committed += new
            accept_lengths.append(len(new))
            if on_tokens is not None:
                on_tokens(new)
            if record:
                accepts = greedy_branch_accepts(tree, logits, maps) if sampling.greedy else []
                step_s = time.perf_counter() - t_step
                records.append(StepRecord(tree.size, accepts, draft_s, verify_s, step_s))
        return GenerationResult(generated, accept_lengths, 0.0, finish, hits, active=chosen, records=records)


def _local_path(merged_of_local: Tensor, path: list[int]) -> list[int]:
    """The drafter's own node indices along the accepted (merged) path, up to where it leaves."""
    local_of_merged = {m: i for i, m in enumerate(merged_of_local.tolist())}
    out = []
    for node in path:
        if node not in local_of_merged:
            break
        out.append(local_of_merged[node])
    return out
