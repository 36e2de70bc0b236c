"""The training config: shipped configs resolve, every kind of mistake names its field, overrides work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from boosttune.config import ConfigError, TrainConfig, dump_yaml, load_config
from boosttune.core.rundir import RunDir
from boosttune.serving.tree import TreeConfig
from boosttune.train.pipeline import check_or_save_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


@pytest.mark.parametrize("name", ["tiny.yaml", "smollm2-demo.yaml", "smollm2-hour.yaml", "smollm2-long.yaml", "openwebtext-llama7b.yaml"])
def test_shipped_configs_resolve(name: str) -> None:
    cfg = load_config(CONFIGS / name)
    assert isinstance(cfg, TrainConfig)
    assert cfg.boost.num_ssms >= 1
    # the resolved form round-trips through YAML
    again = load_config_from_text(dump_yaml(cfg))
    assert again == cfg


def load_config_from_text(text: str) -> TrainConfig:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    return load_config(f.name)


def test_llama7b_is_specinfer_setting() -> None:
    cfg = load_config(CONFIGS / "openwebtext-llama7b.yaml")
    assert cfg.llm.ref == "meta-llama/Llama-2-7b-hf"
    assert cfg.ssm.init == "JackFram/llama-160m"
    assert cfg.boost.num_ssms == 5
    assert cfg.prompts.sources[0].kind == "openwebtext"
    assert cfg.optim.strategy == "deepspeed_stage_2" and cfg.optim.devices == 8


def test_demo_config_meets_the_issue() -> None:
    cfg = load_config(CONFIGS / "smollm2-demo.yaml")
    assert cfg.llm.ref == "default" and cfg.boost.num_ssms >= 3


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_deepspeed_jsons_agree_with_the_typed_config(zero: str) -> None:
    stage = {"zero2": 2, "zero3": 3}[zero]
    ds = json.loads((CONFIGS / "deepspeed" / f"{zero}.json").read_text())
    assert ds["zero_optimization"]["stage"] == stage
    # consistent with the 7B config when that strategy is chosen (validate() cross-checks)
    load_config(CONFIGS / "openwebtext-llama7b.yaml",
                [f"optim.strategy=deepspeed_stage_{stage}", f"optim.deepspeed_config={CONFIGS / 'deepspeed' / zero}.json"])


def test_deepspeed_json_disagreeing_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 7,
                               "bf16": {"enabled": True}, "gradient_clipping": 1.0}))
    with pytest.raises(ConfigError, match="gradient_accumulation_steps 7 != optim.grad_accum 4"):
        load_config(CONFIGS / "openwebtext-llama7b.yaml", [f"optim.deepspeed_config={bad}"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optim.lr_typo=1"], "unknown field optim.lr_typo"),
        (["nonsense.x=1"], "unknown field nonsense"),
        (["optim.max_steps=ten"], "optim.max_steps: expected an integer"),
        (["optim.max_steps=1.5"], "optim.max_steps: expected an integer"),
        (["optim.lr=fast"], "optim.lr: expected a number"),
        (["boost.mode=bagging"], "boost.mode: must be one of 'match', 'quantile', 'weighted', 'independent'"),
        (["boost.num_ssms=0"], "boost.num_ssms: must be >= 1"),
        (["boost.match.fraction=1.5"], "boost.match.fraction: must be in"),
        (["prompts.sources=[{kind: jsonl, path: /no/such/file.jsonl}]"], r"prompts.sources\[0\].path: file not found"),
        (["prompts.sources=[{kind: jsonl}]"], r"prompts.sources\[0\].path: a jsonl source needs a path"),
        (["prompts.sources=[{kind: web}]"], r"prompts.sources\[0\].kind: must be one of"),
        (["optim.loss=ce+kl"], "optim.loss: 'ce\\+kl' needs the teacher's top-k log-probs"),
        (["ssm.layers=[0, -1]"], "ssm.layers: layer indices must be >= 0"),
        (["llm.teacher_dtype=int8"], "llm.teacher_dtype: must be fp32, bf16, fp16 or auto"),
        (["eval.prompts=/no/such.jsonl"], "eval.prompts: file not found"),
        (["teacher.top_p=0"], "teacher.top_p: must be in"),
        (["optim.deepspeed_config=/no/ds.json"], "optim.deepspeed_config: file not found"),
        (["scheduler.limit=-1"], "scheduler.limit"),
        (["optim=3"], "optim: expected a mapping"),
        (["optim.lr"], "expected section.field=value"),
    ],
)
def test_mistakes_name_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIGS / "tiny.yaml", overrides)


def test_overrides_apply_with_yaml_values() -> None:
    cfg = load_config(CONFIGS / "tiny.yaml", ["optim.lr=3e-4", "boost.num_ssms=5", "tree.widths=[1, 3]",
                                              "prompts.sources=[{kind: default, limit: 7}]"])
    assert cfg.optim.lr == 3e-4 and cfg.boost.num_ssms == 5 and cfg.tree.widths == (1, 3)
    assert cfg.prompts.sources[0].limit == 7


def test_configs_from_before_the_tree_section_still_load(tmp_path: Path) -> None:
    """Run directories keep the config.yaml they were started with: its eval.widths is the tree's."""
    old = tmp_path / "config.yaml"
    old.write_text("eval:\n  limit: 2\n  widths: [1, 2, 1]\n")
    assert load_config(old).tree == TreeConfig(widths=(1, 2, 1))
    with pytest.raises(ConfigError, match="tree.widths only"):
        load_config(CONFIGS / "tiny.yaml", ["eval.widths=[1, 3]"])
    with pytest.raises(ConfigError, match="tree.widths must be"):
        load_config(CONFIGS / "tiny.yaml", ["tree.widths=[1, 0]"])


def test_missing_config_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--config: file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_resume_refuses_a_changed_config(tmp_path: Path) -> None:
    cfg = load_config(CONFIGS / "tiny.yaml")
    check_or_save_config(cfg, RunDir(tmp_path))
    check_or_save_config(load_config(CONFIGS / "tiny.yaml", ["optim.logger=none", "eval.limit=1"]), RunDir(tmp_path))
    with pytest.raises(ConfigError, match="optim.max_steps: this run directory was started with optim.max_steps=12"):
        check_or_save_config(load_config(CONFIGS / "tiny.yaml", ["optim.max_steps=13"]), RunDir(tmp_path))


def test_cli_reports_config_errors_before_any_work(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "boosttune.cli", "train", "--config", str(CONFIGS / "tiny.yaml"), "--run-dir", str(run),
         "optim.lr=abc"], capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "optim.lr: expected a number" in proc.stderr
    assert not run.exists()  # nothing was started


def test_cli_names_a_missing_model(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "boosttune.cli", "train", "--config", str(CONFIGS / "tiny.yaml"),
         "--run-dir", str(tmp_path / "r"), "llm.ref=/no/such/model"], capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "llm.ref:" in proc.stderr and "/no/such/model" in proc.stderr


def test_an_ssm_init_with_another_vocabulary_is_refused_at_start(tmp_path: Path) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from boosttune.config import load_config
    from boosttune.core.models import resolve_model_path
    from boosttune.train.pipeline import preflight

    other = tmp_path / "other-ssm"
    tok = AutoTokenizer.from_pretrained(resolve_model_path("tiny-random"))
    tok.add_tokens(["<brand-new-token>"])
    tok.save_pretrained(other)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(other)
    cfg = load_config(CONFIGS / "tiny.yaml", [f"ssm.init={other}"])
    with pytest.raises(ConfigError, match="ssm.init: SSM .* has a different vocabulary"):
        preflight(cfg)


def _normalised(text: str) -> str:
    return " ".join(text.lower().split())


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_no_shipped_config_trains_on_mt_bench(name: str) -> None:
    """MT-bench is evaluation only: no source names it, and no seed or local prompt is one of its turns."""
    from conftest import MT_BENCH

    from boosttune.core.prompts import read_prompts
    from boosttune.train.sources import default_seeds

    cfg = load_config(CONFIGS / name)
    mt_turns = {_normalised(t) for line in MT_BENCH.read_text().splitlines() if line.strip()
                for t in json.loads(line)["turns"]}
    texts = [p.text for p in default_seeds()]
    # what training reads: the prompt sources, and the scheduler's training prompts
    paths = [(s.kind, s.path) for s in cfg.prompts.sources] + [("jsonl", cfg.scheduler.prompts or "")]
    for kind, path in paths:
        assert not any(m in path.lower() for m in ("mt_bench", "mt-bench", "mtbench")), f"{name}: {path}"
        if kind in ("text", "jsonl") and path and Path(path).is_file():
            texts += [p.text for p in read_prompts(path)]
    leaked = [t for t in texts if _normalised(t) in mt_turns]
    assert not leaked, f"{name} trains on MT-bench turns: {leaked[:3]}"
