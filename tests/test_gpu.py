"""The speculative engine on a CUDA device: greedy output, sampling, the Triton tree-attention path, bf16.

Everything here is gpu-marked and skipped without CUDA (run with ``pytest -m gpu``). The CPU
suite already checks the same properties with the PyTorch reference attention
(test_engine_greedy.py); on CUDA, ``tree_attention`` dispatches to the Triton kernel, so these
tests are the end-to-end check of that kernel inside real forwards (tree verification and the
SSMs' depth-by-depth drafting).

Models are built and perturbed on the CPU (``perturbed`` draws its noise with a CPU generator),
then moved to the device. Sampling draws from a generator on the LLM's device, so a fixed seed
must give the same tokens run after run (the CPU suite checks the sampled distributions).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import perturbed, tiny_llama

import boosttune.kernels.tree_attention_triton as tat
from boosttune.assemble import engine_from_models
from boosttune.kernels.tree_attention import tree_attention_reference
from boosttune.serving.decode import incremental_generate
from boosttune.serving.drafter import SSMDrafter
from boosttune.serving.engine import GenerationResult, Plan, SpeculativeEngine
from boosttune.serving.runner import ModelRunner
from boosttune.serving.sampling import SamplingParams
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TreeConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
NEW_TOKENS = 33
TREES = {
    "chain": TreeConfig(widths=(1, 1, 1, 1)),
    "specinfer": TreeConfig(widths=(1, 1, 3, 1, 1, 1, 1, 1)),  # SpecInfer's tree, arXiv 2305.09781 §3
    "dynamic": TreeConfig(kind="dynamic", topk=3, depth=4, budget=12),
}
SEEDS = range(3)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.fixture(autouse=True)
def _full_fp32_matmuls():
    """fp32 comparisons need IEEE fp32 matmuls (no TF32), whatever a previous import configured."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


def _prompt(seed: int) -> list[int]:
    """The same random prompt (1..11 tokens, ids 2..63) as test_engine_greedy.py."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 64, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()


def run_pair(
    tree: str, seed: int, device: str = DEVICE, dtype: torch.dtype = torch.float32
) -> tuple[GenerationResult, GenerationResult]:
    """(incremental reference, speculative engine) greedy results for one tiny LLM / SSM pair."""
    llm = tiny_llama(seed)
    ssm = perturbed(llm, seed + 100, noise=0.15)  # on the CPU: its noise comes from a CPU generator
    llm = llm.to(device=device, dtype=dtype)
    ssm = ssm.to(device=device, dtype=dtype)
    prompt = _prompt(seed)
    stop = StopCriteria(max_new_tokens=NEW_TOKENS)
    ref = incremental_generate(llm, prompt, stop)
    engine = SpeculativeEngine(ModelRunner(llm), {"ssm": SSMDrafter(ModelRunner(ssm))}, Plan({"ssm": TREES[tree]}))
    out = engine.generate(prompt, stop)
    return ref, out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("tree", sorted(TREES))
def test_engine_matches_incremental_fp32(tree, seed):
    ref, out = run_pair(tree, seed)
    assert out.tokens == ref.tokens
    assert sum(out.accept_lengths) == len(out.tokens) == NEW_TOKENS
    assert out.steps < NEW_TOKENS, "a 15%-noise copy of the LLM should get some drafts accepted"


class _CountingTriton:
    """Wraps ``tree_attention_triton``: counts calls and compares each with the fp32 reference."""

    def __init__(self, real):
        self.real = real
        self.calls: list[tuple[int, int, int, torch.dtype]] = []  # (T, S, P, dtype) per call
        self.max_err = 0.0  # max |kernel - reference| / max |reference| over the calls

    def __call__(self, q, k, v, prefix_len, tree_mask, scale, **kwargs):
        out = self.real(q, k, v, prefix_len, tree_mask, scale, **kwargs)
        self.calls.append((q.shape[2], k.shape[2], int(prefix_len), q.dtype))
        want = tree_attention_reference(q.float(), k.float(), v.float(), prefix_len, tree_mask, scale)
        err = (out.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)
        self.max_err = max(self.max_err, float(err))
        return out


@pytest.fixture
def counting_triton(monkeypatch):
    """``tree_attention`` looks ``tat.tree_attention_triton`` up at call time, so this catches it."""
    pytest.importorskip("triton")
    if _interpreting():
        pytest.skip("TRITON_INTERPRET is set; this test is for compiled kernels")
    assert tat.HAS_TRITON
    counter = _CountingTriton(tat.tree_attention_triton)
    monkeypatch.setattr(tat, "tree_attention_triton", counter)
    return counter


@pytest.mark.parametrize("tree", ["specinfer", "dynamic"])
def test_engine_runs_the_triton_kernel(counting_triton, tree):
    ref, out = run_pair(tree, seed=0)
    assert out.tokens == ref.tokens
    calls = counting_triton.calls
    assert len(calls) > 0, "tree attention on CUDA never reached the Triton kernel"
    assert all(dt == torch.float32 for *_, dt in calls)
    # verification forwards feed a tree (T > 1) after a committed prefix (P > 0)
    assert any(t > 1 and p > 0 for t, _, p, _ in calls), calls[:20]
    assert counting_triton.max_err < 1e-4, (
        f"kernel vs fp32 reference inside the engine: {counting_triton.max_err}"
    )


@pytest.mark.parametrize("tree", ["chain", "specinfer", "dynamic"])
def test_engine_bf16_runs(counting_triton, tree):
    ref, out = run_pair(tree, seed=1, dtype=torch.bfloat16)
    # bf16 may legitimately diverge from bf16 incremental decoding (different summation orders
    # near ties); it must still run to the end and count its tokens right.
    assert len(out.tokens) == sum(out.accept_lengths) == NEW_TOKENS
    assert all(0 <= t < 64 for t in out.tokens)
    assert len(ref.tokens) == NEW_TOKENS
    calls = counting_triton.calls
    assert calls and all(dt == torch.bfloat16 for *_, dt in calls)
    assert counting_triton.max_err < 2e-2, f"bf16 kernel vs fp32 reference: {counting_triton.max_err}"
    same = next(
        (i for i, (a, b) in enumerate(zip(out.tokens, ref.tokens, strict=True)) if a != b), NEW_TOKENS
    )
    print(
        f"bf16 {tree}: {same}/{NEW_TOKENS} tokens agree with incremental, {out.steps} steps, "
        f"{len(calls)} kernel calls, max rel err {counting_triton.max_err:.2e}"
    )


SAMPLING = {
    "t1": SamplingParams(temperature=1.0, seed=7),
    "t07_topk_topp": SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=7),
}


def _sampling_engine(tree: str, lookup: int = 0) -> tuple[SpeculativeEngine, torch.nn.Module]:
    llm = tiny_llama(0)
    ssm = perturbed(llm, 100, noise=0.15)
    llm, ssm = llm.to(DEVICE), ssm.to(DEVICE)
    return engine_from_models(llm, [ssm], TREES[tree], lookup=lookup), llm


@pytest.mark.parametrize("params", sorted(SAMPLING))
@pytest.mark.parametrize("tree", sorted(TREES))
def test_engine_sampling_runs_and_is_seeded(tree, params):
    """Sampled drafting (Gumbel-top-k children) and stochastic verification run on CUDA; the
    request's seed fixes the output."""
    engine, _ = _sampling_engine(tree)
    sp = SAMPLING[params]
    stop = StopCriteria(max_new_tokens=NEW_TOKENS)
    a = engine.generate(_prompt(0), stop, sp)
    b = engine.generate(_prompt(0), stop, sp)
    assert len(a.tokens) == sum(a.accept_lengths) == NEW_TOKENS
    assert all(0 <= t < 64 for t in a.tokens)
    assert a.tokens == b.tokens, "same seed, same device: the sampled tokens must repeat"
    other = engine.generate(_prompt(0), stop, SamplingParams(temperature=1.0, seed=8))
    assert len(other.tokens) == NEW_TOKENS


def test_engine_sampling_with_prompt_lookup():
    """Prompt lookup builds its one-hot q on the host; the verifier must take it to the LLM's device."""
    engine, _ = _sampling_engine("specinfer", lookup=4)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # repeats, so lookup proposes chains
    out = engine.generate(prompt, StopCriteria(max_new_tokens=NEW_TOKENS), SAMPLING["t1"], record=True)
    assert len(out.tokens) == sum(out.accept_lengths) == NEW_TOKENS
    assert out.records and any(r.nodes > 0 for r in out.records)


def test_incremental_sampling_runs():
    _, llm = _sampling_engine("chain")
    stop = StopCriteria(max_new_tokens=NEW_TOKENS)
    a = incremental_generate(llm, _prompt(1), stop, SAMPLING["t1"])
    b = incremental_generate(llm, _prompt(1), stop, SAMPLING["t1"])
    assert len(a.tokens) == NEW_TOKENS and a.tokens == b.tokens


def test_planner_one_token_prompt_on_device():
    """The planner gets (0, H) hidden states on the LLM's device for a one-token prompt."""
    engine, _ = _sampling_engine("chain")
    seen = []
    engine.generate([3], StopCriteria(max_new_tokens=4), planner=lambda h: seen.append(h))  # None: default plan
    assert seen[0].shape == (0, 32) and seen[0].device.type == "cuda"
