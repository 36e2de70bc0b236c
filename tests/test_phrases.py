"""The LLM's phrase table: counting, its file, the second branch it adds to prompt lookup's greedy
trees, decoding with it (token-identical to plain decoding, whatever the table says) and its bundle file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from bundle_fixtures import make_run_dir
from conftest import tiny_llama

from boosttune.core.rundir import RunDir
from boosttune.serving.decode import incremental_generate
from boosttune.serving.engine import Plan, SpeculativeEngine
from boosttune.serving.lookup import LOOKUP_NAME, PromptLookupDrafter, lookup_tree, with_branch
from boosttune.serving.phrases import PhraseTable, build_phrases, load_phrases, save_phrases
from boosttune.serving.runner import ModelRunner
from boosttune.serving.sampling import SamplingParams
from boosttune.serving.stops import StopCriteria


def test_the_table_keeps_the_most_frequent_next_token_and_backs_off_to_the_last_token():
    table = build_phrases([[1, 2, 3, 1, 2, 3, 1, 2, 4], [5, 2, 7, 2, 4]], vocab_size=10)
    assert table.next_token(1, 2) == 3  # 3 twice, 4 once after "1 2"
    assert table.next_token(5, 2) == 7
    assert table.next_token(9, 2) == 3  # no "9 2": after "2" alone 3 and 4 were seen twice each, ties to 3
    assert table.next_token(0, 9) == -1  # 9 was never followed
    assert table.chain(np.array([0, 1, 2]), 4).tolist() == [3, 1, 2, 3]
    assert table.chain(np.array([2]), 3).tolist() == []  # the chain starts from two tokens
    # counted within each sequence: the first one's end and the second's start make no pair
    assert (4, 5) not in table.pair_next and table.last_next[4] == -1
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 10\)"):
        build_phrases([[1, 12]], vocab_size=10)


def test_the_file_round_trips_and_refuses_what_is_not_a_table(tmp_path):
    table = build_phrases([[random.Random(s).randrange(50) for _ in range(200)] for s in range(5)], vocab_size=50)
    path = tmp_path / "phrases.safetensors"
    save_phrases(path, table)
    back = load_phrases(path, vocab_size=50)
    assert back.pair_next == table.pair_next and back.last_next.tolist() == table.last_next.tolist()
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError, match="covers 50 tokens, the LLM has 64"):
        load_phrases(path, vocab_size=64)
    from safetensors.torch import save_file

    bad = tmp_path / "bad.safetensors"
    save_file({"pairs": torch.zeros(1, 2, dtype=torch.int64)}, str(bad), metadata={"format": "other", "version": "1"})
    with pytest.raises(ValueError, match="not a boosttune.phrases v1 file"):
        load_phrases(bad)
    save_file({"pairs": torch.tensor([[1, 60]]), "pair_next": torch.tensor([3]), "last_next": torch.full((50,), -1)},
              str(bad), metadata={"format": "boosttune.phrases", "version": "1"})
    with pytest.raises(ValueError, match=r"token ids outside \[0, 50\)"):
        load_phrases(bad)
    bad.write_bytes(b"not safetensors at all")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_phrases(bad)


def test_the_branch_shares_the_chain_prefix():
    def tree(chain, branch):
        tokens, parents, depth = with_branch(np.array(chain, dtype=np.int64), np.array(branch, dtype=np.int64))
        assert depth.tolist() == [1 + (depth[p] if p >= 0 else 0) for p in parents], "a node sits below its parent"
        return tokens.tolist(), parents.tolist()

    assert tree([5, 6, 7], [5, 9]) == ([5, 6, 7, 9], [-1, 0, 1, 0])
    assert tree([5, 6, 7], [5, 6]) == ([5, 6, 7], [-1, 0, 1])  # the chain holds it all
    assert tree([3], [1, 2]) == ([3, 1, 2], [-1, -1, 1])  # two branches from the root
    assert tree([], [1, 2]) == ([1, 2], [-1, 0])
    assert tree([4, 4], []) == ([4, 4], [-1, 0])
    assert tree([], []) == ([], [])


def test_greedy_trees_hold_the_branch_and_sampled_trees_do_not():
    table = build_phrases([[1, 2, 3, 4]], vocab_size=16)
    drafter = PromptLookupDrafter(vocab_size=16, phrases=table, phrase_length=2)
    ctx = torch.tensor([9, 1, 2, 8, 9, 1, 2])  # lookup copies "8 9" after "1 2"; the table says "3 4"
    greedy = drafter.draft(ctx, lookup_tree(2), SamplingParams(), None)
    assert greedy.tokens.tolist() == [8, 9, 3, 4] and greedy.parents.tolist() == [-1, 0, -1, 2]
    assert greedy.depth.tolist() == [1, 2, 1, 2]
    sampled = drafter.draft(ctx, lookup_tree(2), SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert sampled.tokens.tolist() == [8, 9] and sampled.q_dists.shape == (2, 16)
    with pytest.raises(ValueError, match="covers 16 tokens, the LLM 32"):
        PromptLookupDrafter(vocab_size=32, phrases=table)


def _engine(llm, table: PhraseTable | None) -> SpeculativeEngine:
    v = llm.get_output_embeddings().weight.shape[0]
    drafter = PromptLookupDrafter(vocab_size=v, phrases=table)
    return SpeculativeEngine(ModelRunner(llm), {LOOKUP_NAME: drafter}, Plan({LOOKUP_NAME: lookup_tree(4)}))


def test_greedy_decoding_with_the_table_is_plain_decoding_right_or_wrong_table():
    """A table of the LLM's own outputs gets its branch accepted (more drafted tokens kept than without
    it); a table of random tokens gets nothing accepted; the output is plain decoding's either way."""
    gained = 0
    for seed in range(3):
        llm = tiny_llama(seed)
        v = llm.get_output_embeddings().weight.shape[0]
        rng = random.Random(seed)
        prompts = [[rng.randrange(3, v) for _ in range(5)] for _ in range(4)]  # no repeats: lookup alone finds little
        stop = StopCriteria(max_new_tokens=24)
        refs = [incremental_generate(llm, p, stop).tokens for p in prompts]
        own = build_phrases([p + r for p, r in zip(prompts, refs, strict=True)], v)
        noise = build_phrases([[rng.randrange(v) for _ in range(400)]], v)
        for prompt, ref in zip(prompts, refs, strict=True):
            plain_hits = _engine(llm, None).generate(prompt, stop).proposer_hits[LOOKUP_NAME]
            out = _engine(llm, own).generate(prompt, stop)
            assert out.tokens == ref, seed
            gained += out.proposer_hits[LOOKUP_NAME] - plain_hits
            assert _engine(llm, noise).generate(prompt, stop).tokens == ref, seed
    assert gained > 0, "the table's branch was never accepted: the test would not exercise it"


def test_the_bundle_ships_the_run_table_and_serves_it_unless_told(tmp_path):
    from boosttune.assemble import from_bundle
    from boosttune.export.bundle import export_bundle
    from boosttune.serving.bundle import BundleError, load_bundle

    run = make_run_dir(tmp_path / "run", n_ssms=1)
    bare = export_bundle(run, tmp_path / "bare", prompt_lookup=4).bundle
    assert json.loads((bare / "manifest.json").read_text())["phrases"] is None
    assert not from_bundle(load_bundle(bare)).phrases
    b = load_bundle(bare)
    v = b.llm.model.get_output_embeddings().weight.shape[0]
    ids = b.llm.tokenizer("the cat sat on the mat")["input_ids"]
    stop = StopCriteria(max_new_tokens=16)
    ref = incremental_generate(b.llm.model, ids, stop).tokens
    save_phrases(RunDir(run).phrases_path, build_phrases([ids + ref], v))
    out = export_bundle(run, tmp_path / "b", prompt_lookup=4).bundle
    m = json.loads((out / "manifest.json").read_text())
    assert m["phrases"] == "phrases.safetensors" and "phrases.safetensors" in m["files"]
    loaded = load_bundle(out)
    assert loaded.phrases is not None and loaded.phrases.pair_next == load_phrases(RunDir(run).phrases_path).pair_next
    served = from_bundle(loaded)
    assert served.phrases and not from_bundle(loaded, phrases=False).phrases
    res = served.engine.generate(ids, stop)
    assert res.tokens == ref and res.proposer_hits[LOOKUP_NAME] > 0
    # a table for another vocabulary, hashes updated to match, is refused naming the file
    save_phrases(out / "phrases.safetensors", build_phrases([[1, 2, 3]], 7))
    from boosttune.core.files import sha256_file

    m["files"]["phrases.safetensors"] = {"sha256": sha256_file(out / "phrases.safetensors"),
                                         "size": (out / "phrases.safetensors").stat().st_size}
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="phrases.safetensors: .*another vocabulary"):
        load_bundle(out)


def test_named_models_take_a_phrase_table_by_path_and_bad_ones_are_refused_before_loading(tmp_path, capsys):
    """``--phrases`` with --llm/--ssm: the run's table (a file or its directory) joins prompt lookup, its
    branch gets accepted, and the output stays plain decoding's; without --prompt-lookup, at a missing
    path, beside a bundle, or for another vocabulary it is refused with the flag's name."""
    from boosttune.assemble import load
    from boosttune.cli import main
    from boosttune.core.models import TINY_LLM
    from boosttune.core.rundir import RunDir

    run = make_run_dir(tmp_path / "run", n_ssms=1, scheduler=False, ranking=False)
    ssm = str(RunDir(run).ssm_dir(1))
    plain = load(llm=TINY_LLM, ssms=[ssm], lookup=4)
    ids = plain.llm.tokenizer("the cat sat on the mat")["input_ids"]
    stop = StopCriteria(max_new_tokens=16)
    ref = incremental_generate(plain.llm.model, ids, stop).tokens
    v = plain.llm.model.get_output_embeddings().weight.shape[0]
    save_phrases(RunDir(run).phrases_path, build_phrases([ids + ref], v))
    without = plain.engine.generate(ids, stop)
    for ref_path in (run, RunDir(run).phrases_path):
        served = load(llm=TINY_LLM, ssms=[ssm], lookup=4, phrase_table=ref_path)
        assert served.phrases and not plain.phrases
        assert served.phrase_file == RunDir(run).phrases_path and plain.phrase_file is None
        out = served.engine.generate(ids, stop)
        assert out.tokens == ref == without.tokens
        assert out.proposer_hits[LOOKUP_NAME] > without.proposer_hits[LOOKUP_NAME]
    with pytest.raises(ValueError, match="--phrases: .*--prompt-lookup"):
        load(llm=TINY_LLM, ssms=[ssm], phrase_table=run)
    with pytest.raises(ValueError, match="--phrases: no phrase table at"):
        load(llm=TINY_LLM, ssms=[ssm], lookup=4, phrase_table=tmp_path / "nowhere")
    other = tmp_path / "other.safetensors"
    save_phrases(other, build_phrases([[1, 2, 3]], 7))
    with pytest.raises(ValueError, match="another vocabulary"):
        load(llm=TINY_LLM, ssms=[ssm], lookup=4, phrase_table=other)
    from boosttune.export.bundle import export_bundle

    bundle = export_bundle(run, tmp_path / "bundle", prompt_lookup=4).bundle
    with pytest.raises(ValueError, match="--phrases .*a bundle brings its own"):
        load(bundle=bundle, phrase_table=run)
    assert load(bundle=bundle).phrase_file == Path(bundle) / "phrases.safetensors"
    assert load(bundle=bundle, phrases=False).phrase_file is None
    # the command line: the flag reaches the engine, and its refusal is one line naming it
    args = ["generate", "--llm", TINY_LLM, "--ssm", ssm, "the cat sat on the mat", "--max-new-tokens", "8",
            "--prompt-lookup", "4"]
    assert main([*args, "--phrases", str(run)]) == 0
    capsys.readouterr()
    assert main([*args[:-2], "--phrases", str(run)]) == 2
    assert "--phrases" in capsys.readouterr().err
    assert main([*args, "--phrases", str(run), "--no-phrases"]) == 2
    assert "--phrases and --no-phrases" in capsys.readouterr().err
