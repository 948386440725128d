"""One run per directory (refusal, --overwrite, the lock, resume rolls the directory back) and bad input that used to
be accepted silently or end in a traceback, each as the one line a user now gets."""
import contextlib, io, json, os, socket, subprocess, sys
from pathlib import Path
import pytest
from conftest import ROOT, run_gg
from gradient_garden.cli import main
from gradient_garden.recipes import load_config

RECIPE = "recipes/pretraining/debug.yaml"

def sets(prepared, out: Path, steps=4, **extra):
    "A small, fast run writing under `out`."
    s = {"paths.runs": out/"runs", "training.max_steps": steps, "training.log_every": 1, "model.dim": 64,
         "model.n_layers": 2,
         "model.n_heads": 4, "model.n_kv_heads": 2, "model.max_seq_len": 64, "training.seq_len": 64,
         "training.micro_batch_size": 4, "training.total_batch_size": 1024, "validation.every": 2,
         "validation.steps": 1,
         "generation.every": 0, "checkpointing.every": 2, "checkpointing.keep_last": 1,
         "optimizers.adamw.warmup_steps": 1,
         "runtime.device": "cpu", **extra}
    return prepared["sets"] + [f"{k}={v}" for k, v in s.items()]

def run_dir(out: Path) -> Path: return out/"runs"/"pretraining"/"debug"

def steps_logged(out: Path) -> list[int]:
    return [json.loads(l)["step"] for l in (run_dir(out)/"metrics.jsonl").read_text().splitlines()]

def ckpts(out: Path) -> list[str]: return sorted(p.name for p in (run_dir(out)/"checkpoints").glob("step_*.pt"))

def test_a_directory_holds_one_run(prepared, tmp_path):
    run_gg("train", "--recipe", RECIPE, "--set", *sets(prepared, tmp_path))
    r = run_gg("train", "--recipe", RECIPE, "--set", *sets(prepared, tmp_path, steps=2), check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"error: {run_dir(tmp_path)} holds another run (training.max_steps is 4 there, 2 now): start this one beside "
        f"it with --set run.name=NEW_NAME, replace that one with --overwrite, or continue it with these settings with "
        f"--checkpoint {run_dir(tmp_path)}")
    assert steps_logged(tmp_path) == [1, 2, 3, 4]  # untouched
    r = run_gg("train", "--recipe", RECIPE, "--overwrite", "--set", *sets(prepared, tmp_path, steps=2))
    assert "--overwrite: removed the previous run" in r.stderr
    assert steps_logged(tmp_path) == [1, 2] and ckpts(tmp_path) == ["step_0000002.pt"]

def test_resume_rolls_the_directory_back(prepared, tmp_path):
    "A resume from step 2 of a run that reached step 4 (a crash, kill -9): rows once each, the new checkpoint kept."
    run_gg("train", "--recipe", RECIPE, "--set", *sets(prepared, tmp_path, **{"checkpointing.keep_last": 2}))
    ck = run_dir(tmp_path)/"checkpoints"
    assert ckpts(tmp_path) == ["step_0000002.pt", "step_0000004.pt"]
    r = run_gg("train", "--recipe", RECIPE, "--checkpoint", ck/"step_0000002.pt", "--set",
               *sets(prepared, tmp_path, steps=3))  # keep_last=1: retention must keep what it just wrote
    assert "dropped 2 metric rows" in r.stderr and "moved 1 later checkpoints" in r.stderr, r.stderr
    assert steps_logged(tmp_path) == [1, 2, 3]
    assert ckpts(tmp_path) == ["step_0000003.pt"]
    assert [p.name for p in (ck/"superseded").iterdir()] == ["step_0000004.pt"]

def test_lock_refuses_a_second_writer_and_recognises_a_stale_one(prepared, tmp_path):
    d = run_dir(tmp_path); d.mkdir(parents=True)
    (d/".lock").write_text(json.dumps(dict(pid=os.getpid(), host=socket.gethostname(), since=0)))  # this test: alive
    r = run_gg("train", "--recipe", RECIPE, "--set", *sets(prepared, tmp_path, steps=1), check=False)
    assert r.returncode == 2 and f"another run is writing here (pid {os.getpid()} on {socket.gethostname()}" in r.stderr
    assert "Traceback" not in r.stderr
    gone = subprocess.Popen([sys.executable, "-c", "pass"]); gone.wait()
    (d/".lock").write_text(json.dumps(dict(pid=gone.pid, host=socket.gethostname(), since=0)))
    r = run_gg("train", "--recipe", RECIPE, "--set", *sets(prepared, tmp_path, steps=1))
    assert f"removed a stale lock (pid {gone.pid} is no longer running)" in r.stderr
    assert not (d/".lock").exists()  # released at the end

def gg_error(*argv) -> str:
    "Run `gg ARGV` in this process; the stderr of a run that must fail with status 2."
    err = io.StringIO()
    with contextlib.redirect_stderr(err): rc = main([str(a) for a in argv])
    assert rc == 2, (rc, err.getvalue())
    assert "Traceback" not in err.getvalue() and len(err.getvalue().strip().splitlines()) == 1, err.getvalue()
    return err.getvalue().strip()

@pytest.mark.parametrize("override,expected", [
    ("training.grad_clip=-1", "error: training.grad_clip: got -1.0; must be >= 0 (0 or null turns clipping off; a "
                              "negative clip reverses the gradient)"),
    ("optimizers.adamw.max_lr=-0.003", "error: optimizers.adamw.max_lr: got -0.003; must be > 0"),
    ("optimizers.adamw.max_lr=.nan", "error: optimizers.adamw.max_lr: got nan; must be a finite number"),
    ("optimizers.adamw.min_lr=-1e-4", "error: optimizers.adamw.min_lr: got -0.0001; must be >= 0"),
    ("checkpointing.keep_last=0",
     "error: checkpointing.keep_last: got 0; must be >= 1 (the checkpoint just written is always kept)"),
    ("training.seed=-3", f"error: training.seed: got -3; must be in [0, {2**32 - 1}]"),
    ("generation.temperature=-1.0", "error: generation.temperature: got -1.0; must be >= 0"),
    ("evals.every=-1", "error: evals.every: got -1; must be >= 0"),
    ("run.name=../x",
     "error: run.name: got '../x'; must be a plain directory name (no '/', not empty, not '.' or '..')"),
    ("model.norm_eps=0", "error: model.norm_eps: got 0.0; must be > 0"),
])
def test_values_out_of_range_are_one_line(override, expected):
    assert gg_error("train", "--recipe", RECIPE, "--set", override) == expected

def test_start_step_and_a_finished_checkpoint(prepared, tmp_path):
    assert gg_error("train", "--recipe", RECIPE, "--start-step", "-5", "--set", *sets(prepared, tmp_path)) == \
        "error: --start-step: got -5; must be in [0, training.max_steps = 4)"
    run_gg("train", "--recipe", RECIPE, "--set", *sets(prepared, tmp_path, steps=2))
    assert gg_error("train", "--recipe", RECIPE, "--checkpoint", run_dir(tmp_path), "--set",
                    *sets(prepared, tmp_path, steps=2)) == \
        ("error: --checkpoint: the checkpoint is at step 2, already at training.max_steps = 2; raise "
         "training.max_steps to train further")

def test_malformed_yaml_is_one_line(tmp_path):
    bad = tmp_path/"r.yaml"; bad.write_text("name: x\nconfig:\n  training: {max_steps: 20\n  model: {dim: 64}\n")
    assert gg_error("train", "--recipe", bad) == \
        (f"error: {bad}: not valid YAML: expected ',' or '}}', but got ':' at line 4, column 8 (while parsing a flow "
         "mapping)")

def test_short_run_clamps_warmup_with_one_line(capsys):
    cfg, _ = load_config(recipe=RECIPE, overrides=["training.max_steps=10"])
    assert cfg.optimizers.adamw.warmup_steps == 1
    assert capsys.readouterr().err == ("note: optimizers.adamw.warmup_steps 20 > training.max_steps 10: warming up "
                                       "over "
                                       "1 step (10% of the run) instead\n")

def test_rows_without_text_are_counted_and_refused_past_the_threshold(prepared, tmp_path):
    rows = tmp_path/"corpus.jsonl"
    rows.write_text("".join(json.dumps({"id": i, **({} if i % 40 == 0 else {"text": f"document {i} " * 20})}) + "\n"
                            for i in range(200)))  # 5 of 200 rows (2.5%) lack "text"
    (tmp_path/"r.yaml").write_text("name: holes\ndata:\n  target_tokens: 100000\n  val_fraction: 0.1\n  shard_tokens: "
                                   "4096\n"
                                   f"  mix: [{{type: local, name: corpus, files: '{rows}'}}]\n")
    base = [f"tokenizer.path={prepared['base']/'tokenizer'}", f"paths.datasets={tmp_path/'datasets'}"]
    r = run_gg("prepare", "--recipe", tmp_path/"r.yaml", "--set", *base, check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (  # after prepare's own progress bar
        "error: data.mix[0].text_field: 5 of 200 rows of 'corpus' lack 'text' (2.5%, more than "
        "data.max_missing_fraction "
        "= 0.01); fix the rows, pick another text_field, or raise data.max_missing_fraction"), r.stderr
    r = run_gg("prepare", "--recipe", tmp_path/"r.yaml", "--set", *base, "data.max_missing_fraction=0.05")
    assert "note: corpus: skipped 5 of 200 rows that lack the text field" in r.stderr, r.stderr

def test_resume_rolls_back_a_sharded_run(prepared, tmp_path):
    "The same rollback for sharded checkpoint directories, also when an earlier resume left a copy in superseded/."
    sharded = {"checkpointing.format": "sharded", "checkpointing.keep_last": 2}
    run_gg("train", "--recipe", RECIPE, "--set", *sets(prepared, tmp_path, **sharded))
    ck = run_dir(tmp_path)/"checkpoints"
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_0000002", "step_0000004"]
    (ck/"superseded"/"step_0000004").mkdir(parents=True); (ck/"superseded"/"step_0000004"/"old").write_text("x")
    r = run_gg("train", "--recipe", RECIPE, "--checkpoint", ck/"step_0000002", "--set",
               *sets(prepared, tmp_path, steps=3, **{**sharded, "checkpointing.keep_last": 1}))
    assert "dropped 2 metric rows" in r.stderr and "moved 1 later checkpoints" in r.stderr, r.stderr
    assert steps_logged(tmp_path) == [1, 2, 3]
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_0000003"]  # retention kept what it just wrote
    moved = ck/"superseded"/"step_0000004"
    assert (moved/"COMPLETE").is_file() and not (moved/"old").exists()  # the newer copy replaced the older one

def test_torchrun_says_a_config_error_once():
    ("2 gloo ranks, a bad --set: the one line once (rank 0); torchrun's failure table points at it, not at a traceback "
     "hint.")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                "gradient_garden.cli"]
    r = subprocess.run(torchrun + ["train", "--recipe", RECIPE, "--set", "training.grad_clip=-1"], cwd=ROOT,
                       capture_output=True,
                       text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = ("error: training.grad_clip: got -1.0; must be >= 0 (0 or null turns clipping off; a negative clip reverses "
            "the gradient)")
    seen = r.stdout + r.stderr
    assert r.returncode != 0 and seen.count(line) == 1 and seen.count("training.grad_clip") == 1, seen
    assert seen.strip().splitlines()[0] == line  # the first thing a user reads; torchrun's summary follows it
    assert "To enable traceback" not in seen and "Root Cause" in seen, seen
    assert "traceback : exit status 2: bad input, said in one 'error:' line above\n" in seen
    assert "traceback : exit status 2: bad input, said in one 'error:' line above (by rank 0)" in seen

PEAK_THAT_RISES = """
import sys, torch
import gradient_garden.hardware as hw
seen = {}
def measure(device=torch.device("cpu"), n=1024, reps=5, dtype=torch.float32, refresh=False):
    "A busy machine getting quieter: every new measurement reads 10x the last."
    key = (str(device), n, dtype)
    if key not in seen or refresh: seen[key] = 1e11 * 10 ** sum(1 for k in seen if k == key)
    return seen[key]
hw.measure_matmul_peak = measure
from gradient_garden.cli import main
sys.exit(main(sys.argv[1:]))
"""

def test_mfu_rows_and_summary_divide_by_one_peak(prepared, tmp_path):
    "The peak is measured once per run: every row's MFU / tokens/s and the summary's are the same FLOPs-per-peak ratio."
    r = subprocess.run([sys.executable, "-c", PEAK_THAT_RISES, "train", "--recipe", RECIPE, "--set",
                        *sets(prepared, tmp_path)],
                       cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.splitlines()
    said = [l for l in out if l.startswith("mfu: against a peak of ")]
    assert len(said) == 1 and "0.1 TFLOP/s per process" in said[0] and "measured once at the start" in said[0], out
    rows = [json.loads(l) for l in (run_dir(tmp_path)/"metrics.jsonl").read_text().splitlines()]
    ratios = [x["mfu"] / x["tokens_per_s"] for x in rows if "mfu" in x]
    # validation at steps 2 and 4 measured nothing again
    assert len(ratios) == 4 and max(ratios) / min(ratios) - 1 < 1e-9, rows
    tps = float(next(l for l in out if l.startswith("tokens/s ")).split()[-1].replace(",", ""))
    mfu = float(next(l for l in out if l.startswith("MFU ")).split()[-1].rstrip("%")) / 100
    assert abs(mfu / tps / ratios[0] - 1) < 0.02, (mfu, tps, rows)
