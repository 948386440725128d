"""The open models in and out: tiny random Llama 3.x (`llama3` RoPE), SmolLM2 (a tied Llama), Mistral, Qwen2 (q/k/v
biases) and Qwen3 (per-head q/k norms, wide heads) built locally with `transformers` import with logits within 1e-5
of `transformers` (fp32) and the same greedy tokens; a trained Qwen3-shaped model, and its LoRA adapter through
`peft`, export back to `Qwen3ForCausalLM` with the same logits."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gradient_garden.checkpoint.hf import export_hf, export_hf_with_adapter, load_hf
from gradient_garden.config import ConfigError, LoraConfig
from gradient_garden.batching import generate
from gradient_garden.models.attention import precompute_rope
from gradient_garden.models.lora import apply_lora, lora_modules

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.1)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
FAMILIES = {   # name -> (config class, settings), each the shape of a published model family, made small
    "llama3.2": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)),
    "llama3.1": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)),
    "smollm2": ("LlamaConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                                    tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=None, head_dim=16)),
    "qwen2.5": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3_untied": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
}


def hf_model(family: str, seed: int = 0):
    "A random `transformers` model of `family`; norm gains and biases drawn too, so that they count."
    cls, settings = FAMILIES[family]
    cfg = getattr(transformers, cls)(**SHAPE, **settings)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"): p.normal_(1.0, 0.3)
            elif n.endswith("bias"): p.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def imported(request, tmp_path_factory):
    "`(family, transformers model, its folder, the Tendril loaded from that folder)`."
    hf = hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    model, _ = load_hf(folder)
    return request.param, hf, folder, model


def test_logits_equal_transformers(imported):
    family, hf, _, model = imported
    tokens = torch.randint(0, 256, (3, 48), generator=torch.Generator().manual_seed(1))
    am = torch.ones(3, 48, dtype=torch.long)
    am[0, :9] = 0
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
        ours = model(tokens, attn_mask=am)
        theirs = hf(tokens, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
        pad_diff = (ours - theirs)[am.bool()].abs().max().item()
    assert diff < 1e-5 and pad_diff < 1e-5, (family, diff, pad_diff)


def test_greedy_generation_equal_token_for_token(imported):
    family, hf, _, model = imported
    prompts = [[5, 17, 99, 3], [42, 7, 7, 200, 13, 1]]
    ours = generate(model, None, prompts, max_new_tokens=24, stop_ids=[], pad_id=0)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24,
                               pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
        assert got == want, (family, got, want)


def test_config_options_and_export_names_the_family(imported, tmp_path):
    family, hf, folder, model = imported
    cfg = model.cfg
    assert (cfg.qkv_bias, cfg.qk_norm) == (family == "qwen2.5", family.startswith("qwen3"))
    assert cfg.tie_embeddings == hf.config.tie_word_embeddings
    assert cfg.rope_scaling == ("llama3" if family.startswith("llama3") else "none")
    assert cfg.head_dim == (getattr(hf.config, "head_dim", None) or 16)
    out = export_hf(model, tmp_path/"out")
    written = json.loads((out/"config.json").read_text())
    assert written["architectures"] == [type(hf).__name__] and written["model_type"] == hf.config.model_type


def test_llama3_rope_tables_equal_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf = hf_model("llama3.1")
    inv_freq, scale = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    assert scale == 1.0
    cos, _ = precompute_rope(16, 128, 500000.0, scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                             original_max_seq_len=32))
    want = torch.outer(torch.arange(128, dtype=torch.float32), inv_freq.float()).cos()
    assert torch.allclose(cos[:, :8], want, atol=1e-6)


@pytest.mark.parametrize("change, key", [({"sliding_window": 16}, "sliding_window: got 16"),
                                         ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                               "original_max_position_embeddings": 32}}, "rope_type"),
                                         ({"attention_bias": True}, "attention_bias: got True"),
                                         ({"model_type": "gemma2"}, "model_type: got 'gemma2'")])
def test_unrepresentable_settings_are_refused_in_one_line(tmp_path, change, key):
    hf = hf_model("mistral" if "sliding_window" in change else "llama3.1")
    hf.save_pretrained(tmp_path)
    cj = json.loads((tmp_path/"config.json").read_text())
    (tmp_path/"config.json").write_text(json.dumps({**cj, **change}))
    with pytest.raises(ConfigError) as e: load_hf(tmp_path)
    assert key in str(e.value) and "\n" not in str(e.value)


def _train_steps(model, steps: int = 3):
    "A few AdamW steps on a next-token loss over the second half of each row (the prompt half unsupervised)."
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(2))
    labels = tokens[:, 1:].clone()
    labels[:, :16] = -100
    for _ in range(steps):
        opt.zero_grad()
        (model(tokens[:, :-1], labels=labels) / (labels != -100).sum()).backward()
        opt.step()
    return model


def test_trained_qwen3_exports_back_to_qwen3(tmp_path):
    hf = hf_model("qwen3")
    hf.save_pretrained(tmp_path/"base")
    model, _ = load_hf(tmp_path/"base")
    model = _train_steps(model.train()).eval()
    out = export_hf(model, tmp_path/"tuned")
    assert json.loads((out/"config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back).__name__ == "Qwen3ForCausalLM"
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        moved = (back(tokens).logits - hf(tokens).logits).abs().max().item()
        diff = (model(tokens) - back(tokens).logits).abs().max().item()
    assert moved > 1e-3 and diff < 1e-5, (moved, diff)


def test_qwen3_lora_adapter_loads_in_peft(tmp_path):
    from peft import PeftModel
    hf = hf_model("qwen3")
    hf.save_pretrained(tmp_path/"base")
    model, _ = load_hf(tmp_path/"base")
    lora = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["wq", "wk", "wv", "wo", "w1", "w2", "w3"])
    model = _train_steps(apply_lora(model, lora).train()).eval()
    assert all(m.lora_B.abs().max() > 0 for m in lora_modules(model).values())
    out, adapter = export_hf_with_adapter(model, tmp_path/"export")
    assert json.loads((out/"config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    targets = json.loads((adapter/"adapter_config.json").read_text())["target_modules"]
    assert targets == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    peft_model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32),
                                           adapter).eval()
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(): diff = (model(tokens) - peft_model(tokens).logits).abs().max().item()
    assert diff < 1e-5, diff
