"""Feature-conditioned SSMs ("feature heads"): the files and the one module that reads the LLM's state.

A feature head drafts from the LLM's own last-layer hidden state (the *feature*: the LM head's input,
after the final norm) as well as from tokens, as EAGLE does (Li et al. 2024, arXiv 2401.15077): at
position j it reads the pair ``(F_j, token_{j+1})``, where ``F_j`` is the LLM's feature at j, and
predicts ``F_{j+1}``, whose LM-head logits are its guess for ``token_{j+2}``. Beyond the first draft
depth it reads its own predicted features. EAGLE's reason for doing so: the next feature is much
easier to predict than the next token (features are smooth), so one decoder layer on top of them
accepts far more often than a standalone SSM of the same cost.

On disk it is a Hugging Face causal-LM folder (a one- or few-layer copy of the LLM's architecture:
its embeddings, decoder layers, final norm and tied LM head), so transformers loads the body and
tokenizer like any SSM's, plus two files of ours:
- ``FEATURE_FILE`` (``feature_head.json``): format marker, the LLM hidden width it reads;
- ``FC_FILE`` (``feature_fc.safetensors``): the ``(H, 2H)`` projection of ``[embed(token), F]``
  into the body's input.

:func:`attach_fc` gives a loaded model its projection as ``model.feature_fc``; whoever drafts with
it asks :func:`is_feature_head`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

FEATURE_FILE = "feature_head.json"
FC_FILE = "feature_fc.safetensors"
FORMAT = "boosttune.feature_head"
VERSION = 1
FC_ATTR = "feature_fc"


def is_feature_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a feature head (its marker file)."""
    return (Path(path) / FEATURE_FILE).is_file()


def is_feature_head(model: nn.Module) -> bool:
    """Whether ``model`` is a loaded feature head (it carries its projection)."""
    return isinstance(getattr(model, FC_ATTR, None), nn.Linear)


def new_fc(hidden: int) -> nn.Linear:
    """The pair projection, initialised to pass the feature through: ``fc([e, F]) = F`` (the body
    then starts from the LLM's own state rather than from noise)."""
    fc = nn.Linear(2 * hidden, hidden, bias=False)
    with torch.no_grad():
        fc.weight.zero_()
        fc.weight[:, hidden:] = torch.eye(hidden)
    return fc


def pair_inputs(model: nn.Module, features: Tensor, tokens: Tensor) -> Tensor:
    """(..., H) features and (...) token ids → (..., H) inputs of the head's body."""
    fc: nn.Linear = getattr(model, FC_ATTR)
    emb = model.get_input_embeddings()(tokens.to(fc.weight.device))
    return fc(torch.cat([emb, features.to(device=fc.weight.device, dtype=fc.weight.dtype)], dim=-1))


def save_fc(model: nn.Module, out: str | Path, meta: dict | None = None) -> None:
    """Write the projection and the marker next to a saved HF folder ``out``."""
    fc: nn.Linear = getattr(model, FC_ATTR)
    save_file({"weight": fc.weight.detach().float().cpu().contiguous()}, str(Path(out) / FC_FILE))
    marker = {"format": FORMAT, "version": VERSION, "hidden_size": fc.weight.shape[0], **(meta or {})}
    (Path(out) / FEATURE_FILE).write_text(json.dumps(marker, indent=1) + "\n")


def save_head(model: nn.Module, out: str | Path, meta: dict | None = None) -> None:
    """``save_pretrained`` the head's body into ``out`` (its weights without the projection, which
    transformers would not load back), then the projection and the marker (:func:`save_fc`)."""
    fc = getattr(model, FC_ATTR)
    delattr(model, FC_ATTR)
    try:
        model.save_pretrained(out)
    finally:
        setattr(model, FC_ATTR, fc)
    save_fc(model, out, meta)


def attach_fc(model: nn.Module, path: str | Path) -> None:
    """Give a model loaded from ``path`` its projection (``model.feature_fc``), in its dtype and device.
    Raises ValueError naming the file when the folder is not a well-formed feature head."""
    marker_file, fc_file = Path(path) / FEATURE_FILE, Path(path) / FC_FILE
    marker = json.loads(marker_file.read_text())
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise ValueError(f"{marker_file}: not a {FORMAT} v{VERSION} marker; re-export the feature head")
    if not fc_file.is_file():
        raise ValueError(f"{fc_file} is missing: a feature head needs its projection; re-export it")
    weight = load_file(str(fc_file))["weight"]
    hidden = model.get_input_embeddings().weight.shape[1]
    if tuple(weight.shape) != (hidden, 2 * hidden):
        raise ValueError(f"{fc_file}: projection is {tuple(weight.shape)}, the head's width needs ({hidden}, {2 * hidden})")
    ref = model.get_input_embeddings().weight
    fc = nn.Linear(2 * hidden, hidden, bias=False).to(device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        fc.weight.copy_(weight)
    fc.requires_grad_(False)
    setattr(model, FC_ATTR, fc)
