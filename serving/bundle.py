"""Bundles: everything `boosttune serve` needs, in one directory, validated before use.

A bundle is written by ``boosttune export`` (``boosttune/export/bundle.py``) from a training run::

    BUNDLE/
      manifest.json                 what is here (format below); written last
      tokenizer/                    the LLM's tokenizer, once for every model
      ssms/NAME/                    each drafter with a model: config.json, model*.safetensors, stats.json,
                                    acceptance_profile.json, and its kind's own files (serving/kinds.py)
      scheduler/                    the run's learned scheduler, copied file for file (optional)
      draft_vocab.json              the draft vocabulary ranking (serving/draft_vocab.py; optional)
      phrases.safetensors           the LLM's phrase table, for prompt lookup (serving/phrases.py; optional)

``manifest.json`` (its schema and its one owner: ``manifest.py``) lists every other file with its size
and sha256. The LLM is not copied: it is named (``ref``: "default", "tiny-random", a hub
id or a path; ``path``: where export found it) and pinned by a content hash over its config and
safetensors weight files (:func:`llm_content_hash`).

Loading (:func:`load_bundle`) checks, before any weight is read: the manifest (at most 1 MiB) parses,
its format is one this code reads, every path stays inside the bundle, every listed file is there
with its size and sha256, no unlisted file or link is there, each drafter's kind is registered and
finds its files (a model's config builds it, on the meta device, and its safetensors headers hold
exactly that model's tensors: ``DrafterKind.check``), every JSON file of the tokenizer, the drafters
and the scheduler parses within ``MAX_JSON_DEPTH``, a scheduler directory holds its ``scheduler.json``,
and the LLM that was found hashes to the manifest's hash. Then the tokenizer loads and renders a probe
conversation through its chat template, before any model loads.
Each refusal is a :class:`BundleError` naming the file and the fix. Weights load from safetensors
only (``use_safetensors=True``), the scheduler is JSON (``scheduler/persist.py``, read by the
assembly: this layer does not import the scheduler) and nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from boosttune.core.files import sha256_file
from boosttune.core.rundir import SCHEDULER_FILE
from boosttune.serving import kinds
from boosttune.serving.manifest import (
    MANIFEST,
    MAX_JSON_DEPTH,
    BundleError,
    Manifest,
    json_depth,
    read_manifest,
)

# LLM files that define its outputs: hashed at export, checked at load. Tokenizer files are not
# among them because the bundle carries its own copy of the tokenizer.
_LLM_CONFIG_FILES = ("config.json", "generation_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")


def llm_files(llm_dir: Path) -> list[str]:
    """Names of the LLM files covered by its content hash: config files and safetensors weights."""
    names = sorted(
        p.name for p in llm_dir.iterdir()
        if p.is_file() and (p.name in _LLM_CONFIG_FILES or p.name.endswith(_WEIGHT_SUFFIXES))
    )
    if not any(n.endswith(".safetensors") for n in names):
        raise BundleError(
            f"LLM directory {llm_dir} has no *.safetensors weights (bundles never load pickled weights); "
            "re-save the LLM with save_pretrained(..., safe_serialization=True)"
        )
    if "config.json" not in names:
        raise BundleError(f"LLM directory {llm_dir} has no config.json; is it a transformers model directory?")
    return names


def combine_hashes(per_file: dict[str, str]) -> str:
    """One digest over ``name<TAB>sha256`` lines in name order: the LLM's content hash."""
    lines = "".join(f"{name}\t{per_file[name]}\n" for name in sorted(per_file))
    return hashlib.sha256(lines.encode()).hexdigest()


def llm_content_hash(llm_dir: Path) -> tuple[str, dict[str, str]]:
    """The LLM's content hash and the sha256 of each file it covers (see :func:`llm_files`)."""
    per_file = {name: sha256_file(llm_dir / name) for name in llm_files(llm_dir)}
    return combine_hashes(per_file), per_file


# --------------------------------------------------------------------------------------------
# Validation: files, then the LLM.


def verify_files(root: Path, manifest: Manifest) -> None:
    """Every listed file present, of the listed size and sha256; nothing unlisted; references listed."""
    listed = manifest.files
    referenced: list[tuple[str, str]] = [(manifest.tokenizer, "tokenizer")]
    for d in manifest.drafters:
        referenced += d.files()
    referenced += [(f, "scheduler") for f in manifest.scheduler_files]
    if manifest.draft_vocab is not None:
        referenced.append((manifest.draft_vocab, "draft vocabulary ranking"))
    if manifest.phrases is not None:
        referenced.append((manifest.phrases, "phrase table"))
    for rel, what in referenced:
        if rel == manifest.tokenizer:
            if not any(f.startswith(rel + "/") for f in listed):
                raise BundleError(f"{MANIFEST}: no file of the tokenizer directory {rel}/ is listed under 'files'")
        elif rel not in listed:
            raise BundleError(f"{MANIFEST}: {what} file {rel} is not listed under 'files' (no hash to check it by)")
    if manifest.scheduler_dir is not None and scheduler_file(manifest) not in manifest.scheduler_files:
        raise BundleError(f"{MANIFEST}: the scheduler directory {manifest.scheduler_dir}/ has no {SCHEDULER_FILE}; "
                          "a bundle served without its scheduler would decode unlike the one trained: re-export it")
    root_resolved = root.resolve()
    for rel, entry in sorted(listed.items()):
        path = root / rel
        if not path.resolve().is_relative_to(root_resolved):
            raise BundleError(f"bundle file {rel} points outside the bundle (a link?); refusing it")
        if not path.is_file():
            raise BundleError(f"bundle file {rel} is missing (listed in {MANIFEST}); the bundle is incomplete: re-export it")
        size = path.stat().st_size
        if size != entry.size:
            state = "truncated" if size < entry.size else "longer than exported"
            raise BundleError(
                f"bundle file {rel} is {state}: {size} bytes, {MANIFEST} says {entry.size}; re-export the bundle"
            )
        actual = sha256_file(path)
        if actual != entry.sha256:
            raise BundleError(
                f"bundle file {rel} does not match {MANIFEST}: sha256 {actual[:16]}… but the manifest says "
                f"{entry.sha256[:16]}…; the file or the manifest was altered: re-export the bundle"
            )
    for path in sorted(root.rglob("*")):  # rglob lists a linked directory but does not enter it
        rel = path.relative_to(root).as_posix()
        if rel == MANIFEST or rel in listed:
            continue
        if path.is_symlink():
            raise BundleError(f"bundle entry {rel} is a link that {MANIFEST} does not list; remove it or re-export "
                              "the bundle")
        if path.is_file():
            raise BundleError(f"bundle file {rel} is not listed in {MANIFEST}; remove it or re-export the bundle")


def scheduler_file(manifest: Manifest) -> str:
    """The bundle path of the learned scheduler's file (the manifest must name a scheduler directory)."""
    return f"{manifest.scheduler_dir}/{SCHEDULER_FILE}"


def verify_json_files(root: Path, manifest: Manifest) -> None:
    """Every JSON file the bundle loads (tokenizer, drafter stats and profiles, the scheduler, the draft
    vocabulary) parses, within ``MAX_JSON_DEPTH``; a refusal names the file (the tokenizer library's
    own error names none)."""
    names = [f for f in manifest.files if f.startswith(manifest.tokenizer + "/") and f.endswith(".json")]
    for d in manifest.drafters:
        names += [p for p in (d.stats, d.acceptance_profile) if p]
    if manifest.scheduler_dir is not None:
        names.append(scheduler_file(manifest))
    if manifest.draft_vocab is not None:
        names.append(manifest.draft_vocab)
    for rel in names:
        _read_json(root / rel, rel)


def verify_drafter_files(root: Path, manifest: Manifest) -> None:
    """Each drafter's kind is registered and finds what it needs in its directory; each config.json is
    a model config and each safetensors header parses (hashes cannot tell: a manifest rewritten
    together with a file agrees with it). Reads headers, not weights."""
    from safetensors import SafetensorError, safe_open
    from transformers import AutoConfig

    for d in manifest.drafters:
        try:
            kind = kinds.kind(d.kind)
        except ValueError as e:
            raise BundleError(f"{MANIFEST}: drafter {d.name!r}: {e}; upgrade boosttune or register the kind") from None
        if kind.has_model != (d.dir is not None):
            need = "needs a model directory" if kind.has_model else "has no model directory"
            raise BundleError(f"{MANIFEST}: drafter {d.name!r} of kind {d.kind!r} {need}; re-export the bundle")
        if d.dir is None:
            continue
        assert d.config is not None  # parse_manifest requires it of entries with a dir
        config = _read_json(root / d.config, d.config)
        if not isinstance(config, dict):
            raise BundleError(f"bundle file {d.config} must hold a JSON object (a model config); re-export the bundle")
        try:
            AutoConfig.from_pretrained(root / d.dir)
        # transformers reports bad fields as TypeError, ValueError or huggingface_hub's
        # StrictDataclassError (an Exception subclass only), depending on the field
        except Exception as e:  # any failure here is the file's: re-raised as one naming it
            raise BundleError(f"bundle file {d.config} is not a valid model config ({e}); re-export the bundle") from None
        for w in d.weights:
            if not w.endswith(".safetensors"):
                continue
            try:
                with safe_open(root / w, framework="pt") as f:
                    f.keys()
            except (SafetensorError, OSError) as e:
                raise BundleError(f"bundle file {w} is not a valid safetensors file ({e}); re-export the bundle") from None
        try:  # the kind's own needs: its files, a config that builds the model, exactly its tensors
            kind.check(root / d.dir)
        except ValueError as e:
            raise BundleError(f"bundle directory {d.dir}: {e}; re-export the bundle") from None


def resolve_llm_dir(manifest: Manifest, override: str | None = None) -> Path:
    """Where the bundle's LLM is on this machine: ``override``, else its ref, else export's path."""
    from boosttune.core.models import TINY_LLM, resolve_model_path

    if override:
        try:
            return Path(resolve_model_path(override))
        except ValueError as e:
            raise BundleError(f"--llm {override}: {e}") from None
    ref = manifest.llm.ref
    builtin = ref.strip().lower() in ("default", "smollm2-135m-instruct", TINY_LLM)
    if not builtin and Path(manifest.llm.path).is_dir():
        return Path(manifest.llm.path)
    try:
        return Path(resolve_model_path(ref))
    except ValueError as e:
        raise BundleError(
            f"the bundle's LLM {ref!r} (exported from {manifest.llm.path}) is not available here: {e}; "
            "pass --llm PATH to say where it is"
        ) from None


def verify_llm(llm_dir: Path, manifest: Manifest) -> None:
    """Refuse an LLM whose config/weight files differ from those the bundle was exported against."""
    expected = manifest.llm.files
    present = set(llm_files(llm_dir))
    for name in sorted(set(expected) | present):
        if name not in present:
            raise BundleError(
                f"LLM file {name} is missing in {llm_dir}, but the bundle was exported with it; "
                "pass --llm with the LLM the bundle was exported against"
            )
        if name not in expected:
            raise BundleError(
                f"LLM file {name} in {llm_dir} is not part of the LLM the bundle was exported against; "
                "pass --llm with the right LLM or re-export the bundle"
            )
        actual = sha256_file(llm_dir / name)
        if actual != expected[name]:
            raise BundleError(
                f"LLM file {name} in {llm_dir} does not match the bundle's LLM hash (sha256 {actual[:16]}…, "
                f"expected {expected[name][:16]}…): the bundle was exported against another LLM "
                f"({manifest.llm.ref}); pass --llm with that LLM"
            )
    if combine_hashes(expected) != manifest.llm.sha256:
        raise BundleError(f"{MANIFEST}: llm.sha256 does not match llm.files; the manifest was altered: re-export")


@dataclass(frozen=True)
class VerifiedBundle:
    """A bundle whose files and LLM passed every check (nothing loaded yet)."""

    root: Path
    manifest: Manifest
    llm_dir: Path


def verify_bundle(bundle: str | Path, llm: str | None = None) -> VerifiedBundle:
    """Every check of :func:`load_bundle`, without loading a model.

    Args:
        bundle: the bundle directory.
        llm: where the LLM is, overriding the manifest's reference (its hash is still checked).
    """
    root = Path(bundle)
    manifest = read_manifest(root)
    verify_files(root, manifest)
    verify_json_files(root, manifest)
    verify_drafter_files(root, manifest)
    llm_dir = resolve_llm_dir(manifest, llm)
    verify_llm(llm_dir, manifest)
    return VerifiedBundle(root=root, manifest=manifest, llm_dir=llm_dir)


# --------------------------------------------------------------------------------------------
# Loading.


@dataclass
class LoadedBundle:
    """A validated bundle with its models in memory.

    Attributes:
        root: the bundle directory.
        manifest: its parsed manifest (each drafter's kind and tree: ``manifest.drafters``).
        llm: the LLM, with the bundle's tokenizer.
        models: the drafters' models by drafter name, for kinds that have one (None otherwise), in
            the manifest's order; they share the LLM's tokenizer.
        scheduler_dir: the bundle's scheduler directory (files verified, not read) or None.
        ranking: the draft vocabulary ranking (V,) or None when the bundle has none.
        phrases: the LLM's phrase table (``phrases.py``) or None when the bundle has none.
        acceptance_profiles: each drafter's acceptance profile by name (None where training wrote none).
    """

    root: Path
    manifest: Manifest
    llm: Any
    models: dict[str, Any]
    scheduler_dir: Path | None
    acceptance_profiles: dict[str, dict | None] = field(default_factory=dict)
    ranking: torch.Tensor | None = None
    phrases: Any = None

    @property
    def model_names(self) -> list[str]:
        """The names of the drafters that have a model, in order (what a learned scheduler chooses among)."""
        return [d.name for d in self.manifest.models]

    @property
    def context_length(self) -> int:
        """Positions the LLM was built for (``max_position_embeddings``; 2048 when absent)."""
        return int(getattr(self.llm.model.config, "max_position_embeddings", None) or 2048)


def load_bundle(
    bundle: str | Path,
    llm: str | None = None,
    dtype: str | torch.dtype = "fp32",
    ssm_dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> LoadedBundle:
    """Validate a bundle (:func:`verify_bundle`), then load its LLM, its drafters' models (each through
    its kind) and its tokenizer.

    Args:
        bundle: the bundle directory.
        llm: where the LLM is, overriding the manifest's reference (its hash is still checked).
        dtype: dtype of the LLM, and of the drafters unless ``ssm_dtype`` is given.
        ssm_dtype: dtype of the drafters (the output depends only on the LLM's).
        device: where the LLM and the drafters run (``core/device.py``: ``auto``, ``cpu``, ``cuda``,
            ``cuda:N``), checked before anything is read; dtype ``auto`` is resolved for it.
    """
    from boosttune.core.device import resolve_device
    from boosttune.core.low_rank import load_factors
    from boosttune.core.models import LoadedModel, check_same_vocabulary, model_vocab_size, parse_dtype

    device = resolve_device(device)
    verified = verify_bundle(bundle, llm)
    root, manifest = verified.root, verified.manifest
    llm_dtype = parse_dtype(dtype, device) if isinstance(dtype, str) else dtype
    ssm_torch_dtype = llm_dtype if ssm_dtype is None else (
        parse_dtype(ssm_dtype, device) if isinstance(ssm_dtype, str) else ssm_dtype)
    tokenizer = load_tokenizer(root, manifest)
    llm_model = kinds.load_causal_lm(verified.llm_dir, llm_dtype, device)
    gen = llm_model.generation_config
    if gen is not None and gen.pad_token_id is None:
        eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
        gen.pad_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
    loaded_llm = LoadedModel(model=llm_model, tokenizer=tokenizer, ref=manifest.llm.ref, path=str(verified.llm_dir))
    models: dict[str, Any] = {}
    for entry in manifest.drafters:
        if entry.dir is None:
            models[entry.name] = None
            continue
        try:
            model = kinds.kind(entry.kind).load(root / entry.dir, ssm_torch_dtype, device, llm=llm_model)
            factors = load_factors(root / entry.dir)  # an SSM cut to SSM 1 plus low-rank deltas
            if factors is not None:
                model.low_rank_delta = factors
        except (OSError, ValueError, RuntimeError, TypeError) as e:  # e.g. weights that do not fit the config
            raise BundleError(f"bundle directory {entry.dir}: the {entry.kind} drafter does not load ({e}); "
                              "re-export the bundle") from None
        check_same_vocabulary(tokenizer, tokenizer, model_vocab_size(llm_model), model_vocab_size(model), entry.name)
        models[entry.name] = LoadedModel(model=model, tokenizer=tokenizer, ref=entry.name, path=str(root / entry.dir))
    profiles = {
        d.name: _read_json(root / d.acceptance_profile, d.acceptance_profile) if d.acceptance_profile else None
        for d in manifest.drafters
    }
    ranking = None
    if manifest.draft_vocab is not None:
        from boosttune.serving.draft_vocab import load_ranking

        try:
            ranking = load_ranking(root / manifest.draft_vocab)
        except ValueError as e:
            raise BundleError(f"bundle file {manifest.draft_vocab}: {e}; re-export the bundle") from None
    phrases = None
    if manifest.phrases is not None:
        from boosttune.serving.phrases import load_phrases

        try:
            phrases = load_phrases(root / manifest.phrases, model_vocab_size(llm_model))
        except ValueError as e:
            raise BundleError(f"bundle file {manifest.phrases}: {e}; re-export the bundle") from None
    return LoadedBundle(
        root=root, manifest=manifest, llm=loaded_llm, models=models,
        scheduler_dir=root / manifest.scheduler_dir if manifest.scheduler_dir else None,
        acceptance_profiles=profiles, ranking=ranking, phrases=phrases,
    )


PROBE_CONVERSATION = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2 + 2?"}]
"""What the chat template must render at load: a template that raises on it would fail every chat request."""


def load_tokenizer(root: Path, manifest: Manifest) -> Any:
    """The bundle's tokenizer, its chat template (if any) rendered once on ``PROBE_CONVERSATION``; a
    :class:`BundleError` naming its directory and file otherwise. The template runs in transformers'
    Jinja sandbox, as it does for every chat request."""
    from transformers import AutoTokenizer

    where = root / manifest.tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(where)
    # tokenizers and transformers raise what their parsers raise (ValueError, KeyError, Exception from
    # the Rust side): any failure is the bundle's tokenizer files'
    except Exception as e:
        raise BundleError(f"bundle directory {manifest.tokenizer}/: the tokenizer does not load "
                          f"({type(e).__name__}: {e}); re-export the bundle") from None
    if getattr(tokenizer, "chat_template", None):
        template = next((f for f in ("chat_template.jinja", "tokenizer_config.json") if (where / f).is_file()),
                        "tokenizer_config.json")
        try:
            tokenizer.apply_chat_template(PROBE_CONVERSATION, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # Jinja's TemplateError, a sandbox SecurityError, or what the template raises
            raise BundleError(f"bundle file {manifest.tokenizer}/{template}: the chat template fails on a probe "
                              f"conversation ({type(e).__name__}: {e}); re-export the bundle") from None
    return tokenizer


def _read_json(path: Path, rel: str | None = None) -> Any:
    """``path``'s JSON; a :class:`BundleError` naming ``rel`` (its bundle path; default: its name) if it is not."""
    name = rel or path.name
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"bundle file {name}: not valid JSON ({e}); re-export the bundle") from None
    except RecursionError:  # json recurses once per nesting level
        raise BundleError(f"bundle file {name}: JSON nested too deeply; re-export the bundle") from None
    if json_depth(data) > MAX_JSON_DEPTH:
        raise BundleError(f"bundle file {name}: JSON nested deeper than {MAX_JSON_DEPTH} levels; re-export the bundle")
    return data
