"""Optimizers beyond the notebook: Muon on 2 and 4 gloo ranks (FSDP2, HSDP 2 x 2, DDP; gathered and distributed
Newton-Schulz) equal to one process, its overlapped step bit-equal to one bucket at a time, row blocks of expert weights
as units, LoRA-only groups."""
import copy, json, os
import pytest
import torch
from torch import nn
import torch.distributed as dist

from gloo_ranks import run_ranks

from gradient_garden.config import GlobalConfig
from gradient_garden.train.optim import (Muon, build_optimizers, classify_parameters, set_learning_rates, ns_flops,
                                         part_shapes, _replica_group)


def _model():
    "Matrices whose row counts do not split evenly over 2 ranks (FSDP2 shards dim 0 unevenly)."
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 7, bias=False), nn.Tanh(), nn.Linear(7, 5, bias=False), nn.Tanh(),
                         nn.Linear(5, 12, bias=False))


def _fsdp_worker(rank, world_size, out_dir):
    "Step Muon on a fully_shard-ed model and on an unsharded copy; write the max parameter difference."
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    ref = _model()
    model = copy.deepcopy(ref)
    for layer in model:
        if isinstance(layer, nn.Linear): fully_shard(layer)
    fully_shard(model)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    opt, ref_opt = Muon(model.parameters(), lr=0.05, weight_decay=0.1), Muon(ref.parameters(), lr=0.05,
                                                                             weight_decay=0.1)
    g = torch.Generator().manual_seed(123)
    for _ in range(4):
        x = torch.randn(8, 6, generator=g)  # the same batch on every rank: averaged grads equal the reference
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).pow(2).mean().backward()
            o.step(); o.zero_grad(set_to_none=True)
    diff = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    moved = max((q - q0).abs().max().item() for q, q0 in zip(ref.parameters(), _model().parameters()))
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f: f.write(f"{diff} {moved}")


@pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")
def test_muon_fsdp2_matches_single_process(tmp_path):
    run_ranks(_fsdp_worker, 2, tmp_path / "pg_init", str(tmp_path))
    for r in range(2):
        diff, moved = map(float, (tmp_path / f"rank{r}.txt").read_text().split())
        assert moved > 1e-3, "parameters did not move"
        assert diff <= 1e-6, f"rank {r}: FSDP2 Muon differs from single-process Muon by {diff}"


class _Net(nn.Module):
    "Uneven rows for every world size, three 7 x 7 matrices (one shape batch), and a fused q/k/v-style weight."
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(6, 7, bias=False), nn.Linear(7, 7, bias=False), nn.Linear(7, 7, bias=False)
        self.d = nn.Linear(7, 7, bias=False)
        self.qkv = nn.Linear(7, 13, bias=False)
        self.qkv.split_sizes = (7, 3, 3)
        self.e = nn.Linear(13, 5, bias=False)
    def forward(self, x):
        for m in (self.a, self.b, self.c, self.d, self.qkv, self.e): x = torch.tanh(m(x))
        return x

LINEARS = ("a", "b", "c", "d", "qkv", "e")
SPLITS = [None, None, None, None, (7, 3, 3), None]


def _muon(params, **kw):
    return Muon([{"params": list(params), "splits": SPLITS}], lr=0.05, weight_decay=0.1, ns_dtype="fp32", **kw)


def _ns_counter(counts):
    "Wrap the optimizer module's Newton-Schulz so every call adds its matmul FLOPs (FlopCounterMode) to `counts`."
    from torch.utils.flop_counter import FlopCounterMode
    import gradient_garden.train.optim as optim
    inner = optim.zeropower_via_newtonschulz
    def counted(*a, **k):
        with FlopCounterMode(display=False) as fc: out = inner(*a, **k)
        counts.append(fc.get_total_flops())
        return out
    optim.zeropower_via_newtonschulz = counted


def _wrap(layout, world, model, **kw):
    "`model` wrapped for `layout` and a Muon over its parameters."
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP
    if layout == "ddp":
        wrapped = DDP(model)
        return wrapped, _muon(model.parameters(), process_group=_replica_group(wrapped), **kw)
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if layout == "hsdp"
            else init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)))
    for n in LINEARS: fully_shard(getattr(model, n), mesh=mesh)
    return fully_shard(model, mesh=mesh), _muon(model.parameters(), **kw)


def _run(layout, world, distributed, counts):
    ("10 Muon steps on `_Net` wrapped for `layout`, on a copy stepped one bucket at a time (no overlap) and on a plain "
     "copy; max |difference|, max |change|, NS FLOPs here, and whether the two wrapped copies are bit-equal.")
    ref = _Net()
    model, blocking = copy.deepcopy(ref), copy.deepcopy(ref)
    wrapped, opt = _wrap(layout, world, model, distributed=distributed)
    wrapped_b, opt_b = _wrap(layout, world, blocking, distributed=distributed, overlap=False)
    ref_opt = _muon(ref.parameters())
    g, init = torch.Generator().manual_seed(123), [p.detach().clone() for p in ref.parameters()]
    for _ in range(10):
        x = torch.randn(8, 6, generator=g)  # the same batch on every rank: the averaged grads equal the reference's
        for m in (wrapped, wrapped_b, ref): m(x).pow(2).mean().backward()
        n0 = len(counts); opt.step(); flops = sum(counts[n0:]); ref_opt.step(); opt_b.step()   # flops: the last step's
        for o in (opt, opt_b, ref_opt): o.zero_grad(set_to_none=True)
    full = lambda p: p.full_tensor() if hasattr(p, "full_tensor") else p
    diff = max((full(p) - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    moved = max((q - q0).abs().max().item() for q, q0 in zip(ref.parameters(), init))
    same = all(torch.equal(full(p), full(q)) for p, q in zip(model.parameters(), blocking.parameters()))
    return dict(diff=diff, moved=moved, flops=flops, overlap_bit_equal=same)


def _muon_worker(rank, world, out_dir):
    "Every layout this world allows, distributed and gathered; one JSON file per rank."
    counts = []
    _ns_counter(counts)
    layouts = ["fsdp2", "ddp"] + (["hsdp"] if world == 4 else [])
    res = {f"{lay}/{alg}": _run(lay, world, alg == "distributed", counts) for lay in layouts
           for alg in ("distributed", "gathered")}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f: json.dump(res, f)
    print(rank, json.dumps(res))


@pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")
@pytest.mark.parametrize("world", [2, 4])
def test_distributed_muon_matches_one_process(tmp_path, world):
    run_ranks(_muon_worker, world, tmp_path / "pg_init", str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    one = sum(ns_flops(q) for m, sp in zip([(7, 6), (7, 7), (7, 7), (7, 7), (13, 7), (5, 13)], SPLITS)
              for q in part_shapes(m, sp))
    for case in ranks[0]:
        for r, res in enumerate(ranks):
            got = res[case]
            assert got["moved"] > 1e-2, f"{case}: parameters did not move"
            assert got["diff"] <= 1e-5, f"rank {r} {case}: differs from one process by {got['diff']}"
            assert got["overlap_bit_equal"], f"rank {r} {case}: the overlapped step differs from one bucket at a time"
            if case.endswith("gathered"): assert got["flops"] == one, (case, got["flops"])
        if case.endswith("distributed"):   # every matrix orthogonalised exactly once, split over the ranks
            assert sum(res[case]["flops"] for res in ranks) == one
            assert max(res[case]["flops"] for res in ranks) < one * (0.6 if world == 2 else 0.45), case


class _LoraLinear(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.base = nn.Linear(d, d, bias=False).requires_grad_(False)
        self.lora_A, self.lora_B = nn.Linear(d, 2, bias=False), nn.Linear(2, d, bias=False)


def test_lora_only_adapters_no_muon():
    m = nn.Module()
    m.tok_embeddings = nn.Embedding(10, 8).requires_grad_(False)
    m.wq = _LoraLinear(8)
    cfg = GlobalConfig().optimizers
    cfg.muon.enabled = True
    groups = classify_parameters(m)
    assert [n for n, _ in groups["adapters"]] == ["wq.lora_A.weight", "wq.lora_B.weight"]
    assert not groups["matrices"] and not groups["embeddings"]
    opts = build_optimizers(m, cfg, "cpu")
    assert [type(o).__name__ for o in opts] == ["AdamW"]
    assert [g["group"] for g in opts[0].param_groups] == ["adapters"]
    assert opts[0].param_groups[0]["weight_decay"] == cfg.adamw.weight_decay


def test_fused_adamw_steps_on_cpu():
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    cfg = GlobalConfig().optimizers
    cfg.adamw.fused = "yes"
    opts = build_optimizers(m, cfg, "cpu")
    assert opts[0].defaults["fused"] is True
    set_learning_rates(opts, 0, cfg, 10)
    before = [p.detach().clone() for p in m.parameters()]
    m(torch.randn(3, 4)).sum().backward()
    opts[0].step()
    assert all(not torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_real_tendril_groups_and_lora():
    registry = pytest.importorskip("gradient_garden.models.registry")
    from gradient_garden.config import ModelConfig
    from gradient_garden.models.lora import apply_lora
    cfg = GlobalConfig()
    cfg.model = ModelConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=64)
    cfg.optimizers.muon.enabled = True
    model = registry.build_model(cfg.model)
    groups = classify_parameters(model)
    # per block: wqkv, wo, w13, w2
    assert {g: len(v) for g, v in groups.items()} == {"embeddings": 1, "output": 1, "matrices": 8, "vectors": 5,
                                                      "adapters": 0}
    assert sum(p.numel() for v in groups.values() for _, p in v) == sum(p.numel() for p in model.parameters())
    opts = build_optimizers(model, cfg.optimizers, "cpu")
    assert [type(o).__name__ for o in opts] == ["AdamW", "Muon"]
    cfg.lora.enabled = True
    apply_lora(model, cfg.lora)
    opts = build_optimizers(model, cfg.optimizers, "cpu")
    assert [(type(o).__name__, g["group"], len(g["params"])) for o in opts
            for g in o.param_groups] == [("AdamW", "adapters", 16)]


class _Experts(nn.Module):
    "A 3-D weight (5 experts: uneven over 2 and 4 ranks) with row blocks 4 + 2, and a weight fused from three blocks."
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(5, 6, 4) * 0.3)
        self.split_sizes = {"w": (4, 2)}
        self.v = nn.Linear(4, 9, bias=False)
        self.v.split_sizes = (2, 4, 3)
    def forward(self, x): return torch.tanh(torch.einsum("bi,eoi->beo", torch.tanh(self.v(x))[:, :4], self.w)).sum()


def _experts_worker(rank, world, out_dir):
    "5 Muon steps on `_Experts` under FSDP2 (2 ranks) or HSDP 2 x 2 (4) and in one process; the max difference."
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    ref = _Experts()
    model, init = copy.deepcopy(ref), ref.w.detach().clone()
    mesh = (init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if world == 4
            else init_device_mesh("cpu", (world,)))
    fully_shard(model.v, mesh=mesh); fully_shard(model, mesh=mesh)
    opts = [Muon([{"params": [m.w, m.v.weight], "splits": [(4, 2), (2, 4, 3)]}], lr=0.05, weight_decay=0.1,
                 ns_dtype="fp32") for m in (model, ref)]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(3, 4, generator=g)
        for m, o in zip((model, ref), opts): m(x).backward(); o.step(); o.zero_grad()
    pairs = zip((model.w, model.v.weight), (ref.w, ref.v.weight))
    diff = max((p.full_tensor() - q).abs().max().item() for p, q in pairs)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"diff": diff, "moved": (ref.w - init).abs().max().item()}, f)


@pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")
@pytest.mark.parametrize("world", [2, 4])
def test_distributed_muon_splits_experts_into_units(tmp_path, world):
    "Row blocks of a 3-D (expert) weight sharded over its experts travel as pieces and equal one process's update."
    run_ranks(_experts_worker, world, tmp_path / "pg_init", str(tmp_path))
    for r in range(world):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["moved"] > 1e-2 and got["diff"] <= 1e-5, (r, got)
