"""The CPU GEMM-layout choice for few-row Linear inputs: same numbers as F.linear, opt-out, hook."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama
from torch import nn

from boosttune.core.models import load_model
from boosttune.serving import cpu_linear
from boosttune.serving.cpu_linear import ENV_VAR, MAX_ROWS, SkinnyLinear
from boosttune.serving.runner import ModelRunner


def _layer(bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(48, 80, bias=bias)


@pytest.mark.parametrize("bias", [False, True])
def test_forced_layout_matches_f_linear_for_every_row_count(bias, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    layer = _layer(bias)
    plain = copy.deepcopy(layer)
    assert cpu_linear.install(layer).modules == 1 and isinstance(layer, SkinnyLinear)
    assert layer.layout_rows() == frozenset(range(2, MAX_ROWS + 1))
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in range(1, 41):
            for shape in ((rows, 48), (1, rows, 48)):  # 2-D and 3-D (B = 1, T = rows)
                x = torch.randn(shape, generator=g)
                want = F.linear(x, plain.weight, plain.bias)
                got = layer(x)
                assert got.shape == want.shape and got.is_contiguous()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        x = torch.randn(2, 3, 48, generator=g)  # B = 2: six rows in one GEMM
        torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(5, 48, generator=g)
        torch.testing.assert_close(cpu_linear.transposed_linear(x, layer.weight, layer.bias), plain(x),
                                   rtol=1e-5, atol=1e-5)


def test_grad_mode_keeps_f_linear_and_its_gradients(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
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
    with torch.no_grad():  # no_grad counts like inference_mode: the transposed form, same numbers
        torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-5)


def test_env_zero_leaves_the_model_alone(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "0")
    llm = tiny_llama(0)
    ModelRunner(llm)
    assert not any(isinstance(m, SkinnyLinear) for m in llm.modules())
    assert cpu_linear.install(llm).modules == 0
    w = torch.randn(8, 4)
    assert cpu_linear.transposed_rows(w) == frozenset()


def test_env_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "yes")
    with pytest.raises(ValueError, match=ENV_VAR):
        cpu_linear.install(_layer(bias=False))


def test_default_transposes_fp32_weights_only(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert cpu_linear.transposed_rows(torch.randn(8, 4)) == frozenset(range(2, MAX_ROWS + 1))
    assert cpu_linear.transposed_rows(torch.randn(8, 4).bfloat16()) == frozenset()


def test_calibration_is_bounded_and_cached(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "auto")
    weight = torch.randn(1536, 576)  # SmolLM2-135M's MLP up-projection
    chosen = cpu_linear.calibrate(weight, budget_s=0.05)
    assert chosen <= frozenset(range(2, MAX_ROWS + 1))
    first = cpu_linear.transposed_rows(weight)
    assert cpu_linear.transposed_rows(torch.randn(1536, 576)) is first  # same key: no second timing
    assert cpu_linear.calibrate(torch.randn(0, 4)) == frozenset()


def test_runner_installs_once_per_model_and_keeps_hf_paths(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    llm = tiny_llama(1)
    plain = copy.deepcopy(llm)
    ModelRunner(llm)
    linears = [m for m in llm.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is SkinnyLinear for m in linears)
    assert cpu_linear.install(llm).modules == 0  # a second runner on the same model: nothing to do
    ModelRunner(llm)
    assert llm.state_dict().keys() == plain.state_dict().keys()
    monkeypatch.setenv(ENV_VAR, "1")  # force the transposed form on every layer for what follows
    for m in linears:
        m.forget_layout()
    ids = torch.tensor([[5, 9, 2, 7, 3, 11]])
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


@pytest.mark.slow
def test_default_llm_logits_match_with_the_layout_forced(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    llm = load_model("default").model
    ids = torch.tensor([[1, 4093, 314, 253, 1345, 28, 359, 1090, 30, 216, 7, 42]])  # 12 rows
    with torch.inference_mode():
        ref = llm(ids).logits[0]  # (T, V)
    runner = ModelRunner(llm)
    assert isinstance(llm.lm_head, SkinnyLinear)
    got = runner.forward_chain(ids[0])  # (T, V), tree attention and the transposed GEMMs
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
