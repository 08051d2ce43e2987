"""Hugging Face interop: this project's Llama weights <-> a ``LlamaForCausalLM`` folder;
a mixture-of-experts flavor's -> a ``Glm4MoeForCausalLM`` folder (export only).

Owns: the name map between the two state dicts, the per-head row order of ``wq``/``wk``
that makes the two RoPE conventions agree, the ``config.json`` fields of a Llama, reading
the model weights out of one finished ``step-N`` checkpoint, and writing / reading an HF
folder (``config.json``, safetensors weights, tokenizer files).

RoPE: this model rotates interleaved channel pairs (2i, 2i+1) of each head
(``apply_rope``); HF's Llama rotates channel i with channel i + head_dim/2 (rotate_half).
Reordering each head's rows of ``wq`` and ``wk`` from (0, 1, 2, 3, ...) to
(0, 2, 4, ..., 1, 3, 5, ...) moves every pair to where HF expects it, and q.k is
unchanged because q and k are reordered alike. ``wv``/``wo`` and the MLP need nothing.

Mixture of experts: transformers' GLM-4-MoE computes what models/moe.py computes when
its options are set to it (``hf_config``): Llama attention (no q/k norm, no biases,
RoPE on the whole head), a sigmoid router choosing the top k of score +
``e_score_correction_bias`` (our ``expert_bias``) in one group, gates the chosen
unbiased scores normalized (it adds 1e-20 to the sum: a last-bit difference at most),
scaled by 1.0, a shared expert, and no dense first layer. Its experts are fused:
``gate_up_proj`` is our ``w1`` over ``w3`` per expert, ``down_proj`` our ``w2``.
``expert_tokens`` (a count, not a weight) is not exported. DeepSeek-V3's class has
multi-head latent attention and Qwen3-MoE's has q/k norms and softmax routing with no
shared expert: neither computes this model. Importing an MoE folder is not done.

Never: train, build the trainer's model, write into a checkpoint folder, or need a
process group. transformers is never imported here (only the tests load the result with
it), and safetensors is imported only by the functions that read or write it, so the
trainer does not depend on either.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from torchtitan.checkpoint.folder import read_manifest
from torchtitan.checkpoint.integrity import format_problem, verify_checkpoint
from torchtitan.checkpoint.store import is_url, store_for, upload_folder
from torchtitan.config import resolve_path
from torchtitan.data.tokenizer import Tokenizer, TokenizerError
from torchtitan.models.llama import ModelArgs, Transformer, llama_configs

logger = logging.getLogger("torchtitan")

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
ARCHITECTURE = "LlamaForCausalLM"


class HFError(ValueError):
    """An HF export or import that cannot be done as asked; one line naming the file and fix."""


# ---- names and the RoPE row order ---------------------------------------------------------

# Project name (top level, or per block after "layers.{i}.") -> HF name.
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# A mixture of experts' feed-forward (per block) -> GLM-4-MoE's. The experts' weights are
# fused (``_moe_experts``); ``expert_tokens`` has no counterpart.
_BLOCK_MOE = {
    "feed_forward.router.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
}
MOE_ARCHITECTURE = "Glm4MoeForCausalLM"
_TOP_BACK = {v: k for k, v in _TOP.items()}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_PROJECT_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Older HF exports store the RoPE frequencies; they are derived from the config here.
_HF_DERIVED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _rope_heads(project_name: str, args: ModelArgs) -> int | None:
    """How many heads the rows of this weight hold, if RoPE is applied to its output."""
    if project_name.endswith("attention.wq.weight"):
        return args.n_heads
    if project_name.endswith("attention.wk.weight"):
        return args.n_kv_heads
    return None


def _pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Per head, rows (0, 1, 2, 3, ...) -> (0, 2, 4, ..., 1, 3, 5, ...)."""
    return w.reshape(heads, -1, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def _halves_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of ``_pairs_to_halves``."""
    return w.reshape(heads, 2, -1, w.shape[1]).transpose(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    m = _PROJECT_BLOCK.match(name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"
    if m and m.group(2) in _BLOCK_MOE:
        return f"model.layers.{m.group(1)}.{_BLOCK_MOE[m.group(2)]}"
    raise HFError(f"model weight {name!r} has no Hugging Face Llama counterpart")


def _project_name(hf_name: str) -> str:
    if hf_name in _TOP_BACK:
        return _TOP_BACK[hf_name]
    m = _HF_BLOCK.match(hf_name)
    if m and m.group(2) in _BLOCK_BACK:
        return f"layers.{m.group(1)}.{_BLOCK_BACK[m.group(2)]}"
    raise HFError(
        f"Hugging Face weight {hf_name!r} is not part of a bias-free LlamaForCausalLM; "
        "only plain Llama checkpoints can be imported"
    )


def expected_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """Every weight this model has for ``args``, with its shape (built on meta: no memory)."""
    with torch.device("meta"):
        model = Transformer(args)
    return {name: t.shape for name, t in model.state_dict().items()}


def check_weights(state_dict: dict, args: ModelArgs, what: str, fix: str):
    """One-line HFError unless ``state_dict`` has exactly the weights and shapes of ``args``."""
    want = expected_shapes(args)
    missing = sorted(set(want) - set(state_dict))
    if missing:
        raise HFError(f"{what} lacks weight {missing[0]} ({len(missing)} missing); {fix}")
    extra = sorted(set(state_dict) - set(want))
    if extra:
        raise HFError(f"{what} has weight {extra[0]} that {args.flavor!r} lacks; {fix}")
    for name, shape in want.items():
        if state_dict[name].shape != shape:
            raise HFError(
                f"{what}: weight {name} has shape {list(state_dict[name].shape)}, "
                f"{args.flavor!r} expects {list(shape)}; {fix}"
            )


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict:
    """Project weights -> ``LlamaForCausalLM`` weights (``wq``/``wk`` reordered into new
    tensors; the others are the same tensors under their HF names)."""
    check_weights(
        state_dict, args, "the model state", "pass the ModelArgs the weights were built with"
    )
    out = {}
    for name, tensor in state_dict.items():
        if ".feed_forward.experts." in name or name.endswith("feed_forward.expert_tokens"):
            continue  # fused below; a count, not exported
        heads = _rope_heads(name, args)
        out[_hf_name(name)] = tensor if heads is None else _pairs_to_halves(tensor, heads)
    if args.is_moe:
        out.update(_moe_experts(state_dict, args))
    return out


def _moe_experts(state_dict: dict, args: ModelArgs) -> dict:
    """GLM-4-MoE's fused expert weights of every block: ``gate_up_proj`` [E, 2 hidden,
    dim] (w1's rows, then w3's, per expert) and ``down_proj`` [E, dim, hidden] (w2)."""
    out = {}
    for i in range(args.n_layers):
        at, to = f"layers.{i}.feed_forward.experts.", f"model.layers.{i}.mlp.experts."
        w1, w3 = state_dict[at + "w1"], state_dict[at + "w3"]
        out[to + "gate_up_proj"] = torch.cat([w1, w3], dim=1)
        out[to + "down_proj"] = state_dict[at + "w2"]
    return out


def from_hf_state_dict(
    hf_state_dict: dict[str, torch.Tensor],
    args: ModelArgs,
    source: str = "the Hugging Face weights",
    fix: str = "pass the matching ModelArgs",
) -> dict:
    """``LlamaForCausalLM`` weights -> project weights; the exact inverse of ``to_hf_state_dict``.

    ``source`` and ``fix`` complete the error message when the weights do not fit ``args``.
    """
    renamed = {
        _project_name(name): tensor
        for name, tensor in hf_state_dict.items()
        if not _HF_DERIVED.search(name)
    }
    check_weights(renamed, args, source, fix)
    out = {}
    for name, tensor in renamed.items():
        heads = _rope_heads(name, args)
        out[name] = tensor if heads is None else _halves_to_pairs(tensor, heads)
    return out


# ---- config.json ----------------------------------------------------------------------------


def hf_config(
    args: ModelArgs, bos_id: int | None, eos_id: int | None, dtype: torch.dtype = torch.float32
) -> dict:
    """The ``config.json`` of a ``LlamaForCausalLM`` that computes what this model computes
    (of a ``Glm4MoeForCausalLM`` for a mixture of experts: ``moe_config``)."""
    dtype_name = str(dtype).removeprefix("torch.")
    if args.is_moe:
        return moe_config(args, bos_id, eos_id, dtype_name)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        # transformers >= 5 reads rope_parameters; 4.x reads the top-level rope_theta.
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        # transformers >= 5 names it dtype; 4.x torch_dtype.
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }


def moe_config(args: ModelArgs, bos_id, eos_id, dtype_name: str) -> dict:
    """A ``Glm4MoeForCausalLM`` config.json with every option set to what models/moe.py
    computes (the module docstring lists them)."""
    return {
        "architectures": [MOE_ARCHITECTURE],
        "model_type": "glm4_moe",
        "hidden_size": args.dim,
        "intermediate_size": args.moe_hidden_dim,  # the dense MLP's: no layer has one
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": args.rope_theta,
            "partial_rotary_factor": 1.0,
        },  # fmt: skip
        "max_position_embeddings": args.max_seq_len,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_qk_norm": False,
        "attention_dropout": 0.0,
        "moe_intermediate_size": args.moe_hidden_dim,
        "n_routed_experts": args.n_experts,
        "num_experts_per_tok": args.n_active_experts,
        "n_shared_experts": args.n_shared_experts,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "first_k_dense_replace": 0,
        "num_nextn_predict_layers": 0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "dtype": dtype_name,
    }


def args_from_hf_config(config: dict, source: str = CONFIG) -> dict:
    """``ModelArgs`` keyword arguments from a Llama ``config.json`` (defaults as LlamaConfig's).

    Raises HFError for what this model cannot compute: biases, tied embeddings, another
    activation, a head_dim other than hidden_size / heads, or scaled RoPE.
    """
    archs = config.get("architectures") or []
    if ARCHITECTURE not in archs and config.get("model_type") != "llama":
        raise HFError(
            f"{source} describes {archs or config.get('model_type')!r}, not {ARCHITECTURE}; "
            "only Llama checkpoints can be imported"
        )
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size"):  # fmt: skip
        if key not in config:
            raise HFError(f"{source} has no {key}; give it the field LlamaConfig would write")
    unsupported = {
        "attention_bias": config.get("attention_bias", False),
        "mlp_bias": config.get("mlp_bias", False),
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
    }
    for key, value in unsupported.items():
        if value:
            raise HFError(f"{source} sets {key}={value}; this Llama has none: import another model")
    if config.get("hidden_act", "silu") != "silu":
        raise HFError(f"{source} sets hidden_act={config['hidden_act']!r}; this Llama uses silu")
    heads, dim = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or dim // heads
    if head_dim * heads != dim:
        raise HFError(
            f"{source} sets head_dim={head_dim} with hidden_size={dim} and {heads} heads; this "
            "Llama needs head_dim = hidden_size / num_attention_heads"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise HFError(f"{source} uses rope_type {rope_type!r}; this Llama has plain RoPE only")
    return {
        "dim": dim,
        "n_layers": config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads") or heads,
        "ffn_hidden_dim": config["intermediate_size"],
        "vocab_size": config["vocab_size"],
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        "max_seq_len": config.get("max_position_embeddings", 2048),
    }


# ---- reading a project checkpoint ---------------------------------------------------------


def read_dcp_model(step_dir: str) -> dict[str, torch.Tensor]:
    """The model weights of a finished ``step-N`` checkpoint, full (unsharded), on CPU.

    Verifies the folder against its manifest first (every file's size and CRC32), then
    loads only the ``model.*`` entries with DCP in this process, without a process group.
    Cost: reads and checksums the whole folder once, and holds the whole model in memory:
    O(model) in one process, whatever the number of ranks that wrote it.
    """
    store = store_for(step_dir)
    if not store.isdir(step_dir):
        raise HFError(f"checkpoint {step_dir} does not exist; pass a step-N folder")
    problem = verify_checkpoint(step_dir)
    if problem is not None:
        raise HFError(f"checkpoint {step_dir} cannot be exported: {problem}; pick another step")
    problem = format_problem(step_dir)
    if problem:
        raise HFError(f"checkpoint {step_dir} {problem}; export it with the version that wrote it")
    metadata = store.reader(step_dir).read_metadata()
    weights = {}
    for key, info in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(info, dcp.TensorStorageMetadata):
            weights[key.removeprefix("model.")] = torch.empty(
                info.size, dtype=info.properties.dtype
            )
    if not weights:
        raise HFError(f"checkpoint {step_dir} holds no model weights; pick another step")
    dcp.load({"model": weights}, checkpoint_id=step_dir, storage_reader=store.reader(step_dir),
             no_dist=True)  # fmt: skip
    return weights


def checkpoint_args(step_dir: str, vocab_size: int, flavor: str | None = None) -> ModelArgs:
    """The ModelArgs a checkpoint's weights were built with: the flavor its manifest's config
    names (or ``flavor``), with the vocab size its embedding has."""
    if flavor is None:
        config = read_manifest(step_dir).get("config") or {}
        flavor = (config.get("model") or {}).get("flavor")
        if flavor is None:
            raise HFError(
                f"checkpoint {step_dir}: its manifest.json records no model.flavor; "
                "name the flavor it was trained with (--flavor)"
            )
    if flavor not in llama_configs:
        raise HFError(
            f"unknown llama flavor {flavor!r}: pass --flavor, one of {sorted(llama_configs)}"
        )
    return replace(llama_configs[flavor], vocab_size=vocab_size)


# ---- writing and reading an HF folder -------------------------------------------------------


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise HFError(
            "the safetensors package is not installed; pip install safetensors "
            "(or pip install -e '.[dev]')"
        ) from None
    return safetensors.torch


def _write_json(path: str, obj: dict):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _sentencepiece_config(tokenizer: Tokenizer) -> dict:
    """tokenizer_config.json that makes transformers' LlamaTokenizer encode as ``tokenizer``."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    data = Path(tokenizer.path).read_bytes()
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(data)
    norm = sentencepiece_model_pb2.ModelProto.FromString(data).normalizer_spec
    if norm.name not in ("identity", "") or norm.remove_extra_whitespaces:
        # transformers' LlamaTokenizer neither normalizes nor collapses whitespace.
        logger.warning(
            "tokenizer %s normalizes its input (%s); transformers' LlamaTokenizer does not, "
            "so its ids can differ on such text",
            tokenizer.path,
            norm.name,
        )
    special = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id,
               "unk_token": sp.unk_id(), "pad_token": sp.pad_id()}  # fmt: skip
    return {
        "tokenizer_class": "LlamaTokenizer",
        **{name: sp.id_to_piece(i) for name, i in special.items() if i >= 0},
        # Training documents start with bos (and end with eos); a prompt gets bos only.
        "add_bos_token": True,
        "add_eos_token": False,
        # transformers' Llama default prepends a space to every input; SentencePiece
        # does only if its model says so.
        "add_prefix_space": bool(norm.add_dummy_prefix),
        "legacy": False,
        "clean_up_tokenization_spaces": False,
    }


def _tokenizers_json_config(tokenizer: Tokenizer) -> dict:
    """A minimal tokenizer_config.json naming bos and eos, for a tokenizer.json without one."""
    import tokenizers

    backend = tokenizers.Tokenizer.from_file(tokenizer.path)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": backend.id_to_token(tokenizer.bos_id),
        "eos_token": backend.id_to_token(tokenizer.eos_id),
        "clean_up_tokenization_spaces": False,
    }


def tokenizer_files(
    tokenizer_path: str, model_config: dict | None = None, expected_sha256: str | None = None
) -> tuple[dict[str, str], dict | None, int, int]:
    """What an HF folder needs for a tokenizer: (files to copy, by their name there; the
    tokenizer_config.json to write, or None; bos id; eos id). Writes nothing.

    The tokenizer is loaded as the run loaded it (``model_config``: the run's ``[model]``
    section, for bos_token/eos_token) and must have the run's fingerprint
    (``expected_sha256``) when one is given. A SentencePiece model becomes
    ``tokenizer.model`` + a ``tokenizer_config.json`` naming LlamaTokenizer; a
    ``tokenizer.json`` is copied with the ``tokenizer_config.json`` beside it, or given a
    minimal one.
    """
    if not os.path.exists(tokenizer_path):
        raise HFError(f"tokenizer {tokenizer_path} does not exist; pass --tokenizer PATH")
    # Only the tokens a run set: a default config loads the file as it is.
    special = {
        k: v for k, v in (model_config or {}).items() if k in ("bos_token", "eos_token") and v
    }
    try:
        tokenizer = Tokenizer(tokenizer_path, **special)
    except TokenizerError as e:
        raise HFError(str(e)) from None
    if expected_sha256 and tokenizer.sha256() != expected_sha256:
        raise HFError(
            f"tokenizer {tokenizer.path} is not the one the checkpoint was trained with "
            f"(fingerprint {tokenizer.sha256()[:12]}, checkpoint {expected_sha256[:12]}); "
            "pass the run's --tokenizer"
        )
    # The kind is told by content, as the Tokenizer does: a tokenizer.json is JSON.
    with open(tokenizer.path, "rb") as f:
        is_json = f.read(64).lstrip()[:1] == b"{"
    if not is_json:
        files = {"tokenizer.model": tokenizer.path}
        return files, _sentencepiece_config(tokenizer), tokenizer.bos_id, tokenizer.eos_id
    files = {"tokenizer.json": tokenizer.path}
    beside = os.path.join(os.path.dirname(tokenizer.path), "tokenizer_config.json")
    if os.path.isfile(beside):
        files["tokenizer_config.json"] = beside
        return files, None, tokenizer.bos_id, tokenizer.eos_id
    return files, _tokenizers_json_config(tokenizer), tokenizer.bos_id, tokenizer.eos_id


def export(
    step_dir: str, out_dir: str, tokenizer_path: str | None = None, flavor: str | None = None
) -> ModelArgs:
    """Write ``step_dir``'s model as a ``LlamaForCausalLM`` folder (``Glm4MoeForCausalLM`` for
    a mixture of experts); returns its ModelArgs.

    The flavor is the one the checkpoint's manifest records (``flavor`` overrides it), the
    tokenizer the one its config names (``tokenizer_path`` overrides it; either must have
    the fingerprint the checkpoint recorded). Everything is checked before
    ``out_dir`` is written; files already there with the same names are replaced.
    Cost: O(model) memory and one read of the checkpoint folder, in one process.

    ``out_dir`` may be a URL (``s3://bucket/hf``): the folder is written to a local
    temporary folder, then uploaded with ``config.json`` last (a reader that finds it
    finds the weights). Not written through fsspec directly: safetensors writes a file
    by path, and its in-memory ``save`` would hold a second copy of the model.
    """
    if is_url(out_dir):
        with tempfile.TemporaryDirectory(prefix="hf-export-") as local:
            args = export(step_dir, local, tokenizer_path, flavor)
            upload_folder(local, out_dir, last=CONFIG)
        return args
    weights = read_dcp_model(step_dir)
    if "tok_embeddings.weight" not in weights:
        raise HFError(f"checkpoint {step_dir} has no tok_embeddings.weight; pick another step")
    args = checkpoint_args(step_dir, weights["tok_embeddings.weight"].shape[0], flavor)
    check_weights(weights, args, f"checkpoint {step_dir}", "pass the flavor it was trained with")
    hf_weights = {name: t.contiguous() for name, t in to_hf_state_dict(weights, args).items()}
    manifest = read_manifest(step_dir)
    model_config = (manifest.get("config") or {}).get("model") or {}
    if tokenizer_path is None:
        tokenizer_path = model_config.get("tokenizer_path")
        if tokenizer_path is None:
            raise HFError(f"checkpoint {step_dir} records no tokenizer; pass --tokenizer PATH")
        tokenizer_path = resolve_path(tokenizer_path)
    expected_sha256 = (manifest.get("data_fingerprint") or {}).get("tokenizer_sha256")
    files, tokenizer_config, bos, eos = tokenizer_files(
        tokenizer_path, model_config, expected_sha256
    )
    save_file = _safetensors().save_file

    os.makedirs(out_dir, exist_ok=True)
    for name, source in files.items():
        shutil.copyfile(source, os.path.join(out_dir, name))
    if tokenizer_config is not None:
        _write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config)
    dtype = weights["tok_embeddings.weight"].dtype
    _write_json(os.path.join(out_dir, CONFIG), hf_config(args, bos, eos, dtype))
    # transformers refuses safetensors files without format metadata.
    save_file(hf_weights, os.path.join(out_dir, WEIGHTS), metadata={"format": "pt"})
    return args


def _read_hf_weights(folder: str) -> dict[str, torch.Tensor]:
    load_file = _safetensors().load_file
    single, index = os.path.join(folder, WEIGHTS), os.path.join(folder, WEIGHTS_INDEX)
    if os.path.isfile(single):
        return load_file(single)
    if not os.path.isfile(index):
        raise HFError(
            f"{folder} has neither {WEIGHTS} nor {WEIGHTS_INDEX}; save the model with "
            "save_pretrained(..., safe_serialization=True)"
        )
    with open(index) as f:
        shards = sorted(set(json.load(f).get("weight_map", {}).values()))
    weights = {}
    for shard in shards:
        path = os.path.join(folder, shard)
        if not os.path.isfile(path):
            raise HFError(f"{index} names {shard}, which is missing from {folder}; copy it there")
        weights.update(load_file(path))
    return weights


def read_hf_folder(folder: str, args: ModelArgs | None = None) -> tuple[dict, dict]:
    """(project state dict, ModelArgs kwargs) of a ``LlamaForCausalLM`` folder, for an
    initial load. With ``args`` (the configured flavor) the folder must match it exactly.

    Reads ``config.json`` and ``model.safetensors`` (or the shards its index names).
    Cost: O(model) memory in one process.
    """
    config_path = os.path.join(folder, CONFIG)
    try:
        with open(config_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise HFError(f"{config_path} does not exist; pass a Hugging Face model folder") from None
    except (OSError, ValueError) as e:
        raise HFError(f"{config_path} is unreadable ({e}); re-export the folder") from None
    kwargs = args_from_hf_config(config, config_path)
    try:
        folder_args = ModelArgs(**kwargs, flavor=CONFIG)
    except ValueError as e:
        raise HFError(f"{config_path}: {e}") from None
    if args is not None:
        for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "vocab_size",
                      "norm_eps", "rope_theta"):  # fmt: skip
            have, want = getattr(folder_args, field), getattr(args, field)
            if have != want:
                raise HFError(
                    f"{config_path} has {field}={have}, flavor {args.flavor!r} has {want}; "
                    "set --model.flavor (and tokenizer) to match the folder"
                )
    hf_weights = _read_hf_weights(folder)
    weights = from_hf_state_dict(
        hf_weights, folder_args, f"the weights in {folder}", f"they do not fit {CONFIG}: re-export"
    )
    return weights, kwargs
