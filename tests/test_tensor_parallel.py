"""Tensor and sequence parallelism on 4 gloo ranks as a dp 2 x tp 2 mesh (FSDP2 over dp, DTensor TP/SP over tp):
10 fp32 AdamW steps give one process's losses and gradients within 1e-5; activations saved for backward per rank at
tp 2 are at most 0.6x tp 1's; parameters and optimizer state per rank are 1/(dp tp) + the replicated norms; Muon
equals one process within 2e-6; KV-cache decoding and selective activation checkpointing under TP give one
process's logits and gradients; a dp 2 x tp 2 checkpoint resumes at dp 4 and in one process with equal weights and
optimizer state. One 4-rank world; the file took 82-115 s on a 2-core machine shared with other jobs (load 16-19),
about 28 s of CPU time in all."""
import json
from pathlib import Path
import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
from gradient_garden.config import ConfigError, ModelConfig
from gradient_garden.models.tendril import Tendril
from gradient_garden.checkpoint.state_dict import StateDictAdapter
from gradient_garden.checkpoint.checkpoints import (load_checkpoint, load_sharded_state, save_sharded_checkpoint,
                                                    sharded_state)
from gradient_garden.parallel.distributed import apply_fsdp
from gradient_garden.parallel.tensor_parallel import (apply_tp, build_tp_mesh, check_tp, parallelize_tp,
                                                      saved_activation_bytes, tp_activation_bytes)
from gradient_garden.train.optim import Muon

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64, multiple_of=16)
MHA_CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=256, max_seq_len=64, multiple_of=16)
MEM_CFG = ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=128, multiple_of=16)
B, T, STEPS, MUON_STEPS = 4, 16, 10, 3
META = {"step": STEPS, "stage": "pretraining", "architecture": "tendril", "config": {}}

def batches(n=STEPS, b=B, t=T, vocab=CFG.vocab_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (b, t + 1), generator=g) for _ in range(n)]

def model(cfg=CFG):
    torch.manual_seed(0)
    return Tendril(cfg)

def muon_optimizers(m, distributed=False):
    "Muon for the blocks' matrices, AdamW for the rest (the split `build_optimizers` makes)."
    mats = [p for n, p in m.named_parameters() if p.ndim == 2 and n.startswith("layers.")]
    rest = [p for n, p in m.named_parameters() if not (p.ndim == 2 and n.startswith("layers."))]
    splits = [getattr(mod, "split_sizes", None) for n, mod in m.named_modules()
              if n.startswith("layers.") and isinstance(mod, torch.nn.Linear)]
    return [Muon([{"params": mats, "splits": splits}], lr=0.02, ns_dtype="fp32", distributed=distributed),
            torch.optim.AdamW(rest, lr=1e-2)]

def train(m, optimizers, xs, scale, after=lambda loss, m: None):
    "Steps of the mean next-token loss over `xs`; `after(loss, m)` sees each step's loss and gradients."
    for x in xs:
        loss = m(x[:, :-1], labels=x[:, 1:]) / scale
        loss.backward()
        after(loss, m)
        for o in optimizers: o.step(); o.zero_grad()

def greedy_logits(m, prompt, new=4):
    "Logits of the prompt's last position and of `new` greedy KV-cache steps."
    cache, out = m.new_kv_cache(prompt.shape[0], 32), []
    with torch.no_grad():
        logits = m(prompt, kv_cache=cache)[:, -1]
        pos = prompt.shape[1]
        for _ in range(new):
            out.append(logits)
            tok = logits.argmax(-1, keepdim=True)
            logits = m(tok, kv_cache=cache, start_pos=pos)[:, -1]
            pos += 1
    return torch.stack(out)

def _full(t): return t.full_tensor() if hasattr(t, "full_tensor") else t

def _tp_world(rank, world, out):
    "dp 2 x tp 2: training, a checkpoint read back at dp 4, Muon, memory, decoding; rank 0 writes what it measured."
    out, res = Path(out), {}
    mesh = build_tp_mesh(world, 2)
    dp, dpr = mesh["dp"].size(), mesh["dp"].get_local_rank()
    mine = lambda xs: [x[dpr * len(x) // dp:(dpr + 1) * len(x) // dp] for x in xs]
    m = parallelize_tp(model(), mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses, grads = [], []
    def record(loss, m):
        l = loss.detach().clone()
        dist.all_reduce(l, group=mesh["dp"].get_group())
        losses.append(l.item() / dp)
        grads.append({k: _full(p.grad) for k, p in m.named_parameters()})
    train(m, [opt], mine(batches()), B * T // dp, record)
    local = lambda ts: sum(t.to_local().numel() if hasattr(t, "to_local") else t.numel() for t in ts)
    res["param_share"] = local(m.parameters()) / sum(p.numel() for p in m.parameters())
    states = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    res["optim_share"] = local(states) / sum(v.numel() for v in states)
    res["placements"] = {n: str(p.placements) for n, p in m.named_parameters() if n.startswith("layers.0.")}
    save_sharded_checkpoint(sharded_state(m, [opt]), META, out/"ckpt")
    weights = {k: _full(v) for k, v in m.state_dict().items()}
    optim_avg = {k: _full(opt.state[p]["exp_avg"]) for k, p in m.named_parameters()}
    dp4_weights, dp4_avg = _read_at_dp4(out)
    # selective activation checkpointing on the same mesh: one step's gradients
    ac = parallelize_tp(model(), mesh, activation_checkpointing="selective")
    x = mine(batches(1))[0]
    (ac(x[:, :-1], labels=x[:, 1:]) / (B * T // dp)).backward()
    ac_grads = {k: _full(p.grad) for k, p in ac.named_parameters()}
    # Muon on the same mesh, from the same start
    mu = parallelize_tp(model(), mesh)
    train(mu, muon_optimizers(mu), mine(batches(MUON_STEPS)), B * T // dp)
    muon_weights = {k: _full(v) for k, v in mu.state_dict().items()}
    # Muon's distributed path on a tp-only mesh (dp 1 x tp 4): Newton-Schulz split over the tp ranks
    mu4 = apply_tp(model(MHA_CFG), build_tp_mesh(world, 4)["tp"])
    train(mu4, muon_optimizers(mu4, distributed=True), batches(MUON_STEPS), B * T)
    muon_tp4 = {k: _full(v) for k, v in mu4.state_dict().items()}
    # activations saved for backward on this rank's micro-batch, tp 2 (with SP) against the same model unsplit
    x = mine(batches(1, b=B, t=MEM_CFG.max_seq_len, vocab=MEM_CFG.vocab_size))[0]
    one, two = model(MEM_CFG), apply_tp(model(MEM_CFG), mesh["tp"])
    res["act_tp1"], res["act_tp2"] = (saved_activation_bytes(k, lambda: k(x[:, :-1], labels=x[:, 1:]))
                                      for k in (one, two))
    # KV-cache decoding under TP (no SP: one new token cannot split by sequence)
    dec = apply_tp(model(), mesh["tp"], sequence_parallel=False)
    decoded = greedy_logits(dec, batches(1, b=2, t=7, seed=1)[0])
    if rank == 0:
        torch.save(dict(losses=losses, grads=grads, weights=weights, optim_avg=optim_avg, muon=muon_weights,
                        decoded=decoded, dp4=dict(weights=dp4_weights, optim_avg=dp4_avg), ac_grads=ac_grads,
                        muon_tp4=muon_tp4),
                   out/"tp.pt")
        (out/"tp.json").write_text(json.dumps(res))

def _read_at_dp4(out):
    "The dp 2 x tp 2 checkpoint read by FSDP2 over the same 4 ranks (the fused layout): full weights and AdamW state."
    m = apply_fsdp(model(), "fp32")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    train(m, [opt], batches(1), B * T)   # optimizer state to be overwritten
    load_sharded_state(Path(out)/"ckpt", m, [opt])
    return ({k: _full(v) for k, v in m.state_dict().items()},
            {k: _full(opt.state[p]["exp_avg"]) for k, p in m.named_parameters()})

@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    run_ranks(_tp_world, 4, d/"init_tp", str(d))
    return d

@pytest.fixture(scope="module")
def tp(worlds): return torch.load(worlds/"tp.pt"), json.loads((worlds/"tp.json").read_text())

def fused(sd: dict) -> dict:
    "A TP model's state (separate q/k/v, gate/up) in the one-process model's fused layout."
    return StateDictAdapter(model()).join(sd)

def one_process(optimizers_of, steps):
    "The same run in this one process: losses, gradients per step, final weights."
    m, losses, grads = model(), [], []
    def record(loss, m):
        losses.append(loss.item()); grads.append({k: p.grad.clone() for k, p in m.named_parameters()})
    train(m, optimizers_of(m), batches(steps), B * T, record)
    return m, losses, grads

def test_losses_and_gradients_equal_one_process(tp):
    got, _ = tp
    m, losses, grads = one_process(lambda m: [torch.optim.AdamW(m.parameters(), lr=1e-2)], STEPS)
    assert len(got["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=0, atol=1e-5)
    worst = max((fused(g)[k] - ref[k]).abs().max().item() for g, ref in zip(got["grads"], grads) for k in ref)
    print(f"loss {max(abs(a - b) for a, b in zip(got['losses'], losses)):.2e}, gradients {worst:.2e}")
    for step, (g, ref) in enumerate(zip(got["grads"], grads)):
        g = fused(g)
        assert set(g) == set(ref)
        for k in ref: torch.testing.assert_close(g[k], ref[k], rtol=0, atol=1e-5, msg=f"step {step + 1}: {k}")

def test_selective_activation_checkpointing_under_tp(tp):
    got, _ = tp
    _, _, grads = one_process(lambda m: [torch.optim.AdamW(m.parameters(), lr=1e-2)], 1)
    g = fused(got["ac_grads"])
    for k, ref in grads[0].items(): torch.testing.assert_close(g[k], ref, rtol=0, atol=1e-5, msg=k)

def test_the_mesh_splits_heads_and_sequence(tp):
    _, res = tp
    pl = res["placements"]
    # FSDP2 over dp on top of TP: q/k/v, gate/up by rows (heads, halves), wo/w2 by columns, norms replicated over tp
    assert pl["layers.0.attention.wq.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert pl["layers.0.attention.wo.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert pl["layers.0.feed_forward.w1.weight"] == pl["layers.0.attention.wq.weight"]
    assert pl["layers.0.attention_norm.weight"] == "(Shard(dim=0), Replicate())"

def test_activations_divide(tp):
    _, res = tp
    ratio = res["act_tp2"] / res["act_tp1"]
    print(f"activations saved per rank: tp 1 {res['act_tp1']:,} B, tp 2 {res['act_tp2']:,} B, ratio {ratio:.3f}")
    assert ratio <= 0.6, (res["act_tp1"], res["act_tp2"])
    # the plan's model (53_plan's tp column): all divides but the two all-gathered block inputs, whole on every rank
    per_rank_batch = B // 2
    gathered = 2 * MEM_CFG.n_layers * per_rank_batch * MEM_CFG.max_seq_len * MEM_CFG.dim * 4
    model_bytes = tp_activation_bytes(res["act_tp1"], gathered, 2)
    print(f"the plan's model: {model_bytes:,.0f} B, {model_bytes / res['act_tp2'] - 1:+.1%} of the measured")
    assert abs(model_bytes / res["act_tp2"] - 1) <= 0.1

def test_parameters_and_optimizer_state_divide(tp):
    _, res = tp
    norms = (2 * CFG.n_layers + 1) * CFG.dim / sum(p.numel() for p in model().parameters())
    print(f"per rank: parameters {res['param_share']:.4f}, AdamW state {res['optim_share']:.4f}, norms {norms:.4f}")
    for share in (res["param_share"], res["optim_share"]):   # norm gains are replicated over tp: the epsilon
        assert 1 / 4 <= share <= 1 / 4 + norms / 4 + 1e-9, (share, norms)

def test_muon_equals_one_process(tp):
    got, _ = tp
    m, _, _ = one_process(muon_optimizers, MUON_STEPS)
    ref, w = m.state_dict(), fused(got["muon"])
    print(f"Muon: {max((w[k] - ref[k]).abs().max().item() for k in ref):.2e}")
    for k in ref: torch.testing.assert_close(w[k], ref[k], rtol=0, atol=2e-6, msg=k)
    assert max((w[k] - model().state_dict()[k]).abs().max() for k in ref) > 1e-3   # it did move

def test_distributed_muon_on_a_tp_mesh_equals_one_process(tp):
    "dp 1 x tp 4, Muon's default distributed path: each matrix orthogonalised whole on one rank, as one process."
    got, _ = tp
    torch.manual_seed(0)
    m = Tendril(MHA_CFG)
    train(m, muon_optimizers(m), batches(MUON_STEPS), B * T)
    w = StateDictAdapter(m).join(got["muon_tp4"])
    for k, ref in m.state_dict().items(): torch.testing.assert_close(w[k], ref, rtol=0, atol=2e-6, msg=k)

def test_kv_cache_decoding_equals_one_process(tp):
    got, _ = tp
    torch.testing.assert_close(got["decoded"], greedy_logits(model(), batches(1, b=2, t=7, seed=1)[0]),
                               rtol=0, atol=1e-5)

def test_checkpoint_reshards_to_dp4_and_one_process(tp, worlds):
    got, _ = tp
    saved = fused(got["weights"])
    dp4 = got["dp4"]
    one = load_checkpoint(worlds/"ckpt")
    with pytest.warns(UserWarning, match="separate q/k/v"): one = StateDictAdapter(model()).from_old(one)
    for k in saved:
        torch.testing.assert_close(dp4["weights"][k], saved[k], rtol=0, atol=0, msg=k)
        torch.testing.assert_close(one["model"][k], saved[k], rtol=0, atol=0, msg=k)
    avg = fused(got["optim_avg"])
    for k in avg: torch.testing.assert_close(dp4["optim_avg"][k], avg[k], rtol=0, atol=0, msg=k)

def test_gqa_with_fewer_kv_heads_than_ranks_is_refused():
    with pytest.raises(ConfigError, match="n_kv_heads = 2 cannot be split over 4"): check_tp(CFG, 4)
    with pytest.raises(ConfigError, match="must divide model.n_heads"): check_tp(CFG, 3)

def test_the_data_parallel_parallelize_refuses_tp():
    from gradient_garden.config import RuntimeConfig
    from gradient_garden.parallel.distributed import DistEnv, parallelize
    with pytest.raises(ConfigError, match="runtime.tp: got 2; parallelize wraps data parallelism only"):
        parallelize(model(), RuntimeConfig(tp=2), DistEnv())

def test_gg_plan_shows_a_tp_column():
    "`gg plan` with runtime.tp = 2: a column of FSDP2 over world / 2 ranks and TP over 2, by `tp_memory`."
    from gradient_garden.config import GlobalConfig, RuntimeConfig
    from gradient_garden.train.plan import format_plan, plan
    from gradient_garden.parallel.tensor_parallel import tp_memory
    cfg = GlobalConfig(model=CFG, runtime=RuntimeConfig(tp=2, precision="bf16"))
    cfg.training.seq_len = CFG.max_seq_len   # 8 x 64 tokens a micro-step, 4 ranks: 4 micro-steps of the 8192
    p = plan(cfg, gpus_per_node=4)
    assert p.memory["fsdp+tp2"] == tp_memory(p.memory["fsdp2"], cfg)
    assert p.memory["fsdp+tp2"]["activations"]["none"] < 0.6 * p.memory["fsdp2"]["activations"]["none"]
    header = next(l for l in format_plan(p).splitlines() if l.startswith("GiB per rank"))
    assert header.split()[-1] == "fsdp+tp2", header

def test_a_tp_below_one_is_refused_when_the_config_is_read():
    from gradient_garden.checks import check_ranges
    from gradient_garden.config import GlobalConfig, RuntimeConfig
    with pytest.raises(ConfigError, match=r"runtime.tp: got 0; must be >= 1"):
        check_ranges(GlobalConfig(runtime=RuntimeConfig(tp=0)))
