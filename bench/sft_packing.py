"""SFT throughput: packing (several chats per row, document masking) vs padding (one chat per row).

The figure that matters is **supervised tokens per second** — assistant tokens (and their <|eot_id|>) that carry a
label — since that is the useful work of SFT. Both contenders train the same Tendril (same initial weights) on
the same prepared verifiable chats, through the real `SFTLoader` and `SFTTask`; one step = next_batch + forward +
summed cross-entropy + backward + AdamW. Padding pads each batch to its longest chat (rounded up to 8), the usual
baseline; `--pad-to-max` pads to `--seq-len` instead. Contenders alternate within each round; figures are medians
over rounds of (supervised tokens in the round / time of the round).

    python bench/sft_packing.py                                  # CPU fp32
    python bench/sft_packing.py --device cuda --batch-size 32 --seq-len 1024 --dim 512 --n-layers 8
    python bench/sft_packing.py --smoke                          # 200 chats, dim 64, one layer, 2 x 128, one round

The last line of stdout is one JSON object with the figures.
"""
from __future__ import annotations
import json, statistics, tempfile, time
from pathlib import Path
import torch
from common import apply_smoke, bench_parser, setup, sync

from gradient_garden.config import GlobalConfig, ModelConfig, TokenizerConfig
from gradient_garden.data.verifiable import WORDS, sample_conversations
from gradient_garden.models.tendril import count_parameters
from gradient_garden.models.registry import build_model
from gradient_garden.stages.sft import SFTLoader, SFTTask, prepare_instruct
from gradient_garden.tokenizer import init_tokenizer, train_bpe

DEFAULT_TOKENIZER = Path("data/tokenizers/garden-bpe-4k")

def parse_args(argv=None):
    p = bench_parser(__doc__, rounds=8, steps_per_round=3, warmup=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--conversations", type=int, default=4000)
    p.add_argument("--pad-to-max", action="store_true",
                   help="padding contender pads to --seq-len, not to the batch's longest")
    p.add_argument("--tokenizer", default=None,
                   help=f"tokenizer folder (default: {DEFAULT_TOKENIZER} if present, else a BPE trained here)")
    return apply_smoke(p.parse_args(argv), conversations=200, batch_size=2, seq_len=128, dim=64, n_layers=1, rounds=1,
                       steps_per_round=1, warmup=1)

def get_tokenizer(args, tmp: Path):
    "The embedded default tokenizer when prepared, else a small BPE trained on verifiable chats in seconds."
    path = Path(args.tokenizer) if args.tokenizer else DEFAULT_TOKENIZER
    if not (path/"tokenizer.json").is_file():
        texts = [m["content"] for c in sample_conversations(3000, seed=0) for m in c] + [" ".join(WORDS)] * 3
        path = train_bpe(texts, 1024, tmp/"tok")
    return init_tokenizer(TokenizerConfig(path=str(path)))

def step(model, opt, task, batch, autocast_dtype, device_type) -> int:
    "One SFT optimizer step; returns the supervised tokens of the batch."
    with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss_sum, _ = task.loss(model, batch)
    n = task.count(batch)
    (loss_sum / n).backward()
    opt.step(); opt.zero_grad(set_to_none=True)
    return int(n)

def main(argv=None):
    args = parse_args(argv)
    dev_type, dtype, autocast_dtype = setup(args)
    tmp = Path(tempfile.mkdtemp(prefix="sft_packing_"))
    tok = get_tokenizer(args, tmp)
    mcfg = ModelConfig(dim=args.dim, n_layers=args.n_layers, n_heads=max(2, args.dim // 64),
                       n_kv_heads=max(1, args.dim // 128), vocab_size=tok.vocab_size, max_seq_len=args.seq_len)
    cfg = GlobalConfig(model=mcfg, tokenizer=TokenizerConfig(path=tok.path))
    t = time.perf_counter()
    sources = {"sources": [{"type": "verifiable", "train": args.conversations, "val": 10, "seed": 0}]}
    meta = prepare_instruct(sources, cfg, tmp/"instruct", tokenizer=tok, progress=False)["train"]
    print(f"prepared {meta['n_conversations']} chats, {meta['n_tokens']} tokens ({meta['n_supervised']} supervised) "
          f"in {time.perf_counter() - t:.1f}s", flush=True)

    names = ["packing", "padding"]
    torch.manual_seed(0)
    base = build_model(mcfg)
    task, contenders = SFTTask(), {}
    for n in names:
        m = build_model(mcfg); m.load_state_dict(base.state_dict()); m.to(args.device).train()
        loader = SFTLoader(tmp/"instruct", "train", args.batch_size, args.seq_len, packing=(n == "packing"))
        if n == "padding" and args.pad_to_max: loader.collate_to_max = True
        contenders[n] = (m, torch.optim.AdamW(m.parameters(), lr=1e-4), loader)
    dev = lambda b: {k: v.to(args.device, non_blocking=True) for k, v in b.items()}
    fetch = lambda loader: (pad_to_max(loader.next_batch(), args.seq_len, loader.pad_id)
                            if getattr(loader, "collate_to_max", False) else loader.next_batch())

    for n in names:
        m, o, loader = contenders[n]
        for _ in range(args.warmup): step(m, o, task, dev(fetch(loader)), autocast_dtype, dev_type)
    sync(args.device)

    rates = {n: [] for n in names}
    positions, sup_total, docs = {n: 0 for n in names}, {n: 0 for n in names}, {n: 0 for n in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            m, o, loader = contenders[n]
            sync(args.device); t0 = time.perf_counter(); sup = 0
            for _ in range(args.steps_per_round):
                b = fetch(loader)
                positions[n] += b["input_ids"].numel()
                docs[n] += int((b["input_ids"] == tok.bos_id).sum())  # every chat starts with <|begin_of_text|>
                sup += step(m, o, task, dev(b), autocast_dtype, dev_type)
            sync(args.device)
            rates[n].append(sup / (time.perf_counter() - t0)); sup_total[n] += sup
    med = {n: statistics.median(v) for n, v in rates.items()}
    eff = {n: sup_total[n] / positions[n] for n in names}
    steps = args.rounds * args.steps_per_round

    print(f"\n{'contender':10s} {'sup tok/s':>10s} {'vs padding':>10s} {'sup/positions':>14s} {'chats/step':>11s} "
          f"{'positions/step':>15s}")
    for n in names:
        print(f"{n:10s} {med[n]:10.0f} {med[n]/med['padding']:9.2f}x {eff[n]:14.3f} {docs[n]/steps:11.1f} "
              f"{positions[n]/steps:15.0f}")
    print(f"Tendril {count_parameters(contenders['packing'][0]):,} params, {dtype}, device {args.device}, "
          f"{torch.get_num_threads()} threads")
    result = dict(bench="sft_packing", smoke=args.smoke, device=args.device,
                  device_name=torch.cuda.get_device_name() if dev_type == "cuda" else "cpu",
                  threads=torch.get_num_threads(), dtype=dtype, torch=torch.__version__,
                  padding_to="max" if args.pad_to_max else "longest_in_batch",
                  shape=dict(dim=mcfg.dim, n_layers=mcfg.n_layers, vocab=mcfg.vocab_size, seq_len=args.seq_len,
                             batch_size=args.batch_size),
                  rounds=args.rounds, steps_per_round=args.steps_per_round,
                  supervised_tokens_per_s={n: round(v, 1) for n, v in med.items()},
                  speedup_packing_vs_padding=round(med["packing"] / med["padding"], 3),
                  supervised_fraction={n: round(v, 4) for n, v in eff.items()},
                  chats_per_step={n: round(docs[n] / steps, 2) for n in names},
                  positions_per_step={n: round(positions[n] / steps, 1) for n in names})
    print(json.dumps(result))

def pad_to_max(batch: dict, seq_len: int, pad_id: int) -> dict:
    "Right-pad a padded batch to `seq_len` positions."
    extra = seq_len - batch["input_ids"].shape[1]
    if extra <= 0: return batch
    f = torch.nn.functional.pad
    return {"input_ids": f(batch["input_ids"], (0, extra), value=pad_id),
            "labels": f(batch["labels"], (0, extra), value=-100)}

if __name__ == "__main__":
    main()
