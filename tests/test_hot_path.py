"""The GPU hot path, checked on CPU: no host-device synchronisation inside a training step, the attention kernel each
path asks for, bounded torch.compile graphs, FSDP2 accumulation without per-micro-step reduce-scatters, per-rank CUDA
RNG state, the GPU datasheet table, and the whole step on fake CUDA tensors without a device mismatch."""
import json, os, shutil, subprocess, sys, tempfile
from collections import Counter
from pathlib import Path
from unittest import mock
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from gradient_garden.config import GlobalConfig, from_plain

aten = torch.ops.aten

# -- the sync detector --------------------------------------------------------------------------------------------
# ops that make the host wait for the device on CUDA: a scalar read, or an output whose size depends on the data
SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.equal.default,
            aten.is_nonzero.default, aten.bincount.default, aten._unique2.default, aten.unique_consecutive.default,
            aten.unique_dim.default, aten.allclose.default, aten.argwhere.default}


class SyncDetector(TorchDispatchMode):
    "Counts the ops that would synchronise a CUDA host with its device, with a short stack of where each came from."
    def __init__(self):
        super().__init__()
        self.found = Counter()

    def _record(self, what):
        import traceback
        here = [f"{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_stack()
                if "gradient_garden" in f.filename][-3:]
        self.found[(what, " < ".join(reversed(here)))] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNC_OPS: self._record(str(func))
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            if any(torch.is_tensor(i) and i.dtype == torch.bool for i in args[1] if i is not None):
                self._record(f"{func} with a boolean mask")      # = nonzero, then gather: data-dependent size
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None: self._record(str(func))
        return func(*args, **kwargs)


HOST_TENSORS: dict[int, torch.Tensor] = {}   # id -> tensor the test loaders handed out: host memory in a GPU run


class BlockingCopyDetector(TorchFunctionMode):
    ("Counts host-to-device copies that block: Python data made a device tensor, a loader's tensor moved without "
     "non_blocking.")
    def __init__(self, device, package_only: bool = True):
        super().__init__()
        self.device, self.found, self.package_only = torch.device(device), Counter(), package_only

    def _record(self, what):
        import traceback
        here = [f"{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_stack()
                if "gradient_garden" in f.filename][-3:]
        if here or not self.package_only: self.found[(what, " < ".join(reversed(here)))] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and args and not torch.is_tensor(args[0]):
            # with a device: a blocking copy; without: a host tensor that the step then has to copy over
            self._record(f"{func.__name__}(python data{', device=...' if kwargs.get('device') is not None else ''})")
        elif func is torch.Tensor.to and id(args[0]) in HOST_TENSORS and not kwargs.get("non_blocking", False) \
                and not any(a is True for a in args[2:]):
            self._record("a loader's tensor moved by Tensor.to(device) without non_blocking")
        return func(*args, **kwargs)


class HostSyncs:
    "Both detectors at once; `report()` lists what was found."
    def __init__(self, device="cpu", package_only=True):
        self.syncs, self.copies = SyncDetector(), BlockingCopyDetector(device, package_only)
    def __enter__(self):
        self.copies.__enter__(); self.syncs.__enter__(); return self
    def __exit__(self, *exc):
        self.syncs.__exit__(*exc); self.copies.__exit__(*exc)
    @property
    def total(self) -> int: return sum(self.syncs.found.values()) + sum(self.copies.found.values())
    def report(self) -> str:
        return "\n".join(f"{n} x {what} at {where}"
                         for (what, where), n in (self.syncs.found + self.copies.found).items())


def test_detector_catches_the_usual_syncs():
    "The detector sees `.item()`, a boolean-mask index, a Python float sent to the device, and a blocking `.to`."
    x = torch.randn(8)
    with HostSyncs() as d: x.sum().item()
    assert sum(d.syncs.found.values()) == 1
    with HostSyncs() as d: x[x > 0]
    assert any("boolean mask" in w for w, _ in d.syncs.found)
    with HostSyncs(package_only=False) as d: torch.tensor(2.0, device="cpu"); host({"x": x})["x"].to("cpu")
    assert sum(d.copies.found.values()) == 2
    with HostSyncs(package_only=False) as d:
        x * 2; x.cumsum(0); x.sort(); torch.full((), 2.0, device="cpu"); x.to("cpu", non_blocking=True)
    assert d.total == 0, d.report()


# -- one training step of each task ---------------------------------------------------------------------------------
VOCAB, T = 64, 16

def tiny_cfg(arch="tendril", n_layers=2, **training) -> GlobalConfig:
    "A two-layer model and a two-micro-step optimizer step of 2 x 16 tokens each."
    model = dict(architecture=arch, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=T,
                 multiple_of=16)
    if arch == "tendril_moe": model |= dict(n_experts=4, n_experts_per_token=2)
    return from_plain(GlobalConfig, dict(model=model, runtime=dict(device="cpu"),
        training=dict(dict(seq_len=T, micro_batch_size=2, total_batch_size=2 * 2 * T, max_steps=4, log_every=4,
                           grad_clip=1.0), **training),
        optimizers=dict(adamw=dict(fused="yes")),   # as on CUDA: the step count stays a device tensor
        validation=dict(enabled=False, every=0, steps=2), generation=dict(every=0), checkpointing=dict(every=0),
        paths=dict(runs=tempfile.mkdtemp())))


def host(batch: dict) -> dict:
    "Mark the batch's tensors as host memory for the copy detector."
    HOST_TENSORS.update({id(v): v for v in batch.values()})   # kept alive: ids stay unique
    return batch


class ListLoader:
    "Cycles through prepared CPU batches; resumable by position."
    def __init__(self, batches): self.batches, self.pos = batches, 0
    def next_batch(self):
        b = self.batches[self.pos % len(self.batches)]; self.pos += 1
        return host({k: v.clone() for k, v in b.items()})
    def fixed_batches(self, n): return [host(self.batches[i % len(self.batches)]) for i in range(n)]
    def state_dict(self): return dict(pos=self.pos)
    def load_state_dict(self, d): self.pos = d["pos"]


def causal_batches(n=4, packed=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        seq = torch.randint(0, VOCAB, (2, T + 1), generator=g)
        b = dict(input_ids=seq[:, :-1].contiguous(), labels=seq[:, 1:].contiguous())
        if packed:   # two documents per row, the first one's prompt unsupervised
            b["labels"][:, :3] = -100
            doc = (torch.arange(T) >= T // 2).long().expand(2, T).contiguous()
            b |= dict(doc_ids=doc, position_ids=torch.arange(T).remainder(T // 2).expand(2, T).contiguous())
        out.append(b)
    return out


def make_parts(kind: str, n_layers: int = 2, **training):
    "Config, model, task and loaders for `kind` in dense | moe | sft | dpo | distillation, on CPU, in memory."
    from gradient_garden.models.registry import build_model
    from gradient_garden.stages.pretraining import CausalLMTask
    cfg = tiny_cfg("tendril_moe" if kind == "moe" else "tendril", n_layers, **training)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    task, batches = CausalLMTask(), causal_batches(packed=kind == "sft")
    if kind == "sft":
        from gradient_garden.stages.sft import SFTTask
        task = SFTTask()
    elif kind == "dpo":
        from gradient_garden.stages.dpo import DPOTask, ModelReference
        task = DPOTask(cfg.dpo, ModelReference(model))
        for b in batches: b["labels"][:, :5] = -100     # the prompt; rows 0 and 1 are one (chosen, rejected) pair
    elif kind == "distillation":
        from transformers import LlamaConfig, LlamaForCausalLM
        from gradient_garden.stages.distillation import DistillationTask
        teacher = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T))
        task = DistillationTask(cfg.distillation, teacher.eval().requires_grad_(False), CausalLMTask())
        for b in batches: b["labels"][:, :4] = -100
    return cfg, model, task, ListLoader(batches), ListLoader(causal_batches(2, packed=kind == "sft", seed=1))


def make_trainer(kind: str, n_layers: int = 2, **training):
    "A Trainer for `kind` in dense | moe | sft | dpo | distillation, on CPU, with in-memory batches."
    from gradient_garden.train.trainer import Trainer
    cfg, model, task, loader, val_loader = make_parts(kind, n_layers, **training)
    return Trainer(cfg, model, task, loader, val_loader, log_to_console=False)


@pytest.mark.parametrize("kind", ["dense", "moe", "sft", "dpo", "distillation"])
def test_training_step_never_syncs(kind):
    ("Between two logging intervals a training step reads nothing back from the device and copies nothing blocking to "
     "it.")
    tr = make_trainer(kind)
    tr.train_step()                                   # first step: lazy state (optimizer moments) is created
    with HostSyncs() as d: tr.train_step()
    assert d.total == 0, f"{kind}: host syncs in one training step:\n{d.report()}"


# -- FSDP2: reduce-scatters per unit per micro-step (the default) or once per optimizer step (no_sync) -----------------
def _fsdp_reduce_scatters(rank, world, out_dir, mode):
    ("Two micro-steps of an FSDP2 Tendril under `runtime.fsdp_accumulation=mode`; write how many reduce-scatters each "
     "optimizer step ran.")
    import json
    import torch.distributed as dist
    from gradient_garden.parallel.distributed import DistEnv, apply_fsdp
    from gradient_garden.train.trainer import Trainer
    from gradient_garden.models.registry import build_model
    from gradient_garden.stages.pretraining import CausalLMTask
    cfg = tiny_cfg(total_batch_size=2 * 2 * T * world)            # micro-batches of 2 x 16, 2 per rank per step
    cfg.runtime.fsdp_accumulation = mode
    torch.manual_seed(0)
    model = apply_fsdp(build_model(cfg.model))
    tr = Trainer(cfg, model, CausalLMTask(), ListLoader(causal_batches(seed=rank)), env=DistEnv(rank, rank, world),
                 log_to_console=False)
    calls, real = [], dist.reduce_scatter_single
    def counting(*a, **k):
        calls.append(1); return real(*a, **k)
    per_step = []
    with mock.patch.object(dist, "reduce_scatter_single", counting):
        for _ in range(2):
            n = len(calls); tr.train_step(); per_step.append(len(calls) - n)
    from gradient_garden.config import RuntimeConfig
    from gradient_garden.parallel.distributed import parallelize
    ddp = parallelize(build_model(cfg.model), RuntimeConfig(device="cpu"), DistEnv(rank, rank, world))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(dict(per_step=per_step, grad_accum=tr.grad_accum,
                                                                 units=len(model.layers) + 1,
                                                                 ddp_broadcasts_buffers=ddp.broadcast_buffers)))


@pytest.mark.parametrize("mode", ["reduce_scatter", "no_sync"])
def test_fsdp2_reduce_scatters_per_accumulation_mode(tmp_path, mode):
    ("FSDP2 reduce-scatters each unit's gradients on every micro-step by default (sharded gradients), once per "
     "optimizer step under no_sync.")
    import json
    from gloo_ranks import run_ranks
    run_ranks(_fsdp_reduce_scatters, 2, tmp_path / "pg", str(tmp_path), mode)
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["grad_accum"] == 2
        per_micro_step = res["grad_accum"] if mode == "reduce_scatter" else 1
        assert res["per_step"] == [res["units"] * per_micro_step] * 2, res     # per FSDP unit (the blocks and the root)
        assert res["ddp_broadcasts_buffers"] is False          # the RoPE tables are the same on every rank


# -- torch.compile: a bounded number of graphs across train / validate / sample ----------------------------------
def test_compiled_blocks_do_not_recompile_per_layer(monkeypatch):
    ("Blocks compiled as `parallelize` does: training, validation and KV-cached sampling need 4 graphs, not one per "
     "layer.")
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters
    import gradient_garden.batching as batching
    torch._dynamo.reset(); counters.clear()
    tr = make_trainer("dense", n_layers=6)
    cnt = CompileCounter()                      # backend="eager" that counts the graphs it is handed
    for block in tr.model.layers: block.compile(backend=cnt)
    tr.train_step(); tr.train_step()
    after_train = cnt.frame_count
    tr.validate(); tr.validate()
    after_validate = cnt.frame_count
    monkeypatch.setattr(batching, "decode_step_applies", lambda m: False)   # decode through the blocks, as on a GPU
    batching.generate(tr.model, None, [[1, 2, 3], [4, 5, 6]], max_new_tokens=6, stop_ids=[])
    limit_hits = [k for k in counters["unimplemented"] if "recompile limit" in k.lower()]
    assert not limit_hits, limit_hits
    # train: 1; validate (no grad): +1; sampling (inference mode): prefill, first decode, then start_pos turns dynamic
    assert (after_train, after_validate) == (1, 2), (after_train, after_validate)
    assert cnt.frame_count <= 5, cnt.frame_count
    torch._dynamo.reset()


# -- the attention spy: which SDPA call (and so which GPU kernel) each path makes -----------------------------------
class SDPASpy:
    ("Records each `F.scaled_dot_product_attention` call: is_causal, the mask's dtype (None without one), the kernel "
     "class.")
    def __init__(self, monkeypatch):
        from gradient_garden.models.attention import sdpa_kernel_class
        self.calls, real = [], F.scaled_dot_product_attention
        def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
            self.calls.append((is_causal, None if attn_mask is None else attn_mask.dtype, sdpa_kernel_class(attn_mask)))
            return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)
        monkeypatch.setattr(F, "scaled_dot_product_attention", spy)


def test_attention_kernels_per_path(monkeypatch):
    ("Pretraining is causal without a mask (Flash); packed and padded batches pass the masks the memory-efficient "
     "kernel takes.")
    tr = make_trainer("dense")
    spy = SDPASpy(monkeypatch)
    tr.train_step()
    assert spy.calls and set(spy.calls) == {(True, None, "flash")}, set(spy.calls)
    spy.calls.clear(); make_trainer("sft").train_step()
    assert set(spy.calls) == {(False, torch.bool, "memory-efficient")}, set(spy.calls)
    spy.calls.clear()
    tokens, pad = torch.randint(0, VOCAB, (2, 8)), torch.ones(2, 8, dtype=torch.bool)
    pad[0, :3] = False                                    # a left-padded prompt
    with torch.no_grad(): tr.model(tokens, attn_mask=pad)
    assert set(spy.calls) == {(False, torch.float32, "memory-efficient")}, set(spy.calls)


# -- the fused loss: compiled chunks equal the eager ones -----------------------------------------------------------
def test_compiled_loss_chunks_match_eager():
    "Inductor's compiled chunk (the CUDA path, compiled here for the CPU) gives the eager loss and gradients."
    from gradient_garden.models import tendril
    torch.manual_seed(0)
    h, w = torch.randn(50, 24, requires_grad=True), (0.3 * torch.randn(70, 24)).requires_grad_()
    labels = torch.randint(0, 70, (50,)); labels[::4] = -100
    ref = tendril.linear_cross_entropy(h, w, labels, chunk_rows=16, impl="eager")
    ref_g = torch.autograd.grad(ref, (h, w))
    got = tendril.linear_cross_entropy(h, w, labels, chunk_rows=16, impl="compiled")
    got_g = torch.autograd.grad(got, (h, w))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_g, ref_g): torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert tendril.loss_impl("cuda") in ("compiled", "liger") and tendril.loss_impl("cpu") == "eager"


# -- MFU: the datasheet, and time outside training left out --------------------------------------------------------
def test_gpu_datasheet_matches_exact_names():
    "L40 is not an L4, H100 PCIe / NVL are not the SXM part, the A10G is unknown; fp32 with TF32 uses the TF32 figure."
    from gradient_garden.hardware import gpu_datasheet_flops, peak_flops
    tf = lambda name, p="bf16": gpu_datasheet_flops(name, p) / 1e12
    assert [tf("NVIDIA L4"), tf("NVIDIA L40"), tf("NVIDIA L40S")] == [121, 181, 362]
    assert [tf("NVIDIA H100 80GB HBM3"), tf("NVIDIA H100 PCIe"), tf("NVIDIA H100 NVL")] == [989, 756, 835]
    assert gpu_datasheet_flops("NVIDIA A10G") is None and tf("NVIDIA A10") == 125
    cuda = torch.device("cuda", 0)
    with mock.patch("torch.cuda.get_device_name", return_value="NVIDIA A100-SXM4-80GB"):
        assert [peak_flops(cuda, "fp32", tf32=True) / 1e12, peak_flops(cuda, "fp32") / 1e12,
                peak_flops(cuda, "bf16") / 1e12] == [156, 19.5, 312]


def test_logged_throughput_leaves_out_validation(monkeypatch):
    "A slow validation inside a logging interval does not lower the logged tokens/s (nor the MFU)."
    import time, types
    from gradient_garden.train import trainer as trainer_module
    from gradient_garden.train.telemetry import read_metrics
    skipped = [0.0]  # a clock that jumps 100 s forward during each validation: what a slow validation looks like
    clock = types.SimpleNamespace(**{k: getattr(time, k) for k in ("time", "sleep", "monotonic")},
                                  perf_counter=lambda: time.perf_counter() + skipped[0])
    monkeypatch.setattr(trainer_module, "time", clock)
    tr = make_trainer("dense", max_steps=4, log_every=2)
    tr.cfg.validation.every, tr.cfg.validation.enabled = 1, True
    real = tr.validate
    def slow_validate():
        skipped[0] += 100.0
        return real()
    tr.validate = slow_validate
    tr.fit()
    rec = [r for r in read_metrics(tr.run_dir) if r["step"] == 4][0]
    seconds = 2 * 2 * 2 * T / rec["tokens_per_s"]            # two steps of two micro-batches of 2 x 16 tokens
    assert seconds < 50, f"the interval counted {seconds:.2f} s: validation time included"


def test_final_evaluation_runs_under_the_run_autocast():
    "The final evaluation (and the scheduled evals) see the run's precision, as training does."
    tr = make_trainer("dense", max_steps=1, log_every=1)
    tr.cfg.runtime.precision = "bf16"
    tr.final_evaluate = lambda m: {"autocast_dtype": str(torch.get_autocast_dtype("cpu"))
                                   if torch.is_autocast_enabled("cpu") else "off"}
    tr.fit()
    from gradient_garden.train.telemetry import read_metrics
    assert read_metrics(tr.run_dir)[-1]["autocast_dtype"] == "torch.bfloat16"


def test_prefetching_trainer_trains_and_resumes_like_the_plain_one():
    "With runtime.num_workers the loader runs ahead in a thread; losses and the saved loader position are unchanged."
    from gradient_garden.data.loaders import PrefetchLoader
    plain = make_trainer("dense")
    ahead = make_trainer("dense"); ahead.cfg.runtime.num_workers = 3
    from gradient_garden.train.trainer import Trainer
    ahead = Trainer(ahead.cfg, ahead.model, ahead.task, ahead.train_loader, log_to_console=False)
    assert isinstance(ahead.train_loader, PrefetchLoader)
    for _ in range(2):
        assert torch.equal(plain.train_step()["loss"], ahead.train_step()["loss"])
    assert ahead.train_loader.state_dict() == plain.train_loader.state_dict() == dict(pos=4)
    ahead.train_loader.close()


def test_each_rank_restores_its_own_cuda_rng():
    ("With torch.cuda mocked: every rank's CUDA generator states are saved, and rank r gets rank r's back (rank 0's if "
     "fewer).")
    from gradient_garden.checkpoint.checkpoints import rng_state, set_rng_state
    from gradient_garden.train.resume import _rank_entry
    per_rank = [[torch.tensor([r, d], dtype=torch.uint8) for d in range(2)] for r in range(2)]   # 2 ranks x 2 devices
    restored = {}
    states = []
    for r in range(2):
        with mock.patch("torch.cuda.is_available", return_value=True), \
             mock.patch("torch.cuda.get_rng_state_all", return_value=per_rank[r]): states.append(rng_state())
    ckpt = dict(rngs=states, rng=states[0])
    with mock.patch("torch.cuda.is_available", return_value=True), mock.patch("torch.cuda.device_count",
                                                                              return_value=2), \
         mock.patch("torch.cuda.set_rng_state", side_effect=lambda s, i: restored.update({i: s.tolist()})):
        set_rng_state(_rank_entry(ckpt, "rngs", "rng", 1))
        assert restored == {0: [1, 0], 1: [1, 1]}
        set_rng_state(_rank_entry(ckpt, "rngs", "rng", 3))      # a rank the checkpoint did not have: rank 0's states
        assert restored == {0: [0, 0], 1: [0, 1]}


# -- the step on CUDA without a GPU: FakeTensorMode's CUDA tensors through the real step --------------------------
FAKE_CUDA_CASES = [f"{kind}:{precision}" for kind in ("dense", "moe", "sft", "dpo", "distillation")
                   for precision in ("fp32", "bf16")]

@pytest.mark.skipif(shutil.which("c++") is None, reason="builds a small C++ library that fakes CUDA for autograd")
def test_training_step_on_fake_cuda_has_no_device_mismatch():
    """Every task's step on fake `cuda:0` tensors, fp32 and bf16 autocast, compiled loss, fused AdamW, packed SFT on
    flex_attention: everything on the device; a mask made on the host inside the loss is caught as a device mismatch."""
    from fake_cuda import build_library
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("fake_cuda.py")), str(build_library()),
                        *FAKE_CUDA_CASES, "dense:fp32:host"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for case in FAKE_CUDA_CASES:
        got = res[case]
        assert isinstance(got, dict), f"{case}: {got}"
        devices = {d for v in got["devices"].values() for d in ([v] if isinstance(v, str) else v)}
        assert devices == {"cuda:0"}, (case, got["devices"])
        assert got["loss_impl"] == "compiled" and got["compiled_loss_graphs"] == 1 and got["fused_adamw"], (case, got)
        assert ("torch.bfloat16" in got["activation_dtypes"]) == case.endswith("bf16"), (case, got["activation_dtypes"])
        # 2 layers x 2 micro-steps
        assert got["flex_attention_calls"] == (4 if case.startswith("sft") else 0), (case, got)
    assert res["dense:fp32:host"].startswith("FakeTensorDeviceMismatchError"), res["dense:fp32:host"]


# -- packed documents on flex_attention
# ---------------------------------------------------------------------------------
def test_packed_forward_on_flex_equals_sdpa_with_compiled_blocks(monkeypatch):
    ("`model.attention_backend: flex`: the BlockMask goes through compiled blocks, and the logits equal SDPA's dense "
     "mask.")
    from gradient_garden.config import ModelConfig
    from gradient_garden.models import attention
    from gradient_garden.models.registry import build_model
    shape = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=32, multiple_of=16)
    torch.manual_seed(0)
    sdpa = build_model(ModelConfig(**shape, attention_backend="sdpa"))
    flex = build_model(ModelConfig(**shape, attention_backend="flex")); flex.load_state_dict(sdpa.state_dict())
    # as `parallelize` does, without Inductor's C++ build
    for block in flex.layers: block.compile(backend="aot_eager")
    calls, real = [], attention.flex_gqa
    monkeypatch.setattr(attention, "flex_gqa", lambda *a: calls.append(1) or real(*a))
    tokens, doc = torch.randint(0, VOCAB, (2, 32)), (torch.arange(32) >= 13).long().expand(2, 32).contiguous()
    with torch.no_grad(): torch.testing.assert_close(flex(tokens, doc_ids=doc), sdpa(tokens, doc_ids=doc), rtol=1e-5,
                                                     atol=1e-5)
    assert len(calls) == 2                                          # one per layer: flex, not SDPA
    with pytest.raises(NotImplementedError, match="cannot train on CPU"): flex(tokens, doc_ids=doc, labels=tokens)
    torch._dynamo.reset()


@pytest.mark.skipif(shutil.which("c++") is None, reason="builds a small C++ library that fakes CUDA for autograd")
def test_fit_on_fake_cuda_waits_on_the_device_only_when_asked():
    """A whole `fit()` on fake CUDA (8 steps; logging at 1, 4, 8; validation at 3, 8; a checkpoint at 6): no
    `torch.cuda.synchronize` and no host read of a device value on any other step (2, 5, 7)."""
    from fake_cuda import build_library
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("fake_cuda.py")), str(build_library()), "fit:fp32",
                        "fit:bf16"],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    for case, got in json.loads(r.stdout.strip().splitlines()[-1]).items():
        assert isinstance(got, dict), f"{case}: {got}"
        assert got["steps"] == 8 and got["saved"] == [6], got
        busy = {1, 3, 4, 6, 8}
        for what in ("synchronize", "host_reads"):
            quiet = {int(s): n for s, n in got[what].items() if int(s) not in busy}
            assert quiet == {}, (case, what, got[what])
        assert set(map(int, got["host_reads"])) <= busy and got["host_reads"], got
