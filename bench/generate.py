"""Batched KV-cache generation throughput: gradient_garden.batching.generate vs transformers' generate, same weights.

Both decode the same batch of mixed-length prompts (left padding), greedily, for exactly the same number of new
tokens (no stop tokens), in alternating (rotated) order; figures are medians over rounds. Reported: generated
tokens/s, the ratio, how many generated tokens agree between the two, and MFU of the forward FLOPs against the
measured matmul peak (and the datasheet peak on GPU).

    python bench/generate.py                                  # CPU fp32
    python bench/generate.py --dtype bf16                     # CPU bf16 weights, with an fp32 Tendril beside them
    python bench/generate.py --device cuda --dtype bf16 --batch-size 32
    python bench/generate.py --smoke                          # dim 64, 2 layers, 2 prompts x 4 new tokens, one round

With `--dtype bf16`, Tendril decodes its fp32 weights under `torch.autocast(bf16)` (bf16 matmuls on held bf16 weight
copies, fp32 residual stream, fp32 attention on CPU over an fp32 KV cache, the head's top logits re-scored in fp32), and
`tendril_fp32` (the same weights, no autocast) decodes beside the others; transformers' model is cast to bf16. The
bf16 speed-up over fp32 and two agreements with fp32 greedy decoding are reported: free-running (the tokens of
each row up to its first difference from fp32; once a row differs, its later tokens count as misses) and
teacher-forced (top-1 of bf16 vs fp32 on the fp32 greedy sequence, each position with the fp32 prefix). The
free-running agreement is measured on the timed batch and, because one early difference in one row of eight moves
it by several points, also over `--agreement-batches` batches of fresh prompts (64 rows by default). With a
trained `--checkpoint` whose prepared data is at hand, `--prompts text` (the default then) takes the prompts from
its validation split (what the model was trained to continue); `--prompts random` draws random token ids.

The last line of stdout is one JSON object with the figures.
"""
from __future__ import annotations
import argparse, copy, json, statistics, time
import torch
from gradient_garden.hardware import gpu_datasheet_flops
from gradient_garden.runtime import dispatch_choices
from common import add_smoke, apply_smoke, matmul_peak_flops, sync

from gradient_garden.config import ModelConfig
from gradient_garden.batching import generate
from gradient_garden.generation import hold_decode_weights
from gradient_garden.models.tendril import Tendril
from gradient_garden.models.registry import flops_per_token
from gradient_garden.checkpoint.hf import to_hf_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--compile", action="store_true", help="torch.compile Tendril's forward (dynamic shapes)")
    p.add_argument("--no-cache-too", action="store_true", help="also time Tendril without the KV cache")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--checkpoint", default=None, help="decode a trained checkpoint's model instead of random weights")
    p.add_argument("--prompts", choices=["auto", "text", "random"], default="auto",
                   help="text: windows of the checkpoint's validation split; auto: text when there is one, else random")
    p.add_argument("--agreement-batches", type=int, default=8, help="batches of fresh prompts for the bf16 agreement")
    return apply_smoke(add_smoke(p).parse_args(argv), batch_size=2, min_prompt=4, max_prompt=8, new_tokens=4, rounds=1,
                       agreement_batches=1)

def prompt_source(args, run_cfg, vocab_size: int):
    "A function seed -> prompts of the bench's lengths: random token ids, or windows of the validation text."
    val = None
    if args.prompts != "random" and run_cfg is not None:
        from pathlib import Path
        from gradient_garden.data.loaders import load_meta, open_shards
        data = Path(run_cfg.paths.datasets)/"pretraining"
        if (data/"val").is_dir(): val = open_shards(data, load_meta(data), "val")[0]
    if args.prompts == "text" and val is None:
        raise SystemExit("--prompts text: the checkpoint's pretraining/val data is not there")
    def prompts(seed: int):
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(args.min_prompt, args.max_prompt + 1, (args.batch_size,), generator=g).tolist()
        if val is None: return lens, [torch.randint(1, vocab_size, (n,), generator=g).tolist() for n in lens]
        starts = torch.randint(0, len(val) - args.max_prompt, (args.batch_size,), generator=g).tolist()
        return lens, [[int(t) for t in val[s:s + n]] for s, n in zip(starts, lens)]
    return prompts, "text" if val is not None else "random"

def free_running(a: list[list[int]], b: list[list[int]]) -> tuple[int, list[int]]:
    "Tokens that agree before each row's first difference, and the positions of the first differences."
    hits, first = 0, []
    for x, y in zip(a, b):
        k = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x))
        hits += k
        if k < len(x): first.append(k)
    return hits, first

def agreement_over_batches(model, low, prompts, n_batches: int, n_new: int) -> dict:
    "Free-running agreement of decoding under `low` (autocast) with fp32 greedy, over `n_batches` batches of prompts."
    hits = total = 0; first = []
    for seed in range(1, n_batches + 1):
        _, ps = prompts(seed)
        want = generate(model, None, ps, max_new_tokens=n_new, stop_ids=[])
        with low: got = generate(model, None, ps, max_new_tokens=n_new, stop_ids=[])
        h, f = free_running(want, got)
        hits, total, first = hits + h, total + len(ps) * n_new, first + f
    return dict(agreement=hits / total, rows=n_batches * len(ps), rows_differing=len(first), first_differences=first)

def teacher_forced_agreement(model, prompts, greedy, low) -> float:
    "Share of positions where the top-1 token under `low` (autocast) equals fp32's, on the fp32 greedy sequences."
    from gradient_garden.models.tendril import rescore_top_logits
    hits = total = 0
    with torch.inference_mode():
        for p, g in zip(prompts, greedy):
            seq = torch.tensor([p + g], device=next(model.parameters()).device)
            want = model(seq)[0, len(p) - 1:-1].argmax(-1)
            normed = {}
            hook = model.norm.register_forward_hook(lambda m, i, o: normed.setdefault("h", o))
            try:
                with low: logits = model(seq)
            finally: hook.remove()
            # as decoding does: top logits in fp32
            if low.fast_dtype != torch.float32 and torch.is_tensor(normed.get("h")):
                logits = rescore_top_logits(logits, normed["h"], model.output.weight)
            hits += (logits[0, len(p) - 1:-1].argmax(-1) == want).sum().item(); total += len(g)
    return hits / total

def main(argv=None):
    args = parse_args(argv)
    if args.threads: torch.set_num_threads(args.threads)
    dev_type = torch.device(args.device).type
    dtype = args.dtype or ("bf16" if dev_type == "cuda" else "fp32")
    cfg = ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, multiple_of=256,
                      max_seq_len=args.max_prompt + args.new_tokens, tie_embeddings=False)
    if args.smoke: cfg = ModelConfig(**{**cfg.__dict__, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                        "vocab_size": 1024, "multiple_of": 64})
    torch.manual_seed(0)
    model, run_cfg = Tendril(cfg).eval(), None
    if args.checkpoint:   # trained weights: greedy choices are decided by real margins, not random-init ties
        from gradient_garden.checkpoint.checkpoints import load_model_from_checkpoint
        model, run_cfg = load_model_from_checkpoint(args.checkpoint)
        cfg = run_cfg.model
    hf = to_hf_model(model).to(args.device, DTYPES[dtype]).eval()
    model = model.to(args.device)
    model_fp32 = (copy.deepcopy(model) if args.compile else model) if dtype != "fp32" else None   # fp32, no autocast
    low = torch.autocast(dev_type, dtype=DTYPES[dtype], enabled=dtype != "fp32")
    hf.generation_config.pad_token_id = 0
    hf.generation_config.eos_token_id = None
    hf.generation_config.bos_token_id = None

    prompts_of, prompt_kind = prompt_source(args, run_cfg, cfg.vocab_size)
    lens, prompts = prompts_of(1)
    L = max(lens)
    ids = torch.zeros(args.batch_size, L, dtype=torch.long)
    am = torch.zeros(args.batch_size, L, dtype=torch.long)
    for i, p in enumerate(prompts): ids[i, L - len(p):], am[i, L - len(p):] = torch.tensor(p), 1
    ids, am = ids.to(args.device), am.to(args.device)
    n_new = args.new_tokens

    fwd_model = model
    if args.compile: fwd_model.forward = torch.compile(model.forward, dynamic=True)

    def ours(cache=True):
        with low: return generate(fwd_model, None, prompts, max_new_tokens=n_new, stop_ids=[], use_kv_cache=cache)
    def theirs():
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=am, max_new_tokens=n_new, min_new_tokens=n_new,
                              do_sample=False)
        return out[:, L:].tolist()

    runs = {"tendril": ours, "hf": theirs}
    if args.no_cache_too: runs["tendril_no_cache"] = lambda: ours(False)
    if model_fp32 is not None:
        runs["tendril_fp32"] = lambda: generate(model_fp32, None, prompts, max_new_tokens=n_new, stop_ids=[])
    outputs = {n: f() for n, f in runs.items()}        # warm-up (and compilation)
    agreement = lambda a, b: free_running(outputs[a], outputs[b])[0] / (args.batch_size * n_new)
    agree = agreement("tendril", "hf")
    agree_fp32 = agreement("tendril", "tendril_fp32") if model_fp32 is not None else None
    forced_fp32 = (teacher_forced_agreement(model, prompts, outputs["tendril_fp32"], low) if model_fp32 is not None
                   else None)
    sample = (agreement_over_batches(model, low, prompts_of, args.agreement_batches, n_new)
              if model_fp32 is not None and not args.compile else None)

    names = list(runs)
    times, cpu_times = {n: [] for n in names}, {n: [] for n in names}
    for r in range(args.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            sync(args.device); t, c = time.perf_counter(), time.process_time(); runs[n](); sync(args.device)
            times[n].append(time.perf_counter() - t); cpu_times[n].append(time.process_time() - c)
    med = {n: statistics.median(v) for n, v in times.items()}
    cpu_med = {n: statistics.median(v) for n, v in cpu_times.items()}
    tps = {n: args.batch_size * n_new / t for n, t in med.items()}

    peak = matmul_peak_flops(args.device, DTYPES[dtype], args.smoke)
    ctx = sum(lens) / len(lens) + n_new / 2
    fwd_flops = flops_per_token(cfg, int(ctx)) / 3         # forward only, at the mean context length while decoding
    peak_fp32 = peak if dtype == "fp32" else matmul_peak_flops(args.device, torch.float32, args.smoke)
    mfu = {n: fwd_flops * v / (peak_fp32 if n.endswith("_fp32") else peak) for n, v in tps.items()}
    datasheet = None
    if dev_type == "cuda":
        datasheet = gpu_datasheet_flops(torch.cuda.get_device_name(), dtype)

    print(f"{'contender':18s} {'ms/batch':>9s} {'tokens/s':>10s} {'vs hf':>7s} {'MFU':>8s} {'cpu ms':>8s} "
          f"{'vs hf':>7s}")
    for n in names:
        print(f"{n:18s} {med[n]*1e3:9.1f} {tps[n]:10.0f} {tps[n]/tps['hf']:6.2f}x {mfu[n]*100:7.3f}% "
              f"{cpu_med[n]*1e3:8.1f} {cpu_med['hf']/cpu_med[n]:6.2f}x")
    print("fastest batch (a quiet-machine estimate): "
          + ", ".join(f"{n} {min(v)*1e3:.0f} ms ({min(times['hf'])/min(v):.2f}x)" for n, v in times.items()))
    print(f"{prompt_kind} prompts {lens}, {n_new} new tokens each; greedy tokens agreeing with transformers: "
          f"{agree:.1%}")
    if agree_fp32 is not None:
        print(f"{dtype} vs fp32 Tendril: {med['tendril_fp32']/med['tendril']:.2f}x faster (median), "
              f"{cpu_med['tendril_fp32']/cpu_med['tendril']:.2f}x (CPU time); greedy tokens agreeing on the timed "
              f"batch: {agree_fp32:.1%} free-running, {forced_fp32:.1%} teacher-forced")
    if sample is not None:
        print(f"free-running agreement over {sample['rows']} rows ({args.agreement_batches} batches of {prompt_kind} "
              f"prompts): {sample['agreement']:.1%}; {sample['rows_differing']} rows differ, first at new token "
              f"{sample['first_differences']}")
    choices = dispatch_choices()
    for name, c in choices.items():
        if name != "machine": print(f"dispatch {name} = {c['value']:,} ({c['why']}; on {choices['machine']})")
    prepacked = None
    if dev_type == "cpu":     # what generate held prepacked: the weights a step of the batch's rows takes packed
        with torch.inference_mode(), low, hold_decode_weights(model, rows=args.batch_size):
            prepacked = [n for n, m in model.named_modules() if m.__dict__.get("_packed_weight") is not None]
        print(f"prepacked for decoding {args.batch_size} rows: {', '.join(prepacked) or 'none'} (fp32: where "
              f"{args.batch_size} x the weight's size passes the measured crossover; bf16 copies: all)")
    result = dict(bench="generate", smoke=args.smoke, device=args.device, dispatch=choices, prepacked=prepacked,
                  device_name=torch.cuda.get_device_name() if dev_type == "cuda" else "cpu",
                  threads=torch.get_num_threads(), dtype=dtype, torch=torch.__version__, compile=args.compile,
                  checkpoint=args.checkpoint,
                  prompts=prompt_kind, agreement_sample_vs_fp32=sample,
                  batch_size=args.batch_size, prompt_lens=lens, new_tokens=n_new, rounds=args.rounds,
                  ms_per_batch={n: round(v * 1e3, 1) for n, v in med.items()},
                  tokens_per_s={n: round(v, 1) for n, v in tps.items()},
                  ratio_vs_hf={n: round(v / tps["hf"], 3) for n, v in tps.items()},
                  ms_per_batch_min={n: round(min(v) * 1e3, 1) for n, v in times.items()},
                  ratio_vs_hf_min={n: round(min(times["hf"]) / min(v), 3) for n, v in times.items()},
                  cpu_ms_per_batch={n: round(v * 1e3, 1) for n, v in cpu_med.items()},
                  ratio_vs_hf_cpu_time={n: round(cpu_med["hf"] / v, 3) for n, v in cpu_med.items()},
                  token_agreement=round(agree, 4), mfu={n: round(v, 5) for n, v in mfu.items()},
                  token_agreement_vs_fp32=round(agree_fp32, 4) if agree_fp32 is not None else None,
                  teacher_forced_agreement_vs_fp32=round(forced_fp32, 4) if forced_fp32 is not None else None,
                  ratio_vs_tendril_fp32_cpu_time=({n: round(cpu_med["tendril_fp32"] / v, 3) for n, v in cpu_med.items()}
                                                  if model_fp32 is not None else None),
                  ratio_vs_tendril_fp32=({n: round(med["tendril_fp32"] / v, 3) for n, v in med.items()}
                                         if model_fp32 is not None else None),
                  mfu_datasheet={n: round(fwd_flops * v / datasheet, 5) for n, v in tps.items()} if datasheet else None,
                  matmul_peak_tflops=round(peak / 1e12, 4))
    print(json.dumps(result))

if __name__ == "__main__":
    main()
