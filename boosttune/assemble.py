"""The one place a speculative engine is assembled from models.

Every command that decodes builds its engine here, so the drafters, their names and their default
trees are the same whichever command asks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor
from transformers import PreTrainedModel

from boosttune.serving.builders import TreeConfig
from boosttune.serving.drafter import Drafter, SSMDrafter
from boosttune.serving.engine import Plan, SpeculativeEngine
from boosttune.serving.lookup import LOOKUP_NAME, PromptLookupDrafter, lookup_tree
from boosttune.serving.runner import ModelRunner


def ssm_names(n: int) -> list[str]:
    """The names of ``n`` SSMs given without names: ssm-1 .. ssm-N, as a run and its bundles name them."""
    return [f"ssm-{k}" for k in range(1, n + 1)]


def engine_from_models(
    llm: PreTrainedModel, ssms: Mapping[str, PreTrainedModel] | Sequence[PreTrainedModel], tree: TreeConfig,
    ranking: Tensor | None = None, lookup: int = 0,
) -> SpeculativeEngine:
    """An engine over ``llm`` whose SSMs all draft ``tree`` by default.

    Args:
        llm: the LLM.
        ssms: the SSMs by name (a sequence is named ``ssm_names``), in merge order.
        tree: every SSM's default tree.
        ranking: the draft vocabulary ranking (``draft_vocab.py``), needed by trees with
            ``draft_vocab`` > 0.
        lookup: > 0 adds the prompt-lookup drafter (``LOOKUP_NAME``, ``lookup.py``) after the
            SSMs, proposing up to that many tokens by default.
    """
    named = dict(ssms) if isinstance(ssms, Mapping) else dict(zip(ssm_names(len(ssms)), ssms, strict=True))
    if LOOKUP_NAME in named:
        raise ValueError(f"an SSM may not be named {LOOKUP_NAME!r}: that name is the prompt-lookup drafter's")
    v = llm.get_output_embeddings().weight.shape[0]
    drafters: dict[str, Drafter] = {
        name: SSMDrafter(ModelRunner(m), vocab_size=v, ranking=ranking) for name, m in named.items()
    }
    trees = dict.fromkeys(named, tree)
    if lookup:
        drafters[LOOKUP_NAME] = PromptLookupDrafter(vocab_size=v)
        trees[LOOKUP_NAME] = lookup_tree(lookup)
    return SpeculativeEngine(ModelRunner(llm), drafters, Plan(trees))
