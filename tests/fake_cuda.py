"""A training step on CUDA without a GPU: `FakeTensorMode`'s CUDA tensors (shapes, dtypes and devices, no memory) run
through the real trainer step, so that a tensor the step makes on the host next to a CUDA one raises
`FakeTensorDeviceMismatchError` as it would on a GPU.

A CPU build of torch makes fake CUDA tensors, but its autograd aborts on them: recording a CUDA leaf asks for a CUDA
device guard, and `backward` asks for the current CUDA stream. A small C++ library supplies both (c10's no-op
`FakeGuardImpl` and CUDA hooks that say CUDA is there); it is built with the system C++ compiler and loaded before
torch is imported, which is why the step runs in a fresh process:

    python tests/fake_cuda.py LIBRARY dense:fp32 moe:bf16 dense:fp32:host ...   # one JSON line: {case: result | error}

(`LIBRARY` from `build_library()`; a `:host` case adds a host-made mask to the task loss, to show it is caught.)
"""
import ctypes, hashlib, importlib.util, json, os, subprocess, sys
from pathlib import Path

CPP_SOURCE = r'''
// Fake CUDA for a CPU build of torch: a no-op CUDA device guard and CUDA hooks that report one device.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {
struct FakeCUDAHooks : at::CUDAHooksInterface {
  FakeCUDAHooks(at::CUDAHooksArgs) {}
  bool hasCUDA() const override { return true; }
  bool isAvailable() const override { return true; }
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  at::DeviceIndex current_device() const override { return 0; }
  int getNumGPUs() const override { return 1; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
};
}
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
namespace at { C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", FakeCUDAHooks); }
// A CPU build answers "no accelerator" at compile time; this definition comes first in the symbol lookup (see preload)
namespace at::accelerator {
std::optional<c10::DeviceType> getAccelerator(bool) { return c10::DeviceType::CUDA; }
}
'''


def torch_dir() -> Path:
    "Where torch is installed, found without importing it."
    return Path(importlib.util.find_spec("torch").submodule_search_locations[0])


def build_library(cache: Path | None = None) -> Path:
    "Compile the fake-CUDA library once per source, torch version and torch install (about a second); return its path."
    import torch
    cache = Path(cache or os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gradient_garden" / "fake_cuda"
    # the library links torch's by an absolute rpath, so another environment (another venv) gets its own build
    key = hashlib.sha256((CPP_SOURCE + torch.__version__ + str(torch_dir().resolve())).encode()).hexdigest()[:16]
    lib = cache / f"fake_cuda_{key}.so"
    if lib.exists(): return lib
    cache.mkdir(parents=True, exist_ok=True)
    src, inc, libdir = cache / f"fake_cuda_{key}.cpp", torch_dir() / "include", torch_dir() / "lib"
    src.write_text(CPP_SOURCE)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run(["c++", "-shared", "-fPIC", "-std=c++17",
                    f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                    "-isystem", str(inc), str(src), "-o", str(tmp), f"-L{libdir}", f"-Wl,-rpath,{libdir}", "-lc10",
                    "-ltorch_cpu"],
                   check=True, capture_output=True, text=True)
    tmp.replace(lib)
    return lib


def preload(lib: Path):
    "Load the fake-CUDA library (and through it torch's) before `import torch`: its hooks and accelerator answer first."
    assert "torch" not in sys.modules, "the fake CUDA hooks must be registered before torch is imported"
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)   # ahead of libtorch_cpu in the lookup order, which it loads


def to_fake_cuda(module, mode):
    "Every parameter and buffer of `module` replaced by a fake `cuda:0` tensor of its shape and dtype (ties kept)."
    import torch
    new: dict = {}
    def fake(t):
        if id(t) not in new:
            with mode: f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
            new[id(t)] = torch.nn.Parameter(f, t.requires_grad) if isinstance(t, torch.nn.Parameter) else f
        return new[id(t)]
    for m in module.modules():
        for slots in (m._parameters, m._buffers):
            for k, v in slots.items():
                if v is not None: slots[k] = fake(v)
    return module


def run_step(kind: str, precision: str, host_tensor_in_loss: bool = False) -> dict:
    "One optimizer step (two micro-batches) of `kind` on fake CUDA; the devices of its outputs and gradients."
    import torch
    from unittest import mock
    from torch._subclasses.fake_tensor import FakeTensorMode
    from gradient_garden.parallel.distributed import DistEnv
    from gradient_garden.train.trainer import Trainer
    from test_hot_path import make_parts
    from gradient_garden.models import attention, tendril
    attention.FLEX_COMPILE_BACKEND = "aot_eager"  # packed documents: flex_attention as traced for Inductor, likewise
    # the CUDA default without Liger (whose Triton kernel needs a real GPU)
    tendril.LOSS_IMPL = "compiled"
    # the compiled loss as traced for Inductor; no Triton to generate CUDA code
    tendril.LOSS_COMPILE_BACKEND = "aot_eager"
    cfg, model, task, loader, val_loader = make_parts(kind)
    cfg.runtime.device, cfg.runtime.precision = "cuda", precision
    cfg.runtime.num_workers = 0   # no prefetching: fake tensors cannot be pinned (page-locked)
    mode = FakeTensorMode()      # real tensors are refused: a host constant reaching the step is an error too
    for m in (model, getattr(getattr(task, "reference", None), "model", None), getattr(task, "teacher", None)):
        if m is not None: to_fake_cuda(m, mode)
    for ld in (loader, val_loader):   # the loader's batches stay host tensors, as a real loader's are
        ld.batches = [{k: mode.from_tensor(v) for k, v in b.items()} for b in ld.batches]
    if host_tensor_in_loss:           # the classic bug: a mask made without `device=`, so on the host
        real_loss = task.loss
        def loss_with_a_host_mask(mdl, b):
            loss_sum, metrics = real_loss(mdl, b)
            keep = (b["labels"] != -100) & torch.ones(b["labels"].shape, dtype=torch.bool)
            return loss_sum + 0 * keep.sum(), metrics
        task.loss = loss_with_a_host_mask
    with mode, mock.patch("torch.cuda.get_device_name", return_value="NVIDIA H100 80GB HBM3"), \
            mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            mock.patch("torch.cuda.is_bf16_supported", return_value=True), \
            mock.patch("torch.cuda.amp.common.amp_definitely_not_available", return_value=False):
        tr = Trainer(cfg, model, task, loader, val_loader, env=DistEnv(device=torch.device("cuda", 0)),
                     log_to_console=False)
        tr.state.step = 1            # a step between logging intervals: the loop reads nothing back
        seen, flex_calls, real_flex = [], [], attention.flex_gqa
        def counting_flex(*a, **k):
            flex_calls.append(1); return real_flex(*a, **k)
        hook = torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, o: seen.append(o.dtype) if torch.is_tensor(o) and o.is_floating_point() else None)
        try:
            with mock.patch.object(attention, "flex_gqa", counting_flex): out = tr.train_step()
        finally: hook.remove()
        step_count = [s["step"] for o in tr.optimizers for s in o.state.values() if "step" in s]
    devices = {k: str(v.device) for k, v in out.items() if torch.is_tensor(v)}
    devices |= {"params": sorted({str(p.device) for p in model.parameters()}),
                "optimizer_step": sorted({str(s.device) for s in step_count})}
    return dict(devices=devices, activation_dtypes=sorted({str(d) for d in seen}), loss_impl=tendril.loss_impl("cuda"),
                flex_attention_calls=len(flex_calls),
                compiled_loss_graphs=len(tendril._COMPILED_CHUNK),
                fused_adamw=all(g.get("fused") for o in tr.optimizers for g in o.param_groups if "fused" in g))


def run_fit(precision: str) -> dict:
    """A whole `fit()` of the dense model on fake CUDA: 8 steps, logging every 4, validation at 3 and 8, a checkpoint at
    6. Per step: `torch.cuda.synchronize` calls and host reads of a device value (`.item()`, `float()`, ...)."""
    import torch
    from unittest import mock
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import FakeTensorMode
    from gradient_garden.train import resume as resume_module
    from gradient_garden.checkpoint.checkpoints import CheckpointManager
    from gradient_garden.parallel.distributed import DistEnv
    from gradient_garden.train.trainer import Trainer
    from test_hot_path import make_parts
    from gradient_garden.models import tendril
    tendril.LOSS_IMPL, tendril.LOSS_COMPILE_BACKEND = "compiled", "aot_eager"
    cfg, model, task, loader, val_loader = make_parts("dense", max_steps=8, log_every=4)
    cfg.runtime.device, cfg.runtime.precision = "cuda", precision
    cfg.runtime.num_workers = 0   # no prefetching: fake tensors cannot be pinned (page-locked)
    cfg.validation.enabled, cfg.validation.every = True, 3
    cfg.checkpointing.every, cfg.checkpointing.save_final = 6, False
    mode = FakeTensorMode()
    to_fake_cuda(model, mode)
    for ld in (loader, val_loader): ld.batches = [{k: mode.from_tensor(v) for k, v in b.items()} for b in ld.batches]
    step, syncs, reads = [0], {}, {}
    def read(fake_mode, func, arg):    # a host read of a device value: counted, answered with a number
        reads[step[0]] = reads.get(step[0], 0) + 1
        return 1.0 if arg.dtype.is_floating_point else 1
    real_step = Trainer.train_step
    def train_step(self):
        step[0] = self.state.step + 1; out = real_step(self); return out
    saved = []
    with mode, mock.patch("torch.cuda.get_device_name", return_value="NVIDIA H100 80GB HBM3"), \
            mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            mock.patch("torch.cuda.is_bf16_supported", return_value=True), \
            mock.patch("torch.cuda.amp.common.amp_definitely_not_available", return_value=False), \
            mock.patch("torch.cuda.synchronize",
                       side_effect=lambda *a: syncs.__setitem__(step[0], syncs.get(step[0], 0) + 1)), \
            mock.patch.dict(fake_impls.op_implementations_dict, {torch.ops.aten._local_scalar_dense.default: read,
                                                                  torch.ops.aten.item.default: read}), \
            mock.patch.object(Trainer, "train_step", train_step), \
            mock.patch.object(resume_module, "rng_state", lambda: {}), \
            mock.patch.object(resume_module, "full_state", lambda m, o: ({}, {})), \
            mock.patch.object(CheckpointManager, "save", lambda self, s, state,
                              val_loss=None: saved.append(s) or self.path(s)):
        tr = Trainer(cfg, model, task, loader, val_loader, env=DistEnv(device=torch.device("cuda", 0)),
                     log_to_console=False)
        res = tr.fit()
    return dict(steps=res["step"], saved=saved, synchronize=syncs, host_reads=reads)


def main(cases: list[str]) -> dict:
    "Run each `kind:precision[:host]` case; its result, or the error it raised as 'ErrorType: message'."
    results = {}
    for case in cases:
        kind, precision, *bug = case.split(":")
        try: results[case] = run_fit(precision) if kind == "fit" else run_step(kind, precision,
                                                                               host_tensor_in_loss=bool(bug))
        except Exception as e: results[case] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return results


if __name__ == "__main__":
    preload(Path(sys.argv[1]))
    sys.path.insert(0, str(Path(__file__).parent))
    print(json.dumps(main(sys.argv[2:])))
