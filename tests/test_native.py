"""The C++ ops of serving/native_ops.cpp (built by serving/native.py) and the compiled forward's use of them."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama

from boosttune.serving import compiled as compiled_mod
from boosttune.serving import cpu_linear, native
from boosttune.serving.compiled import CompiledForward, compile_runner
from boosttune.serving.lean import LeanRunner

needs_native = pytest.mark.skipif(not native.available(), reason=f"native ops not built here: {native.reason()}")


@needs_native
@torch.inference_mode()
def test_linear_multiplies_with_the_weight_put_under_its_key() -> None:
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(24, 16, generator=g), torch.randn(3, 5, 16, generator=g)
    torch.ops.boosttune_native.put(w, 10_001, False)
    assert torch.equal(torch.ops.boosttune_native.linear(x, 10_001, 24), F.linear(x, w))
    if cpu_linear.can_pack(torch.bfloat16):  # oneDNN's packed bf16 weight: the very op the eager forward calls
        wb, xb = w.bfloat16(), x.bfloat16()
        packed = cpu_linear.pack(wb)
        torch.ops.boosttune_native.put(packed, 10_002, True)
        assert torch.equal(torch.ops.boosttune_native.linear(xb, 10_002, 24), cpu_linear.packed_linear(xb, packed))
        torch.ops.boosttune_native.drop(10_002)
    with pytest.raises(RuntimeError, match="graph expects 7"):
        torch.ops.boosttune_native.linear(x, 10_001, 7)
    torch.ops.boosttune_native.drop(10_001)
    with pytest.raises(RuntimeError, match="no weight under key 10001"):
        torch.ops.boosttune_native.linear(x, 10_001, 24)


@needs_native
def test_a_compiled_forward_holds_its_weights_in_the_native_table_until_it_is_freed() -> None:
    runner = LeanRunner(tiny_llama(12, layers=2))
    forward = CompiledForward(runner)
    keys = sorted(forward._native)
    assert len(keys) == 2 * 4 + 1  # every product of the two layers and the LM head
    x = torch.randn(1, 2, runner.model.config.hidden_size)
    torch.ops.boosttune_native.linear(x, keys[0], forward._layers_keys[0][0][1])
    del forward
    gc.collect()  # the compiled function refers back to its module: a cycle
    with pytest.raises(RuntimeError, match="no weight under key"):
        torch.ops.boosttune_native.linear(x, keys[0], 8)


@torch.inference_mode()
def test_without_the_native_ops_the_compiled_forward_calls_the_python_op(monkeypatch) -> None:
    monkeypatch.setattr(compiled_mod.native, "available", lambda: False)
    llm = tiny_llama(13, layers=2)
    runner, eager = LeanRunner(llm), LeanRunner(llm)
    compile_runner(runner)
    assert not runner.compiled._native
    prompt = torch.arange(2, 11)
    torch.testing.assert_close(runner.forward_chain(prompt), eager.forward_chain(prompt), rtol=1e-4, atol=1e-4)
    p = runner.cached_len
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    args = (torch.tensor([[5, 6, 7]]), torch.tensor([[p, p + 1, p + 1]]), p, tree)
    torch.testing.assert_close(runner.forward(*args), eager.forward(*args), rtol=1e-4, atol=1e-4)


def test_boosttune_native_0_turns_the_native_ops_off_and_says_so() -> None:
    code = "from boosttune.serving import native; print(native.available(), native.reason())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "BOOSTTUNE_NATIVE": "0"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False BOOSTTUNE_NATIVE=0"
