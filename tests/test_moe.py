("TendrilMoE beyond the notebook: the router losses, dense equivalence, dispatch, no host sync, masks, KV cache, "
 "DDP/FSDP2.")
import dataclasses, io, os
import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gradient_garden.config import ConfigError, GlobalConfig, LoraConfig, ModelConfig
from gradient_garden.models.moe import (TendrilMoE, load_balancing_loss, moe_dispatch, reference_moe, route,
                                        router_z_loss, upcycle)
from gradient_garden.models.tendril import Tendril
from gradient_garden.models.registry import build_model, flops_per_token

CFG = ModelConfig(architecture="tendril_moe", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128,
                  multiple_of=16, max_seq_len=32, n_experts=4, n_experts_per_token=2)


def moe(**kw) -> TendrilMoE:
    torch.manual_seed(0)
    return build_model(dataclasses.replace(CFG, **kw))


# -- the router losses ------------------------------------------------------------------------------------------
def test_load_balancing_loss_is_minimal_for_uniform_routing_and_grows_with_imbalance():
    E, N, k = 8, 2048, 2
    uniform = load_balancing_loss(torch.full((N, E), 1 / E), torch.arange(N * k).view(N, k) % E)
    assert abs(uniform.item() - 1.0) < 1e-6
    torch.manual_seed(0)
    noise, values = torch.randn(N, E), []
    for bias in torch.linspace(0, 6, 7):
        logits = noise.clone(); logits[:, 0] += bias
        _, experts, probs = route(logits, k)
        values.append(load_balancing_loss(probs, experts).item())
    assert all(v >= 1.0 - 1e-6 for v in values)
    assert all(a < b for a, b in zip(values, values[1:])), values
    collapsed = torch.zeros(N, E); collapsed[:, 0] = 1   # every token's probability and first choice on expert 0
    top1 = load_balancing_loss(collapsed, torch.zeros(N, 1, dtype=torch.long))
    assert abs(top1.item() - E) < 1e-5


def test_z_loss_matches_its_formula_and_respects_the_mask():
    torch.manual_seed(0)
    logits, mask = torch.randn(10, 6) * 4, torch.tensor([1, 1, 0, 1, 0, 0, 1, 1, 1, 0]).bool()
    by_hand = [torch.log(torch.exp(row.double()).sum()) ** 2 for row in logits[mask]]
    assert torch.allclose(router_z_loss(logits, mask).double(), torch.stack(by_hand).mean(), atol=1e-5)
    assert torch.allclose(router_z_loss(logits), torch.logsumexp(logits, -1).pow(2).mean())


def test_aux_loss_is_the_weighted_sum_over_layers_on_supervised_tokens():
    model = moe(load_balance_coef=0.3, z_loss_coef=0.05).train()
    tokens = torch.randint(0, 128, (2, 16))
    mask = torch.rand(2, 16) > 0.4
    captured = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: captured.append(inp[0].reshape(-1, 32)))
             for m in model.moe_layers()]
    model(tokens, loss_mask=mask)
    for h in hooks: h.remove()
    expected = 0
    for m, x in zip(model.moe_layers(), captured):
        logits = F.linear(x, m.router.weight)
        _, experts, probs = route(logits, 2)
        expected = expected + 0.3 * load_balancing_loss(probs[mask.flatten()], experts[mask.flatten()]) \
                            + 0.05 * router_z_loss(logits[mask.flatten()])
    assert torch.allclose(model.aux_loss(), expected, atol=1e-6)
    with torch.no_grad(): model(tokens)                  # a no-grad forward does not replace the training aux
    assert torch.allclose(model.aux_loss(), expected, atol=1e-6)


# -- equivalence with the dense model ---------------------------------------------------------------------------
@pytest.mark.parametrize("router", ["softmax_topk", "topk_softmax"])
def test_one_expert_top1_equals_dense_tendril_with_the_same_weights(router):
    dense_cfg = dataclasses.replace(CFG, architecture="tendril")
    torch.manual_seed(0)
    dense = Tendril(dense_cfg).eval()
    model = TendrilMoE(dataclasses.replace(CFG, n_experts=1, n_experts_per_token=1, router=router)).eval()
    sd = {}
    # explicit name mapping: feed_forward.w13.weight -> feed_forward.experts.w13.weight[0]
    for k, v in dense.state_dict().items():
        sd[k.replace(".feed_forward.", ".feed_forward.experts.")] = v[None] if ".feed_forward." in k else v
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all(".router." in k for k in missing)
    tokens = torch.randint(0, 128, (3, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), dense(tokens), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(upcycle(dense, model.cfg).eval()(tokens), dense(tokens), rtol=1e-5, atol=1e-5)


def test_flops_count_active_parameters_only():
    many = dataclasses.replace(CFG, n_experts=64)
    assert flops_per_token(many, 32) - flops_per_token(CFG, 32) == 6 * CFG.n_layers * CFG.dim * 60   # routers only
    dense = flops_per_token(dataclasses.replace(CFG, architecture="tendril"), 32)
    assert flops_per_token(dataclasses.replace(CFG, n_experts_per_token=1),
                           32) == dense + 6 * CFG.n_layers * CFG.dim * 4


# -- dispatch ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [None, 1000, 7])
def test_dispatch_matches_the_loop_over_tokens_reference(capacity):
    model = moe()
    grouped = model.layers[0].feed_forward.experts
    torch.manual_seed(1)
    x = torch.randn(30, 32)
    gates, experts, _ = route(torch.randn(30, 4) + torch.tensor([2.0, 0, 0, -1]), 2)
    with torch.no_grad():
        torch.testing.assert_close(moe_dispatch(x, gates, experts, grouped, capacity),
                                   reference_moe(x, gates, experts, grouped, capacity), rtol=1e-5, atol=1e-5)


def test_capacity_drops_tokens_only_in_training_and_gradients_flow():
    model = moe(capacity_factor=0.5)
    ff = model.layers[0].feed_forward
    x = torch.randn(2, 16, 32, requires_grad=True)
    assert ff.capacity(32) == 8
    y = ff(x)
    y.square().sum().backward()
    assert (x.grad.abs().sum() > 0 and ff.experts.w2.weight.grad.abs().sum() > 0
            and ff.router.weight.grad.abs().sum() > 0)
    ff.eval()
    assert ff.capacity(32) is None
    with torch.no_grad(): assert not torch.allclose(ff(x), y)   # eval keeps every assignment


class _Ops(TorchDispatchMode):
    def __init__(self): super().__init__(); self.ops = set()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_forward_and_backward_never_synchronise_with_the_host(capacity_factor):
    model = moe(capacity_factor=capacity_factor).train()
    tokens, mask = torch.randint(0, 128, (2, 16)), torch.rand(2, 16) > 0.3
    with _Ops() as rec:
        loss = model(tokens, loss_mask=mask).float().logsumexp(-1).mean() + model.aux_loss()
        loss.backward()
        model.eval(); model(tokens)                      # the eval path (statistics) too
    syncing = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select", "aten.unique",
               "aten._unique2", "aten.bincount", "aten.repeat_interleave", "aten.tolist"}
    assert not (rec.ops & syncing), rec.ops & syncing


# -- the model in the platform ----------------------------------------------------------------------------------
def test_kv_cache_decoding_matches_the_full_forward_with_shared_experts():
    model = moe(n_shared_experts=1, capacity_factor=1.0).eval()
    seq = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        full = model(seq)
        cache = model.new_kv_cache(2, 16)
        parts = [model(seq[:, :7], kv_cache=cache)] + [model(seq[:, t:t + 1], kv_cache=cache, start_pos=t)
                                                       for t in range(7, 12)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


def test_router_metrics_count_supervised_tokens_of_eval_forwards():
    model = moe().eval()
    tokens = torch.randint(0, 128, (2, 10))
    mask = torch.zeros(2, 10, dtype=torch.bool); mask[:, :3] = True
    with torch.no_grad():
        model.set_loss_mask(mask); model(tokens)
        model(tokens, attn_mask=mask.long())                       # padding excluded without a loss mask
    counts = model.router_counts()
    assert counts[:, -1].tolist() == [12, 12] and counts[:, :-1].sum(-1).tolist() == [24, 24]
    m = model.router_metrics()
    assert set(m) >= {"moe/effective_experts", "moe/dead_experts", "moe/max_share", "moe/layer0/load/expert3"}
    assert all(isinstance(v, float) for v in m.values())
    assert 1 <= m["moe/effective_experts"] <= 4 and model.router_metrics() == {}   # reset after reading
    model.train(); model(tokens)
    assert model.router_counts() is None                            # training forwards do not accumulate


def test_state_dict_roundtrip_lora_hf_and_checkpoint_shape_checks(tmp_path):
    from gradient_garden.checkpoint.checkpoints import check_compatible
    from gradient_garden.models.hf import check_llama_compatible
    from gradient_garden.models.lora import apply_lora, lora_modules
    model = moe(n_shared_experts=1)
    buf = io.BytesIO(); torch.save(model.state_dict(), buf); buf.seek(0)
    other = moe(n_shared_experts=1); other.load_state_dict(torch.load(buf, weights_only=True))
    tokens = torch.randint(0, 128, (1, 8))
    with torch.no_grad(): torch.testing.assert_close(other.eval()(tokens), model.eval()(tokens))
    adapted = apply_lora(moe(), LoraConfig(enabled=True, rank=2))
    assert len(lora_modules(adapted)) == 4 * CFG.n_layers
    with pytest.raises(ConfigError, match="not an nn.Linear"):
        apply_lora(moe(), LoraConfig(enabled=True, rank=2, target_modules=["w2"]))
    with pytest.raises(ConfigError, match="mixture-of-experts"): check_llama_compatible(CFG)
    cfg = GlobalConfig(); cfg.model = CFG
    ckpt = dict(architecture="tendril_moe", config=cfg.to_dict(), stage="pretraining", step=1)
    check_compatible(ckpt, cfg)
    cfg8 = GlobalConfig(); cfg8.model = dataclasses.replace(CFG, n_experts=8)
    with pytest.raises(ConfigError, match="model.n_experts: got 8"): check_compatible(ckpt, cfg8)
    with pytest.raises(ConfigError, match="model.n_experts_per_token: got 5"): moe(n_experts_per_token=5)
    with pytest.raises(ConfigError, match="use softmax_topk"): moe(router="topk_softmax", n_experts_per_token=1)


# -- DDP and FSDP2 ----------------------------------------------------------------------------------------------
def _train(model, batches, rank=None, world=1, steps=2):
    "A few AdamW steps of CE + aux on this rank's share of each batch; returns the full parameters."
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for tokens in batches[:steps]:
        mine = tokens if rank is None else tokens.chunk(world)[rank]
        loss = F.cross_entropy(model(mine[:, :-1]).flatten(0, 1).float(), mine[:, 1:].flatten())
        (loss + getattr(model, "module", model).aux_loss()).backward()
        opt.step(); opt.zero_grad(set_to_none=True)
    sd = getattr(model, "module", model).state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in sd.items()}


def _reference(batches, world, steps=2):
    "One process: the mean over ranks' micro-batches of (CE + aux) (each rank's aux is over its own tokens)."
    model = moe()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for tokens in batches[:steps]:
        for part in tokens.chunk(world):
            loss = F.cross_entropy(model(part[:, :-1]).flatten(0, 1), part[:, 1:].flatten())
            ((loss + model.aux_loss()) / world).backward()
        opt.step(); opt.zero_grad(set_to_none=True)
    return model.state_dict()


def _dist_worker(rank, world, out_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from gradient_garden.parallel.distributed import apply_fsdp
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 128, (4, 17), generator=g) for _ in range(2)]
    ddp = _train(DDP(moe()), batches, rank, world)
    fsdp = _train(apply_fsdp(moe()), batches, rank, world)
    ref = _reference(batches, world)
    diffs = [max((a[k] - ref[k]).abs().max().item() for k in ref) for a in (ddp, fsdp)]
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f: f.write(" ".join(map(str, diffs)))


@pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")
def test_ddp_and_fsdp2_match_one_process(tmp_path):
    run_ranks(_dist_worker, 2, tmp_path / "pg", str(tmp_path))
    for r in range(2):
        ddp, fsdp = map(float, (tmp_path / f"rank{r}.txt").read_text().split())
        assert ddp < 1e-5 and fsdp < 1e-5, (r, ddp, fsdp)


# -- router statistics: local in the model, summed over ranks by the trainer ---------------------------------------
def _router_batch(rank):
    "A validation batch of this rank: its own tokens, the first three positions unsupervised."
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(100 + rank))
    labels = tokens[:, 1:].clone(); labels[:, :3] = -100
    return {"input_ids": tokens[:, :-1], "labels": labels}

class _OneBatch:
    "A loader that hands out one rank's batch."
    def __init__(self, rank): self.rank = rank
    def next_batch(self): return _router_batch(self.rank)
    def fixed_batches(self, n): return [_router_batch(self.rank) for _ in range(n)]

def _router_worker(rank, world, out_dir):
    "Validate through the trainer on this rank's batch; write the router metrics it keeps."
    import json
    from unittest import mock
    from gradient_garden.config import from_plain
    from gradient_garden.parallel.distributed import DistEnv
    from gradient_garden.train.trainer import Trainer
    from gradient_garden.stages.pretraining import CausalLMTask
    cfg = from_plain(GlobalConfig, dict(model=dataclasses.asdict(CFG), runtime=dict(device="cpu"),
                     training=dict(seq_len=16, micro_batch_size=2, total_batch_size=2 * 16 * world, max_steps=1),
                     validation=dict(steps=1), paths=dict(runs=str(out_dir))))
    torch.manual_seed(0)
    tr = Trainer(cfg, moe(), CausalLMTask(), _OneBatch(rank), _OneBatch(rank), env=DistEnv(rank, rank, world),
                 log_to_console=False)
    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as reduce:
        tr.validate()
    with open(os.path.join(out_dir, f"router{rank}.json"), "w") as f:
        json.dump(dict(metrics=tr.router_metrics, reduces=reduce.call_count), f)

@pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")
def test_router_metrics_are_summed_over_ranks_by_the_engine(tmp_path):
    "Two ranks validating different batches log the metrics of one process that saw both; the model reduces nothing."
    import json
    from unittest import mock as _mock
    run_ranks(_router_worker, 2, tmp_path / "pg", str(tmp_path))
    torch.manual_seed(0); one = moe().eval()
    with torch.no_grad(), _mock.patch.object(dist, "all_reduce", side_effect=AssertionError("the model reduced")):
        for r in range(2):
            b = _router_batch(r); one.set_loss_mask(b["labels"] != -100); one(b["input_ids"])
        counts = one.router_counts()
        expected = one.router_metrics()
    assert counts[:, -1].tolist() == [2 * 2 * 13] * CFG.n_layers          # supervised tokens of both ranks
    for r in range(2):
        got = json.loads((tmp_path / f"router{r}.json").read_text())
        assert got["metrics"].keys() == expected.keys()
        assert all(abs(got["metrics"][k] - v) < 1e-6 for k, v in expected.items()), (r, got["metrics"], expected)
        assert got["reduces"] == 2                    # the trainer's two: router counts, then the loss sums
