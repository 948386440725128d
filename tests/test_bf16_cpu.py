"""bf16 on CPU: training attends through BlockAttentionFunction (not SDPA) and matches the SDPA path; bf16 decoding
under autocast takes the lean decoding step with bf16 weight copies that are released afterwards."""
import torch
import torch.nn.functional as F
import gradient_garden.generation as generation
import gradient_garden.models.attention as attention
from gradient_garden.config import ModelConfig
from gradient_garden.models.tendril import Tendril

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=32,
                  init_std=0.1)


def _bf16_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16): loss = model(x, labels=y) / y.numel()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_bf16_training_uses_block_attention_and_matches_sdpa(monkeypatch):
    "Same loss and gradients (within bf16 rounding) as SDPA's flash kernel; SDPA is not called on the block path."
    torch.manual_seed(0)
    model = Tendril(CFG)
    x, y = torch.randint(0, 128, (2, 2, 16))
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    loss_block, g_block = _bf16_grads(model, x, y)
    assert not calls
    monkeypatch.setattr(attention, "BLOCK_ATTENTION_MAX_BYTES", 0)
    loss_sdpa, g_sdpa = _bf16_grads(model, x, y)
    assert calls
    assert abs(loss_block - loss_sdpa) < 1e-2 * abs(loss_sdpa)
    for a, b in zip(g_block, g_sdpa):
        assert (a - b).norm() <= 3e-2 * b.norm() + 1e-6, ((a - b).norm(), b.norm())


def test_bf16_decoding_takes_the_decoding_step_with_bf16_copies(monkeypatch):
    "Under autocast `generate` holds bf16 weight copies, decodes with `decode_step`, and drops the copies at the end."
    torch.manual_seed(0)
    model = Tendril(CFG).eval()
    steps, real = [], generation.decode_step
    def spy(m, *a, **k):
        steps.append(m.output.__dict__.get("_held_weight").dtype)
        return real(m, *a, **k)
    monkeypatch.setattr(generation, "decode_step", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = generation.generate(model, None, [[5, 6, 7], [9]], max_new_tokens=6, stop_ids=[])
    assert [len(o) for o in out] == [6, 6]
    assert steps and set(steps) == {torch.bfloat16}
    assert model.output.__dict__.get("_held_weight") is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
