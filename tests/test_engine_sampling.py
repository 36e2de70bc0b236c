"""End to end: sampled speculative decoding with a merged multi-SSM tree keeps the LLM's distribution.

A 5-token vocabulary makes every 2-token continuation enumerable: the exact probability of each
comes from the LLM's own processed distributions, and a chi-square test compares it with the
engine's output over many seeds. The same test with an accept-always verifier must fail.

Cost: each sample is a whole ``generate`` call of tiny models, so the seeds are split over
``WORKERS`` spawned processes (one torch thread each), each rebuilding the same engine from a
module-level recipe; the counts are exactly those of one process running every seed. The negative
controls use fewer seeds (``NEGATIVE_RUNS``): the chi-square test's power against a fixed wrong
distribution only grows with the sample size, so a control that fails at ``NEGATIVE_RUNS`` shows
the ``RUNS``-sample test would catch that verifier too.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
from conftest import perturbed, tiny_llama
from scipy.stats import chisquare

import boosttune.serving.engine as engine_mod
from boosttune.serving.engine import Plan, SpeculativeEngine
from boosttune.serving.sampling import SamplingParams, logits_to_probs
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TreeConfig

VOCAB = 5
PROMPT = [2, 3, 1]
PARAMS = dict(temperature=0.9, top_k=4)
RUNS = 2000
NEGATIVE_RUNS = 500
WORKERS = min(2, os.cpu_count() or 1)


def exact_distribution(llm, prompt: list[int] = PROMPT) -> dict[tuple[int, int], float]:
    params = SamplingParams(**PARAMS)
    with torch.no_grad():
        p1 = logits_to_probs(llm(torch.tensor([prompt])).logits[0, -1:], params)[0]
        seqs = torch.tensor([prompt + [a] for a in range(VOCAB)])
        p2 = logits_to_probs(llm(seqs).logits[:, -1], params)  # (V, V)
    return {(a, b): float(p1[a] * p2[a, b]) for a, b in itertools.product(range(VOCAB), repeat=2)}


def _count(eng: SpeculativeEngine, prompt: list[int], seeds) -> dict[tuple[int, int], int]:
    counts = dict.fromkeys(itertools.product(range(VOCAB), repeat=2), 0)
    stop = StopCriteria(max_new_tokens=2)
    for seed in seeds:
        out = eng.generate(prompt, stop, SamplingParams(seed=seed, **PARAMS))
        counts[tuple(out.tokens)] += 1
    return counts


_STOCHASTIC_VERIFY = engine_mod.stochastic_verify


def _worker_init() -> None:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)


def _worker_counts(recipe: Callable, args: tuple, verifier: Callable | None, prompt: list[int], seeds: range):
    """In a worker: rebuild the engine from ``recipe(*args)`` and count its outputs over ``seeds``."""
    _worker_init()  # again: unpickling ``recipe`` imported conftest, which sets two threads
    # this worker serves later tests too: every task sets the verifier it needs
    engine_mod.stochastic_verify = verifier if verifier is not None else _STOCHASTIC_VERIFY
    eng = recipe(*args)
    return _count(eng, prompt, seeds), _fingerprint(eng)


def _fingerprint(eng: SpeculativeEngine) -> float:
    """A checksum of the engine's LLM weights: the workers must sample the LLM the test computed."""
    return float(sum(p.detach().double().sum() for p in eng.llm.model.parameters()))


_POOL: list[ProcessPoolExecutor] = []


def run_engine(recipe: Callable[..., SpeculativeEngine], args: tuple = (), prompt: list[int] = PROMPT,
               runs: int = RUNS, verifier: Callable | None = None) -> dict[tuple[int, int], int]:
    """Counts of each 2-token continuation of ``prompt`` over seeds ``0..runs-1`` of the engine
    ``recipe(*args)`` (a module-level function, so that spawned workers can rebuild it), with
    ``verifier`` in place of the stochastic verifier when given."""
    if WORKERS == 1:
        with pytest.MonkeyPatch.context() as mp:
            if verifier is not None:
                mp.setattr(engine_mod, "stochastic_verify", verifier)
            return _count(recipe(*args), prompt, range(runs))
    if not _POOL:
        ctx = multiprocessing.get_context("spawn")
        _POOL.append(ProcessPoolExecutor(WORKERS, mp_context=ctx, initializer=_worker_init))
    jobs = [_POOL[0].submit(_worker_counts, recipe, args, verifier, prompt, range(w, runs, WORKERS))
            for w in range(WORKERS)]
    parts = [j.result() for j in jobs]
    expected = _fingerprint(recipe(*args))
    assert all(abs(f - expected) < 1e-6 * max(1.0, abs(expected)) for _, f in parts), "workers built another LLM"
    return {k: sum(c[k] for c, _ in parts) for k in parts[0][0]}


def pvalue(counts, exact) -> float:
    n = sum(counts.values())
    keys = [k for k in counts if exact[k] * n >= 5]
    rest = [k for k in counts if k not in keys]
    obs = [counts[k] for k in keys] + [sum(counts[k] for k in rest)]
    exp = [exact[k] * n for k in keys] + [sum(exact[k] for k in rest) * n]
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
    """The SSMs draft through the runner serving gives them (``drafter_runner``: the lean one for
    plain llamas), so the distribution test covers what is served."""
    trees = [TreeConfig(widths=(2, 2), min_prob=0.15), TreeConfig(kind="dynamic", topk=2, depth=2)]
    from boosttune.serving.drafter import SSMDrafter
    from boosttune.serving.lean import drafter_runner
    from boosttune.serving.runner import ModelRunner

    drafters = {f"ssm-{i}": SSMDrafter(drafter_runner(s)) for i, s in enumerate(ssms)}
    return SpeculativeEngine(ModelRunner(llm), drafters, Plan(dict(zip(drafters, trees, strict=True))))


def merged_engine() -> SpeculativeEngine:
    """The recipe: both SSMs, a static and a dynamic tree, merged."""
    return make_engine(*sampling_models())


def test_sampling_keeps_the_llm_distribution(models):
    llm, _ = models
    exact = exact_distribution(llm)
    pv = pvalue(run_engine(merged_engine), exact)
    assert pv > 1e-3, f"chi-square p-value {pv:.2e}: sampled output does not follow the LLM"


def w8a8_engine() -> SpeculativeEngine:
    """The recipe: the LLM served w8a8 (``--quantize w8a8``: int8 weights and int8 inputs, so its products
    take in_features of 64), two SSMs drafting one tree."""
    from boosttune import assemble

    llm = tiny_llama(11, vocab=VOCAB, hidden=64, init=0.3)
    ssms = [perturbed(llm, 12, noise=0.8), perturbed(llm, 13, noise=1.2)]
    eng = assemble.engine_from_models(llm, ssms, TreeConfig(widths=(2, 2), min_prob=0.15))
    assemble.quantize_llm(eng, "w8a8")
    return eng


@torch.inference_mode()
def test_sampling_keeps_the_w8a8_llms_distribution():
    """Lossless with respect to the quantized LLM: the output follows the w8a8 LLM's own distribution,
    computed by its plain forward."""
    runner = w8a8_engine().llm
    params = SamplingParams(**PARAMS)
    runner.reset()
    p1 = logits_to_probs(runner.forward_chain(torch.tensor(PROMPT))[-1:], params)[0]
    exact = {}
    for a in range(VOCAB):
        runner.reset()
        p2 = logits_to_probs(runner.forward_chain(torch.tensor([*PROMPT, a]))[-1:], params)[0]
        exact.update({(a, b): float(p1[a] * p2[b]) for b in range(VOCAB)})
    pv = pvalue(run_engine(w8a8_engine), exact)
    assert pv > 1e-3, f"chi-square p-value {pv:.2e}: sampled output does not follow the w8a8 LLM"


def eagle3_engine() -> SpeculativeEngine:
    """The recipe: an EAGLE-3 head over 4 of the 5 tokens (token 1 has q = 0), reading two layers'
    inputs (one of them twice), a tree of two levels."""
    from boosttune.core.eagle3_head import Eagle3Spec
    from boosttune.serving.eagle3_drafter import Eagle3Drafter
    from boosttune.serving.runner import ModelRunner
    from boosttune.train.eagle3 import init_head

    llm, _ = sampling_models()
    head = init_head(llm, Eagle3Spec.from_llm(llm.config, 4, (0, 1, 1)), torch.tensor([0, 2, 3, 4]))
    drafters = {"eagle3": Eagle3Drafter(head.eval().requires_grad_(False), VOCAB)}
    return SpeculativeEngine(ModelRunner(llm), drafters, Plan({"eagle3": TreeConfig(widths=(2, 2))}))


def test_sampling_with_an_eagle3_head_keeps_the_llm_distribution(models):
    llm, _ = models
    pv = pvalue(run_engine(eagle3_engine), exact_distribution(llm))
    assert pv > 1e-3, f"chi-square p-value {pv:.2e}: sampled output with an EAGLE-3 head does not follow the LLM"


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


def test_negative_control_accept_always_fails(models):
    llm, _ = models
    exact = exact_distribution(llm)
    pv = pvalue(run_engine(merged_engine, runs=NEGATIVE_RUNS, verifier=_accept_always), exact)
    assert pv < 1e-6, f"the wrong verifier passed (p-value {pv:.2e}): the test has no power"
