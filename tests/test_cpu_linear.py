"""The CPU Linear forms for inference (oneDNN-packed weights, the transposed few-row form): same
numbers as F.linear, packed again when weights change, grad mode untouched, opt-out."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama
from torch import nn

from boosttune.core.models import load_model
from boosttune.serving import cpu_linear
from boosttune.serving.cpu_linear import ENV_VAR, CpuLinear
from boosttune.serving.runner import ModelRunner

needs_onednn = pytest.mark.skipif(not cpu_linear.can_pack(torch.float32), reason="torch built without oneDNN")


def _layer(bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(48, 80, bias=bias)


@pytest.mark.parametrize("mode", ["packed", "transposed"])
@pytest.mark.parametrize("bias", [False, True])
def test_fast_forms_match_f_linear_for_every_row_count(mode, bias, monkeypatch):
    monkeypatch.setenv(ENV_VAR, mode)
    layer = _layer(bias)
    plain = copy.deepcopy(layer)
    assert cpu_linear.install(layer).modules == 1 and isinstance(layer, CpuLinear)
    assert layer.mode == (mode if cpu_linear.can_pack(torch.float32) or mode == "transposed" else "transposed")
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (*range(1, 41), 96, 200):
            for shape in ((rows, 48), (1, rows, 48)):  # 2-D and 3-D (B = 1, T = rows)
                x = torch.randn(shape, generator=g)
                want = F.linear(x, plain.weight, plain.bias)
                got = layer(x)
                assert got.shape == want.shape and got.is_contiguous()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        x = torch.randn(2, 3, 48, generator=g)  # B = 2: six rows in one GEMM
        torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(48, 5, generator=g).T  # a non-contiguous input
        torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_linear.can_pack(torch.bfloat16), reason="no native bf16 on this CPU")
def test_packed_bf16_matches_f_linear(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    layer = _layer(bias=True).bfloat16()
    plain = copy.deepcopy(layer)
    cpu_linear.install(layer)
    assert layer.mode == "packed"
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for rows in (1, 3, 8, 17, 64):
            x = torch.randn(rows, 48, generator=g).bfloat16()
            got = layer(x)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), plain(x).float(), rtol=2e-2, atol=2e-2)


@needs_onednn
def test_packed_weights_follow_changes_of_the_weight(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "packed")
    layer = _layer(bias=True)
    cpu_linear.install(layer)
    x = torch.randn(4, 48)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    for _ in range(3):  # evaluate, train a step, evaluate again: the second forward sees the new weight
        with torch.no_grad():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        opt.zero_grad()
        layer(x).square().sum().backward()
        opt.step()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 48))  # in place, as load_state_dict writes
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    layer.weight = nn.Parameter(torch.randn(80, 48))  # a new tensor
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["packed", "transposed"])
def test_grad_mode_keeps_f_linear_and_its_gradients(mode, monkeypatch):
    monkeypatch.setenv(ENV_VAR, mode)
    layer = _layer(bias=True)
    plain = copy.deepcopy(layer)
    cpu_linear.install(layer)
    x = torch.randn(4, 48, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_(True)
    out, ref = layer(x), plain(x_plain)
    assert torch.equal(out, ref)  # the very same kernel: bitwise equal
    (out.square().sum()).backward()
    (ref.square().sum()).backward()
    assert torch.equal(x.grad, x_plain.grad)
    assert torch.equal(layer.weight.grad, plain.weight.grad) and torch.equal(layer.bias.grad, plain.bias.grad)
    with torch.no_grad():  # no_grad counts like inference_mode: the fast form, same numbers
        torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-5)


def test_env_zero_leaves_the_model_alone(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "0")
    llm = tiny_llama(0)
    ModelRunner(llm)
    assert not any(isinstance(m, CpuLinear) for m in llm.modules())
    assert cpu_linear.install(llm).modules == 0


def test_env_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "yes")
    with pytest.raises(ValueError, match=ENV_VAR):
        cpu_linear.install(_layer(bias=False))


def test_default_mode_packs_where_onednn_can(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    fp32, bf16, fp16 = _layer(False), _layer(False).bfloat16(), _layer(False).half()
    for layer in (fp32, bf16, fp16):
        cpu_linear.install(layer)
    assert fp32.mode == ("packed" if cpu_linear.can_pack(torch.float32) else "transposed")
    assert bf16.mode == ("packed" if cpu_linear.can_pack(torch.bfloat16) else "off")
    assert fp16.mode == "off"  # neither form: F.linear
    with torch.inference_mode():
        x = torch.randn(3, 48).half()
        assert torch.equal(fp16(x), F.linear(x, fp16.weight, fp16.bias))
    with pytest.raises(ValueError, match="mode"):
        fp32.set_mode("fast")


def test_runner_installs_once_per_model_and_keeps_hf_paths(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    llm = tiny_llama(1)
    plain = copy.deepcopy(llm)
    ModelRunner(llm)
    linears = [m for m in llm.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is CpuLinear for m in linears)
    assert cpu_linear.install(llm).modules == 0  # a second runner on the same model: nothing to do
    ModelRunner(llm)
    assert llm.state_dict().keys() == plain.state_dict().keys()
    ids = torch.tensor([[5, 9, 2, 7, 3, 11]])
    for mode in ("packed", "transposed"):
        cpu_linear.set_mode(llm, mode)
        with torch.no_grad():
            out = llm(ids, output_hidden_states=True)
            ref = plain(ids, output_hidden_states=True)
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
        for h, r in zip(out.hidden_states, ref.hidden_states, strict=True):
            torch.testing.assert_close(h, r, rtol=1e-4, atol=1e-4)
        gen = llm.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=1)
        assert gen.tolist() == plain.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=1).tolist()
    loss = llm(ids, labels=ids).loss  # training: grad mode, plain F.linear
    loss.backward()
    assert all(m.weight.grad is not None for m in linears)


def test_restricted_head_takes_the_fast_form(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    llm = tiny_llama(2)
    runner = ModelRunner(llm, head_ids=torch.tensor([3, 1, 7, 20]))
    assert isinstance(runner._head, CpuLinear)
    full = ModelRunner(copy.deepcopy(llm))
    ids = torch.tensor([5, 9, 2, 7])
    cut, ref = runner.forward_chain(ids), full.forward_chain(ids)  # (T, V) each
    torch.testing.assert_close(cut[:, [3, 1, 7, 20]], ref[:, [3, 1, 7, 20]], rtol=1e-5, atol=1e-5)
    assert torch.isinf(cut[:, 0]).all()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["packed", "transposed"])
def test_default_llm_logits_match_in_each_form(mode, monkeypatch):
    monkeypatch.setenv(ENV_VAR, mode)
    llm = load_model("default").model
    ids = torch.tensor([[1, 4093, 314, 253, 1345, 28, 359, 1090, 30, 216, 7, 42]])  # 12 rows
    with torch.inference_mode():
        ref = llm(ids).logits[0]  # (T, V)
    runner = ModelRunner(llm)
    assert isinstance(llm.lm_head, CpuLinear)
    got = runner.forward_chain(ids[0])  # (T, V), tree attention and the fast GEMMs
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_weights_made_in_inference_mode_are_packed(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with torch.inference_mode():  # e.g. a restricted head's rows cut while serving
        layer = nn.Linear(48, 80)
        cpu_linear.install(layer)
        x = torch.randn(3, 48)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_packed_layers_can_be_copied_and_pickled(monkeypatch):
    import pickle

    monkeypatch.delenv(ENV_VAR, raising=False)
    llm = tiny_llama(3)
    ModelRunner(llm).forward_chain(torch.tensor([4, 5, 6]))  # packs every layer
    for twin in (copy.deepcopy(llm), pickle.loads(pickle.dumps(llm))):
        ids = torch.tensor([[4, 5, 6]])
        with torch.no_grad():
            torch.testing.assert_close(twin(ids).logits, llm(ids).logits, rtol=1e-5, atol=1e-5)
