"""Post-training beyond the notebooks: DPO / distillation losses against closed forms, LoRA merge, SFT masks and
packing, disjoint ranks, DPO under FSDP2 on 2 gloo ranks, exact resume of SFT and DPO runs."""
import copy, json, math, os
from argparse import Namespace
from pathlib import Path
import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
import torch.nn.functional as F

from gradient_garden.config import (ConfigError, DPOConfig, DistillationConfig, GlobalConfig, LoraConfig, ModelConfig,
                                    TokenizerConfig, from_plain)
from gradient_garden.data.verifiable import (TASKS, WORDS, heldout_examples, sample_conversations,
                                             sample_preference_pairs, split_of)
from gradient_garden.models.lora import apply_lora, lora_state_dict, merge_lora, unmerge_lora, merge_and_unload
from gradient_garden.models.registry import build_model
from gradient_garden.stages.distillation import DistillationTask, check_vocab, distillation_kl, load_teacher
from gradient_garden.stages.dpo import (DPOLoader, DPOTask, ModelReference, PairDataset, PrecomputedReference, dpo_loss,
                                       prepare_dpo, preference_accuracy)
from gradient_garden.stages.sft import IGNORE_INDEX, SFTLoader, SFTTask, prepare_instruct, tokenize_chat
from gradient_garden.cli.prepare import run_stage_prepare   # gg prepare of a stage with data of its own
from gradient_garden.stages.registry import get_stage
from gradient_garden.tokenizer import init_tokenizer, train_bpe

VOCAB, SEQ = 768, 128


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    texts = [m["content"] for c in sample_conversations(2000, seed=0) for m in c] + [" ".join(WORDS)] * 3
    return train_bpe(texts, VOCAB, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir): return init_tokenizer(TokenizerConfig(path=str(tok_dir)))


@pytest.fixture(scope="module")
def data(tmp_path_factory, tok, tok_dir):
    "Instruct and DPO data prepared once, and a config pointing at them."
    base = tmp_path_factory.mktemp("post")
    cfg = GlobalConfig(tokenizer=TokenizerConfig(path=str(tok_dir)), model=small_model_cfg())
    cfg.paths.datasets = str(base/"datasets")
    prepare_instruct({"sources": [{"type": "verifiable", "train": 600, "val": 60}]}, cfg, base/"datasets"/"instruct",
                     tok, progress=False)
    prepare_dpo({"sources": [{"type": "verifiable", "train": 120, "val": 40}]}, cfg, base/"datasets"/"dpo", tok,
                progress=False)
    return dict(base=base, cfg=cfg, instruct=base/"datasets"/"instruct", dpo=base/"datasets"/"dpo")


def small_model_cfg(**kw):
    return ModelConfig(**dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=SEQ) | kw)


def tiny_tendril(seed=0, **kw):
    torch.manual_seed(seed)
    return build_model(small_model_cfg(**kw))


# -- DPO ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reference", ["precomputed", "copy"])
def test_dpo_loss_is_log2_when_policy_is_reference(data, reference):
    policy = tiny_tendril()
    if reference == "copy": ref = ModelReference(policy)
    else: ref = PrecomputedReference(policy, {"val": PairDataset(data["dpo"], "val")}, SEQ, 20)
    batch = DPOLoader(data["dpo"], "val", 8, SEQ, reference=ref).next_batch()
    for beta in (0.05, 0.5):
        task = DPOTask(DPOConfig(beta=beta), ref)
        with torch.no_grad(): loss_sum, m = task.loss(policy, batch)
        assert int(task.count(batch)) == 8
        assert abs(loss_sum.item() / 8 - math.log(2)) < 1e-5
        assert abs(m["rewards/chosen"].item()) < 1e-3 and abs(m["rewards/rejected"].item()) < 1e-3


@pytest.mark.parametrize("beta", [0.1, 0.7])
def test_ipo_and_conservative_against_direct_formulas(beta):
    g = torch.Generator().manual_seed(1)
    pc, pr, rc, rr = (torch.randn(32, dtype=torch.float64, generator=g) * 4 for _ in range(4))
    h = (pc - rc) - (pr - rr)
    ipo = dpo_loss(pc, pr, rc, rr, beta, "ipo")[0]
    assert torch.allclose(ipo, (h - 1 / (2 * beta)) ** 2)
    eps = 0.15
    cons = dpo_loss(pc, pr, rc, rr, beta, "conservative", eps)[0]
    sig = torch.sigmoid(beta * h)
    assert torch.allclose(cons, -(1 - eps) * torch.log(sig) - eps * torch.log(1 - sig))
    plain = dpo_loss(pc, pr, rc, rr, beta, "sigmoid")[0]
    assert torch.allclose(plain, -torch.log(sig))
    with pytest.raises(ConfigError, match="label_smoothing"): DPOTask(DPOConfig(loss_type="conservative"), None)


def test_dpo_chosen_and_rejected_in_one_forward(data):
    policy = tiny_tendril()
    calls = []
    policy.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    ref = PrecomputedReference(copy.deepcopy(policy), {"val": PairDataset(data["dpo"], "val")}, SEQ, 20)
    batch = DPOLoader(data["dpo"], "val", 8, SEQ, reference=ref).next_batch()
    calls.clear()
    DPOTask(DPOConfig(), ref).loss(policy, batch)
    assert len(calls) == 1 and calls[0][0] == 16


def test_dpo_labels_cover_exactly_the_responses(data, tok):
    ds = PairDataset(data["dpo"], "val")
    b = DPOLoader(data["dpo"], "val", 4, SEQ, shuffle=False).next_batch()
    for row in range(8):
        i = int(b["pair_index"][row % 4])
        want = ds.ids("chosen" if row < 4 else "rejected", i).tolist()
        lab = b["labels"][row]
        assert lab[lab != IGNORE_INDEX].tolist() == want
        n_prompt = len(ds.ids("prompt", i))
        assert b["input_ids"][row, :n_prompt].tolist() == ds.ids("prompt", i).tolist()


def test_dpo_pairs_are_correct_vs_corrupted():
    for p in sample_preference_pairs(300, "val", seed=3):
        assert p["chosen"] != p["rejected"]
    ex = heldout_examples(5)
    assert all(split_of(e.task, e.key) == "dev" for e in ex) and {e.task for e in ex} == set(TASKS)


def test_preference_accuracy_prefers_what_training_prefers(data):
    policy = tiny_tendril()
    before = preference_accuracy(policy, data["dpo"], "val", seq_len=SEQ)
    ref = PrecomputedReference(policy, {"val": PairDataset(data["dpo"], "val")}, SEQ, 40)
    loader = DPOLoader(data["dpo"], "val", 20, SEQ, reference=ref)
    task, opt = DPOTask(DPOConfig(beta=0.5), ref), torch.optim.AdamW(policy.parameters(), lr=3e-3)
    for _ in range(8):
        loss_sum, _ = task.loss(policy, loader.next_batch())
        opt.zero_grad(); (loss_sum / 20).backward(); opt.step()
    after = preference_accuracy(policy, data["dpo"], "val", seq_len=SEQ)
    assert after["n"] == before["n"] == 40
    assert after["accuracy"] > before["accuracy"] + 0.1, (before, after)


# -- distillation ------------------------------------------------------------------------------------------------------
class _HFStudent(torch.nn.Module):
    "A student whose logits are the teacher's (restricted to `vocab` ids), behind the Tendril call signature."
    def __init__(self, hf, vocab): super().__init__(); self.hf, self.vocab = hf, vocab
    def forward(self, tokens, *, position_ids=None, doc_ids=None, **kw):
        return self.hf(input_ids=tokens, position_ids=position_ids, use_cache=False).logits[..., :self.vocab]


def _save_teacher(folder, vocab_size):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=SEQ)).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("extra", [0, 40])
def test_kl_is_zero_when_student_is_teacher(tmp_path, data, extra):
    teacher = load_teacher(_save_teacher(tmp_path/"teacher", VOCAB + extra))
    assert not teacher.training
    batch = SFTLoader(data["instruct"], "train", 2, SEQ).next_batch()
    task = DistillationTask(DistillationConfig(temperature=2.0, alpha=0.5), teacher, SFTTask(), student_vocab=VOCAB)
    loss_sum, m = task.loss(_HFStudent(teacher, VOCAB), batch)
    assert abs(m["distill/kl"].item()) < 1e-3 * task.count(batch).item()
    assert torch.allclose(loss_sum, 0.5 * m["distill/ce"] + 0.5 * m["distill/kl"])


def test_kl_against_direct_formula_and_temperature_scaling():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 6, 20, generator=g), torch.randn(3, 6, 20, generator=g)
    labels = torch.ones(3, 6, dtype=torch.long)
    for T in (1.0, 3.0):
        p = F.softmax(t / T, -1)
        direct = (p * (p.log() - F.log_softmax(s / T, -1))).sum() * T * T
        assert torch.allclose(distillation_kl(s, t, labels, T), direct, atol=1e-4)


def test_vocab_mismatch_refused_naming_both_sizes(tmp_path, tok):
    with pytest.raises(ConfigError,
                       match="700 tokens, fewer than the student's model.vocab_size = 768"): check_vocab(768, 700)
    other = init_tokenizer(TokenizerConfig(path=str(train_bpe([" ".join(reversed(WORDS))] * 40 + ["x y z"] * 20, 600,
                                                              tmp_path/"o"))))
    with pytest.raises(ConfigError, match="student vocab 600, teacher vocab 768"): check_vocab(600, 768, other, tok)
    with pytest.raises(ConfigError, match="distillation.teacher"): load_teacher(tmp_path/"missing")


# -- LoRA --------------------------------------------------------------------------------------------------------------
def test_merged_lora_logits_equal_unmerged_and_only_adapters_train():
    model = tiny_tendril()
    apply_lora(model,
               LoraConfig(rank=4, alpha=8, dropout=0.1, target_modules=["wq", "wk", "wv", "wo", "w1", "w2", "w3"]))
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"): p.normal_(std=0.05)
    model.eval()
    x = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        ref = model(x)
        merge_lora(model); merged = model(x)
        unmerge_lora(model); again = model(x)
    assert torch.allclose(merged, ref, atol=1e-5) and torch.allclose(again, ref, atol=1e-5)
    assert len(lora_state_dict(model)) == 2 * 7 * 2
    from gradient_garden.checkpoint.checkpoints import base_weights
    plain = tiny_tendril(seed=5)
    plain.load_state_dict(base_weights({"model": model.state_dict(), "config": {"lora": {"alpha": 8}}}, plain))
    with torch.no_grad(): assert torch.allclose(plain.eval()(x), ref, atol=1e-5)
    with torch.no_grad(): assert torch.allclose(merge_and_unload(model)(x), ref, atol=1e-5)


# -- SFT ---------------------------------------------------------------------------------------------------------------
def test_sft_mask_is_assistant_content_and_eot(tok):
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 4 + 4?"},
            {"role": "assistant", "content": "8"}, {"role": "user", "content": "Reverse 'ab'."},
            {"role": "assistant", "content": "ba"}]
    ids, mask, cuts = tokenize_chat(tok, chat)
    sup = [i for i, m in zip(ids, mask) if m]
    assert sup == tok.encode("8") + [tok.eot_id] + tok.encode("ba") + [tok.eot_id]
    assert len(cuts) == 2 and cuts[-1] == len(ids)
    ids1, _, _ = tokenize_chat(tok, chat, max_len=len(ids) - 1)
    assert ids1 == ids[:cuts[0]] and ids1[-1] == tok.eot_id


@pytest.mark.parametrize("packing", [True, False])
def test_loader_labels_are_only_assistant_tokens(data, tok, packing):
    from gradient_garden.stages.sft import SFTDataset
    ds = SFTDataset(data["instruct"], "train")
    supervised = set()
    for i in range(len(ds)):
        ids, mask = ds.example(i, int(ds.offsets[i + 1] - ds.offsets[i]))
        supervised |= {int(t) for t, m in zip(ids, mask) if m}
    loader = SFTLoader(data["instruct"], "train", 4, SEQ, packing=packing)
    for _ in range(5):
        b = loader.next_batch()
        lab = b["labels"]
        assert {int(t) for t in lab[lab != IGNORE_INDEX]} <= supervised
        assert tok.start_header_id not in lab.tolist() and tok.bos_id not in sum(lab.tolist(), [])
        if packing:
            for r in range(lab.shape[0]):
                d = b["doc_ids"][r]
                starts = torch.cat([torch.tensor([True]), d[1:] != d[:-1]])
                assert (b["position_ids"][r][starts] == 0).all()
                # the label of a document's last position is its own eot, never the next document's bos
                ends = torch.cat([d[1:] != d[:-1], torch.tensor([True])])
                assert all(int(x) in (tok.eot_id, IGNORE_INDEX) for x in lab[r][ends])
        else: assert "doc_ids" not in b


def test_packed_loss_equals_documents_alone(data):
    model = tiny_tendril().eval()
    b = SFTLoader(data["instruct"], "train", 2, SEQ).next_batch()
    task = SFTTask()
    with torch.no_grad():
        packed, _ = task.loss(model, b)
        alone = sum(task.loss(model, {"input_ids": b["input_ids"][r:r+1, b["doc_ids"][r] == d],
                                      "labels": b["labels"][r:r+1, b["doc_ids"][r] == d]})[0]
                    for r in range(2) for d in b["doc_ids"][r].unique())
    assert torch.allclose(packed, alone, rtol=1e-4)


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_ranks_are_disjoint_and_resume_is_exact(data, kind):
    make = (lambda **kw: SFTLoader(data["instruct"], "train", 4, SEQ, **kw)) if kind == "sft" else \
           (lambda **kw: DPOLoader(data["dpo"], "train", 4, SEQ, **kw))
    items = ((lambda b: {tuple(r) for r in b["input_ids"].tolist()}) if kind == "sft"
             else (lambda b: set(b["pair_index"].tolist())))
    r0, r1 = make(rank=0, world_size=2), make(rank=1, world_size=2)
    assert not set().union(*(items(r0.next_batch()) for _ in range(5))) & set().union(*(items(r1.next_batch())
                                                                                        for _ in range(5)))
    a = make()
    for _ in range(3): a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    want = [a.next_batch() for _ in range(40)]  # crosses an epoch boundary
    b = make(); b.load_state_dict(state)
    for x, y in zip(want, [b.next_batch() for _ in range(40)]): assert torch.equal(x["input_ids"], y["input_ids"])
    two = [make(rank=r, world_size=2) for r in (0, 1)]  # the 1-rank state continues on 2 ranks: the same next items
    for l in two: l.load_state_dict(state)
    assert items(two[0].next_batch()) | items(two[1].next_batch()) == items(want[0]) | items(want[1])
    old = {k: v for k, v in state.items() if k != "stream"} | {"world_size": 2}  # the per-rank loader of older versions
    with pytest.raises(ConfigError, match="older versions on 2 ranks.*--reset-loader"): make().load_state_dict(old)


def test_prepare_hooks_and_sources(data, tok, tmp_path, capsys):
    cfg = copy.deepcopy(data["cfg"]); cfg.paths.datasets = str(tmp_path)
    jsonl = tmp_path/"chats.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}."},
                                                      {"role": "assistant", "content": w}]}) + "\n"
                                                      for w in WORDS[:60]))
    spec = {"sources": [{"type": "json", "path": str(jsonl), "val_fraction": 0.2}]}
    args = Namespace(overwrite=False, progress=False)
    assert run_stage_prepare(get_stage("instruct"), cfg, spec, args) == 0
    assert run_stage_prepare(get_stage("instruct"), cfg, spec, args) == 0 and "up to date" in capsys.readouterr().out
    meta = json.loads((tmp_path/"instruct"/"train"/"meta.json").read_text())
    assert meta["tokenizer_identity"] == tok.identity and 40 <= meta["n_conversations"] < 60
    hub = tmp_path/"hub_dataset"; hub.mkdir()  # a dataset folder: the same load_dataset call as a hub id
    for split, words in (("train", WORDS[:50]), ("test", WORDS[50:60])):
        (hub/f"{split}.jsonl").write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"Say {w}."},
                                                                               {"from": "gpt", "value": w}]}) + "\n"
                                                                               for w in words))
    metas = prepare_instruct({"sources": [{"type": "hub", "path": str(hub), "split": "train", "val_split": "test",
                                           "column": "conversations"}]}, cfg, tmp_path/"hub_out", tok, progress=False)
    assert (metas["train"]["n_conversations"], metas["val"]["n_conversations"]) == (50, 10)
    pairs = tmp_path/"pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Say {w}.", "chosen": w, "rejected": w[::-1]}) + "\n"
                             for w in WORDS[:30]))
    assert run_stage_prepare(get_stage("dpo"), cfg,
                             {"sources": [{"type": "json", "path": str(pairs), "val_fraction": 0.3}]}, args) == 0
    with pytest.raises(ConfigError, match=r"data.sources\[0\].type"): run_stage_prepare(get_stage("dpo"), cfg,
                                                                                        {"sources": [{"type": "web"}]},
                                                                                        Namespace(overwrite=True))
    bad = tmp_path/"bad.jsonl"; bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(ConfigError, match="row 0"):
        prepare_instruct({"sources": [{"type": "json", "path": str(bad), "val_fraction": 0.0}]}, cfg, tmp_path/"x", tok,
                         progress=False)


# -- DPO under FSDP2 on two ranks
# ---------------------------------------------------------------------------------------
def _dpo_fsdp_worker(rank, world, dpo_dir, out_dir):
    from gradient_garden.parallel.distributed import apply_fsdp
    policy = apply_fsdp(tiny_tendril())
    ref = PrecomputedReference(policy, {"val": PairDataset(dpo_dir, "val")}, SEQ, 7, rank, world)
    loader = DPOLoader(dpo_dir, "val", 4, SEQ, rank, world, reference=ref)
    batch = loader.next_batch()
    loss_sum, _ = DPOTask(DPOConfig(beta=0.3), ref).loss(policy, batch)
    total = loss_sum.detach().clone(); dist.all_reduce(total)
    torch.save({"table": ref.table("val"), "loss": total, "pairs": batch["pair_index"]},
               os.path.join(out_dir, f"r{rank}.pt"))


@pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")
def test_dpo_reference_and_loss_under_fsdp2_match_one_process(data, tmp_path):
    run_ranks(_dpo_fsdp_worker, 2, tmp_path/"pg", str(data["dpo"]), str(tmp_path))
    r = [torch.load(tmp_path/f"r{i}.pt") for i in range(2)]
    policy = tiny_tendril()
    ds = PairDataset(data["dpo"], "val")
    one = PrecomputedReference(policy, {"val": ds}, SEQ, 20)
    assert torch.allclose(r[0]["table"], one.table("val"), atol=1e-3) and torch.equal(r[0]["table"], r[1]["table"])
    assert not set(r[0]["pairs"].tolist()) & set(r[1]["pairs"].tolist())
    from gradient_garden.stages.dpo import collate_pairs
    loss = 0.0
    for i in range(2):
        b = one.attach(collate_pairs(ds, r[i]["pairs"].numpy(), int(ds.meta["pad_id"]), SEQ), "val")
        loss += DPOTask(DPOConfig(beta=0.3), one).loss(policy, b)[0].item()
    assert abs(r[0]["loss"].item() - loss) < 1e-3 * abs(loss)


# -- exact resume of whole runs ----------------------------------------------------------------------------------------
def _run_cfg(data, stage, runs, steps=4, **over):
    d = {"training": {"stage": stage, "max_steps": steps, "micro_batch_size": 4, "seq_len": SEQ,
                      "total_batch_size": 4 * SEQ,
                      "log_every": 1, "seed": 7},
         "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": VOCAB, "max_seq_len": SEQ},
         "optimizers": {"adamw": {"warmup_steps": 1, "max_lr": 1e-3, "min_lr": 1e-4}},
         "validation": {"every": 2, "steps": 1}, "checkpointing": {"every": 2, "keep_last": 5},
         "generation": {"every": 0}, "evals": {"every": 0}, "runtime": {"device": "cpu"},
         "tokenizer": {"path": data["cfg"].tokenizer.path},
         "paths": {"datasets": data["cfg"].paths.datasets, "runs": str(runs)}}
    for k, v in over.items(): d.setdefault(k, {}).update(v)
    return from_plain(GlobalConfig, d)


def _losses(run_dir):
    recs = [json.loads(l) for l in (Path(run_dir)/"metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}, {r["step"]: r["val_loss"] for r in recs
                                                                 if "val_loss" in r}


@pytest.mark.parametrize("stage,over", [("instruct", {}), ("dpo", {}), ("dpo", {"dpo": {"reference": "copy"}})])
def test_resume_is_exact(data, tmp_path, stage, over):
    from gradient_garden.train.run import run_training
    full = _run_cfg(data, stage, tmp_path/"full", **over)
    run_training(full, checkpoint=None)
    ckpt = full.run_dir/"checkpoints"/"step_0000002.pt"
    resumed = _run_cfg(data, stage, tmp_path/"resumed", **over)
    run_training(resumed, checkpoint=ckpt)
    (a, va), (b, vb) = _losses(full.run_dir), _losses(resumed.run_dir)
    assert sorted(b) == [3, 4]
    for s in b: assert a[s] == b[s], (stage, s, a[s], b[s])
    assert va[4] == vb[4]


def test_sft_keeps_the_checkpoint_best_by_held_out_exact_match(data, tmp_path):
    "validation.metric: exact_match: SFT scores the held-out problems at every validation and ranks checkpoints by it."
    from gradient_garden.train.run import run_training
    from gradient_garden.checkpoint.checkpoints import list_checkpoints, load_checkpoint, resolve_checkpoint
    cfg = _run_cfg(data, "instruct", tmp_path, steps=6, validation={"metric": "exact_match"},
                   checkpointing={"keep_last": 1})
    run_training(cfg, checkpoint=None)
    recs = [json.loads(l) for l in (cfg.run_dir/"metrics.jsonl").read_text().splitlines()]
    em = {r["step"]: r["exact_match"] for r in recs if "exact_match" in r}
    assert sorted(em) == [2, 4, 6] and [r["step"] for r in recs].count(6) == 1   # the last step's, evaluated once
    top = max(em.values()); best_step = min(s for s in em if em[s] == top)      # the earliest on ties
    best = resolve_checkpoint(cfg.run_dir/"best")
    meta = load_checkpoint(best, weights=False)
    assert (meta["step"], meta["best_by"]) == (best_step, -top)
    assert {p.name for p in list_checkpoints(cfg.run_dir/"checkpoints")} == {best.name, "step_0000006.pt"}

