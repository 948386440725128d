"""Failing fast on several ranks: a rank that stops answering (it sleeps inside its training step) makes every rank
exit within the collective timeout plus a few seconds, with one line naming it and the collective the others waited
in, and the previous checkpoint stays intact; the process groups a run needs exist from its start."""
import json, os, subprocess, sys, time
from pathlib import Path
import psutil
from conftest import ROOT

RECIPE = "recipes/pretraining/debug.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
TIMEOUT_S = 5

def sets(prepared, out: Path, **extra) -> list[str]:
    "A small 2-rank run under `out`: a loss row every step, sharded checkpoints every 4 steps."
    s = {"paths.runs": out/"runs", "training.max_steps": 40, "training.log_every": 1, "model.dim": 64,
         "model.n_layers": 2,
         "model.n_heads": 4, "model.n_kv_heads": 2, "model.max_seq_len": 64, "training.seq_len": 64,
         "training.micro_batch_size": 4, "training.total_batch_size": 1024, "validation.enabled": False,
         "generation.every": 0, "checkpointing.every": 4, "runtime.device": "cpu",
         "runtime.collective_timeout_s": TIMEOUT_S, **extra}
    return prepared["sets"] + [f"{k}={v}" for k, v in s.items()]

HANG_RANK_1 = """
import os, sys, time
from pathlib import Path
from gradient_garden.train.trainer import Trainer
real, mark = Trainer.train_step, Path(sys.argv.pop(1))
def train_step(self):
    if os.environ["RANK"] == "1" and self.state.step == 6:      # step 7 never comes on rank 1
        mark.write_text(str(time.time())); time.sleep(600)
    return real(self)
Trainer.train_step = train_step
from gradient_garden.cli import main
sys.exit(main(sys.argv[1:]))
"""

def test_a_rank_that_hangs_ends_the_run_with_one_line(prepared, tmp_path):
    from gradient_garden.checkpoint.checkpoints import list_checkpoints, load_checkpoint
    script, mark = tmp_path/"hang.py", tmp_path/"hung_at"
    script.write_text(HANG_RANK_1)
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(script),
                             str(mark), "train", "--recipe", RECIPE, "--set", *sets(prepared, tmp_path)],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers, exited = {}, {}
    while proc.poll() is None and time.time() - t0 < 300:   # when each rank's process ends
        for c in psutil.Process(proc.pid).children():   # the ranks: the agent's own children, not theirs
            try:
                if c.pid not in workers and "train" in c.cmdline(): workers[c.pid] = c
            except psutil.Error: pass
        for pid, c in workers.items():
            if pid in exited: continue
            try: gone = c.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess: gone = True
            if gone: exited[pid] = time.time()
        time.sleep(0.05)
    stdout, stderr = proc.communicate(timeout=60)
    r = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    ended = max(exited.values(), default=time.time())
    hung = float(mark.read_text())
    lines = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert r.returncode != 0 and len(lines) == 1, r.stderr[-4000:]
    assert lines[0] == (f"error: rank 1 stopped answering: rank 0 waited {TIMEOUT_S} s in all_reduce in train_step at "
                        "step 7 "
                        f"(runtime.collective_timeout_s)"), lines
    assert len(workers) == 2 and len(exited) == 2, (workers, exited)
    assert ended - hung < TIMEOUT_S + 10, f"every rank exited {ended - hung:.1f} s after rank 1 hung"
    ck = tmp_path/"runs"/"pretraining"/"debug"/"checkpoints"
    assert [p.name for p in list_checkpoints(ck)] == ["step_0000004"]
    assert load_checkpoint(ck)["step"] == 4                      # intact: it loads, weights and all
    print(json.dumps(dict(hang_exit_s=round(ended - hung, 1), run_s=round(ended - t0, 1))))
