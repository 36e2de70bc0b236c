"""Tree-attention kernels: PyTorch reference vs a naive einsum, Triton kernel vs the reference.

Shape legend: B batch, H query heads, Hkv kv heads, T new tokens, S cached positions, P prefix_len,
W = S - P tree positions, C head dim.

The Triton kernel is checked on CPU under the Triton interpreter. TRITON_INTERPRET=1 must be set
before triton is imported, which this pytest process cannot promise, so the interpreter cases run
in one child process: this file executed as a script (``python tests/test_kernels.py OUT.pt``) with
TRITON_INTERPRET=1 in its environment. The child saves inputs and kernel outputs; the parent
compares them with the reference here, one pytest test per case.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from boosttune.kernels.tree_attention import full_mask, tree_attention, tree_attention_reference

_REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def naive_tree_attention(q, k, v, prefix_len, tree_mask, scale):
    """Independent check: repeat kv heads, einsum logits in fp32, -inf masking, softmax, einsum."""
    B, H, T, C = q.shape
    G = H // k.shape[1]
    kf = k.float().repeat_interleave(G, dim=1)  # (B, H, S, C)
    vf = v.float().repeat_interleave(G, dim=1)
    s = torch.einsum("bhtc,bhsc->bhts", q.float(), kf) * scale
    visible = torch.cat([torch.ones(T, prefix_len, dtype=torch.bool), tree_mask.bool()], dim=1)  # (T, S)
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no visible key: all NaN -> zeros
    return torch.einsum("bhts,bhsc->bhtc", p, vf).to(q.dtype)


def random_mask(T: int, W: int, g: torch.Generator) -> torch.Tensor:
    """(T, W) random bool mask; query t always sees its own position W - T + t."""
    m = torch.rand(T, W, generator=g) < 0.5
    if T and W >= T:
        m[torch.arange(T), W - T + torch.arange(T)] = True
    return m


def random_tree_mask(T: int, W: int, g: torch.Generator) -> torch.Tensor:
    """(T, W) ancestor mask of a random tree of W nodes in topological order; rows = last T nodes."""
    assert W >= T, "the T new tokens are the last T of the W tree nodes"
    anc = torch.eye(W, dtype=torch.bool)
    for i in range(1, W):
        parent = int(torch.randint(-1, i, (1,), generator=g))  # -1: hangs directly off the prefix
        if parent >= 0:
            anc[i] |= anc[parent]
    return anc[W - T :]


def make_inputs(B, H, Hkv, T, S, P, C, dtype, mask="random", layout="bhtc", seed=0):
    """Random q, k, v, tree_mask. layout "bthc" gives non-contiguous (B, H, T, C) views, like HF."""
    g = torch.Generator().manual_seed(seed)
    if layout == "bthc":
        q = torch.randn(B, T, H, C, generator=g).to(dtype).transpose(1, 2)
        k = torch.randn(B, S, Hkv, C, generator=g).to(dtype).transpose(1, 2)
        v = torch.randn(B, S, Hkv, C, generator=g).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(B, H, T, C, generator=g).to(dtype)
        k = torch.randn(B, Hkv, S, C, generator=g).to(dtype)
        v = torch.randn(B, Hkv, S, C, generator=g).to(dtype)
    W = S - P
    if mask == "tree":
        tm = random_tree_mask(T, W, g)
    else:
        tm = random_mask(T, W, g)
        if mask in ("empty_row", "empty_row_partial"):
            tm[1] = False
        if mask == "empty_row_partial":  # row 2 sees only key 0: no visible key in later splits
            tm[2] = False
            tm[2, 0] = True
    return q, k, v, tm


_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


# ----------------------------------------------------------------------------------------------
# PyTorch reference
# ----------------------------------------------------------------------------------------------

REF_SHAPES = [  # (B, H, Hkv, T, S, P, C)
    (2, 4, 4, 3, 10, 6, 8),
    (1, 8, 2, 4, 16, 9, 32),  # GQA
    (2, 4, 1, 5, 5, 0, 16),  # P = 0, MQA
    (1, 2, 2, 1, 12, 11, 16),  # T = 1
    (1, 2, 1, 7, 13, 5, 16),  # odd sizes
    (1, 2, 2, 2, 10, 10, 8),  # S == P: no tree columns
]


@pytest.mark.parametrize(
    "shape, mask",
    [
        pytest.param(s, m, id=f"{m}-" + "x".join(map(str, s)))
        for s in REF_SHAPES
        for m in ("random", "tree")
        if m == "random" or s[4] - s[5] >= s[3]  # a tree of W nodes has W >= T
    ],
)
def test_reference_matches_naive(shape, mask):
    B, H, Hkv, T, S, P, C = shape
    q, k, v, tm = make_inputs(*shape, torch.float32, mask=mask, seed=sum(shape))
    out = tree_attention_reference(q, k, v, P, tm, C**-0.5)
    assert out.shape == (B, H, T, C) and out.dtype == torch.float32
    torch.testing.assert_close(out, naive_tree_attention(q, k, v, P, tm, C**-0.5), atol=1e-5, rtol=1e-5)


def test_reference_non_contiguous_and_dispatcher_on_cpu():
    q, k, v, tm = make_inputs(2, 4, 2, 3, 11, 4, 16, torch.float32, layout="bthc", seed=3)
    want = naive_tree_attention(q, k, v, 4, tm, 0.3)
    torch.testing.assert_close(tree_attention_reference(q, k, v, 4, tm, 0.3), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree_attention(q, k, v, 4, tm, 0.3), want, atol=1e-5, rtol=1e-5)


def test_reference_empty_row_gives_zeros_not_nan():
    q, k, v, tm = make_inputs(1, 2, 1, 4, 6, 0, 8, torch.float32, mask="empty_row", seed=1)
    out = tree_attention_reference(q, k, v, 0, tm, 0.5)
    assert not out.isnan().any()
    assert (out[:, :, 1] == 0).all()
    torch.testing.assert_close(out, naive_tree_attention(q, k, v, 0, tm, 0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_low_precision(dtype):
    q, k, v, tm = make_inputs(1, 4, 2, 5, 12, 7, 16, dtype, mask="tree", seed=2)
    out = tree_attention_reference(q, k, v, 7, tm, 0.25)
    assert out.dtype == dtype
    torch.testing.assert_close(out, naive_tree_attention(q, k, v, 7, tm, 0.25), **_TOL[dtype])


def test_full_mask():
    tm = torch.tensor([[True, False], [True, True]])
    assert full_mask(3, tm, 5).tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    with pytest.raises(ValueError, match="S"):
        full_mask(3, tm, 6)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=torch.zeros(1, 3, 2, 8)), "multiple of kv heads"),
        (dict(k=torch.zeros(1, 2, 5, 8)), "same shape"),
        (dict(tree_mask=torch.ones(2, 3, dtype=torch.bool)), r"tree_mask must be \(T, S - prefix_len\)"),
        (dict(prefix_len=7), "prefix_len"),
        (dict(q=torch.zeros(2, 8)), "4-D"),
        (dict(q=torch.zeros(1, 4, 2, 8, dtype=torch.float64)), "dtypes differ"),
    ],
)
def test_dispatcher_rejects_bad_shapes(change, match):
    args = dict(
        q=torch.zeros(1, 4, 2, 8),
        k=torch.zeros(1, 2, 6, 8),
        v=torch.zeros(1, 2, 6, 8),
        prefix_len=4,
        tree_mask=torch.ones(2, 2, dtype=torch.bool),
        scale=1.0,
    )
    args.update(change)
    with pytest.raises(ValueError, match=match):
        tree_attention(**args)


def test_import_without_triton():
    """The package imports without triton; the Triton path then says which package is missing."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from boosttune.kernels import tree_attention as ta, tree_attention_triton as tat\n"
        "assert not tat.HAS_TRITON\n"
        "q = torch.zeros(1, 1, 1, 8); k = torch.zeros(1, 1, 1, 8)\n"
        "m = torch.ones(1, 1, dtype=torch.bool)\n"
        "assert ta.tree_attention(q, k, k, 0, m, 1.0).shape == (1, 1, 1, 8)\n"
        "try:\n"
        "    tat.tree_attention_triton(q, k, k, 0, m, 1.0)\n"
        "except ImportError as e:\n"
        "    assert '`triton`' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=_REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


# ----------------------------------------------------------------------------------------------
# Triton kernel under the interpreter (CPU)
# ----------------------------------------------------------------------------------------------

# name -> make_inputs kwargs. Tiny on purpose: the interpreter runs every program in numpy.
INTERP_CASES = {
    "gqa_fp32": dict(B=1, H=4, Hkv=2, T=5, S=12, P=7, C=16, dtype=torch.float32),
    "t1_fp32": dict(B=2, H=2, Hkv=2, T=1, S=9, P=8, C=32, dtype=torch.float32),
    "p0_mqa_fp32": dict(B=1, H=3, Hkv=1, T=6, S=6, P=0, C=16, dtype=torch.float32, mask="tree"),
    # 20 query rows (two row blocks), key blocks straddling P, four key blocks in all
    "tree_multiblock_fp32": dict(B=1, H=4, Hkv=1, T=5, S=41, P=9, C=16, dtype=torch.float32, mask="tree"),
    # C = 24 padded to 32, non-contiguous (B, T, H, C)-strided inputs
    "odd_c_strided_fp32": dict(B=2, H=4, Hkv=2, T=3, S=19, P=11, C=24, dtype=torch.float32, layout="bthc"),
    "gqa_bf16": dict(B=1, H=4, Hkv=2, T=5, S=12, P=7, C=16, dtype=torch.bfloat16),
    "tree_fp16": dict(B=1, H=2, Hkv=1, T=7, S=20, P=6, C=16, dtype=torch.float16, mask="tree"),
    "empty_row_p0_fp32": dict(B=1, H=2, Hkv=2, T=4, S=4, P=0, C=16, dtype=torch.float32, mask="empty_row"),
    "no_tree_cols_fp32": dict(B=1, H=2, Hkv=1, T=2, S=10, P=10, C=16, dtype=torch.float32),
    # Split-K path, num_splits forced; ranges are whole 16-key blocks (see test_split_plan).
    # keys [0, 32) | [32, 41): the first range crosses P = 20, the second lies in the tree part
    "split2_tree_fp32": dict(
        B=1, H=2, Hkv=1, T=5, S=41, P=20, C=16, dtype=torch.float32, mask="tree", splits=2
    ),
    # [0, 16) | [16, 32) | [32, 41): a split inside the prefix, one across P = 20, one in the tree;
    # GQA, batch 2, non-contiguous inputs
    "split3_gqa_strided_fp32": dict(
        B=2, H=4, Hkv=2, T=3, S=41, P=20, C=16, dtype=torch.float32, layout="bthc", splits=3
    ),
    # P = 0, [0, 16) | [16, 32) | [32, 36): row 1 sees no key at all, row 2 only key 0
    "split3_p0_empty_row_fp32": dict(
        B=1, H=2, Hkv=2, T=4, S=36, P=0, C=16, dtype=torch.float32, mask="empty_row_partial", splits=3
    ),
    # decode (T = 1), GQA, bf16, C = 24 padded to 32: [0, 32) prefix only | [32, 33) one tree key
    "split2_t1_gqa_bf16": dict(B=1, H=6, Hkv=2, T=1, S=33, P=32, C=24, dtype=torch.bfloat16, splits=2),
    # S == P (no tree columns), the ranges [0, 16) | [16, 32) both in the prefix
    "split2_no_tree_cols_fp16": dict(B=1, H=2, Hkv=1, T=2, S=32, P=32, C=16, dtype=torch.float16, splits=2),
}
DETERMINISM_CASES = ["tree_multiblock_fp32", "gqa_bf16", "split3_gqa_strided_fp32"]
_INTERP_BLOCK = 16


def _scale(case: dict) -> float:
    return case["C"] ** -0.5


def _run_interpreter_cases(out_path: str) -> None:
    """Child-process entry: run every interpreter case through the kernel and torch.save results."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 in the environment"
    torch.set_num_threads(1)
    from boosttune.kernels.tree_attention_triton import tree_attention_triton

    results = {}
    for i, (name, case) in enumerate(INTERP_CASES.items()):
        case = dict(case)
        splits = case.pop("splits", None)  # None: automatic, which is 1 (single pass) off CUDA
        q, k, v, tm = make_inputs(**case, seed=100 + i)
        outs = []
        for _ in range(2 if name in DETERMINISM_CASES else 1):
            outs.append(
                tree_attention_triton(
                    q,
                    k,
                    v,
                    case["P"],
                    tm,
                    _scale(case),
                    block_r=_INTERP_BLOCK,
                    block_s=_INTERP_BLOCK,
                    num_splits=splits,
                )
            )
        results[name] = dict(q=q, k=k, v=v, tree_mask=tm, outs=outs)
        print(f"{name}: done", flush=True)
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    """Run all interpreter cases once, in a child process with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    out_path = tmp_path_factory.mktemp("triton_interp") / "results.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(out_path)],
        capture_output=True,
        text=True,
        cwd=_REPO,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, f"interpreter child failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return torch.load(out_path)


@pytest.mark.parametrize("name", list(INTERP_CASES))
def test_triton_interpreter_matches_reference(interpreter_results, name):
    case = INTERP_CASES[name]
    r = interpreter_results[name]
    q, k, v, tm = r["q"], r["k"], r["v"], r["tree_mask"]
    out = r["outs"][0]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any()
    want = tree_attention_reference(q, k, v, case["P"], tm, _scale(case))  # computed in q's dtype
    torch.testing.assert_close(out, want, **_TOL[case["dtype"]])
    if case["dtype"] != torch.float32:  # and against exact fp32 math on the same (rounded) inputs
        exact = naive_tree_attention(q.float(), k.float(), v.float(), case["P"], tm, _scale(case))
        torch.testing.assert_close(out.float(), exact, **_TOL[case["dtype"]])
    if case.get("mask") in ("empty_row", "empty_row_partial"):
        assert (out[:, :, 1] == 0).all()


@pytest.mark.parametrize("name", [n for n, c in INTERP_CASES.items() if c.get("splits")])
def test_interpreter_split_cases_really_split(name):
    """The forced split counts above are the counts launched (ranges of whole 16-key blocks)."""
    from boosttune.kernels.tree_attention_triton import choose_num_splits

    c = INTERP_CASES[name]
    q = torch.empty(c["B"], c["H"], c["T"], c["C"])
    k = torch.empty(c["B"], c["Hkv"], c["S"], c["C"])
    got = choose_num_splits(q, k, block_r=_INTERP_BLOCK, block_s=_INTERP_BLOCK, num_splits=c["splits"])
    assert got == c["splits"]


@pytest.mark.parametrize(
    "S, programs, block_s, num_sms, forced, want",
    [
        (8193, 32, 32, None, None, (1, 8193)),  # off CUDA: single pass unless forced
        (8193, 32, 32, 132, None, (9, 928)),  # LLaMA-2-7B T=1 on an H200: ceil(264 / 32) = 9
        (513, 32, 32, 132, None, (1, 513)),  # under 1024 keys: the single pass (measured faster)
        (1100, 32, 32, 132, None, (5, 224)),  # capped at ceil(1100 / 256) = 5 splits
        (8193, 264, 32, 132, None, (1, 8193)),  # already 2 programs per SM
        (8193, 3, 64, 132, None, (33, 256)),  # SmolLM2 T=1: 88 wanted, capped by 256 keys per split
        (41, 1, 16, None, 3, (3, 16)),
        (41, 1, 16, None, 8, (3, 16)),  # forced is an upper bound: at most ceil(41 / 16) ranges
        (10, 1, 16, 132, 4, (1, 10)),
        (41, 1, 16, 132, 1, (1, 41)),
        (0, 1, 16, 132, None, (1, 0)),
    ],
)
def test_split_plan(S, programs, block_s, num_sms, forced, want):
    from boosttune.kernels.tree_attention_triton import _plan_splits

    splits, per = _plan_splits(S, programs, block_s, num_sms=num_sms, num_splits=forced)
    assert (splits, per) == want
    if splits > 1:
        assert per % block_s == 0 and (splits - 1) * per < S <= splits * per  # no empty range


def test_triton_rejects_bad_num_splits():
    pytest.importorskip("triton")
    from boosttune.kernels.tree_attention_triton import tree_attention_triton

    q, k, v, tm = make_inputs(1, 2, 2, 2, 6, 4, 8, torch.float32)
    with pytest.raises(ValueError, match="num_splits"):
        tree_attention_triton(q, k, v, 4, tm, 1.0, num_splits=0)


@pytest.mark.parametrize("name", DETERMINISM_CASES)
def test_triton_interpreter_deterministic(interpreter_results, name):
    first, second = interpreter_results[name]["outs"]
    assert torch.equal(first, second)


# ----------------------------------------------------------------------------------------------
# Triton kernel on a real GPU
# ----------------------------------------------------------------------------------------------

GPU_SHAPES = [  # (B, H, Hkv, T, S, P, C)
    (2, 32, 8, 64, 1100, 1000, 128),
    (1, 16, 16, 1, 513, 512, 64),
    (3, 12, 4, 37, 300, 250, 80),
    (2, 8, 2, 40, 40, 0, 64),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_splits", [None, 4], ids=["splits_auto", "splits4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_matches_reference_gpu(shape, dtype, num_splits):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set; this test is for compiled kernels")
    from boosttune.kernels.tree_attention_triton import choose_num_splits, tree_attention_triton

    B, H, Hkv, T, S, P, C = shape
    q, k, v, tm = make_inputs(*shape, dtype, mask="tree", seed=7)
    q, k, v, tm = (x.cuda() for x in (q, k, v, tm))
    splits = choose_num_splits(q, k, num_splits=num_splits)
    print(f"[{'x'.join(map(str, shape))} {dtype} num_splits={num_splits}] launched splits={splits}")
    out = tree_attention_triton(q, k, v, P, tm, C**-0.5, num_splits=num_splits)
    torch.cuda.synchronize()
    exact = naive_tree_attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), P, tm.cpu(), C**-0.5)
    tol = dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else _TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), exact, **tol)
    if num_splits is None:  # the dispatcher picks Triton with the automatic split count
        torch.testing.assert_close(tree_attention(q, k, v, P, tm, C**-0.5), out)
    else:  # and the split path agrees with the single pass
        single = tree_attention_triton(q, k, v, P, tm, C**-0.5, num_splits=1)
        torch.testing.assert_close(out, single, **tol)
    assert torch.equal(tree_attention_triton(q, k, v, P, tm, C**-0.5, num_splits=num_splits), out)


if __name__ == "__main__":
    _run_interpreter_cases(sys.argv[1])
