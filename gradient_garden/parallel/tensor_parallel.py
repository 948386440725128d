from __future__ import annotations
import math
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from gradient_garden.config import ConfigError
from gradient_garden.models.attention import KVCache
from gradient_garden.models.tendril import Tendril, unwrap_model
from gradient_garden.parallel.distributed import apply_fsdp, init_rows
from gradient_garden.parallel.activation_checkpointing import apply_activation_checkpointing


def check_tp(cfg, tp: int):
    "Raise `ConfigError` when heads, KV heads or the FFN width cannot be split over `tp` ranks."
    if cfg.n_heads % tp:
        raise ConfigError(f"runtime.tp: got {tp}; must divide model.n_heads = {cfg.n_heads}")
    if cfg.n_kv_heads % tp:
        raise ConfigError(f"runtime.tp: got {tp}; model.n_kv_heads = {cfg.n_kv_heads} cannot be split over {tp} ranks "
                          "(each rank needs whole KV heads): use tp dividing n_kv_heads")


class StackedProjections:
    "A fused projection computed from its parts, `cat([part(x), ...], -1)`: each part sharded by heads on its own."
    def __init__(self, parts): self.parts = parts
    def __call__(self, x): return torch.cat([p(x) for p in self.parts], -1)


def unfuse(model: nn.Module) -> dict[str, tuple[str, int, tuple]]:
    ("Replace each fused projection (`wqkv`, `w13`) by its declared parts as separate linears; return each part's "
     "weight -> (fused weight, first row, fused shape).")
    source = {}
    for mname, m in list(model.named_modules()):
        fused = m.__dict__.get("fused_projections") or {}
        for fname, parts in fused.items():
            lin = m._modules.pop(fname)
            W, row = lin.weight, 0
            for pname, rows in parts.items():
                part = nn.Linear(W.shape[1], rows, bias=False, device=W.device, dtype=W.dtype)
                if not W.is_meta:
                    with torch.no_grad(): part.weight.copy_(W[row:row + rows])
                m.register_module(pname, part)
                pre = f"{mname}." if mname else ""
                source[f"{pre}{pname}.weight"] = (f"{pre}{fname}.weight", row, tuple(W.shape))
                row += rows
            object.__setattr__(m, fname, StackedProjections([m._modules[p] for p in parts]))
        if fused: m.fused_projections = {}
    return source


def tendril_tp_plan(model: nn.Module, sequence_parallel: bool = True) -> dict:
    ("torchtitan's plan for a Llama-style model: q/k/v, gate/up column-wise (by heads, by halves), wo/w2 row-wise; "
     "with SP the residual stream and norms split by sequence.")
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    if sequence_parallel: plan["norm"] = SequenceParallel()
    for i in range(len(model.layers)):
        b = f"layers.{i}"
        plan |= {f"{b}.attention.{p}": ColwiseParallel() for p in ("wq", "wk", "wv")}
        plan |= {f"{b}.feed_forward.{p}": ColwiseParallel() for p in ("w1", "w3")}
        plan |= {f"{b}.attention.wo": RowwiseParallel(output_layouts=seq),
                 f"{b}.feed_forward.w2": RowwiseParallel(output_layouts=seq)}
        if sequence_parallel:
            nil = (None,) * 5
            plan |= {f"{b}.attention_norm": SequenceParallel(), f"{b}.ffn_norm": SequenceParallel(),
                     f"{b}.attention": PrepareModuleInput(input_layouts=(seq, *nil),
                                                          desired_input_layouts=(Replicate(), *nil)),
                     f"{b}.feed_forward": PrepareModuleInput(input_layouts=(seq,),
                                                             desired_input_layouts=(Replicate(),))}
    return plan


class VocabParallelCrossEntropy(torch.autograd.Function):
    ("Summed cross-entropy of `h @ W.T` with the vocabulary split over `group` (this rank: rows `[start, start + "
     "W.shape[0])`), chunk by chunk, gradients formed in the forward.")
    @staticmethod
    def forward(ctx, h, weight, labels, chunk_rows: int, ignore_index: int, start: int, group):
        grad_h, grad_w = torch.empty_like(h), torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total, V = torch.zeros((), dtype=torch.float32, device=h.device), weight.shape[0]
        for s in range(0, h.shape[0], chunk_rows):
            hc, lab = h[s:s + chunk_rows], labels[s:s + chunk_rows]
            keep = lab != ignore_index
            t = lab - start
            mine = keep & (t >= 0) & (t < V)
            logits = (hc @ weight.T).float()
            top = logits.amax(-1)
            dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
            logits.sub_(top[:, None])
            target = torch.where(mine, logits.gather(1, t.clamp(0, V - 1)[:, None]).squeeze(1), 0)
            grad = logits.exp_()                                  # in place of the logits
            denom = grad.sum(-1)
            both = torch.stack([denom, target])
            dist.all_reduce(both, group=group)   # the softmax denominator and the target logit, summed over the vocabulary
            denom, target = both
            total += torch.where(keep, denom.log() - target, 0).sum()
            grad.div_(denom.masked_fill(~keep, float("inf"))[:, None])
            grad.scatter_add_(1, t.clamp(0, V - 1)[:, None], -mine[:, None].to(grad.dtype))
            grad = grad.to(h.dtype)
            torch.mm(grad, weight, out=grad_h[s:s + chunk_rows])
            grad_w.addmm_(grad.T.float(), hc.float())
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), (grad_w * grad_out).to(ctx.weight_dtype), None, None, None, None, None


def vocab_parallel_loss_sum(self: Tendril, h, labels) -> torch.Tensor:
    "`Tendril.loss_sum` with the head split by vocabulary over the tensor-parallel ranks; the same summed loss on each."
    w = self.output.weight
    mesh = w.device_mesh
    if not isinstance(h, DTensor): h = DTensor.from_local(h, mesh, [Replicate()], run_check=False)
    # every rank's whole sequence; its gradient is this rank's vocabulary's share: reduced (scattered under SP)
    h = h.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    h, labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    w_local = w.to_local()
    start = mesh.get_local_rank() * w_local.shape[0]
    rows = max(1, (1 << 21) // w_local.shape[0])
    return VocabParallelCrossEntropy.apply(h, w_local, labels, rows, -100, start, mesh.get_group())


def tp_kv_cache(self: Tendril, batch_size: int, max_seq_len: int | None = None) -> KVCache:
    "`Tendril.new_kv_cache` for this rank's KV heads."
    c, tp = self.cfg, self.tp_mesh.size()
    return KVCache(c.n_layers, batch_size, max_seq_len or c.max_seq_len, c.n_kv_heads // tp, c.head_dim)


TP_PLANS = {Tendril: tendril_tp_plan}


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool = True) -> nn.Module:
    "Shard `model` over `tp_mesh` by its class's plan: fused projections split, heads divided, loss and cache per rank."
    plan_of = TP_PLANS.get(type(model))
    if plan_of is None:
        raise ConfigError(f"runtime.tp: {type(model).__name__} has no tensor-parallel plan (have: "
                          f"{', '.join(c.__name__ for c in TP_PLANS)})")
    tp = tp_mesh.size()
    check_tp(model.cfg, tp)
    if model.cfg.tie_embeddings:
        raise ConfigError("runtime.tp: model.tie_embeddings is not supported with tensor parallelism")
    model.tp_sources, model.tp_mesh = unfuse(model), tp_mesh
    for block in model.layers:
        block.attention.n_heads //= tp
        block.attention.n_kv_heads //= tp
    parallelize_module(model, tp_mesh, plan_of(model, sequence_parallel))
    model.loss_sum = vocab_parallel_loss_sum.__get__(model)
    model.new_kv_cache = tp_kv_cache.__get__(model)
    return model


def tp_mesh_shape(world_size: int, tp: int) -> tuple[int, int]:
    "`(dp, tp)`: data-parallel shard ranks times tensor-parallel ranks; tp ranks are neighbours (one node)."
    if tp < 1 or world_size % tp:
        raise ConfigError(f"runtime.tp: got {tp}; must divide the world size {world_size}")
    return world_size // tp, tp


def build_tp_mesh(world_size: int, tp: int, device_type: str = "cpu"):
    "The 2-D `DeviceMesh` `(dp, tp)`."
    return init_device_mesh(device_type, tp_mesh_shape(world_size, tp), mesh_dim_names=("dp", "tp"))


def materialize_tp(model: nn.Module, device, seed: int) -> nn.Module:
    ("Storage on `device` for a meta-device TP (and FSDP2) model; each rank's block of every parameter drawn as "
     "`materialize` draws the unsplit model's.")
    inner = unwrap_model(model)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in inner.named_parameters():
            kind, std = inner.param_init(name)
            src, first, shape = inner.tp_sources.get(name, (name, 0, tuple(p.shape)))
            local, offset = p, (0,) * p.ndim
            if isinstance(p, DTensor):
                _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                local = p.to_local()
            rows = init_rows(shape, kind, std, seed, src, first + offset[0], first + offset[0] + local.shape[0],
                             local.device)
            if p.ndim == 2: rows = rows[:, offset[1]:offset[1] + local.shape[1]]
            local.copy_(rows)
        inner.init_buffers()
    return model


def parallelize_tp(model: nn.Module, mesh, precision: str = "fp32", activation_checkpointing: str = "none",
                   init_seed: int | None = None, sequence_parallel: bool = True) -> nn.Module:
    ("TP (and SP) over `mesh['tp']`, then FSDP2 over `mesh['dp']`, torchtitan's order; a meta-device model is "
     "materialised from `init_seed`.")
    apply_tp(model, mesh["tp"], sequence_parallel)
    apply_activation_checkpointing(model, activation_checkpointing)
    if mesh["dp"].size() > 1: apply_fsdp(model, precision, mesh["dp"])
    if any(p.is_meta for p in model.parameters()):
        if init_seed is None: raise ValueError("parallelize_tp: a model on the meta device needs init_seed")
        materialize_tp(model, mesh.device_type, init_seed)
    return model


def _storage(t: torch.Tensor):
    "The storage of this rank's part of `t`."
    t = t.to_local() if isinstance(t, DTensor) else t
    return (t.trigger_wait() if isinstance(t, AsyncCollectiveTensor) else t).untyped_storage()


def saved_activation_bytes(model: nn.Module, fn) -> int:
    ("Bytes of the distinct storages autograd saves for backward while `fn()` runs: this rank's shards, `model`'s "
     "parameters excluded.")
    params, seen = {_storage(p).data_ptr() for p in model.parameters()}, {}
    def pack(t):
        st = _storage(t)
        if st.data_ptr() not in params: seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t): fn()
    return sum(seen.values())
