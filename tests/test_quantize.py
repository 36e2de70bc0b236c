"""Weight-only quantized serving (``--quantize``): the products compute what their dequantized weights
would, every product of the LLM is quantized, rows stay independent of one another, and speculative
decoding stays lossless with respect to the quantized LLM (greedy token identity with its own plain
decoding, one at a time, batched and compiled)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import perturbed, tiny_llama

from boosttune import assemble
from boosttune.assemble import engine_from_models
from boosttune.serving import batch, lean, quantize
from boosttune.serving.engine import Plan
from boosttune.serving.lean import LeanRunner
from boosttune.serving.quantize import QuantLinear, check_scheme, int4_codes, int8_codes, shape_reason
from boosttune.serving.runner import ModelRunner
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TreeConfig

SCHEMES = ["int8", "int4", "w8a8"]


def _llm(seed: int, scheme: str, **kw):
    """A tiny llama whose products w8a8 takes (in_features a multiple of 64) where the scheme is w8a8."""
    return tiny_llama(seed, hidden=64 if scheme == "w8a8" else 32, **kw)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_product_multiplies_by_its_dequantized_weight(scheme, dtype):
    """(w8a8 quantizes the inputs too: it computes ``w8a8_reference`` and is ~1 % off the dequantized
    weight's product.)"""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(48, 64, generator=g) * 0.1).to(dtype)
    layer = QuantLinear.from_weight(w, scheme, keep_reference=True)
    assert layer.reference is not None
    x = torch.randn(2, 3, 64, generator=g).to(dtype)
    y = layer(x)
    assert y.shape == (2, 3, 48) and y.dtype == dtype
    want = x.float() @ layer.reference.T
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if scheme == "w8a8":
        ref = quantize.w8a8_reference(x.view(6, 64), layer.packed, layer.scales).view(2, 3, 48)
        torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * float(want.abs().max()))
        tol = 3e-2
    torch.testing.assert_close(y.float(), want, rtol=tol, atol=tol * float(want.abs().max()))
    # the dequantized weight is near the original (int4 groups of 32: 16 levels a group)
    err = float((layer.reference - w.float()).norm() / w.float().norm())
    assert err < (0.01 if scheme == "int8" else 0.1)
    assert err > 0  # and it is quantized


@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_row_is_computed_from_its_own_input_alone(scheme):
    """A tree's rows round as plain steps' rows do: each output row, bit for bit, whatever rows share
    the product (bf16, as served)."""
    g = torch.Generator().manual_seed(1)
    layer = QuantLinear.from_weight(torch.randn(64, 128, generator=g).to(torch.bfloat16), scheme)
    x = torch.randn(12, 128, generator=g).to(torch.bfloat16)
    both = layer(x)
    for r in (0, 5, 11):
        assert torch.equal(layer(x[r : r + 1])[0], both[r])


def test_codes_are_per_row_so_fused_products_equal_their_parts():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(32, 64, generator=g), torch.randn(16, 64, generator=g) * 3
    for fn in (int8_codes, lambda w: int4_codes(w, 32)):
        whole, parts = fn(torch.cat([a, b])), (fn(a), fn(b))
        for j, t in enumerate(whole):
            assert torch.equal(t, torch.cat([parts[0][j], parts[1][j]]))


def test_bad_schemes_and_shapes_say_what_to_do():
    with pytest.raises(ValueError, match="--quantize 'int3'"):
        check_scheme("int3")
    with pytest.raises(ValueError, match="group size 16"):
        check_scheme("int4", 16)
    assert shape_reason(40, 64, "int4") is not None and shape_reason(40, 64, "int8") is None
    with pytest.raises(ValueError, match="divisible"):
        QuantLinear.from_weight(torch.randn(48, 40), "int4")
    with pytest.raises(ValueError, match="fp32 or bf16"):
        QuantLinear.from_weight(torch.randn(48, 64).half(), "int8")
    layer = QuantLinear.from_weight(torch.randn(48, 64), "int8")
    with pytest.raises(ValueError, match="bfloat16 inputs"):
        layer(torch.randn(1, 64).to(torch.bfloat16))


class _W8A8Reference(torch.nn.Module):
    """A Linear as w8a8 computes it, through ``quantize.w8a8_reference``."""

    def __init__(self, q: QuantLinear) -> None:
        super().__init__()
        self.q = q

    def forward(self, x):
        flat = quantize.w8a8_reference(x.reshape(-1, self.q.in_features), self.q.packed, self.q.scales)
        return flat.view(*x.shape[:-1], self.q.out_features)


def _dequantized_model(llm, scheme: str):
    """A copy of ``llm`` whose every Linear weight (the LM head too) is the dequantized one (w8a8: whose
    every Linear is its reference product, inputs quantized too)."""
    ref = copy.deepcopy(llm)
    with torch.no_grad():
        for name, m in list(ref.named_modules()):
            if isinstance(m, torch.nn.Linear):
                q = QuantLinear.from_weight(m.weight, scheme, keep_reference=True)
                if scheme == "w8a8":
                    parent, _, attr = name.rpartition(".")
                    setattr(ref.get_submodule(parent) if parent else ref, attr, _W8A8Reference(q))
                else:
                    m.weight = torch.nn.Parameter(q.reference.to(m.weight.dtype))
    return ref


@pytest.mark.parametrize("scheme", SCHEMES)
@torch.inference_mode()
def test_every_product_of_the_llm_is_quantized(scheme):
    """The quantized runner computes the model with every weight (q/k/v, o, gate/up, down, LM head)
    replaced by its dequantized form; the unquantized model differs."""
    llm = _llm(3, scheme, layers=2)
    runner = LeanRunner(llm)
    assert runner.quantize(scheme) > 0 and runner.quantized == scheme
    # the weights are held once, stacked per kind of product; each layer's product is a slice of its stack
    kinds = [[runner.products(i)[j] for i in range(2)] for j in range(4)] + [[runner.lm_product()]]
    assert len(runner.quant_stacks) == 5
    for products, (packed, scales) in zip(kinds, runner.quant_stacks, strict=True):
        assert all(p.packed.data_ptr() == packed[i].data_ptr() and p.scales.data_ptr() == scales[i].data_ptr()
                   for i, p in enumerate(products))
    ref = ModelRunner(_dequantized_model(llm, scheme))
    plain = ModelRunner(llm)
    prompt = torch.tensor([3, 9, 4, 17, 2])
    got, want, unq = runner.forward_chain(prompt), ref.forward_chain(prompt), plain.forward_chain(prompt)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert float((got - unq).abs().max()) > 1e-3
    p = runner.cached_len  # and a tree after it
    toks, pos = torch.tensor([[5, 6, 7]]), torch.tensor([[p, p + 1, p + 1]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    torch.testing.assert_close(runner.forward(toks, pos, p, mask), ref.forward(toks, pos, p, mask), rtol=1e-4, atol=1e-4)
    spawned = runner.spawn()  # a batch's runners compute the same quantized model
    torch.testing.assert_close(spawned.forward_chain(prompt), got)
    with pytest.raises(ValueError, match="same quantization"):  # and are never mixed with unquantized ones
        lean.run_many([(spawned, lean.Feed(toks, pos, p, mask)), (LeanRunner(llm), lean.Feed(toks, pos, p, mask))])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_speculative_decoding_equals_the_quantized_llms_plain_decoding(scheme):
    """fp32 greedy: token-identical to the quantized LLM's own plain decoding, with drafts accepted
    (so the identity tests verification); one at a time and batched."""
    llm = _llm(0, scheme)
    engine = engine_from_models(llm, [perturbed(llm, 1, 0.3)], TreeConfig(widths=(2, 2, 1)))
    assemble.quantize_llm(engine, scheme)
    stop = StopCriteria(max_new_tokens=32)
    prompts = [[5, 9, 2], [7, 3, 3, 11, 20], [4]]
    plain = [engine.generate(p, stop, plan=Plan()).tokens for p in prompts]
    hits = 0
    for prompt, ref in zip(prompts, plain, strict=True):
        res = engine.generate(prompt, stop)
        assert res.tokens == ref
        hits += sum(a - 1 for a in res.accept_lengths)
    assert hits > 0
    decoder = batch.BatchedDecoder(engine, max_batch=3, draft_max_batch=3)
    for i, p in enumerate(prompts):
        decoder.add(p, stop, None, tag=i)
    got: dict[int, list[int]] = {}
    while len(decoder):
        for m in decoder.step():
            got[m.tag] = m.stream.result().tokens
    assert [got[i] for i in range(3)] == plain
    # and the quantized LLM is another model than the unquantized one
    unquantized = engine_from_models(llm, [], TreeConfig(widths=(1,)))
    assert any(unquantized.generate(p, stop, plan=Plan()).tokens != r for p, r in zip(prompts, plain, strict=True))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_drafters_draft_over_their_cut_head_and_decoding_stays_lossless(scheme):
    """``quantize_drafters``: an SSM's products and its LM head cut to the draft vocabulary are quantized
    (a head cut before or after quantizing alike), eager and compiled; fp32 greedy output stays the
    quantized LLM's own plain decoding, with drafts accepted."""
    from boosttune.serving.compiled import compile_runner

    llm = _llm(0, scheme)
    ranking = torch.randperm(64, generator=torch.Generator().manual_seed(6))
    engine = engine_from_models(llm, [perturbed(llm, 1, 0.2)], TreeConfig(widths=(2, 2, 1), draft_vocab=48),
                                ranking=ranking)
    drafter = engine.drafters["ssm-1"]
    drafter.prepare(engine.plan.trees["ssm-1"])  # cut before quantizing: the cut rows are quantized after
    llm_bytes, drafter_bytes = assemble.quantize_served(engine, scheme)
    runner = drafter.runner
    assert runner.quantized == scheme and isinstance(runner._head, QuantLinear)
    layers = sum(p.nbytes for i in range(len(runner._qkv)) for p in runner.products(i))
    assert drafter_bytes == layers + runner._head.nbytes < llm_bytes  # the 48 rows it reads, not the LM head's 64
    assert runner._head.out_features == 48 and all(isinstance(p, QuantLinear) for p in runner.products(0))
    cut = LeanRunner(perturbed(llm, 1, 0.2))  # cut after quantizing: the same quantized head
    cut.quantize(scheme)
    cut.restrict_head(runner.head_ids)
    assert torch.equal(cut._head.packed, runner._head.packed)
    stop = StopCriteria(max_new_tokens=32)
    prompts = [[5, 9, 2], [7, 3, 3, 11, 20]]
    plain = [engine.generate(p, stop, plan=Plan()).tokens for p in prompts]
    results = [engine.generate(p, stop) for p in prompts]
    assert [r.tokens for r in results] == plain
    assert sum(a - 1 for r in results for a in r.accept_lengths) > 0
    compile_runner(engine.llm)
    compile_runner(runner)
    assert runner.compiled._head[1] == 48
    assert [engine.generate(p, stop).tokens for p in prompts] == plain


def test_quantize_refuses_what_it_cannot_serve(monkeypatch):
    llm = tiny_llama(0)
    runner = LeanRunner(llm)
    runner.quantize("int8")
    with pytest.raises(ValueError, match="once"):
        runner.quantize("int8")
    odd = LeanRunner(tiny_llama(0, vocab=70))
    with pytest.raises(ValueError, match="takes int8"):
        odd.quantize("int4")
    assert odd.quantized is None  # nothing changed
    cut = LeanRunner(llm, torch.arange(20))  # a cut head of 20 rows: int4 takes multiples of 16
    with pytest.raises(ValueError, match="takes int8"):
        cut.quantize("int4")
    assert cut.quantized is None and not isinstance(cut._head, QuantLinear)
    monkeypatch.setenv("BOOSTTUNE_LEAN", "0")
    with pytest.raises(ValueError, match="leave --quantize off"):
        assemble.quantize_llm(engine_from_models(llm, [], TreeConfig(widths=(1,))), "int4")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_compiled_quantized_forward_matches_the_eager_one(scheme):
    from boosttune.serving.compiled import compile_runner

    llm = _llm(5, scheme)
    eager, compiled = LeanRunner(llm), LeanRunner(llm)
    eager.quantize(scheme)
    compiled.quantize(scheme)
    compile_runner(compiled, warm_up=False)
    prompt = torch.tensor([3, 9, 4, 17, 2])
    eager.prefill(prompt)
    compiled.prefill(prompt)
    with torch.inference_mode():
        for tok in (5, 8, 1):
            p = eager.cached_len
            args = (torch.tensor([[tok]]), torch.tensor([[p]]), p, torch.ones(1, 1, dtype=torch.bool))
            torch.testing.assert_close(compiled.forward(*args), eager.forward(*args), rtol=1e-4, atol=1e-4)


def test_w8a8_without_the_native_kernel_stays_lossless(monkeypatch):
    """Where the native kernel is not built, w8a8 runs on ``w8a8_reference`` in torch: still each row
    alone, so speculative decoding equals that model's plain decoding (fp32 greedy)."""
    monkeypatch.setattr(quantize, "native_w8a8", lambda: False)
    llm = _llm(0, "w8a8")
    engine = engine_from_models(llm, [perturbed(llm, 1, 0.3)], TreeConfig(widths=(2, 2, 1)))
    assemble.quantize_llm(engine, "w8a8")
    stop = StopCriteria(max_new_tokens=24)
    hits = 0
    for prompt in ([5, 9, 2], [7, 3, 3, 11, 20]):
        res = engine.generate(prompt, stop)
        assert res.tokens == engine.generate(prompt, stop, plan=Plan()).tokens
        hits += sum(a - 1 for a in res.accept_lengths)
    assert hits > 0


@torch.inference_mode()
def test_w8a8_in_fp32_computes_every_row_as_a_plain_step_does():
    """A w8a8 runner in fp32 attends row by row (``exact_attention``): a prompt fed at once and fed token
    by token give the same logits bit for bit, as does a tree's row and the plain step of its token; in
    bf16 and with the other schemes attention stays torch's."""
    llm = _llm(3, "w8a8", layers=2)
    runner = LeanRunner(llm)
    runner.quantize("w8a8")
    assert runner.exact_attention
    # 300 tokens: long enough that torch's attention rounds a prompt's rows and single steps apart
    prompt = torch.randint(2, 64, (300,), generator=torch.Generator().manual_seed(0))
    whole = runner.forward_chain(prompt)
    runner.reset()
    runner.forward_chain(prompt[:280])
    steps = torch.cat([runner.forward_chain(prompt[i : i + 1]) for i in range(280, 300)])
    assert torch.equal(whole[280:], steps)
    runner.reset()  # a tree after 290 tokens: rows 1 and 2 are siblings, row 3 the child of row 2
    runner.forward_chain(prompt[:290])
    p = runner.cached_len
    toks = torch.tensor([[int(prompt[290]), 1, int(prompt[291]), int(prompt[292])]])
    pos = torch.tensor([[p, p + 1, p + 1, p + 2]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    tree = runner.forward(toks, pos, p, mask).reshape(4, -1)
    assert torch.equal(tree[0], whole[290]) and torch.equal(tree[2], whole[291]) and torch.equal(tree[3], whole[292])
    runner.exact_attention = False  # the test can fail: torch's attention rounds them apart
    runner.reset()
    runner.forward_chain(prompt[:280])
    assert not torch.equal(whole[280:], torch.cat([runner.forward_chain(prompt[i : i + 1]) for i in range(280, 300)]))
    bf16 = LeanRunner(_llm(3, "w8a8", layers=2).to(torch.bfloat16))
    bf16.quantize("w8a8")
    other = LeanRunner(llm)
    other.quantize("int8")
    assert not bf16.exact_attention and not other.exact_attention
