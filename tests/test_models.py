"""What the model notebooks cannot show on their own: `gg generate` / `gg export` end to end on a real checkpoint and
tokenizer, generation under autocast, meta-device construction, and torch.compile."""
import json
from pathlib import Path

import pytest
import torch

from gradient_garden.config import GlobalConfig, ModelConfig, TokenizerConfig, to_plain
from gradient_garden.batching import generate
from gradient_garden.models.tendril import Tendril, count_parameters
from gradient_garden.models.registry import build_model

def _corpus() -> list[str]:
    "Some text that is on every machine: the standard library's own sources."
    import argparse, dataclasses, json as js, pathlib as pl
    return [Path(m.__file__).read_text() for m in (argparse, dataclasses, js.encoder, js.decoder, pl)]

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    "A tokenizer folder and a checkpoint of a tiny random Tendril that uses it."
    from gradient_garden.tokenizer import train_bpe
    from gradient_garden.checkpoint.checkpoints import save_checkpoint
    base = tmp_path_factory.mktemp("models")
    tok_dir = train_bpe(_corpus(), 640, base / "tok")
    cfg = GlobalConfig()
    cfg.model = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=640, multiple_of=32, max_seq_len=96,
                            init_std=0.1)
    cfg.tokenizer = TokenizerConfig(backend="huggingface", path=str(tok_dir))
    torch.manual_seed(0)
    model = Tendril(cfg.model)
    ckpt = save_checkpoint(dict(step=1, stage="pretraining", architecture="tendril", config=to_plain(cfg),
                                model=model.state_dict()), base / "checkpoints" / "step_0000001.pt")
    return dict(base=base, ckpt=ckpt, tok_dir=tok_dir, cfg=cfg, model=model.eval())

def _args(add, argv):
    import argparse
    return add(argparse.ArgumentParser()).parse_args(argv)

def test_gg_generate(run, capsys):
    "`run_generate` loads the checkpoint and tokenizer, completes plain and chat prompts, and writes the JSON file."
    from gradient_garden.cli.generate import add_generate_args, run_generate
    from gradient_garden.batching import generate_text
    from gradient_garden.tokenizer import init_tokenizer
    base = run["base"]
    (base / "prompts.json").write_text(json.dumps(["def main(", {"prompt": "import os"}]))
    out = base / "out" / "gen.json"
    args = _args(add_generate_args, ["--checkpoint", str(run["ckpt"]), "--prompts", str(base / "prompts.json"),
                                     "--max-gen-len", "12", "--device", "cpu", "--output-file-name", str(out)])
    assert run_generate(args) == 0
    res = json.loads(out.read_text())
    assert [r["prompt"] for r in res["results"]] == ["def main(", "import os"]
    tok = init_tokenizer(run["cfg"].tokenizer)
    expected = generate_text(run["model"], tok, ["def main(", "import os"], max_new_tokens=12)
    assert [r["completion"] for r in res["results"]] == expected
    args = _args(add_generate_args, ["--checkpoint", str(run["ckpt"]), "--prompts", str(base / "prompts.json"),
                                     "--max-gen-len", "5", "--instruct", "--no-use-kv-cache", "--temperature", "0.8"])
    assert run_generate(args) == 0
    assert "=== def main(" in capsys.readouterr().out

def test_gg_generate_compiled_matches_eager(run):
    "`gg generate --compile` gives the eager completions (greedy, KV cache, mixed prompt lengths)."
    from gradient_garden.cli.generate import add_generate_args, run_generate
    base = run["base"]
    (base / "prompts_c.json").write_text(json.dumps(["def main(", "import os, sys", "x"]))
    outs = {}
    for flag in ([], ["--compile"]):
        out = base / "out" / f"gen{len(flag)}.json"
        args = _args(add_generate_args, ["--checkpoint", str(run["ckpt"]), "--prompts", str(base / "prompts_c.json"),
                                         "--max-gen-len", "10", "--device", "cpu", "--output-file-name", str(out),
                                         *flag])
        assert run_generate(args) == 0
        outs[len(flag)] = [r["completion"] for r in json.loads(out.read_text())["results"]]
    assert outs[1] == outs[0] and any(outs[0])

def test_gg_export(run):
    "`run_export` writes a folder that transformers loads, with equal logits and a working tokenizer."
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from gradient_garden.config import ConfigError
    from gradient_garden.cli.generate import add_export_args, run_export
    from gradient_garden.checkpoint.hf import load_hf
    out = run["base"] / "hf"
    assert run_export(_args(add_export_args, ["--checkpoint", str(run["ckpt"]), "--out", str(out)])) == 0
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, 640, (2, 24))
    with torch.no_grad(): diff = (hf(tokens).logits - run["model"](tokens)).abs().max().item()
    assert diff < 1e-4, diff
    hf_tok = AutoTokenizer.from_pretrained(out)
    from gradient_garden.tokenizer import init_tokenizer
    ours = init_tokenizer(run["cfg"].tokenizer)
    assert hf_tok("def f(x): return x")["input_ids"][-5:] == ours.encode("def f(x): return x")[-5:]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == [ours.eos_id, ours.eot_id]
    model, cfg = load_hf(out)
    assert cfg.dim == 64 and count_parameters(model) == count_parameters(run["model"])
    with pytest.raises(ConfigError, match="exists and is not empty"):
        run_export(_args(add_export_args, ["--checkpoint", str(run["ckpt"]), "--out", str(out)]))

def test_generate_under_autocast_matches_cache_free():
    "Under bf16 autocast the KV cache takes the bf16 keys; cached and uncached greedy decoding still agree."
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=48,
                      init_std=0.1)
    torch.manual_seed(0)
    model = Tendril(cfg).eval()
    prompts = [[5, 6, 7, 8], [9, 10]]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = generate(model, None, prompts, max_new_tokens=8, stop_ids=[])
        b = generate(model, None, prompts, max_new_tokens=8, stop_ids=[], use_kv_cache=False)
    assert [len(x) for x in a] == [8, 8]
    agree = sum(x == y for r, s in zip(a, b) for x, y in zip(r, s))
    assert agree >= 14, (a, b)   # bf16 rounding may flip a near-tie late in a sequence

def test_meta_device_build_then_materialise():
    "Built on the meta device (as the trainer's estimate does), materialised with to_empty + init_weights."
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=32)
    with torch.device("meta"): model = build_model(cfg)
    assert count_parameters(model) > 0
    model.to_empty(device="cpu")
    model.init_weights()
    torch.manual_seed(0)
    ref = Tendril(cfg)
    torch.testing.assert_close(model.rope_cos, ref.rope_cos)
    assert torch.isfinite(model(torch.randint(0, 128, (1, 8)))).all()

@pytest.mark.slow
def test_compiled_training_step_matches_eager():
    "torch.compile of the model gives the eager loss and gradients."
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=64)
    torch.manual_seed(0)
    model = Tendril(cfg)
    x = torch.randint(0, 128, (2, 40))
    def loss_grads(m):
        loss = torch.nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        grads = torch.autograd.grad(loss, list(model.parameters()))
        return loss, grads
    l1, g1 = loss_grads(model)
    l2, g2 = loss_grads(torch.compile(model))
    torch.testing.assert_close(l1, l2, rtol=1e-4, atol=1e-5)
    for a, b in zip(g1, g2): torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    compiled = torch.compile(model)                      # the model's own loss: fused, outside the compiled graph
    l3 = compiled(x[:, :-1], labels=x[:, 1:]) / x[:, 1:].numel()
    torch.testing.assert_close(l3, l1, rtol=1e-4, atol=1e-5)
    for a, b in zip(torch.autograd.grad(l3, list(model.parameters())), g1): torch.testing.assert_close(a, b, rtol=1e-3,
                                                                                                       atol=1e-5)

def test_cpu_generation_takes_the_decoding_step_only_where_it_applies(monkeypatch):
    """Plain Tendril on CPU: the prefill and every step after it go through `decode_step` and the tokens equal
    cache-free decoding; a LoRA-adapted model and the MoE model decode through `forward` and agree with their cache-free
    decoding."""
    import gradient_garden.batching as G
    from gradient_garden.config import LoraConfig
    from gradient_garden.models.lora import apply_lora
    calls = []
    real_step = G.decode_step
    monkeypatch.setattr(G, "decode_step", lambda *a, **k: calls.append(1) or real_step(*a, **k))
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=48,
                      init_std=0.1)
    prompts = [[5, 6, 7, 8, 9], [9, 10], [3]]
    torch.manual_seed(0)
    plain = Tendril(cfg).eval()
    adapted = apply_lora(Tendril(cfg),
                         LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["wq", "wv", "w1"])).eval()
    moe = build_model(ModelConfig(**{**cfg.__dict__, "architecture": "tendril_moe", "n_experts": 4,
                                     "n_experts_per_token": 2})).eval()
    for model, expect_calls in ((plain, 10), (adapted, 0), (moe, 0)):   # plain: the prefill and 9 steps
        calls.clear()
        cached = generate(model, None, prompts, max_new_tokens=10, stop_ids=[])
        assert len(calls) == expect_calls, (type(model).__name__, len(calls))
        assert cached == generate(model, None, prompts, max_new_tokens=10, stop_ids=[], use_kv_cache=False)
