"""Pieces of the training pipeline: prompt sources (real `datasets`), matching, losses, batching, SSM init."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import MT_BENCH, SHARED_DATA, perturbed, tiny_llama
from transformers import AutoTokenizer

from boosttune.config import BoostConfig, MatchConfig, PromptsConfig, SourceConfig, SSMInitConfig
from boosttune.core.models import resolve_model_path
from boosttune.train.distill import BatchOrder, Sample, collate, distill_losses, lr_lambda, plan_batches
from boosttune.train.matching import is_match, teacher_forced_agreement
from boosttune.train.pipeline import acceptance_profile, stage_pool, unmatched
from boosttune.train.sources import collect_prompts, default_seeds, source_prompts
from boosttune.train.ssm_init import derive_ssm

OWT = SHARED_DATA / "openwebtext_sample" / "openwebtext_sample.txt"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_model_path("tiny-random"))


# ------------------------------------------------------------------------------------------ sources
def test_default_seeds_cover_the_eight_categories() -> None:
    cats = {p.category for p in default_seeds()}
    assert cats == {"writing", "coding", "math", "qa", "summarization", "extraction", "roleplay", "translation"}
    assert len(default_seeds()) >= 100


def test_default_source_is_chat_templated(tok) -> None:
    ps = source_prompts(SourceConfig(kind="default", limit=3), tok, PromptsConfig())
    assert len(ps) == 3 and all(p.chat for p in ps)
    assert "<|im_start|>assistant" in tok.decode(ps[0].input_ids)


@pytest.mark.skipif(not OWT.is_file(), reason="needs ../shared/data")
def test_openwebtext_local_text_through_datasets_is_cut_into_chunks(tok) -> None:
    cfg = PromptsConfig(chunk_tokens=32)
    ps = source_prompts(SourceConfig(kind="openwebtext", path=str(OWT), limit=50), tok, cfg)
    assert len(ps) == 50
    assert all(16 <= len(p.input_ids) <= 32 and not p.chat for p in ps)
    first_doc = OWT.read_text().split("\n\n")[0]
    assert tok.decode(ps[0].input_ids).strip() in first_doc  # the first chunk is the corpus's opening text


def test_dataset_saved_to_disk_and_parquet(tok, tmp_path) -> None:
    import datasets

    texts = [f"Document number {i} talks about rivers, mountains and the weather in spring. " * 4 for i in range(6)]
    ds = datasets.Dataset.from_dict({"body": texts})
    ds.save_to_disk(str(tmp_path / "saved"))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    cfg = PromptsConfig(chunk_tokens=16)
    a = source_prompts(SourceConfig(kind="dataset", path=str(tmp_path / "saved"), text_column="body"), tok, cfg)
    b = source_prompts(SourceConfig(kind="dataset", path=str(tmp_path / "d.parquet"), text_column="body"), tok, cfg)
    assert len(a) == len(b) > 6 and [p.input_ids for p in a] == [p.input_ids for p in b]
    with pytest.raises(ValueError, match="text_column"):
        source_prompts(SourceConfig(kind="dataset", path=str(tmp_path / "saved")), tok, cfg)


def test_hub_dataset_offline_names_the_source(tok, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="prompts source 'openwebtext' path 'Skylion007/openwebtext'"):
        source_prompts(SourceConfig(kind="openwebtext"), tok, PromptsConfig())


def test_jsonl_chat_prompts_and_dedup(tok) -> None:
    cfg = PromptsConfig(sources=[SourceConfig(kind="jsonl", path=str(MT_BENCH), limit=5),
                                 SourceConfig(kind="jsonl", path=str(MT_BENCH), limit=5)])
    ps = collect_prompts(cfg, tok)
    assert len(ps) == 5 and all(p.chat for p in ps)


def test_jsonl_strings_may_hold_unicode_line_breaks(tmp_path) -> None:
    """U+2028, U+0085 and form feeds are line breaks to str.splitlines but not to JSON Lines
    (ShareGPT prompts contain them): both prompt readers keep such a record whole."""
    from boosttune.core.prompts import read_prompts
    from boosttune.core.rundir import RunDir
    from boosttune.train.pipeline import read_prompts_file
    from boosttune.train.sources import TrainPrompt

    texts = ["first\u2028second", "a\x85b\x0cc", "plain"]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    assert [p.text for p in read_prompts(path)] == texts
    run = RunDir(tmp_path / "run")
    run.prompts_dir.mkdir(parents=True)
    saved = [TrainPrompt(id=str(i), source="jsonl", category="", chat=True, input_ids=[1, 2], text=t) for i, t in enumerate(texts)]
    run.prompts_file.write_text("".join(p.to_json() + "\n" for p in saved), encoding="utf-8")
    assert read_prompts_file(run) == saved


# ----------------------------------------------------------------------------------------- matching
def test_match_criteria() -> None:
    assert is_match([True] * 4 + [False], MatchConfig(kind="prefix", k=4))
    assert not is_match([True, False, True, True], MatchConfig(kind="prefix", k=4))
    assert is_match([True, False, True, False], MatchConfig(kind="fraction", k=4, fraction=0.5))
    assert not is_match([True, False, False, False], MatchConfig(kind="fraction", k=4, fraction=0.5))
    assert not is_match([], MatchConfig())


def test_matched_samples_leave_the_pool_until_too_few_are_left() -> None:
    boost = BoostConfig(min_pool=2)
    first = stage_pool(boost, 1, 6, None)
    assert first == list(range(6))
    left = unmatched(first, [True, False, True, False, False, True])
    assert left == [1, 3, 4]  # the matched samples 0, 2 and 5 are gone
    assert stage_pool(boost, 2, 6, left) == [1, 3, 4]
    left = unmatched([1, 3, 4], [False, False, False, True, True, False])
    assert left == [1]
    assert stage_pool(boost, 3, 6, left) == list(range(6))  # fewer than min_pool left: train on all again
    assert stage_pool(BoostConfig(mode="independent"), 2, 6, [1, 3, 4]) == list(range(6))


def test_acceptance_profile() -> None:
    rows = [[True, True, False], [False, True], [True, True, True]]
    assert acceptance_profile(rows, depths=3) == pytest.approx([2 / 3, 2 / 3, 1 / 3])


def _greedy_samples(model, n: int, new: int) -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        prompt = torch.randint(2, 64, (5,), generator=g).tolist()
        ids = prompt[:]
        with torch.no_grad():
            for _ in range(new):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(Sample(ids, len(prompt)))
    return out


def test_a_model_matches_its_own_greedy_continuations_and_a_perturbed_one_does_not() -> None:
    llm = tiny_llama(3)
    samples = _greedy_samples(llm, 4, 10)
    rows = teacher_forced_agreement(llm, samples, pad_id=1)
    assert all(all(r) and len(r) == 10 for r in rows)
    other = teacher_forced_agreement(perturbed(llm, 0, 1.0), samples, pad_id=1)
    assert not all(all(r) for r in other)


# ------------------------------------------------------------------------------------------- losses
def test_collate_aligns_loss_positions_with_the_continuation() -> None:
    s = [Sample([5, 6, 7, 8, 9], 2, [[8, 1], [9, 2], [3, 4]], [[-0.1, -3.0]] * 3), Sample([5, 6, 7], 1, [[6, 1], [7, 2]],
                                                                                        [[-0.1, -3.0]] * 2)]
    b = collate(s, pad_id=0)
    assert b["targets"][b["loss_mask"]].tolist() == [7, 8, 9, 6, 7]
    assert b["topk_ids"][:, 0].tolist() == [8, 9, 3, 6, 7]  # one teacher row per loss position, in order
    assert b["input_ids"][1].tolist() == [5, 6, 7, 0, 0]


def test_kl_and_tv_vanish_when_the_student_equals_the_teacher_topk() -> None:
    teacher_lp = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    ids = torch.tensor([[4, 2, 9]])
    logits = torch.full((1, 12), -1e4)
    logits[0, ids[0]] = teacher_lp[0]
    batch = {"topk_ids": ids, "topk_logprobs": teacher_lp}
    kl = distill_losses(logits, torch.tensor([4]), batch, "ce+kl")
    tv = distill_losses(logits, torch.tensor([4]), batch, "ce+tv")
    assert kl["kl"].item() == pytest.approx(0.0, abs=1e-5) and tv["tv"].item() == pytest.approx(0.0, abs=1e-5)
    assert kl["ce"].item() == pytest.approx(-math.log(0.7), rel=1e-4)
    uniform = distill_losses(torch.zeros((1, 12)), torch.tensor([4]), batch, "ce+tv")["tv"].item()
    # TV(p, uniform over 12) with p = (.7,.2,.1) on three ids: 0.5 * (|.7-1/12|+|.2-1/12|+|.1-1/12| + 9/12)
    assert uniform == pytest.approx(0.5 * (0.7 - 1 / 12 + 0.2 - 1 / 12 + 0.1 - 1 / 12 + 9 / 12), rel=1e-4)


def test_lr_schedule_and_batch_budget() -> None:
    assert lr_lambda(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_lambda(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_lambda(100, 10, 100, 0.1) == pytest.approx(0.1)
    lengths = [3, 50, 7, 20, 20, 9, 64, 1]
    batches = plan_batches(lengths, 64, seed=0)
    assert sorted(i for b in batches for i in b) == list(range(8))
    assert all(max(lengths[i] for i in b) * len(b) <= 64 for b in batches)


# --------------------------------------------------------------------------------------------- init
def _take(order: BatchOrder, k: int) -> list[int]:
    it = iter(order)
    return [next(it) for _ in range(k)]


def test_batch_order_resumes_at_any_position_and_shares_out_ranks() -> None:
    """The data order depends only on the position: a stage resumed after any step (mid-pass too)
    sees the rest of the uninterrupted order; each pass is a permutation; ranks split the stream."""
    n, seed = 5, 7
    whole = _take(BatchOrder(n, seed), 4 * n)
    assert all(sorted(whole[e * n:(e + 1) * n]) == list(range(n)) for e in range(4))
    assert len({tuple(whole[e * n:(e + 1) * n]) for e in range(4)}) > 1  # passes are reshuffled
    for step in range(1, 3 * n):
        resumed = BatchOrder(n, seed)
        resumed.resume_at(step, grad_accum=1)
        assert _take(resumed, n) == whole[step:step + n]
    accum = BatchOrder(n, seed)
    accum.resume_at(3, grad_accum=2)
    assert _take(accum, 4) == whole[6:10]
    ranks = [BatchOrder(n, seed, rank=r, world=2) for r in range(2)]
    for r in ranks:
        r.resume_at(2, grad_accum=1)
    assert _take(ranks[0], 3) == whole[4:10:2] and _take(ranks[1], 3) == whole[5:11:2]


def test_derived_ssm_copies_llm_layers_and_projects_embeddings() -> None:
    llm = tiny_llama(0, layers=3, hidden=32)
    ssm = derive_ssm(llm, SSMInitConfig(layers=[2]))
    assert ssm.config.num_hidden_layers == 1 and ssm.config.tie_word_embeddings
    assert torch.equal(ssm.model.layers[0].mlp.up_proj.weight, llm.model.layers[2].mlp.up_proj.weight)
    assert torch.equal(ssm.model.embed_tokens.weight, llm.model.embed_tokens.weight)
    narrow = derive_ssm(llm, SSMInitConfig(layers=[], num_layers=2, hidden_size=16))
    assert narrow.config.hidden_size == 16 and narrow(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 64)
    with pytest.raises(ValueError, match="ssm.layers: the LLM has 3 layers"):
        derive_ssm(llm, SSMInitConfig(layers=[5]))


# ------------------------------------------------------------------------------------------ grow
@pytest.mark.parametrize("backend", ["batched", "hf"])
def test_grown_requests_are_new_sampled_and_reproducible(backend: str) -> None:
    from boosttune.core.models import eos_token_ids, load_model
    from boosttune.train.grow import grow_prompts

    llm = load_model("tiny-random")
    seeds = default_seeds()[:6]  # each picked several times: its ask is read once per batch

    def grow(seed: int) -> list:
        return grow_prompts(llm.model, llm.tokenizer, seeds, 24, frozenset(eos_token_ids(llm)), seed=seed,
                            batch_size=16, max_new_tokens=12, backend=backend)

    first = grow(0)
    texts = [p.text for p in first]
    assert 12 <= len(first) <= 24 and len(set(texts)) == len(texts)  # sampled: few repeats, and those dropped
    assert not set(texts) & {s.text for s in seeds}
    assert {p.category for p in first} <= {s.category for s in seeds}
    assert [p.text for p in grow(0)] == texts and [p.text for p in grow(1)] != texts


def test_llm_cast_from_fp32_is_a_load_in_that_dtype() -> None:
    """RunLLM loads the LLM once (fp32 when its phases' dtypes differ) and casts it: the copy must hold what
    a load in that dtype holds, buffers included (a cast rotary ``inv_freq`` changes the logits)."""
    from boosttune.core.models import load_model
    from boosttune.train.pipeline import RunLLM, cast_parameters

    fresh = load_model("tiny-random", torch.bfloat16).model
    loaded = load_model("tiny-random", torch.float32).model
    cast = cast_parameters(loaded, torch.bfloat16)
    for kind in ("named_parameters", "named_buffers"):
        want, got = dict(getattr(fresh, kind)()), dict(getattr(cast, kind)())
        assert want.keys() == got.keys()
        for k in want:
            assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, cast(ids).logits)
    assert loaded.dtype == torch.float32  # the original is untouched

    llm = RunLLM("tiny-random", [torch.bfloat16, torch.float32], "cpu")
    first = llm.get(torch.bfloat16, "cpu")
    attn = first.model.config._attn_implementation
    first.model.config._attn_implementation = "eager" if attn != "eager" else "sdpa"  # as the teacher sets its own
    assert llm.get(torch.bfloat16, "cpu") is first and first.model.config._attn_implementation == attn
    assert llm.get(torch.float32, "cpu").model.dtype == torch.float32


# --------------------------------------------------------------------------------- boosting modes
def test_quantile_pool_and_weighted_pool() -> None:
    from boosttune.train.pipeline import next_pool

    pool, matched = [0, 2, 3, 5], [True, False, False, True, False, False]
    covered = [0.0, 0.0, 0.9, 0.2, 0.0, 0.7]
    assert next_pool(BoostConfig(), pool, matched, None) == [2, 5]  # match: unmatched ones stay
    assert next_pool(BoostConfig(mode="quantile", quantile=0.5), pool, matched, covered) == [0, 3]
    assert next_pool(BoostConfig(mode="weighted"), pool, matched, None) == pool
    assert stage_pool(BoostConfig(mode="quantile", min_pool=2), 2, 6, [0, 3]) == [0, 3]
    assert stage_pool(BoostConfig(mode="weighted", min_pool=2), 2, 6, [0, 3]) == list(range(6))


def _weighted_batch(n: int, seed: int, kind: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    g = torch.Generator().manual_seed(seed)
    vocab = 300
    logits = torch.randn(n, vocab, generator=g) * 3
    targets = torch.randint(0, vocab, (n,), generator=g)
    batch = {"topk_ids": torch.randint(0, vocab, (n, 4), generator=g), "topk_logprobs": torch.randn(n, 4, generator=g)}
    return logits, targets, batch


@pytest.mark.parametrize("kind", ["ce", "ce+kl", "ce+tv"])
def test_weighted_loss_with_unit_weights_is_the_loss_bit_for_bit(kind: str) -> None:
    for n in (1, 7, 33, 257):
        logits, targets, batch = _weighted_batch(n, n, kind)
        plain = distill_losses(logits, targets, batch, kind)
        ones = distill_losses(logits, targets, {**batch, "weights": torch.ones(n)}, kind)
        assert plain.keys() == ones.keys()
        for k in plain:
            assert torch.equal(plain[k], ones[k]), (n, k)


@pytest.mark.parametrize("kind", ["ce", "ce+kl", "ce+tv"])
def test_weighted_loss_with_zero_weights_is_the_loss_over_the_other_tokens(kind: str) -> None:
    logits, targets, batch = _weighted_batch(40, 3, kind)
    keep = torch.arange(40) % 3 != 1
    sub = distill_losses(logits[keep], targets[keep], {k: v[keep] for k, v in batch.items()}, kind)
    weighted = distill_losses(logits, targets, {**batch, "weights": keep.float()}, kind)
    for k in sub:
        torch.testing.assert_close(weighted[k], sub[k])
    # weights scale: 0.1 on some tokens is the mean with those tokens counted a tenth
    w = torch.where(keep, 1.0, 0.1)
    ce = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    torch.testing.assert_close(distill_losses(logits, targets, {**batch, "weights": w}, kind)["ce"],
                               (ce * w).sum() / w.sum())


def test_collate_carries_token_weights_in_loss_order() -> None:
    s = [Sample([5, 6, 7, 8, 9], 2, weights=[1.0, 0.1, 1.0]), Sample([5, 6, 7], 1, weights=[0.1, 1.0])]
    b = collate(s, pad_id=0)
    assert b["weights"].tolist() == pytest.approx([1.0, 0.1, 1.0, 0.1, 1.0])
    assert "weights" not in collate([Sample([5, 6, 7], 1)], pad_id=0)  # no weights: today's batch


def test_teacher_forced_ranks_agree_with_token_ranks() -> None:
    from boosttune.core.ranks import token_ranks
    from boosttune.train.matching import teacher_forced_scores

    llm = tiny_llama(3)
    samples = _greedy_samples(llm, 3, 6)
    model = perturbed(llm, 0, 1.0)
    agree, ranks = teacher_forced_scores(model, samples, pad_id=1)
    assert agree == teacher_forced_agreement(model, samples, pad_id=1)
    for s, r, a in zip(samples, ranks, agree, strict=True):
        with torch.no_grad():
            hidden = model.model(torch.tensor([s.ids[:-1]])).last_hidden_state[0, s.prompt_len - 1:]
        want = token_ranks(hidden, model.get_output_embeddings().weight, None, torch.tensor(s.ids[s.prompt_len:]))
        assert r == want.tolist()
        assert [x == 0 for x in r] == a  # no ties in fp32 here: rank 0 is the argmax


def test_head_loss_weights_over_prompt_lookup() -> None:
    """``feature.lookup_weight``: every head's classification weight is lowered where prompt lookup drafts
    the LLM's token (``lookup_rank_rows``), at the pair that guesses it, and stays 1 elsewhere; at 1 the
    head trains unweighted (no weights at all), as before the setting existed."""
    from boosttune.config import FeatureConfig, TrainConfig
    from boosttune.train.pipeline import HeadData, boost_weights

    # lookup is right at answer tokens 0, 3 and 4 (tests/test_coverage.py works it out by hand)
    sample = Sample(ids=[5, 6, 7, 5, 6, 7, 8, 5, 6, 7, 9], prompt_len=5)
    data = HeadData([sample], [], [], [], torch.arange(10), 0.0, 0)
    cfg = TrainConfig(feature=FeatureConfig(lookup_weight=0.25))
    weights, by_heads, by_lookup = boost_weights(cfg, None, 1, data, {}, "cpu")  # head 1: no earlier head to read
    assert by_heads is None and by_lookup == pytest.approx(3 / 6)
    # pair j guesses answer token t = j - prompt_len + 2; the prompt's pairs keep weight 1
    want = [1.0] * 3 + [0.25, 1.0, 1.0, 0.25, 0.25, 1.0] + [1.0]
    assert weights is not None and weights[0].tolist() == want
    assert boost_weights(TrainConfig(), None, 1, data, {}, "cpu") == (None, None, None)
    with pytest.raises(ValueError, match="feature.lookup_weight"):
        FeatureConfig(lookup_weight=-0.1)
