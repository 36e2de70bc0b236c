"""The one place a speculative engine is assembled: from models, or from a bundle with its scheduler.

`boosttune generate`, `serve` and `bench`, training's τ evaluation and the scheduler trainer all
build their engines here, so one bundle gives the same drafters, default trees, draft vocabulary and
learned scheduler whichever command loads it (``tests/test_scheduler_train.py`` runs generate, serve
and bench on one bundle and compares what they assembled).

Drafters are named (SSMs by their bundle or run names, ``ssm_names`` when given without names; the
prompt-lookup drafter ``LOOKUP_NAME``) and built by their kind (``serving/kinds.py``), never by what a
model looks like. A bundle with a learned scheduler (``scheduler/policy.py``) serves the drafters it
was trained to choose among (its models and, if it learned to use it, prompt lookup) and plans every
request; without one (or with ``use_scheduler=False``) every request drafts with every drafter the
manifest lists, each on its own tree.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedModel

from boosttune.core.device import resolve_device
from boosttune.core.models import LoadedModel, load_llm_and_ssms, model_vocab_size
from boosttune.core.rundir import PHRASES, SCHEDULER_FILE, ssm_name
from boosttune.scheduler.policy import Candidate, Scheduler
from boosttune.serving.bundle import LoadedBundle, load_bundle
from boosttune.serving.draft_vocab import ranking_for
from boosttune.serving.drafter import Drafter, SSMDrafter
from boosttune.serving.engine import GenerationResult, Plan, Planner, SpeculativeEngine, TokenCallback
from boosttune.serving.kinds import PromptLookupKind, SSMKind, kind
from boosttune.serving.lean import llm_runner
from boosttune.serving.lookup import LOOKUP_NAME, lookup_tree
from boosttune.serving.phrases import PhraseTable, load_phrases
from boosttune.serving.sampling import SamplingParams
from boosttune.serving.stacked import stack_reason, stacked_drafters
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TreeConfig


@dataclass
class Served:
    """An assembled engine with the models it decodes with and the scheduler that plans its requests.

    Attributes:
        engine: the engine; its default plan is what a request drafts when no scheduler plans it.
        llm: the LLM, with its tokenizer.
        models: the drafters' models by drafter name.
        ranking: the draft vocabulary ranking the SSMs were given (None: none).
        scheduler: the learned scheduler (None: every request takes the engine's default plan).
        phrase_file: the file of the phrase table prompt lookup drafts with (None: none), for the record.
    """

    engine: SpeculativeEngine
    llm: LoadedModel
    models: dict[str, LoadedModel]
    ranking: Tensor | None = None
    scheduler: Scheduler | None = None
    phrase_file: Path | None = None

    def generate(
        self, prompt_ids: Sequence[int], stop: StopCriteria, sampling: SamplingParams | None = None,
        on_tokens: TokenCallback | None = None, *, chat: bool = True, record: bool = False,
    ) -> GenerationResult:
        """One request; the scheduler, if any, plans it from the prefill (``chat``: the prompt went
        through the chat template, one of its features)."""
        planner = self.planner(prompt_ids, chat)
        return self.engine.generate(prompt_ids, stop, sampling, on_tokens, planner=planner, record=record)

    def planner(self, prompt_ids: Sequence[int], chat: bool = True) -> Planner | None:
        """What plans this request: the scheduler's planner for it, or None (the engine's default plan)."""
        return self.scheduler.planner(prompt_ids, chat) if self.scheduler is not None else None

    @property
    def lookup(self) -> int:
        """The longest chain the prompt-lookup drafter is asked for (0: no prompt lookup)."""
        tree = self.engine.plan.trees.get(LOOKUP_NAME)
        return tree.max_depth if tree is not None else 0

    @property
    def phrases(self) -> bool:
        """Whether prompt lookup drafts with the LLM's phrase table too (``serving/phrases.py``)."""
        return getattr(self.engine.drafters.get(LOOKUP_NAME), "phrases", None) is not None


def quantize_llm(engine: SpeculativeEngine, scheme: str) -> int:
    """Serve ``engine``'s LLM with quantized ``scheme`` ("int8", "int4" or "w8a8") products from now on
    (``serving/quantize.py``; plain decoding and verification alike, so decoding stays lossless with
    respect to the quantized LLM); before ``compile_served``, and before a batch spawns runners. Returns
    the bytes of the quantized weights. Raises ValueError naming ``--quantize`` where the LLM cannot be
    (not the lean CPU forward, a weight shape the kernel refuses), before anything changes. Drafters
    keep their weights (``quantize_drafters``)."""
    from boosttune.serving.lean import LeanRunner

    llm = engine.llm
    if not isinstance(llm, LeanRunner):
        raise ValueError(f"--quantize {scheme}: the LLM runs through {type(llm).__name__}, not the lean CPU forward "
                         "(a llama-architecture model on the CPU); leave --quantize off for this LLM")
    return llm.quantize(scheme)


def quantize_served(engine: SpeculativeEngine, scheme: str) -> tuple[int, int]:
    """``--quantize``: the LLM's products (``quantize_llm``) and then the drafters' (``quantize_drafters``)
    in ``scheme``; returns the bytes of each. A drafter's quantized products cut its draft cost (the demo
    bundle's feature head over int8: 2.2 against 2.9 ms a step, AMX Xeon) and change only its guesses."""
    return quantize_llm(engine, scheme), quantize_drafters(engine, scheme)


def quantize_drafters(engine: SpeculativeEngine, scheme: str) -> int:
    """Draft with weight-only ``scheme`` products too, in every drafter that runs the lean CPU forward (SSMs,
    feature heads; their LM heads cut to a draft vocabulary included); before ``compile_served``.
    Returns the bytes of their quantized weights. A drafter that cannot be (another runner, a weight
    shape the kernel refuses) keeps its weights: a drafter's products change its guesses, never the
    output, which verification takes from the LLM alone."""
    from boosttune.serving.lean import LeanRunner

    total = 0
    for d in engine.drafters.values():
        runner = getattr(d, "runner", None)
        if isinstance(runner, LeanRunner) and runner.device.type == "cpu" and runner.quantized is None:
            try:
                total += runner.quantize(scheme)
            except ValueError:
                continue  # a shape or dtype the kernel refuses: this drafter keeps its weights
    return total


def compile_served(served: Served, batched: bool = False) -> float:
    """Compile the forward of ``served``'s LLM and of each drafter that runs the lean CPU forward (SSMs,
    feature heads; ``serving/compiled.py``), with their graphs, now (``batched``: also the LLM's graphs
    for several requests at once, and in bf16 for prompts: a server compiles once and serves for long, where
    a one-shot ``generate`` would pay for two graphs more than its prompt saves); returns the seconds it took.
    Raises ValueError naming ``--compile`` where the LLM's forward cannot be compiled (not the lean CPU
    forward), before any compile work, or where inductor fails."""
    from boosttune.serving.compiled import compile_reason, compile_runner

    llm = served.engine.llm
    why = compile_reason(llm)
    if why is not None:
        raise ValueError(f"--compile: {why}; leave --compile off for this LLM")
    plan = served.engine.plan.trees
    for name, d in served.engine.drafters.items():
        if isinstance(d, SSMDrafter) and name in plan:
            d.prepare(plan[name])  # the head its trees draft over, cut before its graphs are built
    drafters = [r for d in served.engine.drafters.values() if compile_reason(r := getattr(d, "runner", None)) is None]
    try:
        # prompts compiled only where output is not promised identical: in fp32 a prompt's cache must be what
        # the one-at-a-time server's eager prompt makes (a fused norm rounds apart, and w8a8's input codes
        # turn that into other blocks: fp32 w8a8 answers of 16 batched clients matched 0 of 32)
        prompts = batched and llm.model.dtype != torch.float32  # type: ignore[attr-defined]
        return compile_runner(llm, pooled=batched, prefills=prompts) + sum(compile_runner(r) for r in drafters)  # type: ignore[arg-type]
    except Exception as e:  # inductor's own errors (e.g. no C++ compiler): say which flag to drop
        for r in [llm, *drafters]:
            r.compiled = None  # type: ignore[attr-defined]
        raise ValueError(f"--compile: torch.compile failed ({type(e).__name__}: {str(e)[:300]}); leave --compile "
                         "off, or install a C++ compiler (inductor builds the graphs with it)") from e


CALIBRATION_PROMPTS = (
    "Write a short poem about the sea at night.",
    "Explain in a few sentences how a hash table finds a key.",
    "List three differences between a virus and a bacterium, with an example of each.",
)
"""What ``recost_served`` times the served forward on (chat turns of several kinds, none from MT-bench)."""


def recost_served(served: Served, prompts: Sequence[list[int]] | None = None, tokens: int = 16,
                  keep: bool = False) -> float:
    """Measure the scheduler's cost model again on the forward being served and take its fixed choice
    again (``Scheduler.recosted``): after ``quantize_served`` or ``compile_served``, whose forward is not
    the eager one the training run measured. ``prompts``: token ids to time on (default: the
    ``CALIBRATION_PROMPTS`` through the LLM's chat template). ``keep``: the costs are kept on disk and a later
    start on the same forward and machine reads them instead of timing them (``recost_cache``). Returns the
    seconds it took (0 without a scheduler)."""
    from boosttune import recost_cache
    from boosttune.core.prompts import encode_prompt
    from boosttune.scheduler.calibrate import served_costs

    sched = served.scheduler
    if sched is None:
        return 0.0
    start = time.perf_counter()
    if prompts is None:
        prompts = [encode_prompt(served.llm.tokenizer, text) for text in CALIBRATION_PROMPTS]
    key = recost_cache.entry_key(sched, served.engine.llm, prompts, tokens) if keep and recost_cache.folder() else None
    kept = recost_cache.load(key) if key else None
    if kept:
        costs, where = kept
    else:
        costs = served_costs(served.engine, sched.drafters, prompts, sched.widths, sched.costs.depths, tokens,
                             sched.draft_vocab)
        where = recost_cache.save(key, costs) if key else None
    served.scheduler = sched.recosted(costs, round(sum(len(p) for p in prompts) / len(prompts)))
    served.scheduler.meta["recosted"].update(kept=str(where) if kept else None,
                                             saved=str(where) if where and not kept else None)
    return time.perf_counter() - start


def recost_note(served: Served, seconds: float) -> str:
    """One line on what ``recost_served`` did, for logs."""
    sched = served.scheduler
    if sched is None:
        return "no scheduler: nothing to measure again"
    info = sched.meta.get("recosted", {})
    before = info.get("fallback_before", {})
    was = sched.plan(Candidate(before["mask"], before["depth"])).label if before else "?"
    how = (f"read from {info['kept']} (delete it to time them again)" if info.get("kept")
           else f"measured again on the served forward ({seconds:.1f} s)")
    return f"the scheduler's costs {how}: its fixed choice {was} -> {sched.plan(sched.fallback).label}"


def ssm_names(n: int) -> list[str]:
    """The names of ``n`` SSMs given without names: ssm-1 .. ssm-N, as a run and its bundles name them."""
    return [ssm_name(k) for k in range(1, n + 1)]


def engine_from_models(
    llm: PreTrainedModel, ssms: Mapping[str, PreTrainedModel] | Sequence[PreTrainedModel],
    tree: TreeConfig | Mapping[str, TreeConfig], ranking: Tensor | None = None, lookup: int = 0,
    kinds: Mapping[str, str] | None = None, stack_ssms: bool = False, lookup_depths: tuple[int, ...] = (),
    phrases: PhraseTable | None = None,
) -> SpeculativeEngine:
    """An engine over ``llm`` with a drafter per model, each built by its kind (``serving/kinds.py``).

    Args:
        llm: the LLM.
        ssms: the drafters' models by name (a sequence is named ``ssm_names``), in merge order.
        tree: every drafter's default tree, or each one's by name.
        ranking: the draft vocabulary ranking (``draft_vocab.py``), needed by trees with
            ``draft_vocab`` > 0.
        lookup: > 0 adds the prompt-lookup drafter (``LOOKUP_NAME``, ``lookup.py``) after the
            others, proposing up to that many tokens by default.
        kinds: each model's kind by name (absent: "ssm").
        lookup_depths: prompt lookup's chain length per matched n-gram length (``TreeConfig.ngram_depths``).
        phrases: the LLM's phrase table, a second branch of prompt lookup's greedy trees (``lookup.py``).
        stack_ssms: SSMs of one shape draft together in one batched forward per depth
            (``serving/stacked.py``), each still a drafter of its own name; SSMs that cannot stack
            with any other draft separately. Off by default.
    """
    named = dict(ssms) if isinstance(ssms, Mapping) else dict(zip(ssm_names(len(ssms)), ssms, strict=True))
    if LOOKUP_NAME in named:
        raise ValueError(f"an SSM may not be named {LOOKUP_NAME!r}: that name is the prompt-lookup drafter's")
    kinds = dict(kinds or {})
    unknown = set(kinds) - set(named)
    if unknown:
        raise ValueError(f"kinds name drafters {sorted(unknown)} that are not among the models {list(named)}")
    v = llm.get_output_embeddings().weight.shape[0]
    stacked = _stacked_ssms(named, kinds, v, ranking) if stack_ssms else {}
    drafters: dict[str, Drafter] = {
        name: stacked[name] if name in stacked else kind(kinds.get(name, SSMKind.name)).drafter(m, v, ranking)
        for name, m in named.items()
    }
    trees = {name: tree[name] if isinstance(tree, Mapping) else tree for name in named}
    for name in named:  # refused here, not at the first draft of a request
        kind(kinds.get(name, SSMKind.name)).check_tree(trees[name])
    if lookup:
        drafters[LOOKUP_NAME] = kind(PromptLookupKind.name).drafter(phrases, v, None)
        trees[LOOKUP_NAME] = lookup_tree(lookup, lookup_depths)
    return SpeculativeEngine(llm_runner(llm), drafters, Plan(trees))


def _stacked_ssms(
    named: Mapping[str, PreTrainedModel], kinds: Mapping[str, str], vocab_size: int, ranking: Tensor | None,
) -> dict[str, Drafter]:
    """The SSMs of ``named`` that stack with at least one other, as stacked drafters by name: each SSM
    joins the first group it stacks with (``stack_reason``), in merge order."""
    groups: list[list[str]] = []
    for name in (n for n in named if kinds.get(n, SSMKind.name) == SSMKind.name):
        for group in groups:
            if stack_reason([named[n] for n in (*group, name)], [*group, name]) is None:
                group.append(name)
                break
        else:
            groups.append([name])
    out: dict[str, Drafter] = {}
    for group in (g for g in groups if len(g) > 1):
        out.update(stacked_drafters([named[n] for n in group], group, vocab_size, ranking))
    return out


STACK_MODES = ("auto", "on", "off")


def stacks(mode: str, models: Sequence[PreTrainedModel]) -> bool:
    """Whether SSMs draft stacked (``serving/stacked.py``) under ``--stack-ssms mode``: "on", "off", or
    "auto": where an SSM carries low-rank factors over SSM 1 (``core/low_rank.py``), which is what they
    were cut for."""
    if mode not in STACK_MODES:
        raise ValueError(f"--stack-ssms must be one of {', '.join(STACK_MODES)}, got {mode!r}")
    return mode == "on" or mode == "auto" and any(getattr(m, "low_rank_delta", None) for m in models)


def from_refs(
    llm: str, ssms: Sequence[str], tree: TreeConfig, *, dtype: str = "fp32", ssm_dtype: str | None = None,
    draft_ranking: str | None = None, lookup: int = 0, device: str | torch.device = "cpu", stack_ssms: str = "auto",
    phrases: str | Path | None = None,
) -> Served:
    """Models named on the command line (``default``, a directory or a hub id), the SSMs as ssm-1 ..,
    each of the kind its directory declares, all on ``device``; ``draft_ranking``: the ranking for
    ``tree.draft_vocab`` > 0 (None: found next to the first SSM); ``stack_ssms``: ``stacks``' mode;
    ``phrases``: prompt lookup's phrase table (``phrases_file``), checked against the LLM's vocabulary."""
    device = resolve_device(device)
    table_path = phrases_file(phrases, lookup) if phrases is not None else None  # before any model loads
    ranking = ranking_for(tree.draft_vocab, draft_ranking, ssms)
    loaded_llm, loaded = load_llm_and_ssms(llm, list(ssms), dtype, ssm_dtype or dtype, device=device)
    table = load_phrases(table_path, model_vocab_size(loaded_llm.model)) if table_path is not None else None
    named = dict(zip(ssm_names(len(loaded)), loaded, strict=True))
    engine = engine_from_models(loaded_llm.model, {n: s.model for n, s in named.items()}, tree, ranking, lookup,
                                kinds={n: s.kind for n, s in named.items()}, phrases=table,
                                stack_ssms=stacks(stack_ssms, [s.model for s in named.values()]))
    return Served(engine, loaded_llm, named, ranking, phrase_file=table_path)  # a table is refused without lookup


def phrases_file(ref: str | Path, lookup: int) -> Path:
    """The phrase table ``--phrases`` names: a ``phrases.safetensors`` file or the run directory (or
    bundle) holding one; refused unless prompt lookup drafts (``lookup`` > 0), which is what uses it."""
    if lookup <= 0:
        raise ValueError("--phrases: the phrase table is a branch of prompt lookup's trees; pass --prompt-lookup N too")
    path = Path(ref)
    if path.is_dir():
        path = path / PHRASES
    if not path.is_file():
        raise ValueError(f"--phrases: no phrase table at {path} (a run's or a bundle's {PHRASES}, or its directory)")
    return path


def load_scheduler(bundle: LoadedBundle) -> Scheduler | None:
    """The bundle's learned scheduler, checked against its drafters; None when it has none."""
    if bundle.scheduler_dir is None or not (bundle.scheduler_dir / SCHEDULER_FILE).is_file():
        return None
    scheduler = Scheduler.load(bundle.scheduler_dir / SCHEDULER_FILE)
    scheduler.check_drafters(bundle.model_names)
    return scheduler


def from_bundle(
    bundle: LoadedBundle, *, use_scheduler: bool = True, tree: TreeConfig | None = None, lookup: int | None = None,
    ranking: Tensor | None = None, stack_ssms: str = "auto", phrases: bool = True,
) -> Served:
    """What a bundle serves: each drafter (built by its kind) on its own tree, its draft vocabulary
    ranking, and its learned scheduler (unless ``use_scheduler`` is False) with the drafters it was
    trained for; without one, every drafter the manifest lists, prompt lookup included.

    Args:
        bundle: a loaded bundle.
        use_scheduler: plan every request with the bundle's learned scheduler, if it has one.
        tree: every model drafter's tree instead of its own (only where no scheduler decides).
        lookup: the prompt-lookup chain length instead of the bundle's (only where no scheduler decides).
        ranking: the draft vocabulary ranking instead of the bundle's.
        stack_ssms: whether its SSMs draft stacked (``stacks``).
        phrases: prompt lookup drafts with the bundle's phrase table too, if it has one.
    """
    scheduler = load_scheduler(bundle) if use_scheduler else None
    if scheduler is not None and (tree is not None or lookup is not None):
        raise ValueError("the bundle's learned scheduler chooses every request's drafters and trees; pass "
                         "--no-scheduler to set the tree or prompt lookup yourself")
    entries = bundle.manifest.models
    trees = {d.name: tree or d.tree for d in entries}
    ranking = bundle.ranking if ranking is None else ranking
    if scheduler is not None:
        lookup = scheduler.lookup_length
    depths: tuple[int, ...] = ()
    if scheduler is None and lookup is None:  # the bundle's prompt lookup, with its per-match table if any
        lookup, depths = bundle.manifest.prompt_lookup, bundle.manifest.lookup_depths
    needs = [*(t.draft_vocab for t in trees.values()), scheduler.draft_vocab if scheduler is not None else 0]
    if any(needs) and ranking is None:
        raise ValueError(f"--draft-vocab {max(needs)}: this bundle has no token ranking; pass --draft-ranking "
                         "RUN_DIR (its training run) or re-export it")
    named = {d.name: bundle.models[d.name] for d in entries}
    engine = engine_from_models(bundle.llm.model, {n: s.model for n, s in named.items()}, trees, ranking, lookup,
                                kinds={d.name: d.kind for d in entries}, lookup_depths=depths,
                                phrases=bundle.phrases if phrases else None,
                                stack_ssms=stacks(stack_ssms, [s.model for s in named.values() if s is not None]))
    served = Served(engine, bundle.llm, named, ranking, scheduler)
    if served.phrases and bundle.manifest.phrases is not None:
        served.phrase_file = bundle.root / bundle.manifest.phrases
    return served


def load(
    *, bundle: str | Path | None = None, llm: str | None = None, ssms: Sequence[str] = (), dtype: str = "fp32",
    ssm_dtype: str | None = None, tree: TreeConfig | None = None, draft_ranking: str | None = None,
    lookup: int | None = None, use_scheduler: bool = True, device: str | torch.device = "cpu", stack_ssms: str = "auto",
    phrases: bool = True, phrase_table: str | Path | None = None,
) -> Served:
    """Load and assemble what a command decodes with (`boosttune generate` and `bench`).

    Args:
        bundle: a bundle (``from_bundle``); None: the models ``llm`` and ``ssms`` name (``from_refs``).
        llm: with a bundle, where its LLM is (None: as the bundle names it); else the LLM
            (None: "default").
        ssms: SSM references (no bundle only).
        dtype: the LLM's dtype, and the SSMs' unless ``ssm_dtype``.
        ssm_dtype: the SSMs' dtype (only the LLM's decides the output).
        tree: the SSMs' tree (None: the bundle's, else ``TreeConfig()``).
        draft_ranking: the draft vocabulary ranking file or its run directory (None: the bundle's,
            else found next to the first SSM).
        lookup: prompt lookup's chain length (None: the bundle's default, else 0 = off).
        use_scheduler: plan requests with the bundle's learned scheduler, if it has one.
        device: where the models run (``core/device.py``), checked before anything loads.
        stack_ssms: "auto", "on" or "off": whether the SSMs draft stacked (``stacks``).
        phrases: with a bundle, prompt lookup drafts with its phrase table too, if it has one.
        phrase_table: without a bundle, the phrase table prompt lookup drafts with (``phrases_file``).
    """
    device = resolve_device(device)
    if phrase_table is not None and not phrases:
        raise ValueError("--phrases and --no-phrases: pass one (--phrases names a table, --no-phrases drafts without one)")
    if lookup is not None and lookup < 0:
        raise ValueError(f"--prompt-lookup must be >= 0 (0 = off), got {lookup}")
    if bundle is None:
        return from_refs(llm or "default", ssms, tree or TreeConfig(), dtype=dtype, ssm_dtype=ssm_dtype,
                         draft_ranking=draft_ranking, lookup=lookup or 0, device=device, stack_ssms=stack_ssms,
                         phrases=phrase_table)
    if phrase_table is not None:
        raise ValueError("--phrases names a phrase table for --llm/--ssm; a bundle brings its own (--no-phrases: without it)")
    if ssms:
        raise ValueError("--ssm cannot be combined with a bundle: the bundle's SSMs are used")
    loaded = load_bundle(bundle, llm=llm, dtype=dtype, ssm_dtype=ssm_dtype or dtype, device=device)
    ranking = None
    if draft_ranking is not None:
        needs = [tree.draft_vocab] if tree is not None else [d.tree.draft_vocab for d in loaded.manifest.models]
        ranking = ranking_for(max(needs), draft_ranking, [])
    return from_bundle(loaded, use_scheduler=use_scheduler, tree=tree, lookup=lookup, ranking=ranking,
                       stack_ssms=stack_ssms, phrases=phrases)
