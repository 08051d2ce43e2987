"""Hugging Face interop: a trained checkpoint exported, loaded by transformers, and read back.

One in-process debug run (3 steps, checkpoint at step 3) is exported once per module;
transformers is imported and the exported model loaded once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import safetensors.torch
import torch
import transformers
from helpers import REPO, train_here

from torchtitan import hf
from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from torchtitan.models import ModelArgs, build_model, llama_configs

TOLERANCE = 1e-4
TEXT = (
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n"
    "Or to take arms against a sea of troubles\n"
    "And by opposing end them. To die: to sleep;\n"
)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(step-3 folder, its HF export, the checkpoint's ModelArgs)."""
    root = tmp_path_factory.mktemp("hf")
    train_here(root / "run", "--training.steps", 3, "--checkpoint.enable_checkpoint",
               "--checkpoint.interval", 3)  # fmt: skip
    step = str(root / "run" / "checkpoint" / "step-3")
    args = hf.export(step, str(root / "export"))
    return step, str(root / "export"), args


@pytest.fixture(scope="module")
def hf_model(exported):
    return transformers.LlamaForCausalLM.from_pretrained(exported[1], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokens(tokenizer) -> torch.Tensor:
    """Two rows of real text, long enough (200 tokens) for RoPE angles to wrap many times."""
    ids = tokenizer.encode(TEXT * 8, bos=True)
    return torch.tensor([ids[:200], ids[100:300]])


def project_logits(exported, tokens) -> torch.Tensor:
    step, _, args = exported
    model = build_model(args.flavor, args.vocab_size, device="cpu")
    model.load_state_dict(hf.read_dcp_model(step))
    with torch.no_grad():
        return model.eval()(tokens)


def test_transformers_computes_the_same_logits(exported, hf_model, tokens):
    with torch.no_grad():
        theirs = hf_model(tokens).logits
    diff = (project_logits(exported, tokens) - theirs).abs().max().item()
    assert diff <= TOLERANCE, diff


def test_without_the_rope_row_order_the_logits_differ(exported, hf_model, tokens):
    """Negative control: q/k rows in the project's order give other logits, so the test above
    can fail."""
    step, _, args = exported
    weights = hf.read_dcp_model(step)
    wrong = transformers.LlamaForCausalLM(hf_model.config).eval()
    state = dict(hf_model.state_dict())
    for i in range(args.n_layers):
        for hf_name, name in (("q_proj", "wq"), ("k_proj", "wk")):
            state[f"model.layers.{i}.self_attn.{hf_name}.weight"] = weights[
                f"layers.{i}.attention.{name}.weight"
            ]
    wrong.load_state_dict(state)
    with torch.no_grad():
        diff = (project_logits(exported, tokens) - wrong(tokens).logits).abs().max().item()
    assert diff > 10 * TOLERANCE, diff


def test_round_trip_is_exact(exported):
    step, out, args = exported
    weights = hf.read_dcp_model(step)
    to_hf = hf.to_hf_state_dict(weights, args)
    assert not torch.equal(to_hf["model.layers.0.self_attn.k_proj.weight"],
                           weights["layers.0.attention.wk.weight"])  # fmt: skip
    back = hf.from_hf_state_dict(to_hf, args)
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k], weights[k]) for k in weights)

    read, kwargs = hf.read_hf_folder(out, args)
    assert read.keys() == weights.keys()
    assert all(torch.equal(read[k], weights[k]) for k in weights)
    assert hf.expected_shapes(ModelArgs(**kwargs)) == hf.expected_shapes(args)


def test_sharded_folder_reads_the_same(exported, tmp_path):
    step, out, args = exported
    weights = safetensors.torch.load_file(os.path.join(out, hf.WEIGHTS))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}  # fmt: skip
    for file, members in shards.items():
        safetensors.torch.save_file({n: weights[n] for n in members}, str(tmp_path / file))
    index = {"weight_map": {n: file for file, members in shards.items() for n in members}}
    (tmp_path / hf.WEIGHTS_INDEX).write_text(json.dumps(index))
    shutil.copy(os.path.join(out, hf.CONFIG), tmp_path)
    read, _ = hf.read_hf_folder(str(tmp_path), args)
    expected = hf.read_dcp_model(step)
    assert all(torch.equal(read[k], expected[k]) for k in expected)

    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(hf.HFError, match="model-00002-of-00002.safetensors, which is missing"):
        hf.read_hf_folder(str(tmp_path))


def one_line_error(call, match: str) -> str:
    with pytest.raises(hf.HFError, match=match) as info:
        call()
    assert "\n" not in str(info.value)
    return str(info.value)


def test_hf_folder_errors_name_the_file_and_the_fix(exported, tmp_path):
    _, out, args = exported
    one_line_error(lambda: hf.read_hf_folder(str(tmp_path)), "config.json does not exist")

    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    config = json.loads((bad / hf.CONFIG).read_text())
    (bad / hf.CONFIG).write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"],
                                             "model_type": "gpt2"}))  # fmt: skip
    one_line_error(lambda: hf.read_hf_folder(str(bad)), "describes .*GPT2LMHeadModel")

    deeper = replace(args, n_layers=args.n_layers + 1)
    message = one_line_error(lambda: hf.read_hf_folder(out, deeper), "n_layers=2, flavor")
    assert "--model.flavor" in message
    other = replace(llama_configs["125M"], vocab_size=args.vocab_size)
    one_line_error(lambda: hf.read_hf_folder(out, other), "dim=64, flavor '125M' has 768")

    (bad / hf.CONFIG).write_text(json.dumps({**config, "num_hidden_layers": 3}))
    one_line_error(lambda: hf.read_hf_folder(str(bad)), "lacks weight layers.2.* re-export")

    os.remove(bad / hf.WEIGHTS)
    (bad / hf.CONFIG).write_text(json.dumps(config))
    one_line_error(lambda: hf.read_hf_folder(str(bad)), "neither model.safetensors nor")


def test_damaged_or_unlabelled_checkpoint_is_one_clear_error(exported, tmp_path):
    step, _, args = exported
    damaged = tmp_path / "step-3"
    shutil.copytree(step, damaged)
    data = next(p for p in damaged.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    out = tmp_path / "out"
    one_line_error(lambda: hf.export(str(damaged), str(out)), "fails its checksum")
    assert not out.exists()  # nothing written before everything is checked

    unlabelled = tmp_path / "unlabelled" / "step-3"
    shutil.copytree(step, unlabelled)
    manifest = json.loads((unlabelled / "manifest.json").read_text())
    del manifest["config"]
    (unlabelled / "manifest.json").write_text(json.dumps(manifest))
    one_line_error(lambda: hf.export(str(unlabelled), str(out), DEFAULT_TOKENIZER_PATH), "--flavor")
    assert hf.export(str(unlabelled), str(out), DEFAULT_TOKENIZER_PATH, args.flavor) == args


def load_script():
    spec = importlib.util.spec_from_file_location("export_hf", REPO / "scripts" / "export_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_writes_a_loadable_folder(exported, tmp_path, capsys):
    step, _, _ = exported
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "scripts" / "export_hf.py"), "--checkpoint", step,
           "--output", str(out), "--tokenizer", DEFAULT_TOKENIZER_PATH]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {"config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"} <= set(
        os.listdir(out)
    )

    missing = str(tmp_path / "nowhere" / "step-9")
    assert load_script().main(["--checkpoint", missing, "--output", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("export_hf: error: checkpoint") and missing in err


def test_transformers_tokenizer_gives_the_same_ids(exported, tokenizer):
    theirs = transformers.AutoTokenizer.from_pretrained(exported[1])
    text = "  Leading spaces,\ttabs\n\nand\r\nCRLF; 1611 digits, Ünïcödé 漢字 🙂\n" + TEXT
    ids = tokenizer.encode(text)
    assert theirs.encode(text, add_special_tokens=False) == ids
    assert theirs(text)["input_ids"] == [tokenizer.bos_id, *ids]
    assert theirs.decode(ids) == text


def test_tokenizer_of_another_run_is_refused(exported, tmp_path):
    step, _, _ = exported
    relabelled = tmp_path / "step-3"
    shutil.copytree(step, relabelled)
    manifest = json.loads((relabelled / "manifest.json").read_text())
    manifest["data_fingerprint"]["tokenizer_sha256"] = "0" * 64
    (relabelled / "manifest.json").write_text(json.dumps(manifest))
    one_line_error(
        lambda: hf.export(str(relabelled), str(tmp_path / "out")), "not the one the checkpoint"
    )


def test_tokenizers_json_is_exported_and_loads(exported, tmp_path):
    """A run with a tokenizer.json (here: the same vocabulary, converted by transformers)."""
    step, out, _ = exported
    converted = tmp_path / "tokenizer.json"
    transformers.AutoTokenizer.from_pretrained(out).backend_tokenizer.save(str(converted))
    ours = Tokenizer(converted)
    run = tmp_path / "step-3"
    shutil.copytree(step, run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["data_fingerprint"]["tokenizer_sha256"] = ours.sha256()
    (run / "manifest.json").write_text(json.dumps(manifest))

    hf.export(str(run), str(tmp_path / "out"), str(converted))
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / hf.CONFIG).read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (ours.bos_id, ours.eos_id)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert theirs.encode(TEXT, add_special_tokens=False) == ours.encode(TEXT)
    assert theirs.bos_token_id == ours.bos_id


# ---- starting a run from other weights (checkpoint.initial_load_path) -------------------


def first_losses(dump) -> list[float]:
    from helpers import read_jsonl

    return [r["loss"] for r in read_jsonl(os.path.join(dump, "metrics.jsonl"))]


def test_a_run_starts_from_a_step_folder_or_a_hf_folder_then_from_its_own(exported, tmp_path):
    """The same weights from another job's step-3 (dcp) and from its HF export (hf) give
    the same first loss, and not the loss of a fresh start. Once the run has a checkpoint
    of its own, that one wins: a run stopped at step 2 and relaunched repeats the
    uninterrupted one bit for bit."""
    step, folder, _ = exported
    common = ["--training.steps", 3, "--checkpoint.enable_checkpoint", "--checkpoint.interval", 1]
    train_here(tmp_path / "scratch", *common)
    train_here(tmp_path / "dcp", *common, "--checkpoint.initial_load_path", step)
    _, log = train_here(tmp_path / "hf", *common, "--checkpoint.initial_load_path", folder,
                        "--checkpoint.initial_load_format", "hf", "--training.stop_at_step", 2)  # fmt: skip
    assert f"model weights from {folder} (hf)" in log
    _, log = train_here(tmp_path / "hf", *common, "--checkpoint.initial_load_path", folder,
                        "--checkpoint.initial_load_format", "hf")  # fmt: skip
    assert "loaded checkpoint" in log and "model weights from" not in log
    assert first_losses(tmp_path / "hf") == first_losses(tmp_path / "dcp")
    assert first_losses(tmp_path / "dcp")[0] != first_losses(tmp_path / "scratch")[0]


@pytest.mark.slow
def test_two_fsdp_ranks_start_from_a_hf_folder_read_by_rank_0(exported, tmp_path):
    """Rank 0 reads the folder and broadcasts each rank its part: 2 ranks x 2 sequences
    give the loss of 1 rank x 4 from the same weights (to float rounding: the sums run in
    another order)."""
    from helpers import train

    step, folder, _ = exported
    two = train(tmp_path / "two", "--training.steps", 1, "--training.batch_size", 2,
                "--checkpoint.initial_load_path", folder, "--checkpoint.initial_load_format", "hf")  # fmt: skip
    assert "model weights from" in two.stderr
    one = train_here(
        tmp_path / "one", "--training.steps", 1, "--checkpoint.initial_load_path", step
    )
    assert one[0] == 0
    assert first_losses(tmp_path / "two")[0] == pytest.approx(first_losses(tmp_path / "one")[0])


# Slow tier, beside the 2-rank start from an HF folder: a 2-rank launch whose rank 0
# sleeps 5 s (13 s).
@pytest.mark.slow
def test_the_wait_for_rank_0_is_sized_from_the_folder_and_says_when_storage_is_slow(
    exported, tmp_path
):
    """The other ranks wait for rank 0's read of an HF folder as long as its size says
    (120 s + its bytes at 25 MB/s), not the process group's fixed timeout. Rank 0 here
    takes 5 s (a probe sleeps before the real read) against a budget of 1 s (as if the
    folder were that much larger than the storage's speed): the waiting rank stops with
    one line naming the folder, its size and the fix, instead of hanging in a collective.
    (Rank 0, still reading, is then stopped by torchrun.)"""
    from helpers import error_lines, shim_env

    from torchtitan.initial_weights import load_timeout_s
    from torchtitan.tools.launch import torchrun_command

    assert load_timeout_s(16e9) == 120 + 640  # an 8B folder
    _, folder, _ = exported
    env = shim_env(tmp_path / "shim", (
        "import time\n"
        "from torchtitan import hf, initial_weights\n"
        "_read = hf.read_hf_folder\n"
        "def slow(*args, **kwargs):\n"
        "    time.sleep(5)\n"
        "    return _read(*args, **kwargs)\n"
        "hf.read_hf_folder = slow\n"
        "initial_weights.WAIT_BASE_S, initial_weights.WAIT_MIN_BYTES_PER_S = 1.0, 1e15\n"
    ))  # fmt: skip
    args = ["--job.config_file", "train_configs/debug_model.toml", "--training.steps", 1,
            "--job.dump_folder", tmp_path / "run", "--checkpoint.initial_load_path", folder,
            "--checkpoint.initial_load_format", "hf"]  # fmt: skip
    proc = subprocess.run(torchrun_command(2, [str(a) for a in args]), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    errors = [e for e in error_lines(proc.stderr) if e.startswith("[rank1]")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert "did not finish reading it" in errors[0] and "MB/s" in errors[0], errors
    frames = [x for x in proc.stderr.splitlines() if x.strip().startswith("File ")]
    assert not [f for f in frames if "torchtitan" in f or "train.py" in f], frames


def test_a_bad_initial_load_path_is_one_line(exported, tmp_path):
    step, folder, _ = exported
    status, log = train_here(tmp_path / "a", "--checkpoint.initial_load_path", tmp_path / "none",
                             expect_ok=False)  # fmt: skip
    assert status == 1 and "checkpoint.initial_load_path" in log and "Traceback" not in log
    status, log = train_here(tmp_path / "b", "--checkpoint.initial_load_path", step,
                             "--checkpoint.initial_load_format", "hf", expect_ok=False)  # fmt: skip
    assert status == 1 and "config.json does not exist" in log and "Traceback" not in log
    # Weights of another shape (a different vocabulary) and a truncated safetensors file.
    status, log = train_here(tmp_path / "c", "--checkpoint.initial_load_path", step,
                             "--model.tokenizer_path", _other_vocab_tokenizer(tmp_path),
                             expect_ok=False)  # fmt: skip
    assert status == 1 and "model weight tok_embeddings.weight is (4096, 64)" in log
    assert "Traceback" not in log
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    status, log = train_here(tmp_path / "d", "--checkpoint.initial_load_path", broken,
                             "--checkpoint.initial_load_format", "hf", expect_ok=False)  # fmt: skip
    assert status == 1 and f"checkpoint.initial_load_path {broken}" in log
    assert "Traceback" not in log and len(log.strip().splitlines()[-1]) < 600


def _other_vocab_tokenizer(tmp_path) -> str:
    """A SentencePiece model with another vocabulary size, trained on a few lines."""
    import io

    import sentencepiece as spm

    text = tmp_path / "text.txt"
    text.write_text(TEXT * 40)
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(input=str(text), model_writer=out, vocab_size=400,
                                   model_type="bpe", byte_fallback=True, minloglevel=2)  # fmt: skip
    path = tmp_path / "other.model"
    path.write_bytes(out.getvalue())
    return str(path)


def test_an_moe_checkpoint_exports_as_glm4_moe_with_the_same_logits(tmp_path, tokens):
    """debug_moe after 3 steps (a trained balancing bias in play) exported as a
    Glm4MoeForCausalLM: transformers computes the same logits (to TOLERANCE; the bias is
    its e_score_correction_bias). Negative control: the fused experts with the up rows
    before the gate rows (w3 over w1) give other logits."""
    train_here(tmp_path / "run", "--model.flavor", "debug_moe", "--training.steps", 3,
               "--training.seq_len", 32, "--checkpoint.enable_checkpoint",
               "--checkpoint.interval", 3)  # fmt: skip
    step = str(tmp_path / "run" / "checkpoint" / "step-3")
    args = hf.export(step, str(tmp_path / "export"))
    weights = hf.read_dcp_model(step)
    assert weights["layers.0.feed_forward.expert_bias"].abs().sum() > 0
    theirs = transformers.Glm4MoeForCausalLM.from_pretrained(
        str(tmp_path / "export"), dtype=torch.float32
    ).eval()
    ours = build_model(args.flavor, args.vocab_size, device="cpu")
    ours.load_state_dict(weights)
    with torch.no_grad():
        expected = ours.eval()(tokens)
        assert (expected - theirs(tokens).logits).abs().max().item() <= TOLERANCE
        for i in range(args.n_layers):
            at = f"layers.{i}.feed_forward.experts."
            fused = torch.cat([weights[at + "w3"], weights[at + "w1"]], dim=1)
            theirs.model.layers[i].mlp.experts.gate_up_proj.copy_(fused)
        assert (expected - theirs(tokens).logits).abs().max().item() > 10 * TOLERANCE
