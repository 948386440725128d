"""Per-step fault tolerance with torchft on CPU (gloo): a lighthouse in this process and two replica groups, each a
`gg train` process of its own. Once both have taken 5 steps, one group is `kill -9`ed; the other keeps stepping
without a restart; the killed one is started again with the same command, heals from its peer's live state and
rejoins; both end with bit-equal weights, optimizer state and loader position. The same with groups of 2 FSDP2 ranks
(HSDP across groups, Muon for the matrices), each a torchrun job that restarts its own group. Also the one-line
errors for a missing lighthouse and a missing torchft."""
import json, os, re, signal, subprocess, sys, time
os.environ.setdefault("RUST_LOG", "warn")   # the lighthouse in this process logs every quorum at INFO otherwise
from pathlib import Path
import psutil
import pytest
import torch
from conftest import GG, ROOT, run_gg
from test_train_e2e import RECIPE, small
from gradient_garden.checkpoint.checkpoints import list_checkpoints, load_checkpoint

LighthouseServer = pytest.importorskip("torchft.coordination").LighthouseServer
STEPS = 300
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RUST_LOG": "warn"}

def sets(prepared, out: Path, group: int, lighthouse: str) -> list[str]:
    "A tiny fp32 Tendril, 2 micro-batches a step, the final checkpoint only, as replica group `group` of 2."
    tiny = {"model.dim": 64, "model.n_layers": 2, "model.max_seq_len": 64, "training.seq_len": 64,
            "training.micro_batch_size": 4, "training.total_batch_size": 512,
            "runtime.device": "cpu", "runtime.precision": "fp32", "checkpointing.every": STEPS,
            "checkpointing.format": "full", "generation.every": 0, "validation.enabled": "false",
            "evals.hellaswag": "false", "evals.winogrande": "false", "evals.arc_challenge": "false",
            "fault_tolerance.enabled": "true", "fault_tolerance.lighthouse": lighthouse,
            "fault_tolerance.replica_group": group, "fault_tolerance.replica_groups": 2,
            "fault_tolerance.min_replicas": 1, "fault_tolerance.timeout_s": 10}
    return small(prepared, out/f"group{group}", steps=STEPS, **tiny)

def run_dir(out: Path, group: int) -> Path: return out/f"group{group}"/"runs"/"pretraining"/"debug"

def last_step(out: Path, group: int) -> int:
    "The latest step in group `group`'s metrics.jsonl (0 before the first)."
    p = run_dir(out, group)/"metrics.jsonl"
    rows = [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.is_file() else []
    return max((r["step"] for r in rows), default=0)

def assert_equal(a, b, at="optimizers"):
    "Nested dicts and lists of tensors and numbers equal bit for bit."
    if isinstance(a, dict):
        assert a.keys() == b.keys(), at
        for k in a: assert_equal(a[k], b[k], f"{at}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), at
        for i, (x, y) in enumerate(zip(a, b)): assert_equal(x, y, f"{at}[{i}]")
    elif torch.is_tensor(a): assert torch.equal(a, b), at
    else: assert a == b, at

def start(args: list[str], log: Path) -> subprocess.Popen:
    "`gg ARGS` as a process of its own, its output into `log`."
    return subprocess.Popen(GG + [str(a) for a in args], cwd=ROOT, env=ENV, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)

def wait_until(cond, what: str, procs=(), timeout=240):
    "Poll `cond()` until true; fail naming `what` if a process in `procs` ends first or time runs out."
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond(): return
        for p in procs: assert p.poll() is None, f"a replica group ended before {what}"
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")

@pytest.mark.slow   # 100-140 s on a shared 2-core machine: 300 steps, so a restarted process finds its peer running
def test_a_killed_replica_group_heals_and_rejoins(prepared, tmp_path):
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    args = [["train", "--recipe", RECIPE, "--set", *sets(prepared, tmp_path, g, lighthouse.address())] for g in (0, 1)]
    g0 = start(args[0], tmp_path/"group0.log")
    g1 = start(args[1], tmp_path/"group1.log")
    try:
        both = lambda: min(last_step(tmp_path, 0), last_step(tmp_path, 1))
        wait_until(lambda: both() >= 5, "both groups' fifth step", [g0, g1])
        os.kill(g1.pid, signal.SIGKILL); g1.wait(timeout=30)
        killed_at = last_step(tmp_path, 0)
        wait_until(lambda: last_step(tmp_path, 0) >= killed_at + 5, "group 0 stepping alone", [g0])
        alone_to = last_step(tmp_path, 0)
        g1 = start(args[1], tmp_path/"group1_again.log")   # the same command again
        assert g1.wait(timeout=240) == 0, (tmp_path/"group1_again.log").read_text()[-3000:]
        assert g0.wait(timeout=240) == 0, (tmp_path/"group0.log").read_text()[-3000:]
    finally:
        for p in (g0, g1):
            if p.poll() is None: p.kill()
        lighthouse.shutdown()
    again = (tmp_path/"group1_again.log").read_text()
    healed = [l for l in again.splitlines() if "replica group 1: healed from a live peer's state at step" in l]
    assert len(healed) == 1, again[-3000:]
    healed_at = int(healed[0].rsplit(" ", 1)[1])
    assert alone_to < healed_at < STEPS, (killed_at, alone_to, healed_at)   # it joined a run that had gone on
    a, b = (load_checkpoint(list_checkpoints(run_dir(tmp_path, g)/"checkpoints")[-1]) for g in (0, 1))
    assert a["step"] == b["step"] == STEPS
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert_equal(a["optimizers"], b["optimizers"])   # AdamW's moments and step counts too
    assert a["loader"] == b["loader"]   # the same position in the global order: each group reads its own share
    print(f"group 1 killed at group 0's step {killed_at}; group 0 alone to step {alone_to}; group 1 healed at step "
          f"{healed_at}; both finished {STEPS} steps with bit-equal weights")

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "3", "-m", "gradient_garden.cli"]

@pytest.mark.slow   # about 100-130 s on a shared 2-core machine: 4 ranks and a restart of one group
def test_a_group_of_fsdp2_ranks_restarted_by_torchrun_heals(prepared, tmp_path):
    ("Two groups of 2 FSDP2 ranks (HSDP across groups), each a torchrun job; one rank of group 1 killed; torchrun "
     "restarts that group alone and each of its ranks heals its own shards. Muon for the matrices: its momentum heals "
     "with the rest, and each group's Muon shares the orthogonalisations over its own two ranks.")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    env = {**ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}   # each attempt of a group: a store of its own
    jobs = [subprocess.Popen(TORCHRUN + ["train", "--recipe", RECIPE, "--set",
                                         *sets(prepared, tmp_path, g, lighthouse.address()),
                                         "training.total_batch_size=1024", "runtime.fsdp=true",
                                         "optimizers.muon.enabled=true"],
                             cwd=ROOT, env=env, stdout=(tmp_path/f"group{g}.log").open("w"), stderr=subprocess.STDOUT)
            for g in (0, 1)]
    try:
        wait_until(lambda: min(last_step(tmp_path, 0), last_step(tmp_path, 1)) >= 5, "both groups' fifth step", jobs)
        ranks = [p for p in psutil.Process(jobs[1].pid).children()   # the ranks: the agent's own children, not theirs
                 if "gradient_garden.cli" in " ".join(p.cmdline())]
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1].pid, signal.SIGKILL)
        killed_at = last_step(tmp_path, 0)
        assert [p.wait(timeout=600) for p in jobs] == [0, 0], (tmp_path/"group1.log").read_text()[-3000:]
    finally:
        for p in jobs:
            if p.poll() is None: p.kill()
        lighthouse.shutdown()
    logs = [(tmp_path/f"group{g}.log").read_text() for g in (0, 1)]
    starts = [log.count("precision: fp32") for log in logs]   # a line per rank and start
    assert starts[1] == 2 * starts[0] and "exitcode: -9" in logs[1] and "exitcode" not in logs[0], starts
    # group 0 never restarted, group 1 once
    # both ranks of the restarted group; their lines share one stdout, so two may run together on one line
    healed = [int(h) for h in re.findall(r"replica group 1: healed from a live peer's state at step (\d+)", logs[1])]
    assert len([h for h in healed if h > killed_at]) == 2, healed
    a, b = (load_checkpoint(list_checkpoints(run_dir(tmp_path, g)/"checkpoints")[-1]) for g in (0, 1))
    assert a["step"] == b["step"] == STEPS
    assert_equal(a["model"], b["model"], "model"); assert_equal(a["optimizers"], b["optimizers"])
    assert any("momentum_buffer" in s for s in a["optimizers"]["state"].values())   # Muon's state, healed and equal

def test_fault_tolerance_without_a_lighthouse_is_one_line(prepared, tmp_path):
    r = run_gg("train", "--recipe", RECIPE, "--set", *small(prepared, tmp_path, steps=2),
               "fault_tolerance.enabled=true", "fault_tolerance.replica_group=0", check=False,
               env={"TORCHFT_LIGHTHOUSE": None})
    assert r.returncode != 0
    assert "fault_tolerance.lighthouse: got '' and TORCHFT_LIGHTHOUSE is not set" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]

def test_fault_tolerance_without_torchft_is_one_line(prepared, tmp_path):
    hide = tmp_path/"hide"; hide.mkdir()
    (hide/"torchft.py").write_text("raise ImportError('No module named torchft (hidden for this test)')\n")
    r = run_gg("train", "--recipe", RECIPE, "--set", *small(prepared, tmp_path, steps=2),
               "fault_tolerance.enabled=true", "fault_tolerance.replica_group=0",
               "fault_tolerance.lighthouse=http://localhost:1", check=False, env={"PYTHONPATH": str(hide)})
    assert r.returncode != 0
    assert "torchft cannot be imported" in r.stderr and "pip install 'gradient-garden[ft]'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
