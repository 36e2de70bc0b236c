"""EAGLE-3 heads: the layer against transformers' own, the training-time-test unroll against explicit
chains, training, the Hugging Face files and the llama.cpp GGUF."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import greedy_samples, tiny_llama

from boosttune.config import Eagle3Config
from boosttune.core.eagle3_head import Eagle3Head, Eagle3Spec, default_layers, is_eagle3_dir, load_head
from boosttune.train.distill import Sample
from boosttune.train.eagle3 import (
    chain_accepts,
    eagle3_ranks,
    evaluate_eagle3,
    init_head,
    layer_features,
    make_batch,
    train_eagle3,
    ttt_losses,
)

LAYERS = (0, 1, 3)


@pytest.fixture(scope="module")
def llm4():
    return tiny_llama(11, layers=4)


def _spec(llm, k: int = 24) -> Eagle3Spec:
    return Eagle3Spec.from_llm(llm.config, k, LAYERS)


def _rows(k: int = 24) -> torch.Tensor:
    return torch.arange(64)[torch.randperm(64, generator=torch.Generator().manual_seed(0))][:k].sort().values


def _samples(n: int = 6, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 9 + 3 * i
        out.append(Sample(ids=torch.randint(2, 64, (length,), generator=g).tolist(), prompt_len=3 + i % 3))
    return out


def _noisy(head: Eagle3Head, seed: int = 1) -> Eagle3Head:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.3 * (p.std() + 0.1))
    return head.eval()


def test_default_layers_and_spec_checks(llm4):
    assert default_layers(32) == (2, 16, 31)
    with pytest.raises(ValueError, match="at least 4 layers"):
        default_layers(3)
    with pytest.raises(ValueError, match="eagle3.layers"):
        Eagle3Spec.from_llm(llm4.config, 8, (0, 1, 4))
    with pytest.raises(ValueError, match="eagle3.depth"):
        Eagle3Config(depth=0)
    with pytest.raises(ValueError, match="eagle3.layers"):
        Eagle3Config(layers=[1, 2])


def test_layer_features_are_layer_inputs(llm4):
    s = _samples(1)[0]
    f = layer_features(llm4, [s], LAYERS)[0]
    with torch.no_grad():
        out = llm4(input_ids=torch.tensor([s.ids]), output_hidden_states=True)
    # transformers' hidden_states[i] is layer i's input (i < n_layers); the last is after the final norm
    want = torch.cat([out.hidden_states[i][0] for i in LAYERS], -1)
    torch.testing.assert_close(f.aux.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(f.final.float(), out.hidden_states[-1][0], atol=2e-2, rtol=2e-2)


def test_step_zero_is_the_llm_layer_when_it_reads_only_g(llm4):
    """With q/k/v reading only the state half and fc passing layer 3's input through, step 0 must
    reproduce transformers' layer 3 (rotary, grouped attention, residual, MLP all checked)."""
    head = init_head(llm4, _spec(llm4), _rows()).eval()
    last = llm4.model.layers[3]
    h = llm4.config.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(head, name).weight.copy_(torch.cat([torch.zeros_like(w := getattr(last.self_attn, name).weight), w], 1))
    s = _samples(1)[0]
    with torch.no_grad():
        out = llm4(input_ids=torch.tensor([s.ids]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][:, :-1] for i in LAYERS], -1)  # pairs 0 .. L-2
        state = head.unroll(aux, torch.tensor([s.ids[1:]]), 1)[0]
        got = head.norm(state)  # the head's final norm is the LLM's
    torch.testing.assert_close(got, out.hidden_states[-1][:, :-1], atol=1e-4, rtol=1e-4)
    assert head.spec.hidden == h


def _explicit_chain(head: Eagle3Head, aux, tokens, j: int, depth: int) -> list[torch.Tensor]:
    """A chain from pair j drafted step by step with an explicit key/value list (no masks)."""
    s = head.spec
    group = s.heads // s.kv_heads
    n = tokens.shape[1]
    pos = torch.arange(n)[None]
    g = head.fc(aux)
    _, k0, v0 = head.qkv(tokens, g, pos)
    keys, vals = [k0[:, :, : j + 1]], [v0[:, :, : j + 1]]
    state = g[:, j : j + 1]
    out = []
    for step in range(depth):
        if j + step >= n:
            break
        q, k, v = head.qkv(tokens[:, j + step : j + step + 1], state, torch.tensor([[j + step]]))
        if step:
            keys.append(k)
            vals.append(v)
        kk = torch.cat(keys, 2).repeat_interleave(group, 1)
        vv = torch.cat(vals, 2).repeat_interleave(group, 1)
        p = torch.softmax((q @ kk.transpose(-1, -2)) * s.head_dim ** -0.5, -1)
        state = head.finish(p @ vv, state)
        out.append(state[0, 0])
    return out


def test_unroll_equals_explicit_chains(llm4):
    head = _noisy(init_head(llm4, _spec(llm4), _rows()))
    s = _samples(1, seed=3)[0]
    b = make_batch([s], layer_features(llm4, [s], LAYERS))
    with torch.no_grad():
        states = head.unroll(b.aux, b.tokens, 3)
        n = b.tokens.shape[1]
        for j in (0, 2, n - 3, n - 1):
            chain = _explicit_chain(head, b.aux, b.tokens, j, 3)
            for step, want in enumerate(chain):
                torch.testing.assert_close(states[step][0, j], want, atol=1e-5, rtol=1e-5)
    # a negative control: step 1 is not step 0 shifted (the chain's own key matters)
    assert not torch.allclose(states[1][0, 0], states[0][0, 1], atol=1e-3)


def test_padding_does_not_change_a_sample(llm4):
    head = _noisy(init_head(llm4, _spec(llm4), _rows()))
    a, b = _samples(2, seed=5)
    fa, fb = layer_features(llm4, [a, b], LAYERS)
    w = llm4.lm_head.weight[_rows()]
    with torch.no_grad():
        alone = head.unroll(make_batch([a], [fa]).aux, make_batch([a], [fa]).tokens, 3)
        both = make_batch([a, b], [fa, fb])
        padded = head.unroll(both.aux, both.tokens, 3)
        m = len(a.ids) - 1
        for step in range(3):
            torch.testing.assert_close(padded[step][0, : m - step], alone[step][0, : m - step], atol=1e-5, rtol=1e-5)
        assert set(ttt_losses(head, both, w, 3)) == {"ce0", "ce1", "ce2", "loss"}


def test_training_lowers_the_loss_and_raises_acceptance(llm4):
    rows = torch.arange(64)  # the whole vocabulary: every token can be drafted
    head = init_head(llm4, _spec(llm4, 64), rows)
    samples = greedy_samples(llm4)  # the LLM's own greedy continuations: what the teacher writes
    feats = layer_features(llm4, samples, LAYERS)
    w = llm4.lm_head.weight.detach()[rows]
    cfg = Eagle3Config(enabled=True, minutes=0, max_steps=60, depth=3, lr=5e-3, batch_tokens=128)
    before = evaluate_eagle3(head, samples, feats, 3)
    with torch.no_grad():
        first = float(ttt_losses(head, make_batch(samples, feats), w, 3)["loss"])
    stats = train_eagle3(head, samples, feats, w, cfg)
    after = evaluate_eagle3(head, samples, feats, 3)
    with torch.no_grad():
        last = float(ttt_losses(head, make_batch(samples, feats), w, 3)["loss"])
    assert stats["steps"] == 60 and last < 0.7 * first
    assert after["tau"] > before["tau"] and 1.0 <= after["tau"] <= 4.0
    assert after["accept_rate"] == sorted(after["accept_rate"], reverse=True)
    bf16 = train_eagle3(head, samples, feats, w, Eagle3Config(enabled=True, minutes=0, max_steps=2, batch_tokens=128),
                        autocast=torch.bfloat16)  # as the pipeline trains where the CPU has native bf16
    assert bf16["precision"] == "bfloat16" and bf16["last"]["loss"] > 0
    acc = chain_accepts(head, samples[0], feats[0], 3)
    s0 = samples[0]
    ranks = eagle3_ranks(head, feats[0].aux.float(), s0.ids, s0.prompt_len)  # depth 1, as coverage reads it
    assert ranks.shape == (len(s0.ids) - s0.prompt_len,)
    assert torch.equal(ranks == 0, acc[: len(ranks)] > 0)  # rank 0 where the chain's first draft is right
    assert len(acc) == len(samples[0].ids) - 1 - max(0, samples[0].prompt_len - 2)


def test_hf_files_round_trip(llm4, tmp_path):
    rows = _rows()
    head = _noisy(init_head(llm4, _spec(llm4), rows))
    head.save(tmp_path, {"llm_ref": "tiny"})
    assert is_eagle3_dir(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 24 and config["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "model.safetensors"))
    assert state["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # reads [norm(e), norm(g)]
    assert state["fc.weight"].shape == (32, 96)
    torch.testing.assert_close(state["d2t"] + torch.arange(24), rows)  # offsets, as EAGLE-3 stores them
    assert int(state["t2d"].sum()) == 24 and bool(state["t2d"][rows].all())
    back = load_head(tmp_path, llm4.get_input_embeddings().weight).eval()
    s = _samples(1)[0]
    b = make_batch([s], layer_features(llm4, [s], LAYERS))
    with torch.no_grad():
        for x, y in zip(head.unroll(b.aux, b.tokens, 2), back.unroll(b.aux, b.tokens, 2), strict=True):
            torch.testing.assert_close(head.logits(x), back.logits(y))
    with pytest.raises(ValueError, match="embeddings"):
        load_head(tmp_path, torch.zeros(10, 32))
    (tmp_path / "eagle3_head.json").write_text("{}")
    with pytest.raises(ValueError, match="marker"):
        load_head(tmp_path, llm4.get_input_embeddings().weight)


def test_gguf_has_what_llama_cpp_reads(llm4, tmp_path):
    import gguf

    from boosttune.export.gguf import GGUFField, rope_to_ggml, write_eagle3_gguf

    rows = _rows()
    head = _noisy(init_head(llm4, _spec(llm4), rows))
    head.save(tmp_path / "head")
    tokens = GGUFField([f"t{i}".encode() for i in range(64)], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)
    path = tmp_path / "eagle3.f32.gguf"
    write_eagle3_gguf(tmp_path / "head", "tiny", {"tokenizer.ggml.tokens": tokens}, path, "f32")
    r = gguf.GGUFReader(path)
    f = r.fields
    assert bytes(f["general.architecture"].parts[-1]).decode() == "eagle3"
    assert [int(f["eagle3.target_layers"].parts[i][0]) for i in f["eagle3.target_layers"].data] == list(LAYERS)
    assert int(f["eagle3.target_hidden_size"].parts[-1][0]) == 32 and int(f["eagle3.block_count"].parts[-1][0]) == 1
    assert not bool(f["eagle3.norm_before_residual"].parts[-1][0])
    t = {x.name: x for x in r.tensors}
    assert "token_embd.weight" not in t  # llama.cpp embeds with the LLM's
    assert {"fc.weight", "blk.0.attn_norm_2.weight", "output.weight", "output_norm.weight", "d2t"} <= set(t)
    assert list(t["d2t"].data) == rows.tolist()  # absolute LLM ids
    q = head.q_proj.weight.detach().numpy()
    assert (t["blk.0.attn_q.weight"].data == rope_to_ggml(q, 4)).all()  # GGML's rotary row order
    assert (t["blk.0.attn_norm_2.weight"].data == head.hidden_norm.weight.detach().numpy()).all()
    assert (t["output.weight"].data == head.lm_head.weight.detach().numpy()).all()
    bad = {"tokenizer.ggml.tokens": GGUFField([b"x"] * 10, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)}
    with pytest.raises(ValueError, match="--llm-gguf"):
        write_eagle3_gguf(tmp_path / "head", "tiny", bad, tmp_path / "bad.gguf", "f32")
