"""`gg export --lora-adapter` end to end: a LoRA checkpoint becomes a Llama base folder plus a `peft` adapter folder
that `peft.PeftModel.from_pretrained` loads, with the platform's LoRA logits (fp32, within 1e-4); the merged export
too."""
import json
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")

from gradient_garden.cli import main
from gradient_garden.config import GlobalConfig, LoraConfig, ModelConfig, TokenizerConfig, to_plain
from gradient_garden.checkpoint.checkpoints import load_model_from_checkpoint, save_checkpoint
from gradient_garden.models.lora import apply_lora, lora_modules
from gradient_garden.models.tendril import Tendril
from gradient_garden.tokenizer import train_bpe

def _corpus() -> list[str]:
    import argparse, dataclasses
    return [Path(m.__file__).read_text() for m in (argparse, dataclasses)]

@pytest.fixture(scope="module")
def lora_ckpt(tmp_path_factory):
    "An instruct checkpoint of a tiny Tendril with trained-looking (non-zero) LoRA adapters on every linear layer."
    base = tmp_path_factory.mktemp("peft")
    cfg = GlobalConfig()
    cfg.training.stage = "instruct"
    cfg.model = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=640, multiple_of=32, max_seq_len=64,
                            init_std=0.1)
    cfg.lora = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["wq", "wk", "wv", "wo", "w1", "w2", "w3"])
    cfg.tokenizer = TokenizerConfig(backend="huggingface", path=str(train_bpe(_corpus(), 640, base/"tok")))
    torch.manual_seed(0)
    model = apply_lora(Tendril(cfg.model), cfg.lora)
    for m in lora_modules(model).values(): torch.nn.init.normal_(m.lora_B, std=0.05)
    ckpt = save_checkpoint(dict(step=1, stage="instruct", architecture="tendril", config=to_plain(cfg),
                                model=model.state_dict()), base/"run"/"step_0000001.pt")
    plain = GlobalConfig(); plain.model, plain.tokenizer = cfg.model, cfg.tokenizer
    no_lora = save_checkpoint(dict(step=1, stage="pretraining", architecture="tendril", config=to_plain(plain),
                                   model=Tendril(cfg.model).state_dict()), base/"plain"/"step_0000001.pt")
    return dict(base=base, ckpt=ckpt, no_lora=no_lora)

def test_lora_adapter_export_loads_in_peft_with_equal_logits(lora_ckpt, capsys):
    from transformers import AutoModelForCausalLM
    from peft import AutoPeftModelForCausalLM, PeftModel
    out = lora_ckpt["base"]/"export"
    assert main(["export", "--checkpoint", str(lora_ckpt["ckpt"]), "--out", str(out), "--lora-adapter"]) == 0
    assert "PEFT LoRA adapter" in capsys.readouterr().out
    adapter = out/"adapter"
    cfg = json.loads((adapter/"adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["task_type"]) == ("LORA", 4, 8.0, "CAUSAL_LM")
    assert cfg["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    ours, _ = load_model_from_checkpoint(lora_ckpt["ckpt"], merge_lora=False)
    merged_ours, _ = load_model_from_checkpoint(lora_ckpt["ckpt"])
    tokens = torch.randint(0, 640, (2, 24))
    base = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        want = ours(tokens)
        base_logits = base(tokens).logits
        got = PeftModel.from_pretrained(base, adapter).eval()(tokens).logits
        auto = AutoPeftModelForCausalLM.from_pretrained(adapter, dtype=torch.float32).eval()(tokens).logits
    diffs = dict(peft=(got - want).abs().max().item(), auto_peft=(auto - want).abs().max().item(),
                 platform_merged=(merged_ours(tokens) - want).abs().max().item())
    assert max(diffs.values()) < 1e-4, diffs
    assert (base_logits - want).abs().max().item() > 1e-3          # the adapter matters: the base alone differs
    merged = lora_ckpt["base"]/"merged"
    assert main(["export", "--checkpoint", str(lora_ckpt["ckpt"]), "--out", str(merged)]) == 0
    assert not (merged/"adapter").exists()
    with torch.no_grad(): merged_logits = AutoModelForCausalLM.from_pretrained(merged,
                                                                               dtype=torch.float32)(tokens).logits
    diffs["merged_export"] = (merged_logits - want).abs().max().item()
    assert diffs["merged_export"] < 1e-4, diffs
    with capsys.disabled(): print({k: f"{v:.1e}" for k, v in diffs.items()})

def test_lora_adapter_needs_adapters(lora_ckpt, capsys):
    rc = main(["export", "--checkpoint", str(lora_ckpt["no_lora"]), "--out", str(lora_ckpt["base"]/"x"),
               "--lora-adapter"])
    assert rc == 2 and "holds no LoRA adapters" in capsys.readouterr().err
