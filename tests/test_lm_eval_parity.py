"Parity with lm-evaluation-harness itself: its HF model on a `gg export` folder against `gg evaluate` and `GardenLM`."
import argparse, json, os, subprocess, sys, textwrap
from pathlib import Path

os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"      # lm-eval must not touch the network
import numpy as np
import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
import lm_eval.tasks as lm_eval_tasks
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from gradient_garden.evals import benchmarks as D
from gradient_garden.evals import multiple_choice as E
from gradient_garden.cli import evaluate as CE
from gradient_garden.cli import main as gg
from gradient_garden.config import GlobalConfig, ModelConfig
from gradient_garden.checkpoint.checkpoints import load_model_from_checkpoint, save_checkpoint
from gradient_garden.models.registry import build_model
from gradient_garden.tokenizer import init_tokenizer, train_bpe

# lm-eval's own task definitions of the three benchmarks, pointed at the bundled fixture rows (same hub schemas)
BUILTIN = {"hellaswag": ("hellaswag/hellaswag.yaml", "validation"),
           "winogrande": ("winogrande/default.yaml", "validation"),
           "arc_challenge": ("arc/arc_challenge.yaml", "test")}


@pytest.fixture(scope="module", autouse=True)
def offline():
    "Offline also for libraries imported before this module set the environment."
    import datasets, huggingface_hub
    old = datasets.config.HF_DATASETS_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_DATASETS_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    yield
    datasets.config.HF_DATASETS_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = old


def _checkpoint(folder: Path, cfg: GlobalConfig, seed=0, prepare=None) -> Path:
    torch.manual_seed(seed)
    model = build_model(cfg.model)
    if prepare: prepare(model)
    return save_checkpoint({"step": 1, "stage": "pretraining", "architecture": cfg.model.architecture,
                            "config": cfg.to_dict(),
                            "model": model.state_dict()}, folder/"step_0000001.pt"), model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    "A tiny Tendril checkpoint with the platform's Llama 3-style BPE, its `gg export` folder, lm-eval's HF model on it."
    d = tmp_path_factory.mktemp("parity")
    texts = [s for n in D.BENCHMARKS for ex in D.load_examples(n) for pair in ex.requests for s in pair]
    cfg = GlobalConfig()
    cfg.tokenizer.path = str(train_bpe(texts, 600, d/"tok"))
    cfg.model = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=600, multiple_of=16,
                            max_seq_len=256)
    ckpt, _ = _checkpoint(d, cfg)
    assert gg(["export", "--checkpoint", str(ckpt), "--out", str(d/"hf")]) == 0
    root = Path(lm_eval_tasks.__file__).parent
    for name, (yml, split) in BUILTIN.items():
        (d/"tasks").mkdir(exist_ok=True)
        (d/"tasks"/f"fx_{name}.yaml").write_text(textwrap.dedent(f"""\
            include: {root/yml}
            task: fx_{name}
            tag: []
            dataset_path: json
            dataset_name: null
            dataset_kwargs:
              data_files:
                {split}: {D.FIXTURES_DIR/(name + '.jsonl')}
            training_split: null
            validation_split: {split if split == 'validation' else 'null'}
            test_split: {split if split == 'test' else 'null'}
            """))
    D.prepare_evals(list(BUILTIN), d/"evals", from_hub=False)
    model, cfg = load_model_from_checkpoint(ckpt)
    return dict(d=d, ckpt=ckpt, cfg=cfg, model=model, tok=init_tokenizer(cfg.tokenizer),
                hf=HFLM(pretrained=str(d/"hf"), device="cpu", batch_size=16, dtype="float32"),
                tm=TaskManager(include_path=str(d/"tasks"), include_defaults=False))


@pytest.fixture(scope="module")
def lm_eval_runs(setup):
    "lm-eval's HF model on the three fixture tasks, with its per-sample log."
    return lm_eval.simple_evaluate(model=setup["hf"], tasks=[f"fx_{n}" for n in BUILTIN], task_manager=setup["tm"],
                                   log_samples=True, num_fewshot=0)


def _theirs(runs, name):
    "lm-eval's per-choice log-likelihoods and per-sample acc/acc_norm, by doc_id."
    return {s["doc_id"]: ([ll for ll, _ in s["filtered_resps"]], s["acc"], s.get("acc_norm"))
            for s in runs["samples"][f"fx_{name}"]}


@pytest.mark.parametrize("name", list(BUILTIN))
@pytest.mark.parametrize("share", [False, True])
def test_per_choice_loglikelihoods_and_scores_equal_lm_eval(name, share, setup, lm_eval_runs):
    samples = {}
    ours = E.evaluate_benchmarks(setup["model"], setup["tok"], [name], None, 8, data_dir=setup["d"]/"evals",
                                 share_context=share,
                            samples=samples)[name]
    theirs = _theirs(lm_eval_runs, name)
    assert sorted(theirs) == [r["doc_id"] for r in samples[name]]
    for r in samples[name]:
        lls, acc, acc_norm = theirs[r["doc_id"]]
        np.testing.assert_allclose(r["loglikelihoods"], lls, atol=1e-4, rtol=0, err_msg=f"{name} doc {r['doc_id']}")
        assert r["acc"] == acc and (acc_norm is None or r["acc_norm"] == acc_norm), (name, r["doc_id"])
    agg = lm_eval_runs["results"][f"fx_{name}"]
    assert ours["acc"] == agg["acc,none"] and ours["n"] == 40
    if "acc_norm,none" in agg: assert ours["acc_norm"] == agg["acc_norm,none"]


def test_gg_evaluate_equals_lm_eval_on_the_bundled_fixtures(setup, lm_eval_runs, capsys):
    "The closing table: `gg evaluate` on the native checkpoint and on the export, against lm-eval's HF model."
    out = {}
    for kind in ("checkpoint", "hf-checkpoint"):
        src = setup["ckpt"] if kind == "checkpoint" else setup["d"]/"hf"
        res_file = setup["d"]/f"res_{kind}.json"
        argv = [f"--{kind}", str(src), "--hellaswag", "--winogrande", "--arc-challenge", "--hellaswag-examples", "0",
                "--winogrande-examples", "0", "--arc-challenge-examples", "0", "--evals-dir", str(setup["d"]/"evals"),
                "--device", "cpu", "--batch-size", "8", "--output-file-name", str(res_file)]
        assert CE.run_evaluate(CE.add_evaluate_args(argparse.ArgumentParser()).parse_args(argv)) == 0
        out[kind] = json.loads(res_file.read_text())
        assert out[kind]["context_prefix"] == "bos (tokenizer default)"
    rows = []
    for name in BUILTIN:
        agg = lm_eval_runs["results"][f"fx_{name}"]
        for metric in ("acc", "acc_norm"):
            ref = agg.get(f"{metric},none")
            got = [out[k]["tasks"][name][metric] for k in ("checkpoint", "hf-checkpoint")]
            rows.append(f"| {name} | {metric} | {got[0]:.4f} | {got[1]:.4f} | {'-' if ref is None else f'{ref:.4f}'} |")
            if ref is not None: assert got == [ref, ref], (name, metric, got, ref)
    with capsys.disabled():
        print("\n| task | metric | gg evaluate --checkpoint | gg evaluate --hf-checkpoint (export) | lm-eval hf "
              "(export) |")
        print("|---|---|---|---|---|"); print("\n".join(rows))


def test_special_token_choices_follow_lm_eval(setup):
    "Empty contexts score after one BOS; --no-add-bos equals lm-eval's add_bos_token=False."
    exs = [D.choices_example("", ["The river froze.", "Ice"], 0),
           D.choices_example("Question: What melts?\nAnswer:", ["ice"], 0)]
    reqs = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(r for ex in exs for r in ex.requests)]
    ours = sum(E.score_examples(setup["model"], setup["tok"], exs, batch_size=4), [])
    np.testing.assert_allclose(ours, [ll for ll, _ in setup["hf"].loglikelihood(reqs)], atol=1e-4, rtol=0)
    no_bos = HFLM(pretrained=str(setup["d"]/"hf"), device="cpu", batch_size=16, dtype="float32", add_bos_token=False)
    ours = sum(E.score_examples(setup["model"], setup["tok"], exs, batch_size=4, add_bos=False), [])
    np.testing.assert_allclose(ours, [ll for ll, _ in no_bos.loglikelihood(reqs)], atol=1e-4, rtol=0)
    pair = E.pair_encoder(setup["tok"])
    assert pair("", " the")[0] == [setup["tok"].bos_id]                       # one BOS, not two


def test_log_samples_can_be_diffed_with_lm_eval(setup, lm_eval_runs):
    res_file = setup["d"]/"logged"/"res.json"
    argv = ["--checkpoint", str(setup["ckpt"]), "--winogrande", "--winogrande-examples", "0", "--evals-dir",
            str(setup["d"]/"evals"),
            "--device", "cpu", "--log-samples", "--output-file-name", str(res_file)]
    assert CE.run_evaluate(CE.add_evaluate_args(argparse.ArgumentParser()).parse_args(argv)) == 0
    logged = D.read_jsonl(setup["d"]/"logged"/"res_samples_winogrande.jsonl")
    theirs = {s["doc_id"]: s for s in lm_eval_runs["samples"]["fx_winogrande"]}
    for r in logged:
        t = theirs[r["doc_id"]]
        assert [list(a) for a in r["arguments"]] == [list(a) for a in t["arguments"]]
        np.testing.assert_allclose(r["loglikelihoods"], [ll for ll, _ in t["filtered_resps"]], atol=1e-4, rtol=0)
        assert r["gold"] == int(t["doc"]["answer"]) - 1 and r["acc"] == t["acc"] and all(n >= 1 for n in r["n_tokens"])


def test_gg_evaluate_errors_are_one_line(setup, capsys):
    for argv, msg in [(["--batch-size", "0"], "--batch-size: got 0; must be >= 1"),
                      (["--validation", "--validation-steps", "0"], "--validation-steps: got 0; must be >= 1"),
                      (["--hellaswag-examples", "-3"], "--hellaswag-examples: got -3; must be >= 0 (0 = all rows)"),
                      (["--lm-eval-limit", "0"], "--lm-eval-limit: got 0; must be >= 1")]:
        rc = gg(["evaluate", "--checkpoint", str(setup["ckpt"]), "--hellaswag", "--evals-dir", str(setup["d"]/"evals"),
                 "--device", "cpu", "--output-file-name", str(setup["d"]/"err.json"), *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and msg in err[0], (argv, err)
    rc = gg(["evaluate", "--hf-checkpoint", str(setup["d"]/"hf"), "--lm-eval-tasks", "fx_winogrande"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--lm-eval-tasks needs --checkpoint" in err[0], err


def test_lora_and_moe_checkpoints_through_lm_eval(setup, tmp_path):
    ("GardenLM on a LoRA checkpoint (merged on load) and on a mixture-of-experts one equals the trained model's own "
     "forward.")
    from gradient_garden.config import from_plain
    from gradient_garden.evals.lm_eval import GardenLM
    from gradient_garden.models.lora import apply_lora
    reqs = [Instance("loglikelihood", {}, r, i)
            for i, r in enumerate([("Question: What melts?\nAnswer:", " ice"), ("", "Rain.")])]
    pair = E.pair_encoder(setup["tok"])
    def with_adapters(m):
        apply_lora(m, cfg.lora)
        for n, p in m.named_parameters():
            if n.endswith("lora_B"): torch.nn.init.normal_(p, std=0.05)     # adapters that change the outputs
    for arch in ("lora", "tendril_moe"):
        cfg = from_plain(GlobalConfig, setup["cfg"].to_dict())
        if arch == "tendril_moe": cfg.model.architecture = "tendril_moe"
        (tmp_path/arch).mkdir()
        ckpt, model = _checkpoint(tmp_path/arch, cfg, seed=1, prepare=with_adapters if arch == "lora" else None)
        model.eval()
        ref = []
        for ctx, cont in (r.args for r in reqs):
            c, k = pair(ctx, cont)
            with torch.no_grad(): logp = model(torch.tensor([c + k[:-1]]))[0].float().log_softmax(-1)
            ref.append(sum(logp[len(c) - 1 + j, t].item() for j, t in enumerate(k)))
        got = GardenLM(checkpoint=str(ckpt), batch_size=2).loglikelihood(reqs)
        np.testing.assert_allclose([ll for ll, _ in got], ref, atol=1e-4, rtol=0, err_msg=arch)


WORKER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1",
              "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
def test_lm_eval_tasks_under_torchrun_equal_one_process(setup, tmp_path):
    "gg evaluate --lm-eval-tasks on 2 gloo ranks gives the single-process scores (lm-eval splits and gathers the docs)."
    common = ["evaluate", "--checkpoint", str(setup["ckpt"]), "--lm-eval-tasks", "fx_arc_challenge,fx_winogrande",
              "--lm-eval-include", str(setup["d"]/"tasks"), "--device", "cpu", "--batch-size", "8"]
    assert gg(common + ["--output-file-name", str(tmp_path/"one.json")]) == 0
    torchrun = Path(sys.executable).parent/"torchrun"
    r = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "gradient_garden.cli", *common,
                        "--output-file-name", str(tmp_path/"two.json")], env={**os.environ, **WORKER_ENV},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    one, two = (json.loads((tmp_path/f).read_text())["tasks"] for f in ("one.json", "two.json"))
    for name in ("fx_arc_challenge", "fx_winogrande"):
        assert two[name]["n"] == one[name]["n"] == 40
        assert abs(two[name]["acc"] - one[name]["acc"]) < 1e-12, (name, one[name], two[name])


TURN = ("<|start_header_id|>user<|end_header_id|>\\n\\n{{question}}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\\n\\n")


@pytest.fixture(scope="module")
def chat_tasks(setup):
    ("A multiple-choice and a generation task in plain text (`c_arc`, `c_qa`), and the same with chat markup in the "
     "prompt.")
    d = setup["d"]/"chat_tasks"
    d.mkdir()
    arc = D.read_jsonl(D.FIXTURES_DIR/"arc_challenge.jsonl")[:10]
    (d/"arc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in arc))
    (d/"qa.jsonl").write_text("".join(json.dumps({"question": r["question"], "answer": r["choices"]["text"][0]}) + "\n"
                                      for r in arc))
    common = lambda f: f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d/f}\ntest_split: test\n"
    (d/"c_arc.yaml").write_text("task: c_arc\n" + common("arc.jsonl") + textwrap.dedent("""\
        output_type: multiple_choice
        doc_to_text: "Question: {{question}}\\nAnswer:"
        doc_to_target: "{{choices.label.index(answerKey)}}"
        doc_to_choice: "{{choices.text}}"
        metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]
        """))
    (d/"c_qa.yaml").write_text("task: c_qa\n" + common("qa.jsonl") + textwrap.dedent("""\
        output_type: generate_until
        doc_to_text: "{{question}}"
        doc_to_target: "{{answer}}"
        generation_kwargs: {until: ["\\n\\n"], max_gen_toks: 12, do_sample: false}
        metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]
        """))
    for kind in ("arc", "qa"):
        (d/f"m_{kind}.yaml").write_text(f'include: {d/f"c_{kind}.yaml"}\ntask: m_{kind}\ndoc_to_text: "{TURN}"\n')
    return d, TaskManager(include_path=str(d), include_defaults=False)


CHAT_RUNS = {"markup": (["m_arc", "m_qa"], {}),
             "template": (["c_arc", "c_qa"], dict(apply_chat_template=True, fewshot_as_multiturn=True, num_fewshot=2))}


@pytest.fixture(scope="module")
def hf_chat_runs(setup, chat_tasks):
    ("lm-eval's HF model on the export: the markup tasks, and the plain ones through the chat template with two shots "
     "as turns.")
    return {how: lm_eval.simple_evaluate(model=setup["hf"], tasks=tasks, task_manager=chat_tasks[1], log_samples=True,
                                         **kw)
            for how, (tasks, kw) in CHAT_RUNS.items()}


def _by_doc(run, task, field):
    return [s[field] for s in sorted(run["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.parametrize("how", list(CHAT_RUNS))
def test_chat_format_equals_lm_eval_hf(how, setup, chat_tasks, hf_chat_runs):
    ("Markup in prompts and apply_chat_template: same prompts, same ids, log-likelihoods within 1e-4, identical greedy "
     "answers.")
    from gradient_garden.evals.lm_eval import GardenLM
    (arc, qa), kw = CHAT_RUNS[how]
    lm = GardenLM(setup["model"], setup["tok"], batch_size=8)
    ours, theirs = lm_eval.simple_evaluate(model=lm, tasks=[arc, qa], task_manager=chat_tasks[1], log_samples=True,
                                           **kw), hf_chat_runs[how]
    for task in (arc, qa): assert _by_doc(ours, task, "arguments") == _by_doc(theirs, task, "arguments"), task
    prompt = _by_doc(ours, qa, "arguments")[0][0][0]
    # 2 shots x 2 turns + the question
    assert prompt.count("<|eot_id|>") == (5 if how == "template" else 1)
    assert lm.tok_encode(prompt) == setup["hf"].tok_encode(prompt) and setup["tok"].eot_id in lm.tok_encode(prompt)
    ll = lambda run: [l for r in _by_doc(run, arc, "resps") for (l, _), in r]
    np.testing.assert_allclose(ll(ours), ll(theirs), atol=1e-4, rtol=0)
    gens = _by_doc(ours, qa, "resps")
    assert gens == _by_doc(theirs, qa, "resps") and any(g[0] for g in gens)
    assert ours["results"][arc]["acc,none"] == theirs["results"][arc]["acc,none"]


def test_gg_evaluate_apply_chat_template(setup, chat_tasks, hf_chat_runs):
    "gg evaluate --apply-chat-template --fewshot-as-multiturn scores what lm-eval's HF model scores on the export."
    res_file = setup["d"]/"chat_res.json"
    assert gg(["evaluate", "--checkpoint", str(setup["ckpt"]), "--lm-eval-tasks", "c_arc,c_qa", "--lm-eval-include",
               str(chat_tasks[0]),
               "--apply-chat-template", "--fewshot-as-multiturn", "--num-fewshot", "2", "--device", "cpu",
               "--batch-size", "8",
               "--output-file-name", str(res_file)]) == 0
    res, ref = json.loads(res_file.read_text()), hf_chat_runs["template"]["results"]
    assert res["chat_template"] is True
    assert (res["tasks"]["c_arc"]["acc"] == ref["c_arc"]["acc,none"]
            and res["tasks"]["c_qa"]["exact_match"] == ref["c_qa"]["exact_match,none"])
