#!/usr/bin/env bash
# The GPU path in one prepared script: training steps at the tendril-124m and tendril-400m shapes in bf16 with
# torch.compile on one GPU (124M also with the eager loss, for the compiled loss's gain), the same under FSDP2 on every
# GPU present, generation at batch 1 and 32, and packed documents on flex_attention vs SDPA; prints
# tokens/s, MFU against the datasheet peak and peak memory as ONE JSON line. Budget: < 10 minutes on one H100/H200.
#
#   bash bench/gpu.sh                 # from the repository root, on a CUDA machine with the package installed
#
# Targets on one H100/H200: >= 45% MFU at 124M, >= 50% at 400M. Record the line in bench/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:-$PWD}" TOKENIZERS_PARALLELISM=false
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
[ "$NGPU" -ge 1 ] || { echo "bench/gpu.sh: no CUDA device" >&2; exit 1; }
OUT=$(mktemp -d)

cat > "$OUT/step.py" <<'PY'
"""One rank: timed bf16 compiled training steps of a recipe's model on random tokens; rank 0 writes JSON to argv[2].
GG_LOSS_IMPL=eager|compiled|liger overrides the loss (auto by default); GG_BENCH_DEVICE=cpu GG_BENCH_COMPILE=0 is the
CPU smoke run of this script."""
import json, os, sys, time, torch
from gradient_garden.config import load_recipe
from gradient_garden.models import tendril
from gradient_garden.models.tendril import build_model, count_parameters, flops_per_token
from gradient_garden.engine.distributed import init_distributed, parallelize, all_reduce, grad_sync
from gradient_garden.engine.optim import build_optimizers
from gradient_garden.hardware import peak_flops
recipe, out, micro = sys.argv[1], sys.argv[2], int(sys.argv[3])
dev_type = os.environ.get("GG_BENCH_DEVICE", "cuda")
tendril.LOSS_IMPL = os.environ.get("GG_LOSS_IMPL", "auto")
cfg = load_recipe(recipe).config
cfg.runtime.device, cfg.runtime.compile = dev_type, os.environ.get("GG_BENCH_COMPILE", "1") == "1"
env = init_distributed(cfg.runtime)
cuda = env.device.type == "cuda"
sync = torch.cuda.synchronize if cuda else (lambda: None)
torch.manual_seed(0)
model = parallelize(build_model(cfg.model).to(env.device), cfg.runtime, env)
opts = build_optimizers(model, cfg.optimizers, env.device.type)
T = cfg.training.seq_len
toks = torch.randint(0, cfg.model.vocab_size, (micro, T + 1), device=env.device)
# micro-steps per optimizer step as the recipe's run takes them (32 at 124M on one GPU): Muon's Newton-Schulz and
# AdamW run once per 0.5M tokens, as in training, not once per micro-batch
accum = int(os.environ.get("GG_BENCH_ACCUM", 0)) or max(1, cfg.training.total_batch_size // (micro * T * env.world_size))
def step():
    for i in range(accum):
        with grad_sync(model, sync=i == accum - 1), torch.autocast(env.device.type, dtype=torch.bfloat16):
            loss = model(toks[:, :-1], labels=toks[:, 1:]) / (micro * T * accum)
        loss.backward()
    for o in opts: o.step(); o.zero_grad(set_to_none=True)
step()                                               # compile + warm-up
sync()
if cuda: torch.cuda.reset_peak_memory_stats()
n, t0 = (4 if cuda else 1), time.perf_counter()
for _ in range(n): step()
sync(); dt = time.perf_counter() - t0
tps = n * accum * micro * T * env.world_size / dt
peak = peak_flops(env.device, "bf16")
mem = all_reduce(torch.tensor(float(torch.cuda.max_memory_allocated() if cuda else 0), device=env.device), "max").item()
if env.is_main:
    json.dump(dict(params=count_parameters(model), ranks=env.world_size, micro_batch=micro, seq_len=T, grad_accum=accum,
                   optimizers=[type(o).__name__ for o in opts], tokens_per_s=round(tps),
                   loss_impl=tendril.loss_impl(env.device.type), compiled=cfg.runtime.compile,
                   mfu=round(tps * flops_per_token(cfg.model, T) / (peak * env.world_size), 4),
                   peak_mem_gib=round(mem / 2**30, 2), activation_checkpointing=cfg.runtime.activation_checkpointing), open(out, "w"))
PY

cat > "$OUT/gen.py" <<'PY'
"Generation at batch 1 and 32 with the KV cache, 124M shape, bf16: decode tokens/s."
import json, sys, time, torch
from gradient_garden.config import load_recipe
from gradient_garden.models.tendril import build_model
cfg = load_recipe("recipes/pretraining/tendril-124m.yaml").config
model = build_model(cfg.model).to("cuda", torch.bfloat16).eval()
res = {}
for b in (1, 32):
    prompt = torch.randint(0, cfg.model.vocab_size, (b, 128), device="cuda")
    new = 256
    with torch.no_grad():
        def run():   # prefill 128 tokens, then greedy decode with the KV cache (allocated on first write, bf16 on the GPU)
            c = model.new_kv_cache(b, 128 + new)
            logits = model(prompt, kv_cache=c, start_pos=0)[:, -1]
            tok = logits.argmax(-1, keepdim=True)
            for i in range(new - 1):
                tok = model(tok, kv_cache=c, start_pos=128 + i)[:, -1].argmax(-1, keepdim=True)
        run(); torch.cuda.synchronize()
        t0 = time.perf_counter(); run(); torch.cuda.synchronize()
    res[f"batch{b}_tokens_per_s"] = round(b * new / (time.perf_counter() - t0))
json.dump(res, open(sys.argv[1], "w"))
PY

python "$OUT/step.py" recipes/pretraining/tendril-124m.yaml "$OUT/s124.json" 16
GG_LOSS_IMPL=eager python "$OUT/step.py" recipes/pretraining/tendril-124m.yaml "$OUT/s124e.json" 16   # the loss outside the graph, eager
python "$OUT/step.py" recipes/pretraining/tendril-400m.yaml "$OUT/s400.json" 16
if [ "$NGPU" -gt 1 ]; then
  torchrun --standalone --nproc-per-node "$NGPU" "$OUT/step.py" recipes/pretraining/tendril-124m.yaml "$OUT/f124.json" 16
  torchrun --standalone --nproc-per-node "$NGPU" "$OUT/step.py" recipes/pretraining/tendril-400m.yaml "$OUT/f400.json" 16
fi
python "$OUT/gen.py" "$OUT/gen.json" || echo '{"error": "generation failed"}' > "$OUT/gen.json"
# packed documents: flex_attention with a block mask vs SDPA with the dense mask, at a 2k-token SFT shape
python bench/flex_attention.py --device cuda --dtype bf16 --batch-size 16 --seq-len 2048 --dim 768 --n-layers 12 \
  --doc-len 300 | tail -1 > "$OUT/flex.json" || echo '{"error": "flex bench failed"}' > "$OUT/flex.json"
python - "$OUT" <<'PY'
import json, sys, torch
from pathlib import Path
d = Path(sys.argv[1])
r = {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__}
names = {"s124": "train_124m_1gpu", "s124e": "train_124m_1gpu_eager_loss", "s400": "train_400m_1gpu", "f124": "train_124m_fsdp2",
         "f400": "train_400m_fsdp2", "gen": "generation", "flex": "packed_documents_flex_vs_sdpa"}
for name, key in names.items():
    p = d/f"{name}.json"
    if p.exists() and p.read_text().strip(): r[key] = json.loads(p.read_text())
if "mfu" in r.get("train_124m_1gpu", {}) and "mfu" in r.get("train_124m_1gpu_eager_loss", {}):
    r["mfu_124m_compiled_loss_over_eager"] = round(r["train_124m_1gpu"]["mfu"] / r["train_124m_1gpu_eager_loss"]["mfu"], 3)
print(json.dumps(r))
PY
