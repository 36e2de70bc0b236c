"""The teacher's batched decoder writes what HF ``generate`` writes, prompt by prompt.

Greedy reference: HF ``generate`` on each prompt alone (no padding), fp32, cut after the first EOS.
The batched decoder runs all prompts at once (left padding, finished rows compacted away) and must
give the same tokens, the same top-k token ids and the same log-probabilities. Sampled: each token
drawn from the distribution HF's temperature and top-p warpers leave (chi-square, with a control
that the test rejects).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_llama
from test_verify_stochastic import _gof_pvalue  # chi-square, cells expected < 5 merged
from transformers import MistralConfig, MistralForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from boosttune.config import TEACHER_BACKENDS, ConfigError, TeacherConfig, load_config
from boosttune.train import batched_decode
from boosttune.train.teacher.backends import BACKENDS, backend_for
from boosttune.train.teacher.local import BatchedBackend, HFBackend, LocalBackend, generate_batch
from boosttune.train.teacher.shards import cut_at_eos

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
    every_step = batched_decode.decode_batch(model, prompts, MAX_NEW, eos, 0, compact_every=1, features=True)
    never = batched_decode.decode_batch(model, prompts, MAX_NEW, eos, 0, compact_every=10_000, features=True)
    assert every_step.tokens == never.tokens
    assert not never.features[0].requires_grad, "decode_batch must not record autograd graphs (its cost and memory)"
    # prompts read in groups of similar length (lengths 1, 3 | 5 | 7 | 9 | 12 here) write the same
    assert batched_decode._prefill_groups(sorted(map(len, prompts)), 12) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6)]
    grouped = batched_decode.decode_batch(model, prompts, MAX_NEW, eos, 0, features=True, prefill_tokens=12)
    assert grouped.tokens == never.tokens
    repeated = batched_decode.decode_batch(model, prompts + prompts[::2], MAX_NEW, eos, 0)  # read once each
    assert repeated.tokens == never.tokens + never.tokens[::2]
    # the features it kept are the LLM's own last hidden states over prompt + output (all but the last token)
    for p, out, a, b, c in zip(prompts, never.tokens, every_step.features, never.features, grouped.features, strict=True):
        ids = torch.tensor([(p + out)[:-1]])
        with torch.no_grad():
            want = model.model(input_ids=ids).last_hidden_state[0]
        assert a.dtype == torch.float16 and a.shape == want.shape == b.shape
        torch.testing.assert_close(a.float(), want, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(b.float(), want, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(c.float(), want, atol=2e-3, rtol=2e-3)


def _hf_warped(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """(V,) the distribution HF's sampling draws from after its temperature and top-p warpers."""
    scores = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, logits[None].clone()))
    return torch.softmax(scores[0], -1)


@pytest.mark.parametrize(("temperature", "top_p"), [(0.8, 0.9), (1.0, 1.0), (1.3, 0.5)])
def test_sampled_tokens_follow_hfs_warped_distribution(temperature: float, top_p: float) -> None:
    logits = torch.randn(40, generator=torch.Generator().manual_seed(2)) * 2.0
    n = 20_000
    got = batched_decode.pick_tokens(logits.expand(n, -1), temperature, top_p, torch.Generator().manual_seed(0))
    counts = torch.bincount(got, minlength=40).float()
    want = _hf_warped(logits, temperature, top_p)
    assert counts[want == 0].sum() == 0, "a token outside the nucleus was drawn"
    assert _gof_pvalue(counts, want) > 1e-3
    control = _hf_warped(logits, temperature * 1.15, min(1.0, top_p + 0.1))  # a slightly different warp
    assert _gof_pvalue(counts, control) < 1e-6, "the test cannot tell a different distribution apart"


def test_the_batched_decoder_samples_the_models_next_token_and_is_seeded() -> None:
    model = tiny_llama(4, init=0.1)
    prompt, n = [5, 9, 14, 3], 3000
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    outs = batched_decode.decode_batch(model, [prompt] * n, 1, frozenset({1}), 0, temperature=0.7, top_p=0.9,
                                       generator=torch.Generator().manual_seed(1)).tokens
    counts = torch.bincount(torch.tensor([o[0] for o in outs]), minlength=logits.numel()).float()
    assert _gof_pvalue(counts, _hf_warped(logits, 0.7, 0.9)) > 1e-3
    assert _gof_pvalue(counts, _hf_warped(logits, 1.0, 1.0)) < 1e-6  # control: the unwarped distribution
    again = [batched_decode.decode_batch(model, _prompts(), 8, frozenset(), 0, temperature=1.0,
                                         generator=torch.Generator().manual_seed(3)).tokens for _ in range(2)]
    assert again[0] == again[1]
    greedy = batched_decode.decode_batch(model, _prompts(), 8, frozenset(), 0).tokens
    assert again[0] != greedy


def _sliding_window_model():
    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    return MistralForCausalLM(cfg).eval()


def test_auto_backend_falls_back_to_hf_where_the_batched_decoder_cannot_run() -> None:
    cfg = load_config(None).teacher
    auto = backend_for(cfg)
    assert isinstance(auto, LocalBackend)
    assert auto.decoder_for(tiny_llama(0)) == "batched"
    assert auto.decoder_for(_sliding_window_model()) == "hf"
    cfg.temperature = 0.7  # sampling teachers too
    assert backend_for(cfg).decoder_for(tiny_llama(0)) == "batched"
    assert backend_for(TeacherConfig(backend="batched")).decoder_for(_sliding_window_model()) == "batched"
    with pytest.raises(ValueError, match="sliding-window"):
        generate_batch(_sliding_window_model(), [[2, 3]], 2, 0.0, 1.0, 0, frozenset({1}), backend="batched")


def test_an_unknown_backend_is_refused() -> None:
    assert load_config(None, ["teacher.backend=batched", "teacher.temperature=0.7"]).teacher.backend == "batched"
    with pytest.raises(ConfigError, match="teacher.backend"):
        load_config(None, ["teacher.backend=vllm"])
    with pytest.raises(ConfigError, match=r"teacher\.backend: 'vllm' is not a teacher backend"):
        backend_for(TeacherConfig(backend="vllm"))  # a config built in code, past load_config's checks


def test_every_configurable_backend_is_registered() -> None:
    """config.py names the backends (it sits below training); the registry has exactly one class each."""
    assert set(BACKENDS) == set(TEACHER_BACKENDS) and len(BACKENDS) == len(TEACHER_BACKENDS)
    for name in TEACHER_BACKENDS:
        assert type(backend_for(TeacherConfig(backend=name))) is BACKENDS[name]


def test_prompt_growth_uses_the_local_teachers_decoder() -> None:
    """Growing prompts runs the LLM in this process: a local backend's own decoder, else auto."""
    assert BatchedBackend.decoder == "batched" and HFBackend.decoder == "hf"
    assert backend_for(TeacherConfig()).decoder == "auto"
    assert backend_for(TeacherConfig(backend="openai", endpoint="http://h:1/v1")).decoder == "auto"


def test_the_teacher_keeps_the_llms_features_beside_its_shards(tmp_path) -> None:
    from boosttune.config import TeacherConfig
    from boosttune.core.rundir import RunDir
    from boosttune.train.distill import samples_from_teacher
    from boosttune.train.pipeline import recorded_features
    from boosttune.train.sources import TrainPrompt
    from boosttune.train.teacher.backends import run_teacher
    from boosttune.train.teacher.shards import features_path, load_features, load_teacher

    model, run = tiny_llama(2, init=0.1), RunDir(tmp_path / "run")
    prompts = [TrainPrompt(id=f"p{i}", source="t", category="c", chat=False, input_ids=p) for i, p in enumerate(_prompts())]
    cfg = TeacherConfig(max_new_tokens=10, batch_size=4, shard_size=4)
    stats = run_teacher(model, SimpleNamespace(pad_token_id=0), prompts, cfg, run, frozenset({1}), features=True)
    assert stats["backend"] == "batched" and features_path(run.teacher_shard(1)).is_file()
    samples = samples_from_teacher(load_teacher(run, len(prompts), 4), range(len(prompts)))
    feats = load_features(run, range(len(prompts)), 4)
    for s, f in zip(samples, feats, strict=True):
        with torch.no_grad():
            want = model.model(input_ids=torch.tensor([s.ids[:-1]])).last_hidden_state[0]
        torch.testing.assert_close(f.float(), want, atol=2e-3, rtol=2e-3)
    features_path(run.teacher_shard(1)).unlink()  # shard 1 (prompts 4, 5) written without features
    assert load_features(run, [3, 4], 4)[1] is None

    kept, got, n = recorded_features(run, 4, samples[2:], 2)
    assert n == 2 and got[2] is None and got[3] is None
    assert kept[0].ids == samples[2].ids[:-1] and kept[2].ids == samples[4].ids  # recorded: the unfed last token goes
