"""The first start on a never-seen corpus: launch to step 1 as the corpus grows, side by
side with torchtitan 0.3.0's trainer launched the same way, and with its loader alone.

    python scripts/benchmarks/bench_coldstart.py [--peer-python /path/to/venv/bin/python] [--work DIR]
        [--rounds 2] [--sizes 1,8] [--base-mb 20] [--seq-len 128] [--smoke] [--json out.json]

Corpora, built once under --work (default: the temporary folder's ``bench_coldstart``)
and kept there: per size S (--sizes, in multiples of --base-mb MB of text), 64 parquet
files (columns ``id`` and ``text``, 64-row groups), each from one bundled text
(Shakespeare, Milton, KJV in turn): its documents from a point of the file's own on,
round and round, each headed by a line naming its file and row, until the file holds
S x base-mb / 64 MB of text (the last document cut to fit). A larger size is the same 64
files S times longer (the same documents, continued), not S times as many files: only
the bytes and the row groups grow, what a start pays per file (listing, footers, opens)
stays the same, so the ratio between sizes is what grows with the text, which a first
start should not pay for (what grows with the number of files is bench_startup.py's).
Row groups of a fixed number of rows keep the unit a streaming reader decodes the same
at every size.

Ours is the product as a user launches it, through its command line only (what runs is
this checkout's ``train.py``; nothing here calls torchtitan's data package, so any
version of it is measured alike): ``torchrun --standalone --nproc_per_node 2 train.py
--job.config_file train_configs/debug_model.toml --training.dataset_path <corpus>
--training.streaming {true,false} --training.steps 1``, seq_len --seq-len, batch 4 per
rank, no checkpoint, one thread per process, the job's dump folder under --work, a fresh
empty ``--training.length_index_dir`` and ``$TORCHTITAN_CACHE`` per launch, so that every
launch is the corpus's first start. Timed from the launch to the line of step 1 in the
job's log (its stdout and stderr read line by line as they come, and kept with the
seconds since the launch in the run's folder under --work), and to the exit. Map-style
reads the corpus with ``datasets.load_dataset``, which converts parquet into its own
Arrow cache the first time it sees a corpus (O(corpus): the library's cost, not ours):
before the rounds, one launch per corpus with a throwaway index folder warms that cache
($HF_HOME under --work, offline); its time is reported apart, labelled.

Two peers, both torchtitan 0.3.0 in --peer-python (a virtual environment where ``import
torchtitan`` is 0.3.0; this script installs nothing, and skips both, saying why, when it
cannot import it), both streaming the same parquet files (``load_dataset(...,
streaming=True)``, registered as "bench" in 0.3.0's ``DATASETS``) through the bundled
SentencePiece model in bench_streaming.py's adapter (its ``PEER_SETUP``), both launched from
their run's folder so that this repository's torchtitan is not on the path:

- "peer trainer, torchrun 2 ranks", what ours is measured against: 0.3.0's own trainer
  (``torchtitan/train.py``'s ``main``), launched as ours is, ``torchrun --standalone
  --nproc_per_node 2 launch.py ARGS --module __main__ --config bench_debugmodel
  --hf_assets_path data/tokenizer --dump_folder <run>/dump --dataloader.dataset bench
  --dataloader.dataset_path <corpus> --training.steps 1 --training.seq_len <--seq-len>
  --training.local_batch_size 4 --checkpoint.no-enable --parallelism.spmd_backend
  partial_dtensor`` (the exact command is kept with each launch). ``launch.py`` is
  ``PEER_TRAINER``, written to the run's folder: it registers "bench", defines the config
  function ``bench_debugmodel`` and calls 0.3.0's ``main`` (0.3.0's ConfigManager imports the
  module that ``--module`` names; ``__main__`` is the launcher itself). ``bench_debugmodel``
  is 0.3.0's ``llama3_debugmodel`` (flavor ``debugmodel``: dim 256, 6 layers, 7.2 M
  parameters with this vocabulary, a larger model than ours; FSDP over the 2 ranks,
  selective activation checkpointing, no compile, as 0.3.0 ships it) with our tokenizer, the
  vocabulary sized to it (4096; ours sizes its model to the tokenizer too) and SDPA for
  attention. Timed from the launch to the first metrics line of step 1 (``step:  1  loss``),
  and to the exit.
  0.3.0 does not start on a CPU as shipped. Two settings go through its own config:
  ``--parallelism.spmd_backend partial_dtensor`` (the default, ``spmd_types``, hands
  ``fully_shard`` plain parameters, which this torch's FSDP2 refuses: "When dp_mesh_dims is
  provided, all parameters must be DTensors"), and SDPA (llama3's default FlexAttention has
  no backward on a CPU in torch, and varlen is CUDA's; 0.3.0's trainer runs SDPA as a
  maskless backend, causal over the whole window rather than per document). The launcher
  changes four things at run time, each only what stops the start, and no file of 0.3.0's:
  (1) the device: 0.3.0 picks torch's accelerator, else "cuda", never the CPU, once, in
  ``torchtitan.tools.utils`` at its import, and the modules imported after it copy the
  choice; the launcher sets ``device_type = "cpu"`` there before any other module of
  0.3.0's is imported, with a device module that is ``torch.cpu`` plus what the memory
  monitor asks and ``torch.cpu`` lacks (name, capacity, empty memory statistics, so the step
  line's memory reads -0.00GiB) and ``current_device() == 0``; 0.3.0 then picks gloo itself.
  (2) triton: torch's CPU builds have none, and llama3's imports reach the MoE
  expert-parallel kernels (``distributed/minimal_async_ep/kernels.py``), which import it at
  the top; where triton is absent the launcher stands in for that one module (each kernel
  raises if called; a dense model calls none), so triton stays absent for torch. (3) gloo has
  no PREMUL_SUM, which FSDP2 reduce-scatters with once 0.3.0 sets the gradient divide factor
  to 1 (it scales by the global token count itself): its ``disable_fsdp_gradient_division``
  is wrapped to also set FSDP's sum-only reductions (SUM, then the same factor 1 after: the
  same gradients). (4) ``torch.distributed.set_timeout``, called after step 1 to shorten the
  collectives' timeout, is absent from this torch: where absent, it is aliased to torch's
  ``distributed_c10d._set_pg_timeout`` (same arguments).
- "peer loader, 1 process", 0.3.0's data path alone: its ``HuggingFaceTextDataset`` in its
  ``ParallelAwareDataloader``, rank 0 of 2, batch 4, seq_len --seq-len, in one fresh process.
  Timed from the launch to the line it prints after its first batch (mostly imports: no
  torchrun, process group or model).

Rounds (--rounds): per size, ours streaming, the peer trainer, the peer loader, ours
map-style; medians. Targets: ours, largest size / smallest <= 1.2 (streaming and map-style);
ours streaming / peer <= 1.5, against the peer trainer (against the peer loader, labelled,
where the trainer has no figure).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan
from bench_streaming import PEER_SETUP

from harness import bench
from harness.corpus import built_once, write_parquet
from torchtitan import REPO_ROOT as REPO

CONFIG = "train_configs/debug_model.toml"
TOKENIZER = REPO / "data" / "tokenizer" / "tokenizer.model"  # debug_model.toml's
DOMAINS = ("shakespeare", "milton", "kjv")
FILES, ROW_GROUP, BATCH = 64, 64, 4
LAUNCH_TIMEOUT_S = 3600
STEP_1 = re.compile(r"\bstep\s+1\s+loss\b")  # the job's metrics line of step 1
PEER_STEP_1 = re.compile(r"step:\s+1\s")  # 0.3.0's, between colour codes (no \b)
FIRST_BATCH = re.compile(r"^FIRST ")
TARGET_GROWTH, TARGET_PEER = 1.2, 1.5


# ---- corpora ---------------------------------------------------------------------------


def bundled_texts(domain: str) -> list[str]:
    import pyarrow.parquet as pq

    files = sorted(str(p) for p in (REPO / "data" / "corpus" / domain).glob("*.parquet"))
    return pq.read_table(files, columns=["text"])["text"].to_pylist()


def file_documents(f: int, pool: list[str], domain: str, text_bytes: int):
    """File ``f``'s (id, text) rows: ``pool``'s documents from a point of its own on,
    round and round, each headed by its file and row; the last one cut so that the rows
    hold exactly ``text_bytes`` bytes of UTF-8 (give or take a cut character)."""
    size, r = 0, 0
    while size < text_bytes:
        text = f"{domain}, part {f}, document {r}\n" + pool[(f * 97 + r) % len(pool)]
        data = text.encode()
        if size + len(data) > text_bytes:
            text = data[: text_bytes - size].decode(errors="ignore")
        yield f"{domain}-{f:02d}-{r:05d}", text
        size, r = size + len(data), r + 1


def build_corpus(folder: Path, text_bytes: int) -> dict:
    """FILES parquet files under ``folder/data`` holding ``text_bytes`` of text in all;
    built once (a DONE file records what was built)."""
    import pyarrow.parquet as pq

    def build(out: Path) -> dict:
        data = out / "data"
        pools = {d: bundled_texts(d) for d in DOMAINS}
        documents, groups = 0, 0
        for f in range(FILES):
            domain = DOMAINS[f % len(DOMAINS)]
            rows = [{"id": i, "text": t}
                    for i, t in file_documents(f, pools[domain], domain, text_bytes // FILES)]  # fmt: skip
            path = write_parquet(data / f"part-{f:03d}.parquet", rows, row_group=ROW_GROUP)
            documents, groups = documents + len(rows), groups + pq.ParquetFile(path).num_row_groups
        return {"path": str(data), "files": FILES, "documents": documents, "row_groups": groups,
                "text_bytes": text_bytes // FILES * FILES,
                "parquet_bytes": sum(p.stat().st_size for p in data.glob("*.parquet"))}  # fmt: skip

    return built_once(folder, "corpus", build)


# ---- launching and timing --------------------------------------------------------------


def timed_launch(cmd: list[str], cwd: Path, env: dict, marker: re.Pattern, log: Path) -> dict:
    """Seconds from the launch to the first output line matching ``marker`` (None if
    none came) and to the exit; the exit status and the output's last lines. The whole
    output goes to ``log``, each line after the seconds since the launch."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    # A job that hangs is ended with the process group it leads (its ranks included).
    timer = threading.Timer(LAUNCH_TIMEOUT_S, os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    first, matched, tail = None, "", deque(maxlen=40)
    try:
        with open(log, "w") as out:
            for line in proc.stdout:
                now = time.perf_counter() - start
                if first is None and marker.search(line):
                    first, matched = now, line.strip()
                out.write(f"{now:9.3f} {line}")
                tail.append(line)
        returncode = proc.wait()
    finally:
        timer.cancel()
    return {"first_s": first, "exit_s": time.perf_counter() - start, "returncode": returncode,
            "line": matched, "tail": "".join(tail)}  # fmt: skip


def fresh(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def job_env(work: Path, cache: Path) -> dict:
    """One thread per process, no PYTHONPATH; torchtitan's and datasets' caches under
    --work, offline."""
    env = bench.program_env() | {"PYTHONUNBUFFERED": "1", "TORCHTITAN_CACHE": str(cache),
                                 "HF_HOME": str(work / "hf"), "HF_HUB_OFFLINE": "1",
                                 "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    env.pop("HF_DATASETS_CACHE", None)
    return env


def ours(work: Path, corpus: dict, streaming: bool, seq_len: int, label: str) -> dict:
    """One launch of the training job on ``corpus``, as its first start (a fresh index
    folder and torchtitan cache)."""
    run = fresh(work / "runs" / label)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "train.py", "--job.config_file", CONFIG, "--job.dump_folder", str(run / "dump"),
           "--training.dataset_path", corpus["path"],
           "--training.streaming", "true" if streaming else "false",
           "--training.length_index_dir", str(fresh(run / "length_index")),
           "--training.steps", "1", "--training.seq_len", str(seq_len),
           "--training.batch_size", str(BATCH), "--checkpoint.enable_checkpoint", "false",
           "--metrics.enable_tensorboard", "false"]  # fmt: skip
    result = timed_launch(cmd, REPO, job_env(work, fresh(run / "cache")), STEP_1, run / "log")
    tail = result.pop("tail")
    if result["returncode"] != 0 or result["first_s"] is None:
        raise SystemExit(f"our job {label} failed (exit {result['returncode']}):\n"
                         f"{' '.join(cmd)}\n{tail}")  # fmt: skip
    return result


PEER_FIRST_BATCH = (
    "import time\nT0 = time.perf_counter()\n"
    + PEER_SETUP
    + r"""
T1 = time.perf_counter()
DATASETS["bench"] = DatasetConfig(
    path="bench",
    loader=lambda _: load_dataset("parquet", data_files=args["files"], split="train",
                                  streaming=True),
    sample_processor=lambda sample: sample["text"],
)
dataset = HuggingFaceTextDataset("bench", None, tokenizer, seq_len=args["seq_len"],
                                 dp_rank=0, dp_world_size=2, infinite=True)
loader = ParallelAwareDataloader(dataset, dp_rank=0, dp_world_size=2, batch_size=args["batch"],
                                 num_workers=0)
batch = next(iter(loader))
T2 = time.perf_counter()
print("FIRST", json.dumps({"imports_s": T1 - T0, "after_imports_s": T2 - T1}), flush=True)
"""
)


def peer_loader(work: Path, python: str, corpus: dict, seq_len: int, label: str) -> dict:
    """One fresh process of the peer's loader to its first batch on ``corpus``, streaming."""
    files = sorted(str(p) for p in Path(corpus["path"]).glob("*.parquet"))
    args = {"files": files, "seq_len": seq_len, "batch": BATCH, "tokenizer": str(TOKENIZER),
            "repo": str(REPO)}  # fmt: skip
    run = fresh(work / "runs" / label)
    # From the run's folder, so that this repository's torchtitan is not on the path.
    result = timed_launch([python, "-c", PEER_FIRST_BATCH, json.dumps(args)], run,
                          job_env(work, fresh(run / "cache")), FIRST_BATCH, run / "log")  # fmt: skip
    tail = result.pop("tail")
    if "SKIP" in tail:
        raise bench.PeerUnavailable(tail.split("SKIP", 1)[1].strip())
    if result["returncode"] != 0 or result["first_s"] is None:
        raise SystemExit(f"the peer loader failed (exit {result['returncode']}):\n{tail}")
    return result | json.loads(result["line"].split("FIRST", 1)[1])


# torchtitan 0.3.0's trainer on the CPU. The device comes first, before PEER_SETUP imports
# the modules of 0.3.0's that copy it. The numbered changes: the module docstring's (1)-(4).
PEER_CPU_DEVICE = r"""
import os, sys, types
import torch


class CpuDeviceModule:
    # torch.cpu, and what 0.3.0 asks of an accelerator's module that torch.cpu lacks.
    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def current_device(self):
        return 0  # an index: barrier(device_ids=[...]) takes integers

    def get_device_name(self, device=None):
        return "cpu"

    def get_device_properties(self, device=None):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(name="cpu", total_memory=memory)

    def memory_stats(self, device=None):
        return {}

    def reset_peak_memory_stats(self, device=None):
        pass

    def empty_cache(self):
        pass


# (1) 0.3.0 takes torch's accelerator, else "cuda", once, here; the modules imported after copy it.
try:
    import torchtitan.tools.utils
    torchtitan.tools.utils.device_type = "cpu"
    torchtitan.tools.utils.device_module = CpuDeviceModule()
except Exception:
    pass  # PEER_SETUP, next, says what this torchtitan is
"""

PEER_TRAINER = (
    PEER_CPU_DEVICE
    + PEER_SETUP
    + r"""
import glob
import importlib.util
from dataclasses import dataclass

# (2) llama3's imports reach the MoE kernels, which import triton; a dense model runs none.
if importlib.util.find_spec("triton") is None:
    KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"

    def _needs_triton(name):
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args, **kwargs):
            raise RuntimeError(f"{KERNELS}.{name} needs triton, which this torch lacks")

        return kernel

    sys.modules[KERNELS] = types.ModuleType(KERNELS)
    sys.modules[KERNELS].__getattr__ = _needs_triton

import torchtitan.distributed.fsdp
from torch.distributed.fsdp import FSDPModule
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.train import main

# (3) gloo has no PREMUL_SUM: reduce with SUM, then the same factor (1) after.
_disable_fsdp_gradient_division = torchtitan.distributed.fsdp.disable_fsdp_gradient_division


def disable_fsdp_gradient_division_sum_only(model):
    _disable_fsdp_gradient_division(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


torchtitan.distributed.fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division_sum_only
# (4) called after step 1; this torch names it _set_pg_timeout (same arguments).
if not hasattr(torch.distributed, "set_timeout"):
    torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout

DATASETS["bench"] = DatasetConfig(
    path="bench",
    loader=lambda path: load_dataset("parquet", split="train", streaming=True,
                                     data_files=sorted(glob.glob(os.path.join(path, "*.parquet")))),
    sample_processor=lambda sample: sample["text"],
)


class BenchTokenizer(SentencePieceAdapter):
    # PEER_SETUP's adapter as 0.3.0's trainer builds a tokenizer: from --hf_assets_path.
    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config, tokenizer_path):
        super().__init__(os.path.join(tokenizer_path, "tokenizer.model"))


def bench_debugmodel():
    # The config function --config names: llama3_debugmodel with our tokenizer and its
    # vocabulary, and SDPA (FlexAttention has no backward on a CPU; varlen is CUDA's).
    config = llama3_debugmodel()
    config.tokenizer = BenchTokenizer.Config()
    vocab, model = tokenizer.get_vocab_size(), config.model_spec.model
    model.vocab_size = model.tok_embeddings.num_embeddings = model.lm_head.out_features = vocab
    config.loss.loss_fn.global_vocab_size = vocab
    for _, _, parent, name in model.traverse(FlexAttention.Config):
        setattr(parent, name, ScaledDotProductAttention.Config())
    return config


del sys.argv[1]  # PEER_SETUP's; the rest are the trainer's
main()
"""
)


def peer_trainer_command(python: str, corpus: dict, seq_len: int, run: Path) -> list[str]:
    """torchrun of 2 ranks running PEER_TRAINER (``launch.py`` in ``run``) to step 1."""
    args = {"tokenizer": str(TOKENIZER), "repo": str(REPO)}
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "launch.py", json.dumps(args), "--module", "__main__", "--config", "bench_debugmodel",
            "--hf_assets_path", str(TOKENIZER.parent), "--dump_folder", str(run / "dump"),
            "--dataloader.dataset", "bench", "--dataloader.dataset_path", corpus["path"],
            "--training.steps", "1", "--training.seq_len", str(seq_len),
            "--training.local_batch_size", str(BATCH), "--checkpoint.no-enable",
            "--parallelism.spmd_backend", "partial_dtensor"]  # fmt: skip


def peer_trainer(work: Path, python: str, corpus: dict, seq_len: int, label: str) -> dict:
    """One launch of the peer's trainer on ``corpus``, streaming, to its step 1 and exit."""
    run = fresh(work / "runs" / label)
    (run / "launch.py").write_text(PEER_TRAINER)
    cmd = peer_trainer_command(python, corpus, seq_len, run)
    # From the run's folder, so that this repository's torchtitan is not on the path.
    result = timed_launch(cmd, run, job_env(work, fresh(run / "cache")), PEER_STEP_1,
                          run / "log")  # fmt: skip
    tail = result.pop("tail")
    if "SKIP" in tail:
        raise bench.PeerUnavailable(tail.split("SKIP", 1)[1].strip())
    if result["returncode"] != 0 or result["first_s"] is None:
        raise SystemExit(f"the peer trainer failed (exit {result['returncode']}):\n"
                         f"{shlex.join(cmd)}\n{tail}")  # fmt: skip
    return result | {"command": shlex.join(cmd)}


# ---- report ----------------------------------------------------------------------------

# Each kind of launch a round makes, in the table's order, with its row's label.
LABELS = {"streaming": "ours streaming", "map-style": "ours map-style",
          "peer trainer": "peer trainer, torchrun 2 ranks",
          "peer loader": "peer loader, 1 process"}  # fmt: skip
PEERS = ("peer trainer", "peer loader")  # the first with a figure is the target's


def median(runs: list[dict], key: str = "first_s"):
    return statistics.median(r[key] for r in runs) if runs else None


def summarize(sizes: list[int], corpora: dict, runs: dict) -> dict:
    """The table's rows (per size, one per kind of launch that ran), the ratios between the
    largest size and the smallest, and the targets, each as measured."""
    rows = []
    for size in sizes:
        ours_s = median(runs[size]["streaming"])
        for kind, label in LABELS.items():
            if not runs[size][kind]:
                continue
            first_s = median(runs[size][kind])
            rows.append({"size": size, "run": kind, "label": label, **{k: corpora[size][k] for k in
                         ("text_bytes", "parquet_bytes", "files", "documents", "row_groups")},
                         "first_s": first_s, "exit_s": median(runs[size][kind], "exit_s"),
                         "runs_s": [r["first_s"] for r in runs[size][kind]],
                         "ours_streaming_over_this": ours_s / first_s if kind in PEERS else None})  # fmt: skip
    low, high = min(sizes), max(sizes)
    growth = {}
    for kind in LABELS if high > low else ():
        if runs[high][kind] and runs[low][kind]:
            growth[kind] = median(runs[high][kind]) / median(runs[low][kind])
    targets = [{"target": f"ours {kind}, {high}x / {low}x <= {TARGET_GROWTH}", "ratio": ratio,
                "met": ratio <= TARGET_GROWTH}
               for kind, ratio in growth.items() if kind not in PEERS]  # fmt: skip
    for size in sizes:
        peer = next((r for r in rows if r["size"] == size and r["run"] in PEERS), None)
        if peer:
            ratio = peer["ours_streaming_over_this"]
            targets.append({"target": f"ours streaming / {peer['label']}, {size}x <= {TARGET_PEER}",
                            "ratio": ratio, "met": ratio <= TARGET_PEER})  # fmt: skip
    return {"rows": rows, "growth": {"sizes": [high, low], **growth}, "targets": targets}


def print_report(result: dict):
    print(f"\nfirst start on a never-seen corpus, seq_len {result['seq_len']}, batch {BATCH} per "
          f"rank, medians of {result['rounds']} rounds: launch to the line of step 1 (ours and the "
          f"peer trainer, torchtitan 0.3.0's: torchrun, 2 ranks) or of the first batch (the peer "
          f"loader, torchtitan 0.3.0's: 1 process), and to the exit\n")  # fmt: skip
    print(f"{'size':<6}{'text MB':>9}{'parquet MB':>12}{'files':>7}  {'run':<32}"
          f"{'first s':>9}{'exit s':>9}{'ours streaming / this':>23}")  # fmt: skip
    for r in result["summary"]["rows"]:
        ratio = r["ours_streaming_over_this"]
        print(f"{str(r['size']) + 'x':<6}{r['text_bytes'] / 1e6:>9.1f}{r['parquet_bytes'] / 1e6:>12.1f}"
              f"{r['files']:>7}  {r['label']:<32}{r['first_s']:>9.2f}{r['exit_s']:>9.2f}"
              f"{f'{ratio:.2f}' if ratio else '-':>23}")  # fmt: skip
    warm = ", ".join(f"{s}x {w['first_s']:.2f} s" for s, w in result["warmups"].items())
    print(f"\nmap-style warm-up launches (datasets' Arrow conversion of a corpus never seen, "
          f"then the job; not in the rows above), launch to step 1: {warm}")  # fmt: skip
    growth = result["summary"]["growth"]
    high, low = growth["sizes"]
    for kind in PEERS:
        if kind in growth:
            print(f"{LABELS[kind]}, {high}x / {low}x: {growth[kind]:.2f} (no target)")
    print()
    for t in result["summary"]["targets"]:
        print(f"{'met ' if t['met'] else 'MISS'} {t['ratio']:6.2f}  {t['target']}")
    if result["peer"]["skipped"]:
        print(f"SKIP the peers: {result['peer']['skipped']}")


def main(argv=None) -> int:
    p = bench.Arguments(__doc__, smoke={"rounds": 1, "sizes": "1", "base_mb": 1.0}, rounds=2,
                        work=str(Path(tempfile.gettempdir()) / "bench_coldstart"),
                        peer=True)  # fmt: skip
    p.add_argument("--sizes", default="1,8", help="corpus sizes, in multiples of --base-mb")
    p.add_argument("--base-mb", type=float, default=20.0, help="MB of text of size 1")
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse(argv)
    work = Path(args.work).resolve()
    sizes = sorted({int(s) for s in args.sizes.split(",")})

    corpora = {}
    for size in sizes:
        text_bytes = int(size * args.base_mb * 1e6)
        corpora[size] = build_corpus(work / f"corpus-{text_bytes}", text_bytes)
        print(f"corpus {size}x: {corpora[size]['path']}, {corpora[size]['text_bytes'] / 1e6:.1f} "
              f"MB of text, {corpora[size]['documents']:,} documents", flush=True)  # fmt: skip

    warmups = {}
    for size in sizes:
        warmups[size] = ours(work, corpora[size], False, args.seq_len, f"warmup-{size}x")
        print(f"map-style warm-up {size}x (datasets' cache): {warmups[size]['first_s']:.2f} s to "
              f"step 1", flush=True)  # fmt: skip

    peer_state = {"python": args.peer_python,
                  "skipped": "" if args.peer_python else "no --peer-python"}  # fmt: skip
    if peer_state["skipped"]:
        print(f"SKIP the peers: {peer_state['skipped']}", flush=True)
    runs = {size: {kind: [] for kind in LABELS} for size in sizes}
    for n in range(args.rounds):
        for size in sizes:
            r = ours(work, corpora[size], True, args.seq_len, f"ours-{size}x-streaming-{n}")
            runs[size]["streaming"].append(r)
            print(f"round {n} {size}x ours streaming: {r['first_s']:.2f} s to step 1, "
                  f"{r['exit_s']:.2f} s to exit", flush=True)  # fmt: skip
            if not peer_state["skipped"]:
                try:
                    r = peer_trainer(work, args.peer_python, corpora[size], args.seq_len,
                                     f"peer-trainer-{size}x-{n}")  # fmt: skip
                    runs[size]["peer trainer"].append(r)
                    print(f"round {n} {size}x peer trainer: {r['first_s']:.2f} s to step 1, "
                          f"{r['exit_s']:.2f} s to exit", flush=True)  # fmt: skip
                    r = peer_loader(work, args.peer_python, corpora[size], args.seq_len,
                                    f"peer-loader-{size}x-{n}")  # fmt: skip
                    runs[size]["peer loader"].append(r)
                    print(f"round {n} {size}x peer loader: {r['first_s']:.2f} s to the first "
                          f"batch ({r['after_imports_s']:.2f} s after its imports)", flush=True)  # fmt: skip
                except bench.PeerUnavailable as e:
                    peer_state["skipped"] = str(e)
                    print(f"SKIP the peers: {e}", flush=True)
            r = ours(work, corpora[size], False, args.seq_len, f"ours-{size}x-map-{n}")
            runs[size]["map-style"].append(r)
            print(f"round {n} {size}x ours map-style: {r['first_s']:.2f} s to step 1, "
                  f"{r['exit_s']:.2f} s to exit", flush=True)  # fmt: skip

    result = {
        **bench.about(argv, commit=True), "seq_len": args.seq_len, "batch": BATCH, "rounds": args.rounds, "base_mb": args.base_mb,
        "corpora": corpora, "warmups": warmups, "runs": runs, "peer": peer_state,
        "summary": summarize(sizes, corpora, runs),
    }  # fmt: skip
    print_report(result)
    return bench.save(args, result)


if __name__ == "__main__":
    sys.exit(main())
