("float8 training through torchao (emulated on CPU): a run with runtime.float8 resumes exactly and says so; the debug "
 "recipe trains like bf16; FSDP2's float8 all-gather gives one process's loss; the plan names it.")
import json, os, subprocess, sys
from pathlib import Path
import pytest
import torch
from conftest import ROOT, run_gg

RECIPE = "recipes/pretraining/debug.yaml"


def quick(prepared, out: Path, steps: int, **extra) -> list[str]:
    "Overrides for a short CPU run of the debug recipe writing under `out` (no validation, evals or samples)."
    s = prepared["sets"] + [f"paths.runs={out/'runs'}", f"training.max_steps={steps}", "training.log_every=1",
                            "validation.enabled=false", "evals.every=0", "generation.every=0",
                            "optimizers.adamw.warmup_steps=2", "runtime.precision=bf16"]
    return s + [f"{k}={v}" for k, v in extra.items()]


def losses(out: Path) -> dict[int, float]:
    "step -> training loss of the run under `out`."
    rows = map(json.loads, (out/"runs"/"pretraining"/"debug"/"metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_a_float8_run_resumes_exactly_and_says_so(prepared, tmp_path):
    "Rowwise float8, 6 steps; resumed from step 3 it logs the uninterrupted run's losses bit for bit."
    f8 = {"runtime.float8": "rowwise", "training.total_batch_size": 2048, "checkpointing.every": 3}
    full = run_gg("train", "--recipe", RECIPE, "--set", *quick(prepared, tmp_path/"full", 6, **f8))
    assert "float8: rowwise scaling in the Linear layers (emulated" in full.stdout
    assert "float8      rowwise scaling" in full.stdout                       # the summary table's row
    run_dir = tmp_path/"full"/"runs"/"pretraining"/"debug"
    assert json.loads((run_dir/"snapshot.json").read_text())["precision"]["float8"] == "rowwise"
    ckpt = run_dir/"checkpoints"/"step_0000003.pt"
    run_gg("train", "--recipe", RECIPE, "--checkpoint", ckpt, "--set", *quick(prepared, tmp_path/"resumed", 6, **f8))
    a, b = losses(tmp_path/"full"), losses(tmp_path/"resumed")
    assert sorted(b) == [4, 5, 6]
    for s in b: assert a[s] == b[s], (s, a[s], b[s])


def test_float8_with_lora_is_one_line(prepared, tmp_path):
    r = run_gg("train", "--recipe", RECIPE, "--set", *quick(prepared, tmp_path, 2), "runtime.float8=tensorwise",
               "lora.enabled=true", check=False)
    assert r.returncode == 2 and "runtime.float8: got 'tensorwise' with lora.enabled" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow   # three 50-step runs of the debug recipe: about 20 minutes on a shared 2-core CPU, so not in CI
@pytest.mark.skipif(os.environ.get("GG_LONG") != "1", reason="GG_LONG=1: three 50-step runs (figures in RESULTS.md)")
def test_fifty_debug_steps_in_float8_end_within_one_percent_of_bf16(prepared, tmp_path):
    "The debug recipe (its model, 4096-token steps) for 50 steps: bf16 against bf16 + float8, each recipe."
    runs = {}
    for f8 in ("none", "tensorwise", "rowwise"):
        run_gg("train", "--recipe", RECIPE, "--set",
               *quick(prepared, tmp_path/f8, 50, **{"runtime.float8": f8, "training.total_batch_size": 4096}))
        runs[f8] = losses(tmp_path/f8)
    last = {k: sum(v[s] for s in range(46, 51)) / 5 for k, v in runs.items()}   # the mean of the last 5 steps
    print(last)
    for f8 in ("tensorwise", "rowwise"):
        assert abs(last[f8] / last["none"] - 1) < 0.01, last
        assert runs[f8][1] != runs["none"][1]                                   # float8 did change the numbers


def _fsdp_worker(rank, world, out):
    "FSDP2 over 2 gloo ranks, tensorwise float8 with the float8 all-gather: three AdamW steps; rank 0 saves the losses."
    from gradient_garden.config import ModelConfig
    from gradient_garden.models.float8 import apply_float8
    from gradient_garden.models.tendril import Tendril
    from gradient_garden.parallel.distributed import apply_fsdp
    torch.manual_seed(0)
    model = Tendril(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32,
                                max_seq_len=32))
    apply_float8(model, "tensorwise", emulate=True, fsdp_all_gather=True)
    apply_fsdp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 256, (3, 4, 17), generator=torch.Generator().manual_seed(1))
    got = []
    for b in data:
        mine = b[2 * rank:2 * rank + 2]
        loss = model(mine[:, :-1], labels=mine[:, 1:]) / mine[:, 1:].numel()
        opt.zero_grad(); loss.backward(); opt.step()
        t = loss.detach().clone(); torch.distributed.all_reduce(t); got.append(t.item() / world)
    if rank == 0: torch.save(got, Path(out)/"fsdp.pt")


def test_fsdp2_float8_all_gather_gives_one_process_losses(tmp_path):
    ("Two gloo ranks with the float8 all-gather against one process running each rank's half on its own (an input's "
     "tensorwise scale is its rank's own), averaged.")
    script = (f"import sys; sys.path[:0] = [{str(ROOT/'tests')!r}]\nfrom gloo_ranks import run_ranks\n"
              f"from test_float8 import _fsdp_worker\n"
              f"run_ranks(_fsdp_worker, 2, {str(tmp_path/'pg')!r}, {str(tmp_path)!r})")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    from gradient_garden.config import ModelConfig
    from gradient_garden.models.float8 import apply_float8
    from gradient_garden.models.tendril import Tendril
    torch.manual_seed(0)
    model = Tendril(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32,
                                max_seq_len=32))
    apply_float8(model, "tensorwise", emulate=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 256, (3, 4, 17), generator=torch.Generator().manual_seed(1))
    one = []
    for b in data:
        loss = sum(model(h[:, :-1], labels=h[:, 1:]) / h[:, 1:].numel() for h in b.split(2)) / 2
        opt.zero_grad(); loss.backward(); opt.step(); one.append(loss.item())
    two = torch.load(tmp_path/"fsdp.pt")
    for a, b in zip(one, two): assert abs(a - b) < 1e-5 * a, (one, two)


def torchrun_gg(*args, nproc: int = 2) -> subprocess.CompletedProcess:
    "`gg ARGS` under torchrun on `nproc` local gloo ranks."
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "gradient_garden.cli", *map(str, args)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def test_fsdp2_float8_run_resumes_exactly_from_its_sharded_checkpoint(prepared, tmp_path):
    "`gg train` on 2 ranks with FSDP2's float8 all-gather, 4 steps; resumed from step 2 the losses are the same."
    f8 = {"runtime.float8": "tensorwise", "runtime.fsdp": "true", "training.total_batch_size": 4096,
          "checkpointing.every": 2}
    torchrun_gg("train", "--recipe", RECIPE, "--set", *quick(prepared, tmp_path/"full", 4, **f8))
    ckpt = tmp_path/"full"/"runs"/"pretraining"/"debug"/"checkpoints"/"step_0000002"
    assert ckpt.is_dir()
    torchrun_gg("train", "--recipe", RECIPE, "--checkpoint", ckpt, "--set",
                *quick(prepared, tmp_path/"resumed", 4, **f8))
    a, b = losses(tmp_path/"full"), losses(tmp_path/"resumed")
    assert sorted(b) == [3, 4] and all(a[s] == b[s] for s in b), (a, b)


def test_the_plan_names_float8():
    from gradient_garden.recipes import load_recipe
    from gradient_garden.train.plan import format_plan, plan
    cfg = load_recipe(ROOT/"recipes/pretraining/tendril-124m.yaml").config
    cfg.runtime.float8 = "tensorwise"
    assert "precision bf16 + float8 tensorwise Linear matmuls" in format_plan(plan(cfg, "H100", 8))
