"""One boost-tuning stage's training run: a Lightning Trainer from the typed config, resumable.

Checkpoints are written every ``optim.checkpoint_every`` steps and at the end to a temporary name
and renamed to the stage's checkpoint (``RunDir.stage_checkpoint``: a file, or a folder under DeepSpeed), so a kill
at any moment leaves the previous whole checkpoint; running again resumes from it (optimizer,
scheduler, step and the position in the data order included) and ends with the weights a run never
interrupted ends with (tests/test_train_resume.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from boosttune.config import TrainConfig
from boosttune.core.files import writing
from boosttune.core.models import native_bf16
from boosttune.core.progress import progress
from boosttune.train import dist
from boosttune.train.distill import BatchDataset, BatchOrder, DistillModule, Sample
from boosttune.train.faults import crash_point
from boosttune.train.quiet import quiet_lightning


class AtomicCheckpoint(L.Callback):
    """Save ``last.ckpt`` every N optimizer steps and at the end, never leaving a partial one."""

    def __init__(self, path: Path, every: int):
        self.path, self.every, self._saved_step = path, every, -1

    def _save(self, trainer: L.Trainer) -> None:
        step = trainer.global_step
        if step == self._saved_step:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        if trainer.is_global_zero and tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        trainer.strategy.barrier("atomic-ckpt-clean")
        with writing(self.path):  # a full disk names the run's checkpoint, not Lightning's temporary file
            # weights_only=False: a resume needs the optimizer, schedulers and loops too (said explicitly,
            # or Lightning logs that it chose so at every save)
            trainer.save_checkpoint(str(tmp), weights_only=False)  # collective under DeepSpeed; ends with a barrier
            if trainer.is_global_zero:
                old = self.path.with_name(f".{self.path.name}.old")
                if self.path.exists():
                    os.replace(self.path, old) if not self.path.is_dir() else self.path.rename(old)
                os.replace(tmp, self.path) if not tmp.is_dir() else tmp.rename(self.path)
                if old.exists():
                    shutil.rmtree(old) if old.is_dir() else old.unlink()
        trainer.strategy.barrier("atomic-ckpt-done")
        self._saved_step = step
        crash_point("checkpoint")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step > 0 and trainer.global_step % self.every == 0:
            self._save(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._save(trainer)


class StepProgress(L.Callback):
    """The stage's optimizer steps and loss as boosttune's progress (a bar on a terminal, a line every 30 s in
    a log file), in place of Lightning's bar, whose epoch counter means nothing with ``max_epochs=-1``."""

    def __init__(self, desc: str, total: int):
        self.desc, self.total, self.bar = desc, total, None

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.bar = progress(total=self.total, desc=self.desc, unit="step")
            self.bar.update(trainer.global_step)  # steps of the checkpoint resumed from

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.bar is None or trainer.global_step <= self.bar.n:
            return
        loss = pl_module.last_loss()  # a host sync per optimizer step, as Lightning's bar had
        if loss is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}")
        self.bar.update(trainer.global_step - self.bar.n)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class ResumeDataOrder(L.Callback):
    """A resumed stage continues the data order at the step of the checkpoint it resumes from."""

    def __init__(self, order: BatchOrder, grad_accum: int):
        self.order, self.grad_accum = order, grad_accum

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # called before the training loop first iterates the data
        self.order.resume_at(int(checkpoint["global_step"]), self.grad_accum)


def resume_checkpoint(path: Path) -> Path | None:
    """The checkpoint to resume from: ``last.ckpt``, or its predecessor if a kill hit the swap."""
    if path.exists():
        return path
    old = path.with_name(f".{path.name}.old")
    return old if old.exists() else None


def precision(cfg: TrainConfig) -> str:
    if cfg.optim.precision != "auto":
        return cfg.optim.precision
    if torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    # CPUs with native bf16 (AVX512-BF16 / AMX) run bf16 matmuls several times faster than fp32; others far slower.
    return "bf16-mixed" if native_bf16("cpu") else "32-true"


def _strategy(cfg: TrainConfig):
    o = cfg.optim
    if o.strategy.startswith("deepspeed") and o.deepspeed_config:
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(config=o.deepspeed_config)
    if o.strategy == "ddp" and not torch.cuda.is_available():
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo")
    return o.strategy


def _logger(cfg: TrainConfig, stage_dir: Path):
    if cfg.optim.logger == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(str(stage_dir), name="logs", version=0)
    if cfg.optim.logger == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        return TensorBoardLogger(str(stage_dir), name="tb", version=0)
    return False


def apply_lora(model, cfg: TrainConfig):
    """Wrap ``model`` with PEFT LoRA adapters (only the adapters train)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise ValueError("lora.enabled needs the peft package: pip install 'boosttune[peft]'") from e
    lc = cfg.lora
    return get_peft_model(model, LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                                            target_modules=list(lc.target_modules), task_type="CAUSAL_LM"))


def train_stage(model, samples: list[Sample], cfg: TrainConfig, stage_dir: Path, ckpt: Path, pad_id: int, seed: int,
                desc: str = "SSM"):
    """Train ``model`` on ``samples`` (logs under ``stage_dir``, resumable from ``ckpt``; ``desc`` names it in
    the progress lines); returns (trained plain HF model, stats)."""
    o = cfg.optim
    L.seed_everything(seed, workers=True, verbose=False)
    if cfg.ssm.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    if cfg.lora.enabled:
        model = apply_lora(model, cfg)
    module = DistillModule(model, o)
    if not samples:
        raise ValueError(f"{stage_dir}: no sample to train on (the LLM's continuations of this stage's prompts are "
                         "all empty); add prompts or raise teacher.max_new_tokens")
    data = BatchDataset(samples, o.batch_tokens, pad_id, seed)
    order = BatchOrder(len(data), seed, rank=dist.rank(), world=dist.world_size())
    # the generator only keeps the loader from drawing its base seed from the global RNG
    loader = DataLoader(data, batch_size=None, sampler=order, num_workers=0,
                        generator=torch.Generator().manual_seed(seed))
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    quiet_lightning()
    trainer = L.Trainer(
        accelerator=o.accelerator, devices=o.devices, num_nodes=o.num_nodes, strategy=_strategy(cfg),
        precision=precision(cfg), max_steps=o.max_steps, max_epochs=-1,
        max_time={"minutes": o.max_minutes} if o.max_minutes > 0 else None,
        accumulate_grad_batches=o.grad_accum, gradient_clip_val=o.grad_clip or None,
        logger=_logger(cfg, stage_dir),
        callbacks=[AtomicCheckpoint(ckpt, o.checkpoint_every), ResumeDataOrder(order, o.grad_accum),
                   StepProgress(desc, o.max_steps)],
        enable_checkpointing=False, default_root_dir=str(stage_dir), log_every_n_steps=5,
        # BatchOrder gives each rank its share already
        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
        enable_progress_bar=False,  # StepProgress reports the steps
    )
    resume = resume_checkpoint(ckpt)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=str(resume) if resume else None)
    # over every run of the stage (from the checkpoint): one resumed from its final checkpoint trains no step
    secs = module.train_seconds()
    tokens = module.tokens_seen * dist.world_size()  # every rank sees a different slice of the batches
    stats = {
        "steps": int(trainer.global_step), "train_samples": len(samples),
        "train_tokens": int(tokens), "train_seconds": secs,
        "train_tokens_per_s": tokens / secs if secs > 0 and tokens else None,
        "train_loss": module.last_loss(),
        "resumed_from_step": module.resumed_from_step, "precision": precision(cfg), "world_size": dist.world_size(),
        "strategy": type(trainer.strategy).__name__,
    }
    if cfg.optim.strategy.startswith("deepspeed_stage_3"):  # parameters are partitioned across ranks
        return zero3_model(ckpt, type(module.model), module.model.config), stats
    final = module.model.merge_and_unload() if cfg.lora.enabled else module.model
    return final, stats


def zero3_model(ckpt_dir: Path, model_cls, config):
    """The whole fp32 model from a ZeRO-3 checkpoint folder (rank 0 consolidates, every rank loads).

    Written against Lightning's DeepSpeed utilities; not run on this project's CPU-only CI.
    """
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    out = ckpt_dir.with_name("consolidated.pt")
    if dist.is_main():
        convert_zero_checkpoint_to_fp32_state_dict(str(ckpt_dir), str(out))
    dist.barrier()
    state = torch.load(out, map_location="cpu", weights_only=True)["state_dict"]
    model = model_cls(config)
    model.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
    return model

