"""Benchmarks are not tests: each runs here in smoke mode, and what it reports must make sense
(speeds positive, ratios finite, the state it claims to measure actually in effect), with
the machine it ran on and how much of it other processes used meanwhile
(``harness/machine.py``, which also gives the test session's header line).

The smoke runs start several processes each, so they are in the ``slow`` tier (CI runs
it as its second command); the checks' own negative controls run in the fast tier."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import REPO

from harness import bench, machine

BENCHMARKS = REPO / "scripts" / "benchmarks"
# Results whose rows are what the check reads: the first row, or (s3_checkpoint) all.
FIRST_ROW = {"bench_attention.py", "bench_checkpoint.py", "bench_tp_loader.py"}


def positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def check_data(r: dict):
    assert positive(r["raw_encode_tokens_per_s"], r["workers0_tokens_per_s"],
                    r["workers2_tokens_per_s"], r["streaming_workers0_tokens_per_s"])  # fmt: skip
    assert r["workers0_over_raw"] == r["workers0_tokens_per_s"] / r["raw_encode_tokens_per_s"]
    assert 0 < r["workers0_over_raw"] < 1.5, "the pipeline cannot out-tokenize the tokenizer"
    assert all(0 < b <= 1024 for b in r["state_bytes_per_rank"].values()), (
        "a position (a few integers), not tokens"
    )


def check_resume(r: dict):
    assert positive(r["median_1pct_s"], r["median_99pct_s"], r["ratio_99_over_1"])
    first = r["first_document"]
    assert first["1%"] != first["99%"], "the 99% state was not applied"


def check_step(r: dict):
    assert r["checkpoints_written"] > 0, "the 'on' run must actually checkpoint"
    assert positive(r["median_step_ms_checkpoint_off"], r["median_step_ms_checkpoint_on"])
    assert 0 <= r["median_data_wait_share"] <= 1
    assert 0 < r["stop_check_share"] < 1, "the 2-rank job pays for its stop agreement"
    check_step_vs_peer(r["step_vs_peer"])


def check_step_vs_peer(r: dict):
    assert r["parameters"]["ours"] == 7_212_288, "the peer's debugmodel shapes at vocab 4096"
    assert positive(*r["median_step_ms"].values(), *r["median_cpu_step_ms"].values())
    if "peer" in r["step_ms"]:
        assert r["parameters"]["peer"] == r["parameters"]["ours"], "the same model on both sides"
        assert r["ours_over_peer"] == r["median_step_ms"]["ours"] / r["median_step_ms"]["peer"]
    else:
        assert r["peer_skipped"], "a skipped peer says why"


def check_checkpoint(r: dict):
    assert positive(r["sync_save_s"], r["checkpoint_mb"], r["integrity_s"])
    assert r["async_blocked_s"] < r["sync_blocked_s"], "async must block the loop less than sync"
    assert 0 < r["integrity_over_save"] < 1, "checksumming is part of the save"


def check_attention(r: dict):
    assert r["flavor"] == "debugmodel", r["flavor"]
    assert positive(r["causal_ms"], r["block_causal_ms"]), "attention times must be positive"
    assert r["block_over_causal"] == r["block_causal_ms"] / r["causal_ms"]


def check_pretokenized(r: dict):
    assert positive(
        r["on_the_fly_tokens_per_s"], r["pretokenized_tokens_per_s"], r["pretokenize_s"]
    )
    assert r["same_batches"] is True, "the pretokenized corpus must yield the original's batches"
    assert r["pretokenized_over_on_the_fly"] == (
        r["pretokenized_tokens_per_s"] / r["on_the_fly_tokens_per_s"]
    )
    assert r["pretokenized_over_on_the_fly"] > 1, "reading stored ids must beat tokenizing"
    assert r["corpus_tokens"] > 0 and r["corpus_documents"] > 0


def check_streaming(r: dict):
    for row in r["rows"]:
        assert positive(row["ours_tokens_per_s"]), row
        if row["peer_tokens_per_s"] is not None:
            assert row["ours_over_peer"] == row["ours_tokens_per_s"] / row["peer_tokens_per_s"]
        if row["streaming"]:
            assert row["units"] >= 1, "streaming reads units"
    assert r["peer"]["skipped"] or r["peer"]["tokens_match"], "the peer must tokenize as we do"
    for fmt, resume in r["resume"].items():
        assert positive(resume["median_1pct_s"], resume["median_99pct_s"])
        assert resume["ratio_99_over_1"] == resume["median_99pct_s"] / resume["median_1pct_s"]
        first, decoded = resume["first_document"], resume["rows_decoded"]
        assert first["1%"] != first["99%"], f"{fmt}: the 99% state was not applied"
        # A block or a few where the position lies, never the rows before it.
        late = 0.99 * resume["corpus"]["documents"]
        assert 0 < decoded["99%"] < late / 4, f"{fmt}: a late resume re-reads the data"
    for side in r.get("resume_side_by_side", {}).values():
        assert positive(side["ours_s"]), side
    for target in r["summary"]["targets"]:
        bound = float(target["target"].rsplit(" ", 1)[1])
        at_most = "<=" in target["target"]
        assert target["met"] == (target["ratio"] <= bound if at_most else target["ratio"] >= bound)


def check_startup(r: dict):
    for row in r["results"]:
        mine, alone = row["per_rank"], row["baseline_resolving_alone"]
        assert positive(mine["seconds"], mine["bytes_read"]) and mine["files_opened"] >= 1
        assert alone["files_opened"] == r["files"], "resolving alone opens every file"
        if row["ranks"] > 1:
            assert mine["files_opened"] < alone["files_opened"], "a rank opens its share only"
            first = row["per_rank_first_start"]
            assert first["files_opened"] < alone["files_opened"], "it measures its share only"


def check_tp_loader(r: dict):
    assert r["batches"] > 0
    for mode in ("build", "broadcast"):
        m = r[mode]
        times = m["tp0_ms_per_batch"], m["peer_ms_per_batch"], m["group_cpu_ms_per_batch"]
        assert positive(*times), f"{mode}: every time per batch must be positive"


def check_gpu_check(r: dict):
    assert r["checks"] and all(c["ok"] is True for c in r["checks"]), r["checks"]
    seed = next(c for c in r["checks"] if c["name"] == "seed plan")
    steps = seed["result"].split(" of ")
    assert steps[0] == steps[1].split()[0], "every step of the seed plan is bit-equal"
    steady = next(c for c in r["checks"] if c["name"] == "steady step")
    assert "syncs a step: 0 (not logging)" in steady["result"], steady
    for row in r["rows"]:
        if row["backend"] == "sdpa":
            assert positive(row["tokens_per_s"], row["peak_gib"]), row
        elif r["smoke"]:
            assert row["note"].startswith("not run: CPU"), row


def check_order(r: dict):
    mix = r["mix"]
    for world in (1, 2):
        lanes, one = mix[f"lanes, {world} ranks"], mix[f"one lane (control), {world} ranks"]
        assert lanes["files_per_step_median"] > one["files_per_step_median"], mix
    assert positive(r["memory"]["peak_mb"]) and r["memory"]["units_asked"] < r["memory"]["units"]
    assert positive(r["throughput"]["ours"]["median"])


def check_ft(r: dict):
    live, restart = r["live"], r["restart"]
    assert positive(live["death_to_next_commit_s"], live["launch_to_first_commit_s"],
                    live["quorum_ms_median"], live["step_ms_median"],
                    restart["kill_to_first_step_s"], restart["step_ms_median"])  # fmt: skip
    assert live["heal_s"] is not None and live["heal_s"] > 0, "the joiner must have healed"
    assert restart["steps_trained_again"] >= 0


def check_ft_sim(r: dict):
    sim = r["simulation"]
    assert sim["committed"] == sim["steps"], "every step committed and checked"
    assert sim["deaths"] > 0 and sim["uncommitted"] > 0, "the run went through faults"
    assert positive(sim["rewind_us_median"], r["split"]["unchanged_us"], r["split"]["changed_us"])


def check_ft_loader(r: dict):
    w = r["waits"]
    assert r["same_windows"] and set(w) == {f"{n} {how}" for n in (1, 2)
                                            for how in ("request", "restart")}  # fmt: skip
    assert all(positive(x["changed_ms"], x["steady_ms"], x["changes"]) for x in w.values())
    for n in (1, 2):
        assert w[f"{n} request"]["cost_ms"] < w[f"{n} restart"]["cost_ms"], (
            "a change must cost the workers less than their restart"
        )


def check_firstpass(r: dict):
    med = r["medians"]
    for row in ("cold 0", "warm 0", "map ours"):
        assert positive(med[row]["first_s"], med[row]["window_tps"], med[row]["memory_first"]), row
    assert positive(med["cold 0"]["pass_tps"], med["warm 0"]["pass_tps"])
    # Over a whole pass (the first batch's included), each document tokenized once.
    assert 0.9 < med["cold 0"]["tokenized_over_read"] < 1.1, "the first pass tokenizes twice"
    for name, value, _ in r["checks"]:
        assert positive(value), name


def check_s3_checkpoint(r: list):
    rows = {(x["folder"], x["mode"]): x for x in r}
    assert set(rows) == {(f, m) for f in ("local", "s3") for m in ("sync", "async")}, "all four"
    assert all(positive(x["durable_s"], x["blocked_per_save_s"], x["resume_s"]) for x in r)
    for folder in ("local", "s3"):
        sync, async_ = (rows[folder, m]["blocked_per_save_s"] for m in ("sync", "async"))
        assert async_ < sync, "async must block the loop less than sync"


def check_s3_corpus(r: dict):
    med = r["medians"]
    for side in ("local", "s3"):
        assert positive(med[side]["first_s"], med[side]["tps"]), side
    assert r["same_batches"], "the bucket's batches must equal the local files'"
    assert r["measured"] == 0, "warm: the timed runs measure nothing"
    assert r["s3_over_local"] == med["s3"]["tps"] / med["local"]["tps"]
    if r.get("counts_local_s3_over_local") is not None:
        side = med["s3, counts local"]["tps"]
        assert r["counts_local_s3_over_local"] == side / med["local"]["tps"]


def check_moe(r: dict):
    assert positive(*r["tokens_per_s"].values(), *r["step_ms"].values())
    assert r["moe_over_dense"] == r["tokens_per_s"]["debug_moe"] / r["tokens_per_s"]["debugmodel"]
    assert r["ep2_over_ep1"] == r["step_ms"]["ep2"] / r["step_ms"]["ep1"]
    assert positive(r["a2a_ms"]) and 0 < r["a2a_share"] < 1, "the all-to-alls take part of the step"


def check_muon(r: dict):
    assert positive(*r["step_ms"].values()), "step times must be positive"
    for key, ratio in r["muon_over_adamw"].items():
        model, ranks = key.split("/")
        want = r["step_ms"][f"{model}/Muon/{ranks}"] / r["step_ms"][f"{model}/AdamW/{ranks}"]
        assert ratio == want, key
    # Loopback is the machine's: in a busy tier other tests' traffic lands in the two jobs'
    # difference too, so here only each job's own bytes are sure (a figure for the docs is
    # taken on a quiet machine); the per-step figures must be numbers.
    assert positive(*r["kb_per_job_2ranks"]), "a 2-rank job sends bytes between its ranks"
    assert all(math.isfinite(v) for v in r["kb_per_step_2ranks"].values())


def check_guard(r: dict):
    assert positive(*r["guard_on_ms"], *r["guard_off_ms"]), "step times must be positive"
    assert len(r["on_over_off"]) == r["rounds"] == len(r["guard_on_ms"])
    ratios = [a / b for a, b in zip(r["guard_on_ms"], r["guard_off_ms"])]
    assert r["on_over_off"] == ratios, "a round's ratio is its on / off"
    assert r["cost_pct"] == 100 * (r["median_on_over_off"] - 1), "the cost is the ratio's"


def check_machine(m: dict):
    assert m["cpu"] and m["vector"] in ("AVX-512", "AVX2", "other"), m
    assert m["cores"] >= 1 and m["torch_capability"], m
    assert 0 <= m["others_busy_pct"] <= 100 and m["wall_s"] >= 0, m
    assert m["quiet"] == (m["others_busy_pct"] <= machine.QUIET_PCT), "quiet is the share's"


CHECKS = {
    "bench_moe.py": check_moe,
    "bench_muon.py": check_muon,
    "bench_guard.py": check_guard,
    "bench_firstpass.py": check_firstpass,
    "bench_attention.py": check_attention,
    "bench_ft.py": check_ft,
    "bench_ft_sim.py": check_ft_sim,
    "bench_ft_loader.py": check_ft_loader,
    "bench_data.py": check_data,
    "bench_order.py": check_order,
    "bench_pretokenized.py": check_pretokenized,
    "bench_resume.py": check_resume,
    "bench_step.py": check_step,
    "bench_checkpoint.py": check_checkpoint,
    "bench_s3_checkpoint.py": check_s3_checkpoint,
    "bench_s3_corpus.py": check_s3_corpus,
    "bench_streaming.py": check_streaming,
    "bench_startup.py": check_startup,
    "bench_tp_loader.py": check_tp_loader,
}


@pytest.mark.slow
def test_gpu_check_cpu_smoke(tmp_path):
    """scripts/gpu_check.sh --cpu-smoke: the GPU plan with tiny shapes on CPU, so it
    cannot rot where no GPU is lent; every check passes and each row says what ran."""
    out = tmp_path / "result.json"
    cmd = ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu-smoke", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "| check | configuration | result | ok |" in proc.stdout
    check_gpu_check(json.loads(out.read_text()))


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(CHECKS))
def test_benchmark_smoke(script, tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(BENCHMARKS / script), "--smoke", "--json", str(out)]
    if script in ("bench_resume.py", "bench_streaming.py"):  # their corpora are kept
        cmd += ["--work", str(tmp_path / "work")]  # bench_streaming: no --peer-python here
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    check_machine(result["machine"])
    CHECKS[script](result["rows"] if script == "bench_s3_checkpoint.py" else
                   result["rows"][0] if script in FIRST_ROW else result)  # fmt: skip


STEADY = {
    "name": "steady step",
    "ok": True,
    "result": "no sync raised; syncs a step: 0 (not logging), 1 (logging)",
}
NONSENSE = [
    (check_s3_corpus, {"medians": {side: {"first_s": 1.0, "tps": 1.0} for side in ("local", "s3")},
                       "same_batches": False, "measured": 0, "s3_over_local": 1.0},
     "the bucket's batches must equal the local files'"),
    (check_s3_corpus, {"medians": {side: {"first_s": 1.0, "tps": 1.0} for side in ("local", "s3")},
                       "same_batches": True, "measured": 3, "s3_over_local": 1.0},
     "warm: the timed runs measure nothing"),
    (check_s3_checkpoint, [{"folder": f, "mode": m, "durable_s": 1.0, "resume_s": 1.0,
                            "blocked_per_save_s": 1.0} for f in ("local", "s3")
                           for m in ("sync", "async")],
     "async must block the loop less than sync"),
    (check_attention, {"flavor": "debugmodel", "causal_ms": 0.0, "block_causal_ms": 1.0,
                       "block_over_causal": 1.0},
     "attention times must be positive"),
    (check_data, {"raw_encode_tokens_per_s": 1.0, "workers0_tokens_per_s": 1.0,
                  "workers2_tokens_per_s": 1.0, "streaming_workers0_tokens_per_s": 1.0,
                  "workers0_over_raw": 1.0, "state_bytes_per_rank": {"map": 10**6}},
     r"a position \(a few integers\), not tokens"),
    (check_resume, {"median_1pct_s": 1.0, "median_99pct_s": 1.0, "ratio_99_over_1": 1.0,
                    "first_document": {"1%": "a", "99%": "a"}},
     "the 99% state was not applied"),
    (check_step, {"checkpoints_written": 0, "median_step_ms_checkpoint_off": 1.0,
                  "median_step_ms_checkpoint_on": 1.0, "median_data_wait_share": 0.1,
                  "stop_check_share": 0.01},
     "the \'on\' run must actually checkpoint"),
    (check_step_vs_peer, {"parameters": {"ours": 7_212_288}, "step_ms": {"ours": [1.0]},
                          "median_step_ms": {"ours": 1.0}, "median_cpu_step_ms": {"ours": 1.0},
                          "peer_skipped": ""},
     "a skipped peer says why"),
    (check_step_vs_peer, {"parameters": {"ours": 7_212_288, "peer": 7_000_000},
                          "step_ms": {"ours": [1.0], "peer": [1.0]},
                          "median_step_ms": {"ours": 1.0, "peer": 1.0},
                          "median_cpu_step_ms": {"ours": 1.0, "peer": 1.0},
                          "ours_over_peer": 1.0, "peer_skipped": ""},
     "the same model on both sides"),
    (check_pretokenized, {"on_the_fly_tokens_per_s": 1.0, "pretokenized_tokens_per_s": 30.0,
                          "pretokenize_s": 1.0, "same_batches": False,
                          "pretokenized_over_on_the_fly": 30.0, "corpus_tokens": 1,
                          "corpus_documents": 1},
     "the pretokenized corpus must yield the original\'s batches"),
    (check_tp_loader, {"shape": "4x128", "batches": 20,
                       "build": {"tp0_ms_per_batch": 1.0, "peer_ms_per_batch": 1.0,
                                 "group_cpu_ms_per_batch": 2.0},
                       "broadcast": {"tp0_ms_per_batch": 1.0, "peer_ms_per_batch": 0.0,
                                     "group_cpu_ms_per_batch": 2.0}},
     "broadcast: every time per batch must be positive"),
    (check_checkpoint, {"sync_save_s": 1.0, "checkpoint_mb": 1.0, "integrity_s": 0.1,
                        "async_blocked_s": 2.0, "sync_blocked_s": 1.0, "integrity_over_save": 0.1},
     "async must block the loop less than sync"),
    (check_streaming, {"rows": [{"ours_tokens_per_s": 2.0, "peer_tokens_per_s": 1.0,
                                 "ours_over_peer": 2.0, "streaming": True, "units": 20}],
                       "peer": {"skipped": "", "tokens_match": True},
                       "resume": {"parquet": {"median_1pct_s": 1.0, "median_99pct_s": 1.1,
                                              "ratio_99_over_1": 1.1,
                                              "first_document": {"1%": "a", "99%": "a"},
                                              "rows_decoded": {"1%": 128, "99%": 128},
                                              "corpus": {"documents": 4096}}},
                       "summary": {"targets": []}},
     "parquet: the 99% state was not applied"),
    (check_startup, {"files": 200, "results": [
        {"ranks": 64, "per_rank": {"seconds": 0.1, "bytes_read": 10, "files_opened": 200},
         "per_rank_first_start": {"files_opened": 6},
         "baseline_resolving_alone": {"files_opened": 200}}]},
     "a rank opens its share only"),
    (check_ft, {"live": {"death_to_next_commit_s": 1.0, "launch_to_first_commit_s": 1.0,
                         "quorum_ms_median": 1.0, "step_ms_median": 1.0, "heal_s": None},
                "restart": {"kill_to_first_step_s": 1.0, "step_ms_median": 1.0,
                            "steps_trained_again": 1}},
     "the joiner must have healed"),
    (check_ft_sim, {"simulation": {"committed": 10, "steps": 10, "deaths": 0, "uncommitted": 0,
                                   "rewind_us_median": 1.0},
                    "split": {"unchanged_us": 1.0, "changed_us": 1.0}},
     "the run went through faults"),
    (check_ft_loader, {"same_windows": True, "waits": {
        f"{n} {how}": {"changed_ms": 5.0, "steady_ms": 1.0, "changes": 3,
                       "cost_ms": 4.0 if how == "request" else 3.0}
        for n in (1, 2) for how in ("request", "restart")}},
     "a change must cost the workers less than their restart"),
    (check_firstpass, {"medians": {row: {"first_s": 1.0, "window_tps": 1.0, "pass_tps": 1.0,
                                         "memory_first": 1.0, "tokenized_over_read": 2.0}
                                   for row in ("cold 0", "warm 0", "map ours")},
                       "checks": []},
     "the first pass tokenizes twice"),
    (check_gpu_check, {"smoke": True, "checks": [{"name": "seed plan", "ok": True,
                                                  "result": "3 of 4 steps bit-equal"}],
                       "rows": []},
     "every step of the seed plan is bit-equal"),
    (check_gpu_check, {"smoke": True, "checks": [{"name": "seed plan", "ok": True,
                                                  "result": "4 of 4 steps bit-equal"}, STEADY],
                       "rows": [{"backend": "flex", "note": "", "tokens_per_s": 1.0}]},
     "'backend': 'flex', 'note': ''"),
    (check_gpu_check, {"smoke": True, "checks": [
        {"name": "seed plan", "ok": True, "result": "4 of 4 steps bit-equal"},
        {**STEADY, "result": STEADY["result"].replace("0 (not", "2 (not")}], "rows": []},
     "syncs a step: 0"),
    (check_machine, {"cpu": "x", "vector": "AVX2", "torch_capability": "AVX2", "cores": 2,
                     "others_busy_pct": 40.0, "quiet": True, "wall_s": 3.0},
     "quiet is the share's"),
    (check_guard, {"guard_on_ms": [2.0], "guard_off_ms": [1.0], "on_over_off": [0.5], "rounds": 1,
                   "median_on_over_off": 2.0, "cost_pct": 100.0}, "a round's ratio is its on / off"),
]  # fmt: skip


def test_the_guard_benchmarks_off_arm_applies_every_update(tmp_path, monkeypatch):
    """bench_guard.py's *off* is off: a NaN loss at step 2 is applied (step 3's loss is
    NaN: the weights are), where *on* drops it (step 3 finite). The loss is poisoned
    outside the guard (whose own fault hook goes with it)."""
    import math

    from helpers import CONFIG, read_jsonl

    from torchtitan.loss import BatchLoss

    sys.path.insert(0, str(BENCHMARKS))
    import bench_guard

    real, calls = BatchLoss.__call__, []

    def poisoned(self, batch, normalizer=None):
        calls.append(1)
        loss = real(self, batch, normalizer)
        return loss * float("nan") if len(calls) == 2 else loss

    monkeypatch.setattr(BatchLoss, "__call__", poisoned)
    loss = {}
    for guard in (True, False):
        calls.clear()
        dump = tmp_path / f"guard-{guard}"
        args = [*map(str, CONFIG), "--training.steps", "3", "--job.dump_folder", str(dump)]
        bench_guard.run_arm(guard, args)
        loss[guard] = {r["step"]: r["loss"] for r in read_jsonl(dump / "metrics.jsonl")}[3]
    assert math.isfinite(loss[True]) and math.isnan(loss[False]), loss


@pytest.mark.parametrize("check,result,why", NONSENSE, ids=[c.__name__ for c, _, _ in NONSENSE])
def test_the_checks_reject_a_result_that_makes_no_sense(check, result, why):
    with pytest.raises(AssertionError, match=why):
        check(result)


def check_sampling(r: dict):
    from torchtitan.data.schedule import IMBALANCE_WARNING

    corpus = r["corpus"]
    for row in r["coverage"]:
        assert row["coverage"] == 1.0, f"{row['ranks']}: a document repeated before pass 0 ended"
        assert row["exactly_once"]["heavy"] == [0, 1], row
    read = r["coverage"][0]
    assert read["planned_equals_read"] is True, "the simulation must be what the loaders read"
    assert read["documents_read_pass0"] == corpus["documents"]
    for mix in r["mix"]:
        for source in mix["sources"]:
            assert abs(source["share"] - source["weight"]) < 0.01, (mix["mix"], source)
            assert mix["coverage"][source["name"]] in (None, 1.0), (mix["mix"], source)
    assert r["mix"][0]["exactly_once"]["heavy"] == [0], "the large source's first pass is whole"
    for row in r["imbalance"]:
        busiest = row["sequences_max"] / row["mean"]
        assert busiest == row["max_over_mean"] == row["schedule_imbalance"], row
        assert row["sequences_max"] - row["sequences_min"] <= 1, row
        assert positive(row["plan_ms_per_step"]), row
        assert row["warned"] == (row["schedule_imbalance"] > IMBALANCE_WARNING), row


def test_sampling_benchmark_smoke(tmp_path, capsys, monkeypatch):
    """scripts/benchmarks/bench_sampling.py --smoke, in this process (a few seconds: no
    interpreter start-up): its figures hold what the global order promises, and the
    check rejects an early repeat, a simulation that differs from the loaders, and a
    skewed mix."""
    import copy
    import importlib.util

    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as a script has its own folder: _root
    script = BENCHMARKS / "bench_sampling.py"
    spec = importlib.util.spec_from_file_location("bench_sampling", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "result.json"
    assert bench.main(["--smoke", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| ranks (resumed halfway into pass 0) |" in printed
    assert f"machine: {machine.describe(machine.cpu_facts())}; other processes used" in printed
    result = json.loads(out.read_text())
    check_sampling(result)
    check_machine(result["machine"])
    for path, value, why in (
        (("coverage", 1, "coverage"), 0.084, "a document repeated before pass 0 ended"),
        (("coverage", 0, "planned_equals_read"), False, "the simulation must be what the"),
        (("mix", 0, "sources", 1, "share"), 0.05, "'share': 0.05"),
    ):
        broken = copy.deepcopy(result)
        *where, key = path
        target = broken
        for step in where:
            target = target[step]
        target[key] = value
        with pytest.raises(AssertionError, match=why):
            check_sampling(broken)


# ---- the machine a figure was taken on, and how busy others kept it -----------------------


def stat_text(cpu0: tuple, cpu1: tuple) -> str:
    """/proc/stat's text for two CPUs given as (user, system, idle, steal, guest) ticks (guest
    is already inside user, as the kernel counts it), with the aggregate line first."""
    both = tuple(a + b for a, b in zip(cpu0, cpu1))
    lines = [f"{name} {u} 0 {s} {i} 0 0 0 {st} {g} 0"
             for name, (u, s, i, st, g) in (("cpu", both), ("cpu0", cpu0), ("cpu1", cpu1))]  # fmt: skip
    return "\n".join([*lines, "intr 12 3 4", "ctxt 99", "btime 1700000000"])


def reading(stat: str, own: int, cpus=None) -> machine.Reading:
    return machine.Reading(0.0, *machine.machine_ticks(stat, cpus), own)


def test_others_busy_share_is_the_machines_busy_ticks_less_this_trees():
    """Two synthetic snapshots 2 s apart on 2 CPUs (400 ticks): cpu0 busy 150 (user), cpu1
    busy 50 (user 30, system 10, steal 10: a hypervisor's other guest takes the core too);
    this tree used 120 of the 200, so others used 80 of 400: 20 %. Negative controls: not
    subtracting this tree's ticks reads 50 %, and guest ticks (inside user) are not
    counted twice."""
    start = stat_text((100, 50, 800, 0, 0), (100, 50, 800, 0, 0))
    end = stat_text((250, 50, 850, 0, 70), (130, 60, 950, 10, 0))
    for cpus in (None, {0, 1}):
        assert machine.machine_ticks(end, cpus)[0] - machine.machine_ticks(start, cpus)[0] == 200
        assert machine.machine_ticks(end, cpus)[1] - machine.machine_ticks(start, cpus)[1] == 400
        assert machine.others_busy_pct(reading(start, 1000, cpus), reading(end, 1120, cpus)) == 20.0
    assert machine.others_busy_pct(reading(start, 0), reading(end, 0)) == 50.0, "own counted"
    # Only the CPUs this process may run on: cpu1 alone, busy 50 of its 200 ticks.
    assert machine.others_busy_pct(reading(start, 0, {1}), reading(end, 0, {1})) == 25.0
    load = machine.load_between(reading(start, 1000), reading(end, 1120))
    assert load["others_busy_pct"] == 20.0 and load["quiet"] is False
    assert machine.load_between(reading(start, 1000), reading(end, 1184))["quiet"] is True  # 4 %
    assert machine.others_busy_pct(reading(start, 0), reading(start, 0)) == 0.0, "no tick"


def test_the_cpu_model_and_vector_level_come_from_cpuinfo():
    """The first processor's model and flags; AVX-512 where avx512f is set, AVX2 where only
    avx2 is, "other" on an ARM machine (no model name, "Features" for flags)."""
    xeon = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu sse2 avx "
            "avx2 avx512f avx512bw\n\nprocessor\t: 1\nmodel name\t: Other\nflags\t\t: fpu\n")  # fmt: skip
    epyc = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx avx2 fma\n"
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve\nCPU part\t: 0xd0c\n"
    model, flags = machine.cpu_of(xeon)
    assert (model, machine.vector_level(flags)) == ("Intel(R) Xeon(R) Processor", "AVX-512")
    model, flags = machine.cpu_of(epyc)
    assert (model, machine.vector_level(flags)) == ("AMD EPYC 7B13", "AVX2")
    model, flags = machine.cpu_of(arm)
    assert (model, machine.vector_level(flags)) == ("", "other") and "asimd" in flags


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads /proc/cpuinfo (Linux)")
def test_the_session_header_names_this_cpu_its_vector_level_and_cores(pytestconfig):
    """conftest's pytest_report_header, through pytest's own hook call, against this
    machine's facts read here on their own."""
    import torch

    said = pytestconfig.hook.pytest_report_header(config=pytestconfig,
                                                  start_path=pytestconfig.rootpath)  # fmt: skip
    lines = [line for group in said for line in ([group] if isinstance(group, str) else group)]
    ours = [line for line in lines if line.startswith("cpu: ")]
    info = open("/proc/cpuinfo").read()
    model = next(line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name"))  # fmt: skip
    flags = next(line.split(":", 1)[1].split() for line in info.splitlines()
                 if line.startswith("flags"))  # fmt: skip
    level = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "other"
    capability = torch.backends.cpu.get_cpu_capability()
    assert ours == [f"cpu: {model}, {level} (torch capability {capability}), "
                    f"{len(os.sched_getaffinity(0))} cores"], lines  # fmt: skip


SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass"


def spinner_outside_this_tree(seconds: float) -> int:
    """The pid of a process that spins for ``seconds`` and is no descendant of this one:
    its parent starts it in a session of its own and exits, so it is re-parented."""
    launcher = ("import subprocess, sys\n"
                f"p = subprocess.Popen([sys.executable, '-c', {SPIN.format(seconds=seconds)!r}],"
                " start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)"
                "\nprint(p.pid)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True,
                          check=True, timeout=60)  # fmt: skip
    return int(proc.stdout)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc (Linux)")
def test_a_process_spinning_outside_this_tree_counts_as_others():
    """A spinning process that is not ours shows as others' use, at least its own CPU time
    (read from its /proc/<pid>/stat) and at least 30 % of one core's share; this tree,
    asleep meanwhile, counts next to nothing of it."""
    pid = spinner_outside_this_tree(20)
    try:
        assert pid not in machine.descendants(os.getpid()), "re-parented away from this tree"
        time.sleep(0.3)  # past its interpreter's start
        start, spun_before = machine.read(), machine.process_ticks(pid)
        time.sleep(1.5)
        end, spun = machine.read(), machine.process_ticks(pid) - spun_before
    finally:
        os.kill(pid, signal.SIGKILL)
    own, span = end.own - start.own, end.total - start.total
    others = (end.busy - start.busy) - own
    assert own < spun / 2, f"this tree counted {own} ticks while the spinner ran {spun}"
    assert others >= 0.8 * spun, f"others {others} ticks, the spinner alone {spun}"
    assert machine.others_busy_pct(start, end) >= 30 / machine.cores(), (others, span)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc (Linux)")
def test_this_trees_children_live_or_reaped_are_not_others():
    """A child spinning through the window and one that ran 0.3 CPU-s and was reaped in it
    are this tree's. Negative control: counting this process alone (its children as
    others) reads the machine busier by their share."""
    hz = os.sysconf("SC_CLK_TCK")
    child = subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=20)])
    try:
        time.sleep(0.3)
        start, child_before, alone_before = (
            machine.read(),
            machine.process_ticks(child.pid),
            os.times(),
        )
        subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 0.3:\n"
                        "    pass"], check=True, timeout=60)  # fmt: skip
        time.sleep(1.0)
        end, alone = machine.read(), os.times()
        spun = machine.process_ticks(child.pid) - child_before
    finally:
        child.kill()
        child.wait()
    reaped = (alone.children_user + alone.children_system
              - alone_before.children_user - alone_before.children_system) * hz  # fmt: skip
    own = end.own - start.own
    assert reaped >= 25 and spun >= 10, (reaped, spun)  # both ran
    assert own >= 0.8 * (spun + reaped), f"the tree counted {own}: child {spun}, reaped {reaped}"
    self_only = [(t.user + t.system) * hz for t in (alone_before, alone)]
    naive = machine.others_busy_pct(machine.Reading(0, start.busy, start.total, self_only[0]),
                                    machine.Reading(0, end.busy, end.total, self_only[1]))  # fmt: skip
    share = 100 * 0.8 * (spun + reaped) / (end.total - start.total)
    assert naive - machine.others_busy_pct(start, end) >= share, "children read as others"


def test_a_run_says_its_machine_and_load_and_warns_when_others_kept_it_busy(
    tmp_path, capsys, monkeypatch
):
    """save() ends the output with the machine and others' share, warns over QUIET_PCT and
    puts "machine" in the JSON; with --require-quiet a busy run exits 2 with one line and
    writes nothing. The readings are synthetic: 400 ticks, this tree 100 of them."""
    out = tmp_path / "result.json"
    for require in ([], ["--require-quiet"]):
        monkeypatch.setattr(machine, "sample", lambda s: {"others_busy_pct": 0.0,
                                                          "quiet": True, "wall_s": s})  # fmt: skip
        args = bench.Arguments("doc", smoke={}).parse(["--json", str(out), *require])
        args.load_from = machine.Reading(0.0, 0, 0, 0)
        for busy, pct in ((110, 2.5), (300, 50.0)):  # others 10 or 200 of 400 ticks
            monkeypatch.setattr(machine, "read", lambda b=busy: machine.Reading(2.0, b, 400, 100))
            out.unlink(missing_ok=True)
            refused = require and pct > machine.QUIET_PCT
            assert bench.save(args, {"figure": 1.5}) == (2 if refused else 0)
            printed = capsys.readouterr()
            assert f"other processes used {pct:.1f} % of it over 2.0 s" in printed.out
            assert ("WARNING: not a quiet machine" in printed.out) == (pct > machine.QUIET_PCT)
            if refused:
                assert printed.err.count("\n") == 1 and "refused (--require-quiet)" in printed.err
                assert not out.exists(), "a refused run writes no figures"
                continue
            result = json.loads(out.read_text())
            assert result["figure"] == 1.5 and result["machine"]["others_busy_pct"] == pct
            check_machine(result["machine"])


def test_require_quiet_from_the_environment_refuses_a_busy_machine_before_the_work(
    capsys, monkeypatch
):
    """TORCHTITAN_BENCH_REQUIRE_QUIET=1 is --require-quiet: a busy 1 s sample at the parse
    exits 2 with one line, a quiet one goes on; the variable is taken from the environment
    so that the run's own ranks (which parse too) do not refuse for their siblings' load.
    Negative control: without it nothing is sampled."""

    def load(pct):
        return lambda seconds: {"others_busy_pct": pct, "quiet": pct <= machine.QUIET_PCT,
                                "wall_s": seconds}  # fmt: skip

    monkeypatch.setenv(bench.REQUIRE_QUIET_ENV, "1")
    monkeypatch.setattr(machine, "sample", load(40.0))
    with pytest.raises(SystemExit) as exited:
        bench.Arguments("doc", smoke={}).parse([])
    assert exited.value.code == 2 and bench.REQUIRE_QUIET_ENV not in os.environ
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refused (--require-quiet): other processes used 40.0 %" in err
    monkeypatch.setenv(bench.REQUIRE_QUIET_ENV, "1")
    monkeypatch.setattr(machine, "sample", load(1.0))
    assert bench.Arguments("doc", smoke={}).parse([]).require_quiet is True
    monkeypatch.setattr(machine, "sample", None)  # not called: a call would raise
    assert bench.Arguments("doc", smoke={}).parse([]).require_quiet is False
