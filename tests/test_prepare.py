"Data preparation: sources, mixes, validation errors, shards, split, resume, tokenizer refusal, `gg prepare` flags."
import argparse, json, os, signal, subprocess, sys, time
from pathlib import Path

import numpy as np
import pyarrow as pa, pyarrow.parquet as pq
import pytest

from gradient_garden.config import ConfigError, TokenizerConfig
from gradient_garden.tokenizer import ensure_tokenizer
from gradient_garden.data import prepare as P
from gradient_garden.data.prepare import (DEFAULT_PRETRAINING_DATA, SourceStream, is_validation,
                                          parse_pretraining_data, parse_source, prepare_pretraining)
from gradient_garden.cli.prepare import add_prepare_args, run_prepare

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    "A 1k-token BPE trained on the pydoc topics (a few seconds)."
    topics = [r["text"] for r in P.pydoc_topics()]
    return ensure_tokenizer(TokenizerConfig(path=str(tmp_path_factory.mktemp("tok") / "bpe-1k")), lambda: topics,
                            vocab_size=1024)


@pytest.fixture(scope="module")
def other_tok(tmp_path_factory):
    "A different 1k-token BPE (another identity)."
    texts = [Path(f).read_text(errors="replace") for f in P.stdlib_files()[:30]]
    return ensure_tokenizer(TokenizerConfig(path=str(tmp_path_factory.mktemp("tok2") / "bpe-other")), lambda: texts,
                            vocab_size=1024)


def docs_corpus(n=300, seed=0):
    "Distinct made-up documents of varied length."
    rng = np.random.default_rng(seed)
    words = "the garden grows tokens from text while loaders read windows of numbers every step".split()
    return [f"doc {i}: " + " ".join(rng.choice(words, size=int(rng.integers(5, 400)))) for i in range(n)]


def write_jsonl(path, docs, field="text"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))
    return path


def error_of(f, *a, **kw):
    with pytest.raises(ConfigError) as e: f(*a, **kw)
    return str(e.value)


def cli(*argv):
    return run_prepare(add_prepare_args(argparse.ArgumentParser()).parse_args([str(a) for a in argv]))


def read_split_docs(out_dir, tok, split):
    "Decode every document of a split back to text (split at end-of-document tokens)."
    meta = json.loads((out_dir / "meta.json").read_text())
    ids = np.concatenate([np.fromfile(out_dir / sh["file"], meta["dtype"]) for sh in meta["splits"][split]["shards"]]
                         or [np.zeros(0, int)])
    ends = np.flatnonzero(ids == tok.eos_id)
    starts = np.r_[0, ends[:-1] + 1]
    starts = starts + (ids[starts] == tok.bos_id) if len(ends) else starts   # each document begins with BOS
    return [tok.decode(ids[s:e].tolist()) for s, e in zip(starts, ends)]


# ---------------------------------------------------------------- validation errors (one message each)

BASE = {"mix": [{"type": "embedded", "corpus": "pydoc-topics"}]}

@pytest.mark.parametrize("data, message", [
    ({**BASE, "targets": 5}, "data.targets: unknown key; allowed keys here are mix, target_tokens, val_fraction, "
                             "shard_tokens, max_missing_fraction"),
    ({"target_tokens": 5}, "data.mix: missing; list the sources to prepare"),
    ({"mix": []}, "data.mix: got []; expected a non-empty list of sources"),
    ({"mix": "stdlib"}, "data.mix: got 'stdlib'; expected a non-empty list of sources"),
    ({"mix": ["stdlib"]}, "data.mix[0]: got 'stdlib'; expected a mapping with a 'type' key"),
    ({"mix": [{"type": "s3", "path": "x"}]}, "data.mix[0].type: got 's3'; expected one of 'hub', 'local', 'embedded'"),
    ({"mix": [{"corpus": "pydoc-topics"}]}, "data.mix[0].type: got None; expected one of 'hub', 'local', 'embedded'"),
    ({"mix": [{"type": "hub", "split": "train"}]}, "data.mix[0].path: missing; a hub source needs it"),
    ({"mix": [{"type": "local"}]}, "data.mix[0].files: missing; a local source needs it"),
    ({"mix": [{"type": "embedded"}]}, "data.mix[0].corpus: missing; a embedded source needs it"),
    ({"mix": [{"type": "embedded", "corpus": "wikipedia"}]},
     "data.mix[0].corpus: got 'wikipedia' (str); expected one of 'python-stdlib', 'pydoc-topics'"),
    ({"mix": [{"type": "embedded", "corpus": "pydoc-topics", "weight": 0}]},
     "data.mix[0].weight: got 0.0; must be a number > 0"),
    ({"mix": [{"type": "embedded", "corpus": "pydoc-topics", "weight": -2}]},
     "data.mix[0].weight: got -2.0; must be a number > 0"),
    ({"mix": [{"type": "embedded", "corpus": "pydoc-topics", "weight": float("nan")}]},
     "data.mix[0].weight: got nan; must be a number > 0"),
    ({"mix": [{"type": "embedded", "corpus": "pydoc-topics", "weight": "high"}]},
     "data.mix[0].weight: got 'high' (str); expected float"),
    ({"mix": [{"type": "embedded", "corpus": "pydoc-topics", "weight": True}]},
     "data.mix[0].weight: got True (bool); expected float"),
    ({"mix": [{"type": "hub", "path": "org/ds", "files": ["a"]}]},
     "data.mix[0].files: unknown key; allowed keys here are path, type, name, weight, config, split, revision, "
     "text_field"),
    ({**BASE, "target_tokens": 0}, "data.target_tokens: got 0; must be > 0"),
    ({**BASE, "target_tokens": 1.5e6}, "data.target_tokens: got 1500000.0 (float); expected int"),
    ({**BASE, "val_fraction": -0.1}, "data.val_fraction: got -0.1; must be in [0, 0.5]"),
    ({**BASE, "val_fraction": 0.75}, "data.val_fraction: got 0.75; must be in [0, 0.5]"),
    ({**BASE, "shard_tokens": 100}, "data.shard_tokens: got 100; must be >= 1024"),
    ({"mix": [{"type": "embedded", "corpus": "pydoc-topics"},
              {"type": "embedded", "corpus": "pydoc-topics", "weight": 2}]},
     "data.mix[1].name: got 'pydoc-topics'; already used by mix[0] (names must be unique)"),
    ({"mix": [{"type": "local", "files": "/nonexistent/dir/*.jsonl"}]},
     "data.mix[0].files: '/nonexistent/dir/*.jsonl' matches no file"),
    ({"mix": [{"type": "local", "files": []}]}, "data.mix[0].files: got []; expected at least one path or pattern"),
    ({"mix": [{"type": "local", "files": "x", "sample_by": "sentence"}]},
     "data.mix[0].sample_by: got 'sentence' (str); expected one of 'document', 'paragraph', 'line'"),
    ("mix", "data: got 'mix'; expected a mapping with a 'mix' list"),
])
def test_data_section_errors(data, message):
    assert error_of(parse_pretraining_data, data) == message


def test_unknown_format_is_an_error(tmp_path):
    (tmp_path / "corpus.csv").write_text("a,b\n")
    assert error_of(parse_pretraining_data, {"mix": [{"type": "local", "files": str(tmp_path / "*.csv")}]}) == (
        f"data.mix[0].format: cannot tell the format of '{tmp_path}/corpus.csv' from its extension; "
        "set format to one of 'text', 'json', 'parquet'")


def test_formats_inferred_from_extension(tmp_path):
    for name, fmt in [("a.txt", "text"), ("b.jsonl", "json"), ("c.json.gz", "json"), ("d.parquet", "parquet"),
                      ("e.md", "text")]:
        (tmp_path / name).write_bytes(b"")
        assert parse_source({"type": "local", "files": str(tmp_path / name)}, "m").format == fmt


def test_mix_file_errors(tmp_path):
    p = tmp_path / "mix.json"
    assert error_of(P.load_mix_file, p) == f"--mix-file {p}: file not found"
    p.write_text("[1, 2]")
    assert error_of(P.load_mix_file, p) == f"--mix-file {p}: expected a JSON object with a 'mix' list, got list"
    p.write_text("{'mix': []}")
    assert error_of(P.load_mix_file, p).startswith(f"--mix-file {p}: not valid JSON: Expecting property name")
    p.write_text(json.dumps({"mix": [{"type": "embedded", "corpus": "pydoc-topics", "wait": 1}]}))
    assert error_of(cli, "--pretraining", "--mix-file", p) == (
        f"{p}: mix[0].wait: unknown key; allowed keys here are corpus, type, name, weight")


def test_example_mix_file_is_valid():
    p = REPO / "examples" / "pretraining_data_mix.example.json"
    spec = P.parse_mix_file_data(P.load_mix_file(p), p)
    assert [s.type for s in spec.mix] == ["hub", "embedded", "embedded"]


def test_recipe_data_section_is_valid():
    import yaml
    data = yaml.safe_load((REPO / "recipes" / "pretraining" / "debug.yaml").read_text())["data"]
    spec = parse_pretraining_data(data)
    assert spec.target_tokens == DEFAULT_PRETRAINING_DATA["target_tokens"] and [s.name
                                                                                for s in spec.mix] == ["python-stdlib",
                                                                                                       "pydoc-topics"]


# ---------------------------------------------------------------- sources through the datasets code path

def test_hub_path_through_local_dataset_folder(tmp_path):
    "The hub code path (`load_dataset(path, config, split=..., streaming=True)`) on a local parquet folder."
    docs = docs_corpus(30)
    folder = tmp_path / "org__corpus" / "data"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"content": docs, "n": list(range(30))}), folder / "train-00000-of-00001.parquet")
    src = parse_source({"type": "hub", "path": str(tmp_path / "org__corpus"), "split": "train",
                        "text_field": "content"}, "data.mix[0]")
    got = []
    s = SourceStream(src)
    while (batch := s.take(500)): got += batch
    assert got == docs and s.exhausted


def test_hub_missing_dataset_is_an_error(tmp_path):
    src = parse_source({"type": "hub", "path": str(tmp_path / "missing")}, "data.mix[0]")
    assert error_of(SourceStream, src).startswith(f"data.mix[0].path: cannot open '{tmp_path}/missing' (config=None, "
                                                  "split='train'): ")


def test_wrong_text_field_names_the_columns(tmp_path, tok):
    write_jsonl(tmp_path / "c.jsonl", ["a", "b"], field="body")
    spec = parse_pretraining_data({"target_tokens": 100,
                                   "mix": [{"type": "local", "files": str(tmp_path / "c.jsonl"), "text_field": "txt"}]})
    assert error_of(prepare_pretraining, spec, tok, tmp_path / "out", progress=False) == (
        "data.mix[0].text_field: got 'txt'; the rows of 'c' have the columns 'id', 'body'")


def test_non_text_field_is_an_error(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", [1, 2])
    src = parse_source({"type": "local", "files": str(tmp_path / "c.jsonl")}, "data.mix[0]")
    assert error_of(SourceStream(src).take, 10) == "data.mix[0].text_field: column 'text' holds int, not text"


@pytest.mark.parametrize("sample_by, n", [("document", 2), ("line", 6), ("paragraph", 4)])
def test_local_text_files(tmp_path, sample_by, n):
    for k in range(2): (tmp_path / f"f{k}.txt").write_text("one\ntwo\n\nthree\n")
    s = SourceStream(parse_source({"type": "local", "files": str(tmp_path / "*.txt"), "sample_by": sample_by}, "m"))
    assert len(s.take(10**9)) == n


def test_embedded_corpora_are_documents():
    stdlib = SourceStream(parse_source({"type": "embedded", "corpus": "python-stdlib"}, "m"))
    first = stdlib.take(1)
    assert len(first) == 1 and first[0] == Path(P.stdlib_files()[0]).read_text(errors="replace")
    topics = SourceStream(parse_source({"type": "embedded", "corpus": "pydoc-topics"}, "m")).take(10**9)
    assert len(topics) == len([t for t in P.pydoc_topics() if t["text"]])


# ---------------------------------------------------------------- shards, split, mix

def test_every_document_once_in_its_hash_split(tmp_path, tok):
    "With a budget above the corpus, every document lands exactly once, in the split its hash decides."
    docs = docs_corpus(300)
    write_jsonl(tmp_path / "a" / "a.jsonl", docs[:200]); write_jsonl(tmp_path / "b" / "b.jsonl", docs[200:])
    spec = parse_pretraining_data({"target_tokens": 10**8, "val_fraction": 0.2, "shard_tokens": 2048, "mix": [
        {"type": "local", "files": str(tmp_path / "a" / "*.jsonl"), "weight": 1},
        {"type": "local", "files": str(tmp_path / "b" / "*.jsonl"), "weight": 1}]})
    out = tmp_path / "out"
    meta = prepare_pretraining(spec, tok, out, progress=False)
    train, val = read_split_docs(out, tok, "train"), read_split_docs(out, tok, "val")
    assert sorted(train + val) == sorted(docs)
    assert sorted(val) == sorted(d for d in docs if is_validation(d.encode(), 0.2))
    assert meta["documents"] == 300 and all(c["exhausted"] for c in meta["sources"].values())
    assert meta["splits"]["train"]["n_tokens"] + meta["splits"]["val"]["n_tokens"] == meta["n_tokens"]
    sizes = [sh["n_tokens"] for sh in meta["splits"]["train"]["shards"]]
    assert all(s == 2048 for s in sizes[:-1]) and 0 < sizes[-1] <= 2048
    assert meta["dtype"] == "uint16" and meta["tokenizer"]["identity"] == tok.identity


def test_mix_weights_and_budget(tmp_path, tok):
    write_jsonl(tmp_path / "a.jsonl", docs_corpus(400, seed=1)); write_jsonl(tmp_path / "b.jsonl",
                                                                             docs_corpus(400, seed=2))
    spec = parse_pretraining_data({"target_tokens": 30_000, "val_fraction": 0.0, "mix": [
        {"type": "local", "files": str(tmp_path / "a.jsonl"), "weight": 3},
        {"type": "local", "files": str(tmp_path / "b.jsonl"), "weight": 1}]})
    meta = prepare_pretraining(spec, tok, tmp_path / "out", progress=False, batch_chars=4096)
    a, b = meta["sources"]["a"]["tokens"], meta["sources"]["b"]["tokens"]
    assert 30_000 <= a + b < 30_000 + 2_000
    assert abs(a / (a + b) - 0.75) < 0.03
    assert meta["splits"]["val"]["n_tokens"] == 0


def test_uint32_when_vocab_is_large():
    assert P.token_dtype(65_536) == "uint16" and P.token_dtype(65_537) == "uint32"


def test_budget_too_large_uses_what_exists(tmp_path, tok):
    write_jsonl(tmp_path / "a.jsonl", docs_corpus(20))
    spec = parse_pretraining_data({"target_tokens": 10**9,
                                   "mix": [{"type": "local", "files": str(tmp_path / "a.jsonl")}]})
    meta = prepare_pretraining(spec, tok, tmp_path / "out", progress=False)
    assert meta["documents"] == 20 and meta["sources"]["a"]["exhausted"]


# ---------------------------------------------------------------- tokenizer identity, layout, tampering

def small_spec(tmp_path, **kw):
    write_jsonl(tmp_path / "src" / "c.jsonl", docs_corpus(200))
    return parse_pretraining_data({"target_tokens": 20_000, "shard_tokens": 4096, "val_fraction": 0.1,
                                   "mix": [{"type": "local", "files": str(tmp_path / "src" / "c.jsonl")}], **kw})


def test_refuses_another_tokenizer(tmp_path, tok, other_tok):
    spec, out = small_spec(tmp_path), tmp_path / "out"
    prepare_pretraining(spec, tok, out, progress=False)
    msg = error_of(prepare_pretraining, spec, other_tok, out, progress=False)
    assert msg == (f"{out}: the shards there were made by tokenizer 'bpe-1k' ({tok.identity}), not by the configured "
                   f"'bpe-other' ({other_tok.identity}); use --overwrite or another paths.datasets")
    (out / "progress.json").unlink()        # even without progress, meta.json still names the tokenizer
    assert error_of(prepare_pretraining, spec, other_tok, out, progress=False) == msg
    meta = prepare_pretraining(spec, other_tok, out, progress=False, overwrite=True)
    assert meta["tokenizer"]["identity"] == other_tok.identity


def test_refuses_another_layout(tmp_path, tok):
    spec, out = small_spec(tmp_path), tmp_path / "out"
    prepare_pretraining(spec, tok, out, progress=False)
    spec.val_fraction = 0.3
    assert error_of(prepare_pretraining, spec, tok, out, progress=False) == (
        f'{out}: was prepared with a different val_fraction (recorded: {{"val_fraction": 0.1}}); use --overwrite or '
        'another paths.datasets')


def test_refuses_shards_changed_by_hand(tmp_path, tok):
    spec, out = small_spec(tmp_path), tmp_path / "out"
    prepare_pretraining(spec, tok, out, progress=False)
    os.truncate(out / "train" / "shard_00000.bin", 10)
    spec.target_tokens = 40_000
    assert error_of(prepare_pretraining, spec, tok, out, progress=False) == (
        f"{out}/train/shard_00000.bin: holds 5 tokens but progress.json recorded 4096; "
        "the folder was changed by hand; rerun with --overwrite")


def test_rerun_is_idempotent_and_budget_extends(tmp_path, tok):
    spec, out = small_spec(tmp_path), tmp_path / "out"
    first = prepare_pretraining(spec, tok, out, progress=False)
    stamp = (out / "train" / "shard_00000.bin").stat().st_mtime_ns
    again = prepare_pretraining(spec, tok, out, progress=False)
    assert again["n_tokens"] == first["n_tokens"] and again["up_to_date"]
    assert (out / "train" / "shard_00000.bin").stat().st_mtime_ns == stamp
    spec.target_tokens = 40_000
    more = prepare_pretraining(spec, tok, out, progress=False)
    fresh = prepare_pretraining(spec, tok, tmp_path / "fresh", progress=False)
    for split in ("train", "val"):
        assert read_split_docs(out, tok, split) == read_split_docs(tmp_path / "fresh", tok, split)
    assert more["n_tokens"] == fresh["n_tokens"] >= 40_000


# ---------------------------------------------------------------- resume after interruption

def shard_bytes(out):
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.glob("*/shard_*.bin"))}


def test_resume_after_exception_matches_uninterrupted(tmp_path, tok, monkeypatch):
    "Crash in the middle (after uncommitted writes): the resumed folder is byte-identical to an uninterrupted one."
    spec = small_spec(tmp_path)
    ref = prepare_pretraining(spec, tok, tmp_path / "ref", progress=False, batch_chars=2000, commit_tokens=3000)
    real, calls = P.encode_documents, {"n": 0}
    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 9: raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(P, "encode_documents", flaky)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare_pretraining(spec, tok, out, progress=False, batch_chars=2000, commit_tokens=3000)
    assert not (out / "meta.json").exists()
    progress = json.loads((out / "progress.json").read_text())
    assert 0 < sum(progress["n_tokens"].values()) < ref["n_tokens"]
    monkeypatch.setattr(P, "encode_documents", real)
    meta = prepare_pretraining(spec, tok, out, progress=False, batch_chars=2000, commit_tokens=3000)
    assert shard_bytes(out) == shard_bytes(tmp_path / "ref")
    assert {k: v for k, v in meta.items() if k != "elapsed_s"} == {k: v for k, v in ref.items() if k != "elapsed_s"}


CHILD = """
import sys
from gradient_garden.config import TokenizerConfig
from gradient_garden.tokenizer import init_tokenizer
from gradient_garden.data.prepare import parse_pretraining_data, prepare_pretraining
import json
spec = parse_pretraining_data(json.loads(sys.argv[1]))
tok = init_tokenizer(TokenizerConfig(path=sys.argv[2]))
prepare_pretraining(spec, tok, sys.argv[3], progress=False, batch_chars=4000, commit_tokens=16384)
"""

def test_resume_after_sigkill(tmp_path, tok):
    ("SIGKILL a real run after its first commits; resuming gives the same bytes as an uninterrupted run, no document "
     "lost or repeated.")
    docs = docs_corpus(1000, seed=5)
    write_jsonl(tmp_path / "big.jsonl", docs)
    data = {"target_tokens": 10**8, "val_fraction": 0.1, "shard_tokens": 8192,
            "mix": [{"type": "local", "files": str(tmp_path / "big.jsonl")}]}
    spec = parse_pretraining_data(data)
    ref = prepare_pretraining(spec, tok, tmp_path / "ref", progress=False, batch_chars=4000, commit_tokens=16384)
    out = tmp_path / "out"
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(data), tok.path, str(out)])
    deadline = time.time() + 60
    while time.time() < deadline and child.poll() is None:
        p = out / "progress.json"
        if p.exists() and sum(json.loads(p.read_text())["n_tokens"].values()) > 40_000: break
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL); child.wait()
    assert not (out / "meta.json").exists(), "the child finished before it could be killed"
    prepare_pretraining(spec, tok, out, progress=False, batch_chars=4000, commit_tokens=16384)
    assert shard_bytes(out) == shard_bytes(tmp_path / "ref")
    assert sorted(read_split_docs(out, tok, "train") + read_split_docs(out, tok, "val")) == sorted(docs)
    assert ref["documents"] == len(docs)


# ---------------------------------------------------------------- gg prepare flags

def test_cli_stage_flag_with_recipe_is_an_error(tmp_path):
    assert error_of(cli, "--recipe", REPO / "recipes" / "pretraining" / "debug.yaml", "--instruct") == (
        "--instruct cannot be combined with --recipe: the recipe defines the training stage")


def test_cli_two_stage_flags_is_a_usage_error():
    with pytest.raises(SystemExit):
        add_prepare_args(argparse.ArgumentParser()).parse_args(["--pretraining", "--dpo"])


def test_cli_rl_flag_prepares_the_embedded_prompts(tmp_path, tok):
    "`gg prepare --rl` (no recipe): the embedded verifiable prompts, train and held-out, where the rl stage reads them."
    from gradient_garden.stages.rl import read_prompts
    assert cli("--rl", "--set", f"tokenizer.path={tok.path}", f"paths.datasets={tmp_path}") == 0
    folders = sorted({f.parent for f in (tmp_path / "rl").rglob("prompts.jsonl")})
    assert folders and all(read_prompts(f) for f in folders)
    assert {e.kind for f in folders for e in read_prompts(f)} == {"verifiable"}


def test_cli_stage_prepare_gets_config_data_and_flags(tmp_path, monkeypatch, tok):
    ("`gg prepare --instruct` hands the stage's `prepare` the config, the data section (with `--set data.*`) and the "
     "flags.")
    import dataclasses
    from gradient_garden.stages import registry
    seen = {}
    def fake(cfg, data, overwrite, progress):
        seen.update(stage=cfg.training.stage, data=data, overwrite=overwrite)
        return dict(path=tmp_path/"instruct", up_to_date=True, tokenizer="t")
    monkeypatch.setitem(registry.STAGES, "instruct", dataclasses.replace(registry.STAGES["instruct"], prepare=fake))
    (tmp_path / "m.json").write_text(json.dumps({"tasks": ["arith"]}))
    assert cli("--instruct", "--mix-file", tmp_path / "m.json", "--set", "data.n=3", f"tokenizer.path={tok.path}",
               "--overwrite") == 0
    assert seen == {"stage": "instruct", "data": {"tasks": ["arith"], "n": 3}, "overwrite": True}


def test_every_stage_prepares_its_data_or_reads_token_shards():
    from gradient_garden.stages.registry import STAGES
    assert {name: s.prepare is not None for name, s in STAGES.items()} == {"pretraining": False, "instruct": True,
                                                                           "dpo": True, "rl": True}
    assert all(callable(s.prepare) for s in STAGES.values() if s.prepare)


def test_cli_bad_override(tmp_path, tok):
    assert error_of(cli, "--pretraining", "--set",
                    "data.mix=[]") == "data.mix: got []; expected a non-empty list of sources"
    assert error_of(cli, "--pretraining", "--set", "model.vocab_sise=3").startswith("model.vocab_sise: unknown key")


def test_cli_debug_recipe_trains_tokenizer_and_prepares(tmp_path, monkeypatch, capsys):
    ("`gg prepare --recipe recipes/pretraining/debug.yaml` (smaller budget): trains the BPE when missing, writes the "
     "shards.")
    monkeypatch.chdir(tmp_path)
    rc = cli("--recipe", REPO / "recipes" / "pretraining" / "debug.yaml", "--no-progress", "--set",
             "data.target_tokens=100000")
    assert rc == 0
    meta = json.loads((tmp_path / "data" / "datasets" / "pretraining" / "meta.json").read_text())
    assert (tmp_path / "data" / "tokenizers" / "garden-bpe-4k" / "tokenizer.json").is_file()
    assert (meta["tokenizer"]["vocab_size"] == 4096 and 100_000 <= meta["n_tokens"]
            and meta["splits"]["val"]["n_tokens"] > 0)
    assert "prepared data/datasets/pretraining:" in capsys.readouterr().out
    assert cli("--recipe", REPO / "recipes" / "pretraining" / "debug.yaml", "--set", "data.target_tokens=100000") == 0
    assert capsys.readouterr().out.startswith("data/datasets/pretraining is up to date (")


def test_hub_unknown_split_is_an_error(tmp_path):
    write_jsonl(tmp_path / "ds" / "train.jsonl", ["a doc"])
    src = parse_source({"type": "hub", "path": str(tmp_path / "ds"), "split": "validation"}, "data.mix[0]")
    msg = error_of(lambda: SourceStream(src).take(10))
    assert (msg.startswith(f"data.mix[0].path: cannot open '{tmp_path}/ds' (config=None, split='validation'): ")
            and "validation" in msg)


def test_cli_warns_when_sources_run_out(tmp_path, tok, capsys):
    write_jsonl(tmp_path / "a.jsonl", docs_corpus(10))
    (tmp_path / "m.json").write_text(json.dumps({"target_tokens": 10**7,
                                                 "mix": [{"type": "local", "files": str(tmp_path / "a.jsonl")}]}))
    assert cli("--pretraining", "--no-progress", "--mix-file", tmp_path / "m.json", "--set",
               f"paths.datasets={tmp_path}/d",
               f"tokenizer.path={tok.path}", "model.vocab_size=1024") == 0
    err = capsys.readouterr().err
    assert "note: every source ran out at" in err and "below data.target_tokens = 10,000,000" in err


def test_half_recipes_keep_rl_prompts_out_of_the_sft_data(tmp_path, tok):
    ("`recipes/instruct/debug-half.yaml` and `recipes/rl/debug-unseen-half.yaml` prepare disjoint halves of the train "
     "problems: no RL prompt is a user turn of the SFT conversations.")
    from gradient_garden.data.verifiable import sample_conversations
    from gradient_garden.recipes import load_recipe
    from gradient_garden.stages.rl import read_prompts
    sets = ["--set", f"tokenizer.path={tok.path}", f"paths.datasets={tmp_path}"]
    for recipe in ("instruct/debug-half.yaml", "rl/debug-unseen-half.yaml"):
        assert cli("--recipe", REPO / "recipes" / recipe, "--no-progress", *sets) == 0
    sft = load_recipe(REPO / "recipes" / "instruct" / "debug-half.yaml").data["sources"][0]
    assert json.loads((tmp_path / "instruct" / "train" / "meta.json").read_text())["sources"][0]["train_half"] == 0
    convs = sample_conversations(sft["train"], "train", None, sft["seed"], sft["max_turns"], sft["system_prob"],
                                 sft["train_half"])
    seen = {m["content"] for c in convs for m in c if m["role"] == "user"}
    prompts = {p.prompt for p in read_prompts(tmp_path / "rl" / "train")}
    assert len(seen) > 1000 and len(prompts) > 1000 and not seen & prompts
