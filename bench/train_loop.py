"""End-to-end training throughput vs the bare model step with the same shapes.

The bare step is `--accum` forward + cross-entropy + backward passes on a fixed micro-batch, clipping and AdamW. The
trainer step is `Trainer.train_step` with everything it does around that: reading `--accum` micro-batches from the
memory-mapped shards (through the prefetching loader with `--workers`), counting them on the host, copying each to
the device just before its forward, the schedule, exact-mean accumulation bookkeeping, clipping and metrics. Both
alternate in one process and the medians are compared. Target: trainer >= 0.95 x bare at accumulation 8. Last
line: one JSON object.

    python bench/train_loop.py [--steps 6] [--repeats 5] [--accum 8] [--workers 0] [--device cpu]
"""
import argparse, json, statistics, time
import torch
from gradient_garden.config import load_config
from gradient_garden.engine.distributed import DistEnv, resolve_device
from gradient_garden.engine.optim import build_optimizers
from gradient_garden.engine.trainer import Trainer
from gradient_garden.models.tendril import build_model
from gradient_garden.tasks.pretraining import CausalLMTask

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="recipes/pretraining/debug.yaml")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--accum", type=int, default=8, help="micro-batches per optimizer step")
    ap.add_argument("--workers", type=int, default=0, help="runtime.num_workers: micro-batches prepared ahead by a thread")
    ap.add_argument("--set", nargs="*", default=[], dest="overrides")
    a = ap.parse_args()
    cfg, _ = load_config(recipe=a.recipe, overrides=a.overrides + [f"runtime.device={a.device}", f"training.total_batch_size={a.accum * 8 * 256}",
                                                                   f"runtime.num_workers={a.workers}",
                                                                   "training.micro_batch_size=8", "training.seq_len=256"])
    dev = resolve_device(a.device)
    env = DistEnv(device=dev)
    t = cfg.training
    tokens_per_step = a.accum * t.micro_batch_size * t.seq_len

    torch.manual_seed(0)
    bare_model = build_model(cfg.model).to(dev)
    bare_opts = build_optimizers(bare_model, cfg.optimizers, dev.type)
    x = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), device=dev)
    def bare_step():
        for _ in range(a.accum):   # the model's own (fused) loss, as the trainer uses it
            (bare_model(x[:, :-1], labels=x[:, 1:]) / (a.accum * x[:, 1:].numel())).backward()
        torch.nn.utils.clip_grad_norm_(bare_model.parameters(), 1.0)
        for o in bare_opts: o.step(); o.zero_grad(set_to_none=True)

    from gradient_garden.data.loaders import pretraining_loaders
    torch.manual_seed(0)
    model = build_model(cfg.model).to(dev)
    train, _ = pretraining_loaders(cfg)
    trainer = Trainer(cfg, model, CausalLMTask(), train, None, env=env, log_to_console=False)
    def trainer_step(): trainer.train_step()

    def timed(fn):
        for _ in range(2): fn()  # warm-up
        if dev.type == "cuda": torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.steps): fn()
        if dev.type == "cuda": torch.cuda.synchronize()
        return a.steps * tokens_per_step / (time.perf_counter() - t0)

    bare, loop = [], []
    for r in range(a.repeats):
        pair = [(bare, bare_step), (loop, trainer_step)]
        for lst, fn in (pair if r % 2 == 0 else pair[::-1]): lst.append(timed(fn))
    res = dict(bench="train_loop", device=str(dev), model_dim=cfg.model.dim, n_layers=cfg.model.n_layers,
               micro_batch=t.micro_batch_size, seq_len=t.seq_len, grad_accum=trainer.grad_accum, workers=a.workers, bare_tokens_per_s=statistics.median(bare),
               trainer_tokens_per_s=statistics.median(loop))
    res["ratio"] = res["trainer_tokens_per_s"] / res["bare_tokens_per_s"]
    res["target"] = 0.95
    print(f"bare step    {res['bare_tokens_per_s']:,.0f} tokens/s  (runs: {[round(v) for v in bare]})")
    print(f"trainer step {res['trainer_tokens_per_s']:,.0f} tokens/s  (runs: {[round(v) for v in loop]})")
    print(json.dumps(res))

if __name__ == "__main__": main()
