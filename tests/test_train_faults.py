"""Faults in training are one line and lose nothing: a full disk at each write point, file modes, and
every DDP rank's RNG state in its checkpoint. Unit level: no training run, seconds in all."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from safetensors import SafetensorError

from boosttune.cli.train import file_system_error
from boosttune.core.files import atomic_write_json, atomic_write_text, is_complete, mark_complete

ENOSPC_LINE = "cannot write {}: No space left on device; free space there"
# what safetensors raises when its file cannot be written (its Rust error's Debug form)
SAFETENSORS_ENOSPC = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'


def one_line(e: OSError, path: Path) -> None:
    """The line `boosttune train` prints for ``e``: the run's own ``path`` and the fix."""
    assert e.errno == errno.ENOSPC and e.filename == str(path), (e.errno, e.filename)
    assert file_system_error(e, str(path.parent)).startswith(ENOSPC_LINE.format(path))


@pytest.fixture
def user_umask():
    def set_mask(mask: int) -> None:
        os.umask(mask)

    old = os.umask(0o022)
    yield set_mask
    os.umask(old)


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_files_get_the_users_umask(tmp_path: Path, user_umask, mask: int, mode: int) -> None:
    user_umask(mask)
    atomic_write_text(tmp_path / "a.txt", "x")
    atomic_write_json(tmp_path / "report.json", {"a": 1})
    mark_complete(tmp_path)
    with open(tmp_path / "plain.txt", "w") as f:  # what a plain write gives: the same
        f.write("x")
    for name in ["a.txt", "report.json", "complete.json", "plain.txt"]:
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name


def test_a_failed_atomic_write_names_the_file_and_leaves_no_temporary(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "report.json").write_text("old\n")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as e:
        atomic_write_text(tmp_path / "report.json", "new\n")
    one_line(e.value, tmp_path / "report.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    assert (tmp_path / "report.json").read_text() == "old\n"


def test_writing_names_the_path_for_write_errors_only(tmp_path: Path) -> None:
    from boosttune.core.files import writing

    with pytest.raises(OSError) as e, writing(tmp_path / "model"):
        raise SafetensorError(SAFETENSORS_ENOSPC)
    one_line(e.value, tmp_path / "model")
    with pytest.raises(OSError) as e, writing(tmp_path / "model"):
        raise SafetensorError("I/O error: No space left on device (os error 28)")
    one_line(e.value, tmp_path / "model")
    with pytest.raises(ConnectionRefusedError), writing(tmp_path):  # not a write failure: unchanged
        raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")
    with pytest.raises(SafetensorError), writing(tmp_path):
        raise SafetensorError("header too large")


class _Tokenizer:
    def save_pretrained(self, directory: Path) -> None:
        (Path(directory) / "tokenizer.json").write_text("{}")


def test_disk_full_inside_safetensors_names_the_models_directory(tmp_path: Path, monkeypatch) -> None:
    """A stage's SSM saved on a full disk: one line naming ssms/ssm-1, and the half-written directory is
    never taken for a whole one (no marker; the next save replaces it)."""
    import transformers.modeling_utils

    from boosttune.train.pipeline import _publish_model

    real = transformers.modeling_utils.safe_save_file

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # what the disk took before it was full
        raise SafetensorError(SAFETENSORS_ENOSPC)

    out = tmp_path / "ssms" / "ssm-1"
    out.parent.mkdir()
    model = tiny_llama(0)
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    with pytest.raises(OSError) as e:
        _publish_model(model, _Tokenizer(), out, {"stage": 1})
    one_line(e.value, out)
    tmp = out.with_name(".ssm-1.tmp")
    assert not out.exists() and tmp.is_dir() and not is_complete(tmp)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", real)
    _publish_model(model, _Tokenizer(), out, {"stage": 1})
    assert is_complete(out) and not tmp.exists()


class _Trainer:
    """What AtomicCheckpoint uses of a Trainer; ``save_checkpoint`` is the test's."""

    global_step = 4
    is_global_zero = True

    def __init__(self, save):
        self.save_checkpoint = save
        self.strategy = self

    def barrier(self, name: str) -> None:
        pass


@pytest.mark.parametrize("where", ["torch.save", "checkpoint file"])
def test_disk_full_in_lightnings_checkpointing_names_the_runs_checkpoint(tmp_path: Path, monkeypatch,
                                                                        where: str) -> None:
    """Lightning writes the checkpoint under our temporary name: a full disk there (in torch.save, or
    writing the file) names the stage's last.ckpt, and the checkpoint resumed from stays the whole one."""
    from lightning.fabric.utilities.cloud_io import _atomic_save

    from boosttune.train.stage import AtomicCheckpoint, resume_checkpoint

    ckpt = tmp_path / "stage-1" / "last.ckpt"
    ckpt.parent.mkdir()
    _atomic_save({"global_step": 2}, ckpt)
    whole = ckpt.read_bytes()

    def save(path: str, weights_only: bool = False) -> None:  # Trainer.save_checkpoint's signature
        if where == "torch.save":
            _atomic_save({"global_step": 4}, path)  # Lightning's own writer, torch.save failing inside
        else:
            Path(path).write_bytes(whole[: len(whole) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError) as e:
        AtomicCheckpoint(ckpt, every=4)._save(_Trainer(save))
    one_line(e.value, ckpt)
    assert resume_checkpoint(ckpt) == ckpt and ckpt.read_bytes() == whole


def test_every_ddp_ranks_rng_state_is_saved_and_restored_by_rank(monkeypatch) -> None:
    """Dropout draws from each rank's own RNG: the checkpoint (rank 0's file) holds every rank's state,
    and a resumed rank continues its own stream, not rank 0's."""
    import torch.distributed as tdist

    from boosttune.config import OptimConfig
    from boosttune.train import distill

    torch.manual_seed(0)
    rank0 = distill.rng_state()
    torch.manual_seed(1)
    rank1 = distill.rng_state()
    expected = torch.rand(4)  # rank 1's next draws

    # two ranks: this process is rank 1; the collective hands back rank 0's state beside ours
    monkeypatch.setattr(tdist, "is_initialized", lambda: True)
    monkeypatch.setattr(tdist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(tdist, "get_rank", lambda group=None: 1)

    def all_gather_object(out: list, obj) -> None:
        out[:] = [rank0, obj]

    monkeypatch.setattr(tdist, "all_gather_object", all_gather_object)
    saved = distill.gather_rng_states(rank1)
    assert torch.equal(saved[0]["torch"], rank0["torch"]) and torch.equal(saved[1]["torch"], rank1["torch"])

    module = distill.DistillModule(tiny_llama(0), OptimConfig())
    torch.manual_seed(123)  # the resumed process starts elsewhere
    module.on_load_checkpoint({"global_step": 4, "rng": rank0, "rng_per_rank": saved})
    assert torch.equal(torch.rand(4), expected)

    monkeypatch.setattr(tdist, "get_rank", lambda group=None: 0)
    module.on_load_checkpoint({"global_step": 4, "rng": rank0, "rng_per_rank": saved})
    torch.set_rng_state(rank0["torch"])
    first = torch.rand(4)
    module.on_load_checkpoint({"global_step": 4, "rng": rank0})  # a checkpoint from before: rank 0's
    assert torch.equal(torch.rand(4), first)
