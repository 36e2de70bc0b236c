"""Teacher outputs: the LLM's continuations of every prompt, batched, in resumable Arrow shards.

Shard ``k`` holds prompts ``[k * shard_size, (k + 1) * shard_size)`` of the run's prompt set and is
written by rank ``k % world_size``. A shard is written to a temporary file and renamed into place,
so a file named ``shard-*.arrow`` is always whole; a killed run redoes only the shard it was
writing. Shards are Arrow IPC streams, readable as one `datasets.Dataset` (:func:`load_teacher`).

Columns: ``prompt_id`` (str), ``input_ids`` (prompt tokens), ``output_ids`` (the LLM's tokens, cut
after the first EOS), ``finish`` ("stop" or "length"), and with ``teacher.topk_logprobs = k``:
``topk_ids`` / ``topk_logprobs`` (k per output position: the LLM's k most likely tokens and their
log-probabilities after temperature 1, for KL/TV distillation).

Backends: ``batched`` and ``hf`` run the LLM in this process; ``openai`` asks an OpenAI-compatible
server for the same continuations (:mod:`boosttune.train.teacher_openai`) and writes the same shards.

With ``features`` (a run that trains a feature head) the batched backend also keeps the LLM's
features, which it computes while writing, in ``shard-*.features.safetensors`` next to each shard
(written before it; fp16; per row all but the last token of prompt + output), so the feature head
needs no second pass over the samples (:func:`load_features`). Other backends leave none.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import torch
from safetensors.torch import load_file, save_file

from boosttune.config import TeacherConfig
from boosttune.core.progress import progress
from boosttune.core.rundir import RunDir
from boosttune.train import batched_decode
from boosttune.train.faults import crash_point
from boosttune.train.sources import TrainPrompt


@dataclass
class Continuation:
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
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], "stop"
    return tokens, "length"


def _left_pad(batch: Sequence[Sequence[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(x) for x in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, x in enumerate(batch):
        ids[r, width - len(x):] = torch.tensor(x, dtype=torch.long)
        mask[r, width - len(x):] = 1
    return ids.to(device), mask.to(device)


def resolve_backend(cfg: TeacherConfig, model) -> str:
    """'batched', 'hf' or 'openai': what ``cfg.backend`` means for this model ('auto': batched when it can)."""
    return cfg.backend if cfg.backend != "auto" else local_backend(model)


def local_backend(model) -> str:
    """The in-process backend for ``model``: 'batched' where its attention allows it, else 'hf'."""
    return "batched" if batched_decode.unsupported_reason(model) is None else "hf"


def generate_batch(
    model, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float, top_p: float,
    pad_id: int, eos_ids: frozenset[int], topk: int = 0, backend: str = "hf", features: bool = False,
) -> list[Continuation]:
    """The LLM's continuations of a batch of prompts, by ``backend`` ('hf' or 'batched'; with
    ``features``, the batched backend keeps the LLM's features too)."""
    if backend == "batched":
        d = batched_decode.decode_batch(model, prompts, max_new_tokens, eos_ids, pad_id, topk,
                                        temperature=temperature, top_p=top_p, features=features)
        # decode_batch stops each row at its first EOS: cut_at_eos only names the finish
        return [Continuation(*cut_at_eos(o, eos_ids), d.topk_ids[r] if topk else None,
                             d.topk_logprobs[r] if topk else None, d.features[r] if features else None)
                for r, o in enumerate(d.tokens)]
    return _hf_generate(model, prompts, max_new_tokens, temperature, top_p, pad_id, eos_ids, topk)


@torch.inference_mode()
def _hf_generate(
    model, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float, top_p: float,
    pad_id: int, eos_ids: frozenset[int], topk: int = 0,
) -> list[Continuation]:
    """Left-padded HF ``generate``."""
    ids, mask = _left_pad(prompts, pad_id, model.device)
    sample = temperature > 0
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=sample,
        temperature=temperature if sample else None, top_p=top_p if sample else None, top_k=None,
        pad_token_id=pad_id, eos_token_id=sorted(eos_ids), return_dict_in_generate=True, output_logits=topk > 0,
    )
    new = out.sequences[:, ids.shape[1]:].tolist()
    results = []
    for toks in new:
        toks, finish = cut_at_eos(toks, eos_ids)
        results.append(Continuation(toks, finish))
    if topk:
        logits = torch.stack(out.logits, dim=1).float()  # (B, steps, V)
        lp, ti = torch.log_softmax(logits, dim=-1).topk(topk, dim=-1)
        for r, c in enumerate(results):
            n = len(c.output_ids)
            c.topk_ids, c.topk_logprobs = ti[r, :n].tolist(), lp[r, :n].tolist()
    return results


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


def run_teacher(
    model, tokenizer, prompts: Sequence[TrainPrompt], cfg: TeacherConfig, run: RunDir,
    eos_ids: frozenset[int], rank: int = 0, world: int = 1, seed: int = 0, features: bool = False,
) -> dict:
    """Write this rank's missing shards (with ``features``, the batched backend's features files
    too); returns what this call generated (tokens, seconds, tok/s, the backend, and how the token ids
    were obtained). ``teacher.backend: openai`` asks a server instead of ``model``
    (:mod:`boosttune.train.teacher_openai`)."""
    if cfg.backend == "openai":
        from boosttune.train.teacher_openai import run_openai_teacher

        return run_openai_teacher(tokenizer, prompts, cfg, run, eos_ids, rank=rank, world=world, seed=seed)
    run.teacher_dir.mkdir(parents=True, exist_ok=True)
    n = num_shards(len(prompts), cfg.shard_size)
    todo = [k for k in my_shards(n, rank, world) if not run.teacher_shard(k).exists()]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    backend = resolve_backend(cfg, model)
    tokens, t0 = 0, time.perf_counter()
    n_todo = sum(len(prompts[k * cfg.shard_size:(k + 1) * cfg.shard_size]) for k in todo)
    bar = progress(total=n_todo, desc=f"teacher[rank {rank}, {backend}]", unit="prompt")
    for k in todo:
        shard = list(prompts[k * cfg.shard_size:(k + 1) * cfg.shard_size])
        # Length-sorted batches pad less; results go back to prompt order.
        order = sorted(range(len(shard)), key=lambda i: len(shard[i].input_ids))
        conts: list[Continuation | None] = [None] * len(shard)
        torch.manual_seed(seed * 100_003 + k)  # sampling teachers: reproducible per shard
        for b in range(0, len(order), cfg.batch_size):
            idx = order[b:b + cfg.batch_size]
            outs = generate_batch(model, [shard[i].input_ids for i in idx], cfg.max_new_tokens, cfg.temperature,
                                  cfg.top_p, pad, eos_ids, cfg.topk_logprobs, backend, features)
            for i, c in zip(idx, outs, strict=True):
                conts[i] = c
                tokens += len(c.output_ids)
            bar.set_postfix(tok=tokens, tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
            bar.update(len(idx))
        write_shard(run.teacher_shard(k), shard, conts, cfg.topk_logprobs)
    bar.close()
    secs = time.perf_counter() - t0
    return {"shards_written": len(todo), "tokens": tokens, "seconds": secs, "backend": backend,
            "tokens_per_s": tokens / secs if secs > 0 and tokens else 0.0, "token_ids": {"source": "model"}}


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
