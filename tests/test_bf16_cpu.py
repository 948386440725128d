"""bf16 on CPU: training attends by the kernel measured fastest, and each kernel matches the SDPA path; bf16 decoding
under autocast takes the lean decoding step with bf16 weight copies that are released afterwards."""
import torch
import torch.nn.functional as F
import gradient_garden.batching as batching
import gradient_garden.models.attention as attention
from gradient_garden.config import ModelConfig
from gradient_garden.models.tendril import Tendril
from gradient_garden.runtime import dispatch_choices

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=32,
                  init_std=0.1)


def _bf16_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16): loss = model(x, labels=y) / y.numel()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_bf16_training_kernels_match_sdpa(monkeypatch, tmp_path):
    ("Each bf16 CPU training kernel gives SDPA's loss and gradients (within bf16 rounding); the block kernel calls no "
     "SDPA, and by default training takes the kernel measured fastest here.")
    monkeypatch.setenv("GG_DISPATCH_CACHE", str(tmp_path / "dispatch.json"))
    torch.manual_seed(0)
    model = Tendril(CFG)
    x, y = torch.randint(0, 128, (2, 2, 16))
    calls, seen = [], []
    real, measured = F.scaled_dot_product_attention, attention.train_attention_kernel
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(attention, "train_attention_kernel", lambda *a: seen.append(measured(*a)) or seen[-1])
    _bf16_grads(model, x, y)
    ranking = dispatch_choices()["bf16_train_attention@4x2x16x16"]["value"].split(">")
    assert sorted(ranking) == sorted(attention.TRAIN_ATTENTION_KERNELS) and set(seen) == {ranking[0]}, (ranking, seen)
    results = {}
    for kernel in attention.TRAIN_ATTENTION_KERNELS:
        monkeypatch.setattr(attention, "train_attention_kernel", lambda q, k, m, kn=kernel: kn if measured(q, k, m)
                            else None)
        calls.clear()
        results[kernel] = _bf16_grads(model, x, y)
        assert bool(calls) == (kernel != "block"), kernel
    loss_sdpa, g_sdpa = results["sdpa"]
    for kernel, (loss, grads) in results.items():
        assert abs(loss - loss_sdpa) < 1e-2 * abs(loss_sdpa), kernel
        for a, b in zip(grads, g_sdpa):
            assert (a - b).norm() <= 3e-2 * b.norm() + 1e-6, (kernel, (a - b).norm(), b.norm())


def test_bf16_decoding_takes_the_decoding_step_with_bf16_copies(monkeypatch):
    "Under autocast `generate` holds bf16 weight copies, decodes with `decode_step`, and drops the copies at the end."
    torch.manual_seed(0)
    model = Tendril(CFG).eval()
    steps, real = [], batching.decode_step
    def spy(m, *a, **k):
        steps.append(m.output.__dict__.get("_held_weight").dtype)
        return real(m, *a, **k)
    monkeypatch.setattr(batching, "decode_step", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = batching.generate(model, None, [[5, 6, 7], [9]], max_new_tokens=6, stop_ids=[])
    assert [len(o) for o in out] == [6, 6]
    assert steps and set(steps) == {torch.bfloat16}
    assert model.output.__dict__.get("_held_weight") is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
