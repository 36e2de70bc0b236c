"""Shared fixtures: tiny random llama models (unit tests) and the offline switch."""

from __future__ import annotations

import copy
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("BOOSTTUNE_RECOST_CACHE", "0")  # recosts time the forward (the cache test turns it on)
# The README's test command runs two pytest-xdist workers (`-n 2`): each, and the processes its tests start,
# takes its share of the (2) cores, since torch's threads in two busy processes at once oversubscribe them.
THREADS = max(1, min(2, os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from boosttune.core.feature_head import FC_ATTR, new_fc  # noqa: E402

torch.set_flush_denormal(True)  # as the CLI does: random tiny models otherwise hit slow subnormal arithmetic
torch.set_num_threads(THREADS)

# ../shared/data beside the checkout (CI lays a copy there); BOOSTTUNE_SHARED overrides it.
SHARED_DATA = Path(os.environ.get("BOOSTTUNE_SHARED", Path(__file__).resolve().parents[2] / "shared")) / "data"
MT_BENCH = SHARED_DATA / "mt_bench" / "question.jsonl"


def load_script(name: str):
    """scripts/NAME.py (not a package), loaded from its file; registered in ``sys.modules`` under
    ``NAME_script``, where its dataclasses look their module up."""
    import importlib.util
    import sys

    key = f"{name}_script"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def tiny_llama(seed: int, vocab: int = 64, layers: int = 2, hidden: int = 32, init: float = 0.4) -> LlamaForCausalLM:
    """A random llama whose logits are far from ties (large init), fp32, eval mode."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=init, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.config._attn_implementation = "sdpa"
    return model


def greedy_samples(llm: LlamaForCausalLM, n: int = 12, seed: int = 7) -> list:
    """``n`` training samples of the LLM's own greedy continuations (12 tokens after 4 random ones): what
    a teacher writes, for the heads' training tests."""
    from boosttune.train.distill import Sample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        prompt = torch.randint(2, llm.config.vocab_size, (4,), generator=g)
        with torch.no_grad():
            ids = llm.generate(prompt[None], max_new_tokens=12, do_sample=False, min_new_tokens=12)[0]
        samples.append(Sample(ids=ids.tolist(), prompt_len=4))
    return samples


def perturbed(model: LlamaForCausalLM, seed: int, noise: float) -> LlamaForCausalLM:
    """A copy of ``model`` with Gaussian noise on every weight: an SSM that agrees partly."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return other


def local_llm(seed):
    """A one-layer LLM whose attention output is zeroed: its feature at j depends on token j only."""
    llm = tiny_llama(seed, layers=1)
    with torch.no_grad():
        llm.model.layers[0].self_attn.o_proj.weight.zero_()
    return llm


def oracle_head(llm):
    """For ``local_llm``: a head that reads only the token (fc = [I, 0]) through the LLM's own layer
    and norm, so pair j's output is exactly the LLM's feature after token j+1 (and a draft node's,
    after its own token): every draft of a greedy chain is the LLM's own next token."""
    head = copy.deepcopy(llm)
    fc = new_fc(llm.config.hidden_size)
    with torch.no_grad():
        h = llm.config.hidden_size
        fc.weight.zero_()
        fc.weight[:, :h] = torch.eye(h)
    setattr(head, FC_ATTR, fc)
    return head.eval()


def noisy_head(llm, seed, noise=0.1):
    head = perturbed(llm, seed, noise)
    torch.manual_seed(seed)
    fc = new_fc(llm.config.hidden_size)
    with torch.no_grad():
        fc.weight.add_(torch.randn_like(fc.weight) * 0.05)
    setattr(head, FC_ATTR, fc)
    return head.eval()


@pytest.fixture(scope="session")
def llm() -> LlamaForCausalLM:
    return tiny_llama(0)
