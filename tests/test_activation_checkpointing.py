"""Activation checkpointing composes with what the trainer applies around it: FSDP2 and DDP on 2 gloo ranks,
torch.compile, LoRA and TendrilMoE, with gradients equal to the model without it (fp32); a bad setting is one line."""
import pytest
import torch
from gloo_ranks import run_ranks
from gradient_garden.config import ConfigError, GlobalConfig, LoraConfig, ModelConfig, RuntimeConfig, from_plain
from gradient_garden.models.registry import build_model
from gradient_garden.parallel.activation_checkpointing import apply_activation_checkpointing
from gradient_garden.parallel.distributed import DistEnv, parallelize

SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64)
MOE = dict(SMALL, architecture="tendril_moe", n_experts=4, n_experts_per_token=2)

def tokens(batch=4, seq=32, seed=0):
    return torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))

def grads_of(model, toks, scale=1.0):
    "Loss (summed, times `scale`) and full gradients by parameter name after one backward."
    loss = model(toks[:, :-1], labels=toks[:, 1:]) * scale
    aux = model.aux_loss() if hasattr(model, "aux_loss") else None   # None: a model without an auxiliary loss
    if aux is not None: loss = loss + aux
    loss.backward()
    full = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g
    return loss.detach(), {n.replace("module.", ""): full(p.grad).clone() for n, p in model.named_parameters()
                           if p.grad is not None}

def fresh(cfg: dict, seed=0):
    torch.manual_seed(seed)
    return build_model(ModelConfig(**cfg))

def assert_same_grads(a: dict, b: dict, atol=1e-6, rtol=1e-5):
    assert a.keys() == b.keys()
    for n in a: torch.testing.assert_close(a[n], b[n], atol=atol, rtol=rtol, msg=lambda m: f"{n}: {m}")

@pytest.mark.parametrize("cfg", [SMALL, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gradients_equal_without_checkpointing(cfg, mode):
    _, ref = grads_of(fresh(cfg), tokens())
    _, got = grads_of(apply_activation_checkpointing(fresh(cfg), mode), tokens())
    assert_same_grads(ref, got)

def test_lora_and_checkpointing():
    from gradient_garden.models.lora import apply_lora
    lora = LoraConfig(enabled=True, rank=4, target_modules=["wq", "wv", "w2"])
    def build(mode):
        m = apply_lora(fresh(SMALL), lora)
        torch.manual_seed(1)
        for n, p in m.named_parameters():
            if "lora_b" in n: torch.nn.init.normal_(p, std=0.02)   # non-zero adapters, so their A gets a gradient too
        return apply_activation_checkpointing(m, mode)
    _, ref = grads_of(build("none"), tokens())
    assert any("lora" in n for n in ref) and all("lora" in n for n in ref)
    for mode in ("full", "selective"): assert_same_grads(ref, grads_of(build(mode), tokens())[1])

def test_compile_and_checkpointing(mode="selective"):
    # parallelize's order: checkpointing, then each block compiled in place; selective is the harder case for dynamo
    # (the policy's dispatch mode is traced into the graph); one mode keeps the test's compile time down
    _, ref = grads_of(fresh(SMALL), tokens())
    model = parallelize(fresh(SMALL), RuntimeConfig(device="cpu", compile=True, activation_checkpointing=mode),
                        DistEnv())
    assert all(b.activation_checkpointing == mode for b in model.layers)
    assert_same_grads(ref, grads_of(model, tokens())[1], atol=1e-5, rtol=1e-4)

def _wrapped_rank(rank, world, out, cfg, fsdp, mode):
    "One rank: its half of the batch through parallelize (FSDP2 or DDP) with checkpointing; rank 0 saves the gradients."
    model = parallelize(fresh(cfg), RuntimeConfig(device="cpu", fsdp=fsdp, activation_checkpointing=mode),
                        DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world))
    # every rank on one node: FSDP2 shards each parameter over both ranks (not replicated, as HSDP over 2 nodes would)
    if fsdp:
        for n, p in model.named_parameters():
            assert [type(q).__name__ for q in p.placements] == ["Shard"], f"{n}: {p.placements}"
            assert p.to_local().shape[0] == len(torch.arange(p.shape[0]).chunk(world)[rank]) < p.shape[0], n
    toks = tokens()
    half = toks.shape[0] // world
    # each rank's loss is a sum over its half; DDP/FSDP2 average gradients over ranks, so scale by world to get the sum
    loss, grads = grads_of(model, toks[rank * half:(rank + 1) * half], scale=world)
    if rank == 0: torch.save(grads, out)

# router losses are per-rank means: not additive over ranks
MOE_NO_AUX = dict(MOE, load_balance_coef=0.0, z_loss_coef=0.0)

@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "ddp"])
@pytest.mark.parametrize("cfg", [SMALL, MOE_NO_AUX], ids=["dense", "moe"])
def test_fsdp2_and_ddp_with_checkpointing(tmp_path, fsdp, cfg):
    _, ref = grads_of(fresh(cfg), tokens())
    mode = "selective" if fsdp else "full"
    run_ranks(_wrapped_rank, 2, tmp_path/"init", tmp_path/"grads.pt", cfg, fsdp, mode)
    assert_same_grads(ref, torch.load(tmp_path/"grads.pt", weights_only=True), atol=1e-5, rtol=1e-4)

def test_bad_settings_are_one_line():
    with pytest.raises(ConfigError, match=r"runtime.activation_checkpointing: got 'most' \(str\); expected one of "
                                          r"'none', 'full', 'selective'"):
        from_plain(GlobalConfig, {"runtime": {"activation_checkpointing": "most"}})
    with pytest.raises(ConfigError, match="no `layers` blocks to checkpoint"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), "full")
    m = fresh(SMALL)
    m.layers[1].compile()
    with pytest.raises(ConfigError, match=r"model.layers\[1\] is already compiled; apply activation checkpointing "
                                          r"before torch.compile"):
        apply_activation_checkpointing(m, "selective")
