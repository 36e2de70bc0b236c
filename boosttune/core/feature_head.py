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
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel

from boosttune.core.ranks import NOT_DRAFTABLE, token_ranks

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


def second_step(head: PreTrainedModel, cache, hidden: Tensor, tok: Tensor) -> Tensor:
    """The head's second draft step at every pair, as serving drafts depth 2 (EAGLE-3's "training-time
    test", Li et al. 2025, arXiv 2503.01840, §3: train the head on its own predictions, not only on the
    LLM's features).

    Serving feeds a depth-2 node as the pair (the head's predicted feature, its token) one position
    after the last committed pair, attending to every committed pair and itself
    (``serving/feature_drafter.py``). Here step-2 pair j = ``(hidden_j, token_{j+2})`` at position
    j + 1 sees the teacher-forced pairs 0..j (``cache``, filled by the first step) and itself; its
    output predicts ``F_{j+2}`` and ``token_{j+3}``.

    Args:
        head: the feature head.
        cache: the first step's cache over the n teacher-forced pairs.
        hidden: (B, n, H) the first step's outputs (predicted ``F_{j+1}``).
        tok: (B, n) the first step's tokens (``token_{j+1}``).

    Returns:
        (B, n - 1, H) the second step's outputs for j = 0 .. n - 2.
    """
    b, n, _ = hidden.shape
    m = n - 1
    dev = hidden.device
    inputs = pair_inputs(head, hidden[:, :m], tok[:, 1:].to(dev))
    j = torch.arange(m, device=dev)
    sees_cached = torch.arange(n, device=dev)[None, :] <= j[:, None]  # (m, n) pairs 0..j
    mask = torch.cat([sees_cached, torch.eye(m, dtype=torch.bool, device=dev)], dim=1)  # (m, n + m)
    pos = (j + 1).expand(b, m)
    body = head.base_model
    return body(inputs_embeds=inputs, attention_mask=mask.expand(b, 1, m, n + m), position_ids=pos,
                use_cache=True, **{_cache_kw(body): cache}).last_hidden_state


@torch.no_grad()
def teacher_forced_ranks(head: nn.Module, features: Tensor, ids: Sequence[int], prompt_len: int,
                         rows: Tensor | None = None, second: bool = False) -> tuple[Tensor, Tensor | None]:
    """Where the LLM's own answer ranks among the head's guesses, at every answer position, as serving
    drafts: (O,) ranks at depth 1 and, with ``second``, (O,) ranks at depth 2 (0: the head's argmax;
    ``NOT_DRAFTABLE`` outside the draft vocabulary ``rows``).

    For a step starting at answer position t (the committed text is ``ids[:prompt_len + t]``), depth 1
    is the guess of pair ``prompt_len + t - 2`` (the LLM's feature before the pending token, and that
    token) for answer token t; depth 2 is the guess, for answer token t + 1, of the depth-1 node that
    holds answer token t (:func:`second_step`). Positions with nothing to draft from (a one-token
    prompt at t = 0) and the depth-2 rank of the last answer token are ``NOT_DRAFTABLE``.

    Args:
        head: the feature head.
        features: (>= len(ids) - 1, H) the LLM's features at positions 0 .. len(ids) - 2.
        ids: prompt then answer token ids.
        prompt_len: P, the prompt's length (>= 1).
        rows: (K,) the draft vocabulary's token ids (None: the whole vocabulary).
        second: also depth 2.
    """
    m = len(ids) - 1  # pairs (F_j, ids[j + 1]) → guesses for ids[j + 2]
    o = len(ids) - prompt_len
    ranks1 = torch.full((o,), NOT_DRAFTABLE, dtype=torch.long)
    ranks2 = torch.full((o,), NOT_DRAFTABLE, dtype=torch.long) if second else None
    if m < 1 or o < 1:
        return ranks1, ranks2
    fc: nn.Linear = getattr(head, FC_ATTR)
    dev = fc.weight.device
    tok = torch.tensor(list(ids[1:]), device=dev)[None]  # (1, m)
    inputs = pair_inputs(head, features[:m][None], tok)
    body = head.base_model
    cache = DynamicCache(config=head.config) if second else None
    hidden = body(inputs_embeds=inputs, use_cache=second, **{_cache_kw(body): cache}).last_hidden_state  # (1, m, H)
    weight = head.get_output_embeddings().weight
    truth = torch.tensor(list(ids), device=dev)
    first = max(0, 2 - prompt_len)  # answer position t is guessed by pair j = prompt_len + t - 2 >= 0
    lo = prompt_len - 2 + first
    ranks1[first:] = token_ranks(hidden[0, lo : m - 1], weight, rows, truth[lo + 2 :])  # pairs lo .. m - 2
    if second and m - 2 > lo:  # step-2 pair j guesses ids[j + 3]: j = lo .. m - 3
        assert ranks2 is not None
        deep = second_step(head, cache, hidden, tok)[0]  # (m - 1, H)
        ranks2[first : o - 1] = token_ranks(deep[lo : m - 2], weight, rows, truth[lo + 3 :])
    return ranks1, ranks2


def _cache_kw(body: nn.Module) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"


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
    try:
        marker = json.loads(marker_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{marker_file}: not a readable JSON marker ({e}); re-export the feature head") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise ValueError(f"{marker_file}: not a {FORMAT} v{VERSION} marker; re-export the feature head")
    if not fc_file.is_file():
        raise ValueError(f"{fc_file} is missing: a feature head needs its projection; re-export it")
    tensors = load_file(str(fc_file))
    if set(tensors) != {"weight"}:
        raise ValueError(f"{fc_file}: must hold exactly one tensor 'weight', holds {sorted(tensors)[:4]}; re-export it")
    weight = tensors["weight"]
    hidden = model.get_input_embeddings().weight.shape[1]
    if tuple(weight.shape) != (hidden, 2 * hidden):
        raise ValueError(f"{fc_file}: projection is {tuple(weight.shape)}, the head's width needs ({hidden}, {2 * hidden})")
    ref = model.get_input_embeddings().weight
    fc = nn.Linear(2 * hidden, hidden, bias=False).to(device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        fc.weight.copy_(weight)
    fc.requires_grad_(False)
    setattr(model, FC_ATTR, fc)
