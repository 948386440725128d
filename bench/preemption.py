"""Preemption on 2 gloo ranks, as a cluster does it: SIGTERM to torchrun at a random step of a run that checkpoints
only every 1000 steps. Per trial: the step each rank was in when the signal came (recorded by a hook), the step of
the checkpoint written (it must be that step or the next), and the run resumed from it on 2 ranks (losses bit-exact
against the uninterrupted 2-rank run) and on 1 process with `training.virtual_ranks=2` (bit-exact: it adds the
gradients as the two ranks did), plus, on the first trials, the plain one-process order (float rounding only). Last
line: one JSON object.

    python bench/preemption.py --data DIR --trials 20 [--steps 24] [--out /tmp/preemption]
    python bench/preemption.py --smoke      # one trial of 6 steps on random-token shards of its own
"""
import argparse, json, os, random, shutil, signal, subprocess, sys, time
from pathlib import Path
from common import add_smoke, apply_smoke, smoke_dir, synthetic_pretraining_data

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "recipes/pretraining/debug.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]

HOOK = """
import json, os, sys
from pathlib import Path
from gradient_garden.train.trainer import Trainer
from gradient_garden.train.run import StopRequest
where, now = Path(sys.argv.pop(1)), {"step": 0}
real_step, real_handle = Trainer.train_step, StopRequest._handle
def train_step(self):
    now["step"] = self.state.step + 1          # the step in progress
    out = real_step(self)
    now["step"] = self.state.step              # its logging and agreement
    return out
def handle(self, signum, frame):
    if self.signum is None: (where/f"rank{os.environ['RANK']}").write_text(str(now["step"]))
    return real_handle(self, signum, frame)
Trainer.train_step, StopRequest._handle = train_step, handle
from gradient_garden.cli import main
sys.exit(main(sys.argv[1:]))
"""


def sets(data: Path, out: Path, steps: int) -> list[str]:
    s = {"paths.datasets": data/"datasets", "tokenizer.path": data/"tokenizer", "paths.evals": data/"evals",
         "paths.runs": out/"runs", "training.max_steps": steps, "training.log_every": 1, "model.dim": 64,
         "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2, "model.max_seq_len": 64,
         "training.seq_len": 64, "training.micro_batch_size": 4, "training.total_batch_size": 1024,
         "validation.enabled": False, "generation.every": 0, "checkpointing.every": 1000,
         "optimizers.adamw.warmup_steps": 2, "runtime.device": "cpu",
         "runtime.stop_check_s": 0.05}   # agree on a stop within a step or two of the signal, as the trials expect
    return [f"{k}={v}" for k, v in s.items()]


def run_dir(out: Path) -> Path: return out/"runs"/"pretraining"/"debug"


def losses(out: Path) -> dict:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir(out)/"metrics.jsonl").read_text().splitlines())}


def gg(launcher, args, **kw):
    r = subprocess.run(launcher + ["-m", "gradient_garden.cli", "train", "--recipe", RECIPE, *args], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=900, **kw)
    if r.returncode != 0:   # the ranks' own error lines, not only the launcher's traceback that follows them
        errors = [l for l in r.stderr.splitlines() if "error" in l.lower()][:5]
        raise RuntimeError("\n".join(errors) + "\n" + r.stderr[-2000:])


def trial(data, base: Path, steps: int, full: dict, at: int, with_plain: bool = False) -> dict:
    out, hook = base/"cut", base/"signalled"
    shutil.rmtree(base, ignore_errors=True); hook.mkdir(parents=True)
    (base/"hook.py").write_text(HOOK)
    proc = subprocess.Popen(TORCHRUN + [str(base/"hook.py"), str(hook), "train", "--recipe", RECIPE, "--set",
                                        *sets(data, out, steps)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    m = run_dir(out)/"metrics.jsonl"
    while not (m.is_file() and len(m.read_text().splitlines()) >= at):
        if proc.poll() is not None: raise RuntimeError(proc.communicate()[1][-2000:])
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGTERM)                       # to torchrun, which passes it on to every worker
    _, err = proc.communicate(timeout=300)
    signalled = min(int((hook/f"rank{r}").read_text()) for r in (0, 1))
    ck = sorted((run_dir(out)/"checkpoints").iterdir()) if (run_dir(out)/"checkpoints").is_dir() else []
    ck_step = int(ck[-1].name.split("_")[1].split(".")[0]) if ck else None
    res = dict(at_row=at, signalled_step=signalled, checkpoint_step=ck_step, returncode=proc.returncode,
               stop_line=next((l for l in err.splitlines() if l.startswith("stopped by")), None))
    res["checkpoint_ok"] = ck_step is not None and ck_step - signalled in (0, 1)
    if ck_step is None: return res
    two, one, plain = base/"two", base/"one", base/"plain"
    for d in (two, one) + ((plain,) if with_plain else ()): shutil.copytree(out, d)
    gg(TORCHRUN, ["--checkpoint", run_dir(two), "--set", *sets(data, two, steps)])
    gg([sys.executable], ["--checkpoint", run_dir(one), "--set", *sets(data, one, steps), "training.virtual_ranks=2"])
    l2, l1 = losses(two), losses(one)
    res["resume_2_ranks_exact"] = sorted(l2) == list(range(1, steps + 1)) and all(l2[s] == full[s] for s in full)
    res["resume_1_rank_max_rel"] = max(abs(l1[s] - full[s]) / abs(full[s]) for s in full)
    res["resume_1_rank_exact"] = sorted(l1) == list(range(1, steps + 1)) and all(l1[s] == full[s] for s in full)
    if with_plain:   # one process adding the micro-batches in its own order
        gg([sys.executable], ["--checkpoint", run_dir(plain), "--set", *sets(data, plain, steps)])
        lp = losses(plain)
        res["resume_1_rank_plain_max_rel"] = max(abs(lp[s] - full[s]) / abs(full[s]) for s in full)
        res["resume_1_rank_plain_exact"] = all(lp[s] == full[s] for s in full)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--data", default=None,
                    help="a `gg prepare` of recipes/pretraining/debug.yaml (datasets/, tokenizer/)")
    ap.add_argument("--out", default="/tmp/gg_preemption")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plain-trials", type=int, default=3,
                    help="trials that also resume in the plain one-process order")
    a = apply_smoke(add_smoke(ap).parse_args(), trials=1, steps=6, plain_trials=1)
    if a.smoke:   # random-token shards and a small BPE in `gg prepare`'s layout, everything in a temporary folder
        a.out = str(smoke_dir("preemption"))
        if a.data is None: a.data = str(smoke_dir("preemption_data"))   # not under --out, which is emptied first
        if not (Path(a.data)/"datasets").is_dir(): synthetic_pretraining_data(a.data, 1024, 50_000)
    if a.data is None: ap.error("--data is required (a `gg prepare` of recipes/pretraining/debug.yaml)")
    data, out = Path(a.data), Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    gg(TORCHRUN, ["--set", *sets(data, out/"full", a.steps)])
    full = losses(out/"full")
    rng, rows = random.Random(a.seed), []
    for i in range(a.trials):
        rows.append(trial(data, out/f"t{i}", a.steps, full, rng.randint(2, a.steps - 4), with_plain=i < a.plain_trials))
        print(json.dumps(rows[-1]), flush=True)
    summary = dict(bench="preemption", smoke=a.smoke, trials=len(rows),
                   checkpoint_at_signalled_or_next=sum(r["checkpoint_ok"] for r in rows),
                   lost=sum(r["checkpoint_step"] is None for r in rows),
                   resumed_2_ranks_exact=sum(r.get("resume_2_ranks_exact", False) for r in rows),
                   resumed_1_rank_exact=sum(r.get("resume_1_rank_exact", False) for r in rows),
                   resumed_1_rank_max_rel=max((r.get("resume_1_rank_max_rel", 1.0) for r in rows), default=None),
                   plain_1_rank_exact=sum(r.get("resume_1_rank_plain_exact", False) for r in rows
                                          if "resume_1_rank_plain_exact" in r),
                   plain_1_rank_max_rel=max((r["resume_1_rank_plain_max_rel"] for r in rows
                                             if "resume_1_rank_plain_max_rel" in r), default=None),
                   checkpoint_minus_signalled=sorted(r["checkpoint_step"] - r["signalled_step"] for r in rows
                                                     if r["checkpoint_step"]))
    print(json.dumps(summary))


if __name__ == "__main__": main()
