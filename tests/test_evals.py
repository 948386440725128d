"Evals: the batched scorer against a one-forward-per-choice reference, lm-eval's split and metrics, CLI, ranks."
import argparse, json, math, os, subprocess, sys, textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from gradient_garden.config import ConfigError, TokenizerConfig
from gradient_garden.evals import benchmarks as D
from gradient_garden.evals import multiple_choice as E
from gradient_garden.cli import evaluate as CE, prepare as CP

LLAMA3_MODEL = (Path(sys.prefix)/"lib"/f"python{sys.version_info.major}.{sys.version_info.minor}"/"site-packages"
                /"llama_models"/"llama3"/"tokenizer.model")

# -- fixtures: a byte-level BPE trained on the fixture texts and a tiny random Llama ------------------------------

def _train_bpe(vocab_size=600):
    from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders
    texts = [s for n in D.BENCHMARKS for ex in D.load_examples(n) for pair in ex.requests for s in pair]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts,
                            trainers.BpeTrainer(vocab_size=vocab_size,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       special_tokens=["<|begin_of_text|>", "<|end_of_text|>"]))
    return tok

@pytest.fixture(scope="module")
def tok():
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=_train_bpe(), bos_token="<|begin_of_text|>",
                                   eos_token="<|end_of_text|>")

def _tiny_llama(vocab_size, seed=0, max_pos=256):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=max_pos)
    return E.HFCausalLM(LlamaForCausalLM(cfg)).eval()

@pytest.fixture(scope="module")
def model(tok):
    return _tiny_llama(len(tok))

# -- the reference: lm-eval's split written out again, one forward per choice ------------------------------------

def slow_loglikelihood(model, encode, context, continuation, max_len=None):
    "One pair, one forward pass, full log-softmax; left-truncated to `max_len` inputs like lm-eval."
    n = len(context) - len(context.rstrip())
    if n: context, continuation = context[:-n], context[-n:] + continuation
    ctx = encode(context)
    cont = encode(context + continuation)[len(ctx):]
    full = ctx + cont
    if max_len: full = full[-(max_len + 1):]
    with torch.no_grad(): logp = model(torch.tensor([full[:-1]]))[0].float().log_softmax(-1)
    T = len(full) - 1
    return sum(logp[T - len(cont) + k, t].item() for k, t in enumerate(cont))

def _edge_benchmark():
    "A benchmark whose contexts end in whitespace (or are empty) and whose answers are single tokens."
    def to_example(doc):
        return D.choices_example(doc["q"], doc["choices"], doc["gold"], delimiter="")
    return D.Benchmark("edge_cases", "local/edge", None, "test", ("q", "choices", "gold"), to_example)

EDGE_ROWS = [
    {"q": "Question: Which planet is closest to the Sun?\nAnswer: ", "choices": ["the", "a", "Mercury"], "gold": 2},
    {"q": "The river was deeper than the pond, so ", "choices": ["the", "he", "a"], "gold": 0},
    {"q": "Answer:\n", "choices": ["the", "light and sound"], "gold": 0},
    {"q": "Answer:  \t", "choices": [" the", "of"], "gold": 1},
    {"q": "", "choices": ["the", "water"], "gold": 1},
]

def _edge_examples():
    bench = _edge_benchmark()
    return [bench.to_example(r) for r in EDGE_ROWS]

# -- the split -----------------------------------------------------------------------------------------------------

def test_encode_pair_follows_lm_eval(tok):
    enc = E.text_encoder(tok)
    ctx, cont = E.encode_pair(enc, "Question: Which planet?\nAnswer: ", "the")
    assert ctx == enc("Question: Which planet?\nAnswer:") and ctx + cont == enc("Question: Which planet?\nAnswer: the")
    assert len(cont) == 1                                                       # a single-token answer stays one token
    assert E.encode_pair(enc, "", " the", prefix_id=5) == ([5], enc(" the"))
    with pytest.raises(ValueError, match="prefix"): E.encode_pair(enc, "", " the")

def test_text_encoder_adapts_every_tokenizer(tok):
    import tiktoken
    from gradient_garden.tokenizer import init_tokenizer
    platform = init_tokenizer(TokenizerConfig(backend="tiktoken", path=str(LLAMA3_MODEL)))
    raw = platform.model                                                        # the tiktoken.Encoding underneath
    assert isinstance(raw, tiktoken.Encoding)
    text = "Question: What melts?\nAnswer: ice"
    assert E.text_encoder(platform)(text) == E.text_encoder(raw)(text) == raw.encode_ordinary(text)
    assert E.prefix_token_id(platform) == platform.bos_id
    assert E.text_encoder(tok)(text) == tok.encode(text, add_special_tokens=False)
    assert E.text_encoder(tok.backend_tokenizer)(text) == tok.encode(text, add_special_tokens=False)
    # the Llama 3 split of a context ending in a space: the space joins the answer token
    ctx, cont = E.encode_pair(E.text_encoder(platform), "Answer: ", "ice")
    assert raw.decode(cont) == " ice" and len(cont) == 1

# -- the scorer against the reference ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["hellaswag", "winogrande", "arc_challenge", "edge_cases"])
def test_batched_scorer_matches_one_forward_per_choice(name, model, tok):
    exs = _edge_examples() if name == "edge_cases" else D.load_examples(name)[:10]
    enc = E.text_encoder(tok)
    if name == "edge_cases":
        pairs = [E.encode_pair(enc, c, k, E.prefix_token_id(tok)) for ex in exs for c, k in ex.requests]
        assert any(len(k) == 1 for _, k in pairs), "no single-token continuation in the edge cases"
        slow = []
        for ex in exs:     # the empty context: lm-eval scores the continuation after the prefix token
            slow.append([slow_loglikelihood(model, enc, c, k) if c else
                         _slow_after_prefix(model, E.prefix_token_id(tok), enc(k)) for c, k in ex.requests])
    else:
        slow = [[slow_loglikelihood(model, enc, c, k) for c, k in ex.requests] for ex in exs]
    for bs in (3, 16):
        for share in (False, True):
            got = E.score_examples(model, tok, exs, batch_size=bs, share_context=share)
            np.testing.assert_allclose(np.array(sum(got, [])), np.array(sum(slow, [])), atol=1e-4, rtol=0,
                                       err_msg=f"{name} batch_size={bs} share_context={share}")
            assert E.mc_metrics(got, exs) == E.mc_metrics(slow, exs)

def _slow_after_prefix(model, prefix, cont):
    with torch.no_grad(): logp = model(torch.tensor([[prefix] + cont[:-1]]))[0].log_softmax(-1)
    return sum(logp[k, t].item() for k, t in enumerate(cont))

def test_truncation_matches_lm_eval(model, tok):
    exs = D.load_examples("hellaswag")[:4]
    enc = E.text_encoder(tok)
    assert max(len(enc(c + k)) for ex in exs for c, k in ex.requests) > 48    # so truncation happens
    slow = [[slow_loglikelihood(model, enc, c, k, max_len=48) for c, k in ex.requests] for ex in exs]
    for share in (False, True):    # shared rows longer than max_len fall back to plain, truncated rows
        got = E.score_examples(model, tok, exs, batch_size=4, max_len=48, share_context=share)
        np.testing.assert_allclose(np.array(sum(got, [])), np.array(sum(slow, [])), atol=1e-4, rtol=0)

# -- metrics ---------------------------------------------------------------------------------------------------------

def test_metrics_are_lm_eval_definitions():
    rng = np.random.default_rng(0)
    exs, lls, chs = [], [], []
    for i in range(50):
        k = int(rng.integers(2, 6))
        chs.append(["x" * int(rng.integers(1, 30)) for _ in range(k)])
        exs.append(D.choices_example("ctx", chs[-1], int(rng.integers(0, k))))
        lls.append(list(rng.normal(-20, 5, size=k)))
    acc = np.array([float(np.argmax(l) == ex.gold) for l, ex in zip(lls, exs)])
    # lm-eval: completion_len = [len(choice) for choice in doc_to_choice(doc)]; pred_norm = argmax(lls / completion_len)
    norm = np.array([float(np.argmax(np.array(l) / np.array([float(len(c)) for c in ch])) == ex.gold)
                     for l, ex, ch in zip(lls, exs, chs)])
    m = E.mc_metrics(lls, exs)
    assert m["n"] == 50
    assert math.isclose(m["acc"], acc.mean()) and math.isclose(m["acc_norm"], norm.mean())
    assert math.isclose(m["acc_stderr"], acc.std(ddof=1) / math.sqrt(50))
    assert math.isclose(m["acc_norm_stderr"], norm.std(ddof=1) / math.sqrt(50))

# -- data, errors, registry ------------------------------------------------------------------------------------------

def test_fixtures_follow_the_hub_schemas():
    hs = D.read_jsonl(D.FIXTURES_DIR/"hellaswag.jsonl")
    assert all(isinstance(r["label"], str) and isinstance(r["ind"], int) and len(r["endings"]) == 4 for r in hs)
    assert set(hs[0]) == {"ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings", "source_id", "split",
                          "split_type", "label"}
    wg = D.read_jsonl(D.FIXTURES_DIR/"winogrande.jsonl")
    assert all(set(r) == {"sentence", "option1", "option2", "answer"} and r["answer"] in ("1", "2")
               and r["sentence"].count("_") == 1
               for r in wg)
    arc = D.read_jsonl(D.FIXTURES_DIR/"arc_challenge.jsonl")
    assert all(set(r) == {"id", "question", "choices", "answerKey"} and set(r["choices"]) == {"text", "label"}
               for r in arc)
    for n in ("hellaswag", "winogrande", "arc_challenge"): assert 30 <= len(D.load_examples(n)) <= 60

def test_bad_input_is_named(tmp_path):
    (tmp_path/"arc_challenge.jsonl").write_text('{"id": "1", "question": "Q?", "choices": {"text": ["a"], "label": '
                                                '["A"]}, "answerKey": "B"}\n')
    with pytest.raises(ConfigError,
                       match=r"arc_challenge.jsonl:1: not a valid arc_challenge row"): D.load_examples("arc_challenge",
                                                                                                       tmp_path)
    (tmp_path/"hellaswag.jsonl").write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"hellaswag.jsonl:1: not valid JSON"): D.load_examples("hellaswag", tmp_path)
    with pytest.raises(ConfigError, match="gg prepare --winogrande"): D.load_examples("winogrande", tmp_path)
    with pytest.raises(ConfigError,
                       match="expected one of hellaswag, winogrande, arc_challenge"): D.get_benchmark("mmlu")

def test_prepare_offline_and_hub_path(tmp_path, monkeypatch):
    import datasets
    calls = []
    def fake(path, name=None, split=None):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(D.read_jsonl(D.FIXTURES_DIR/"hellaswag.jsonl"))
    monkeypatch.setattr(datasets, "load_dataset", fake)
    D.prepare_evals(["hellaswag"], tmp_path, from_hub=True)
    assert calls == [("Rowan/hellaswag", None, "validation")]
    assert D.read_jsonl(tmp_path/"hellaswag.jsonl") == D.read_jsonl(D.FIXTURES_DIR/"hellaswag.jsonl")
    def offline(*a, **k): raise ConnectionError("no network")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConfigError, match="cannot load from the hub.*--evals-offline"): D.prepare_evals(["winogrande"],
                                                                                                        tmp_path)
    args = CP.add_prepare_eval_args(argparse.ArgumentParser()).parse_args(["--winogrande", "--arc-challenge",
                                                                           "--evals-offline",
                                                                         "--evals-dir", str(tmp_path)])
    assert CP.run_prepare_evals(args) == 0
    manifest = json.loads((tmp_path/"manifest.json").read_text())
    assert manifest["winogrande"]["source"] == "fixture"
    assert manifest["hellaswag"]["source"].startswith("hub:Rowan/hellaswag")

# -- gg evaluate -----------------------------------------------------------------------------------------------------

def test_evaluate_hf_checkpoint_end_to_end(tmp_path, model, tok):
    model.model.save_pretrained(tmp_path/"hf"); tok.save_pretrained(tmp_path/"hf")
    D.prepare_evals(["hellaswag", "winogrande", "arc_challenge"], tmp_path/"evals", from_hub=False)
    argv = ["--hf-checkpoint", str(tmp_path/"hf"), "--hellaswag", "--hellaswag-examples", "10", "--winogrande",
            "--winogrande-examples", "10", "--arc-challenge", "--arc-challenge-examples", "0", "--evals-dir",
            str(tmp_path/"evals"),
            "--batch-size", "4", "--device", "cpu", "--seed", "3", "--output-file-name", str(tmp_path/"res.json")]
    assert CE.run_evaluate(CE.add_evaluate_args(argparse.ArgumentParser()).parse_args(argv)) == 0
    res = json.loads((tmp_path/"res.json").read_text())
    assert {k: v["n"] for k, v in res["tasks"].items()} == {"hellaswag": 10, "winogrande": 10, "arc_challenge": 40}
    for m in res["tasks"].values():
        assert set(m) >= {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "n", "source"} and 0 <= m["acc"] <= 1
    # the same numbers straight from the library, on the same seeded subset
    direct = E.evaluate_benchmarks(model, tok, ["hellaswag"], 10, 4, data_dir=tmp_path/"evals", seed=3)["hellaswag"]
    assert direct["acc"] == res["tasks"]["hellaswag"]["acc"]
    assert direct["acc_norm"] == res["tasks"]["hellaswag"]["acc_norm"]
    with pytest.raises(ConfigError, match="--validation needs --checkpoint"):
        CE.run_evaluate(CE.add_evaluate_args(argparse.ArgumentParser()).parse_args(["--hf-checkpoint", "x",
                                                                                    "--validation"]))

def test_a_new_benchmark_plugs_in(tmp_path, model, tok):
    bench = D.register_benchmark(_edge_benchmark())
    try:
        with open(tmp_path/"edge_cases.jsonl", "w") as f:
            for r in EDGE_ROWS: f.write(json.dumps(r) + "\n")
        res = E.evaluate_benchmarks(model, tok, ["edge-cases"], None, 2, data_dir=tmp_path)
        assert res["edge_cases"]["n"] == len(EDGE_ROWS) and res["edge_cases"]["source"] == "local"
        args = CE.add_evaluate_args(argparse.ArgumentParser()).parse_args(["--hf-checkpoint", "x", "--edge-cases",
                                                                          "--edge-cases-examples", "3"])
        assert CP.selected_benchmarks(args) == ["edge_cases"] and args.edge_cases_examples == 3
    finally: D.BENCHMARKS.pop(bench.name)

def test_subsets_are_seeded_random():
    a, b = D.sample_indices(1000, 100, 1), D.sample_indices(1000, 100, 2)
    assert a == D.sample_indices(1000, 100, 1) and a != b and a != list(range(100)) and len(set(a)) == 100

# -- ranks: two processes, gloo, FSDP2, unequal shares ------------------------------------------------------------

WORKER = textwrap.dedent('''
    import json, os, sys, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from torch.distributed.fsdp import fully_shard
    from transformers import PreTrainedTokenizerFast
    import test_evals as T
    from gradient_garden.evals import multiple_choice as E
    dist.init_process_group("gloo")
    tok = PreTrainedTokenizerFast(tokenizer_object=T._train_bpe(), bos_token="<|begin_of_text|>",
                                  eos_token="<|end_of_text|>")
    model = T._tiny_llama(len(tok))
    for layer in model.model.model.layers: fully_shard(layer)
    fully_shard(model)
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    out = {{}}
    for share in (False, True):
        calls.clear()
        res = E.evaluate_benchmarks(model, tok, ["arc_challenge", "winogrande"],
                                    {{"arc_challenge": 7, "winogrande": 5}}, batch_size=2, share_context=share)
        out[str(share)] = {{"res": res, "forwards": len(calls)}}
    json.dump(out, open(os.path.join({out!r}, f"rank{{dist.get_rank()}}.json"), "w"))
    dist.barrier()  # no rank tears down the store while the other still uses it
    dist.destroy_process_group()
    os._exit(0)     # results are on disk; skip interpreter teardown, where gloo's threads can abort the process
''')

def test_two_ranks_fsdp_gather_equals_one_process(tmp_path, model, tok):
    script = tmp_path/"worker.py"
    script.write_text(WORKER.format(tests=str(Path(__file__).parent), out=str(tmp_path)))
    torchrun = Path(sys.executable).parent/"torchrun"
    r = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(script)],
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((tmp_path/f"rank{i}.json").read_text()) for i in range(2)]
    for share in (False, True):
        got = [rk[str(share)] for rk in ranks]
        # arc: 7 examples -> 4 + 3 per rank -> 2 forwards each; winogrande: 5 -> 3 + 2 -> 2 forwards each
        assert got[0]["forwards"] == got[1]["forwards"] == 4
        single = E.evaluate_benchmarks(model, tok, ["arc_challenge", "winogrande"],
                                       {"arc_challenge": 7, "winogrande": 5},
                                  batch_size=2, share_context=share)
        for g in got:
            for name, m in single.items():
                assert (g["res"][name]["n"], g["res"][name]["acc"], g["res"][name]["acc_norm"]) == (m["n"], m["acc"],
                                                                                                    m["acc_norm"])

# -- the platform's own model --------------------------------------------------------------------------------------

def test_tendril_batched_and_shared_match_reference(tok):
    registry = pytest.importorskip("gradient_garden.models.registry")
    from gradient_garden.config import ModelConfig
    torch.manual_seed(0)
    m = registry.build_model(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=len(tok),
                                         multiple_of=16,
                                        max_seq_len=256)).eval()
    enc = E.text_encoder(tok)
    for name in ("hellaswag", "winogrande"):
        exs = D.load_examples(name)[:6]
        slow = [[slow_loglikelihood(m, enc, c, k) for c, k in ex.requests] for ex in exs]
        for share in (False, True):
            got = E.score_examples(m, tok, exs, batch_size=4, share_context=share)
            np.testing.assert_allclose(np.array(sum(got, [])), np.array(sum(slow, [])), atol=1e-4, rtol=0)

def test_evaluate_platform_checkpoint_with_validation(tmp_path, monkeypatch):
    pytest.importorskip("gradient_garden.models.tendril")
    from gradient_garden.config import GlobalConfig, ModelConfig
    from gradient_garden.checkpoint.checkpoints import save_checkpoint
    from gradient_garden.models.registry import build_model
    from gradient_garden.tokenizer import train_bpe, init_tokenizer
    texts = [s for n in D.BENCHMARKS for ex in D.load_examples(n) for pair in ex.requests for s in pair]
    cfg = GlobalConfig()
    cfg.tokenizer.path = str(train_bpe(texts, 600, tmp_path/"tok"))
    cfg.model = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=600, multiple_of=16,
                            max_seq_len=128)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    ckpt = save_checkpoint({"step": 1, "stage": "pretraining", "architecture": "tendril", "config": cfg.to_dict(),
                            "model": model.state_dict()}, tmp_path/"step_0000001.pt")
    x = torch.randint(0, 600, (2, 17))
    batches = [{"input_ids": x[:, :-1], "labels": x[:, 1:]}]
    seen = {}
    def fake_batches(c, tokenizer, steps, batch_size, rank, world_size):
        seen.update(steps=steps, identity=tokenizer.identity)
        return batches
    monkeypatch.setattr(CE, "_validation_batches", fake_batches)
    D.prepare_evals(["arc_challenge"], tmp_path/"evals", from_hub=False)
    argv = ["--checkpoint", str(ckpt), "--validation", "--validation-steps", "3", "--arc-challenge",
            "--arc-challenge-examples", "8",
            "--evals-dir", str(tmp_path/"evals"), "--device", "cpu", "--output-file-name", str(tmp_path/"res.json")]
    assert CE.run_evaluate(CE.add_evaluate_args(argparse.ArgumentParser()).parse_args(argv)) == 0
    res = json.loads((tmp_path/"res.json").read_text())
    assert seen == {"steps": 3, "identity": init_tokenizer(cfg.tokenizer).identity}
    with torch.no_grad(): ref = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1),
                                                                  x[:, 1:].flatten()).item()
    assert math.isclose(res["validation"]["loss"], ref, rel_tol=1e-5) and res["validation"]["tokens"] == 32
    assert res["tasks"]["arc_challenge"]["n"] == 8 and res["checkpoint"] == str(ckpt)


# -- special tokens and padding layouts ------------------------------------------------------------------------------

class _LogitsOnly(torch.nn.Module):
    "A model that takes nothing but tokens (no logits_to_keep): its head runs at every position."
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
    def forward(self, tokens): return self.inner(tokens)


def test_with_and_without_logits_to_keep_give_the_reference(model, tok):
    exs = D.load_examples("hellaswag")[:6]
    enc = E.text_encoder(tok)
    slow = [[slow_loglikelihood(model, enc, c, k) for c, k in ex.requests] for ex in exs]
    assert E._keeps_logits(model) and not E._keeps_logits(_LogitsOnly(model))
    for m in (model, _LogitsOnly(model)):                       # the head from the first target on, and everywhere
        got = E.score_examples(m, tok, exs, batch_size=3)
        np.testing.assert_allclose(np.array(sum(got, [])), np.array(sum(slow, [])), atol=1e-4, rtol=0)


def test_default_prefix_follows_the_tokenizer(tmp_path, tok):
    from gradient_garden.tokenizer import train_bpe, init_tokenizer
    texts = [s for n in D.BENCHMARKS for ex in D.load_examples(n) for pair in ex.requests for s in pair]
    platform = init_tokenizer(TokenizerConfig(path=str(train_bpe(texts, 600, tmp_path/"tok"))))
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(tmp_path/"tok")                       # the same folder, as lm-eval loads it
    assert E.default_prefix(platform) == E.default_prefix(hf) == [platform.bos_id] == hf.encode("x")[:1]
    assert E.default_prefix(tok) == []                                       # a tokenizer that adds nothing
    pair = E.pair_encoder(platform)
    ctx, cont = pair("Answer:", " ice")
    assert ctx == hf.encode("Answer:") and ctx + cont == hf.encode("Answer: ice")
    assert pair("", "Ice")[0] == [platform.bos_id]                           # one BOS, not two
    assert E.pair_encoder(platform, add_bos=False)("Answer:", " ice")[0] == hf.encode("Answer:",
                                                                                      add_special_tokens=False)
    assert E.pair_encoder(tok, add_bos=True)("Answer:", " ice")[0][0] == E.prefix_token_id(tok)
    args = CE.add_evaluate_args(argparse.ArgumentParser())
    assert [args.parse_args(a).add_bos for a in ([], ["--add-bos"], ["--no-add-bos"])] == [None, True, False]


def test_evaluate_numbers_out_of_range_are_one_line_errors():
    parse = lambda *a: CE.add_evaluate_args(argparse.ArgumentParser()).parse_args(["--checkpoint", "x.pt",
                                                                                   "--winogrande", *a])
    for argv, msg in [(["--batch-size", "0"], "gg evaluate --batch-size: got 0; must be >= 1"),
                      (["--validation", "--validation-steps", "0"],
                       "gg evaluate --validation-steps: got 0; must be >= 1"),
                      (["--winogrande-examples", "-3"],
                       "gg evaluate --winogrande-examples: got -3; must be >= 0 (0 = all rows)"),
                      (["--num-fewshot", "-1"], "gg evaluate --num-fewshot: got -1; must be >= 0")]:
        with pytest.raises(ConfigError) as e: CE.run_evaluate(parse(*argv))
        assert str(e.value) == msg
    with pytest.raises(ConfigError, match="examples: got -3"): D.sample_indices(10, -3, 0)


def test_default_shares_contexts_and_runs_the_head_at_scored_positions_only(tok):
    "The default mode: one row per example, the vocabulary head on the scored positions only, the same numbers."
    from gradient_garden.config import ModelConfig
    from gradient_garden.models.registry import build_model
    torch.manual_seed(0)
    m = build_model(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=len(tok),
                                multiple_of=16)).eval()
    exs = D.load_examples("hellaswag")[:5]
    pair = E.pair_encoder(tok)
    scored = sum(len({p for _, p, _ in E._shared_row([pair(c, k) for c, k in ex.requests], 0).targets}) for ex in exs)
    rows_seen, head_rows = [], []
    h1 = m.register_forward_hook(lambda mod, args, out: rows_seen.append(args[0].shape[0]))
    h2 = m.output.register_forward_hook(lambda mod, args, out: head_rows.append(args[0].flatten(0, -2).shape[0]))
    try: shared = E.score_examples(m, tok, exs, batch_size=8)
    finally: h1.remove(); h2.remove()
    assert sum(rows_seen) == len(exs) and sum(head_rows) == scored          # no logits for context or padding
    plain = E.score_examples(m, tok, exs, batch_size=8, share_context=False)
    np.testing.assert_allclose(np.array(sum(shared, [])), np.array(sum(plain, [])), atol=1e-4, rtol=0)
    Instance = pytest.importorskip("lm_eval.api.instance").Instance      # GardenLM: one row per context too
    from gradient_garden.evals.lm_eval import GardenLM
    # the platform tokenizer surface GardenLM reads
    class Tok:
        eos_id, bos_id, pad_id = tok.eos_token_id, tok.bos_token_id, 0
        special_ids, markup_tokens, identity = {}, {}, "bpe"
        def encode(self, s): return tok.encode(s, add_special_tokens=False)
        def decode(self, ids): return tok.decode(ids)
        def encode_markup(self, s): return self.encode(s)
    reqs = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(r for ex in exs for r in ex.requests)]
    rows_seen.clear(); h1 = m.register_forward_hook(lambda mod, args, out: rows_seen.append(args[0].shape[0]))
    try: got = GardenLM(m, Tok(), batch_size=8).loglikelihood(reqs)
    finally: h1.remove()
    assert sum(rows_seen) == len(exs)
    np.testing.assert_allclose([ll for ll, _ in got], np.array(sum(plain, [])), atol=1e-4, rtol=0)
