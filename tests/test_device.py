"""--device: the forms it takes, how they resolve on this machine, the errors before any model loads,
and a bundle decoding on a device through `boosttune generate`, token-identical to plain decoding.

The CUDA branches of the resolution are tested without a GPU by faking what torch reports
(``torch.cuda.is_available`` and ``device_count``); only the gpu-marked case runs models on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from bundle_fixtures import make_run_dir
from conftest import MT_BENCH
from transformers import AutoModelForCausalLM

from boosttune import assemble
from boosttune.cli import _build, main
from boosttune.core.device import DEVICE_FORMS, check_device_name, resolve_device

MALFORMED = ["gpu", "cuda:x", "cuda:", "cpu:0", "auto:1", "cuda:-1", "", "cuda 0"]
COMMANDS = {  # each command that loads models, with the arguments it needs to parse
    "serve": ["serve", "BUNDLE"],
    "generate": ["generate", "BUNDLE", "Hello"],
    "bench": ["bench", "--questions", "q.jsonl", "--out", "o"],
    "train-scheduler": ["train-scheduler", "RUN_DIR"],
}


def _cuda(monkeypatch, count: int) -> None:
    """Make torch report ``count`` CUDA devices (0: none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_auto_is_cuda_where_torch_sees_it_else_the_cpu(monkeypatch):
    _cuda(monkeypatch, 0)
    assert resolve_device("auto") == torch.device("cpu")
    _cuda(monkeypatch, 2)
    assert resolve_device("auto") == torch.device("cuda")


@pytest.mark.parametrize("count", [0, 2])
def test_cpu_is_the_cpu_whatever_cuda_there_is(monkeypatch, count):
    _cuda(monkeypatch, count)
    assert resolve_device("cpu") == resolve_device(" CPU ") == resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_cuda_and_an_index_within_the_devices_resolve(monkeypatch):
    _cuda(monkeypatch, 2)
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cuda:1") == resolve_device(torch.device("cuda", 1)) == torch.device("cuda", 1)


@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_without_a_cuda_device_names_the_flag_and_the_fix(monkeypatch, name):
    _cuda(monkeypatch, 0)
    with pytest.raises(ValueError, match=f"--device {name}: torch sees no CUDA device.*use --device cpu or auto"):
        resolve_device(name)


def test_an_index_beyond_the_devices_says_how_many_there_are(monkeypatch):
    _cuda(monkeypatch, 2)
    with pytest.raises(ValueError, match=r"--device cuda:3: this machine has 2 CUDA devices \(cuda:0 .. cuda:1\)"):
        resolve_device("cuda:3")
    _cuda(monkeypatch, 1)
    with pytest.raises(ValueError, match="has 1 CUDA device "):
        resolve_device("cuda:1")


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_names_are_refused_with_the_valid_forms(name):
    with pytest.raises(ValueError, match=f"--device: expected {DEVICE_FORMS}"):
        check_device_name(name)
    with pytest.raises(ValueError, match="--device: expected"):
        resolve_device(name)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_model_command_takes_the_flag(command):
    parser, _ = _build()
    assert parser.parse_args(COMMANDS[command]).device == "auto"
    for name in ("cpu", "cuda", "cuda:1", "Auto"):  # the form only: no CUDA needed to parse
        assert parser.parse_args([*COMMANDS[command], "--device", name]).device == name.lower()


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("name", ["gpu", "cuda:x"])
def test_argparse_refuses_malformed_devices_naming_the_forms(command, name, capsys):
    with pytest.raises(SystemExit) as e:
        main([*COMMANDS[command], "--device", name])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--device" in err and DEVICE_FORMS in err and repr(name) in err


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: the device errors must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the device was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(("count", "name", "says"), [
    (0, "cuda", "use --device cpu or auto"),
    (1, "cuda:3", "this machine has 1 CUDA device (cuda:0); use one of them"),
])
def test_a_missing_device_fails_before_anything_loads(monkeypatch, no_model_loads, tmp_path, capsys, command, count,
                                                      name, says):
    """Even the bundle, models and run directory (here none exists) are looked at only after the device."""
    _cuda(monkeypatch, count)
    argv = {
        "serve": ["serve", str(tmp_path / "no-bundle")],
        "generate": ["generate", "--llm", str(tmp_path / "no-llm"), "Hello"],
        "bench": ["bench", "--llm", str(tmp_path / "no-llm"), "--ssm", str(tmp_path / "no-ssm"), "--questions",
                  str(MT_BENCH), "--out", str(tmp_path / "o")],
        "train-scheduler": ["train-scheduler", str(tmp_path / "no-run")],
    }[command]
    assert main([*argv, "--device", name]) == 2
    err = capsys.readouterr().err
    assert f"--device {name}:" in err and says in err


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from boosttune.export.bundle import export_bundle

    root = tmp_path_factory.mktemp("device")
    run = make_run_dir(root / "run", n_ssms=2)
    return str(export_bundle(run, root / "bundle", prompt_lookup=4).bundle)


@pytest.fixture
def ieee_fp32():
    """fp32 comparisons need IEEE fp32 matmuls on CUDA (no TF32), whatever an earlier import configured."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
])
def test_generate_decodes_a_bundle_on_the_device_as_plain_decoding_does(bundle, monkeypatch, ieee_fp32, device):
    """fp32 greedy: the bundle's SSMs and prompt lookup, all on ``device``, give plain decoding's tokens."""
    from boosttune.core.models import eos_token_ids
    from boosttune.core.prompts import encode_prompt
    from boosttune.serving.decode import incremental_generate
    from boosttune.serving.stops import StopCriteria

    served, results = [], []
    from_bundle, generate = assemble.from_bundle, assemble.Served.generate

    def spy_bundle(*args, **kwargs):
        served.append(from_bundle(*args, **kwargs))
        return served[-1]

    def spy_generate(self, *args, **kwargs):
        results.append(generate(self, *args, **kwargs))
        return results[-1]

    monkeypatch.setattr(assemble, "from_bundle", spy_bundle)
    monkeypatch.setattr(assemble.Served, "generate", spy_generate)
    prompt = "Name three colours."
    assert main(["generate", bundle, prompt, "--max-new-tokens", "16", "--no-scheduler", "--device", device]) == 0
    (engine,), (res,) = served, results
    assert engine.llm.model.device.type == device
    assert {m.model.device.type for m in engine.models.values()} == {device}
    assert engine.lookup == 4 and len(engine.engine.drafters) == 3  # two SSMs and prompt lookup
    ids = encode_prompt(engine.llm.tokenizer, prompt)
    plain = incremental_generate(engine.llm.model, ids, StopCriteria(max_new_tokens=16,
                                                                    eos_token_ids=eos_token_ids(engine.llm)))
    assert res.tokens == plain.tokens and len(res.tokens) > 0
