("Expert parallelism on 2 gloo ranks, alone and with FSDP2: logits and gradients equal one process, half the expert "
 "parameters per rank, and the all-to-all bytes per step equal the count from the router's choices.")
import os, subprocess, sys
from pathlib import Path
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT

from gradient_garden.config import ModelConfig
from gradient_garden.models.moe import TendrilMoE, route

CFG = dict(architecture="tendril_moe", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
           max_seq_len=16, n_experts=8, n_experts_per_token=2)


def batch() -> torch.Tensor:
    return torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))


def routed(model) -> tuple[list, list]:
    "Forward hooks that record each MoE layer's expert choices `[N, k]`; (the records, the hook handles)."
    seen = []
    def hook(m, inp, out):
        x = inp[0].reshape(-1, inp[0].shape[-1]).detach().float()
        seen.append(route(F.linear(x, m.router.weight.detach().float()), m.k, m.router_kind)[1])
    return seen, [m.register_forward_hook(hook) for m in model.moe_layers()]


def _worker(rank, world, out, mode, capacity):
    "One training step of TendrilMoE with expert parallelism (and FSDP2 when `mode` is fsdp) on this rank's half."
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from gradient_garden.parallel.expert_parallel import apply_expert_parallel, apply_fsdp_ep, expert_parallel_params
    torch.manual_seed(0)
    model = TendrilMoE(ModelConfig(**CFG, capacity_factor=capacity)).train()
    mesh = init_device_mesh("cpu", (world,))
    counter = apply_expert_parallel(model, mesh)
    experts = expert_parallel_params(model)
    local = sum(p.to_local().numel() for p in experts)
    if mode == "fsdp": apply_fsdp_ep(model, mesh=mesh)
    seen, hooks = routed(model)
    b = batch()[2 * rank:2 * rank + 2]
    logits = model(b[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten()).backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if isinstance(g, DTensor): g = g.full_tensor()
        elif mode == "alone": dist.all_reduce(g); g = g / world      # the data-parallel average DDP would take
        grads[name] = g
    torch.save(dict(logits=logits.detach(), grads=grads, bytes=counter["bytes"], local=local,
                    total=sum(p.numel() for p in experts), experts=seen), Path(out)/f"r{rank}.pt")


def reference(capacity) -> tuple[list, dict]:
    "One process: each half's logits, and the gradients of the mean of the two halves' losses."
    torch.manual_seed(0)
    model = TendrilMoE(ModelConfig(**CFG, capacity_factor=capacity)).train()
    logits, loss = [], 0
    for h in batch().split(2):
        lg = model(h[:, :-1]); logits.append(lg.detach())
        loss = loss + F.cross_entropy(lg.flatten(0, 1), h[:, 1:].flatten()) / 2
    loss.backward()
    return logits, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode,capacity", [("alone", None), ("fsdp", None), ("alone", 1.0)])
def test_expert_parallel_equals_one_process(tmp_path, mode, capacity):
    script = (f"import sys; sys.path[:0] = [{str(ROOT/'tests')!r}]\nfrom gloo_ranks import run_ranks\n"
              f"from test_expert_parallel import _worker\n"
              f"run_ranks(_worker, 2, {str(tmp_path/'pg')!r}, {str(tmp_path)!r}, {mode!r}, {capacity!r})")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [torch.load(tmp_path/f"r{i}.pt") for i in range(2)]
    logits, grads = reference(capacity)
    for i, rk in enumerate(ranks):
        assert (rk["logits"] - logits[i]).abs().max() < 1e-5
        assert set(rk["grads"]) == set(grads)
        for n, g in grads.items(): assert (rk["grads"][n] - g).abs().max() < 1e-5, (i, n)
        assert rk["local"] * 2 == rk["total"]                          # experts per rank: 1/ep
    if capacity is None:      # bytes sent to the other rank: E/2 int64 counts, then 4 x dim fp32 values per row
        E, dim, ep = CFG["n_experts"], CFG["dim"], 2
        for i, rk in enumerate(ranks):
            expected = 0
            for layer in range(CFG["n_layers"]):
                mine, theirs = ranks[i]["experts"][layer], ranks[1 - i]["experts"][layer]
                sent = int(((mine // (E // ep)) != i).sum())
                got = int(((theirs // (E // ep)) == i).sum())
                expected += (E - E // ep) * 8 + 2 * (sent + got) * dim * 4
            assert rk["bytes"] == expected, (i, rk["bytes"], expected)
