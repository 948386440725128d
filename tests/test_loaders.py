"Pretraining loader: windows, order, disjoint ranks, exact resume, fixed validation, refusals, speed."
import io, json, time
from pathlib import Path

import numpy as np
import pytest
import torch

from gradient_garden.config import ConfigError, TokenizerConfig
from gradient_garden.tokenizer import ensure_tokenizer
from gradient_garden.data import prepare as P
from gradient_garden.data.loaders import PretrainLoader, load_meta
from gradient_garden.data.prepare import write_json_atomic


def toy_folder(root, sizes=(3000, 3000, 3000, 1000), val_sizes=(2000,), dtype="uint32", identity="toy-1"):
    "A prepared folder whose token ids are their global positions (shards of the given sizes)."
    root = Path(root)
    splits = {}
    for split, ss in (("train", sizes), ("val", val_sizes)):
        shards, pos = [], 0
        (root / split).mkdir(parents=True, exist_ok=True)
        for k, n in enumerate(ss):
            f = root / split / f"shard_{k:05d}.bin"
            np.arange(pos, pos + n, dtype=dtype).tofile(f)
            shards.append({"file": f"{split}/{f.name}", "n_tokens": n})
            pos += n
        splits[split] = {"n_tokens": pos, "shards": shards}
    write_json_atomic(root / "meta.json", {"format": "gradient-garden-shards", "version": 2, "dtype": dtype,
                                           "tokenizer": {"identity": identity, "name": "toy"}, "splits": splits})
    return root


@pytest.fixture
def toy(tmp_path):
    return toy_folder(tmp_path / "toy")


def error_of(f, *a, **kw):
    with pytest.raises(ConfigError) as e: f(*a, **kw)
    return str(e.value)


def starts(loader, n):
    "Token id at the start of every window served in `n` batches (the global position of the window)."
    return torch.cat([loader.next_batch()["input_ids"][:, 0] for _ in range(n)]).tolist()


def valid_starts(sizes, seq_len):
    out, pos = set(), 0
    for n in sizes:
        out |= {pos + k * seq_len for k in range((n - 1) // seq_len)}
        pos += n
    return out


# ---------------------------------------------------------------- windows

def test_batch_shapes_and_labels(toy):
    b = PretrainLoader(toy, "train", batch_size=4, seq_len=16).next_batch()
    assert set(b) == {"input_ids", "labels"}
    assert b["input_ids"].shape == b["labels"].shape == (4, 16) and b["input_ids"].dtype == torch.long
    assert torch.equal(b["labels"][:, :-1], b["input_ids"][:, 1:])
    assert torch.equal(b["labels"][:, -1], b["input_ids"][:, -1] + 1)
    assert torch.equal(b["input_ids"], b["input_ids"][:, :1] + torch.arange(16))   # contiguous tokens of one shard


@pytest.mark.parametrize("world_size, batch_size", [(1, 7), (2, 5), (3, 4)])
def test_one_epoch_covers_every_window_once_disjoint_across_ranks(toy, world_size, batch_size):
    loaders = [PretrainLoader(toy, "train", batch_size, 8, rank=r, world_size=world_size, seed=11)
               for r in range(world_size)]
    n = loaders[0].n_windows
    assert n == len(valid_starts((3000, 3000, 3000, 1000), 8))
    steps = n // (batch_size * world_size)
    seen = [starts(l, steps) for l in loaders]
    flat = sum(seen, [])
    assert len(flat) == len(set(flat)) == steps * batch_size * world_size
    assert set(flat) <= valid_starts((3000, 3000, 3000, 1000), 8)
    for a in range(world_size):
        for b in range(a + 1, world_size): assert not set(seen[a]) & set(seen[b])


def test_two_epochs_each_cover_everything(toy):
    loader = PretrainLoader(toy, "train", 1, 100, seed=0)
    n = loader.n_windows
    e0, e1 = starts(loader, n), starts(loader, n)
    assert sorted(e0) == sorted(e1) == sorted(valid_starts((3000, 3000, 3000, 1000), 100))
    assert e0 != e1 and loader.state_dict()["epoch"] == 2


def test_order_is_a_function_of_the_seed(toy):
    a, b, c = (PretrainLoader(toy, "train", 8, 8, seed=s) for s in (5, 5, 6))
    sa, sb, sc = starts(a, 20), starts(b, 20), starts(c, 20)
    assert sa == sb and sa != sc


def test_windows_shuffled_within_shards(toy):
    s = starts(PretrainLoader(toy, "train", 16, 8, seed=0), 1)
    assert s != sorted(s)


def test_shards_smaller_than_a_window_are_skipped(tmp_path):
    d = toy_folder(tmp_path / "t", sizes=(500, 5, 500))
    loader = PretrainLoader(d, "train", 2, 16)
    assert loader.counts.tolist() == [31, 0, 31]
    got = starts(loader, 31)
    assert sorted(got) == sorted(valid_starts((500, 5, 500), 16))


# ---------------------------------------------------------------- resume

def roundtrip(state):
    buf = io.BytesIO(); torch.save({"loader": state}, buf); buf.seek(0)
    return torch.load(buf, weights_only=True)["loader"]


def test_state_is_plain_and_resume_is_exact_across_epochs(toy):
    ref = PretrainLoader(toy, "train", 6, 32, seed=3)
    for _ in range(13): ref.next_batch()
    state = roundtrip(ref.state_dict())
    assert all(isinstance(v, (int, str)) for v in state.values())
    want = [ref.next_batch()["input_ids"] for _ in range(2 * ref.n_windows // 6)]   # two more epochs
    got = PretrainLoader(toy, "train", 6, 32, seed=3)
    got.load_state_dict(state)
    for w in want: assert torch.equal(got.next_batch()["input_ids"], w)
    assert got.state_dict() == ref.state_dict()


def test_resume_on_another_world_size(toy):
    "The state is the same on every rank: 1 rank x 8 resumes as 2 ranks x 4 on exactly the next windows."
    one = PretrainLoader(toy, "train", 8, 16, seed=9)
    for _ in range(5): one.next_batch()
    state = roundtrip(one.state_dict())
    nxt = one.next_batch()["input_ids"]
    two = [PretrainLoader(toy, "train", 4, 16, rank=r, world_size=2, seed=9) for r in range(2)]
    for l in two: l.load_state_dict(state)
    assert torch.equal(torch.cat([l.next_batch()["input_ids"] for l in two]), nxt)
    assert two[0].state_dict() == two[1].state_dict() == one.state_dict()


@pytest.mark.parametrize("change, key",
                         [({"seq_len": 32}, "seq_len"), ({"seed": 1}, "seed"), ({"split": "val"}, "split")])
def test_state_from_another_setup_is_refused(toy, change, key):
    kw = dict(data_dir=toy, split="train", batch_size=2, seq_len=16, seed=0)
    state = PretrainLoader(**kw).state_dict()
    other = PretrainLoader(**{**kw, **change})
    msg = error_of(other.load_state_dict, state)
    assert msg == (f"loader state: {key} is {state[key]!r} in the checkpoint but {getattr(other, key)!r} now; the "
                   "saved position would point elsewhere")


def test_state_from_other_data_is_refused(tmp_path):
    state = PretrainLoader(toy_folder(tmp_path / "a"), "train", 2, 16).state_dict()
    other = PretrainLoader(toy_folder(tmp_path / "b", sizes=(3000, 3000)), "train", 2, 16)
    assert error_of(other.load_state_dict, state) == (
        f"loader state: n_windows is {state['n_windows']} in the checkpoint but {other.n_windows} now; "
        "the saved position would point elsewhere")


# ---------------------------------------------------------------- validation batches

def test_fixed_batches_identical_spread_and_stateless(toy):
    val = PretrainLoader(toy, "val", 4, 16)
    a, b = val.fixed_batches(5), val.fixed_batches(5)
    assert len(a) == 5 and all(torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
                               for x, y in zip(a, b))
    assert val.state_dict()["position"] == 0 and val.state_dict()["epoch"] == 0
    s = torch.cat([x["input_ids"][:, 0] for x in a]).tolist()
    assert len(set(s)) == 20 and max(s) > 1500 and set(s) <= valid_starts((2000,), 16)
    val.next_batch()
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, val.fixed_batches(5)))


def test_fixed_batches_split_across_ranks(toy):
    one = PretrainLoader(toy, "val", 6, 16).fixed_batches(3)
    ranks = [PretrainLoader(toy, "val", 3, 16, rank=r, world_size=2).fixed_batches(3) for r in range(2)]
    for k in range(3):
        assert torch.equal(torch.cat([ranks[0][k]["input_ids"], ranks[1][k]["input_ids"]]), one[k]["input_ids"])


def test_fixed_batches_reuse_windows_when_split_is_small(toy):
    val = PretrainLoader(toy, "val", 50, 16)          # 124 windows, 4 batches need 200
    s = torch.cat([x["input_ids"][:, 0] for x in val.fixed_batches(4)]).tolist()
    assert len(set(s)) == val.n_windows


# ---------------------------------------------------------------- refusals

def test_missing_folder(tmp_path):
    assert error_of(PretrainLoader, tmp_path / "nope", "train", 1, 8) == (
        f"{tmp_path}/nope: no such data folder; run `gg prepare` first (paths.datasets)")


def test_folder_without_meta(tmp_path):
    (tmp_path / "d").mkdir()
    assert error_of(load_meta, tmp_path / "d") == f"{tmp_path}/d: no meta.json; run `gg prepare` to make the shards"
    (tmp_path / "d" / "progress.json").write_text("{}")
    assert error_of(load_meta, tmp_path / "d") == (
        f"{tmp_path}/d: preparation did not finish (progress.json but no meta.json); rerun `gg prepare` to resume it")


def test_foreign_meta(tmp_path):
    (tmp_path / "d").mkdir(); (tmp_path / "d" / "meta.json").write_text(json.dumps({"vocab": 3}))
    assert error_of(load_meta,
                    tmp_path / "d") == f"{tmp_path}/d/meta.json: not a gradient-garden shard folder (format=None)"


def test_unknown_split(toy):
    assert error_of(PretrainLoader, toy, "test", 1, 8) == f"{toy}: no split 'test'; the prepared splits are train, val"


def test_truncated_or_missing_shard(toy):
    (toy / "train" / "shard_00002.bin").write_bytes(b"\0" * 8)
    assert error_of(PretrainLoader, toy, "train", 1, 8) == (
        f"{toy}/train/shard_00002.bin: expected 3000 tokens (12000 bytes), found 8 bytes; rerun `gg prepare "
        "--overwrite`")
    (toy / "train" / "shard_00002.bin").unlink()
    assert error_of(PretrainLoader, toy, "train", 1, 8) == (
        f"{toy}/train/shard_00002.bin: expected 3000 tokens (12000 bytes), found no file; rerun `gg prepare "
        "--overwrite`")


def test_other_tokenizer_refused(toy):
    assert error_of(PretrainLoader, toy, "train", 1, 8, tokenizer_identity="hf-4096-0123") == (
        f"{toy}: the shards were made by tokenizer 'toy' (toy-1), not by the configured one (hf-4096-0123); "
        "prepare the data again with this tokenizer")
    assert PretrainLoader(toy, "train", 1, 8, tokenizer_identity="toy-1").tokenizer_identity == "toy-1"


def test_too_little_data(toy):
    assert error_of(PretrainLoader, toy, "val", 4, 1024, world_size=2) == (
        f"{toy}/val: holds 1 windows of seq_len+1 = 1025 tokens; one batch needs 8 (batch_size 4 x world_size 2); "
        "prepare more data")


@pytest.mark.parametrize("kw, message", [
    ({"batch_size": 0}, "loader batch_size: got 0; must be >= 1"),
    ({"seq_len": 0}, "loader seq_len: got 0; must be >= 1"),
    ({"rank": 2, "world_size": 2}, "loader rank: got 2; must be in [0, world_size=2)"),
])
def test_bad_arguments(toy, kw, message):
    args = {"batch_size": 2, "seq_len": 8, **kw}
    assert error_of(PretrainLoader, toy, "train", **args) == message


# ---------------------------------------------------------------- with real prepared shards, and speed

def test_on_prepared_shards(tmp_path):
    topics = [r["text"] for r in P.pydoc_topics()]
    tok = ensure_tokenizer(TokenizerConfig(path=str(tmp_path / "tok")), lambda: topics, vocab_size=1024)
    spec = P.parse_pretraining_data({"target_tokens": 60_000, "val_fraction": 0.2, "shard_tokens": 8192,
                                     "mix": [{"type": "embedded", "corpus": "pydoc-topics"}]})
    P.prepare_pretraining(spec, tok, tmp_path / "pre", progress=False)
    loader = PretrainLoader(tmp_path / "pre", "train", 4, 64, tokenizer_identity=tok.identity)
    b = loader.next_batch()
    assert b["input_ids"].max() < tok.vocab_size and torch.equal(b["labels"][:, :-1], b["input_ids"][:, 1:])
    text = tok.decode(b["input_ids"][0].tolist())
    assert len(text) > 64
    val = PretrainLoader(tmp_path / "pre", "val", 2, 64)
    assert len(val.fixed_batches(2)) == 2


def test_speed_no_python_loop_per_token(tmp_path):
    d = toy_folder(tmp_path / "big", sizes=(1 << 20,) * 4)
    loader = PretrainLoader(d, "train", 32, 1024)
    loader.next_batch()
    t0 = time.perf_counter()
    for _ in range(50): loader.next_batch()
    per_batch = (time.perf_counter() - t0) / 50
    assert per_batch < 0.05, f"{per_batch * 1e3:.1f} ms per batch of 32 x 1024"


def test_pretraining_loaders_from_config(tmp_path):
    from gradient_garden.config import GlobalConfig
    from gradient_garden.data.loaders import pretraining_loaders
    cfg = GlobalConfig()
    cfg.paths.datasets, cfg.training.micro_batch_size, cfg.training.seq_len = str(tmp_path), 3, 16
    toy_folder(tmp_path / "pretraining")
    train, val = pretraining_loaders(cfg, rank=1, world_size=2, tokenizer_identity="toy-1")
    assert (train.split, val.split, train.batch_size, train.seq_len, train.rank, train.world_size, train.seed) == (
        "train", "val", 3, 16, 1, 2, cfg.training.seed)
    with pytest.raises(ConfigError, match="made by tokenizer 'toy'"):
        pretraining_loaders(cfg, tokenizer_identity="other")
