"""Feature heads (EAGLE-style drafters that read the LLM's features): exactness, alignment, files, training."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import local_llm, noisy_head, oracle_head, perturbed, tiny_llama
from safetensors import safe_open

from boosttune.assemble import engine_from_models
from boosttune.config import FeatureConfig, TrainConfig, from_dict
from boosttune.core.feature_head import (
    FC_ATTR,
    attach_fc,
    is_feature_dir,
    is_feature_head,
    save_fc,
    save_head,
)
from boosttune.serving.decode import incremental_generate
from boosttune.serving.engine import Plan, SpeculativeEngine
from boosttune.serving.feature_drafter import FeatureDrafter
from boosttune.serving.runner import ModelRunner
from boosttune.serving.sampling import SamplingParams
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TreeConfig
from boosttune.train.distill import Sample
from boosttune.train.feature import build_head, evaluate_head, head_losses, llm_features, train_head


def feature_engine(llm, heads, trees):
    drafters = {f"f-{i}": FeatureDrafter(ModelRunner(h)) for i, h in enumerate(heads)}
    return SpeculativeEngine(ModelRunner(llm), drafters, Plan(dict(zip(drafters, trees, strict=True))))


def test_oracle_head_has_every_draft_accepted():
    llm = local_llm(1)
    stop = StopCriteria(max_new_tokens=26)
    ref = incremental_generate(llm, [5, 6, 7], stop)
    out = feature_engine(llm, [oracle_head(llm)], [TreeConfig(widths=(1, 1, 1, 1))]).generate([5, 6, 7], stop)
    assert out.tokens == ref.tokens
    assert out.accept_lengths[:5] == [5, 5, 5, 5, 5], "pairs misaligned: the oracle head should never miss"


def test_one_token_prompt_drafts_after_the_first_step():
    llm = local_llm(2)
    stop = StopCriteria(max_new_tokens=11)
    out = feature_engine(llm, [oracle_head(llm)], [TreeConfig(widths=(1, 1))]).generate([4], stop)
    assert out.tokens == incremental_generate(llm, [4], stop).tokens
    assert out.accept_lengths[0] == 1 and max(out.accept_lengths[1:]) == 3


@pytest.mark.parametrize("tree", [TreeConfig(widths=(2, 2, 1)), TreeConfig(kind="dynamic", topk=3, depth=4, budget=10)])
@pytest.mark.parametrize("seed", range(3))
def test_noisy_heads_merged_with_an_ssm_stay_exact(tree, seed):
    llm = tiny_llama(seed, layers=2)
    heads = [noisy_head(llm, seed + 7)]
    drafters = {"feat": FeatureDrafter(ModelRunner(heads[0]))}
    from boosttune.serving.drafter import SSMDrafter
    drafters["ssm"] = SSMDrafter(ModelRunner(perturbed(llm, seed + 3, 0.2)))
    engine = SpeculativeEngine(ModelRunner(llm), drafters, Plan({"feat": tree, "ssm": TreeConfig(widths=(1, 1))}))
    prompt = list(range(3, 3 + seed + 2))
    stop = StopCriteria(max_new_tokens=30)
    assert engine.generate(prompt, stop).tokens == incremental_generate(llm, prompt, stop).tokens


def test_the_drafter_holds_the_llms_features_of_every_committed_position():
    llm = tiny_llama(4, layers=2)
    drafter = FeatureDrafter(ModelRunner(noisy_head(llm, 9)))
    engine = SpeculativeEngine(ModelRunner(llm), {"f": drafter}, Plan({"f": TreeConfig(widths=(2, 1, 1))}))
    prompt = [3, 9, 4, 11]
    out = engine.generate(prompt, StopCriteria(max_new_tokens=20))
    committed = prompt + out.tokens
    truth = llm.model(input_ids=torch.tensor([committed[:-1]])).last_hidden_state[0]
    assert drafter._features.shape == truth.shape
    torch.testing.assert_close(drafter._features, truth.float(), atol=1e-4, rtol=1e-4)


def test_sampling_with_a_feature_head_runs_and_stops():
    llm = tiny_llama(5, layers=1)
    engine = feature_engine(llm, [noisy_head(llm, 2)], [TreeConfig(widths=(2, 1))])
    out = engine.generate([3, 4], StopCriteria(max_new_tokens=15), SamplingParams(temperature=0.8, seed=3))
    assert len(out.tokens) == 15


def test_files_round_trip_and_refuse_a_bad_projection(tmp_path):
    from boosttune.core.models import load_model, tiny_model_dir
    llm = load_model(str(tiny_model_dir()))
    head = build_head(llm.model, [-1])
    save_head(head, tmp_path / "h")
    llm.tokenizer.save_pretrained(tmp_path / "h")
    assert is_feature_dir(tmp_path / "h") and hasattr(head, FC_ATTR)
    with safe_open(str(tmp_path / "h" / "model.safetensors"), "pt") as f:  # the projection lives in its own file only
        assert not [k for k in f.keys() if FC_ATTR in k]
    back = load_model(str(tmp_path / "h"))
    assert is_feature_head(back.model) and back.model.config.num_hidden_layers == 1
    torch.testing.assert_close(getattr(back.model, FC_ATTR).weight, getattr(head, FC_ATTR).weight)
    engine = engine_from_models(llm.model, {"f": back.model}, TreeConfig(widths=(1, 1)), kinds={"f": "feature"})
    assert isinstance(engine.drafters["f"], FeatureDrafter)
    wrong = copy.deepcopy(back.model)
    setattr(wrong, FC_ATTR, torch.nn.Linear(4, 2, bias=False))
    save_fc(wrong, tmp_path / "h")
    with pytest.raises(ValueError, match="feature_fc.safetensors"):
        attach_fc(copy.deepcopy(back.model), tmp_path / "h")


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_training_lowers_the_losses_on_the_llms_own_text(autocast):
    llm = tiny_llama(6, layers=2, vocab=64)
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(12):
        prompt = torch.randint(2, 64, (4,), generator=g).tolist()
        out = incremental_generate(llm, prompt, StopCriteria(max_new_tokens=24)).tokens
        samples.append(Sample(prompt + out, len(prompt)))
    feats = llm_features(llm, samples)
    head = build_head(llm, [-1])
    rows = torch.arange(64)
    before = evaluate_head(head, samples, feats, rows)
    stats = train_head(head, samples, feats, rows, FeatureConfig(minutes=0, max_steps=60, batch_tokens=256, lr=3e-3),
                       autocast=autocast)
    after = evaluate_head(head, samples, feats, rows)
    assert stats["steps"] == 60 and stats["precision"] == ("bfloat16" if autocast else "float32")
    assert all(p.dtype == torch.float32 for p in head.parameters())  # mixed precision: fp32 weights
    assert after["reg"] < 0.8 * before["reg"] and after["ce"] < before["ce"]
    assert 0 <= stats["last"]["top1"] <= 1  # measured every TOP1_EVERY steps, kept as last measured
    full = head_losses(head, samples[:2], feats[:2], rows, 0.0, depth2=True)
    lean = head_losses(head, samples[:2], feats[:2], rows, 0.0, depth2=True, top1=False)
    assert 0 <= full["top1"] <= 1 and set(full) - set(lean) == {"top1", "top1_2"}
    assert all(torch.equal(lean[k], full[k]) for k in lean)  # the diagnostic changes no loss


def test_second_training_step_is_what_serving_drafts_at_depth_2():
    """``second_step`` (training's depth 2) computes exactly the depth-1 node's output the feature
    drafter feeds when it drafts depth 2: the node reads the head's predicted feature and its token,
    one position after the last committed pair, seeing every committed pair and itself."""
    from transformers import DynamicCache

    from boosttune.core.feature_head import pair_inputs
    from boosttune.serving.runner import cache_keyword
    from boosttune.train.feature import second_step

    llm = tiny_llama(4, layers=2)
    head = noisy_head(llm, 9)
    prompt = [3, 9, 4, 11, 7, 2]
    t = len(prompt)
    feats = llm.model(input_ids=torch.tensor([prompt])).last_hidden_state[0].float()  # (T, H)
    drafter = FeatureDrafter(ModelRunner(head))
    drafter.observe(feats[: t - 1])  # the pending token's feature is not known when drafting
    tree = drafter.draft(torch.tensor(prompt), TreeConfig(widths=(1, 1)), SamplingParams(), None)
    d1 = int(tree.tokens[0])
    ids = torch.tensor([prompt + [d1]])
    with torch.no_grad():
        cache = DynamicCache(config=head.config)
        body = head.base_model
        hidden = body(inputs_embeds=pair_inputs(head, feats[None], ids[:, 1:]), position_ids=torch.arange(t)[None],
                      use_cache=True, **{cache_keyword(body.forward): cache}).last_hidden_state
        second = second_step(head, cache, hidden, ids[:, 1:])
    assert second.shape == (1, t - 1, hidden.shape[-1])
    torch.testing.assert_close(hidden[0, t - 2], drafter._node_hidden[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second[0, t - 2], drafter._node_hidden[0], atol=1e-5, rtol=1e-5)


def test_training_the_second_step_lowers_its_loss():
    """``feature.depth2_weight`` trains the head on its own predicted features: its depth-2 loss ends
    lower than a head trained on depth 1 alone, from the same start and batches."""
    llm = tiny_llama(6, layers=2, vocab=64)
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(12):
        prompt = torch.randint(2, 64, (4,), generator=g).tolist()
        samples.append(Sample(prompt + incremental_generate(llm, prompt, StopCriteria(max_new_tokens=24)).tokens,
                              len(prompt)))
    feats = llm_features(llm, samples)
    rows = torch.arange(64)
    after = {}
    for w in (0.0, 1.0):
        torch.manual_seed(0)
        head = build_head(llm, [-1])
        cfg = FeatureConfig(minutes=0, max_steps=60, batch_tokens=256, lr=3e-3, depth2_weight=w)
        train_head(head, samples, feats, rows, cfg)
        after[w] = evaluate_head(head, samples, feats, rows)
    assert after[1.0]["ce2"] < 0.9 * after[0.0]["ce2"], after
    assert after[1.0]["top1_2"] >= after[0.0]["top1_2"], after
    with pytest.raises(ValueError, match="depth2_weight"):
        FeatureConfig(depth2_weight=-1)


def test_prompt_weight_adds_the_prompts_targets_and_zero_keeps_answers_only():
    """``feature.prompt_weight``: 0 is the answers-only cross-entropy whatever the prompt pairs' targets
    say; above 0 those targets (the LLM's distribution there) enter the loss; ``top1`` stays the answers'."""
    from boosttune.train.feature import _step_losses

    g = torch.Generator().manual_seed(1)
    hidden, f_out, w = torch.randn(1, 6, 8, generator=g), torch.randn(1, 6, 8, generator=g), torch.randn(16, 8, generator=g)
    valid = torch.ones(1, 6, dtype=torch.bool)
    cont = torch.tensor([[False, False, True, True, True, True]])
    changed = f_out.clone()
    changed[0, 1] = torch.randn(8, generator=g) * 3  # a prompt pair's target
    base, moved = (_step_losses(hidden, x, valid, cont, w, "") for x in (f_out, changed))
    with_p, moved_p = (_step_losses(hidden, x, valid, cont, w, "", 1.0) for x in (f_out, changed))
    assert float(base["ce"]) == pytest.approx(float(moved["ce"]))  # the prompt's targets do not count at 0
    assert float(with_p["ce"]) != pytest.approx(float(moved_p["ce"]))  # ... and do above 0
    assert float(with_p["ce"]) != pytest.approx(float(base["ce"]))
    assert float(with_p["top1"]) == float(base["top1"])
    half = _step_losses(hidden, f_out, valid, cont, w, "", 0.5)["ce"]  # a weighted mean between the two
    assert min(float(base["ce"]), float(with_p["ce"])) < float(half) < max(float(base["ce"]), float(with_p["ce"]))
    with pytest.raises(ValueError, match="prompt_weight"):
        FeatureConfig(prompt_weight=-1.0)


def test_classification_losses_are_what_they_say():
    """``feature.loss``: ``kl`` is the soft cross-entropy (forward KL plus p's entropy), ``ce`` the
    cross-entropy on p's argmax, ``tv`` one minus the mass p and q share (zero exactly when q = p, the
    rejection probability of speculative sampling), ``kl+tv`` their sum; an unknown name is refused."""
    from boosttune.train.feature import classification_loss

    g = torch.Generator().manual_seed(2)
    pred, other = torch.randn(5, 12, generator=g), torch.randn(5, 12, generator=g) * 2
    p, q = torch.softmax(other, -1), torch.softmax(pred, -1)
    kl = classification_loss(pred, p, "kl")
    entropy = -(p * p.log()).sum(-1)
    assert torch.allclose(kl - entropy, (p * (p.log() - q.log())).sum(-1), atol=1e-5)
    assert torch.allclose(classification_loss(pred, p, "ce"), -q.log()[torch.arange(5), p.argmax(-1)], atol=1e-6)
    tv = classification_loss(pred, p, "tv")
    assert torch.allclose(tv, 0.5 * (p - q).abs().sum(-1), atol=1e-6)
    assert torch.allclose(classification_loss(other, p, "tv"), torch.zeros(5), atol=1e-6)
    assert torch.allclose(classification_loss(pred, p, "kl+tv"), kl + tv, atol=1e-5)
    pred.requires_grad_(True)
    classification_loss(pred, p, "tv").sum().backward()
    assert pred.grad is not None and pred.grad.abs().sum() > 0  # it trains
    with pytest.raises(ValueError, match="feature.loss"):
        classification_loss(pred, p, "js")
    with pytest.raises(ValueError, match="loss"):
        from_dict(TrainConfig, {"feature": {"loss": "js"}})


def test_pair_weights_put_each_answer_weight_on_the_pair_that_guesses_it():
    """Answer token t is guessed by pair ``prompt_len + t - 2`` (:func:`teacher_forced_ranks`); every other
    pair (the prompt's, and an answer token the sample has no pair for) keeps weight 1."""
    from boosttune.train.feature import pair_weights

    s = Sample([5, 6, 7, 8, 9, 10], 3)  # answer tokens 8, 9, 10: pairs 1, 2, 3 guess them; pair 4 guesses past the end
    (w,) = pair_weights([s], [[0.1, 0.5, 0.2]])
    assert w.tolist() == pytest.approx([1.0, 0.1, 0.5, 0.2, 1.0])
    (w1,) = pair_weights([Sample([5, 6, 7], 1)], [[0.3, 0.4]])  # a one-token prompt: answer token 0 has no pair
    assert w1.tolist() == pytest.approx([0.4, 1.0])


def test_boosting_weights_steer_the_loss_and_ones_change_nothing():
    """``head_losses(weights=...)``: all-ones weights give the unweighted losses bit for bit; a pair at
    weight 0 leaves the classification loss whatever its target, and the regression never weighs pairs."""
    llm = tiny_llama(6, layers=2, vocab=64)
    g = torch.Generator().manual_seed(3)
    samples = [Sample(torch.randint(2, 64, (10,), generator=g).tolist(), 4) for _ in range(2)]
    feats = llm_features(llm, samples)
    head, rows = build_head(llm, [-1]), torch.arange(64)
    plain = head_losses(head, samples, feats, rows, 0.0, depth2=True)
    ones = head_losses(head, samples, feats, rows, 0.0, depth2=True, weights=[torch.ones(9), torch.ones(9)])
    assert all(torch.equal(plain[k], ones[k]) for k in plain)
    zero = [torch.ones(9), torch.ones(9)]
    zero[0][8] = 0.0  # sample 0's last pair: its target feature is no pair's input
    moved = [f.clone() for f in feats]
    moved[0][9] = torch.randn(moved[0].shape[1], generator=g) * 5  # that pair's target feature
    a = head_losses(head, samples, feats, rows, 0.0, weights=zero)
    b = head_losses(head, samples, moved, rows, 0.0, weights=zero)
    assert float(a["ce"].detach()) == pytest.approx(float(b["ce"].detach()), rel=1e-6)  # weight 0: the target does not count
    assert float(a["reg"]) != pytest.approx(float(b["reg"]))  # ... while the regression still sees it
    assert float(a["ce"]) != pytest.approx(float(plain["ce"]))


def test_answer_ranks_are_serving_ranks_and_an_oracle_covers_everything():
    """:func:`answer_ranks` is the depth-1 rank serving sees: the oracle head (the LLM's own next
    feature) ranks every greedy answer token first, so boosting after it weighs every answer token down."""
    from boosttune.train.coverage import token_weights
    from boosttune.train.feature import answer_ranks, pair_weights

    llm = local_llm(1)
    head = oracle_head(llm)
    prompt = [3, 9, 4, 11, 7]
    s = Sample(prompt + incremental_generate(llm, prompt, StopCriteria(max_new_tokens=12)).tokens, len(prompt))
    feats = llm_features(llm, [s])
    (ranks,) = answer_ranks(head, [s], feats, None)
    assert len(ranks) == 12 and ranks == [0] * 12
    (w,) = pair_weights([s], token_weights([ranks], 1, 0.25))
    assert w[len(prompt) - 2 : len(prompt) + 10].tolist() == pytest.approx([0.25] * 12)
    assert w[: len(prompt) - 2].tolist() == pytest.approx([1.0] * (len(prompt) - 2))


def test_feature_boost_settings_are_checked():
    with pytest.raises(ValueError, match="feature.heads"):
        FeatureConfig(heads=0)
    with pytest.raises(ValueError, match="feature.boost"):
        FeatureConfig(boost="match")
    with pytest.raises(ValueError, match="feature.covered_weight"):
        FeatureConfig(covered_weight=1.5)
