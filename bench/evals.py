"""Multiple-choice eval throughput on CPU: examples/s per task for the debug-size model, one forward per choice
(the direct formulation) vs batched scoring vs batched scoring with shared contexts. Medians of alternating repeats.

    .venv/bin/python bench/evals.py [--repeats 3] [--batch-size 16] [--device cpu]

The last line of stdout is one JSON object with the figures."""
import argparse, json, statistics, sys, tempfile, time
from pathlib import Path

import torch

from gradient_garden import evals as E
from gradient_garden.config import ModelConfig, TokenizerConfig


def debug_tokenizer():
    "The configured default tokenizer if it has been built, else a byte-level BPE trained on the eval fixtures."
    cfg = TokenizerConfig()
    if Path(cfg.path).is_dir():
        from gradient_garden.tokenizer import init_tokenizer
        return init_tokenizer(cfg), f"{cfg.backend}:{cfg.path}"
    from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders
    texts = [s for n in E.TASKS for ex in E.load_examples(n) for pair in ex.requests for s in pair]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=4096, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       special_tokens=["<|begin_of_text|>", "<|end_of_text|>"], show_progress=False))
    return tok, f"fixture-bpe-{tok.get_vocab_size()}"


def debug_model(mc: ModelConfig):
    "The debug Tendril (ModelConfig defaults) when the model module exists, else a Llama of the same shape."
    torch.manual_seed(0)
    try:
        from gradient_garden.models.tendril import build_model
        return build_model(mc).eval(), "tendril"
    except ImportError:
        from transformers import LlamaConfig, LlamaForCausalLM
        hidden = int(2 * 4 * mc.dim / 3)
        hidden = mc.multiple_of * ((hidden + mc.multiple_of - 1) // mc.multiple_of)
        cfg = LlamaConfig(vocab_size=mc.vocab_size, hidden_size=mc.dim, intermediate_size=hidden, num_hidden_layers=mc.n_layers,
                          num_attention_heads=mc.n_heads, num_key_value_heads=mc.n_kv_heads, max_position_embeddings=mc.max_seq_len,
                          rope_theta=mc.rope_theta, rms_norm_eps=mc.norm_eps, tie_word_embeddings=mc.tie_embeddings)
        return E.HFCausalLM(LlamaForCausalLM(cfg)).eval(), "llama (debug Tendril shape; models.tendril not importable)"


@torch.no_grad()
def one_forward_per_choice(model, tokenizer, examples, device):
    "The direct formulation: every (context, continuation) pair in its own forward pass."
    encode, prefix = E.text_encoder(tokenizer), E.prefix_token_id(tokenizer)
    out = []
    for ex in examples:
        lls = []
        for c, k in ex.requests:
            ctx, cont = E.encode_pair(encode, c, k, prefix)
            logits = E._logits(model, torch.tensor([ctx + cont[:-1]], device=device))[0]
            logp = logits[len(ctx) - 1:].float().log_softmax(-1)
            lls.append(logp.gather(1, torch.tensor(cont, device=device)[:, None]).sum().item())
        out.append(lls)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--examples", type=int, default=20, help="examples per task (fixture rows; 0 = all 40)")
    a = ap.parse_args()
    device = torch.device(a.device)
    mc = ModelConfig()
    tokenizer, tok_name = debug_tokenizer()
    model, model_name = debug_model(mc)
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    modes = {
        "one_per_choice": lambda exs: one_forward_per_choice(model, tokenizer, exs, device),
        "batched": lambda exs: E.score_examples(model, tokenizer, exs, a.batch_size, device, max_len=mc.max_seq_len),
        "batched_shared": lambda exs: E.score_examples(model, tokenizer, exs, a.batch_size, device, share_context=True,
                                                       max_len=mc.max_seq_len),
    }
    print(f"model {model_name}, {n_params/1e6:.2f}M params; tokenizer {tok_name}; device {device}; "
          f"torch threads {torch.get_num_threads()}; batch {a.batch_size} examples; {a.repeats} repeats", file=sys.stderr)
    figures = {}
    for name in E.TASKS:
        exs = E.load_examples(name)
        exs = [exs[i] for i in E.sample_indices(len(exs), a.examples, 0)]
        ref = modes["one_per_choice"](exs)
        diffs = {}
        for m in ("batched", "batched_shared"):
            try: got = modes[m](exs)
            except Exception as e:          # a model without attn_mask / position_ids support cannot share contexts
                print(f"{name}: {m} unavailable ({type(e).__name__}: {e})", file=sys.stderr)
                continue
            diffs[m] = max(abs(x - y) for g, r in zip(got, ref) for x, y in zip(g, r))
        times = {m: [] for m in modes if m == "one_per_choice" or m in diffs}
        for _ in range(a.repeats):
            for m in times:
                t0 = time.perf_counter(); modes[m](exs); times[m].append(time.perf_counter() - t0)
        med = {m: statistics.median(v) for m, v in times.items()}
        f = {"examples": len(exs), "choices": sum(len(ex.requests) for ex in exs)}
        for m, t in med.items(): f[f"{m}_examples_per_s"] = round(len(exs) / t, 2)
        for m in diffs:
            f[f"{m}_speedup"] = round(med["one_per_choice"] / med[m], 2)
            f[f"{m}_max_abs_diff"] = float(f"{diffs[m]:.2e}")
        figures[name] = f
        print(f"{name:14s} " + "  ".join(f"{m} {len(exs)/t:7.1f} ex/s" for m, t in med.items()) + "  " +
              "  ".join(f"{m} x{f[f'{m}_speedup']}" for m in diffs))
    print(json.dumps({"bench": "evals", "device": str(device), "model": model_name, "params": n_params, "tokenizer": tok_name,
                      "batch_size": a.batch_size, "repeats": a.repeats, "torch_threads": torch.get_num_threads(), "tasks": figures}))


if __name__ == "__main__":
    main()
