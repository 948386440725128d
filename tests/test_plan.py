"""`gg plan` on every recipe, the one-line answers for a plan that does not fit or an unknown GPU, `gg train`
refusing a run that does not fit before it builds the model, the plan's communication, Muon and grace-period lines,
and the time from SIGTERM to a durable checkpoint on 2 gloo ranks (bench/save_grace.py --smoke, about 20 s)."""
import pytest
from conftest import ROOT, run_gg
from gradient_garden.recipes import load_recipe
from gradient_garden.train.plan import plan, format_plan, fit_message

RECIPES = sorted(str(p.relative_to(ROOT)) for p in (ROOT/"recipes").rglob("*.yaml"))

@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_plans(recipe):
    cfg = load_recipe(ROOT/recipe).config
    gpus = 8 if cfg.training.total_batch_size % (cfg.training.micro_batch_size * cfg.training.seq_len * 8) == 0 else 1
    p = plan(cfg, "H100", gpus_per_node=gpus)
    text = format_plan(p)
    assert p.fits, fit_message(p)
    assert text.splitlines()[0].startswith(f"{cfg.run.name}: {p.counts['total']:,} parameters")
    assert "FLOPs per token" in text and "Chinchilla" in text and text.splitlines()[-1].startswith("fits:")

def test_gg_plan_hsdp_and_measured_mfu(tmp_path):
    metrics = tmp_path/"metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 3.0, "mfu": 0.30}\n{"step": 2, "loss": 2.9, "mfu": 0.50}\n{"step": 3, '
                       '"mfu": 0.52}\n')
    r = run_gg("plan", "--recipe", "recipes/pretraining/tendril-1b.yaml", "--gpu", "H200", "--gpus-per-node", "8",
               "--nodes", "2", "--mfu-from", metrics)
    lines = r.stdout.splitlines()
    header = next(l for l in lines if l.startswith("GiB per rank")).split()   # one column per layout
    assert "hsdp" in header and "fsdp2" in header
    assert "at 50% MFU (measured in" in r.stdout and "16 x H200 (2 nodes x 8)" in r.stdout

def test_plan_that_does_not_fit_says_what_would():
    r = run_gg("plan", "--recipe", "recipes/pretraining/tendril-1b.yaml", "--gpu", "L40S", "--set",
               "runtime.activation_checkpointing=none", "training.micro_batch_size=32",
               "training.total_batch_size=1048576",
               check=False)
    assert r.returncode == 1
    last = r.stdout.splitlines()[-1]
    assert last.startswith("does not fit: needs") and "L40S" in last and "; try " in last, last

def test_unknown_gpu_is_one_line():
    r = run_gg("plan", "--recipe", "recipes/pretraining/tendril-124m.yaml", "--gpu", "B300", check=False)
    assert r.returncode == 2 and r.stderr.strip() == "error: --gpu: got 'B300'; known: H200, H100, A100, L40S, cpu"

def test_train_refuses_a_run_that_does_not_fit(prepared, tmp_path):
    # micro batch 32768 x 256 tokens of the debug model: ~1 TB of activations; refused before the model is built
    r = run_gg("train", "--recipe", "recipes/pretraining/debug.yaml", "--set", *prepared["sets"],
               f"paths.runs={tmp_path}",
               "runtime.device=cpu", "training.micro_batch_size=32768", "training.total_batch_size=8388608",
               check=False, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [l for l in r.stderr.splitlines() if l.strip()]
    assert err[-1].startswith("error: runtime: does not fit: needs") and "try " in err[-1], err[-3:]
    assert not (tmp_path/"pretraining").exists()

def test_gg_plan_communication_muon_and_grace():
    args = ("plan", "--recipe", "recipes/pretraining/tendril-1b.yaml", "--gpus-per-node", "8", "--nodes", "2")
    out = run_gg(*args).stdout.splitlines()
    row = next(l for l in out if l.startswith("replicate all_reduce"))   # once per step, across the nodes
    assert row.endswith("(InfiniBand)") and 0.5 < float(row.split()[2]) < 0.6, row   # GB: 4 x 1.08B / 8
    assert next(l for l in out if l.startswith("shard reduce_scatter")).endswith("(NVLink)")
    assert any(l.startswith("Muon step (modelled, replicate x shard 2 x 8): ideal") for l in out)
    assert any(l.startswith("a stop (SIGTERM) takes up to") and "within the 30 s grace period" in l for l in out)
    slow = run_gg(*args, "--storage-gbps", "0.05", "--grace-s", "20").stdout.splitlines()
    warned = [l for l in slow if l.startswith("warning:")]
    assert len(warned) == 1 and "over the 20 s grace period (--grace-s)" in warned[0] and "0.05 GB/s" in warned[0]
    bad = run_gg(*args, "--grace-s", "0", check=False)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --grace-s: got 0.0; must be > 0"

def test_sigterm_to_a_durable_checkpoint_on_two_ranks():
    "bench/save_grace.py --smoke: SIGTERM to torchrun over 2 gloo ranks, timed until the checkpoint is committed."
    import json, subprocess, sys
    r = subprocess.run([sys.executable, "save_grace.py", "--smoke"], cwd=ROOT/"bench", capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.splitlines()[-1])
    assert 0 < res["durable_s"] <= res["exit_s"] < 120, res
    assert abs(res["checkpoint_bytes"] / res["plan_checkpoint_bytes"] - 1) < 0.05, res   # the plan counts the bytes
