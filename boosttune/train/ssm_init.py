"""SSM initialisation: a pretrained small model (hub id / path) or one derived from the LLM.

``derived`` builds a model of the LLM's own architecture (its config class, tokenizer, rope, norms)
with few decoder layers:
- ``ssm.layers = [i, j, ...]`` copies those LLM layers, with the LLM's embeddings and final norm;
  DESIGN.md measured truncated LLM layers at 3-6 % top-1 agreement before training; the first stage
  of configs/smollm2-demo.yaml takes layers 0-3 of SmolLM2 to 31 % held-out top-1 (docs/measurements.md, "Boost-tuning").
- ``ssm.layers = []`` with ``ssm.num_layers = n`` and optionally ``ssm.hidden_size = h`` makes fresh
  layers; a narrower width gets the LLM's embeddings projected onto their top-``h`` principal
  directions, so the SSM starts in the LLM's token geometry.
Embeddings stay tied (the LM head is the embedding matrix), as in the LLMs we target.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from boosttune.config import SSMInitConfig
from boosttune.core.models import check_same_vocabulary, load_model, model_vocab_size


def _layer_prefix(model: PreTrainedModel) -> str:
    for name, _ in model.named_modules():
        if name.endswith("layers.0"):
            return name[: -len("0")]
    raise ValueError(f"{type(model).__name__}: cannot find its decoder layers (expected a '...layers.0' module)")


def _small_config(llm_config, num_layers: int, hidden: int):
    cfg = copy.deepcopy(llm_config)
    cfg.num_hidden_layers = num_layers
    cfg.tie_word_embeddings = True
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(cfg.layer_types)[:num_layers]
    if hidden and hidden != cfg.hidden_size:
        heads = max(1, hidden // cfg.head_dim) if getattr(cfg, "head_dim", None) else cfg.num_attention_heads
        ratio = max(1, cfg.num_attention_heads // max(1, cfg.num_key_value_heads))
        cfg.hidden_size = hidden
        cfg.intermediate_size = int(hidden * cfg.intermediate_size / llm_config.hidden_size)
        cfg.num_attention_heads = heads
        cfg.num_key_value_heads = max(1, heads // ratio)
        cfg.head_dim = hidden // heads
    return cfg


def _pca_projection(embed: torch.Tensor, width: int) -> torch.Tensor:
    """(d, width): the top principal directions of the embedding rows."""
    centred = embed.float() - embed.float().mean(0, keepdim=True)
    _, _, v = torch.linalg.svd(centred[:: max(1, embed.shape[0] // 8192)], full_matrices=False)
    return v[:width].T


def derive_ssm(llm: PreTrainedModel, cfg: SSMInitConfig) -> PreTrainedModel:
    """A small model of the LLM's architecture (fp32, train mode), initialised from the LLM."""
    n_llm = llm.config.num_hidden_layers
    bad = [i for i in cfg.layers if i >= n_llm]
    if bad:
        raise ValueError(f"ssm.layers: the LLM has {n_llm} layers (0..{n_llm - 1}), got {bad}")
    copy_layers = bool(cfg.layers)
    if copy_layers and cfg.hidden_size not in (0, llm.config.hidden_size):
        raise ValueError("ssm.hidden_size: copying LLM layers needs the LLM's width; set ssm.hidden_size: 0 "
                         "or ssm.layers: [] with ssm.num_layers")
    n = len(cfg.layers) if copy_layers else cfg.num_layers
    sconf = _small_config(llm.config, n, 0 if copy_layers else cfg.hidden_size)
    sconf.dtype = "float32"
    torch.manual_seed(0)
    ssm = AutoModelForCausalLM.from_config(sconf, dtype=torch.float32)
    src = {k: v.detach().float() for k, v in llm.state_dict().items()}
    dst = ssm.state_dict()
    embed_key = next(k for k in dst if k.endswith("embed_tokens.weight"))
    width = sconf.hidden_size
    if width == llm.config.hidden_size:
        dst[embed_key] = src[embed_key]
        norm_key = next((k for k in dst if k.endswith("norm.weight") and "layers." not in k), None)
        if norm_key:
            dst[norm_key] = src[norm_key]
    else:
        emb = src[embed_key]
        proj = _pca_projection(emb, width)
        dst[embed_key] = (emb - emb.mean(0, keepdim=True)) @ proj
    if copy_layers:
        prefix = _layer_prefix(llm)
        for new, old in enumerate(cfg.layers):
            for k, v in src.items():
                if k.startswith(f"{prefix}{old}."):
                    dst[f"{prefix}{new}." + k[len(f"{prefix}{old}."):]] = v
    ssm.load_state_dict(dst)
    ssm.tie_weights()
    return ssm.train()


def init_ssm(llm_loaded, cfg: SSMInitConfig) -> PreTrainedModel:
    """The starting weights of every stage's SSM (fp32, train mode)."""
    if cfg.init == "derived":
        return derive_ssm(llm_loaded.model, cfg)
    ssm = load_model(cfg.init, torch.float32)
    check_same_vocabulary(llm_loaded.tokenizer, ssm.tokenizer, model_vocab_size(llm_loaded.model),
                          model_vocab_size(ssm.model), f"ssm.init={cfg.init}")
    ssm.model.requires_grad_(True)
    return ssm.model.train()
