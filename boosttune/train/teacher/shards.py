"""Teacher shards: the LLM's continuations of every prompt, in resumable Arrow files.

Every backend (:mod:`boosttune.train.teacher.backends`) writes the same shards through this module,
and every later phase reads them through it, so the file format has one owner.

Shard ``k`` holds prompts ``[k * shard_size, (k + 1) * shard_size)`` of the run's prompt set and is
written by rank ``k % world_size``. A shard is written to a temporary file and renamed into place,
so a file named ``shard-*.arrow`` is always whole; a killed run redoes only the shard it was
writing. Shards are Arrow IPC streams, readable as one `datasets.Dataset` (:func:`load_teacher`).

Columns: ``prompt_id`` (str), ``input_ids`` (prompt tokens), ``output_ids`` (the LLM's tokens, cut
after the first EOS), ``finish`` ("stop" or "length"), and with ``teacher.topk_logprobs = k``:
``topk_ids`` / ``topk_logprobs`` (k per output position: the LLM's k most likely tokens and their
log-probabilities after temperature 1, for KL/TV distillation).

With ``features`` (a run that trains a feature head) the batched decoder also keeps the LLM's
features, which it computes while writing, in ``shard-*.features.safetensors`` next to each shard
(written before it; fp16; per row all but the last token of prompt + output), so the feature head
needs no second pass over the samples (:func:`load_features`). Other backends leave none.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import torch
from safetensors.torch import load_file, save_file

from boosttune.core.rundir import RunDir
from boosttune.train.faults import crash_point
from boosttune.train.sources import TrainPrompt


@dataclass
class Continuation:
    """One prompt's continuation as a backend returns it: one row of a shard (and its features)."""

    output_ids: list[int]
    finish: str
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None
    features: torch.Tensor | None = None  # (len(prompt) + len(output) - 1, H): the LLM's features


def schema(topk: int) -> pa.Schema:
    fields = [
        pa.field("prompt_id", pa.string()),
        pa.field("input_ids", pa.list_(pa.int32())),
        pa.field("output_ids", pa.list_(pa.int32())),
        pa.field("finish", pa.string()),
    ]
    if topk:
        fields += [pa.field("topk_ids", pa.list_(pa.list_(pa.int32()))),
                   pa.field("topk_logprobs", pa.list_(pa.list_(pa.float32())))]
    return pa.schema(fields)


def num_shards(n_prompts: int, shard_size: int) -> int:
    return (n_prompts + shard_size - 1) // shard_size


def my_shards(n: int, rank: int, world: int) -> list[int]:
    return [k for k in range(n) if k % world == rank]


def cut_at_eos(tokens: list[int], eos: frozenset[int]) -> tuple[list[int], str]:
    """``tokens`` up to and including the first EOS, and the shard's ``finish`` ("stop" or "length")."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], "stop"
    return tokens, "length"


def write_shard(path: Path, prompts: Sequence[TrainPrompt], conts: Sequence[Continuation], topk: int) -> None:
    cols = {
        "prompt_id": [p.id for p in prompts],
        "input_ids": [p.input_ids for p in prompts],
        "output_ids": [c.output_ids for c in conts],
        "finish": [c.finish for c in conts],
    }
    if topk:
        cols["topk_ids"] = [c.topk_ids for c in conts]
        cols["topk_logprobs"] = [c.topk_logprobs for c in conts]
    table = pa.table(cols, schema=schema(topk))
    if conts and all(c.features is not None for c in conts):  # before the shard: a whole shard has its features
        feats = [c.features for c in conts]
        _write_atomic(features_path(path), lambda tmp: save_file(
            {"features": torch.cat(feats).to(torch.float16).contiguous(),
             "lengths": torch.tensor([len(f) for f in feats], dtype=torch.int64)}, str(tmp)))

    def write(tmp: Path) -> None:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)

    _write_atomic(path, write, crash="teacher-shard-tmp")
    crash_point("teacher-shard")


def _write_atomic(path: Path, write, crash: str = "") -> None:
    """``write(tmp)`` a temporary file next to ``path``, fsync it, rename it into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    if crash:
        crash_point(crash)
    os.replace(tmp, path)


def features_path(shard: Path) -> Path:
    """The LLM-features file next to a teacher shard."""
    return shard.with_name(shard.name.replace(".arrow", ".features.safetensors"))


def load_features(run: RunDir, indices: Sequence[int], shard_size: int) -> list[torch.Tensor | None]:
    """The teacher's recorded features of prompts ``indices`` ((L - 1, H) fp16 each), None where its
    shard has none (another backend, or a run without a feature head when it was written)."""
    out: list[torch.Tensor | None] = []
    shards: dict[int, list[torch.Tensor] | None] = {}
    for i in indices:
        k = i // shard_size
        if k not in shards:
            path = features_path(run.teacher_shard(k))
            if path.is_file():
                data = load_file(str(path))
                shards[k] = list(torch.split(data["features"], data["lengths"].tolist()))
            else:
                shards[k] = None
        out.append(None if shards[k] is None else shards[k][i % shard_size])
    return out


def pending_shards(run: RunDir, n_prompts: int, shard_size: int, rank: int, world: int) -> list[int]:
    """This rank's shards that are not written yet (the work of a teacher phase, or of its resumption)."""
    return [k for k in my_shards(num_shards(n_prompts, shard_size), rank, world) if not run.teacher_shard(k).exists()]


def shard_prompts(prompts: Sequence[TrainPrompt], k: int, shard_size: int) -> list[TrainPrompt]:
    """The prompts of shard ``k``."""
    return list(prompts[k * shard_size:(k + 1) * shard_size])


def missing_shards(run: RunDir, n_prompts: int, shard_size: int) -> list[int]:
    return [k for k in range(num_shards(n_prompts, shard_size)) if not run.teacher_shard(k).exists()]


def load_teacher(run: RunDir, n_prompts: int, shard_size: int):
    """All shards as one `datasets.Dataset` in prompt order (every shard must exist)."""
    import datasets

    missing = missing_shards(run, n_prompts, shard_size)
    if missing:
        raise RuntimeError(f"{run.teacher_dir}: teacher shards {missing[:5]} are missing; re-run to finish them")
    parts = [datasets.Dataset.from_file(str(run.teacher_shard(k)))
             for k in range(num_shards(n_prompts, shard_size))]
    return datasets.concatenate_datasets(parts)


def remove_shard_temporaries(run: RunDir) -> list[Path]:
    """Delete the temporary files of shards a killed run was writing (``.shard-*.tmp``; never read:
    the shard is redone). Call it while no rank writes shards. Returns what was deleted."""
    stale = sorted(run.teacher_dir.glob(".shard-*.tmp"))  # shards' and their features files'
    for path in stale:
        path.unlink(missing_ok=True)
    return stale
