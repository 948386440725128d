"""RL step throughput: prompt-completions per second, rollout + update, of the rl stage's loader and loss against TRL's
GRPOTrainer, on the same model (a `gg export` folder of our checkpoint), prompts, G, maximum new tokens and batch.

    python bench/rl.py --checkpoint runs/instruct/debug --steps 4

Both sides: P prompts x G completions per step, sampled at temperature 1, up to M new tokens (stopped at the eot
token), rewarded by exact match, one AdamW step over all P x G rows (one micro-batch), fp32 on CPU, loss `dapo`, beta 0,
one pass per rollout batch. Ours decodes with our KV cache (the prompt prefilled once per group); TRL generates with
`transformers`' `generate`. Reports medians over the timed steps and our rollout share of the step; the last line of
stdout is one JSON object with the figures.

    python bench/rl.py --smoke      # a random dim-64 model with a 1k BPE, 2 prompts x G 2, 4 new tokens, one timed step
    python bench/rl.py --only ours --rollouts both --threads 2   # rl.async_rollouts against sampling then updating

Without TRL installed its side is skipped with a line."""
from __future__ import annotations
import argparse, json, statistics, tempfile, time
from pathlib import Path
import torch
from common import add_smoke, apply_smoke, reference_available, smoke_dir


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="runs/instruct/debug")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=4, help="timed steps per side (after one warm-up step)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--only", choices=["ours", "trl"], default=None)
    p.add_argument("--rollouts", choices=["sync", "async", "both"], default="sync",
                   help="ours: sample then update (sync), the next step's rollouts sampled during the update "
                        "(rl.async_rollouts, with the correction it needs), or both from the same start")
    args = apply_smoke(add_smoke(p).parse_args(), prompts=2, group=2, max_new_tokens=4, steps=1)
    if args.smoke: args.checkpoint = smoke_checkpoint(smoke_dir("rl"))
    return args


def smoke_checkpoint(tmp: Path) -> str:
    "A randomly initialised chat checkpoint of the debug recipe at dim 64, 2 layers, with a 1k BPE on verifiable chats."
    from gradient_garden.checkpoint.checkpoints import save_checkpoint
    from gradient_garden.config import TokenizerConfig, to_plain
    from gradient_garden.recipes import load_config
    from gradient_garden.data.verifiable import WORDS, sample_conversations
    from gradient_garden.models.registry import build_model
    from gradient_garden.tokenizer import train_bpe
    root = Path(__file__).resolve().parent.parent
    cfg, _ = load_config(recipe=str(root/"recipes/pretraining/debug.yaml"),
                         overrides=["model.dim=64", "model.n_layers=2", "model.vocab_size=1024"])
    texts = [m["content"] for c in sample_conversations(500, seed=0) for m in c] + [" ".join(WORDS)] * 3
    cfg.tokenizer = TokenizerConfig(backend="huggingface", path=str(train_bpe(texts, 1024, tmp/"tok")))
    torch.manual_seed(0)
    state = dict(step=0, stage="pretraining", architecture=cfg.model.architecture, config=to_plain(cfg),
                 model=build_model(cfg.model).state_dict())
    return str(save_checkpoint(state, tmp/"random"/"step_0000000.pt"))


def setup(args):
    from gradient_garden.checkpoint.checkpoints import load_checkpoint, base_weights
    from gradient_garden.config import GlobalConfig, from_plain
    from gradient_garden.models.registry import build_model
    from gradient_garden.tokenizer import init_tokenizer
    from gradient_garden.data.verifiable import sample_examples
    ck = load_checkpoint(args.checkpoint)
    cfg = from_plain(GlobalConfig, ck["config"])
    model = build_model(cfg.model)
    model.load_state_dict(base_weights(ck))
    tok = init_tokenizer(cfg.tokenizer)
    exs = sample_examples(args.prompts * (args.steps + 1), "train", seed=5)
    return cfg, model, tok, exs


def ours_stepper(args, model, tok, exs, async_on: bool = False):
    "One timed step of our loader and loss at a time: returns `step() -> (step seconds, rollout seconds)`, the loader."
    from gradient_garden.config import RLConfig
    from gradient_garden.evals.verifiers import Problem
    from gradient_garden.stages.rewards import Rewarder
    from gradient_garden.stages.rl import RLTask
    from gradient_garden.stages.rl_rollouts import RolloutLoader
    rl = RLConfig(group_size=args.group, loss_type="dapo", temperature=1.0, max_new_tokens=args.max_new_tokens,
                  importance_sampling_correction=async_on, async_rollouts=async_on)
    examples = [Problem("verifiable", e.task, e.prompt, e.answer, {"answer": e.answer}) for e in exs]
    rows = args.prompts * args.group
    loader = RolloutLoader(model, tok, examples, rl, Rewarder(), 128, rows, 1, seed=0)
    loader._order_for = lambda e: list(range(len(examples)))        # the same prompts, in order, as TRL's side
    task, opt = RLTask(rl), torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()
    def step():
        t0 = time.perf_counter()
        b = loader.next_batch()
        t1 = time.perf_counter()
        loss_sum, _ = task.loss(model, b)
        (loss_sum / task.count(b)).backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, t1 - t0
    return step, loader


def figures(steps: list, rows: int) -> dict:
    "Completions/s of the median step, and the median share of a step spent waiting for rollouts."
    step_s = statistics.median(t for t, _ in steps)
    return dict(completions_per_s=rows / step_s, step_s=step_s,
                rollout_share=statistics.median(r / t for t, r in steps))


def bench_ours(args, cfg, model, tok, exs) -> dict:
    step, _ = ours_stepper(args, model, tok, exs)
    return figures([step() for _ in range(args.steps + 1)][1:], args.prompts * args.group)


def bench_sync_async(args, tok, exs, block: int = 3) -> tuple[dict, dict]:
    ("Sync and async from the same start, in alternating blocks of `block` steps (the first of each untimed), so both "
     "meet the same load on a shared machine; an async block's last rollouts finish before the next sync block.")
    sync, _ = ours_stepper(args, setup(args)[1], tok, exs)
    asyn, loader = ours_stepper(args, setup(args)[1], tok, exs, async_on=True)
    timed = {"sync": [], "async": []}
    while len(timed["async"]) < args.steps:
        for name, step in (("sync", sync), ("async", asyn)):
            timed[name] += [step() for _ in range(block)][1:]
        if loader.pending is not None: loader.pending[1].result()
    rows = args.prompts * args.group
    return figures(timed["sync"], rows), figures(timed["async"], rows)


def bench_trl(args, cfg, model, tok, exs) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from gradient_garden.checkpoint.hf import export_hf
    from gradient_garden.evals.generative import encode_prompt
    from gradient_garden.data.verifiable import exact_match
    out = Path(tempfile.mkdtemp())/"hf"
    export_hf(model, out, tok, tokenizer_dir=cfg.tokenizer.path)
    hf_tok = AutoTokenizer.from_pretrained(out)
    hf_tok.pad_token_id = tok.pad_id
    hf_tok.padding_side = "left"
    texts = [tok.decode(encode_prompt(tok, e.prompt)) for e in exs]   # the same chat-formatted prompts, as text
    first = encode_prompt(tok, exs[0].prompt)
    assert hf_tok(texts[0], add_special_tokens=False)["input_ids"] == first, "prompt tokens differ"
    ds = Dataset.from_dict({"prompt": texts, "answer": [e.answer for e in exs]})
    def reward(completions, answer, **kw): return [float(exact_match(c, a)) for c, a in zip(completions, answer)]
    stamps = []
    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k): stamps.append(time.perf_counter())
        def on_step_begin(self, *a, **k):
            if not stamps: stamps.append(time.perf_counter())
    rows = args.prompts * args.group
    gargs = GRPOConfig(output_dir=str(out.parent/"trl"), per_device_train_batch_size=rows,
                       gradient_accumulation_steps=1, num_generations=args.group,
                       max_completion_length=args.max_new_tokens, temperature=1.0,
                       learning_rate=1e-5, max_steps=args.steps + 1, loss_type="dapo", beta=0.0, use_cpu=True,
                       report_to=[], logging_steps=1000, gradient_checkpointing=False, save_strategy="no",
                       shuffle_dataset=False, seed=0,
                       generation_kwargs={"eos_token_id": [tok.eot_id]}, dataloader_num_workers=0)
    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    trainer = GRPOTrainer(model=hf, reward_funcs=reward, args=gargs, train_dataset=ds, processing_class=hf_tok,
                          callbacks=[Clock()])
    trainer.train()
    times = [b - a for a, b in zip(stamps[1:], stamps[2:])]   # the first step is the warm-up
    step_s = statistics.median(times)
    return dict(completions_per_s=rows / step_s, step_s=step_s)


def main():
    args = parse()
    if args.threads: torch.set_num_threads(args.threads)
    cfg, model, tok, exs = setup(args)
    res = {}
    if args.only != "trl" and args.rollouts == "both": res["ours"], res["ours_async"] = bench_sync_async(args, tok, exs)
    elif args.only != "trl" and args.rollouts == "async":
        step, _ = ours_stepper(args, model, tok, exs, async_on=True)
        res["ours_async"] = figures([step() for _ in range(args.steps + 1)][1:], args.prompts * args.group)
    elif args.only != "trl": res["ours"] = bench_ours(args, cfg, model, tok, exs)
    if args.only != "ours" and reference_available("trl", "TRL's GRPOTrainer (the reference)"):
        _, model2, _, _ = setup(args)
        res["trl"] = bench_trl(args, cfg, model2, tok, exs)
    print(f"prompts {args.prompts} x G {args.group}, max new tokens {args.max_new_tokens}, {args.steps} timed steps, "
          f"{torch.get_num_threads()} threads")
    for k, r in res.items():
        print(f"{k:>10}: {r['completions_per_s']:8.1f} completions/s  step {r['step_s']:.2f} s"
              + (f"  rollout share {r['rollout_share']:.0%}" if "rollout_share" in r else ""))
    ratio = res["ours"]["completions_per_s"] / res["trl"]["completions_per_s"] if {"ours", "trl"} <= set(res) else None
    if ratio is not None: print(f"ratio ours / TRL: {ratio:.2f}x")
    overlap = (res["ours_async"]["completions_per_s"] / res["ours"]["completions_per_s"]
               if {"ours", "ours_async"} <= set(res) else None)
    if overlap is not None: print(f"ratio async / sync: {overlap:.2f}x")
    print(json.dumps(dict(bench="rl", smoke=args.smoke, prompts=args.prompts, group=args.group,
                          max_new_tokens=args.max_new_tokens, steps=args.steps, threads=torch.get_num_threads(), **res,
                          ours_over_trl=ratio, async_over_sync=overlap)))


if __name__ == "__main__":
    main()
