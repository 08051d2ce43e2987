"""The first start on a never-seen corpus: launch to step 1 as the corpus grows, side by
side with torchtitan 0.3.0's first batch.

    python scripts/bench_coldstart.py [--peer-python /path/to/venv/bin/python] [--work DIR]
        [--rounds 2] [--sizes 1,8] [--base-mb 20] [--seq-len 128] [--json out.json]

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

The peer is torchtitan 0.3.0's ``HuggingFaceTextDataset`` over the same parquet files
(``load_dataset(..., streaming=True)``) in its ``ParallelAwareDataloader``, rank 0 of 2,
batch 4, seq_len --seq-len, reading the bundled SentencePiece model through
bench_streaming.py's adapter (its ``PEER_SETUP``), in one fresh process of
--peer-python (a virtual environment where ``import torchtitan`` is 0.3.0; this script
installs nothing, and skips the peer, saying why, when it cannot import it). Timed from
the launch to the line it prints after its first batch.

Rounds (--rounds): per size, ours streaming, the peer, ours map-style; medians. Targets:
ours, largest size / smallest <= 1.2 (streaming and map-style); ours / peer <= 1.5
(streaming).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
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

REPO = Path(__file__).resolve().parents[1]
# bench_streaming imports torchtitan: this checkout's, the one whose train.py is measured,
# not whichever checkout is installed (its data package may be mid-change).
sys.path.insert(1, str(REPO))
from bench_streaming import PEER_SETUP, PeerUnavailable  # noqa: E402

CONFIG = "train_configs/debug_model.toml"
TOKENIZER = REPO / "data" / "tokenizer" / "tokenizer.model"  # debug_model.toml's
DOMAINS = ("shakespeare", "milton", "kjv")
FILES, ROW_GROUP, BATCH = 64, 64, 4
LAUNCH_TIMEOUT_S = 3600
STEP_1 = re.compile(r"\bstep\s+1\s+loss\b")  # the job's metrics line of step 1
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
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = folder / "DONE.json"
    if done.exists():
        return json.loads(done.read_text())
    shutil.rmtree(folder, ignore_errors=True)
    data = folder / "data"
    data.mkdir(parents=True)
    pools = {d: bundled_texts(d) for d in DOMAINS}
    documents, groups = 0, 0
    for f in range(FILES):
        domain = DOMAINS[f % len(DOMAINS)]
        rows = list(file_documents(f, pools[domain], domain, text_bytes // FILES))
        table = pa.table({"id": [r[0] for r in rows], "text": [r[1] for r in rows]})
        path = data / f"part-{f:03d}.parquet"
        pq.write_table(table, path, row_group_size=ROW_GROUP)
        documents, groups = documents + len(rows), groups + pq.ParquetFile(path).num_row_groups
    info = {"path": str(data), "files": FILES, "documents": documents, "row_groups": groups,
            "text_bytes": text_bytes // FILES * FILES,
            "parquet_bytes": sum(p.stat().st_size for p in data.glob("*.parquet"))}  # fmt: skip
    done.write_text(json.dumps(info))
    return info


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
    """One thread per process; torchtitan's and datasets' caches under --work, offline."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TORCHTITAN_CACHE": str(cache), "HF_HOME": str(work / "hf"),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    env.pop("PYTHONPATH", None)
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


def peer(work: Path, python: str, corpus: dict, seq_len: int, label: str) -> dict:
    """One fresh process of the peer to its first batch on ``corpus``, streaming."""
    files = sorted(str(p) for p in Path(corpus["path"]).glob("*.parquet"))
    args = {"files": files, "seq_len": seq_len, "batch": BATCH, "tokenizer": str(TOKENIZER),
            "repo": str(REPO)}  # fmt: skip
    run = fresh(work / "runs" / label)
    # From the run's folder, so that this repository's torchtitan is not on the path.
    result = timed_launch([python, "-c", PEER_FIRST_BATCH, json.dumps(args)], run,
                          job_env(work, fresh(run / "cache")), FIRST_BATCH, run / "log")  # fmt: skip
    tail = result.pop("tail")
    if "SKIP" in tail:
        raise PeerUnavailable(tail.split("SKIP", 1)[1].strip())
    if result["returncode"] != 0 or result["first_s"] is None:
        raise SystemExit(f"the peer failed (exit {result['returncode']}):\n{tail}")
    return result | json.loads(result["line"].split("FIRST", 1)[1])


# ---- report ----------------------------------------------------------------------------


def median(runs: list[dict], key: str = "first_s"):
    return statistics.median(r[key] for r in runs) if runs else None


def summarize(sizes: list[int], corpora: dict, runs: dict) -> dict:
    """The table's rows, the ratios between the largest size and the smallest, and the
    targets, each as measured."""
    rows = []
    for size in sizes:
        peer_s = median(runs[size]["peer"])
        for mode in ("streaming", "map-style"):
            o, p = median(runs[size][mode]), peer_s if mode == "streaming" else None
            rows.append({"size": size, "mode": mode, **{k: corpora[size][k] for k in
                         ("text_bytes", "parquet_bytes", "files", "documents", "row_groups")},
                         "ours_first_step_s": o, "ours_exit_s": median(runs[size][mode], "exit_s"),
                         "peer_first_batch_s": p, "ours_over_peer": o / p if p else None,
                         "ours_runs_s": [r["first_s"] for r in runs[size][mode]],
                         "peer_runs_s": [r["first_s"] for r in runs[size]["peer"]]
                         if mode == "streaming" else []})  # fmt: skip
    low, high = min(sizes), max(sizes)
    growth = {}
    for side in ("streaming", "map-style", "peer") if high > low else ():
        if runs[high][side] and runs[low][side]:
            growth[side] = median(runs[high][side]) / median(runs[low][side])
    targets = [{"target": f"ours {mode}, {high}x / {low}x <= {TARGET_GROWTH}", "ratio": ratio,
                "met": ratio <= TARGET_GROWTH}
               for mode, ratio in growth.items() if mode != "peer"]  # fmt: skip
    for r in rows:
        if r["ours_over_peer"]:
            targets.append({"target": f"ours / peer, streaming, {r['size']}x <= {TARGET_PEER}",
                            "ratio": r["ours_over_peer"],
                            "met": r["ours_over_peer"] <= TARGET_PEER})  # fmt: skip
    return {"rows": rows, "growth": {"sizes": [high, low], **growth}, "targets": targets}


def print_report(result: dict):
    print(f"\nfirst start, launch to step 1 (ours: torchrun, 2 ranks) and to the first batch "
          f"(peer: torchtitan 0.3.0, 1 process), seq_len {result['seq_len']}, batch {BATCH}, "
          f"medians of {result['rounds']} rounds\n")  # fmt: skip
    print(f"{'size':<6}{'text MB':>9}{'parquet MB':>12}{'files':>7}  {'mode':<11}"
          f"{'ours first-step s':>19}{'peer first-batch s':>20}{'ours/peer':>11}{'ours exit s':>13}")  # fmt: skip
    for r in result["summary"]["rows"]:
        peer_s = f"{r['peer_first_batch_s']:.2f}" if r["peer_first_batch_s"] else "-"
        ratio = f"{r['ours_over_peer']:.2f}" if r["ours_over_peer"] else "-"
        print(f"{str(r['size']) + 'x':<6}{r['text_bytes'] / 1e6:>9.1f}{r['parquet_bytes'] / 1e6:>12.1f}"
              f"{r['files']:>7}  {r['mode']:<11}{r['ours_first_step_s']:>19.2f}{peer_s:>20}"
              f"{ratio:>11}{r['ours_exit_s']:>13.2f}")  # fmt: skip
    warm = ", ".join(f"{s}x {w['first_s']:.2f} s" for s, w in result["warmups"].items())
    print(f"\nmap-style warm-up launches (datasets' Arrow conversion of a corpus never seen, "
          f"then the job; not in the rows above), launch to step 1: {warm}")  # fmt: skip
    growth = result["summary"]["growth"]
    if "peer" in growth:
        high, low = growth["sizes"]
        print(f"peer streaming, {high}x / {low}x: {growth['peer']:.2f} (no target)")
    print()
    for t in result["summary"]["targets"]:
        print(f"{'met ' if t['met'] else 'MISS'} {t['ratio']:6.2f}  {t['target']}")
    if result["peer"]["skipped"]:
        print(f"SKIP the peer: {result['peer']['skipped']}")


def git_commit() -> str:
    proc = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO,
                          capture_output=True, text=True)  # fmt: skip
    return proc.stdout.strip()


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "bench_coldstart"),
                   help="where the corpora (kept), the jobs' folders and caches go")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sizes", default="1,8", help="corpus sizes, in multiples of --base-mb")
    p.add_argument("--base-mb", type=float, default=20.0, help="MB of text of size 1")
    p.add_argument("--peer-python", default="", help="python of a venv with torchtitan 0.3.0")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
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
        print(f"SKIP the peer: {peer_state['skipped']}", flush=True)
    runs = {size: {"streaming": [], "map-style": [], "peer": []} for size in sizes}
    for n in range(args.rounds):
        for size in sizes:
            r = ours(work, corpora[size], True, args.seq_len, f"ours-{size}x-streaming-{n}")
            runs[size]["streaming"].append(r)
            print(f"round {n} {size}x ours streaming: {r['first_s']:.2f} s to step 1, "
                  f"{r['exit_s']:.2f} s to exit", flush=True)  # fmt: skip
            if not peer_state["skipped"]:
                try:
                    r = peer(work, args.peer_python, corpora[size], args.seq_len,
                             f"peer-{size}x-{n}")  # fmt: skip
                    runs[size]["peer"].append(r)
                    print(f"round {n} {size}x peer streaming: {r['first_s']:.2f} s to the first "
                          f"batch ({r['after_imports_s']:.2f} s after its imports)", flush=True)  # fmt: skip
                except PeerUnavailable as e:
                    peer_state["skipped"] = str(e)
                    print(f"SKIP the peer: {e}", flush=True)
            r = ours(work, corpora[size], False, args.seq_len, f"ours-{size}x-map-{n}")
            runs[size]["map-style"].append(r)
            print(f"round {n} {size}x ours map-style: {r['first_s']:.2f} s to step 1, "
                  f"{r['exit_s']:.2f} s to exit", flush=True)  # fmt: skip

    result = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.date.today().isoformat(), "commit": git_commit(),
        "machine": f"{os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}",
        "seq_len": args.seq_len, "batch": BATCH, "rounds": args.rounds, "base_mb": args.base_mb,
        "corpora": corpora, "warmups": warmups, "runs": runs, "peer": peer_state,
        "summary": summarize(sizes, corpora, runs),
    }  # fmt: skip
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
