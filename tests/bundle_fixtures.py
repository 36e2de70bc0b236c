"""A real (small) training run directory and its bundle, for the bundle, server and CLI tests.

LLM: the "tiny-random" built-in (a 2-layer random llama with SmolLM2's tokenizer and chat
template). SSMs: two differently seeded noisy copies of it, saved the way `boosttune train` saves
them (save_pretrained + tokenizer + stats.json + complete.json), with a report.json in format 1
and, when asked, a learned scheduler for the two SSMs (fitted on synthetic labels). Everything is fp32 so greedy outputs can be compared token for token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import perturbed

from boosttune.core.files import atomic_write_json, mark_complete
from boosttune.core.models import TINY_LLM, load_model, model_vocab_size
from boosttune.core.rundir import REPORT_FORMAT, RunDir
from boosttune.serving.decode import incremental_generate
from boosttune.serving.draft_vocab import rank_tokens, save_ranking
from boosttune.serving.stops import StopCriteria

TREE = {"kind": "expansion", "widths": [1, 2, 1], "topk": 4, "depth": 6, "budget": 32, "min_prob": 0.0,
        "draft_vocab": 0, "ngram_depths": []}


def write_ranking(root: Path, llm) -> None:
    """RUN_DIR/draft_vocab.json counted over the LLM's greedy continuations of three prompts."""
    root.mkdir(parents=True, exist_ok=True)
    outs = [incremental_generate(llm.model, llm.tokenizer(p)["input_ids"], StopCriteria(max_new_tokens=24)).tokens
            for p in ("Hello there", "Write a poem", "What is 2 + 2?")]
    ranked, counts = rank_tokens(outs, model_vocab_size(llm.model))
    save_ranking(RunDir(root).draft_vocab_path, ranked, counts)


def make_run_dir(root: Path, n_ssms: int = 2, scheduler: bool = False, ranking: bool = True) -> Path:
    """Write a run directory with ``n_ssms`` complete SSMs under ``root``; returns ``root``.
    With ``ranking``, the draft vocabulary ranking counted over the LLM's greedy continuations; with
    ``scheduler`` (two SSMs), a scheduler directory: scheduler.json, a file beside it and a hidden
    temporary (a bundle's scheduler directory must hold its scheduler.json)."""
    llm = load_model(TINY_LLM)
    run = RunDir(root)
    if ranking:
        write_ranking(root, llm)
    stages = []
    for k in range(1, n_ssms + 1):
        ssm_dir = run.ssm_dir(k)
        ssm = perturbed(llm.model, seed=100 + k, noise=0.02 * k)
        ssm.save_pretrained(ssm_dir)
        llm.tokenizer.save_pretrained(ssm_dir)
        profile = {"per_depth": [0.6 / k, 0.4 / k, 0.2 / k], "per_rank": [[0.5, 0.1]]}
        atomic_write_json(ssm_dir / "stats.json", {"train_loss": 1.0 + k, "acceptance_profile": profile})
        mark_complete(ssm_dir, {"stage": k})
        stages.append({"stage": k, "ssm_dir": run.relative(ssm_dir), "pool_before": 100 // k, "pool_after": 50 // k,
                       "match_rate": 0.5, "ensemble_match_rate": 0.5 + 0.1 * k, "train_loss": 1.0 + k})
    # A stage whose SSM never finished: export must leave it out.
    run.ssm_dir(n_ssms + 1).mkdir(parents=True)
    stages.append({"stage": n_ssms + 1, "ssm_dir": run.relative(run.ssm_dir(n_ssms + 1))})
    if scheduler:
        from test_scheduler import SPEC, costs, synthetic_records

        from boosttune.config import SchedulerConfig
        from boosttune.scheduler.offline.train import fit_scheduler

        assert n_ssms == 2, "the synthetic scheduler is fitted for two SSMs"
        cfg = SchedulerConfig(prompts="unused", depths=(1, 2), pca_components=4, ridge_alphas=(1e-3,),
                              prompt_lookup=False)
        fit_scheduler(synthetic_records(), costs(), SPEC, (1, 1), cfg, ["ssm-1", "ssm-2"]).save(run.scheduler_file)
        atomic_write_json(run.scheduler_dir / "policy.json", {"kind": "test", "weights": [1, 2, 3]})
        (run.scheduler_dir / "features").mkdir()
        (run.scheduler_dir / "features" / "names.txt").write_text("prompt_len\n")
        (run.scheduler_dir / ".policy.json.123.tmp").write_text("half-written temporary")
    atomic_write_json(run.report_path, {
        "format": REPORT_FORMAT,
        "llm": {"ref": TINY_LLM, "path": llm.path, "dtype": "fp32"},
        "tree": TREE,
        "teacher": {},
        "stages": stages,
        "evaluation": {},
    })
    return root


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from two threads, and on a CPU shared with other jobs two OpenMP
    threads waiting for each other made these tests up to 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
