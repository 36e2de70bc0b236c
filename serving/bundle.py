"""Bundles: everything `boosttune serve` needs, in one directory, validated before use.

A bundle is written by ``boosttune export`` (``boosttune/export.py``) from a training run::

    BUNDLE/
      manifest.json                 what is here (format below); written last
      tokenizer/                    the LLM's tokenizer, once for every model
      ssms/ssm-K/                   config.json, model*.safetensors, stats.json, acceptance_profile.json
      scheduler/                    the run's learned scheduler, copied file for file (optional)
      draft_vocab.json              the draft vocabulary ranking (serving/draft_vocab.py; optional)

``manifest.json`` (format 1)::

    {"format": 1, "kind": "boosttune-bundle", "created": ISO time, "source_run": str,
     "versions": {"boosttune": str, "torch": str, "transformers": str, "python": str},
     "llm": {"ref": str, "path": str, "dtype": str, "sha256": str, "files": {name: sha256}},
     "tokenizer": "tokenizer",
     "ssms": [{"name": "ssm-K", "stage": K, "dir": "ssms/ssm-K", "config": path, "weights": [path],
               "stats": path, "acceptance_profile": path | null, "report": {the run's stage entry}}],
     "scheduler": {"dir": "scheduler", "files": [path]} | null,
     "draft_vocab": "draft_vocab.json" | null,   (absent in older bundles: null)
     "prompt_lookup": int,                        (prompt-lookup chain length, 0 = off; absent: 0)
     "tree": {TreeConfig fields},
     "files": {path: {"sha256": str, "size": int}}}

Every path is relative to the bundle, and every file of the bundle other than the manifest is
listed under ``files``. The LLM is not copied: it is named (``ref``: "default", "tiny-random", a hub
id or a path; ``path``: where export found it) and pinned by a content hash over its config and
safetensors weight files (:func:`llm_content_hash`).

Loading (:func:`load_bundle`) checks, before any weight is read: the manifest parses, its format is
one this code reads, every path stays inside the bundle, every listed file is there with its size
and sha256, no unlisted file is there, and the LLM that was found hashes to the manifest's hash.
Each refusal is a :class:`BundleError` naming the file and the fix. Weights load from safetensors
only (``use_safetensors=True``) and the scheduler files are handed over unread: nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from boosttune.core.files import sha256_file
from boosttune.serving.builders import TreeConfig

MANIFEST = "manifest.json"
BUNDLE_FORMAT = 1
BUNDLE_KIND = "boosttune-bundle"
TOKENIZER_DIR = "tokenizer"
SCHEDULER_DIR = "scheduler"
# LLM files that define its outputs: hashed at export, checked at load. Tokenizer files are not
# among them because the bundle carries its own copy of the tokenizer.
_LLM_CONFIG_FILES = ("config.json", "generation_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")


class BundleError(ValueError):
    """A bundle (or the LLM it names) that cannot be served as it is; the message names the file."""


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
# Manifest: typed view, parsed with errors that name the field.


@dataclass(frozen=True)
class FileEntry:
    """One bundle file: its sha256 (hex) and size in bytes."""

    sha256: str
    size: int


@dataclass(frozen=True)
class LLMEntry:
    """The LLM the bundle was exported against.

    Attributes:
        ref: how the run named it ("default", "tiny-random", a hub id or a path).
        path: the directory export found it in (used when ``ref`` does not resolve here).
        dtype: the dtype the run used (informational; serving picks its own).
        sha256: content hash over ``files`` (:func:`combine_hashes`).
        files: sha256 of each hashed LLM file, by file name.
    """

    ref: str
    path: str
    dtype: str
    sha256: str
    files: dict[str, str]


@dataclass(frozen=True)
class SSMEntry:
    """One SSM of the bundle; paths are relative to the bundle.

    Attributes:
        name: "ssm-K".
        stage: the boost-tuning stage that trained it.
        dir: its directory (config + weights; loaded with ``from_pretrained``).
        config: its config.json.
        weights: its safetensors files (and index, when sharded).
        stats: its training stats (JSON).
        acceptance_profile: its acceptance statistics (JSON) or None when training wrote none.
        report: the run report's entry for its stage (pool sizes, match rates, losses).
    """

    name: str
    stage: int
    dir: str
    config: str
    weights: list[str]
    stats: str
    acceptance_profile: str | None
    report: dict[str, Any]


@dataclass(frozen=True)
class Manifest:
    """A parsed manifest.json (format 1); see the module docstring for the JSON."""

    format: int
    created: str
    source_run: str
    versions: dict[str, str]
    llm: LLMEntry
    tokenizer: str
    ssms: list[SSMEntry]
    scheduler_dir: str | None
    scheduler_files: list[str]
    tree: TreeConfig
    files: dict[str, FileEntry]
    draft_vocab: str | None = None
    prompt_lookup: int = 0


def _where(path: str) -> str:
    return f"{MANIFEST}: field '{path}'"


def _field(obj: dict, key: str, kind: type | tuple[type, ...], path: str, optional: bool = False) -> Any:
    """``obj[key]`` checked against ``kind`` (bools are not ints); ``path`` names it in errors."""
    where = f"{path}.{key}" if path else key
    if key not in obj:
        if optional:
            return None
        raise BundleError(f"{_where(where)} is missing; the bundle is damaged or not a boosttune bundle (re-export it)")
    value = obj[key]
    if value is None and optional:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise BundleError(f"{_where(where)} must be {names}, got {type(value).__name__}; re-export the bundle")
    return value


def _rel_path(value: Any, where: str) -> str:
    """A bundle-relative POSIX path that cannot leave the bundle."""
    if not isinstance(value, str) or not value:
        raise BundleError(f"{_where(where)} must be a non-empty relative path, got {value!r}")
    pure = PurePosixPath(value)
    if pure.is_absolute() or "\\" in value or any(part in ("..", ".", "") for part in value.split("/")):
        raise BundleError(f"{_where(where)}: path {value!r} is not a plain relative path inside the bundle")
    return value


def parse_manifest(data: Any) -> Manifest:
    """Check the manifest's JSON object field by field and return its typed view."""
    if not isinstance(data, dict):
        raise BundleError(f"{MANIFEST} must hold a JSON object, got {type(data).__name__}")
    if data.get("kind", BUNDLE_KIND) != BUNDLE_KIND:
        raise BundleError(f"{MANIFEST}: kind {data.get('kind')!r} is not {BUNDLE_KIND!r}; not a boosttune bundle")
    fmt = data.get("format")
    if fmt != BUNDLE_FORMAT or isinstance(fmt, bool):
        raise BundleError(
            f"{MANIFEST}: unsupported bundle format {fmt!r}; this boosttune reads format {BUNDLE_FORMAT}. "
            "Re-export the run with this boosttune version, or serve it with the version that wrote it"
        )
    files_raw = _field(data, "files", dict, "")
    files: dict[str, FileEntry] = {}
    for name, entry in files_raw.items():
        rel = _rel_path(name, f"files[{name!r}]")
        if rel == MANIFEST:
            raise BundleError(f"{_where('files')} lists {MANIFEST} itself; re-export the bundle")
        where = f"files[{name!r}]"
        if not isinstance(entry, dict):
            raise BundleError(f"{_where(where)} must be an object with sha256 and size")
        sha = _field(entry, "sha256", str, where)
        size = _field(entry, "size", int, where)
        if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha) or size < 0:
            raise BundleError(f"{_where(where)}: sha256 must be 64 lowercase hex digits and size >= 0")
        files[rel] = FileEntry(sha, size)

    llm_raw = _field(data, "llm", dict, "")
    llm_files_raw = _field(llm_raw, "files", dict, "llm")
    if not llm_files_raw or not all(isinstance(v, str) for v in llm_files_raw.values()):
        raise BundleError(f"{_where('llm.files')} must map LLM file names to sha256 strings")
    llm = LLMEntry(
        ref=_field(llm_raw, "ref", str, "llm"), path=_field(llm_raw, "path", str, "llm"),
        dtype=_field(llm_raw, "dtype", str, "llm"), sha256=_field(llm_raw, "sha256", str, "llm"),
        files=dict(llm_files_raw),
    )
    ssms = [_parse_ssm(s, i) for i, s in enumerate(_field(data, "ssms", list, ""))]
    if not ssms:
        raise BundleError(f"{_where('ssms')} is empty; a bundle needs at least one SSM")
    sched_raw = _field(data, "scheduler", dict, "", optional=True)
    sched_dir, sched_files = None, []
    if sched_raw is not None:
        sched_dir = _rel_path(_field(sched_raw, "dir", str, "scheduler"), "scheduler.dir")
        sched_files = [_rel_path(f, "scheduler.files[]") for f in _field(sched_raw, "files", list, "scheduler")]
    tree_raw = _field(data, "tree", dict, "")
    try:
        tree = TreeConfig(**tree_raw)
    except (TypeError, ValueError) as e:
        raise BundleError(f"{_where('tree')} is not a valid tree configuration: {e}") from None
    draft_vocab = _field(data, "draft_vocab", str, "", optional=True)
    draft_vocab = _rel_path(draft_vocab, "draft_vocab") if draft_vocab is not None else None
    if tree.draft_vocab and draft_vocab is None:
        raise BundleError(f"{_where('tree.draft_vocab')} is {tree.draft_vocab} but the bundle has no draft_vocab "
                          "ranking; re-export it")
    prompt_lookup = _field(data, "prompt_lookup", int, "", optional=True) or 0
    if prompt_lookup < 0:
        raise BundleError(f"{_where('prompt_lookup')} must be >= 0 (0 = off), got {prompt_lookup}; re-export the bundle")
    versions = _field(data, "versions", dict, "", optional=True) or {}
    return Manifest(
        format=fmt, created=str(data.get("created", "")), source_run=str(data.get("source_run", "")),
        versions={str(k): str(v) for k, v in versions.items()}, llm=llm,
        tokenizer=_rel_path(_field(data, "tokenizer", str, ""), "tokenizer"), ssms=ssms,
        scheduler_dir=sched_dir, scheduler_files=sched_files, tree=tree, files=files, draft_vocab=draft_vocab,
        prompt_lookup=prompt_lookup,
    )


def _parse_ssm(raw: Any, i: int) -> SSMEntry:
    where = f"ssms[{i}]"
    if not isinstance(raw, dict):
        raise BundleError(f"{_where(where)} must be an object")
    weights = [_rel_path(w, f"{where}.weights[]") for w in _field(raw, "weights", list, where)]
    if not any(w.endswith(".safetensors") for w in weights):
        raise BundleError(f"{_where(where + '.weights')} lists no .safetensors file")
    profile = _field(raw, "acceptance_profile", str, where, optional=True)
    return SSMEntry(
        name=_field(raw, "name", str, where), stage=_field(raw, "stage", int, where),
        dir=_rel_path(_field(raw, "dir", str, where), f"{where}.dir"),
        config=_rel_path(_field(raw, "config", str, where), f"{where}.config"), weights=weights,
        stats=_rel_path(_field(raw, "stats", str, where), f"{where}.stats"),
        acceptance_profile=None if profile is None else _rel_path(profile, f"{where}.acceptance_profile"),
        report=_field(raw, "report", dict, where, optional=True) or {},
    )


def read_manifest(bundle: str | Path) -> Manifest:
    """Parse ``BUNDLE/manifest.json`` (no file checks; see :func:`verify_files`)."""
    root = Path(bundle)
    if not root.is_dir():
        raise BundleError(f"bundle {root} is not a directory; create one with `boosttune export RUN_DIR --out {root}`")
    path = root / MANIFEST
    if not path.is_file():
        raise BundleError(f"bundle {root} has no {MANIFEST}; it is incomplete or not a bundle (re-export it)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path}: not valid JSON ({e}); the bundle is damaged (re-export it)") from None
    return parse_manifest(data)


# --------------------------------------------------------------------------------------------
# Validation: files, then the LLM.


def verify_files(root: Path, manifest: Manifest) -> None:
    """Every listed file present, of the listed size and sha256; nothing unlisted; references listed."""
    listed = manifest.files
    referenced: list[tuple[str, str]] = [(manifest.tokenizer, "tokenizer")]
    for s in manifest.ssms:
        referenced += [(s.config, f"{s.name} config"), (s.stats, f"{s.name} stats")]
        referenced += [(w, f"{s.name} weights") for w in s.weights]
        if s.acceptance_profile:
            referenced.append((s.acceptance_profile, f"{s.name} acceptance profile"))
    referenced += [(f, "scheduler") for f in manifest.scheduler_files]
    if manifest.draft_vocab is not None:
        referenced.append((manifest.draft_vocab, "draft vocabulary ranking"))
    for rel, what in referenced:
        if rel == manifest.tokenizer:
            if not any(f.startswith(rel + "/") for f in listed):
                raise BundleError(f"{MANIFEST}: no file of the tokenizer directory {rel}/ is listed under 'files'")
        elif rel not in listed:
            raise BundleError(f"{MANIFEST}: {what} file {rel} is not listed under 'files' (no hash to check it by)")
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
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and rel != MANIFEST and rel not in listed:
            raise BundleError(f"bundle file {rel} is not listed in {MANIFEST}; remove it or re-export the bundle")


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
        manifest: its parsed manifest.
        llm: the LLM, with the bundle's tokenizer.
        ssms: the SSMs in stage order, sharing that tokenizer.
        tree: the tree each SSM drafts by default.
        scheduler_dir: the bundle's scheduler directory (files verified, not read) or None.
        ranking: the draft vocabulary ranking (V,) or None when the bundle has none.
        acceptance_profiles: each SSM's acceptance profile (None where training wrote none).
    """

    root: Path
    manifest: Manifest
    llm: Any
    ssms: list[Any]
    tree: TreeConfig
    scheduler_dir: Path | None
    acceptance_profiles: list[dict | None] = field(default_factory=list)
    ranking: torch.Tensor | None = None

    @property
    def ssm_names(self) -> list[str]:
        return [s.name for s in self.manifest.ssms]

    @property
    def context_length(self) -> int:
        """Positions the LLM was built for (``max_position_embeddings``; 2048 when absent)."""
        return int(getattr(self.llm.model.config, "max_position_embeddings", None) or 2048)


def _load_lm(directory: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, use_safetensors=True)
    model.eval()
    model.requires_grad_(False)
    return model


def load_bundle(
    bundle: str | Path,
    llm: str | None = None,
    dtype: str | torch.dtype = "fp32",
    ssm_dtype: str | torch.dtype | None = None,
) -> LoadedBundle:
    """Validate a bundle (:func:`verify_bundle`), then load its LLM, SSMs and tokenizer.

    Args:
        bundle: the bundle directory.
        llm: where the LLM is, overriding the manifest's reference (its hash is still checked).
        dtype: dtype of the LLM, and of the SSMs unless ``ssm_dtype`` is given.
        ssm_dtype: dtype of the SSMs (the output depends only on the LLM's).
    """
    from transformers import AutoTokenizer

    from boosttune.core.models import LoadedModel, check_same_vocabulary, model_vocab_size, parse_dtype

    verified = verify_bundle(bundle, llm)
    root, manifest = verified.root, verified.manifest
    llm_dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    ssm_torch_dtype = llm_dtype if ssm_dtype is None else (parse_dtype(ssm_dtype) if isinstance(ssm_dtype, str) else ssm_dtype)
    tokenizer = AutoTokenizer.from_pretrained(root / manifest.tokenizer)
    llm_model = _load_lm(verified.llm_dir, llm_dtype)
    gen = llm_model.generation_config
    if gen is not None and gen.pad_token_id is None:
        eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
        gen.pad_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
    loaded_llm = LoadedModel(model=llm_model, tokenizer=tokenizer, ref=manifest.llm.ref, path=str(verified.llm_dir))
    ssms = []
    for entry in manifest.ssms:
        model = _load_lm(root / entry.dir, ssm_torch_dtype)
        check_same_vocabulary(tokenizer, tokenizer, model_vocab_size(llm_model), model_vocab_size(model), entry.name)
        ssms.append(LoadedModel(model=model, tokenizer=tokenizer, ref=entry.name, path=str(root / entry.dir)))
    profiles = [
        _read_json(root / s.acceptance_profile) if s.acceptance_profile else None for s in manifest.ssms
    ]
    ranking = None
    if manifest.draft_vocab is not None:
        from boosttune.serving.draft_vocab import load_ranking

        try:
            ranking = load_ranking(root / manifest.draft_vocab)
        except ValueError as e:
            raise BundleError(f"bundle file {manifest.draft_vocab}: {e}; re-export the bundle") from None
    return LoadedBundle(
        root=root, manifest=manifest, llm=loaded_llm, ssms=ssms, tree=manifest.tree,
        scheduler_dir=root / manifest.scheduler_dir if manifest.scheduler_dir else None,
        acceptance_profiles=profiles, ranking=ranking,
    )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"bundle file {path.name}: not valid JSON ({e})") from None
