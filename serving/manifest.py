"""manifest.json: the one owner of the bundle schema, written by export and parsed at load.

``manifest.json`` (format 2)::

    {"format": 2, "kind": "boosttune-bundle", "created": ISO time, "source_run": str,
     "versions": {"boosttune": str, "torch": str, "transformers": str, "python": str},
     "llm": {"ref": str, "path": str, "dtype": str, "sha256": str, "files": {name: sha256}},
     "tokenizer": "tokenizer",
     "drafters": [{"name": str, "kind": "ssm" | "feature" | "prompt_lookup" | a registered kind,
                   "stage": int, "dir": path | null, "config": path | null, "weights": [path],
                   "stats": path | null, "acceptance_profile": path | null,
                   "tree": {TreeConfig fields}, "report": {the run's entry for it}}],
     "scheduler": {"dir": "scheduler", "files": [path]} | null,
     "draft_vocab": "draft_vocab.json" | null,
     "phrases": "phrases.safetensors" | null,
     "files": {path: {"sha256": str, "size": int}}}

Each drafter names its kind (``serving/kinds.py``, the registry that builds it) and carries its own
default tree, draft vocabulary included, as its training recorded it: nothing is reconciled at load.
Kinds with a model have a ``dir`` (config + safetensors weights); prompt lookup has none (its tree's
depth is its chain length). Every path is relative to the bundle, and every file of the bundle other
than the manifest is listed under ``files``.

:class:`Manifest` is the typed view: ``Manifest.to_json`` writes it (export) and :func:`parse_manifest`
reads it back field by field, refusing anything malformed with a :class:`BundleError` that names the
field; ``parse_manifest(m.to_json()) == m``.

Format 1 (bundles written before drafters had kinds: an ``ssms`` list, one top-level ``tree`` and
``prompt_lookup``) is migrated on load by :func:`migrate_v1`, explicitly and in one place.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from boosttune.core.files import atomic_write_json
from boosttune.serving.lookup import LOOKUP_NAME, lookup_tree
from boosttune.serving.tree import MAX_TREE_DEPTH, TreeConfig

MANIFEST = "manifest.json"
BUNDLE_FORMAT = 2
BUNDLE_KIND = "boosttune-bundle"
TOKENIZER_DIR = "tokenizer"
SSMS_DIR = "ssms"
SCHEDULER_DIR = "scheduler"
LOOKUP_KIND = "prompt_lookup"
"""Prompt lookup's kind name (``serving/kinds.py`` registers it; the manifest reads its chain length)."""
FEATURE_MARKER = "feature_head.json"
"""The file by which format 1 told a feature head from an SSM (``migrate_v1`` only)."""
MAX_MANIFEST_BYTES = 1 << 20
"""Larger manifests are refused before they are parsed (export writes a few KiB: one line per file)."""
MAX_JSON_DEPTH = 32
"""The deepest nesting of objects and lists a bundle's JSON files (manifest, configs, scheduler) may
have; export writes at most 6. Deeper files are refused before their fields are read."""
FC_MARKER = "feature_fc.safetensors"
"""A feature head's projection: format 1 listing it without ``FEATURE_MARKER`` is refused (``migrate_v1``)."""


class BundleError(ValueError):
    """A bundle (or the LLM it names) that cannot be served as it is; the message names the file and is
    one line (whitespace runs, such as the newlines of a library's error quoted in it, become one space)."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of a parsed JSON value (0 for a scalar), counted without recursion and only up to
    ``limit`` + 1: a caller compares it with ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d > limit:
                return d
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


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
class DrafterEntry:
    """One drafter of the bundle; paths are relative to the bundle.

    Attributes:
        name: how plans, reports and the scheduler name it ("ssm-K", "feature", "prompt-lookup").
        kind: its registered kind (``serving/kinds.py``).
        stage: the boost-tuning stage that trained it (0: none).
        tree: the tree it drafts by default, its draft vocabulary included.
        dir: its directory (config + weights; None for kinds without a model).
        config: its config.json (None without a model).
        weights: its safetensors files (and index, when sharded).
        stats: its training stats (JSON) or None.
        acceptance_profile: its acceptance statistics (JSON) or None when training wrote none.
        report: the run report's entry for it (pool sizes, match rates, losses).
    """

    name: str
    kind: str
    stage: int
    tree: TreeConfig
    dir: str | None = None
    config: str | None = None
    weights: list[str] = field(default_factory=list)
    stats: str | None = None
    acceptance_profile: str | None = None
    report: dict[str, Any] = field(default_factory=dict)

    def files(self) -> list[tuple[str, str]]:
        """(path, what) for every file this entry names."""
        out = [(p, f"{self.name} {what}") for p, what in ((self.config, "config"), (self.stats, "stats"),
                                                         (self.acceptance_profile, "acceptance profile")) if p]
        return out + [(w, f"{self.name} weights") for w in self.weights]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tree"] = _tree_json(self.tree)
        return d


def _tree_json(tree: TreeConfig) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(tree).items()}


@dataclass(frozen=True)
class Manifest:
    """The typed manifest.json (format 2); see the module docstring for the JSON.

    Attributes:
        format: ``BUNDLE_FORMAT``.
        created: when export wrote it (ISO time).
        source_run: the run directory it was exported from.
        versions: boosttune, torch, transformers and python versions at export.
        llm: the LLM it was exported against.
        tokenizer: the tokenizer directory.
        drafters: the drafters, in merge order (boost-tuning stages first).
        scheduler_dir: the learned scheduler's directory (None: no scheduler).
        scheduler_files: its files.
        files: every file of the bundle but the manifest, by path.
        draft_vocab: the draft vocabulary ranking's path (None: none).
        phrases: the LLM's phrase table's path (``phrases.py``; None: prompt lookup drafts without it).
    """

    format: int
    created: str
    source_run: str
    versions: dict[str, str]
    llm: LLMEntry
    tokenizer: str
    drafters: list[DrafterEntry]
    scheduler_dir: str | None
    scheduler_files: list[str]
    files: dict[str, FileEntry]
    draft_vocab: str | None = None
    phrases: str | None = None

    @property
    def models(self) -> list[DrafterEntry]:
        """The drafters that have a model directory, in order."""
        return [d for d in self.drafters if d.dir is not None]

    @property
    def prompt_lookup(self) -> int:
        """Prompt lookup's default chain length (0: the bundle drafts without it)."""
        return max((d.tree.max_depth for d in self.drafters if d.kind == LOOKUP_KIND), default=0)

    @property
    def lookup_depths(self) -> tuple[int, ...]:
        """Prompt lookup's chain length per matched n-gram length (``TreeConfig.ngram_depths``: a table a
        run's scheduler learned), () for its whole chain after every match."""
        return next((d.tree.ngram_depths for d in self.drafters if d.kind == LOOKUP_KIND), ())

    def to_json(self) -> dict[str, Any]:
        """The manifest.json object (what :func:`parse_manifest` reads back)."""
        scheduler = None if self.scheduler_dir is None else {"dir": self.scheduler_dir, "files": list(self.scheduler_files)}
        return {
            "format": self.format, "kind": BUNDLE_KIND, "created": self.created, "source_run": self.source_run,
            "versions": dict(self.versions), "llm": asdict(self.llm), "tokenizer": self.tokenizer,
            "drafters": [d.to_json() for d in self.drafters], "scheduler": scheduler,
            "draft_vocab": self.draft_vocab, "phrases": self.phrases,
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


def migrate_v1(data: dict) -> dict:
    """A format-1 manifest object as format 2: each SSM entry gets its kind (a feature head is the one
    whose directory lists ``feature_head.json``; format 1 had no other way to say it) and the bundle's
    one tree; a prompt-lookup default (``prompt_lookup`` > 0) becomes a drafter of its own. Fields are
    type-checked afterwards, by :func:`parse_manifest`, exactly as in format 2."""
    out = {k: v for k, v in data.items() if k not in ("ssms", "tree", "prompt_lookup")}
    files = data.get("files") if isinstance(data.get("files"), dict) else {}
    tree = data.get("tree")
    if isinstance(tree, dict):
        tree = {"ngram_depths": [], **tree}  # absent before per-match lookup lengths existed
    drafters = []
    for i, raw in enumerate(_field(data, "ssms", list, "")):
        if isinstance(raw, dict):
            d = raw.get("dir")
            feature = isinstance(d, str) and f"{d}/{FEATURE_MARKER}" in files
            weights = raw.get("weights") if isinstance(raw.get("weights"), list) else []
            if not feature and isinstance(d, str) and (f"{d}/{FC_MARKER}" in files or f"{d}/{FC_MARKER}" in weights):
                # a head's projection without its marker: serving it as a plain SSM would drop the
                # projection and silently draft worse
                raise BundleError(f"{_where(f'ssms[{i}]')}: {d}/{FC_MARKER} is listed without {d}/{FEATURE_MARKER}; "
                                  "a feature head needs both: re-export the bundle")
            raw = {**raw, "kind": "feature" if feature else "ssm", "tree": tree}
        drafters.append(raw)
    lookup = _field(data, "prompt_lookup", int, "", optional=True) or 0
    if not 0 <= lookup <= MAX_TREE_DEPTH:
        raise BundleError(f"{_where('prompt_lookup')} must be in 0 .. {MAX_TREE_DEPTH} (0 = off), got {lookup}; "
                          "re-export the bundle")
    if lookup:
        drafters.append({"name": LOOKUP_NAME, "kind": LOOKUP_KIND, "stage": 0, "dir": None, "weights": [],
                         "tree": _tree_json(lookup_tree(lookup))})
    out["drafters"] = drafters
    out["format"] = BUNDLE_FORMAT
    return out


def parse_manifest(data: Any) -> Manifest:
    """Check the manifest's JSON object field by field (format 1 migrated first) and return its typed view."""
    if not isinstance(data, dict):
        raise BundleError(f"{MANIFEST} must hold a JSON object, got {type(data).__name__}")
    if data.get("kind", BUNDLE_KIND) != BUNDLE_KIND:
        raise BundleError(f"{MANIFEST}: kind {data.get('kind')!r} is not {BUNDLE_KIND!r}; not a boosttune bundle")
    fmt = data.get("format")
    if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt == 1:
        data, fmt = migrate_v1(data), BUNDLE_FORMAT
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt != BUNDLE_FORMAT:  # 2.0 is not format 2
        raise BundleError(
            f"{MANIFEST}: unsupported bundle format {fmt!r}; this boosttune reads formats 1 and {BUNDLE_FORMAT}. "
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
    drafters = [_parse_drafter(d, i) for i, d in enumerate(_field(data, "drafters", list, ""))]
    if not any(d.dir is not None for d in drafters):
        raise BundleError(f"{_where('drafters')} has no drafter with a model; a bundle needs at least one")
    names = [d.name for d in drafters]
    if len(set(names)) != len(names):
        raise BundleError(f"{_where('drafters')}: drafter names repeat ({names}); re-export the bundle")
    sched_raw = _field(data, "scheduler", dict, "", optional=True)
    sched_dir, sched_files = None, []
    if sched_raw is not None:
        sched_dir = _rel_path(_field(sched_raw, "dir", str, "scheduler"), "scheduler.dir")
        sched_files = [_rel_path(f, "scheduler.files[]") for f in _field(sched_raw, "files", list, "scheduler")]
    draft_vocab = _field(data, "draft_vocab", str, "", optional=True)
    draft_vocab = _rel_path(draft_vocab, "draft_vocab") if draft_vocab is not None else None
    for i, d in enumerate(drafters):
        if d.tree.draft_vocab and draft_vocab is None:
            raise BundleError(f"{_where(f'drafters[{i}].tree.draft_vocab')} is {d.tree.draft_vocab} but the bundle has "
                              "no draft_vocab ranking; re-export it")
    phrases = _field(data, "phrases", str, "", optional=True)
    phrases = _rel_path(phrases, "phrases") if phrases is not None else None
    versions = _field(data, "versions", dict, "", optional=True) or {}
    return Manifest(
        format=fmt, created=str(data.get("created", "")), source_run=str(data.get("source_run", "")),
        versions={str(k): str(v) for k, v in versions.items()}, llm=llm,
        tokenizer=_rel_path(_field(data, "tokenizer", str, ""), "tokenizer"), drafters=drafters,
        scheduler_dir=sched_dir, scheduler_files=sched_files, files=files, draft_vocab=draft_vocab,
        phrases=phrases,
    )


def _parse_tree(raw: Any, where: str) -> TreeConfig:
    if not isinstance(raw, dict):
        raise BundleError(f"{_where(where)} must be an object (a tree configuration); re-export the bundle")
    try:
        return TreeConfig(**raw)
    except (TypeError, ValueError) as e:
        raise BundleError(f"{_where(where)} is not a valid tree configuration: {e}") from None


def _parse_drafter(raw: Any, i: int) -> DrafterEntry:
    """One drafter entry: its kind's name and its paths (whether the kind is registered, and the files
    it needs, are checked when the bundle loads: ``bundle.py``)."""
    where = f"drafters[{i}]"
    if not isinstance(raw, dict):
        raise BundleError(f"{_where(where)} must be an object")
    kind = _field(raw, "kind", str, where)
    d = _field(raw, "dir", str, where, optional=True)
    weights = [_rel_path(w, f"{where}.weights[]") for w in (_field(raw, "weights", list, where, optional=True) or [])]
    if d is not None and not any(w.endswith(".safetensors") for w in weights):
        raise BundleError(f"{_where(where + '.weights')} lists no .safetensors file")
    if d is not None and _field(raw, "config", str, where, optional=True) is None:
        raise BundleError(f"{_where(where + '.config')} is missing; a drafter with a model needs its config")

    def path(key: str) -> str | None:
        value = _field(raw, key, str, where, optional=True)
        return None if value is None else _rel_path(value, f"{where}.{key}")

    return DrafterEntry(
        name=_field(raw, "name", str, where), kind=kind, stage=_field(raw, "stage", int, where),
        tree=_parse_tree(_field(raw, "tree", dict, where), f"{where}.tree"),
        dir=None if d is None else _rel_path(d, f"{where}.dir"), config=path("config"), weights=weights,
        stats=path("stats"), acceptance_profile=path("acceptance_profile"),
        report=_field(raw, "report", dict, where, optional=True) or {},
    )


def read_manifest(bundle: str | Path) -> Manifest:
    """Parse ``BUNDLE/manifest.json`` (at most ``MAX_MANIFEST_BYTES``; no file checks: see :func:`verify_files`)."""
    root = Path(bundle)
    if not root.is_dir():
        raise BundleError(f"bundle {root} is not a directory; create one with `boosttune export RUN_DIR --out {root}`")
    path = root / MANIFEST
    if path.is_symlink():
        raise BundleError(f"{path} is a link; a bundle's {MANIFEST} must be a regular file inside it (re-export it)")
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
    if json_depth(data) > MAX_JSON_DEPTH:
        raise BundleError(f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels; not a bundle manifest (re-export it)")
    return parse_manifest(data)


