"""SSMs that differ from the first SSM by low-rank deltas: the factors, their file, and the check.

Shape legend: O a matrix's output rows, I its input width, R the rank.

Why: N SSMs of one shape drafting together (``serving/stacked.py``) still read N sets of weights per
draft, and a small SSM's draft is bound by reading its weights (docs/measurements.md, "What N SSMs
cost to draft, stacked": c(3) = 2.45 stacked). Members whose every layer matrix is SSM 1's plus a
rank-R product ``B @ A`` draft with SSM 1's weights read once for all members' rows, plus N small
products.

How: with ``boost.delta_rank`` R > 0, training cuts SSM k's delta from SSM 1 (k > 1) in every layer
matrix to its best rank-R approximation (the truncated SVD, Eckart-Young) and saves SSM k as SSM 1
plus that delta, so the saved model is exactly what drafts; the factors go beside its weights in
``DELTA_FILE`` (``A``: (R, I), ``B``: (O, R), the singular values folded into ``B``). The matrices
one stacked product fuses (q, k, v; gate, up) are cut together and share ``A``, so their deltas cost
one rank-R product pair, not one per matrix. A stack
checks that each member's factors rebuild its weights from the first member's before using them
(``rebuilds``), so a factor file that does not belong to its weights is never used silently.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

DELTA_FILE = "delta.safetensors"
"""An SSM directory's low-rank factors over SSM 1: ``<parameter>.A`` (R, I) and ``<parameter>.B`` (O, R)."""

Factors = dict[str, tuple[Tensor, Tensor]]
"""(A, B) by parameter name (``model.layers.0.self_attn.q_proj.weight``)."""


def is_layer_matrix(name: str, value: Tensor) -> bool:
    """Whether parameter ``name`` is one of the decoder layers' projection matrices (what deltas cover)."""
    return value.ndim == 2 and ".layers." in name and name.endswith("_proj.weight")


def truncate_delta(base: Tensor, member: Tensor, rank: int) -> tuple[Tensor, Tensor, float]:
    """The best rank-``rank`` approximation of ``member - base`` (fp32) as (A (R, I), B (O, R)), and the
    share of the delta's energy (squared Frobenius norm) it keeps (1.0 for a zero delta)."""
    delta = member.float() - base.float()
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    r = min(rank, s.numel())
    total = float((s * s).sum())
    kept = float((s[:r] * s[:r]).sum()) / total if total > 0 else 1.0
    return vh[:r].contiguous(), (u[:, :r] * s[:r]).contiguous(), kept


def fused_group(name: str) -> str:
    """The product a layer matrix is fused into when SSMs draft stacked (``serving/stacked.py``): q, k and v
    are one, gate and up another; ``name`` itself for the rest."""
    head, _, leaf = name.rpartition(".")  # leaf: "weight"
    prefix, _, proj = head.rpartition(".")
    group = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    return f"{prefix}.{group.get(proj, proj)}"


@torch.no_grad()
def cut_to_rank(base: torch.nn.Module, member: torch.nn.Module, rank: int) -> tuple[Factors, float]:
    """Make every layer matrix of ``member`` ``base``'s plus a rank-``rank`` delta, in place: per fused product
    (``fused_group``), the best rank-``rank`` approximation of the matrices' stacked difference, so the
    matrices of one product share their ``A`` and a stack multiplies by it once. Returns the factors and
    the mean share of the deltas' energy kept."""
    ref = dict(base.named_parameters())
    groups: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, p in member.named_parameters():
        if is_layer_matrix(name, p):
            groups.setdefault(fused_group(name), []).append((name, p))
    factors: Factors = {}
    kept: list[float] = []
    for parts in groups.values():
        a, b, share = truncate_delta(torch.cat([ref[n] for n, _ in parts]), torch.cat([p for _, p in parts]), rank)
        row = 0
        for name, p in parts:
            bp = b[row : row + p.shape[0]].contiguous()
            row += p.shape[0]
            p.copy_((ref[name].float() + bp @ a).to(p.dtype))
            factors[name] = (a, bp)
        kept.append(share)
    return factors, sum(kept) / len(kept) if kept else 1.0


def save_factors(directory: str | Path, factors: Factors) -> None:
    """Write ``factors`` to ``directory``/``DELTA_FILE`` (fp32)."""
    from safetensors.torch import save_file

    flat = {}
    for name, (a, b) in factors.items():
        flat[f"{name}.A"], flat[f"{name}.B"] = a.float().clone(), b.float().clone()  # q, k, v share A: one copy each
    save_file(flat, str(Path(directory) / DELTA_FILE))


def load_factors(directory: str | Path) -> Factors | None:
    """The factors in ``directory``/``DELTA_FILE`` (None: no such file); a ValueError naming the file when a
    parameter has one factor without the other or factors whose shapes do not chain."""
    path = Path(directory) / DELTA_FILE
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    flat = load_file(str(path))
    names = {k.rsplit(".", 1)[0] for k in flat}
    out: Factors = {}
    for name in sorted(names):
        a, b = flat.get(f"{name}.A"), flat.get(f"{name}.B")
        if a is None or b is None or a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{path}: {name} needs factors A (R, I) and B (O, R); delete the file to draft "
                             "with the SSM's full weights")
        out[name] = (a, b)
    return out


def rebuilds(base: Tensor, member: Tensor, a: Tensor, b: Tensor) -> bool:
    """Whether ``base + b @ a`` equals ``member`` to within ``member``'s dtype rounding (relative to its
    largest entry)."""
    if a.shape[1] != member.shape[1] or b.shape[0] != member.shape[0]:
        return False
    err = (base.float() + b.float() @ a.float() - member.float()).abs().max()
    tol = max(1e-5, 4 * torch.finfo(member.dtype).eps) * member.float().abs().max().clamp_min(1e-12)
    return bool(err <= tol)
