"""HSDP on 4 gloo ranks (a 2 x 2 mesh, replicate x shard), 3 micro-steps through `grad_sync`: every collective call
is counted with its group and buffer bytes. The shard group reduce-scatters every micro-step; the replicas all-reduce
once a step, exactly the gradient shard (`step_bytes`); the accumulated gradients equal one process's gradient of
the same 12 micro-batches."""
import json
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo_ranks import run_ranks
from gradient_garden.config import ModelConfig
from gradient_garden.models.registry import build_model
from gradient_garden.parallel.distributed import apply_fsdp, grad_sync, step_bytes

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=32)
ACCUM, REPLICATE, SHARD = 3, 2, 2

def batch(rank: int, micro: int) -> torch.Tensor:
    "Rank `rank`'s tokens of micro-step `micro` (2 x 17, from their own seed)."
    return torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(100 * rank + micro))

def lm_loss(model, toks): return F.cross_entropy(model(toks[:, :-1]).flatten(0, 1), toks[:, 1:].flatten())

def counting(calls: list):
    "Wrap the collectives FSDP2 calls so that each call appends (name, group ranks, buffer bytes) to `calls`."
    def wrap(name, real, arg, pos):
        def f(*a, **k):
            t = a[pos] if len(a) > pos else next(k[n] for n in (arg, f"{arg}_tensor") if n in k)
            g = k.get("group")
            ranks = tuple(dist.get_process_group_ranks(g)) if g is not None else tuple(range(dist.get_world_size()))
            calls.append((name, ranks, t.numel() * t.element_size()))
            return real(*a, **k)
        return f
    for name, arg, pos in (("all_reduce", "tensor", 0), ("all_gather_single", "input", 1),
                           ("reduce_scatter_single", "input", 1)):
        setattr(dist, name, wrap(name, getattr(dist, name), arg, pos))

def body(rank, world, out):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (REPLICATE, SHARD), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0); model = apply_fsdp(build_model(CFG), "fp32", mesh)
    groups = {tuple(dist.get_process_group_ranks(mesh[d].get_group())): d for d in ("replicate", "shard")}
    calls = []; counting(calls)
    per_micro = []
    for m in range(ACCUM):
        with grad_sync(model, sync=m == ACCUM - 1):
            lm_loss(model, batch(rank, m)).backward()
        per_micro.append(len(calls))
    counted = {}
    for name, ranks, nbytes in calls:
        dim = groups[ranks]
        counted.setdefault(dim, {}).setdefault(name.replace("_single", ""), 0)
        counted[dim][name.replace("_single", "")] += nbytes
    ar_micro = [sum(1 for n, r, _ in calls[a:b] if n == "all_reduce")
                for a, b in zip([0] + per_micro[:-1], per_micro)]
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.manual_seed(0); plain = build_model(CFG)
        (sum(lm_loss(plain, batch(r, m)) for r in range(world) for m in range(ACCUM)) / world).backward()
        diff = max(float((grads[n] - p.grad).abs().max()) for n, p in plain.named_parameters())
        expect = step_bytes(plain, REPLICATE, SHARD, ACCUM)
        (out/"bytes.json").write_text(json.dumps(dict(counted=counted, expect=expect, all_reduces=ar_micro,
                                                      units=CFG.n_layers + 1, diff=diff)))

def test_hsdp_all_reduces_once_a_step(tmp_path):
    run_ranks(body, 4, tmp_path/"init", tmp_path)
    r = json.loads((tmp_path/"bytes.json").read_text())
    assert r["all_reduces"] == [0, 0, r["units"]], r["all_reduces"]   # one per unit, in the last micro-step only
    assert r["counted"] == r["expect"], (r["counted"], r["expect"])
    grad_bytes = 4 * sum(p.numel() for p in build_model(CFG).parameters())
    assert r["counted"]["replicate"]["all_reduce"] == grad_bytes // SHARD    # one all-reduce of the gradient shard
    assert r["counted"]["shard"]["reduce_scatter"] == ACCUM * grad_bytes     # a reduce-scatter every micro-step
    assert r["diff"] < 1e-6, r["diff"]
