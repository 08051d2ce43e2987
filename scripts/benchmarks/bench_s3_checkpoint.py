"""Checkpoints on an object store against a local folder, as train.py drives CheckpointManager.

    python scripts/benchmarks/bench_s3_checkpoint.py [--flavor 125M] [--ranks 2]
                                       [--interval 4] [--saves 2] [--smoke] [--json out.json]

Starts the local S3 API of ``harness/s3.py`` (moto's server on 127.0.0.1, reached through
fsspec/s3fs and the AWS_* variables as a job reaches a bucket), then one torchrun job of
``--ranks`` CPU ranks (gloo, FSDP2) that builds the model and AdamW with the project's
builders and runs the loop's calls as train.py makes them (``wait_for_staging()`` before
the optimizer step, ``save()`` every ``interval`` steps, ``close()``), for each folder
(``local``: under the work folder; ``s3``: ``s3://<bucket>/run``) and each mode (sync,
async). Measured on rank 0:

  durable s     a save from its call until the checkpoint is complete (sync: the call;
                async: until the manifest is written, from the finalizer thread)
  blocked s     every moment the loop spent inside CheckpointManager calls, over all saves
                (sync: the whole write; async: the hand-off, staging and a wait for an
                earlier save), per save
  resume s      a new manager's load() of the newest checkpoint: listing, verification
                (CRC32 locally, ETags on the store), DCP's read

The local server is one Python process on this machine: its figures bound the client's
overhead (requests, no rename), not a real bucket's bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan

from harness import bench
from torchtitan import REPO_ROOT
from torchtitan.tools.launch import run_env, torchrun_command

VOCAB = {"debugmodel": 4096, "125M": 32000}


def rank_main(args) -> dict:
    """One rank of the measured job (run under torchrun)."""
    import torch
    import torch.nn.functional as F

    from torchtitan import parallel
    from torchtitan.checkpoint import CheckpointManager, TrainState
    from torchtitan.checkpoint.stateful import training_components
    from torchtitan.config import parse_args
    from torchtitan.models import build_model, count_parameters
    from torchtitan.optim import build_lr_scheduler, build_optimizer

    logging.getLogger("torchtitan").setLevel(logging.WARNING)
    if args.single_put_mib:  # the writers made from here on read it
        from torchtitan.checkpoint import store_writer

        store_writer.SINGLE_PUT_MAX = args.single_put_mib << 20
    dims = parallel.init_distributed()
    torch.manual_seed(0)
    vocab = VOCAB[args.flavor]
    model = build_model(args.flavor, vocab, device="meta")
    params = count_parameters(model)
    model = parallel.parallelize(model, parse_args([]), dims)  # FSDP, as train.py does
    tokens = torch.randint(
        0, vocab, (1, args.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    rows = []
    for where, folder in (("local", os.path.join(args.root, "local")), ("s3", args.url)):
        for mode in ("disabled", "async"):
            target = f"{folder}/{mode}"
            cfg = parse_args([
                "--job.dump_folder", os.path.join(args.root, "dump"),
                "--checkpoint.folder", target,
                "--checkpoint.enable_checkpoint", "--checkpoint.async_mode", mode,
                "--checkpoint.interval", str(args.interval), "--checkpoint.keep_latest_k", "1",
                "--training.steps", str(args.interval * args.saves),
                "--lr_scheduler.warmup_steps", "1",
            ])  # fmt: skip
            optimizer = build_optimizer(model, cfg)
            scheduler = build_lr_scheduler(optimizer, cfg)

            def manager_for(state, cfg=cfg, optimizer=optimizer, scheduler=scheduler):
                components = training_components(cfg, dims, model=model, optimizer=optimizer,
                                                 lr_scheduler=scheduler, train_state=state,
                                                 fingerprint={})  # fmt: skip
                return CheckpointManager(cfg, dims, components, fingerprint={})

            state = TrainState()
            manager = manager_for(state)
            blocked, durable, steps_s, writers = 0.0, [], [], []
            capturing = contextlib.ExitStack()
            capturing.enter_context(capture_writers(writers))
            while state.step < cfg.training.steps:
                begin = time.perf_counter()
                logits = model(tokens[:, :-1])
                F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
                t = time.perf_counter()
                manager.wait_for_staging()
                blocked += time.perf_counter() - t
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                state.step += 1
                steps_s.append(time.perf_counter() - begin)
                if manager.should_save(state.step):
                    t = time.perf_counter()
                    manager.save(state.step)
                    blocked += time.perf_counter() - t
                    durable.append(time.perf_counter() - t)
            manager.close()
            capturing.close()
            if mode == "async":  # the last save, from its call until its manifest is written
                durable = [manager.saver.last_write_s]
            upload = {}
            if where == "s3":  # the limit of the upload, in the same run: a parallel PUT
                upload = upload_limit(dims, target, args.interval * args.saves)
                # the store writer's own time (serialize and upload, write_data) in the last save
                last = [w.stats.get("seconds", 0.0) for w in writers[-1:] if hasattr(w, "stats")]
                upload["writer_s"] = max(parallel.all_gather_objects(dims, sum(last)))
            resumed = TrainState()
            again = manager_for(resumed)
            readers = []
            parallel.barrier(dims)
            t, began = time.perf_counter(), time.time()
            with capture_readers(readers):
                again.load()
            resume_s = time.perf_counter() - t
            windows = {"resume": (began, time.time())}
            again.close()
            assert resumed.step == state.step, "the resume must load the last save"
            extra = {}
            if where == "s3" and mode == "disabled" and not args.upload_only:
                # the old reader and the read limits, once
                extra = against_the_limit(dims, lambda: manager_for(TrainState()), readers,
                                          windows, not args.no_fsspec_reader)  # fmt: skip
            rows.append({**extra, **upload, "windows": windows,
                "flavor": args.flavor, "parameters": params, "ranks": dims.world_size,
                "folder": where, "mode": "sync" if mode == "disabled" else "async",
                "interval": args.interval, "saves": args.saves,
                "durable_s": statistics.median(durable),
                "blocked_per_save_s": blocked / args.saves,
                "resume_s": resume_s, "median_step_s": statistics.median(steps_s),
            })  # fmt: skip
    parallel.destroy_distributed()
    return rows


@contextlib.contextmanager
def capture_readers(readers: list):
    """The store readers the manager makes (their figures: bytes, requests, spans)."""
    from torchtitan.checkpoint.store import ObjectStore

    make = ObjectStore.reader

    def reader(self, path, manifest=None):
        readers.append(make(self, path, manifest))
        return readers[-1]

    ObjectStore.reader = reader
    try:
        yield
    finally:
        ObjectStore.reader = make


@contextlib.contextmanager
def capture_writers(writers: list):
    """The store writers the manager makes (their figures: objects, requests, seconds)."""
    from torchtitan.checkpoint.store import ObjectStore

    make = ObjectStore.writer

    def writer(self, path):
        writers.append(make(self, path))
        return writers[-1]

    ObjectStore.writer = writer
    try:
        yield
    finally:
        ObjectStore.writer = make


@contextlib.contextmanager
def fsspec_reader():
    """The manager's load through DCP's FsspecReader (the reader before store_reader.py)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    from torchtitan.checkpoint.store import ObjectStore

    make = ObjectStore.reader
    ObjectStore.reader = lambda self, path, manifest=None: FsspecReader(path)
    try:
        yield
    finally:
        ObjectStore.reader = make


def fetch_all(requests: list, threads: int, into: bool = False) -> float:
    """Seconds to fetch ``requests`` ((bucket, key, start, end or None)) with ``threads``
    parallel GETs on one botocore client, reading each body whole and nothing else: with
    botocore's ``read()`` (a new bytes object per body, its checksum checked where the
    server sent one), or, ``into``, received from the socket into a buffer each thread
    reuses (``http.client``'s ``readinto`` under botocore's body; no checksum checked;
    the buffers made and written once before the clock starts: the transfer alone)."""
    import queue

    import botocore.config
    import botocore.session

    client = botocore.session.get_session().create_client(
        "s3", config=botocore.config.Config(max_pool_connections=threads)
    )
    buffers: queue.SimpleQueue = queue.SimpleQueue()
    largest = max((end - start for _, _, start, end in requests if end is not None), default=0)
    for _ in range(threads if into else 0):
        buffers.put(bytearray(largest))

    def get(request):
        bucket, key, start, end = request
        ranged = {} if end is None else {"Range": f"bytes={start}-{end - 1}"}
        reply = client.get_object(Bucket=bucket, Key=key, **ranged)
        body, size = reply["Body"], reply["ContentLength"]
        if not into:
            return len(body.read())
        stream, buffer = body._raw_stream._fp, buffers.get()  # http.client's response
        if len(buffer) < size:  # a whole object (no range): larger than any span
            buffer = bytearray(size)
        view, n = memoryview(buffer)[:size], 0
        while n < size:
            got = stream.readinto(view[n : n + (8 << 20)])
            assert got, f"{key}: the body ended at {n} of {size} bytes"
            n += got
        if stream.isclosed():  # its connection serves the next GET, as the reader's does
            body._raw_stream.release_conn()
        body.close()
        del view
        buffers.put(buffer)
        return n

    begin = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(get, requests))
    return time.perf_counter() - begin


def put_all(bucket: str, prefix: str, size: int, threads: int) -> float:
    """Seconds to write ``size`` bytes as 64 MiB objects (single PUTs) with ``threads``
    parallel requests: the upload's limit on this server."""
    import botocore.config
    import botocore.session

    client = botocore.session.get_session().create_client(
        "s3", config=botocore.config.Config(max_pool_connections=threads, read_timeout=900)
    )
    part = 64 << 20
    body = bytes(part)

    def put(i):
        n = min(part, size - i * part)
        client.put_object(Bucket=bucket, Key=f"{prefix}/{i}", Body=body[:n])

    begin = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, range(-(-size // part))))
    return time.perf_counter() - begin


def upload_limit(dims, folder: str, step: int) -> dict:
    """This rank's bytes of ``folder``'s ``step-N`` (the files it wrote), written again by
    a plain parallel client (16 threads of single 64 MiB PUTs), every rank at once: the
    upload's limit, measured right after the saves it is set against."""
    from torchtitan import parallel
    from torchtitan.checkpoint.store import store_for as store_for_url

    url = f"{folder}/step-{step}"
    store = store_for_url(url)
    own = f"__{dims.rank}_"
    names = [n for n in store.listdir(url) if n.startswith(own)]
    size = sum(store.size(f"{url}/{n}") for n in names)
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    parallel.barrier(dims)
    seconds = put_all(bucket, f"put-limit/{dims.rank}", size, 16)
    parallel.barrier(dims)
    return {"limit_put_s": max(parallel.all_gather_objects(dims, seconds)),
            "own_bytes": parallel.all_gather_objects(dims, size),
            "own_objects": parallel.all_gather_objects(dims, len(names)),
            "load": os.getloadavg()[0]}  # fmt: skip


def against_the_limit(dims, make_manager, readers, windows, fsspec: bool = True) -> dict:
    """The same load through DCP's fsspec reader (unless not ``fsspec``), and the limit:
    this rank's bytes fetched by a plain parallel client (16 threads) as the reader's own
    spans, as 16 MiB ranged GETs, and as whole objects; every rank at once, each phase
    between barriers."""
    from torchtitan import parallel
    from torchtitan.checkpoint.store import store_for as store_for_url

    def timed(name, run):
        parallel.barrier(dims)
        began = time.time()
        seconds = run()
        parallel.barrier(dims)
        windows[name] = (began, time.time())
        return max(parallel.all_gather_objects(dims, seconds))

    def load_old():
        manager = make_manager()
        t = time.perf_counter()
        with fsspec_reader():
            manager.load()
        seconds = time.perf_counter() - t
        manager.close()
        return seconds

    reader = readers[-1]
    bucket, prefix = reader.bucket, reader.prefix
    spans = [(bucket, f"{prefix}/{f}", a, b) for f, a, b in reader.stats["spans"]]
    parts = [(bucket, k, a, min(b, a + (16 << 20))) for bucket, k, s, e in spans
             for a in range(s, e, 16 << 20) for b in [e]]  # fmt: skip
    whole = sorted({(bucket, k, 0, None) for _, k, _, _ in spans})
    stats = {k: v for k, v in reader.stats.items() if k != "spans"}
    own = f"__{dims.rank}_"  # the bytes this rank uploaded: its own files
    stats["needed_own"] = sum(
        store_for_url(f"s3://{bucket}/{prefix}").size(f"s3://{bucket}/{prefix}/{name}")
        for name in store_for_url(f"s3://{bucket}/{prefix}").listdir(f"s3://{bucket}/{prefix}")
        if name.startswith(own)
    )
    old = {"resume_fsspec_s": timed("resume_fsspec", load_old)} if fsspec else {}
    return {
        "reader": parallel.all_gather_objects(dims, stats),
        **old,
        "limit_spans_s": timed("limit_spans", lambda: fetch_all(spans, 16)),
        "limit_spans_into_s": timed("limit_spans_into", lambda: fetch_all(spans, 16, True)),
        "limit_16mib_s": timed("limit_16mib", lambda: fetch_all(parts, 16)),
        "limit_whole_s": timed("limit_whole", lambda: fetch_all(whole, 16)),
    }


@contextlib.contextmanager
def held_link(gbit: float):
    """The loopback held to ``gbit`` Gbit/s for the job (a token bucket: ``tc qdisc add
    dev lo root tbf``), so that a link, not the 2 cores the server and the client share,
    bounds the transfer, as a NIC does between a host and S3; removed at the end. Needs
    root and tc; refused with one line where the loopback already has a qdisc (another
    run's)."""
    if not gbit:
        yield
        return
    shown = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
    if shown.returncode != 0 or "noqueue" not in shown.stdout:
        raise SystemExit(f"bench_s3_checkpoint: --link-gbit needs tc and a loopback with no "
                         f"qdisc of its own ({(shown.stdout + shown.stderr).strip()}); a run "
                         "killed before its end leaves one: tc qdisc del dev lo root")  # fmt: skip
    held = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{gbit}gbit",
            "burst", "1mb", "latency", "50ms"]  # fmt: skip
    added = subprocess.run(held, capture_output=True, text=True)
    if added.returncode != 0:
        raise SystemExit(f"bench_s3_checkpoint: {' '.join(held)}: {added.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)


def run_job(args, root: Path, url: str) -> list[dict]:
    out = root / "result.json"
    argv = ["--rank-main", "--flavor", args.flavor, "--interval", str(args.interval),
            "--saves", str(args.saves), "--seq-len", str(args.seq_len), "--root", str(root),
            "--url", url, "--json", str(out), "--single-put-mib", str(args.single_put_mib)
            ] + (["--upload-only"] if args.upload_only else []) + (
                ["--no-fsspec-reader"] if args.no_fsspec_reader else [])  # fmt: skip
    env = {**run_env(), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.ranks))}
    script = "scripts/benchmarks/bench_s3_checkpoint.py"
    proc = subprocess.run(torchrun_command(args.ranks, argv, script=script), cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
    return json.loads(out.read_text())


def main(argv=None) -> int:
    p = bench.Arguments(__doc__, smoke={"flavor": "debugmodel", "ranks": 2, "saves": 2,
                                        "interval": 2}, work="")  # fmt: skip
    p.add_argument("--flavor", default="125M", choices=sorted(VOCAB))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--saves", type=int, default=2)
    p.add_argument("--interval", type=int, default=4, help="steps between saves")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument(
        "--upload-only",
        action="store_true",
        help="skip DCP's fsspec reader and the read limits (the upload's figures)",
    )
    p.add_argument("--no-fsspec-reader", action="store_true",
                   help="the read limits without DCP's fsspec reader (minutes of GETs)")  # fmt: skip
    p.add_argument("--single-put-mib", type=int, default=0,
                   help="the store writer's largest single PUT (MiB; 0: its own default)")  # fmt: skip
    p.add_argument("--link-gbit", type=float, default=0,
                   help="hold the loopback to this many Gbit/s (up to 8: a 1 MB burst) "
                        "during the job, gloo's traffic too (tc, root)")  # fmt: skip
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", default="", help=argparse.SUPPRESS)
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    args = p.parse(argv)
    if args.rank_main:
        rows = rank_main(args)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    from harness.s3 import Traffic, local_s3, missing

    reason = missing()
    if reason:
        raise SystemExit(f"bench_s3_checkpoint: {reason}")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    # The local server joins a multipart upload's parts in Python: on a busy 2-core machine
    # completing a 700 MB object outlasts botocore's 60 s read timeout, and the retry finds
    # the upload gone. The ranks' clients (fsspec's per-protocol config, read from the
    # environment) wait longer; a real bucket needs nothing of the kind.
    os.environ["FSSPEC_S3"] = json.dumps({"config_kwargs": {"read_timeout": 900}})
    traffic = Traffic(log=[])
    with bench.work_folder(args, "bench_s3_ckpt_") as root, local_s3(traffic) as (bucket, _):
        with held_link(args.link_gbit):
            rows = run_job(args, root, f"s3://{bucket}/run")
        sizes = checkpoint_bytes(bucket, rows)
    for row in rows:
        row["link_gbit"] = args.link_gbit
    for row in rows:  # what the server sent in each timed phase (its GETs, counted there)
        row["checkpoint_bytes"] = sizes[(row["folder"], row["mode"])]
        row["sent"] = {name: traffic.sent(*window) for name, window in row.pop("windows").items()}
    header = ["flavor", "params", "ranks", "folder", "mode", "interval s", "durable s",
              "blocked s / save", "resume s"]  # fmt: skip
    bench.print_table(header, [
        [r["flavor"], f"{r['parameters']:,}", r["ranks"], r["folder"], r["mode"],
         f"{r['interval'] * r['median_step_s']:.2f}", f"{r['durable_s']:.2f}",
         f"{r['blocked_per_save_s']:.3f}", f"{r['resume_s']:.2f}"]
        for r in rows])  # fmt: skip
    report_limit(rows)
    report_upload(rows)
    return bench.save(args, {"rows": rows})


def checkpoint_bytes(bucket: str, rows: list) -> dict:
    """Bytes of the newest checkpoint's files in each folder (local: on disk)."""
    import s3fs

    fs, sizes = s3fs.S3FileSystem(), {}
    for r in rows:
        mode = "disabled" if r["mode"] == "sync" else "async"
        if r["folder"] == "s3":
            sizes[("s3", r["mode"])] = sum(
                info["size"] for info in fs.find(f"{bucket}/run/{mode}", detail=True).values()
                if f"step-{r['interval'] * r['saves']}/" in info["name"])  # fmt: skip
        else:
            sizes[("local", r["mode"])] = None
    return sizes


def report_limit(rows: list):
    """The resume against the local folder's and the limit, side by side (one run)."""
    local = next(r for r in rows if r["folder"] == "local" and r["mode"] == "sync")
    for r in rows:
        if "limit_spans_s" not in r:
            continue
        needed = sum(s["needed"] for s in r["reader"])
        fetched = sum(s["fetched"] for s in r["reader"])
        requests = sum(s["requests"] for s in r["reader"])
        new, old = r["sent"]["resume"], r["sent"].get("resume_fsspec")
        fsspec_s = r.get("resume_fsspec_s")
        print(
            f"\nresume of a {r['checkpoint_bytes'] / 1e6:.0f} MB checkpoint at {r['ranks']} "
            f"rank(s)"
            + (f", the loopback held to {r['link_gbit']:g} Gbit/s" if r.get("link_gbit") else "")
            + f": store reader {r['resume_s']:.2f} s, DCP's fsspec reader "
            + (f"{fsspec_s:.2f} s" if fsspec_s else "not run")
            + f", local folder {local['resume_s']:.2f} s"
        )
        print(
            f"  limit (16 threads): the reader's spans {r['limit_spans_s']:.2f} s (received "
            f"into reused buffers {r['limit_spans_into_s']:.2f} s), 16 MiB "
            f"ranges {r['limit_16mib_s']:.2f} s, whole objects {r['limit_whole_s']:.2f} s"
        )
        best = min(r["limit_spans_s"], r["limit_16mib_s"], r["limit_whole_s"],
                   r["limit_spans_into_s"])  # fmt: skip
        print(
            f"  store reader / limit (spans) {r['resume_s'] / r['limit_spans_s']:.2f}, "
            f"/ limit (spans into buffers) {r['resume_s'] / r['limit_spans_into_s']:.2f}, "
            f"/ best limit {r['resume_s'] / best:.2f}, / local {r['resume_s'] / local['resume_s']:.2f}"
            + (f"; fsspec reader / local {fsspec_s / local['resume_s']:.2f}" if fsspec_s else "")
        )
        print(
            f"  store reader: {requests} ranged GETs, {fetched / 1e6:.1f} MB fetched for "
            f"{needed / 1e6:.1f} MB needed ({fetched / max(1, needed):.3f}x); server sent "
            f"{new[1] / 1e6:.1f} MB in {new[0]} GETs (metadata included)"
            + (f"; fsspec reader: server sent {old[1] / 1e6:.1f} MB in {old[0]} GETs "
               f"({old[1] / r['checkpoint_bytes']:.2f}x the checkpoint)" if old else "")
        )  # fmt: skip


def report_upload(rows: list):
    """Each save to the store against a parallel PUT of the same bytes, measured after it."""
    for r in rows:
        if "limit_put_s" in r:
            print(
                f"upload ({r['mode']} save, {r['ranks']} rank(s), {sum(r['own_bytes']) / 1e6:.0f} MB "
                f"in {sum(r['own_objects'])} objects) {r['durable_s']:.2f} s against a parallel "
                f"PUT of the same bytes (16 threads, 64 MiB objects) {r['limit_put_s']:.2f} s: "
                f"{r['durable_s'] / r['limit_put_s']:.2f}; the writer's write_data (last save, "
                f"slowest rank) {r['writer_s']:.2f} s: {r['writer_s'] / r['limit_put_s']:.2f} "
                f"(load average {r['load']:.1f})"
            )


if __name__ == "__main__":
    sys.exit(main())
