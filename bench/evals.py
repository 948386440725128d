"""Multiple-choice eval throughput on CPU: examples/s per task for the debug-size model, side by side with
lm-evaluation-harness's Hugging Face model (`HFLM`) on the same model exported with `export_hf`, the same rows and
the same batch size (16 rows a forward: `HFLM` 16 requests, the scorer 16 examples = 16 shared rows): one forward
per choice (the direct formulation), the platform's scorer in its default mode (shared contexts), with one row
per choice (`share_context=False`), `GardenLM` (the platform's model inside lm-eval) and `HFLM`. All in one
process, one torch thread, fp32, every contender run once untimed first; medians of interleaved repeats; every
mode's log-likelihoods are checked against `HFLM`'s. The load average is printed and stored with the figures.

    .venv/bin/python bench/evals.py [--repeats 11] [--batch-size 16] [--lm-eval-batch-size N] [--device cpu]
    .venv/bin/python bench/evals.py --smoke      # 2 examples a task, one repeat, lm-eval's HFLM still the reference

Without lm-evaluation-harness installed, `GardenLM` and `HFLM` are skipped (a line says so) and the other modes are
checked against one forward per choice.

The last line of stdout is one JSON object with the figures."""
import argparse, json, os, shutil, statistics, sys, tempfile, time
from pathlib import Path

import torch

from gradient_garden.evals import benchmarks as B, multiple_choice as E
from gradient_garden.config import ModelConfig, TokenizerConfig
from common import add_smoke, apply_smoke, reference_available


def debug_tokenizer(work: Path):
    "The configured default tokenizer if it has been built, else one like it: a 4096-token BPE on the pydoc topics."
    from gradient_garden.data.prepare import pydoc_topics
    from gradient_garden.tokenizer import init_tokenizer, train_bpe
    cfg = TokenizerConfig()
    if not Path(cfg.path).is_dir(): cfg.path = str(train_bpe((r["text"] for r in pydoc_topics()), 4096, work/"tok"))
    return init_tokenizer(cfg), f"{cfg.backend}:{cfg.path}"


def debug_model(mc: ModelConfig):
    "The debug Tendril (ModelConfig defaults) with seeded random weights."
    from gradient_garden.models.registry import build_model
    torch.manual_seed(0)
    return build_model(mc).eval()


@torch.no_grad()
def one_forward_per_choice(model, tokenizer, examples, device):
    "The direct formulation: every (context, continuation) pair in its own forward pass."
    pair, out = E.pair_encoder(tokenizer), []
    for ex in examples:
        lls = []
        for c, k in ex.requests:
            ctx, cont = pair(c, k)
            logits = E._logits(model, torch.tensor([ctx + cont[:-1]], device=device))[0]
            logp = logits[len(ctx) - 1:].float().log_softmax(-1)
            lls.append(logp.gather(1, torch.tensor(cont, device=device)[:, None]).sum().item())
        out.append(lls)
    return out


def lm_eval_requests(examples):
    "lm-eval `Instance`s of every choice of every example (what a multiple-choice task hands the model)."
    from lm_eval.api.instance import Instance
    return [Instance("loglikelihood", {}, r, i) for i, r in enumerate(r for ex in examples for r in ex.requests)]


def regroup(flat, examples):
    "Per-example lists of a flat per-choice result list."
    out, i = [], 0
    for ex in examples:
        out.append([x[0] if isinstance(x, tuple) else x for x in flat[i:i + len(ex.requests)]]); i += len(ex.requests)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lm-eval-batch-size", type=int, default=None, help="HFLM's batch size (default: --batch-size)")
    ap.add_argument("--examples", type=int, default=0, help="examples per task (fixture rows; 0 = all 40)")
    a = apply_smoke(add_smoke(ap).parse_args(), examples=2, repeats=1, batch_size=4)
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    lm_eval = reference_available("lm_eval", "GardenLM and lm-eval's HFLM (the reference)")
    device, work = torch.device(a.device), Path(tempfile.mkdtemp())
    tokenizer, tok_name = debug_tokenizer(work)
    mc = ModelConfig(vocab_size=tokenizer.vocab_size)
    model = debug_model(mc).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    modes = {
        "one_per_choice": lambda exs: one_forward_per_choice(model, tokenizer, exs, device),
        "default": lambda exs: E.score_examples(model, tokenizer, exs, a.batch_size, device, max_len=mc.max_seq_len),
        "per_choice_rows": lambda exs: E.score_examples(model, tokenizer, exs, a.batch_size, device,
                                                        share_context=False, max_len=mc.max_seq_len),
    }
    if lm_eval:
        from lm_eval.models.huggingface import HFLM
        from gradient_garden.evals.lm_eval import GardenLM
        from gradient_garden.checkpoint.hf import export_hf
        export_hf(model, work/"hf", tokenizer=tokenizer, tokenizer_dir=tokenizer.path)
        hf = HFLM(pretrained=str(work/"hf"), device=str(device), batch_size=a.lm_eval_batch_size or a.batch_size,
                  dtype="float32")
        garden = GardenLM(model, tokenizer, batch_size=a.batch_size)
        modes["garden_lm"] = lambda exs: regroup(garden.loglikelihood(lm_eval_requests(exs), disable_tqdm=True), exs)
        modes["lm_eval_hf"] = lambda exs: regroup(hf.loglikelihood(lm_eval_requests(exs), disable_tqdm=True), exs)
    # what every other mode's timings and log-likelihoods are held against
    REF = "lm_eval_hf" if lm_eval else "one_per_choice"
    print(f"model tendril, {n_params/1e6:.2f}M params; tokenizer {tok_name}; device {device}; "
          f"torch threads {torch.get_num_threads()}; batch {a.batch_size} examples (GardenLM: {a.batch_size}, "
          f"HFLM: {a.lm_eval_batch_size or a.batch_size} requests); {a.repeats} repeats", file=sys.stderr)
    figures, load_before = {}, os.getloadavg()
    print(f"load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}", file=sys.stderr)
    for name in B.BENCHMARKS:
        exs = B.load_examples(name)
        exs = [exs[i] for i in B.sample_indices(len(exs), a.examples, 0)]
        ref = modes[REF](exs)
        diffs = {m: max(abs(x - y) for g, r in zip(modes[m](exs), ref) for x, y in zip(g, r))
                 for m in modes if m != REF}
        times = {m: [] for m in modes}
        for _ in range(a.repeats):
            for m in times:
                t0 = time.perf_counter(); modes[m](exs); times[m].append(time.perf_counter() - t0)
        med = {m: statistics.median(v) for m, v in times.items()}
        f = {"examples": len(exs), "choices": sum(len(ex.requests) for ex in exs)}
        for m, t in med.items(): f[f"{m}_examples_per_s"] = round(len(exs) / t, 2)
        for m in diffs:
            f[f"{m}_vs_{REF}"] = round(med[REF] / med[m], 2)
            f[f"{m}_max_abs_diff_vs_{REF}"] = float(f"{diffs[m]:.2e}")
        figures[name] = f
        print(f"{name:14s} " + "  ".join(f"{m} {len(exs)/t:7.1f} ex/s" for m, t in med.items()) + f"  | vs {REF}: " +
              "  ".join(f"{m} x{f[f'{m}_vs_{REF}']}" for m in diffs), file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    ratios = {n: f[f"default_vs_{REF}"] for n, f in figures.items()}
    print(f"load average {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; default scorer vs {REF}: " +
          ", ".join(f"{n} x{r}" for n, r in ratios.items()) + f" (target >= 2x on each: "
          f"{'met' if all(r >= 2 for r in ratios.values()) else 'not met'})", file=sys.stderr)
    print(json.dumps({"bench": "evals", "smoke": a.smoke, "reference": REF,
                      "load_average_before": [round(x, 2) for x in load_before],
                      "load_average_after": [round(x, 2) for x in load_after], "device": str(device),
                      "model": "tendril", "params": n_params, "tokenizer": tok_name, "batch_size": a.batch_size,
                      "lm_eval_batch_size": a.lm_eval_batch_size or a.batch_size, "repeats": a.repeats,
                      "torch_threads": torch.get_num_threads(), "tasks": figures}))


if __name__ == "__main__":
    main()
