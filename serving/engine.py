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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedModel

from boosttune.serving.builders import TreeConfig, merge_trees
from boosttune.serving.drafter import Drafter, SSMDrafter
from boosttune.serving.runner import ModelRunner
from boosttune.serving.sampling import SamplingParams, logits_to_probs, sample
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TokenTree, verification_inputs
from boosttune.serving.verify import greedy_verify
from boosttune.serving.verify_stochastic import stochastic_verify


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
    """

    tokens: list[int]
    accept_lengths: list[int]
    wall_time: float
    finish_reason: str
    proposer_hits: list[int] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(1, self.steps)


TokenCallback = Callable[[list[int]], None]


class SpeculativeEngine:
    """Token-tree speculative decoding of one LLM with any number of drafters (0 = incremental)."""

    def __init__(self, llm: ModelRunner, drafters: Sequence[Drafter]):
        self.llm = llm
        self.drafters = list(drafters)

    @classmethod
    def from_models(cls, llm: PreTrainedModel, ssms: Sequence[PreTrainedModel], tree: TreeConfig) -> SpeculativeEngine:
        """An engine whose SSMs all draft the same tree shape."""
        v = llm.get_output_embeddings().weight.shape[0]
        return cls(ModelRunner(llm), [SSMDrafter(ModelRunner(m), tree, i, vocab_size=v) for i, m in enumerate(ssms)])

    def _draft(self, committed: Tensor, sampling: SamplingParams, gen: torch.Generator) -> tuple[TokenTree, list[Tensor]]:
        if not self.drafters:
            return TokenTree.empty(), []
        trees = [d.draft(committed, sampling, gen) for d in self.drafters]
        return merge_trees(trees, dedupe=sampling.greedy)

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: Sequence[int],
        stop: StopCriteria,
        sampling: SamplingParams | None = None,
        on_tokens: TokenCallback | None = None,
    ) -> GenerationResult:
        """Generate after ``prompt_ids``; ``on_tokens`` receives each step's committed tokens."""
        sampling = sampling or SamplingParams()
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids must hold at least one token")
        start = time.perf_counter()
        gen = sampling.generator()
        self.llm.reset()
        for d in self.drafters:
            d.reset()
        committed = list(prompt_ids)
        if len(committed) > 1:  # prefill all but the pending token
            self.llm.forward_chain(torch.tensor(committed[:-1]))
        generated: list[int] = []
        accept_lengths: list[int] = []
        hits = [0] * len(self.drafters)
        finish = None
        while finish is None:
            prefix_len = len(committed) - 1
            tree, maps = self._draft(torch.tensor(committed), sampling, gen)
            input_ids, pos, mask = verification_inputs(tree, committed[-1], prefix_len)
            logits = self.llm.forward(input_ids, pos, prefix_len, mask)  # (N + 1, V)
            if sampling.greedy:
                path, bonus = greedy_verify(tree, logits)
            else:
                p = logits_to_probs(logits, sampling)  # (N + 1, V)
                path, bonus = stochastic_verify(tree, p, gen) if tree.size else ([], int(sample(p, gen)[0]))
            self.llm.keep(prefix_len, torch.tensor([0] + [n + 1 for n in path], dtype=torch.long))
            for j, d in enumerate(self.drafters):
                local = _local_path(maps[j], path)
                hits[j] += len(local)
                d.accept(local)
            new, finish = stop.cut(generated, tree.tokens[path].tolist() + [bonus])
            generated += new
            committed += new
            accept_lengths.append(len(new))
            if on_tokens is not None:
                on_tokens(new)
        return GenerationResult(generated, accept_lengths, time.perf_counter() - start, finish, hits)


def _local_path(merged_of_local: Tensor, path: list[int]) -> list[int]:
    """The drafter's own node indices along the accepted (merged) path, up to where it leaves."""
    local_of_merged = {m: i for i, m in enumerate(merged_of_local.tolist())}
    out = []
    for node in path:
        if node not in local_of_merged:
            break
        out.append(local_of_merged[node])
    return out
