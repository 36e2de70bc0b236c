"""Drafter kinds: the one registry of what can draft, and everything in which kinds differ.

A *kind* (``"ssm"``, ``"feature"``, ``"prompt_lookup"``, or one a user registers) is one class,
registered with :func:`register`. A bundle's manifest names each drafter's kind (``manifest.py``),
and every place that loads, checks, builds or ships a drafter asks its kind instead of looking at
files, attributes or class names:

- ``check(directory)``: the files and fields a drafter of this kind needs, before anything loads;
- ``load(directory, dtype)``: its model (None for kinds without one, such as prompt lookup);
- ``drafter(model, vocab_size, ranking)``: the ``Drafter`` that serves it (``drafter.py``), which
  itself says whether it reads the LLM's features (``Drafter.observes_features``);
- ``ships(directory)``: the files of a trained drafter's directory that export copies into a bundle;
- ``trained_tree(directory, tree)``: the tree it drafts by default, from what its training recorded
  (a feature head's draft vocabulary is the one it was trained over, written in its own file);
- ``phase``: the training phase that makes it (``boosttune train``), for reports and docs.

Adding a kind is one module with one class and one ``register`` line (``docs/drafter-kinds.md``);
``tests/test_kinds.py`` registers a toy kind from the test module and serves a bundle with it.

A trained drafter's directory declares its kind (``core/kind_file.py``); :func:`directory_kind`
reads it, and migrates directories written before kinds were declared.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn

from boosttune.core.feature_head import FC_FILE, FEATURE_FILE, attach_fc
from boosttune.core.kind_file import declared_kind
from boosttune.serving.drafter import Drafter, SSMDrafter
from boosttune.serving.feature_drafter import FeatureDrafter
from boosttune.serving.lookup import PromptLookupDrafter
from boosttune.serving.tree import TreeConfig

_CONFIG = "config.json"


class DrafterKind:
    """One kind of drafter; subclasses set ``name`` and override what differs."""

    name: ClassVar[str] = ""
    has_model: ClassVar[bool] = True
    """Whether a drafter of this kind has a directory with a model (False: built from its tree alone)."""
    phase: ClassVar[str] = ""
    """The `boosttune train` phase that trains it ("" for kinds that need no training)."""

    def check(self, directory: Path) -> None:
        """Refuse ``directory`` (a ``ValueError`` naming the file) if it lacks what this kind needs."""
        if not (directory / _CONFIG).is_file():
            raise ValueError(f"{directory}: no {_CONFIG}; a {self.name} drafter is a transformers model directory")
        if not any(p.suffix == ".safetensors" for p in directory.iterdir()):
            raise ValueError(f"{directory}: no *.safetensors weights for this {self.name} drafter")

    def load(self, directory: Path, dtype: torch.dtype) -> nn.Module | None:
        """The drafter's model, in eval mode without gradients."""
        return load_causal_lm(directory, dtype)

    def drafter(self, model: nn.Module | None, vocab_size: int, ranking: Tensor | None) -> Drafter:
        """The drafter that serves ``model`` for an LLM of ``vocab_size`` logits."""
        raise NotImplementedError

    def ships(self, directory: Path) -> list[str]:
        """Names of the files in ``directory`` that a bundle carries (weights, configs, stats)."""
        return []

    def trained_tree(self, directory: Path | None, tree: TreeConfig) -> TreeConfig:
        """The tree this drafter drafts by default, given the run's ``tree``."""
        return tree


def load_causal_lm(directory: Path, dtype: torch.dtype) -> nn.Module:
    """A transformers causal LM from ``directory`` for inference (safetensors only: nothing unpickled)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, use_safetensors=True)
    model.eval()
    model.requires_grad_(False)
    return model


_KINDS: dict[str, DrafterKind] = {}


def register(cls: type[DrafterKind]) -> type[DrafterKind]:
    """Register a kind under its ``name`` (a class decorator); a second kind of one name is refused."""
    if not cls.name:
        raise ValueError(f"{cls.__name__}: a drafter kind needs a name")
    if cls.name in _KINDS and type(_KINDS[cls.name]) is not cls:
        raise ValueError(f"drafter kind {cls.name!r} is registered already ({type(_KINDS[cls.name]).__name__})")
    _KINDS[cls.name] = cls()
    return cls


def unregister(name: str) -> None:
    """Remove a kind (tests that register a toy kind clean up with it)."""
    _KINDS.pop(name, None)


def kind(name: str) -> DrafterKind:
    """The registered kind ``name``; a ``ValueError`` listing the known ones otherwise."""
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"unknown drafter kind {name!r}; known kinds: {sorted(_KINDS)}") from None


def kind_names() -> list[str]:
    return sorted(_KINDS)


def directory_kind(directory: str | Path) -> str:
    """The registered kind of a drafter directory (its declaration, or the migration for directories
    written before kinds were declared: ``core/kind_file.py``)."""
    return kind(declared_kind(directory)).name


def _model_files(directory: Path) -> list[str]:
    names = ("config.json", "generation_config.json")
    weights = sorted(p.name for p in directory.iterdir()
                     if p.name.endswith((".safetensors", ".safetensors.index.json")))
    return [n for n in names if (directory / n).is_file()] + weights


@register
class SSMKind(DrafterKind):
    """A small causal LM with the LLM's tokenizer (``SSMDrafter``), boost-tuned in the stages."""

    name = "ssm"
    phase = "stages"

    def drafter(self, model, vocab_size, ranking):
        from boosttune.serving.lean import drafter_runner

        return SSMDrafter(drafter_runner(model), vocab_size=vocab_size, ranking=ranking)

    def ships(self, directory):
        return [n for n in _model_files(directory) if n != FC_FILE]


@register
class FeatureKind(DrafterKind):
    """A feature head (``core/feature_head.py``): reads the LLM's features (``FeatureDrafter``)."""

    name = "feature"
    phase = "feature"

    def check(self, directory):
        super().check(directory)
        for f in (FEATURE_FILE, FC_FILE):
            if not (directory / f).is_file():
                raise ValueError(f"{directory}: a feature head needs {f}; without it the head cannot read the "
                                 "LLM's features")

    def load(self, directory, dtype):
        model = super().load(directory, dtype)
        attach_fc(model, directory)
        return model

    def drafter(self, model, vocab_size, ranking):
        from boosttune.serving.lean import drafter_runner

        return FeatureDrafter(drafter_runner(model), vocab_size=vocab_size, ranking=ranking)

    def ships(self, directory):
        return _model_files(directory) + [FEATURE_FILE]

    def trained_tree(self, directory, tree):
        """The run's tree over the draft vocabulary the head was trained on (``feature_head.json``)."""
        if directory is None or not (directory / FEATURE_FILE).is_file():
            return tree
        try:
            k = json.loads((directory / FEATURE_FILE).read_text(encoding="utf-8")).get("draft_vocab")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            return tree
        return replace(tree, draft_vocab=int(k)) if isinstance(k, int) and k >= 0 else tree


@register
class PromptLookupKind(DrafterKind):
    """Prompt lookup (``lookup.py``): no model and no files; its tree's depth is its chain length."""

    name = "prompt_lookup"
    has_model = False

    def check(self, directory):
        pass

    def load(self, directory, dtype):
        return None

    def drafter(self, model, vocab_size, ranking):
        return PromptLookupDrafter(vocab_size=vocab_size)
