"""Drafter kinds: the one registry of what can draft, and everything in which kinds differ.

A *kind* (``"ssm"``, ``"feature"``, ``"eagle3"``, ``"prompt_lookup"``, or one a user registers) is one class,
registered with :func:`register`. A bundle's manifest names each drafter's kind (``manifest.py``),
and every place that loads, checks, builds or ships a drafter asks its kind instead of looking at
files, attributes or class names:

- ``check(directory)``: the files and fields a drafter of this kind needs, before anything loads;
- ``load(directory, dtype, device, llm)``: its model (None for kinds without one, such as prompt
  lookup; an EAGLE-3 head reads the LLM's token embeddings);
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
from boosttune.core.feature_head import FORMAT as FEATURE_FORMAT
from boosttune.core.feature_head import VERSION as FEATURE_VERSION
from boosttune.core.kind_file import declared_kind
from boosttune.core.low_rank import DELTA_FILE
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
    own_vocabulary: ClassVar[bool] = False
    """Whether it drafts over a vocabulary of its own (its LM head's rows), never a tree's ``draft_vocab``."""

    def check_tree(self, tree: TreeConfig) -> None:
        """Refuse (a ``ValueError`` naming the flag) a tree this kind cannot draft, before any request."""
        if self.own_vocabulary and tree.draft_vocab:
            raise ValueError(f"--draft-vocab: a {self.name} drafter drafts over its own vocabulary; give it a tree "
                             "with draft vocabulary 0 (--draft-vocab 0)")

    def check(self, directory: Path) -> None:
        """Refuse ``directory`` (a ``ValueError`` naming the file) if it lacks what this kind needs:
        a config that builds a model and weights that are exactly that model's (``check_model``)."""
        if not (directory / _CONFIG).is_file():
            raise ValueError(f"{directory}: no {_CONFIG}; a {self.name} drafter is a transformers model directory")
        if not any(p.suffix == ".safetensors" for p in directory.iterdir()):
            raise ValueError(f"{directory}: no *.safetensors weights for this {self.name} drafter")
        self.check_model(directory, skip=(DELTA_FILE,))  # an SSM's low-rank factors (core/low_rank.py)

    @staticmethod
    def check_model(directory: Path, skip: tuple[str, ...] = ()) -> nn.Module:
        """Build the model ``config.json`` describes on the meta device (nothing allocated, nothing from
        the directory executed: no remote code) and compare its tensors with the safetensors headers of
        ``directory`` (files named in ``skip`` aside): every tensor the model needs must be there with its
        shape, and none other. Missing tensors would be randomly initialised and unexpected ones dropped
        by ``from_pretrained``, both silently (a config with more or fewer layers than its weights).
        Returns the meta model (its shapes). Raises ``ValueError`` naming the file."""
        from safetensors import SafetensorError, safe_open
        from transformers import AutoConfig, AutoModelForCausalLM

        shapes: dict[str, tuple[int, ...]] = {}
        where: dict[str, str] = {}
        for f in sorted(directory.glob("*.safetensors")):
            if f.name in skip:
                continue
            try:
                with safe_open(f, framework="pt") as st:
                    for key in st.keys():
                        shapes[key], where[key] = tuple(st.get_slice(key).get_shape()), f.name
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{f}: not a valid safetensors file ({e})") from None
        config_file = directory / _CONFIG
        try:
            config = AutoConfig.from_pretrained(directory)
        # transformers reports bad fields as TypeError, ValueError or huggingface_hub's
        # StrictDataclassError (an Exception subclass only), depending on the field
        except Exception as e:  # any failure here is the file's: re-raised as one naming it
            raise ValueError(f"{config_file}: not a valid model config ({e})") from None
        layers = getattr(config, "num_hidden_layers", None)
        if isinstance(layers, int) and not 0 < layers <= len(shapes):  # each layer has tensors: no model to build
            raise ValueError(f"{config_file}: num_hidden_layers {layers} does not fit weights of {len(shapes)} tensors")
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        # an unknown hidden_act is a KeyError, a bad rope_scaling a KeyError, ValueError or TypeError
        # from the rotary embedding's initialiser: whatever transformers raises, the config is at fault
        except Exception as e:
            raise ValueError(f"{config_file}: does not build a model ({type(e).__name__}: {e})") from None
        groups: dict[int, list[str]] = {}  # tied weights are one parameter under several names
        for name, param in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(param), []).append(name)
        needed = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        unexpected = sorted(set(shapes) - set(needed))
        if unexpected:
            raise ValueError(f"{directory / where[unexpected[0]]}: tensor {unexpected[0]!r}"
                             f"{f' and {len(unexpected) - 1} more' if len(unexpected) > 1 else ''}: not in the "
                             f"model that {_CONFIG} describes (a config with fewer layers than the weights?)")
        tied = {n for names in groups.values() if len(names) > 1 for n in names}
        missing = sorted(n for n in needed if n not in shapes and not (
            n in tied and any(m in shapes for names in groups.values() if n in names for m in names)))
        if missing:
            raise ValueError(f"{directory}: the weights lack tensor {missing[0]!r}"
                             f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''} of the model "
                             f"that {_CONFIG} describes (missing weights, or a config with more layers)")
        for name, shape in shapes.items():
            if shape != needed[name]:
                raise ValueError(f"{directory / where[name]}: tensor {name!r} has shape {list(shape)}, the model "
                                 f"that {_CONFIG} describes needs {list(needed[name])}")
        return model

    def load(self, directory: Path, dtype: torch.dtype, device: torch.device | str = "cpu",
             llm: nn.Module | None = None) -> nn.Module | None:
        """The drafter's model on ``device``, in eval mode without gradients; ``llm``: the LLM it drafts
        for (a kind that shares the LLM's weights, e.g. its token embeddings, reads them there)."""
        return load_causal_lm(directory, dtype, device)

    def drafter(self, model: nn.Module | None, vocab_size: int, ranking: Tensor | None) -> Drafter:
        """The drafter that serves ``model`` for an LLM of ``vocab_size`` logits."""
        raise NotImplementedError

    def ships(self, directory: Path) -> list[str]:
        """Names of the files in ``directory`` that a bundle carries (weights, configs, stats)."""
        return []

    def trained_tree(self, directory: Path | None, tree: TreeConfig) -> TreeConfig:
        """The tree this drafter drafts by default, given the run's ``tree``."""
        return tree


def header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in safetensors ``file``, from its header (no weights read); a ``ValueError``
    naming the file when it is not one."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as st:
            return {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a valid safetensors file ({e})") from None


def load_causal_lm(directory: Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> nn.Module:
    """A transformers causal LM from ``directory`` on ``device`` for inference (safetensors only: nothing
    unpickled)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, use_safetensors=True, device_map=str(device))
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

    def check(self, directory):
        for f in (FEATURE_FILE, FC_FILE):
            if (directory / f).exists():  # a head served as a plain SSM would drop its projection, silently
                raise ValueError(f"{directory / f}: a feature head's file in a drafter of kind 'ssm'; the manifest "
                                 "must name its kind 'feature'")
        super().check(directory)

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
        for f in (FEATURE_FILE, FC_FILE):
            if not (directory / f).is_file():
                raise ValueError(f"{directory}: a feature head needs {f}; without it the head cannot read the "
                                 "LLM's features")
        if not (directory / _CONFIG).is_file():
            raise ValueError(f"{directory}: no {_CONFIG}; a {self.name} drafter is a transformers model directory")
        body = self.check_model(directory, skip=(FC_FILE,))
        marker_file = directory / FEATURE_FILE
        try:
            marker = json.loads(marker_file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"{marker_file}: not valid JSON ({e})") from None
        if not isinstance(marker, dict) or marker.get("format") != FEATURE_FORMAT or marker.get("version") != FEATURE_VERSION:
            raise ValueError(f"{marker_file}: not a {FEATURE_FORMAT} v{FEATURE_VERSION} marker (a JSON object with "
                             "format and version)")
        k = marker.get("draft_vocab", 0)
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"{marker_file}: draft_vocab must be an integer >= 0, got {k!r}")
        self.check_projection(directory / FC_FILE, body.get_input_embeddings().weight.shape[1])

    @staticmethod
    def check_projection(fc_file: Path, hidden: int) -> None:
        """The projection file holds exactly one tensor ``weight`` of shape (H, 2H) (headers only)."""
        found = header_shapes(fc_file)
        if set(found) != {"weight"}:
            raise ValueError(f"{fc_file}: must hold exactly one tensor 'weight', holds {sorted(found)[:4]}")
        if found["weight"] != (hidden, 2 * hidden):
            raise ValueError(f"{fc_file}: 'weight' has shape {list(found['weight'])}, the head's width needs "
                             f"[{hidden}, {2 * hidden}]")

    def load(self, directory, dtype, device="cpu", llm=None):
        model = super().load(directory, dtype, device)
        attach_fc(model, directory)  # on the model's device
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
    """Prompt lookup (``lookup.py``): no model and no files; its tree's depth is its chain length. Its
    ``drafter``'s model is the LLM's phrase table (``phrases.py``) or None: a bundle carries the
    table beside the drafters, not in a drafter's directory."""

    name = "prompt_lookup"
    has_model = False

    def check(self, directory):
        pass

    def load(self, directory, dtype, device="cpu", llm=None):
        return None

    def drafter(self, model, vocab_size, ranking):
        return PromptLookupDrafter(vocab_size=vocab_size, phrases=model)


@register
class Eagle3Kind(DrafterKind):
    """An EAGLE-3 head (``core/eagle3_head.py``): reads three of the LLM's layer inputs
    (``Eagle3Drafter``) and the LLM's token embeddings; trained by the ``eagle3`` phase."""

    name = "eagle3"
    phase = "eagle3"
    own_vocabulary = True

    def check(self, directory):
        from boosttune.core.eagle3_head import WEIGHTS_FILE, hf_shapes, read_spec

        spec = read_spec(directory)  # a ValueError naming the marker
        weights = directory / WEIGHTS_FILE
        if not weights.is_file():
            raise ValueError(f"{directory}: no {WEIGHTS_FILE}; an EAGLE-3 head's weights are missing")
        need = hf_shapes(spec)
        found = header_shapes(weights)
        if set(found) != set(need):
            raise ValueError(f"{weights}: tensors {sorted(set(found) ^ set(need))[:4]} differ from an EAGLE-3 head's")
        for key, shape in need.items():
            if found[key] != shape:
                raise ValueError(f"{weights}: tensor {key!r} has shape {list(found[key])}, the head's "
                                 f"eagle3_head.json needs {list(shape)}")

    def load(self, directory, dtype, device="cpu", llm=None):
        from boosttune.core.eagle3_head import load_head
        from boosttune.serving import cpu_linear

        if llm is None:
            raise ValueError("an EAGLE-3 head reads the LLM's token embeddings; load it with its LLM")
        head = load_head(directory, llm.get_input_embeddings().weight.detach())
        head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)
        if head.fc.weight.device.type == "cpu":
            cpu_linear.install(head)
        return head

    def drafter(self, model, vocab_size, ranking):
        from boosttune.serving.eagle3_drafter import Eagle3Drafter

        return Eagle3Drafter(model, vocab_size)

    def ships(self, directory):
        from boosttune.core.eagle3_head import SPEC_FILE, WEIGHTS_FILE

        return [_CONFIG, WEIGHTS_FILE, SPEC_FILE]

    MIN_PROB: ClassVar[float] = 0.4
    """Deeper levels only under a draft the head believes in: each level costs a head forward (~1.7 ms
    on 2 cores, mostly its 8,192-row LM head), paid only where a chain is likely to be accepted. On
    MT-bench 1-20 (bf16, 2 cores, demo data) widths [3, 1, 1] gave 2.05 tokens a step at 64.5 tok/s
    with this floor, 2.02 at 46.8-51.5 without it, and [3] alone 1.87-1.90 at 58-62 (docs/measurements.md)."""

    def trained_tree(self, directory, tree):
        """Chains as deep as the head was trained to draft (``eagle3.depth``), the run's first width at
        the root, expanded only under drafts of cumulative probability >= ``MIN_PROB`` (or the run's
        own floor, if higher); over the head's own vocabulary (``draft_vocab`` 0)."""
        depth = 3
        if directory is not None and (directory / "stats.json").is_file():
            try:
                depth = int(json.loads((directory / "stats.json").read_text(encoding="utf-8"))["config"]["depth"])
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
                pass
        return replace(tree, kind="expansion", widths=(tree.widths[0] if tree.widths else 1,) + (1,) * (depth - 1),
                       min_prob=max(tree.min_prob, self.MIN_PROB), draft_vocab=0)
