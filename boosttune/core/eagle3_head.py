"""EAGLE-3 heads: a drafter in the layout llama.cpp, vLLM and SGLang load.

EAGLE-3 (Li et al. 2025, arXiv 2503.01840) drafts from three of the LLM's hidden states instead of
its last one: the inputs of a low, a middle and a high decoder layer, concatenated (``3 H_t``) and
fused by one projection ``fc`` into the draft's width H. One decoder layer then reads, at position
j, the pair (token ``t_{j+1}``, fused state ``g_j``): both are RMS-normed and concatenated into a
``2 H`` input of its q/k/v projections; the residual stream starts from ``g_j`` itself. Its output
before the final norm (the *pre-norm state*) is what later draft steps read in place of ``g``; after
the norm, an LM head over a draft vocabulary of K tokens (its own, not the LLM's) guesses
``t_{j+2}``. ``d2t`` maps draft row k to the LLM's token id.

This is the layout of llama.cpp's ``eagle3`` architecture (llama.cpp ``src/models/eagle3.cpp``,
read to match its arithmetic: ``norm_before_residual`` false, ``norm_before_fc`` false, the LLM's
token embeddings, the features from ``llama_get_embeddings_layer_inp``, i.e. each layer's input),
and of the Hugging Face checkpoints its converter reads (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t`` as offsets, ``t2d``). Our own feature head (``core/feature_head.py``) is
EAGLE-1-shaped: none of those engines loads it; this one they do.

Shape legend: B batch, n positions, H the head's width, H_t the LLM's, K draft vocabulary, D draft
steps unrolled in training ("training-time test", the paper's §3.2: step s reads step s - 1's
pre-norm states).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

HF_ARCH = "LlamaForCausalLMEagle3"
"""The architecture name of EAGLE-3 checkpoints (SafeAILab's), which llama.cpp's converter detects."""
SPEC_FILE = "eagle3_head.json"
"""Our marker: the spec and format version, next to the HF-layout ``config.json``."""
FORMAT = "boosttune.eagle3_head"
VERSION = 1
WEIGHTS_FILE = "model.safetensors"


def default_layers(n_layers: int) -> tuple[int, int, int]:
    """The low, middle and high layers whose inputs the head fuses: 2, n/2 and n-1.

    EAGLE-3's code (and llama.cpp's converter, for a checkpoint that names none) reads 2, n/2 and n-3.
    The last layer's input is closer to what the LLM predicts from: on the demo run's data (SmolLM2-135M,
    30 layers), 250 steps each, held-out greedy chains of 3 reached τ 1.84 with layers 2, 15, 29 against
    1.71 with 2, 15, 27 (first draft right 48.9 % against 43.8 %; docs/measurements.md). The layers are
    written into the head's config, so every engine reads the ones it was trained on."""
    if n_layers < 4:
        raise ValueError(f"an EAGLE-3 head needs an LLM of at least 4 layers (it reads layers 2, n/2, n-1), got {n_layers}")
    return (2, n_layers // 2, n_layers - 1)


@dataclass(frozen=True)
class Eagle3Spec:
    """Everything that shapes an EAGLE-3 head (the LLM's geometry, which layers it reads)."""

    hidden: int
    """H, the head's width (the LLM's, so the LLM's token embeddings serve it)."""
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    max_positions: int
    vocab: int
    """The LLM's vocabulary size (``d2t`` maps into it)."""
    draft_vocab: int
    """K, the rows of the head's own LM head."""
    target_hidden: int
    """H_t, the LLM's width."""
    layers: tuple[int, int, int]
    """The LLM layers whose inputs are fused (low, middle, high)."""

    def __post_init__(self) -> None:
        if len(self.layers) != 3:
            raise ValueError(f"eagle3.layers: an EAGLE-3 head fuses exactly 3 layers, got {list(self.layers)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"attention heads {self.heads} must be a multiple of key/value heads {self.kv_heads}")

    @classmethod
    def from_llm(cls, config, draft_vocab: int, layers: tuple[int, int, int] | None = None) -> Eagle3Spec:
        """The spec of a head for an LLM with HF ``config`` (a Llama-architecture one)."""
        n = config.num_hidden_layers
        given = [int(x) for x in (layers or default_layers(n))]
        if len(given) != 3 or any(not 0 <= x < n for x in given):
            raise ValueError(f"eagle3.layers: 3 layer indices in 0..{n - 1} (the LLM has {n} layers), got {given}")
        low, mid, high = given
        rope = getattr(config, "rope_parameters", None) or {}
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(hidden=config.hidden_size, intermediate=config.intermediate_size,
                   heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, head_dim=head_dim,
                   rms_eps=float(config.rms_norm_eps),
                   rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
                   max_positions=config.max_position_embeddings, vocab=config.vocab_size,
                   draft_vocab=draft_vocab, target_hidden=config.hidden_size, layers=(low, mid, high))


class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in fp32 as Llama's norm is."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotary position embedding of (B, heads, n, d) ``x`` at (B, n) positions, in Hugging Face's layout
    (dimension i pairs with i + d/2)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)  # (d/2,)
    ang = pos.float()[:, None, :, None] * inv  # (B, 1, n, d/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


class Eagle3Head(nn.Module):
    """The head: ``fc``, one decoder layer on ``[norm(embed(t)), norm(g)]``, final norm, draft LM head.

    ``embed`` is the LLM's token embedding (frozen, not saved: every engine gives the head the LLM's).
    """

    def __init__(self, spec: Eagle3Spec, embed: Tensor, d2t: Tensor):
        super().__init__()
        if tuple(d2t.shape) != (spec.draft_vocab,):
            raise ValueError(f"d2t must be ({spec.draft_vocab},) target ids, got {tuple(d2t.shape)}")
        h, a, kv = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
        self.spec = spec
        self.embed = nn.Embedding.from_pretrained(embed.detach().float().clone(), freeze=True)
        self.fc = nn.Linear(3 * spec.target_hidden, h, bias=False)
        self.input_layernorm = RMSNorm(h, spec.rms_eps)
        self.hidden_norm = RMSNorm(h, spec.rms_eps)
        self.q_proj = nn.Linear(2 * h, a, bias=False)
        self.k_proj = nn.Linear(2 * h, kv, bias=False)
        self.v_proj = nn.Linear(2 * h, kv, bias=False)
        self.o_proj = nn.Linear(a, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, spec.rms_eps)
        self.gate_proj = nn.Linear(h, spec.intermediate, bias=False)
        self.up_proj = nn.Linear(h, spec.intermediate, bias=False)
        self.down_proj = nn.Linear(spec.intermediate, h, bias=False)
        self.norm = RMSNorm(h, spec.rms_eps)
        self.lm_head = nn.Linear(h, spec.draft_vocab, bias=False)
        self.register_buffer("d2t", d2t.detach().long().clone(), persistent=False)

    # ---------------------------------------------------------------------------------- the step
    def get_input_embeddings(self) -> nn.Embedding:
        """The LLM's token embeddings the head reads (what a transformers model answers here)."""
        return self.embed

    def qkv(self, tokens: Tensor, g: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, n) tokens, (B, n, H) states at (B, n) positions → q (B, heads, n, d), k and v
        (B, kv_heads, n, d), rotated."""
        return self.qkv_embedded(self.embed(tokens).to(g.dtype), g, pos)

    def qkv_embedded(self, e: Tensor, g: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`qkv` from the (B, n, H) token embeddings ``e`` instead of the tokens."""
        s = self.spec
        x = torch.cat([self.input_layernorm(e), self.hidden_norm(g)], -1)  # (B, n, 2H)
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, s.heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
        return rotary(q, pos, s.rope_theta), rotary(k, pos, s.rope_theta), v

    def finish(self, attn: Tensor, g: Tensor) -> Tensor:
        """(B, heads, n, d) attention output and the (B, n, H) states it read → (B, n, H) pre-norm
        states (residual from the raw ``g``: llama.cpp's ``norm_before_residual`` false)."""
        b, _, n, _ = attn.shape
        h = self.o_proj(attn.transpose(1, 2).reshape(b, n, -1)) + g
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def logits(self, prenorm: Tensor) -> Tensor:
        """(..., H) pre-norm states → (..., K) draft-vocabulary logits."""
        return self.lm_head(self.norm(prenorm))

    # ------------------------------------------------------------------------ training-time test
    def unroll(self, aux: Tensor, tokens: Tensor, depth: int) -> list[Tensor]:
        """Pre-norm states of ``depth`` draft steps from every position, teacher forced, as a chain
        drafts them.

        Step 0 at position j reads ``(t_{j+1}, fc(aux_j))`` and attends causally to every step-0 pair
        (these are the pairs the draft cache holds for committed text). Step s >= 1 at j reads
        ``(t_{j+s+1}, step s-1's state at j)`` at position j + s, and attends to step-0 pairs 0..j and
        to its own chain's steps 1..s at j, which is what a chain drafted from j attends to.

        Args:
            aux: (B, n, 3 H_t) the LLM's three layer inputs at positions 0..n-1.
            tokens: (B, n) ``tokens[:, j]`` = t_{j+1}, the token after position j.
            depth: D >= 1 steps.

        Returns:
            D tensors, step s's (B, n - s, H): its state for the chain starting at j = 0..n-s-1,
            whose logits guess t_{j+s+2}.
        """
        assert aux.shape[:2] == tokens.shape and depth >= 1, (aux.shape, tokens.shape, depth)
        b, n = tokens.shape
        s = self.spec
        group = s.heads // s.kv_heads
        pos = torch.arange(n, device=aux.device).expand(b, n)
        g = self.fc(aux)  # (B, n, H)
        q, k0, v0 = self.qkv(tokens, g, pos)
        k0, v0 = k0.repeat_interleave(group, 1), v0.repeat_interleave(group, 1)  # (B, heads, n, d)
        out = [self.finish(F.scaled_dot_product_attention(q, k0, v0, is_causal=True), g)]
        chain_k: list[Tensor] = []
        chain_v: list[Tensor] = []
        scale = s.head_dim ** -0.5
        causal = torch.ones(n, n, dtype=torch.bool, device=aux.device).tril()
        for step in range(1, depth):
            m = n - step
            if m <= 0:
                break
            prev = out[-1][:, :m]
            q, k, v = self.qkv(tokens[:, step:], prev, pos[:, :m] + step)
            chain_k.append(k.repeat_interleave(group, 1))
            chain_v.append(v.repeat_interleave(group, 1))
            main = (q @ k0.transpose(-1, -2)) * scale  # (B, heads, m, n)
            main = main.masked_fill(~causal[:m], float("-inf"))
            own = torch.stack([(q * ck[:, :, :m]).sum(-1) * scale for ck in chain_k], -1)  # (B, heads, m, step)
            p = torch.softmax(torch.cat([main, own], -1).float(), -1).to(q.dtype)
            attn = p[..., :n] @ v0 + sum(p[..., n + r, None] * cv[:, :, :m] for r, cv in enumerate(chain_v))
            out.append(self.finish(attn, prev))
        return out

    # ------------------------------------------------------------------------------------- files
    def save(self, out: str | Path, meta: dict | None = None) -> None:
        """The Hugging Face EAGLE-3 layout into folder ``out``: ``config.json`` (SafeAILab's keys, which
        llama.cpp's converter reads with ``--target-model-dir``), ``model.safetensors`` (``fc``,
        ``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` as offsets from the row index, ``t2d``), plus our
        marker with the spec."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        s = self.spec
        save_file(hf_state(self), str(out / WEIGHTS_FILE))
        config = {
            "architectures": [HF_ARCH], "model_type": "llama", "hidden_size": s.hidden,
            "intermediate_size": s.intermediate, "num_attention_heads": s.heads,
            "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim, "num_hidden_layers": 1,
            "rms_norm_eps": s.rms_eps, "rope_theta": s.rope_theta, "max_position_embeddings": s.max_positions,
            "vocab_size": s.vocab, "draft_vocab_size": s.draft_vocab, "target_hidden_size": s.target_hidden,
            "eagle_aux_hidden_state_layer_ids": list(s.layers), "hidden_act": "silu",
            "tie_word_embeddings": False, "norm_before_residual": False, "torch_dtype": "float32",
        }
        (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        marker = {"format": FORMAT, "version": VERSION, "spec": asdict(self.spec), **(meta or {})}
        (out / SPEC_FILE).write_text(json.dumps(marker, indent=1) + "\n")


_LAYER = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _hf_names() -> dict[str, str]:
    """The HF EAGLE-3 checkpoint's name of each of the head's trained weights → its name here (``d2t`` and
    ``t2d`` aside: buffers, written in the checkpoint's own form)."""
    names = {n: n for n in ("fc.weight", "norm.weight", "lm_head.weight")}
    names |= {f"midlayer.{n}.weight": f"{n}.weight" for n in _LAYER}
    names |= {f"midlayer.self_attn.{n}.weight": f"{n}.weight" for n in _ATTN}
    names |= {f"midlayer.mlp.{n}.weight": f"{n}.weight" for n in _MLP}
    return names


def hf_shapes(spec: Eagle3Spec) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of a head of ``spec`` in the HF EAGLE-3 checkpoint (built on the meta
    device: nothing allocated), what a saved head's file must hold."""
    with torch.device("meta"):
        head = Eagle3Head(spec, torch.empty(spec.vocab, spec.hidden), torch.empty(spec.draft_vocab, dtype=torch.long))
    params = dict(head.named_parameters())
    shapes = {hf: tuple(params[ours].shape) for hf, ours in _hf_names().items()}
    return shapes | {"d2t": (spec.draft_vocab,), "t2d": (spec.vocab,)}


def hf_state(head: Eagle3Head) -> dict[str, Tensor]:
    """The head's weights under the HF EAGLE-3 checkpoint's names (fp32, contiguous)."""
    params = dict(head.named_parameters())
    state = {hf: params[ours].detach().float().cpu().contiguous() for hf, ours in _hf_names().items()}
    d2t = head.d2t.cpu()
    state["d2t"] = (d2t - torch.arange(len(d2t))).contiguous()  # offsets: target id = k + d2t[k]
    t2d = torch.zeros(head.spec.vocab, dtype=torch.bool)
    t2d[d2t] = True
    state["t2d"] = t2d
    return state


def is_eagle3_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a head saved by :meth:`Eagle3Head.save`."""
    return (Path(path) / SPEC_FILE).is_file()


def read_spec(path: str | Path) -> Eagle3Spec:
    """The spec in the marker of the head saved in ``path``. Raises ValueError naming the file when the
    folder is not one."""
    path = Path(path)
    try:
        marker = json.loads((path / SPEC_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path / SPEC_FILE}: not a readable EAGLE-3 head marker ({e}); re-train or re-export it") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise ValueError(f"{path / SPEC_FILE}: not a {FORMAT} v{VERSION} marker; re-train the head")
    return Eagle3Spec(**{**marker["spec"], "layers": tuple(marker["spec"]["layers"])})


def load_head(path: str | Path, embed: Tensor) -> Eagle3Head:
    """The head saved in ``path``, given the LLM's (V, H) token embeddings. Raises ValueError naming
    the file when the folder is not one."""
    path = Path(path)
    spec = read_spec(path)
    if tuple(embed.shape) != (spec.vocab, spec.hidden):
        raise ValueError(f"{path}: the head needs the LLM's ({spec.vocab}, {spec.hidden}) embeddings, got {tuple(embed.shape)}")
    state = load_file(str(path / WEIGHTS_FILE))
    offsets = state.pop("d2t")
    state.pop("t2d", None)
    head = Eagle3Head(spec, embed, offsets + torch.arange(len(offsets)))
    mine = _hf_names()
    if set(state) != set(mine):
        raise ValueError(f"{path / WEIGHTS_FILE}: tensors {sorted(set(state) ^ set(mine))[:4]} differ from an EAGLE-3 head's")
    head.load_state_dict({mine[k]: v for k, v in state.items()} | {"embed.weight": head.embed.weight}, strict=True)
    return head
