"""End to end: sampled speculative decoding with a merged multi-SSM tree keeps the LLM's distribution.

A 5-token vocabulary makes every 2-token continuation enumerable: the exact probability of each
comes from the LLM's own processed distributions, and a chi-square test compares it with the
engine's output over many seeds. The same test with an accept-always verifier must fail.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import perturbed, tiny_llama
from scipy.stats import chisquare

import boosttune.serving.engine as engine_mod
from boosttune.serving.builders import TreeConfig
from boosttune.serving.engine import Plan, SpeculativeEngine
from boosttune.serving.sampling import SamplingParams, logits_to_probs
from boosttune.serving.stops import StopCriteria

VOCAB = 5
PROMPT = [2, 3, 1]
PARAMS = dict(temperature=0.9, top_k=4)
RUNS = 2000


def exact_distribution(llm, prompt: list[int] = PROMPT) -> dict[tuple[int, int], float]:
    params = SamplingParams(**PARAMS)
    with torch.no_grad():
        p1 = logits_to_probs(llm(torch.tensor([prompt])).logits[0, -1:], params)[0]
        seqs = torch.tensor([prompt + [a] for a in range(VOCAB)])
        p2 = logits_to_probs(llm(seqs).logits[:, -1], params)  # (V, V)
    return {(a, b): float(p1[a] * p2[a, b]) for a, b in itertools.product(range(VOCAB), repeat=2)}


def run_engine(eng: SpeculativeEngine, prompt: list[int] = PROMPT) -> dict[tuple[int, int], int]:
    counts = {k: 0 for k in itertools.product(range(VOCAB), repeat=2)}
    stop = StopCriteria(max_new_tokens=2)
    for seed in range(RUNS):
        out = eng.generate(prompt, stop, SamplingParams(seed=seed, **PARAMS))
        counts[tuple(out.tokens)] += 1
    return counts


def pvalue(counts, exact) -> float:
    keys = [k for k in counts if exact[k] * RUNS >= 5]
    rest = [k for k in counts if k not in keys]
    obs = [counts[k] for k in keys] + [sum(counts[k] for k in rest)]
    exp = [exact[k] * RUNS for k in keys] + [sum(exact[k] for k in rest) * RUNS]
    if exp[-1] < 1e-9:  # nothing to pool: any output there is impossible
        if obs[-1]:
            return 0.0  # it produced a continuation the LLM gives probability 0
        obs, exp = obs[:-1], exp[:-1]
    scale = sum(obs) / sum(exp)
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def sampling_models():
    """The LLM over VOCAB tokens and two SSMs that agree with it only partly."""
    llm = tiny_llama(11, vocab=VOCAB, init=0.3)
    return llm, [perturbed(llm, 12, noise=0.8), perturbed(llm, 13, noise=1.2)]


@pytest.fixture(scope="module")
def models():
    return sampling_models()


def make_engine(llm, ssms) -> SpeculativeEngine:
    trees = [TreeConfig(widths=(2, 2), min_prob=0.15), TreeConfig(kind="dynamic", topk=2, depth=2)]
    from boosttune.serving.drafter import SSMDrafter
    from boosttune.serving.runner import ModelRunner

    drafters = {f"ssm-{i}": SSMDrafter(ModelRunner(s)) for i, s in enumerate(ssms)}
    return SpeculativeEngine(ModelRunner(llm), drafters, Plan(dict(zip(drafters, trees, strict=True))))


def test_sampling_keeps_the_llm_distribution(models):
    llm, ssms = models
    exact = exact_distribution(llm)
    pv = pvalue(run_engine(make_engine(llm, ssms)), exact)
    assert pv > 1e-3, f"chi-square p-value {pv:.2e}: sampled output does not follow the LLM"


def _accept_always(tree, p_probs, generator):
    """A wrong verifier: follows the first child down to a leaf, then samples the bonus from p."""
    node, path = -1, []
    while True:
        kids = (tree.parents == node).nonzero().squeeze(-1)
        if kids.numel() == 0:
            break
        node = int(kids[0])
        path.append(node)
    return path, int(torch.multinomial(p_probs[node + 1], 1, generator=generator))


def test_negative_control_accept_always_fails(models, monkeypatch):
    llm, ssms = models
    monkeypatch.setattr(engine_mod, "stochastic_verify", _accept_always)
    exact = exact_distribution(llm)
    pv = pvalue(run_engine(make_engine(llm, ssms)), exact)
    assert pv < 1e-6, f"the wrong verifier passed (p-value {pv:.2e}): the test has no power"
