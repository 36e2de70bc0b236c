"""The teacher's batched greedy decoder writes what HF ``generate`` writes, prompt by prompt.

Reference: HF ``generate`` on each prompt alone (no padding), greedy, fp32, cut after the first EOS.
The batched decoder runs all prompts at once (left padding, finished rows compacted away) and must
give the same tokens, the same top-k token ids and the same log-probabilities.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from transformers import MistralConfig, MistralForCausalLM

from boosttune.config import ConfigError, load_config
from boosttune.train import batched_decode
from boosttune.train.teacher import cut_at_eos, generate_batch, resolve_backend

MAX_NEW = 24
TOPK = 3


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 64, (n,), generator=g).tolist() for n in (1, 7, 3, 12, 5, 9)]


@torch.no_grad()
def _reference(model, prompt: list[int], eos: frozenset[int]) -> tuple[list[int], torch.Tensor]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    toks, _ = cut_at_eos(out.sequences[0, len(prompt):].tolist(), eos)
    logp = torch.log_softmax(torch.stack(out.logits, 1)[0].float(), -1)[: len(toks)]  # (n, V)
    return toks, logp


def _eos_that_ends_some_rows_early(model, prompts) -> frozenset[int]:
    """A token that one row writes half-way: that row stops early and is compacted away."""
    toks, _ = _reference(model, prompts[1], frozenset())
    return frozenset({toks[MAX_NEW // 2]})


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_decoder_matches_hf_generate_prompt_by_prompt(seed: int) -> None:
    model = tiny_llama(seed, init=0.1)
    prompts = _prompts()
    eos = _eos_that_ends_some_rows_early(model, prompts)
    got = generate_batch(model, prompts, MAX_NEW, 0.0, 1.0, pad_id=0, eos_ids=eos, topk=TOPK, backend="batched")
    lengths = []
    for prompt, cont in zip(prompts, got, strict=True):
        toks, logp = _reference(model, prompt, eos)
        assert cont.output_ids == toks, f"prompt {prompt}: batched {cont.output_ids} vs generate {toks}"
        assert cont.finish == ("stop" if toks[-1] in eos else "length")
        ref_lp, ref_ids = logp.topk(TOPK, -1)
        assert cont.topk_ids == ref_ids.tolist()
        torch.testing.assert_close(torch.tensor(cont.topk_logprobs), ref_lp, atol=1e-5, rtol=1e-5)
        lengths.append(len(toks))
    # rows end before the first compaction (step 16) and others run on past it
    assert min(lengths) < 16 < max(lengths), f"the test must see rows end early and others run on: {lengths}"


def test_batched_decoder_compacts_finished_rows_without_changing_others() -> None:
    model = tiny_llama(3, init=0.1)
    prompts = _prompts()
    eos = _eos_that_ends_some_rows_early(model, prompts)
    every_step, _, _ = batched_decode.greedy_batch(model, prompts, MAX_NEW, eos, 0, compact_every=1)
    never, _, _ = batched_decode.greedy_batch(model, prompts, MAX_NEW, eos, 0, compact_every=10_000)
    assert every_step == never


def _sliding_window_model():
    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    return MistralForCausalLM(cfg).eval()


def test_auto_backend_falls_back_to_hf_where_the_batched_decoder_cannot_run() -> None:
    cfg = load_config(None).teacher
    assert resolve_backend(cfg, tiny_llama(0)) == "batched"
    assert resolve_backend(cfg, _sliding_window_model()) == "hf"
    cfg.temperature = 0.7
    assert resolve_backend(cfg, tiny_llama(0)) == "hf"
    with pytest.raises(ValueError, match="sliding-window"):
        generate_batch(_sliding_window_model(), [[2, 3]], 2, 0.0, 1.0, 0, frozenset({1}), backend="batched")


def test_a_sampling_teacher_cannot_ask_for_the_batched_backend() -> None:
    with pytest.raises(ConfigError, match="teacher.backend"):
        load_config(None, ["teacher.backend=batched", "teacher.temperature=0.7"])
    with pytest.raises(ConfigError, match="teacher.backend"):
        load_config(None, ["teacher.backend=vllm"])
