"""A background save's commit is agreed every k steps, not every step: on 2 gloo ranks whose writes finish at different
steps, both commit at the same step, after the later one, with far fewer collectives than polls."""
import json, os, time
import pytest
import torch.distributed as dist

from gloo_ranks import run_ranks


class _Write:
    "A background write that is done from poll number `at` on."
    def __init__(self, at: int): self.at, self.polls = at, 0
    def done(self) -> bool: self.polls += 1; return self.polls >= self.at
    def result(self): return None


def _poll_worker(rank, world, out_dir):
    import gradient_garden.parallel.distributed as pd
    from gradient_garden.checkpoint.checkpoints import CheckpointManager
    from gradient_garden.parallel.distributed import DistEnv
    env = DistEnv(rank=rank, world_size=world, cpu_group=dist.group.WORLD)
    calls, inner = [], pd.agree
    pd.agree = lambda e, flags: calls.append(1) or inner(e, flags)   # count the collectives
    mgr = CheckpointManager(os.path.join(out_dir, f"ck{rank}"), poll_every_s=0.2)
    committed = []
    mgr.wait = lambda: committed.append(step) or setattr(mgr, "pending", None)
    mgr.pending = (_Write(3 if rank == 0 else 12), None, None, {"step": 1})
    for step in range(1, 61):
        time.sleep(0.02)   # a step: k comes out at most 10
        mgr.poll(env)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"committed": committed, "agreements": len(calls)}, f)


@pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")
def test_save_commit_is_agreed_every_k_steps(tmp_path):
    run_ranks(_poll_worker, 2, tmp_path / "pg_init", str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["committed"] == r1["committed"] and len(r0["committed"]) == 1, (r0, r1)   # the same step on both
    assert 12 <= r0["committed"][0] <= 40, r0   # not before the later rank's write is done, nor much later
    assert r0["agreements"] == r1["agreements"], (r0, r1)
    assert 3 * r0["agreements"] <= r0["committed"][0], r0   # polled every step, agreed every few
