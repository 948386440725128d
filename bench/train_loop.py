r"""End-to-end training throughput vs the bare model step with the same shapes.

The bare step is `--accum` forward + cross-entropy + backward passes on a fixed micro-batch, clipping and AdamW. The
trainer step is `Trainer.train_step` with everything it does around that: reading `--accum` micro-batches from the
memory-mapped shards (through the prefetching loader with `--workers`), counting them on the host, copying each to
the device just before its forward, the schedule, exact-mean accumulation bookkeeping, clipping and metrics.

Both models are built from the same seed and do the same arithmetic. After `--warmup` steps of each (optimizer state,
allocator; not counted), the two steps alternate one by one for `--rounds` rounds, the order swapped every round, so
a load change on a shared machine hits both alike. Each step is timed by the wall clock and by the process's CPU
time (which a busy machine's waiting leaves out; a prefetch thread's work is in it). `ratio` and `cpu_ratio` are
bare over trainer seconds per step (= trainer over bare tokens/s) on the medians; `pair_ratio` the median of the
rounds' own ratios. Target: trainer >= 0.95 x bare at accumulation 8. Last line: one JSON object.

    python bench/train_loop.py [--rounds 5] [--warmup 2] [--accum 8] [--workers 0] [--device cpu] \
        [--set KEY=VALUE ...]
    # synthetic shards, dim 64, 2 layers, 2 x 32 tokens, accumulation 2, one round
    python bench/train_loop.py --smoke

The recipe's prepared data is read (`gg prepare` it first); `--smoke` writes random-token shards of its own instead.
"""
import argparse, json, os, statistics, time
from pathlib import Path
import torch
from common import add_smoke, apply_smoke, smoke_dir, synthetic_pretraining_data
from gradient_garden.recipes import load_config
from gradient_garden.parallel.distributed import DistEnv, resolve_device
from gradient_garden.train.optim import build_optimizers
from gradient_garden.train.trainer import Trainer
from gradient_garden.models.registry import build_model
from gradient_garden.stages.pretraining import CausalLMTask
from gradient_garden.data.loaders import pretraining_loaders


ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=1024",
        "model.max_seq_len=64"]


def parse():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT/"recipes"/"pretraining"/"debug.yaml"))
    ap.add_argument("--rounds", type=int, default=5, help="timed (bare, trainer) pairs")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each before the rounds")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--accum", type=int, default=8, help="micro-batches per optimizer step")
    ap.add_argument("--workers", type=int, default=0,
                    help="runtime.num_workers: micro-batches prepared ahead by a thread")
    ap.add_argument("--set", nargs="*", default=[], dest="overrides")
    return apply_smoke(add_smoke(ap).parse_args(), rounds=1, warmup=1, accum=2)


def main():
    a = parse()
    micro, seq = (2, 32) if a.smoke else (8, 256)
    if a.smoke:   # random-token shards and a small BPE of their own, in a temporary folder
        data = synthetic_pretraining_data(smoke_dir("train_loop"), 1024, 20_000)
        a.overrides = TINY + [f"tokenizer.path={data['tokenizer']}", f"paths.datasets={data['datasets']}",
                              f"paths.runs={data['datasets'].parent/'runs'}"] + a.overrides
    cfg, _ = load_config(recipe=a.recipe, overrides=a.overrides + [f"runtime.device={a.device}",
                                                                   f"training.total_batch_size={a.accum * micro * seq}",
                                                                   f"runtime.num_workers={a.workers}",
                                                                   f"training.micro_batch_size={micro}",
                                                                   f"training.seq_len={seq}"])
    dev = resolve_device(a.device)
    t = cfg.training
    tokens_per_step = a.accum * t.micro_batch_size * t.seq_len

    torch.manual_seed(0)
    bare_model = build_model(cfg.model).to(dev)
    bare_opts = build_optimizers(bare_model, cfg.optimizers, dev.type)
    x = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), device=dev)
    inputs, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()   # as the loader hands them out
    def bare_step():
        for _ in range(a.accum):   # the model's own (fused) loss, as the trainer uses it
            (bare_model(inputs, labels=labels) / (a.accum * labels.numel())).backward()
        torch.nn.utils.clip_grad_norm_(bare_model.parameters(), 1.0)
        for o in bare_opts: o.step(); o.zero_grad(set_to_none=True)

    torch.manual_seed(0)
    model = build_model(cfg.model).to(dev)
    train, _ = pretraining_loaders(cfg)
    trainer = Trainer(cfg, model, CausalLMTask(), train, None, env=DistEnv(device=dev), log_to_console=False)
    fetch = []
    def trainer_step():
        trainer._fetch_s = 0.0
        trainer.train_step()
        fetch.append(trainer._fetch_s)

    def timed(fn) -> tuple[float, float]:
        "Wall and CPU seconds of one step, the device's queue drained at both ends."
        if dev.type == "cuda": torch.cuda.synchronize()
        w, c = time.perf_counter(), time.process_time()
        fn()
        if dev.type == "cuda": torch.cuda.synchronize()
        return time.perf_counter() - w, time.process_time() - c

    load_before = os.getloadavg()[0]
    for _ in range(a.warmup): bare_step(); trainer_step()
    fetch.clear()
    runs = {"bare": [], "trainer": []}
    for r in range(a.rounds):
        pair = [("bare", bare_step), ("trainer", trainer_step)]
        for name, fn in (pair if r % 2 == 0 else pair[::-1]): runs[name].append(timed(fn))
    med = {k: [statistics.median(s[i] for s in v) for i in (0, 1)] for k, v in runs.items()}
    res = dict(bench="train_loop", smoke=a.smoke, device=str(dev), model_dim=cfg.model.dim, n_layers=cfg.model.n_layers,
               micro_batch=t.micro_batch_size, seq_len=t.seq_len, grad_accum=trainer.grad_accum, workers=a.workers,
               rounds=a.rounds, warmup=a.warmup, threads=torch.get_num_threads(),
               bare_tokens_per_s=tokens_per_step / med["bare"][0],
               trainer_tokens_per_s=tokens_per_step / med["trainer"][0],
               ratio=med["bare"][0] / med["trainer"][0], cpu_ratio=med["bare"][1] / med["trainer"][1],
               bare_cpu_s=med["bare"][1], trainer_cpu_s=med["trainer"][1],
               pair_ratio=statistics.median(b[0] / tr[0] for b, tr in zip(runs["bare"], runs["trainer"])),
               trainer_fetch_ms=1e3 * statistics.median(fetch), load_avg=[load_before, os.getloadavg()[0]], target=0.95,
               wall_s={k: [round(s[0], 3) for s in v] for k, v in runs.items()},
               cpu_s={k: [round(s[1], 3) for s in v] for k, v in runs.items()})
    for k in ("bare", "trainer"):
        print(f"{k:8s} {res[k + '_tokens_per_s']:>9,.0f} tokens/s   wall s/step {[round(s[0], 2) for s in runs[k]]}   "
              f"cpu s/step {[round(s[1], 2) for s in runs[k]]}")
    print(json.dumps(res))


if __name__ == "__main__": main()
