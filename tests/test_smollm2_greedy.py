"""Integration: on the embedded default LLM, greedy speculative output equals incremental decoding."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import MT_BENCH
from transformers import AutoModelForCausalLM

from boosttune.assemble import engine_from_models
from boosttune.core.models import load_model
from boosttune.core.prompts import encode_prompt, read_prompts
from boosttune.serving.decode import incremental_generate
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TreeConfig


def truncated(model, layers: int):
    """The LLM's first ``layers`` layers with its embeddings and head: a cheap untrained SSM."""
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = layers
    small = AutoModelForCausalLM.from_config(cfg).eval()
    own = small.state_dict()
    small.load_state_dict({k: v for k, v in model.state_dict().items() if k in own})
    small.config._attn_implementation = "sdpa"
    return small


@pytest.fixture(scope="module")
def default_llm():
    return load_model("default")


@pytest.mark.slow
def test_default_llm_greedy_identical_on_mt_bench(default_llm):
    prompts = [p for p in read_prompts(MT_BENCH)][::27][:3]  # three categories
    assert len(prompts) == 3
    llm, tok = default_llm.model, default_llm.tokenizer
    stop = StopCriteria(max_new_tokens=40, eos_token_ids=frozenset({tok.eos_token_id}))
    ssms = [truncated(llm, 4), truncated(llm, 8)]
    trees = [TreeConfig(widths=(2, 2, 1, 1)), TreeConfig(kind="dynamic", topk=3, depth=4, budget=12)]
    for prompt, tree in zip(prompts, [trees[0], trees[1], trees[0]], strict=True):
        ids = encode_prompt(tok, prompt)
        ref = incremental_generate(llm, ids, stop)
        merged = engine_from_models(llm, ssms, tree).generate(ids, stop)
        assert merged.tokens == ref.tokens, json.dumps({"prompt": prompt.text[:80]})
        self_draft = engine_from_models(llm, [llm], TreeConfig(widths=(1, 1, 1))).generate(ids, stop)
        assert self_draft.tokens == ref.tokens
        assert self_draft.tau > 3.0  # the LLM drafting for itself is (almost always) accepted
