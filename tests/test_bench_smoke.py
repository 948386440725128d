"""Every script in bench/ runs with `--smoke` (tiny shapes, one or two repeats, the same code as the real run) and ends
in its one JSON line, so that none rots between the times someone measures with it. The scripts are found by listing
bench/*.py: a new script fails here until it has a smoke mode and an entry in `EXPECTED`. `bench/gpu.sh --smoke` has its
own test (tests/test_gpu_bench.py). Each run's working and temporary folders are the test's own; nothing may be written
into the repository."""
import json, os, subprocess, sys
import pytest
from conftest import ROOT

BENCH = ROOT/"bench"
NOT_SCRIPTS = {"common.py": "the helpers the scripts share (parsers, --smoke, synthetic shards), not a benchmark"}

# the keys each script's last stdout line must hold (besides "smoke": true)
EXPECTED = {
    "activation_checkpointing.py": ["parameters", "modes"],
    "calculator.py": ["with_tool", "without_tool"],
    "checkpoint.py": ["full", "sharded", "async", "async_blocked_over_full"],
    "cpu_matmul.py": ["us_per_call", "gemm_gflops"],
    "evals.py": ["reference", "tasks"],
    "flex_attention.py": ["medians", "max_abs_diff_vs_sdpa", "flex_training"],
    "fsdp_memory.py": ["ddp_adamw", "fsdp2_adamw", "fsdp2_over_ddp_adamw", "fsdp2_over_ddp_muon"],
    "fused_memory.py": ["layout", "peak_bytes", "gathered_copy_term_bytes"],
    "generate.py": ["tokens_per_s", "ratio_vs_hf", "token_agreement"],
    "generate_versions.py": ["results"],
    "gpu_legs.py": ["peak", "train_124m", "train_400m", "decode", "attention", "rl_124m"],
    "model_step.py": ["step_ms", "ratio_vs_llama", "mfu", "peak_memory_mb"],
    "moe_step.py": ["step_ms", "ratio_vs_dense", "tokens_per_s"],
    "muon.py": ["worlds", "ns_flops_per_rank_ratio", "step_time_ratio", "critical_path_over_ideal"],
    "plan_memory.py": ["rows"],
    "precision_step.py": ["step_ms", "fp32_over_bf16"],
    "preemption.py": ["trials", "checkpoint_at_signalled_or_next", "resumed_2_ranks_exact"],
    "prepare.py": ["stream_1x", "naive_1x", "stream_peak_ratio", "embedded_default"],
    "rl.py": ["ours", "ours_over_trl"],
    "rl_control.py": ["control_loss", "zeroed_advantages_loss", "with_sampled_rows_loss"],
    "rl_curves.py": ["train_records", "validations"],
    "sampling.py": ["shapes", "frequency_gap", "frequency_gap_5_sigma"],
    "save_grace.py": ["durable_s", "exit_s", "plan_estimate_s", "checkpoint_bytes", "plan_checkpoint_bytes"],
    "scale_124m.py": ["resume_2ranks_equal", "resume_1rank_max_rel", "hf_max_abs_logit_diff"],
    "serve.py": ["results", "target_8x_ge_4"],
    "sft_packing.py": ["supervised_tokens_per_s", "speedup_packing_vs_padding"],
    "startup_memory.py": ["peak_ratio", "whole_peak_mib", "meta_peak_mib"],
    "stop_agreement.py": ["worlds", "model_512"],
    "train_loop.py": ["ratio", "bare_tokens_per_s", "trainer_tokens_per_s"],
}
# the heavier ones (each starts several trainings or a full `gg prepare`); CI still runs them
SLOW = {"preemption.py", "prepare.py", "scale_124m.py"}

SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name not in NOT_SCRIPTS)


def repo_files() -> dict:
    "What a smoke run must leave alone: bench/ (bytecode aside) and the data and run folders of the checkout."
    files = {p: p.stat().st_mtime_ns for p in BENCH.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    return files | {ROOT/d: None for d in ("data", "runs") if (ROOT/d).exists()}


def test_every_bench_script_has_a_smoke_test():
    assert set(SCRIPTS) == set(EXPECTED), (
        f"bench scripts without a smoke entry: {sorted(set(SCRIPTS) - set(EXPECTED))}; entries of no script: "
        f"{sorted(set(EXPECTED) - set(SCRIPTS))}. Give a new script `--smoke` (bench/common.py) and add it to EXPECTED")


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s for s in SCRIPTS])
def test_bench_smoke(script, tmp_path):
    assert script in EXPECTED, f"bench/{script} has no smoke entry: give it `--smoke` and add it to EXPECTED"
    before = repo_files()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONDONTWRITEBYTECODE": "1",
           "TMPDIR": str(tmp_path), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, str(BENCH/script), "--smoke"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"bench/{script} --smoke failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    lines = r.stdout.strip().splitlines()
    assert lines, r.stderr[-3000:]
    res = json.loads(lines[-1])
    assert res.get("smoke") is True, res
    missing = [k for k in EXPECTED[script] if k not in res]
    assert not missing, (missing, sorted(res))
    assert repo_files() == before, "a smoke run wrote into the repository"
