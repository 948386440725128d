"""Timeouts and the store, on gloo ranks: the CPU group's agreement times out before work queued earlier on the other
groups (NCCL's timer starts when work is queued; an asynchronous gloo all-reduce plays it here), so our one line
naming the stuck rank comes first; store errors in the watcher are retried with backoff before the process exits;
rank 0's checkpoint commit and prune run while the other ranks wait under the long timeout, not the short one."""
import json, os, sys, threading, time, traceback
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_ranks import run_ranks
from gradient_garden.config import RuntimeConfig
import gradient_garden.parallel.distributed as D

SHORT_S = 2.0

def _entry(rank, body, world, init, args):
    "Join a gloo group, run `body`, leave at once (a stalled peer never meets a teardown barrier)."
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    code = 0
    try: body(rank, *args)
    except BaseException: traceback.print_exc(); code = 1
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(code)

def stalled_peer(rank, out, queued):
    "Rank 1 stalls; rank 0 queues an all-reduce, finishes its step, then waits in the agreement."
    D.QUEUED_BACKENDS = queued
    env = D.init_distributed(RuntimeConfig(device="cpu"))
    D.set_collective_timeout(env, SHORT_S)
    if rank == 1: time.sleep(2 * SHORT_S + 3); return        # stuck in its step (past rank 0's last wait)
    work = dist.all_reduce(torch.ones(1), async_op=True)     # the step's device work, its timer running from now
    t0 = time.monotonic(); time.sleep(0.5)                   # the rest of the step
    line = None
    try:
        with D.watch_collectives(env, step=lambda: "7", grace_s=1.0): D.agree(env, [0])
    except D.CollectiveTimeout as e: line = str(e)
    t_line = time.monotonic() - t0 - 1.0                     # less the grace waited for other ranks' reports
    queued_failed = work.is_completed()
    try: work.wait(); t_work = None
    except RuntimeError: t_work = time.monotonic() - t0
    (out/"result.json").write_text(json.dumps(dict(line=line, t_line=t_line, t_work=t_work,
                                                   queued_failed_first=queued_failed)))

@pytest.mark.parametrize("queued", [("gloo",), ()], ids=["longer-queued-timeout", "equal-timeouts"])
def test_our_line_comes_first(tmp_path, queued):
    mp.spawn(_entry, args=(stalled_peer, 2, str(tmp_path/"init"), (tmp_path, queued)), nprocs=2, join=True)
    r = json.loads((tmp_path/"result.json").read_text())
    assert r["line"] == (f"rank 1 stopped answering: rank 0 waited {SHORT_S:g} s in all_reduce at step 7 "
                         "(runtime.collective_timeout_s)"), r
    if queued:   # the queued work's timeout is 2 x 2 s from when it was queued: it is still waiting at our line
        assert not r["queued_failed_first"] and r["t_work"] > r["t_line"] + 1, r
    else:        # equal timeouts: the work queued 0.5 s earlier fails first (NCCL's watchdog would abort here)
        assert r["queued_failed_first"], r

class FlakyStore:
    "A store whose first `fails` requests raise, as a dropped TCPStore connection does."
    def __init__(self, fails): self.fails, self.calls = fails, 0
    def check(self, keys):
        self.calls += 1
        if self.calls <= self.fails: raise RuntimeError("Connection reset by peer")
        return False

def watched(store, seconds):
    "Run the watcher thread on `store` for `seconds`; the exit codes it asked for."
    exits, done = [], threading.Event()
    t = threading.Thread(target=D.watch_store, args=(store, done, threading.Event(), 0.05, exits.append))
    t.start(); time.sleep(seconds); done.set(); t.join()
    return exits

def test_store_errors_are_retried_before_exiting():
    flaky = FlakyStore(4)              # four failures in a row: retried after 0.25, 0.5, 1 and 2 s
    assert watched(flaky, 5.0) == [] and flaky.calls > 5
    dead = FlakyStore(10**9)           # never answers again: gone after the 7.75 s of retries
    exits = watched(dead, 9.0)
    assert exits and exits[0] == 1 and dead.calls >= 6, (exits, dead.calls)

def slow_commit(rank, world, out):
    "A background save whose commit and prune on rank 0 outlast the short timeout; then a training collective."
    from gradient_garden.checkpoint.checkpoints import CheckpointManager
    env = D.init_distributed(RuntimeConfig(device="cpu"))
    D.set_collective_timeout(env, SHORT_S)
    mgr = CheckpointManager(out/"ck", keep_last=1, async_save=True, group=env.checkpoint_group)
    if rank == 0:
        real = mgr.prune
        mgr.prune = lambda: (time.sleep(2 * SHORT_S), real())[1]   # rmtree on slow shared storage
    meta = dict(stage="pretraining", architecture="tendril", config={})
    for step in (1, 2):
        mgr.save_sharded(step, {"w": torch.full((4,), float(step))}, meta | dict(step=step))
        while mgr.poll(env) is None: time.sleep(0.05)   # committed on every rank at the same poll
        dist.all_reduce(torch.ones(1))   # the next training step's collective, under the short timeout
    if rank == 0: (out/"done").write_text(str(sorted(p.name for p in (out/"ck").iterdir())))

def test_commit_and_prune_wait_under_the_long_timeout(tmp_path):
    run_ranks(slow_commit, 2, tmp_path/"init", tmp_path)
    assert (tmp_path/"done").read_text() == "['step_0000002']"
