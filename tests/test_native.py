"""The C++ ops of serving/native_ops.cpp (built by serving/native.py) and the compiled forward's use of them."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import load_script, tiny_llama

from boosttune.serving import compiled as compiled_mod
from boosttune.serving import cpu_linear, native, quantize
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


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_mm_computes_torchs_int8_product_and_each_row_alone(dtype) -> None:
    """37 outputs (a last block of one), 1 to 9 rows (every row block and its tail): the product of the
    inputs and the scaled codes, as torch's kernel gives it, and each row the same bit for bit whatever
    rows share the call, so a tree's rows round as a plain step's."""
    g = torch.Generator().manual_seed(3)
    codes, scales = quantize.int8_codes(torch.randn(37, 64, generator=g))
    scales = scales.to(dtype)
    x = torch.randn(9, 64, generator=g).to(dtype)
    ours = torch.ops.boosttune_native.int8_mm(x, codes, scales)
    assert ours.shape == (9, 37) and ours.dtype == dtype
    want = x.float() @ (codes.float() * scales.float()[:, None]).T
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.float(), want, rtol=tol, atol=tol * float(want.abs().max()))
    torch.testing.assert_close(ours, torch.ops.aten._weight_int8pack_mm(x, codes, scales), rtol=tol,
                               atol=tol * float(want.abs().max()))
    for rows in range(1, 9):
        for r in range(0, 9 - rows + 1, 3):
            assert torch.equal(torch.ops.boosttune_native.int8_mm(x[r : r + rows], codes, scales), ours[r : r + rows])


@needs_native
def test_int8_mm_refuses_what_it_cannot_multiply_and_quantize_falls_back() -> None:
    codes, scales = quantize.int8_codes(torch.randn(8, 36))  # 36: no multiple of 8 (AVX2) or 16 (AVX512) lanes
    with pytest.raises(RuntimeError, match="multiple of"):
        torch.ops.boosttune_native.int8_mm(torch.randn(2, 36), codes, scales)
    with pytest.raises(RuntimeError, match="scales must be in the inputs' dtype"):
        torch.ops.boosttune_native.int8_mm(torch.randn(2, 48), quantize.int8_codes(torch.randn(8, 48))[0],
                                           scales.bfloat16())
    # in_features the kernel does not take (36): quantize.int8_mm uses torch's kernel instead
    x = torch.randn(3, 36)
    torch.testing.assert_close(quantize.int8_mm(x, codes, scales), x @ (codes.float() * scales[:, None]).T,
                               rtol=1e-5, atol=1e-4)
    assert quantize.native_int8() == bool(torch.ops.boosttune_native.int8_vectorised())


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [64, 576, 1536])
def test_w8a8_mm_computes_the_reference_and_each_row_alone(dtype, in_features) -> None:
    """int8 inputs per block (one block of 64; 3 of 192; 6 of 256), 37 outputs (a last block of one), 1 to
    9 rows: what ``w8a8_reference`` computes from the same codes, near the unquantized product, and each
    row bit for bit the same whatever rows share the call. A zero row gives zeros; an outlier coarsens
    only its own block."""
    if not torch.ops.boosttune_native.w8a8_vectorised():
        pytest.skip("w8a8_mm is not vectorised on this CPU")
    g = torch.Generator().manual_seed(4)
    codes, scales = quantize.int8_codes(torch.randn(37, in_features, generator=g))
    packed = (codes.to(torch.int16) + 128).to(torch.uint8)
    x = torch.randn(9, in_features, generator=g)
    x[2] = 0
    x[4, 3] = 40.0  # an outlier in the first block of row 4
    x = x.to(dtype)
    block = quantize.w8a8_block(in_features)
    ours = torch.ops.boosttune_native.w8a8_mm(x, packed, scales, block)
    assert ours.shape == (9, 37) and ours.dtype == dtype
    assert not ours[2].any()
    ref = quantize.w8a8_reference(x, packed, scales)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.float(), ref.float(), rtol=tol, atol=tol * float(ref.float().abs().max()))
    exact = x.float() @ (codes.float() * scales[:, None]).T  # the inputs unquantized: ~1 % off
    err = float((ours.float() - exact).norm() / exact.norm())
    assert 1e-4 < err < 0.03
    codes_x, xs = quantize.w8a8_codes(x, block)
    if in_features > block:  # the outlier's scale is its block's alone
        assert float(xs[4, 0]) > 10 * float(xs[4, 1])
    for rows in range(1, 9):
        for r in range(0, 9 - rows + 1, 3):
            assert torch.equal(torch.ops.boosttune_native.w8a8_mm(x[r : r + rows], packed, scales, block),
                               ours[r : r + rows])
    assert torch.equal(quantize.w8a8_mm(x, packed, scales), ours)
    # a prompt's many rows (AMX: passes of 16 rows over each group's weights, two at a time, the inputs laid
    # out on every thread): an odd count of passes, the last partial; and enough rows to split across threads
    for n in (33, 49, 200):
        many = torch.cat([x] * (n // 9) + [x[: n % 9]]).to(dtype)
        out = torch.ops.boosttune_native.w8a8_mm(many, packed, scales, block)
        assert torch.equal(out, torch.cat([ours] * (n // 9) + [ours[: n % 9]]))


@needs_native
def test_w8a8_mm_refuses_what_it_cannot_multiply() -> None:
    codes, scales = quantize.int8_codes(torch.randn(8, 128))
    packed = (codes.to(torch.int16) + 128).to(torch.uint8)
    with pytest.raises(RuntimeError, match="uint8 weights"):
        torch.ops.boosttune_native.w8a8_mm(torch.randn(2, 128), codes, scales, 128)
    with pytest.raises(RuntimeError, match="the block must divide in_features"):
        torch.ops.boosttune_native.w8a8_mm(torch.randn(2, 128), packed, scales, 96)
    with pytest.raises(RuntimeError, match="fp32 scales"):
        torch.ops.boosttune_native.w8a8_mm(torch.randn(2, 128), packed, scales.bfloat16(), 128)
    assert quantize.native_w8a8() == bool(torch.ops.boosttune_native.w8a8_vectorised())


def test_the_native_build_is_named_for_its_cpu() -> None:
    """A cache shared by machines with other CPUs must not load code built for another's instructions."""
    digest = native.cpu_digest()
    assert len(digest) == 8 and int(digest, 16) >= 0 and digest == native.cpu_digest()


def test_boosttune_native_0_turns_the_native_ops_off_and_says_so() -> None:
    code = "from boosttune.serving import native; print(native.available(), native.reason())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "BOOSTTUNE_NATIVE": "0"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False BOOSTTUNE_NATIVE=0"


@needs_native
def test_w8a8_mm_on_the_vector_path_where_amx_is_kept_off() -> None:
    """BOOSTTUNE_AMX=0: the vector path (VNNI, or int16 products) computes the same product, each row
    alone, in a process of its own (the path is chosen once per process)."""
    if torch.ops.boosttune_native.w8a8_isa() != "amx":
        pytest.skip("no AMX here: the other w8a8 tests run the vector path already")
    env = {**os.environ, "BOOSTTUNE_AMX": "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging",
                          f"{__file__}::test_w8a8_mm_computes_the_reference_and_each_row_alone"],
                         env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__))
    assert out.returncode == 0, out.stdout[-2000:]
    assert "6 passed" in out.stdout
    code = "from boosttune.serving import native; native.available(); import torch; print(torch.ops.boosttune_native.w8a8_isa())"
    isa = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert isa.strip() in ("vnni", "avx-int16")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("c", [64, 8])
def test_attend_rows_computes_attention_each_row_alone_over_its_visible_keys_in_order(dtype, c) -> None:
    """softmax(scale q k^T) v as torch's attention (fp64) gives it; a row that sees no key gives zeros; and
    a row's output is bit for bit the same fed alone, and with its visible keys moved to other slots among
    masked ones (a tree's nodes sit at scattered slots; a plain step's keys are contiguous)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 5, c, generator=g).to(dtype)
    k = torch.randn(2, 3, 40, c, generator=g).to(dtype)
    v = torch.randn(2, 3, 40, c, generator=g).to(dtype)
    mask = torch.rand(2, 1, 5, 40, generator=g) > 0.3
    mask[0, 0, 1] = False
    ours = torch.ops.boosttune_native.attend_rows(q, k, v, mask, 0.125)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=0.125)
    want[0, :, 1] = 0
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.double(), want, rtol=tol, atol=tol)
    assert not ours[0, :, 1].any()
    alone = torch.ops.boosttune_native.attend_rows(q[:, :, 3:4], k, v, mask[:, :, 3:4], 0.125)
    assert torch.equal(alone, ours[:, :, 3:4])
    # row 3's visible keys packed to the front of a cache of another length, nothing masked between them
    vis = mask[1, 0, 3].nonzero().flatten()
    packed_k = torch.zeros(1, 3, len(vis) + 7, c, dtype=dtype)
    packed_v = torch.zeros_like(packed_k)
    packed_k[0, :, : len(vis)], packed_v[0, :, : len(vis)] = k[1][:, vis], v[1][:, vis]
    front = torch.zeros(1, 1, 1, len(vis) + 7, dtype=torch.bool)
    front[..., : len(vis)] = True
    moved = torch.ops.boosttune_native.attend_rows(q[1:2, :, 3:4], packed_k, packed_v, front, 0.125)
    assert torch.equal(moved, ours[1:2, :, 3:4])
    # a (M, L) mask and none at all
    two = torch.ops.boosttune_native.attend_rows(q[:1], k[:1], v[:1], mask[0, 0], 0.125)
    assert torch.equal(two, ours[:1])
    full = torch.ops.boosttune_native.attend_rows(q, k, v, None, 0.125)
    torch.testing.assert_close(full.double(), F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.125),
                               rtol=tol, atol=tol)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_rows_gives_rows_that_share_a_mask_what_each_gets_alone(dtype) -> None:
    """Rows of one kv head that see the same keys (a token's query heads, folded ``t`` rows apart) are
    attended together, reading each key once for the set: each row's output is bit for bit what it gets
    fed alone, whichever rows share its set, and near fp64 attention."""
    g = torch.Generator().manual_seed(6)
    rep, t, keys, c = 3, 4, 70, 64
    q = torch.randn(2, 3, rep * t, c, generator=g).to(dtype)
    k = torch.randn(2, 3, keys, c, generator=g).to(dtype)
    v = torch.randn(2, 3, keys, c, generator=g).to(dtype)
    token_mask = torch.rand(2, 1, t, keys, generator=g) > 0.2  # per token
    token_mask[..., 0] = True
    mask = token_mask.repeat(1, 1, rep, 1)  # heads folded: row h * t + j is token j's head h
    ours = torch.ops.boosttune_native.attend_rows(q, k, v, mask, 0.125)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.double(), want, rtol=tol, atol=tol)
    for row in (0, 5, rep * t - 1):
        alone = torch.ops.boosttune_native.attend_rows(q[:, :, row : row + 1], k, v, mask[:, :, row : row + 1], 0.125)
        assert torch.equal(alone, ours[:, :, row : row + 1])
    two = torch.ops.boosttune_native.attend_rows(q[:, :, [1, 1 + t]], k, v, mask[:, :, [1, 1 + t]], 0.125)
    assert torch.equal(two, ours[:, :, [1, 1 + t]])


@needs_native
@pytest.mark.parametrize("rows", [3, 9, 12, 48])
def test_attend_is_attention_on_either_path(rows) -> None:
    """``attend`` (bf16 serving's attention): the row-by-row kernel for up to 9 rows per kv head, torch's
    flash attention above; either way softmax(scale q k^T) v over the visible keys, as in fp64."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(4, 3, rows, 64, generator=g).bfloat16()
    k = torch.randn(4, 3, 90, 64, generator=g).bfloat16()
    v = torch.randn(4, 3, 90, 64, generator=g).bfloat16()
    mask = torch.rand(4, 1, rows, 90, generator=g) > 0.4
    mask[..., 0] = True
    ours = torch.ops.boosttune_native.attend(q, k, v, mask, 0.125)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=0.125)
    torch.testing.assert_close(ours.double(), want, rtol=2e-2, atol=2e-2)
    if rows <= 9:
        assert torch.equal(ours, torch.ops.boosttune_native.attend_rows(q, k, v, mask, 0.125))


@needs_native
def test_prompts_attend_each_over_their_own_rows_in_a_graph_too() -> None:
    """``attend_prompts`` (bf16 prompts fed into empty slots, one after another): each request's rows attend
    causally over its own keys, as fp64 attention of that request alone; compiled (its fake kernel) the same."""
    g = torch.Generator().manual_seed(3)
    starts = torch.tensor([0, 5, 6, 23, 32])  # prompts of 5, 1, 17 and 9 tokens
    q = torch.randn(1, 6, 32, 64, generator=g).bfloat16()  # 3 query heads per kv head
    k = torch.randn(1, 2, 32, 64, generator=g).bfloat16()
    v = torch.randn(1, 2, 32, 64, generator=g).bfloat16()
    ours = torch.ops.boosttune_native.attend_prompts(q, k, v, starts, 0.125)
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True):
        want = F.scaled_dot_product_attention(q[:, :, a:b].double(), k[:, :, a:b].double().repeat_interleave(3, 1),
                                              v[:, :, a:b].double().repeat_interleave(3, 1), is_causal=True, scale=0.125)
        torch.testing.assert_close(ours[:, :, a:b].double(), want, rtol=2e-2, atol=2e-2)
    graph = torch.compile(lambda *args: torch.ops.boosttune_native.attend_prompts(*args, 0.125) + 0, dynamic=True,
                          fullgraph=True)
    assert torch.equal(graph(q, k, v, starts), ours)
    with pytest.raises(RuntimeError, match="starts must run from 0"):
        torch.ops.boosttune_native.attend_prompts(q, k, v, starts[:-1], 0.125)


@needs_native
def test_bench_native_builds_times_a_revision_beside_the_working_tree(tmp_path, capsys) -> None:
    """scripts/bench_native_builds.py: HEAD's native_ops.cpp built under another namespace, both builds fed
    the same products (checked equal bit for bit when the sources are the same), a row of ms per build."""
    if subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    tiny_llama(3, vocab=128, hidden=64, layers=2).config.save_pretrained(tmp_path / "llm")
    script = load_script("bench_native_builds")
    assert list(script.product_shapes(tiny_llama(3, vocab=128, hidden=64, layers=1).config)) == [
        (64 + 2 * 32, 64), (64, 64), (256, 64), (64, 128), (128, 64)]  # q/k/v fused, o, gate/up, down, head
    assert script.main(["--against", "HEAD", "--llm", str(tmp_path / "llm"), "--rows", "1,3", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert "9 products" in out and "outputs equal bit for bit" in out
    rows = {line.split("|")[1].strip(): line.split("|")[2:4] for line in out.splitlines() if line.startswith("| ")}
    assert float(rows["HEAD (ms)"][0]) > 0 and float(rows["working tree (ms)"][1]) > 0 and "ratio" in rows
    with pytest.raises(SystemExit, match="git cannot show"):
        script.main(["--against", "no-such-revision", "--llm", str(tmp_path / "llm")])
