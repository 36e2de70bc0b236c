"""Typed configuration of `boosttune train`: dataclasses, YAML loading, dotted overrides, checks.

A config is a YAML mapping whose sections mirror :class:`TrainConfig`. Every field can be set on
the command line as ``section.field=value`` (the value is parsed as YAML, so ``train.lr=3e-4``,
``boost.num_ssms=5``, ``prompts.sources=[{kind: default}]`` all work). Unknown fields, wrong types
and bad values fail at start with the field's dotted name; nothing expensive has run by then.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from boosttune.core.rundir import RunDir
from boosttune.serving.tree import (
    TreeConfig,  # the `tree:` section: one tree shape for training, export, serving
)


class ConfigError(ValueError):
    """A configuration problem, named by its dotted field path."""


# ----------------------------------------------------------------------------------------- sections
@dataclass
class LLMConfig:
    ref: str = "default"
    """'default' (SmolLM2-135M-Instruct), 'tiny-random', a local directory or a hub id."""
    teacher_dtype: str = "bf16"
    """dtype of the LLM while it writes continuations: fp32, bf16, fp16, or 'auto' (bf16 where the device
    has native bf16, else fp32; bf16 is ~2x faster on AMX CPUs and far slower on AVX2-only ones)."""
    eval_dtype: str = "fp32"
    """dtype of the LLM for the final τ evaluation (fp32: the exact setting)."""
    device: str = "auto"
    """'auto' (cuda:LOCAL_RANK when CUDA is available, else cpu), 'cpu' or 'cuda'."""


@dataclass
class SourceConfig:
    kind: Literal["default", "openwebtext", "text", "jsonl", "dataset"] = "default"
    """default: data/prompts (embedded); openwebtext: a `datasets` corpus cut into chunks; text: a
    plain-text file (one prompt per line, or a corpus cut into chunks with ``chunk: true``);
    jsonl: chat prompts ({turns|prompt|text}); dataset: any `datasets` id/path with a text column."""
    path: str = ""
    """File or dataset path / hub id (openwebtext defaults to the hub id Skylion007/openwebtext)."""
    limit: int = 0
    """At most this many prompts from this source (0 = all)."""
    chat: bool | None = None
    """Apply the chat template (default: yes for default/jsonl, no for corpora)."""
    chunk: bool | None = None
    """Cut documents into prompt chunks (default: yes for openwebtext/dataset, no otherwise)."""
    split: str = "train"
    """dataset/openwebtext: the split to read."""
    text_column: str = "text"
    """dataset: the column that holds each row's text."""
    streaming: bool = True
    """Hub datasets stream (no full download); local paths are read directly."""


@dataclass
class PromptsConfig:
    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig()])
    """Where prompts come from: a list of sources (mappings; the default is the embedded seeds alone)."""
    chunk_tokens: int = 64
    """Corpus chunks: prompt length in tokens (the LLM continues from the chunk's end)."""
    max_prompt_tokens: int = 384
    """Prompts longer than this are skipped."""
    grow: int = 0
    """Ask the LLM to write this many extra requests from the default seeds (0 = off)."""
    held_out: float = 0.1
    """Fraction (< 1) or count (>= 1) of prompts kept out of training for match rates."""
    shuffle_seed: int = 0
    """Seed of the shuffle before the held-out split (and of prompt growth)."""


TeacherBackendName = Literal["auto", "batched", "hf", "openai"]
"""``teacher.backend``'s names. Each is one class in boosttune/train/teacher/backends.py (training sits
above config, so the names are written here and a test holds the registry's keys equal to them)."""
TEACHER_BACKENDS: tuple[str, ...] = typing.get_args(TeacherBackendName)


@dataclass
class TeacherConfig:
    max_new_tokens: int = 128
    """Length of the LLM's continuation of each prompt (it stops earlier at end of sequence)."""
    batch_size: int = 32
    """Prompts the local backends generate for at once (and prompt growth's batch)."""
    shard_size: int = 128
    """Prompts per shard (the unit of resumption)."""
    temperature: float = 0.0
    """0 = greedy continuations (what greedy verification accepts)."""
    top_p: float = 1.0
    """Nucleus sampling's mass when ``temperature`` > 0 (1 = the whole distribution)."""
    topk_logprobs: int = 0
    """Keep the LLM's top-k log-probs per position for a KL/TV loss (0 = off)."""
    backend: TeacherBackendName = "auto"
    """'batched' (boosttune's own batched decoder, boosttune/train/batched_decode.py: greedy or
    sampled; plain full causal attention only), 'hf' (transformers ``generate``), 'auto' (batched
    where the LLM's attention allows it, else hf), or 'openai' (an OpenAI-compatible
    completions server, e.g. vLLM, SGLang, llama-server or `boosttune serve`, at ``endpoint``)."""
    endpoint: str = ""
    """openai backend: the server's base URL, e.g. http://127.0.0.1:8000/v1 (required for openai)."""
    model: str = ""
    """openai backend: the model name the server serves (empty = the first of GET /v1/models)."""
    concurrency: int = 8
    """openai backend: requests in flight at once."""
    api_key_env: str = "OPENAI_API_KEY"
    """openai backend: the environment variable holding the API key (unset or empty: no key sent)."""
    attn_implementation: str = "eager"
    """The HF backend's attention ('eager' or 'sdpa'); the batched backend brings its own."""
    reuse_from: str = ""
    """Start from another run's prompts and teacher shards (hard links), e.g. for an ablation; its
    llm, prompts and teacher settings must equal this run's."""


@dataclass
class SSMInitConfig:
    init: str = "derived"
    """'derived' (a small model of the LLM's architecture) or a hub id / local directory."""
    layers: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    """derived: LLM layers copied into the SSM (at the LLM's width); [] = fresh layers."""
    num_layers: int = 0
    """derived with fresh layers: how many (used when ``layers`` is empty)."""
    hidden_size: int = 0
    """derived: width (0 = the LLM's). A smaller width projects the LLM's embeddings (PCA)."""
    freeze_embeddings: bool = True
    """Keep the (tied) embeddings fixed: cheaper steps and no drift from the LLM's token space."""


@dataclass
class LoRAConfig:
    enabled: bool = False
    """Train LoRA adapters instead of the SSM's weights (needs ``peft``); merged into the SSM before it is saved."""
    r: int = 16
    """Rank of the adapters."""
    alpha: int = 32
    """LoRA's scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Names of the linear layers that get adapters."""


@dataclass
class OptimConfig:
    max_steps: int = 300
    """Optimizer steps per stage (the unit the ablation holds fixed)."""
    max_minutes: float = 0.0
    """Also stop a stage after this many minutes (0 = no time limit)."""
    batch_tokens: int = 4096
    """Padded tokens per micro-batch (length-bucketed)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    lr: float = 8e-4
    """AdamW's peak learning rate (after warm-up)."""
    warmup_steps: int = 20
    """Steps of linear warm-up from 0 to ``lr``."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    grad_clip: float = 1.0
    """Clip the gradients' norm to this (0: no clipping)."""
    loss: Literal["ce", "ce+kl", "ce+tv"] = "ce"
    """Cross-entropy on the LLM's tokens, optionally plus KL or TV to the teacher's top-k."""
    distill_weight: float = 1.0
    """Weight of the KL or TV term of ``ce+kl`` / ``ce+tv`` (the cross-entropy's is 1)."""
    precision: str = "auto"
    """Lightning precision: 'auto' (bf16-mixed where the device supports it), '32-true', ..."""
    strategy: str = "auto"
    """'auto', 'ddp', 'deepspeed_stage_2', 'deepspeed_stage_3', or any Lightning strategy name."""
    deepspeed_config: str = ""
    """A DeepSpeed JSON (configs/deepspeed/*.json); batch/optimizer fields come from this config."""
    accelerator: str = "auto"
    """Lightning accelerator: 'auto', 'cpu', 'gpu', ..."""
    devices: int = 1
    """Processes per node. >1 on CPU launches a local DDP (gloo) run of the whole pipeline."""
    num_nodes: int = 1
    """Machines of a multi-node run (each runs ``devices`` processes)."""
    checkpoint_every: int = 50
    """Steps between checkpoints (resume points)."""
    logger: Literal["csv", "tensorboard", "none"] = "csv"
    """Training metrics of each stage: CSV (``stages/stage-K/logs``), TensorBoard (``stages/stage-K/tb``) or none."""
    seed: int = 0
    """Seed of the teacher's sampling and of each stage's data order (stage k uses ``seed + k``)."""


@dataclass
class MatchConfig:
    kind: Literal["prefix", "fraction"] = "fraction"
    """prefix: the SSM's teacher-forced greedy tokens equal the LLM's first ``k`` tokens;
    fraction: they equal the LLM's tokens on at least ``fraction`` of the first ``k`` positions."""
    k: int = 32
    """How many of the LLM's first tokens are compared."""
    fraction: float = 0.5
    """``fraction``: the share of the first ``k`` positions that must agree."""


BoostMode = Literal["match", "quantile", "weighted", "independent"]
"""``boost.mode``'s names (``boosttune/train/pipeline.py`` ``stage_pool``; ``boost`` is read as ``match``)."""


@dataclass
class BoostConfig:
    """Boost-tuning: N SSMs trained in stages, each toward what the earlier ones miss
    (``boosttune/train/pipeline.py``; coverage as in ``boosttune/train/coverage.py``).

    Attributes:
        num_ssms: how many SSMs (stages).
        mode: what stage k > 1 trains on.
            ``match``: the samples no earlier SSM matched by ``boost.match`` (SpecInfer's pool, arXiv
            2305.09781 §4.2; called ``boost`` before other modes existed, still read as ``match``);
            ``quantile``: the previous stage's pool without its best-covered ``boost.quantile`` share, ranked
            by the top-``top_k`` coverage of SSMs 1..k-1 together (their union) on each sample;
            ``weighted``: every sample, each token's loss weighted ``boost.covered_weight`` where SSMs 1..k-1
            already hold the LLM's token among their top-``top_k`` candidates, 1 elsewhere (the next SSM
            learns the union's misses);
            ``independent``: every sample with its own seed (the ablation boosting must beat).
        match: the match criterion of ``match`` mode (and of the summaries' match rates in every mode).
        warm_start: SSM k > 1 starts from SSM k-1's weights instead of the initial SSM: the stages' steps add
            up in the later SSMs while each turns toward what the earlier ones miss.
        delta_rank: > 0: after training, SSM k > 1 is cut to SSM 1 plus a rank-``delta_rank`` delta in every
            layer matrix (the truncated SVD per stacked product, ``core/low_rank.py``), and saves the factors
            beside its weights, so that the SSMs draft stacked with SSM 1's weights read once
            (``--stack-ssms``); 0: full SSMs. Meant with ``warm_start``: SSMs trained from the initial SSM
            differ from SSM 1 in full rank, and a cut keeps little of them.
        min_pool: if fewer samples are left in the pool, later stages train on all samples instead.
        quantile: ``quantile`` mode: the share of each stage's pool that leaves it (the best covered).
        covered_weight: ``weighted`` mode: the loss weight of a token the earlier SSMs cover (0: ignored).
        top_k: candidates per position that count as covering the LLM's token, for ``quantile``,
            ``weighted`` and the stages' ``union_coverage`` (0: the tree's first width, ``tree.widths[0]``;
            ``tree.*`` may change on resume, so set it to pin a ``quantile``/``weighted`` run's pools).
    """

    num_ssms: int = 3
    mode: BoostMode = "match"
    match: MatchConfig = field(default_factory=MatchConfig)
    warm_start: bool = False
    delta_rank: int = 0
    min_pool: int = 8
    quantile: float = 0.5
    covered_weight: float = 0.1
    top_k: int = 0


FeatureLoss = Literal["kl", "ce", "tv", "kl+tv"]
HeadBoost = Literal["weighted", "independent"]
MAX_FEATURE_HEADS = 8
"""``feature.loss``'s names (``train/feature.py`` ``classification_loss``)."""


@dataclass
class FeatureConfig:
    """A feature head (``boosttune/core/feature_head.py``: an EAGLE-style drafter that reads the LLM's
    last hidden states), trained after the SSMs on all training samples (``boosttune/train/feature.py``).

    Attributes:
        enabled: train one, into ``RUN_DIR/ssms/feature``.
        layers: the LLM's decoder layers copied into it (negative: from the end; EAGLE uses one).
        minutes: wall-clock training budget (the first step past it is the last).
        max_steps: stop after this many steps (0: the time budget alone).
        batch_tokens: padded tokens per batch.
        lr: AdamW learning rate (5 % warm-up, cosine to 10 %). 4e-3 was the best of 5e-4, 1.5e-3, 4e-3
            and 1e-2 for 8-minute runs (~540 steps) on 169k teacher tokens: held-out top-1 0.28, 0.36,
            0.43, 0.41 on the demo's held-out answers. Minutes-long budgets want a rate far above EAGLE's.
        reg_weight: weight of the next-feature regression (smooth L1; EAGLE: 1).
        ce_weight: weight of the cross-entropy against the LLM's distribution (EAGLE: 0.1).
        noise: half-width of the uniform noise on input features (EAGLE: 0.1).
        draft_vocab: the draft vocabulary it trains its cross-entropy over (0: the whole vocabulary);
            serve it with the same ``--draft-vocab``.
        depth2_weight: weight of the same two losses at the second draft step, where the head reads
            its own predicted feature as serving's depth-2 nodes do (EAGLE-3's training-time test,
            arXiv 2503.01840; ``train/feature.py`` ``second_step``); 0: depth 1 only (EAGLE's recipe).
        prompt_weight: weight of the cross-entropy at prompt positions, relative to the answer's (the
            LLM's distribution there is as good a target as anywhere, and the teacher recorded those
            features anyway: more targets at no teacher cost); 0: answers only (EAGLE's recipe).
        weight_decay: AdamW's decoupled weight decay on the trained weights.
        loss: the classification loss against the LLM's distribution p (``train/feature.py``): ``kl``
            cross-entropy against p (soft targets; EAGLE's), ``ce`` against p's argmax (hard targets),
            ``tv`` total variation (one minus speculative sampling's acceptance), ``kl+tv`` both.
            ``kl`` guessed best on MT-bench (5-minute demo heads on 96.8k teacher tokens: top-1 0.343
            against 0.298 / 0.319 / 0.331; docs/measurements.md, "the classification loss").
        heads: how many feature heads to train (``ssms/feature``, then ``ssms/feature-2`` ...), each for
            ``minutes``; a bundle serves them merged into one tree, as it merges SSMs.
        boost: what head k > 1 trains on: ``weighted`` (collective boost-tuning for heads: each answer
            token's cross-entropy weighted ``covered_weight`` where heads 1..k-1 already rank the LLM's
            token among their first ``boost.top_k`` candidates (else the tree's first width), 1 where
            none does) or ``independent`` (the same data, another seed: the ablation).
        covered_weight: ``weighted``: the loss weight of a token the earlier heads cover (0: ignored).
        lookup_weight: every head's cross-entropy weight on an answer token prompt lookup drafts first
            (``serving/lookup.py``, teacher forced: the latest earlier use of the newest 3, 2 or 1 tokens
            is followed by it): boost-tuning over the drafter a bundle merges with the heads, so that they
            learn what copying misses; where heads 1..k-1 cover the token too, the lower weight. 1: no
            boosting over prompt lookup (the heads' recipe before it existed).
    """

    enabled: bool = False
    layers: list[int] = field(default_factory=lambda: [-1])
    minutes: float = 5.0
    max_steps: int = 0
    batch_tokens: int = 2048
    lr: float = 4e-3
    reg_weight: float = 1.0
    ce_weight: float = 0.1
    noise: float = 0.1
    draft_vocab: int = 8192
    depth2_weight: float = 0.0
    prompt_weight: float = 0.0
    weight_decay: float = 0.0
    loss: FeatureLoss = "kl"
    heads: int = 1
    boost: HeadBoost = "weighted"
    covered_weight: float = 0.1
    lookup_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.heads < 1 or self.heads > MAX_FEATURE_HEADS:
            raise ValueError(f"feature.heads must be 1..{MAX_FEATURE_HEADS}, got {self.heads}")
        if self.boost not in typing.get_args(HeadBoost):
            raise ValueError(f"feature.boost must be one of {typing.get_args(HeadBoost)}, got {self.boost!r}")
        if not 0 <= self.covered_weight <= 1:
            raise ValueError(f"feature.covered_weight must be in [0, 1] (1: no boosting), got {self.covered_weight}")
        if not 0 <= self.lookup_weight <= 1:
            raise ValueError(f"feature.lookup_weight must be in [0, 1] (1: no boosting over prompt lookup), "
                             f"got {self.lookup_weight}")
        if not self.layers:
            raise ValueError("feature.layers must name at least one LLM layer, e.g. [-1]")
        if self.minutes < 0 or self.max_steps < 0 or (self.enabled and not self.minutes and not self.max_steps):
            raise ValueError("feature.minutes / feature.max_steps must be >= 0 and not both 0")
        if self.batch_tokens < 16 or self.lr <= 0 or self.draft_vocab < 0 or self.noise < 0:
            raise ValueError("feature: batch_tokens >= 16, lr > 0, draft_vocab >= 0 and noise >= 0 are required")
        if self.depth2_weight < 0:
            raise ValueError(f"feature.depth2_weight must be >= 0 (0: depth 1 only), got {self.depth2_weight}")
        if self.prompt_weight < 0 or self.weight_decay < 0:
            raise ValueError(f"feature.prompt_weight and feature.weight_decay must be >= 0, got {self.prompt_weight} "
                             f"and {self.weight_decay}")


@dataclass
class Eagle3Config:
    """An EAGLE-3 head (``boosttune/core/eagle3_head.py``): the drafter llama.cpp (``--spec-type
    draft-eagle3``), vLLM and SGLang load, trained after the feature heads on all training samples
    (``boosttune/train/eagle3.py``) into ``RUN_DIR/eagle3``; `boosttune export` ships it in the
    bundle, with a GGUF for llama.cpp.

    Attributes:
        enabled: train one.
        layers: the three LLM layers whose inputs it fuses (empty: 2, n/2 and n - 1; EAGLE-3's code reads
            2, n/2 and n - 3, which held-out chains on the demo run liked less: core/eagle3_head.py).
        minutes: wall-clock training budget (the first step past it is the last).
        max_steps: stop after this many steps (0: the time budget alone).
        depth: draft steps unrolled per training step (EAGLE-3's training-time test; 1: depth 1 only).
        step_decay: step s's loss weight is ``step_decay ** s``.
        batch_tokens: padded tokens per batch.
        lr: AdamW learning rate (5 % warm-up, cosine to 10 %).
        weight_decay: AdamW's decoupled weight decay.
        draft_vocab: rows of its LM head: the run's most frequent teacher tokens (``d2t`` maps them).
        prompt_weight: loss weight at prompt positions, relative to the answer's.
    """

    enabled: bool = False
    layers: list[int] = field(default_factory=list)
    minutes: float = 5.0
    max_steps: int = 0
    depth: int = 3
    step_decay: float = 0.8
    batch_tokens: int = 2048
    lr: float = 2e-3
    weight_decay: float = 0.0
    draft_vocab: int = 8192
    prompt_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.layers and len(self.layers) != 3:
            raise ValueError(f"eagle3.layers must name 3 LLM layers (low, middle, high) or be empty, got {self.layers}")
        if self.minutes < 0 or self.max_steps < 0 or (self.enabled and not self.minutes and not self.max_steps):
            raise ValueError("eagle3.minutes / eagle3.max_steps must be >= 0 and not both 0")
        if not 1 <= self.depth <= 8:
            raise ValueError(f"eagle3.depth must be 1..8 draft steps, got {self.depth}")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"eagle3.step_decay must be in (0, 1], got {self.step_decay}")
        if self.batch_tokens < 16 or self.lr <= 0 or self.draft_vocab < 1 or self.prompt_weight < 0 or self.weight_decay < 0:
            raise ValueError("eagle3: batch_tokens >= 16, lr > 0, draft_vocab >= 1, prompt_weight >= 0 and "
                             "weight_decay >= 0 are required")


@dataclass
class EvalConfig:
    enabled: bool = True
    """Measure τ and speed-up of every drafter (alone and merged) when training ends."""
    prompts: str = ""
    """Chat prompts for τ (JSONL/text); empty = the held-out prompts of this run."""
    limit: int = 8
    """At most this many prompts (0 = all)."""
    max_new_tokens: int = 64
    """Tokens generated per prompt."""
    prompt_lookup: int = 8
    """Each drafter option is also measured merged with a prompt-lookup drafter of chains up to this
    long (0: not); export ships lookup with the drafters when that was the fastest option."""


POLICY_NAMES = ("learned", "all", "best_fixed", "none")
"""Policies that ``real_policies`` may name (run for real through the engine on the eval prompts)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """How `boosttune train-scheduler` collects labels, fits and evaluates the scheduler.

    Attributes:
        prompts: JSONL/text file of prompts held out from SSM training (MT-bench's question.jsonl
            works: first turns are used). Required.
        eval_prompts: a separate file for the evaluation requests; None splits ``prompts``.
        skip: leave out the first ``skip`` prompts of ``prompts`` (the ones the run trained on, when
            ``prompts`` is also one of its sources with that ``limit``).
        limit: use the first ``limit`` prompts of ``prompts`` after ``skip`` (0 = all).
        max_prompt_tokens: leave out requests longer than this many tokens (0: none), from both
            splits, after ``limit``.
        eval_limit: use the first ``eval_limit`` prompts of ``eval_prompts`` (0 = all).
        train_fraction: share of ``prompts`` used to fit (the rest evaluates) when
            ``eval_prompts`` is None; the split is a seeded shuffle.
        seed: seed of the split and of the random-subset policy.
        max_new_tokens: tokens generated per request (labels, calibration and evaluation).
        chat: apply the LLM's chat template to the prompts (also a request feature).
        depths: tree budgets the policy chooses from: how many levels of ``widths`` each chosen
            SSM drafts (1 = one token per SSM; all of ``widths`` beyond its length), and how many
            tokens prompt lookup may propose. Labels are collected at ``max(depths)``.
        widths: expansion widths per depth (None: the run's tree if it is an expansion tree,
            else the ``tree:`` section's default); SSMs never draft deeper than its length.
        dtype: LLM dtype (None: the run's, from report.json).
        ssm_dtype: SSM dtype (None: ``dtype``).
        draft_vocab: SSMs draft over the run's K most frequent tokens (``TreeConfig.draft_vocab``;
            cheaper drafts); 0 = the whole vocabulary. Labels, costs and served trees all use it.
        prompt_lookup: add a prompt-lookup drafter (``serving/lookup.py``: copies what followed the
            newest 1-3 tokens' earlier occurrence; no model, microseconds per draft) to the choice,
            as one more member of the subsets; at depth k it proposes up to k tokens.
        stepwise_lookup: also learn prompt lookup's chain length per step from the matched n-gram's
            length (``scheduler/offline/stepwise.py``); the learned policy then drafts that length
            whenever its choice includes prompt lookup.
        ngram_buckets: size of the hashed token n-gram feature block.
        pca_components: most principal components of the standardized features fed to the
            ridge regression; 1, 2, 4, ... up to it are tried by 5-fold cross-validation.
        ridge_alphas: L2 penalties tried by the same cross-validation.
        margin: the learned choice replaces the fallback (the best fixed choice on the training
            requests) only when predicted to be at least this much faster for the request
            (relative, 0.02 = 2 %): small predicted edges from few requests are mostly noise. The
            fallback itself is the simplest fixed choice (fewest drafters, then shallowest) within
            this much of the fastest.
        z_max: a request whose feature projection lies more than ``z_max`` standard deviations
            from the training data gets the fallback choice.
        calib_prompts: prompts used to time every (SSM, depth) and plain decoding.
        calib_tokens: tokens generated per calibration run.
        real_policies: policies evaluated by real engine runs on the eval prompts (the others,
            and these too, are evaluated by full-information replay). Among learned, all,
            best_fixed, none.
        feature_head: choose the run's feature head too (``ssms/feature``, when it has one), as one
            more drafter; its labels take trees of at most two levels (``widths[:max(depths)]``).
        cv_folds: folds of the training requests that decide whether the per-request choice and
            the per-match prompt-lookup table are served: each is kept only where, refitted
            without a fold and replayed on it, it is at least ``margin`` faster than what it
            replaces with a 95 % interval above 1 (``scheduler/offline/crossval.py``); else every
            request gets the best fixed choice. 0: serve both as fitted, unchecked.
    """

    prompts: str | None = None
    eval_prompts: str | None = None
    skip: int = 0
    limit: int = 80
    max_prompt_tokens: int = 0
    eval_limit: int = 0
    train_fraction: float = 0.5
    seed: int = 0
    max_new_tokens: int = 64
    chat: bool = True
    depths: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)
    widths: tuple[int, ...] | None = None
    dtype: str | None = None
    ssm_dtype: str | None = None
    draft_vocab: int = 0
    prompt_lookup: bool = True
    stepwise_lookup: bool = True
    ngram_buckets: int = 64
    pca_components: int = 8
    ridge_alphas: tuple[float, ...] = (0.1, 1.0, 10.0, 100.0, 1000.0)
    margin: float = 0.02
    z_max: float = 6.0
    calib_prompts: int = 2
    calib_tokens: int = 24
    real_policies: tuple[str, ...] = ("learned", "all", "best_fixed")
    feature_head: bool = True
    cv_folds: int = 10

    def __post_init__(self) -> None:
        for name in ("depths", "ridge_alphas", "real_policies"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.widths is not None:
            object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        _check_scheduler(self.limit >= 0 and self.eval_limit >= 0, "limit/eval_limit", "must be >= 0 (0 = all)")
        _check_scheduler(self.skip >= 0, "skip", f"must be >= 0, got {self.skip}")
        _check_scheduler(self.cv_folds == 0 or self.cv_folds >= 2, "cv_folds",
                         f"must be 0 (no cross-validation) or >= 2, got {self.cv_folds}")
        _check_scheduler(self.max_prompt_tokens >= 0, "max_prompt_tokens", f"must be >= 0 (0: no limit), got {self.max_prompt_tokens}")
        _check_scheduler(
            0.0 < self.train_fraction < 1.0, "train_fraction", f"must be in (0, 1), got {self.train_fraction}"
        )
        _check_scheduler(self.draft_vocab >= 0, "draft_vocab", f"must be >= 0 (0 = the whole vocabulary), got {self.draft_vocab}")
        _check_scheduler(self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        _check_scheduler(
            bool(self.depths) and min(self.depths) >= 1, "depths", f"must be positive ints, got {self.depths}"
        )
        _check_scheduler(len(set(self.depths)) == len(self.depths), "depths", f"must be distinct, got {self.depths}")
        if self.widths is not None:
            _check_scheduler(
                len(self.widths) >= 1 and min(self.widths) >= 1,
                "widths",
                f"needs positive entries, got {self.widths}",
            )
        _check_scheduler(
            self.ngram_buckets >= 1 and self.pca_components >= 1,
            "ngram_buckets/pca_components",
            "must be >= 1",
        )
        _check_scheduler(
            bool(self.ridge_alphas) and min(self.ridge_alphas) > 0, "ridge_alphas", "must be positive floats"
        )
        _check_scheduler(self.z_max > 0, "z_max", f"must be > 0, got {self.z_max}")
        _check_scheduler(0.0 <= self.margin < 1.0, "margin", f"must be in [0, 1), got {self.margin}")
        _check_scheduler(
            self.calib_prompts >= 1 and self.calib_tokens >= 2,
            "calib_prompts/calib_tokens",
            "must be >= 1 / >= 2",
        )
        unknown = sorted(set(self.real_policies) - set(POLICY_NAMES))
        _check_scheduler(not unknown, "real_policies", f"unknown {unknown}; choose from {list(POLICY_NAMES)}")

    @property
    def label_depth(self) -> int:
        """Depth of the tree every SSM drafts while labels are collected."""
        return max(self.depths)

    def to_dict(self) -> dict[str, Any]:
        """JSON/YAML-ready mapping (tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    def replace(self, **changes: Any) -> SchedulerConfig:
        """A copy with ``changes`` applied (None values are ignored: unset command-line flags)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


def _check_scheduler(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"scheduler.{name} {message}")


@dataclass
class TrainConfig:
    llm: LLMConfig = field(default_factory=LLMConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    ssm: SSMInitConfig = field(default_factory=SSMInitConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    boost: BoostConfig = field(default_factory=BoostConfig)
    feature: FeatureConfig = field(default_factory=FeatureConfig)
    """A feature head trained after the SSMs (off unless ``feature.enabled``)."""
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)
    """An EAGLE-3 head trained after the feature heads (off unless ``eagle3.enabled``)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    """Each SSM's tree: the τ evaluation drafts it (merged across SSMs for the ensemble), export writes it
    into the bundle as the served default, and the scheduler takes its expansion widths."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Trained as the last stage when ``scheduler.prompts`` is set (see `boosttune train-scheduler`)."""


# ------------------------------------------------------------------------------------ conversion
def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str) -> Any:
    """``value`` checked against the annotation ``tp`` (and converted where lossless)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        items = [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{where}: unsupported field type {_type_name(tp)}")


def from_dict(cls: type, data: dict, where: str = "") -> Any:
    """An instance of the dataclass ``cls`` from a mapping; unknown keys are errors."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown field {prefix}{unknown[0]}; {where or 'the config'} accepts: {', '.join(sorted(names))}"
        )
    kwargs = {k: _convert(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section's own checks (e.g. SchedulerConfig.__post_init__)
        raise ConfigError(str(e)) from None


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def apply_override(data: dict, item: str) -> None:
    """Set ``a.b.c=value`` (value parsed as YAML) inside the nested mapping ``data``."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected section.field=value (e.g. optim.lr=3e-4)")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {p} is not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML config, apply ``section.field=value`` overrides, check types and values."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config: file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML ({e})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
    for item in overrides:
        apply_override(data, item)
    _read_legacy_fields(data)
    cfg = from_dict(TrainConfig, data)
    validate(cfg)
    return cfg


def _read_legacy_fields(data: dict) -> None:
    """Fields of configs written before they moved (run directories keep their config.yaml):
    ``eval.widths`` is ``tree.widths`` (an expansion tree), from before the ``tree:`` section;
    ``boost.mode: boost`` is ``match``, from before other boosting modes."""
    section = data.get("eval")
    if isinstance(section, dict) and "widths" in section:
        tree = data.setdefault("tree", {})
        if not isinstance(tree, dict) or "widths" in tree:
            raise ConfigError("eval.widths: the tree moved to the tree: section; set tree.widths only")
        tree["widths"] = section.pop("widths")
    boost = data.get("boost")
    if isinstance(boost, dict) and boost.get("mode") == "boost":  # SpecInfer's pool, before other modes existed
        boost["mode"] = "match"


def _check(ok: bool, where: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{where}: {msg}")


def validate(cfg: TrainConfig) -> None:
    """Value checks that types cannot express (files exist, ranges, combinations)."""
    _check(bool(cfg.prompts.sources), "prompts.sources", "needs at least one source")
    for i, s in enumerate(cfg.prompts.sources):
        w = f"prompts.sources[{i}]"
        if s.kind in ("text", "jsonl"):
            _check(bool(s.path), f"{w}.path", f"a {s.kind} source needs a path")
            _check(Path(os.path.expanduser(s.path)).is_file(), f"{w}.path", f"file not found: {s.path}")
        if s.kind == "dataset":
            _check(bool(s.path), f"{w}.path", "a dataset source needs a hub id or local path")
        _check(s.limit >= 0, f"{w}.limit", "must be >= 0")
    _check(cfg.prompts.chunk_tokens >= 4, "prompts.chunk_tokens", "must be >= 4")
    _check(cfg.prompts.held_out >= 0, "prompts.held_out", "must be >= 0")
    _check(cfg.prompts.grow >= 0, "prompts.grow", "must be >= 0")
    _check(cfg.teacher.max_new_tokens >= 1, "teacher.max_new_tokens", "must be >= 1")
    _check(cfg.teacher.batch_size >= 1, "teacher.batch_size", "must be >= 1")
    _check(cfg.teacher.shard_size >= 1, "teacher.shard_size", "must be >= 1")
    _check(cfg.teacher.temperature >= 0, "teacher.temperature", "must be >= 0 (0 = greedy)")
    _check(0 < cfg.teacher.top_p <= 1, "teacher.top_p", "must be in (0, 1]")
    _check(cfg.teacher.topk_logprobs >= 0, "teacher.topk_logprobs", "must be >= 0")
    _check_teacher_backend(cfg.teacher)
    for name in ("teacher_dtype", "eval_dtype"):
        _check(getattr(cfg.llm, name) in ("fp32", "bf16", "fp16", "float32", "bfloat16", "float16", "auto"),
               f"llm.{name}", "must be fp32, bf16, fp16 or auto (bf16 where the device has native bf16, else fp32)")
    if cfg.ssm.init == "derived":
        _check(bool(cfg.ssm.layers) or cfg.ssm.num_layers > 0, "ssm.num_layers",
               "derived SSMs need ssm.layers (LLM layers to copy) or ssm.num_layers > 0")
        _check(all(x >= 0 for x in cfg.ssm.layers), "ssm.layers", "layer indices must be >= 0")
        _check(cfg.ssm.hidden_size >= 0, "ssm.hidden_size", "must be >= 0 (0 = the LLM's width)")
    o = cfg.optim
    _check(o.max_steps >= 1, "optim.max_steps", "must be >= 1")
    _check(o.batch_tokens >= 16, "optim.batch_tokens", "must be >= 16")
    _check(o.grad_accum >= 1, "optim.grad_accum", "must be >= 1")
    _check(o.lr > 0, "optim.lr", "must be > 0")
    _check(o.devices >= 1, "optim.devices", "must be >= 1")
    _check(o.num_nodes >= 1, "optim.num_nodes", "must be >= 1")
    _check(o.checkpoint_every >= 1, "optim.checkpoint_every", "must be >= 1")
    _check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
    if o.loss != "ce":
        _check(cfg.teacher.topk_logprobs > 0, "optim.loss",
               f"{o.loss!r} needs the teacher's top-k log-probs: set teacher.topk_logprobs (e.g. 8)")
    if o.deepspeed_config:
        _check(Path(o.deepspeed_config).is_file(), "optim.deepspeed_config", f"file not found: {o.deepspeed_config}")
        _check(o.strategy.startswith("deepspeed"), "optim.strategy",
               "a deepspeed_config needs strategy deepspeed_stage_2 or deepspeed_stage_3")
        check_deepspeed_json(cfg)
    if o.strategy.startswith("deepspeed_stage_3"):
        _check(not cfg.lora.enabled, "lora.enabled", "LoRA with ZeRO-3 is not supported; use deepspeed_stage_2")
    b = cfg.boost
    _check(b.num_ssms >= 1, "boost.num_ssms", "must be >= 1")
    _check(b.match.k >= 1, "boost.match.k", "must be >= 1")
    _check(0 < b.match.fraction <= 1, "boost.match.fraction", "must be in (0, 1]")
    _check(0 < b.quantile < 1, "boost.quantile", f"must be in (0, 1) (the share of each pool that leaves), got {b.quantile}")
    _check(0 <= b.covered_weight <= 1, "boost.covered_weight",
           f"must be in [0, 1] (1: no boosting, 0: covered tokens ignored), got {b.covered_weight}")
    _check(b.delta_rank >= 0, "boost.delta_rank", f"must be >= 0 (0: full SSMs), got {b.delta_rank}")
    _check(b.top_k >= 0, "boost.top_k", f"must be >= 0 (0: the tree's first width), got {b.top_k}")
    if cfg.teacher.reuse_from:
        _check(RunDir(cfg.teacher.reuse_from).prompts_info() is not None, "teacher.reuse_from",
               f"{cfg.teacher.reuse_from} is not a run directory with a finished prompt set")
    if cfg.eval.prompts:
        _check(Path(cfg.eval.prompts).is_file(), "eval.prompts", f"file not found: {cfg.eval.prompts}")
    _check(cfg.eval.prompt_lookup >= 0, "eval.prompt_lookup", f"must be >= 0 (0: off), got {cfg.eval.prompt_lookup}")


def _check_teacher_backend(t: TeacherConfig) -> None:
    """``teacher.backend`` and the fields that only its backend reads."""
    _check(t.backend in TEACHER_BACKENDS, "teacher.backend", f"must be one of {', '.join(TEACHER_BACKENDS)}")
    _check(t.concurrency >= 1, "teacher.concurrency", f"must be >= 1 (requests in flight), got {t.concurrency}")
    _TEACHER_BACKEND_FIELDS.get(t.backend, _no_backend_fields)(t)


def _no_backend_fields(t: TeacherConfig) -> None:
    """The local backends read no backend-only fields."""


def _check_openai_fields(t: TeacherConfig) -> None:
    """The openai backend's fields: a usable endpoint URL and an environment variable's name for the key."""
    from urllib.parse import urlparse

    _check(bool(t.endpoint.strip()), "teacher.endpoint",
           "the openai backend needs the server's base URL, e.g. teacher.endpoint=http://127.0.0.1:8000/v1")
    url = urlparse(t.endpoint.strip())
    _check(url.scheme in ("http", "https") and bool(url.netloc), "teacher.endpoint",
           f"{t.endpoint!r} is not an http(s) URL; write it like http://127.0.0.1:8000/v1")
    _check(not t.api_key_env or t.api_key_env.replace("_", "").isalnum(), "teacher.api_key_env",
           f"{t.api_key_env!r} is not an environment variable name (e.g. OPENAI_API_KEY); the key itself "
           "belongs in that variable, not in the config")


# Checked when the config loads, before anything runs; here rather than in the backends' classes
# because config sits below training (tests/test_layers.py) and cannot import them.
_TEACHER_BACKEND_FIELDS = {"openai": _check_openai_fields}


def check_deepspeed_json(cfg: TrainConfig) -> None:
    """The DeepSpeed JSON must agree with the typed config on what both of them set."""
    import json

    o = cfg.optim
    where = f"optim.deepspeed_config ({o.deepspeed_config})"
    try:
        ds = json.loads(Path(o.deepspeed_config).read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e})") from None
    stage = ds.get("zero_optimization", {}).get("stage")
    want = {"deepspeed_stage_2": 2, "deepspeed_stage_3": 3}.get(o.strategy.split("_offload")[0])
    _check(want is None or stage == want, where, f"zero_optimization.stage is {stage} but optim.strategy is {o.strategy}")
    _check(ds.get("gradient_accumulation_steps", o.grad_accum) == o.grad_accum, where,
           f"gradient_accumulation_steps {ds.get('gradient_accumulation_steps')} != optim.grad_accum {o.grad_accum}")
    _check(ds.get("train_micro_batch_size_per_gpu", 1) == 1, where,
           "train_micro_batch_size_per_gpu must be 1: each loader item is a whole token-budget batch (optim.batch_tokens)")
    _check(float(ds.get("gradient_clipping", o.grad_clip)) == float(o.grad_clip), where,
           f"gradient_clipping {ds.get('gradient_clipping')} != optim.grad_clip {o.grad_clip}")
    bf16 = bool(ds.get("bf16", {}).get("enabled", False))
    _check(bf16 == o.precision.startswith("bf16"), where,
           f"bf16.enabled is {bf16} but optim.precision is {o.precision}")


def dump_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
