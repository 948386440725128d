"""A stage defined outside the package, in a user's own module, named by a recipe (`training.stage: module:attr`):
`gg train` runs it, a resumed run equals the uninterrupted one bit for bit, and `gg plan` plans it with the stage's
own rows and lines."""
import json, textwrap
import torch
from conftest import run_gg

PLUGIN = textwrap.dedent('''
    "A user's stage: a causal LM learns to continue rows that repeat a random block of `period` tokens."
    from dataclasses import dataclass
    import torch
    from gradient_garden.stages.base import Stage, StageParts, stage_options
    from gradient_garden.stages.pretraining import CausalLMTask

    @dataclass
    class CopyOptions:
        period: int = 4             # tokens in the block each row repeats

    class CopyLoader:
        "Batches made from a seed and the batch's index, so the state is one number and a resume is exact."
        def __init__(self, batch_size, seq_len, vocab, period, seed, rank, world_size):
            self.shape, self.vocab, self.period = (batch_size, seq_len), vocab, period
            self.seed, self.rank, self.world_size, self.index = seed, rank, world_size, 0
        def _batch(self, index):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + index * self.world_size + self.rank)
            block = torch.randint(3, self.vocab, (self.shape[0], self.period), generator=g)
            rows = block.repeat(1, self.shape[1] // self.period + 2)[:, : self.shape[1] + 1]
            return {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}
        def next_batch(self):
            self.index += 1
            return self._batch(self.index)
        def fixed_batches(self, n): return [self._batch(-1 - i) for i in range(n)]
        def state_dict(self): return {"index": self.index}
        def load_state_dict(self, state): self.index = state["index"]

    def build_copy(cfg, tokenizer, env, model):
        opts, t = stage_options(copy, cfg), cfg.training
        loader = lambda seed: CopyLoader(t.micro_batch_size, t.seq_len, 64, opts.period, seed, env.rank, env.world_size)
        return StageParts(CausalLMTask(), loader(t.seed), loader(t.seed + 1))

    def copy_plan_lines(cfg, world):
        return [f"copy stage: rows repeat a block of {cfg.stage_options.get('period', 4)} tokens"]

    copy = Stage("copy", build_copy, order=1, options=CopyOptions, plan_lines=copy_plan_lines,
                 plan_bytes=lambda cfg, world, sizes: {"copy stage's block table": 4096})
''')

RECIPE = textwrap.dedent('''
    name: copy
    description: a stage from the user's own module
    config:
      model: {dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, vocab_size: 4096, multiple_of: 32, max_seq_len: 64}
      training: {stage: "copy_stage:copy", total_batch_size: 1024, micro_batch_size: 8, seq_len: 64, max_steps: 8,
                 log_every: 1}
      optimizers: {adamw: {warmup_steps: 2}}
      stage_options: {period: 4}
      validation: {every: 4, steps: 1}
      generation: {every: 0}
      runtime: {precision: fp32}
''')


def setup(prepared, tmp_path):
    "The plugin module and its recipe in a folder outside the package; the env that puts the module on the path."
    (tmp_path/"copy_stage.py").write_text(PLUGIN)
    (tmp_path/"copy.yaml").write_text(RECIPE)
    return tmp_path/"copy.yaml", {"PYTHONPATH": str(tmp_path)}

def sets(prepared, out, **extra):
    return prepared["sets"] + [f"paths.runs={out}"] + [f"{k}={v}" for k, v in extra.items()]

def metrics(run_dir):
    return [json.loads(l) for l in (run_dir/"metrics.jsonl").read_text().splitlines()]

def weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def test_a_plugin_stage_trains_resumes_exactly_and_plans(prepared, tmp_path):
    recipe, env = setup(prepared, tmp_path)
    full, part = tmp_path/"full", tmp_path/"part"
    unread = {"checkpointing.every": 8, "dpo.beta": 0.3}     # another stage's section, which the run must name
    r = run_gg("train", "--recipe", recipe, "--set", *sets(prepared, full, **unread), env=env)
    assert "note: dpo: set away from its defaults, but the copy_stage:copy stage does not read it" in r.stderr
    run_dir = full/"copy"/"copy"                        # the run folder is the attribute the recipe names
    recs = metrics(run_dir)
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, 9))
    assert recs[-1]["loss"] < recs[0]["loss"]           # it learns: the blocks repeat
    assert [r["step"] for r in recs if "val_loss" in r] == [4, 8]

    run_gg("train", "--recipe", recipe, "--set",
           *sets(prepared, part, **{"checkpointing.every": 3, "checkpointing.keep_last": 5}), env=env)
    ckpt = part/"copy"/"copy"/"checkpoints"/"step_0000003.pt"
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["stage"] == "copy_stage:copy"
    resumed = tmp_path/"resumed"
    run_gg("train", "--recipe", recipe, "--checkpoint", ckpt, "--set",
           *sets(prepared, resumed, **{"checkpointing.every": 8}), env=env)
    a = {r["step"]: r["loss"] for r in recs if "loss" in r}
    b = {r["step"]: r["loss"] for r in metrics(resumed/"copy"/"copy") if "loss" in r}
    assert sorted(b) == [4, 5, 6, 7, 8] and all(a[s] == b[s] for s in b), (a, b)
    wa = weights(run_dir/"checkpoints"/"step_0000008.pt")
    wb = weights(resumed/"copy"/"copy"/"checkpoints"/"step_0000008.pt")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    plan = run_gg("plan", "--recipe", recipe, "--set", *sets(prepared, tmp_path/"plan"), env=env)
    assert "copy stage: rows repeat a block of 4 tokens" in plan.stdout
    assert "copy stage's block table" in plan.stdout


def test_a_plugin_stage_is_checked_in_one_line(prepared, tmp_path):
    recipe, env = setup(prepared, tmp_path)
    r = run_gg("train", "--recipe", recipe, "--set", *sets(prepared, tmp_path/"a"), "stage_options.width=3", env=env,
               check=False)
    assert r.returncode == 2 and r.stderr.strip().endswith("stage_options.width: unknown key; allowed keys here are "
                                                           "period"), r.stderr
    r = run_gg("train", "--recipe", recipe, "--set", *sets(prepared, tmp_path/"b"), "training.stage=copy_stage:nope",
               env=env, check=False)
    assert r.returncode == 2 and "training.stage: got 'copy_stage:nope'; module 'copy_stage' has no 'nope'" in r.stderr
    r = run_gg("train", "--recipe", recipe, "--set", *sets(prepared, tmp_path/"c"), "training.stage=toy", env=env,
               check=False)
    assert r.returncode == 2
    assert "training.stage: got 'toy'; registered stages are pretraining, instruct, dpo, rl" in r.stderr
    assert "Traceback" not in r.stderr
