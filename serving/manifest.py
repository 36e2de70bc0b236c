"""manifest.json: the one owner of the bundle schema, written by export and parsed at load.

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
     "tree": {TreeConfig fields},                 (ngram_depths absent in older bundles: ())
     "files": {path: {"sha256": str, "size": int}}}

Every path is relative to the bundle, and every file of the bundle other than the manifest is
listed under ``files``. :class:`Manifest` is the typed view: ``Manifest.to_json`` writes it (export)
and :func:`parse_manifest` reads it back field by field, refusing anything malformed with a
:class:`BundleError` that names the field; ``parse_manifest(m.to_json()) == m``. Manifests written
before ``draft_vocab``, ``prompt_lookup`` or the tree's ``ngram_depths`` existed still parse (the
defaults above), so the format stays 1.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from boosttune.core.files import atomic_write_json
from boosttune.serving.builders import TreeConfig

MANIFEST = "manifest.json"
BUNDLE_FORMAT = 1
BUNDLE_KIND = "boosttune-bundle"
TOKENIZER_DIR = "tokenizer"
SSMS_DIR = "ssms"
SCHEDULER_DIR = "scheduler"
MAX_MANIFEST_BYTES = 1 << 20
"""Larger manifests are refused before they are parsed (export writes a few KiB: one line per file)."""


class BundleError(ValueError):
    """A bundle (or the LLM it names) that cannot be served as it is; the message names the file."""


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
    """The typed manifest.json (format 1); see the module docstring for the JSON.

    Attributes:
        format: ``BUNDLE_FORMAT``.
        created: when export wrote it (ISO time).
        source_run: the run directory it was exported from.
        versions: boosttune, torch, transformers and python versions at export.
        llm: the LLM it was exported against.
        tokenizer: the tokenizer directory.
        ssms: the SSMs, in stage order.
        scheduler_dir: the learned scheduler's directory (None: no scheduler).
        scheduler_files: its files.
        tree: the tree each SSM drafts by default.
        files: every file of the bundle but the manifest, by path.
        draft_vocab: the draft vocabulary ranking's path (None: none).
        prompt_lookup: the default prompt-lookup chain length where no scheduler decides (0: off).
    """

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

    def to_json(self) -> dict[str, Any]:
        """The manifest.json object (what :func:`parse_manifest` reads back)."""
        scheduler = None if self.scheduler_dir is None else {"dir": self.scheduler_dir, "files": list(self.scheduler_files)}
        return {
            "format": self.format, "kind": BUNDLE_KIND, "created": self.created, "source_run": self.source_run,
            "versions": dict(self.versions), "llm": asdict(self.llm), "tokenizer": self.tokenizer,
            "ssms": [asdict(s) for s in self.ssms], "scheduler": scheduler, "draft_vocab": self.draft_vocab,
            "prompt_lookup": self.prompt_lookup,
            "tree": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.tree).items()},
            "files": {path: asdict(entry) for path, entry in self.files.items()},
        }

    def write(self, bundle: Path) -> None:
        """Write ``BUNDLE/manifest.json`` atomically (export writes it last: a bundle without it is refused)."""
        atomic_write_json(bundle / MANIFEST, self.to_json())


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
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt != BUNDLE_FORMAT:  # 1.0 is not format 1
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
    """Parse ``BUNDLE/manifest.json`` (at most ``MAX_MANIFEST_BYTES``; no file checks: see :func:`verify_files`)."""
    root = Path(bundle)
    if not root.is_dir():
        raise BundleError(f"bundle {root} is not a directory; create one with `boosttune export RUN_DIR --out {root}`")
    path = root / MANIFEST
    if not path.is_file():
        raise BundleError(f"bundle {root} has no {MANIFEST}; it is incomplete or not a bundle (re-export it)")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{path}: {size} bytes, more than a bundle manifest may have ({MAX_MANIFEST_BYTES}); "
                          "the bundle is damaged or not a boosttune bundle (re-export it)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path}: not valid JSON ({e}); the bundle is damaged (re-export it)") from None
    except RecursionError:  # json recurses once per nesting level
        raise BundleError(f"{path}: JSON nested too deeply to be a bundle manifest; re-export the bundle") from None
    return parse_manifest(data)


