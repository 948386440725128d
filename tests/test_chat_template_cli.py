"""A model's own chat template through `gg generate`, `gg serve` and `gg evaluate --apply-chat-template`: a Qwen3 folder
built here with a ChatML tokenizer (`<|im_start|>`, `<|im_end|>` and a newline after each turn). The prompt ids are
`transformers`' `apply_chat_template(..., add_generation_prompt=True)`, the greedy answers are `transformers`'
`generate` and stop at `<|im_end|>`, and lm-eval's continued last message (`gen_prefix`) is cut as lm-eval's own
`HFLM` cuts it, before `<|im_end|>` and the newline after it."""
import json, os, subprocess, sys, textwrap

os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"      # lm-eval must not touch the network

import httpx
import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import ROOT, run_gg
from test_serve import free_port, stop, wait_ready
from test_tokenizer import _chatml_folder
from gradient_garden.checkpoint.checkpoints import save_checkpoint
from gradient_garden.checkpoint.hf import adopt_hf_model, hf_start_checkpoint
from gradient_garden.config import GlobalConfig, TokenizerConfig
from gradient_garden.generation import encode_prompts
from gradient_garden.tokenizer import init_tokenizer

QUESTIONS = ["What is 12 + 7?", "Spell cat", "Reverse abc"]
MAX_NEW = 12


def template_ids(tok, question: str) -> list[int]:
    "`transformers`' prompt ids of one user turn, with the generation prompt."
    return list(tok.apply_chat_template([{"role": "user", "content": question}], tokenize=True,
                                        add_generation_prompt=True, return_dict=True)["input_ids"])


def greedy(hf, prompt: list[int], end) -> list[int]:
    "`transformers`' greedy new ids: up to and with `end`, or MAX_NEW of them when `end` is None."
    kw = dict(eos_token_id=end) if end is not None else dict(eos_token_id=None, min_new_tokens=MAX_NEW)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    """A ChatML Qwen3 folder (untied head) whose greedy answer to the first question is a few tokens and `<|im_end|>`:
    the head rows of `<|im_end|>` and of the token it would have chosen there are swapped."""
    folder = _chatml_folder(tmp_path_factory.mktemp("chatml")/"Qwen3-chatml")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    cfg = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    end, prompt = tok.convert_tokens_to_ids("<|im_end|>"), template_ids(tok, QUESTIONS[0])
    free = greedy(hf, prompt, None)
    k = next(k for k in range(2, MAX_NEW) if free[k] != end and end not in free[:k + 1] and free[k] not in free[:k])
    with torch.no_grad(): hf.lm_head.weight[[free[k], end]] = hf.lm_head.weight[[end, free[k]]]
    assert greedy(hf, prompt, end) == free[:k] + [end]
    hf.save_pretrained(folder)
    return dict(folder=folder, hf=hf, tok=tok, end=end, k=k)


def _answer(chatml, question: str) -> tuple[list[int], str]:
    "transformers' greedy ids for `question` under the template, and their text without special tokens."
    ids = greedy(chatml["hf"], template_ids(chatml["tok"], question), chatml["end"])
    return ids, chatml["tok"].decode(ids, skip_special_tokens=True)


def test_gg_generate_lays_prompts_out_with_the_folders_template(chatml, tmp_path):
    tok = init_tokenizer(TokenizerConfig(path=str(chatml["folder"])))
    assert encode_prompts(tok, QUESTIONS, instruct=True) == [template_ids(chatml["tok"], q) for q in QUESTIONS]
    (tmp_path/"q.json").write_text(json.dumps(QUESTIONS))
    r = run_gg("generate", "--hf-checkpoint", chatml["folder"], "--prompts", tmp_path/"q.json", "--max-gen-len",
               MAX_NEW, "--device", "cpu", "--output-file-name", tmp_path/"out.json")
    assert "prompts: chat format" in r.stdout, r.stdout
    got = [x["completion"] for x in json.loads((tmp_path/"out.json").read_text())["results"]]
    assert got == [_answer(chatml, q)[1] for q in QUESTIONS]
    assert len(_answer(chatml, QUESTIONS[0])[0]) == chatml["k"] + 1 < MAX_NEW     # it stopped at <|im_end|>


def test_gg_serve_chat_endpoint_uses_the_folders_template(chatml):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("GG_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "gradient_garden.cli", "serve", "--hf-checkpoint",
                             str(chatml["folder"]), "--port", str(port), "--log-level", "warning", "--device", "cpu"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        for q in QUESTIONS:
            r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": model, "messages": [{"role": "user", "content": q}], "max_tokens": MAX_NEW,
                "temperature": 0}).json()
            ids, text = _answer(chatml, q)
            stopped = ids[-1] == chatml["end"]
            assert r["choices"][0]["message"]["content"] == text, (q, r)
            assert r["choices"][0]["finish_reason"] == ("stop" if stopped else "length"), (q, r)
            assert (r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]) == (
                len(template_ids(chatml["tok"], q)), len(ids)), (q, r["usage"])
        assert _answer(chatml, QUESTIONS[0])[0][-1] == chatml["end"]        # the first answer stopped at <|im_end|>
    finally: stop(proc)


TASKS = {"cq_gen": textwrap.dedent("""\
            output_type: generate_until
            doc_to_text: "{{question}}"
            doc_to_target: "{{answer}}"
            gen_prefix: "Answer:"
            generation_kwargs: {until: ["\\n\\n"], max_gen_toks: 8, do_sample: false}
            metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]
            """),
         "cq_mc": textwrap.dedent("""\
            output_type: multiple_choice
            doc_to_text: "{{question}}"
            doc_to_target: 0
            doc_to_choice: "{{[answer, 'no']}}"
            gen_prefix: "Answer: "
            metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]
            """)}


@pytest.fixture(scope="module")
def eval_inputs(chatml, tmp_path_factory):
    "The folder as a native checkpoint (what a run started from it holds), and two local tasks with a `gen_prefix`."
    d = tmp_path_factory.mktemp("chat_eval")
    cfg = GlobalConfig()
    cfg.training.init_from, cfg.training.stage = f"hf:{chatml['folder']}", "instruct"
    ckpt = save_checkpoint(hf_start_checkpoint(adopt_hf_model(cfg)), d/"step_0000000.pt")
    rows = [{"question": q, "answer": a} for q, a in zip(QUESTIONS, ["19", "c a t", "cba"])]
    (d/"rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, body in TASKS.items():
        (d/f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                      f"    test: {d/'rows.jsonl'}\ntest_split: test\n" + body)
    return dict(d=d, ckpt=ckpt)


@pytest.fixture(scope="module")
def hflm_run(chatml, eval_inputs):
    "lm-eval's own `HFLM` on the folder, through the template: its samples and scores are the reference."
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    hf = HFLM(pretrained=str(chatml["folder"]), device="cpu", batch_size=4, dtype="float32")
    tm = TaskManager(include_path=str(eval_inputs["d"]), include_defaults=False)
    return hf, tm, lm_eval.simple_evaluate(model=hf, tasks=list(TASKS), task_manager=tm, log_samples=True,
                                           apply_chat_template=True)


def _by_doc(run, task, field):
    return [s[field] for s in sorted(run["samples"][task], key=lambda s: s["doc_id"])]


def test_continued_message_is_cut_as_hflm_cuts_it(chatml, eval_inputs, hflm_run):
    """`GardenLM` on the folder's checkpoint builds lm-eval's prompts as `HFLM` does: the assistant's `gen_prefix`
    continued (no `<|im_end|>`, no newline after it), the same ids, the same greedy answers and choices."""
    import lm_eval
    from gradient_garden.checkpoint.checkpoints import load_model_from_checkpoint
    from gradient_garden.evals.lm_eval import GardenLM
    hf, tm, theirs = hflm_run
    model, cfg = load_model_from_checkpoint(eval_inputs["ckpt"])
    lm = GardenLM(model, init_tokenizer(cfg.tokenizer), batch_size=4)
    prefill = [{"role": "user", "content": "Spell cat"}, {"role": "assistant", "content": "Answer: "}]
    for gen in (True, False):
        assert lm.apply_chat_template(prefill[:1 + (not gen)], gen) == hf.apply_chat_template(prefill[:1 + (not gen)],
                                                                                               gen)
    assert lm.apply_chat_template(prefill, False).endswith("<|im_start|>assistant\nAnswer: ")   # ChatML keeps spacing
    assert lm.chat_template(True) == hf.chat_template(True) == chatml["tok"].chat_template
    ours = lm_eval.simple_evaluate(model=lm, tasks=list(TASKS), task_manager=tm, log_samples=True,
                                   apply_chat_template=True)
    for task in TASKS:
        assert _by_doc(ours, task, "arguments") == _by_doc(theirs, task, "arguments"), task
        assert _by_doc(ours, task, "resps") == _by_doc(theirs, task, "resps") or task == "cq_mc", task
    prompt = _by_doc(ours, "cq_gen", "arguments")[0][0][0]
    assert prompt.endswith("<|im_start|>assistant\nAnswer:") and lm.tok_encode(prompt) == hf.tok_encode(prompt)
    ll = lambda run: [ll for r in _by_doc(run, "cq_mc", "resps") for (ll, _), in r]
    assert max(abs(a - b) for a, b in zip(ll(ours), ll(theirs))) < 1e-4


def test_gg_evaluate_apply_chat_template_scores_what_hflm_scores(eval_inputs, hflm_run):
    from gradient_garden.cli import main as gg
    out = eval_inputs["d"]/"res.json"
    assert gg(["evaluate", "--checkpoint", str(eval_inputs["ckpt"]), "--lm-eval-tasks", ",".join(TASKS),
               "--lm-eval-include", str(eval_inputs["d"]), "--apply-chat-template", "--device", "cpu",
               "--batch-size", "4", "--output-file-name", str(out)]) == 0
    res, ref = json.loads(out.read_text()), hflm_run[2]["results"]
    assert res["chat_template"] is True
    assert res["tasks"]["cq_gen"]["exact_match"] == ref["cq_gen"]["exact_match,none"]
    assert res["tasks"]["cq_mc"]["acc"] == ref["cq_mc"]["acc,none"]
