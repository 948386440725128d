"""Tokenizer backends against independent references: Meta's Llama 3 tokenizer and ChatFormat (llama-models),
a Hugging Face conversion of the same vocabulary, and each other on the locally trained BPE; plus the error cases."""
import json, pickle, subprocess, sys, sysconfig
from pathlib import Path

import numpy as np
import pytest

from gradient_garden.config import ConfigError, TokenizerConfig
from gradient_garden.tokenizer import (BOS, EOS, EOT, REQUIRED_SPECIAL_TOKENS, HFTokenizer, TikTokenizer,
                                       ensure_tokenizer,
                                       init_tokenizer, llama3_special_tokens, tiktoken_pieces, train_bpe)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SAMPLE_FILES = ["argparse.py", "typing.py", "dataclasses.py", "pathlib.py", "functools.py", "inspect.py",
                "json/decoder.py"]
UNSEEN_FILES = ["os.py", "shutil.py", "difflib.py", "email/_header_value_parser.py", "unittest/mock.py"]

CRAFTED = [
    "", " ", "\n", "  \n\n \t", "Hello, world!", "I'M here; you'LL see, they'D've gone... it's 3.14159 or 1234567890.",
    "Ünïcödé — naïve café; Ελληνικά; русский; العربية; 日本語のテキスト; 한국어; emoji 🌱🌳🍅 and ZWJ 👩‍🔬.",
    "special text stays text: <|begin_of_text|><|eot_id|><|start_header_id|>user<|end_header_id|>",
    "tabs\tand\r\nCRLF\r\n\r\nlines   with   trailing   \n", "\u00a0non-breaking\u2003em-space\u3000ideographic",
    "x" * 30_000 + " tail", " " * 30_001 + "word", ("ab " * 50) + "\n" * 26_000 + "end",
]

def read(files): return [(STDLIB / f).read_text(encoding="utf-8") for f in files]


# --- the real Llama 3 tokenizer -------------------------------------------------------------------------------------
llama_models = pytest.importorskip("llama_models", reason="llama-models (test dependency) is not installed")
from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer  # noqa: E402

LLAMA_FILE = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"

@pytest.fixture(scope="module")
def meta(): return MetaTokenizer(LLAMA_FILE)

@pytest.fixture(scope="module")
def llama(): return TikTokenizer(LLAMA_FILE)

@pytest.fixture(scope="module")
def texts():
    # topics.py (~750k characters) crosses Meta's 400k-character window; CRAFTED holds runs over 25k characters.
    return read(UNSEEN_FILES + ["pydoc_data/topics.py"]) + CRAFTED

def test_llama3_special_ids(llama, meta):
    assert llama.vocab_size == meta.n_words == 128256
    assert (llama.bos_id, llama.eos_id, llama.eot_id, llama.pad_id) == (meta.bos_id, meta.eos_id, meta.eot_id,
                                                                        meta.pad_id)
    assert llama.special_ids == meta.special_tokens
    assert llama.pad_id != llama.eos_id
    assert (llama.start_header_id, llama.end_header_id) == (meta.special_tokens["<|start_header_id|>"],
                                                            meta.special_tokens["<|end_header_id|>"])
    assert llama.stop_ids == [meta.eos_id, meta.eot_id]

@pytest.fixture(scope="module")
def meta_ids(meta, texts): return [meta.encode(t, bos=False, eos=False) for t in texts]

def test_llama3_plain_text_matches_meta(llama, meta, texts, meta_ids):
    assert any(len(tiktoken_pieces(t)) > 1 for t in texts)  # the long-input path is exercised
    ref = meta_ids
    assert [llama.encode(t) for t in texts] == ref
    assert llama.encode_batch(texts) == ref
    assert llama.encode_batch(texts, bos=True, eos=True) == [meta.encode(t, bos=True, eos=True) for t in texts]
    assert [llama.decode(ids) for ids in ref] == [meta.decode(ids) for ids in ref] == texts

def test_tiktoken_finds_meta_repo_layout(tmp_path, llama):
    (tmp_path / "Llama-3-repo" / "original").mkdir(parents=True)
    (tmp_path / "Llama-3-repo" / "original" / "tokenizer.model").write_bytes(LLAMA_FILE.read_bytes())
    tok = init_tokenizer(TokenizerConfig(backend="tiktoken", path=str(tmp_path / "Llama-3-repo")))
    assert (tok.name, tok.identity) == ("Llama-3-repo", llama.identity)
    assert llama.name == "llama3"

def test_llama3_decode_accepts_arrays(llama):
    ids = llama.encode("array input", bos=True)
    assert llama.decode(np.array(ids)) == llama.decode(ids) == "<|begin_of_text|>array input"

CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
     {"role": "assistant", "content": "6."}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "\nstarts with a newline"},
     {"role": "assistant", "content": "  leading spaces, ünïcode 🌱, <|eot_id|> as text\n"},
     {"role": "tool", "content": '{"result": 42}'}, {"role": "assistant", "content": "The tool said 42."}],
]

@pytest.mark.parametrize("chat", CHATS, ids=["single", "multi-turn", "edge"])
def test_llama3_chat_matches_meta_chatformat(llama, meta, chat):
    from llama_models.datatypes import RawMessage, ToolPromptFormat
    from llama_models.llama3.chat_format import ChatFormat
    fmt = ChatFormat(meta)
    msgs = [RawMessage(**m) for m in chat]
    ids, mask = llama.render_chat(chat, add_generation_prompt=True)
    assert ids == fmt.encode_dialog_prompt(msgs).tokens
    assert len(mask) == len(ids)
    # message by message: each slice is Meta's encode_message, masked iff the role is assistant (header excluded)
    pos = 1
    for m, raw in zip(chat, msgs):
        toks, _ = fmt.encode_message(raw, ToolPromptFormat.json)
        assert ids[pos:pos + len(toks)] == toks
        body = len(meta.encode(m["content"], bos=False, eos=False)) + 1
        want = [0] * (len(toks) - body) + [int(m["role"] == "assistant")] * body
        assert mask[pos:pos + len(toks)] == want
        pos += len(toks)
    assert mask[pos:] == [0] * (len(ids) - pos) and ids[pos:] == fmt._encode_header("assistant")
    assert llama.render_chat(chat) == (ids[:pos], mask[:pos])

def test_llama3_supervised_text(llama):
    ids, mask = llama.render_chat(CHATS[1])
    assert llama.decode([i for i, m in zip(ids, mask) if m]) == "4<|eot_id|>6.<|eot_id|>"


# --- the Hugging Face backend on the same real vocabulary
# --------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_llama_dir(tmp_path_factory):
    """Meta's tokenizer.model converted to a local Hugging Face folder laid out like an instruct checkpoint."""
    conv = pytest.importorskip("transformers.convert_slow_tokenizer")
    out = tmp_path_factory.mktemp("hf-llama3")
    tok = conv.TikTokenConverter(vocab_file=str(LLAMA_FILE), extra_special_tokens=llama3_special_tokens()).converted()
    tok.save(str(out / "tokenizer.json"))
    # Llama 3 instruct sets eos_token to <|eot_id|> and declares no pad token.
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOT,
         "clean_up_tokenization_spaces": False}))
    return out

def test_hf_backend_on_llama3_vocab_matches_meta(hf_llama_dir, llama, texts, meta_ids):
    hf = HFTokenizer(hf_llama_dir)
    assert (hf.vocab_size, hf.bos_id, hf.eos_id, hf.eot_id, hf.pad_id) == (128256, 128000, 128001, 128009, 128004)
    whole = [i for i, t in enumerate(texts) if len(tiktoken_pieces(t)) == 1]  # Meta cuts longer inputs; HF does not
    assert hf.encode_batch([texts[i] for i in whole]) == [meta_ids[i] for i in whole]
    for chat in CHATS: assert hf.render_chat(chat, add_generation_prompt=True) == llama.render_chat(chat,
                                                                                                    add_generation_prompt=True)


# --- the trained BPE: both backends, one vocabulary -------------------------------------------------------------------
@pytest.fixture(scope="module")
def garden(tmp_path_factory):
    return train_bpe(read(SAMPLE_FILES), 4096, tmp_path_factory.mktemp("tok") / "garden-bpe-4k")

def test_trained_bpe_files_and_layout(garden):
    assert sorted(p.name for p in garden.iterdir()) == ["tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    assert len((garden / "tokenizer.model").read_text().splitlines()) == 4096 - 256
    from transformers import AutoTokenizer
    auto = AutoTokenizer.from_pretrained(garden)
    assert (len(auto) == 4096 and auto.bos_token == BOS and auto.eos_token == EOS
            and auto.pad_token == "<|finetune_right_pad_id|>")
    assert auto.convert_tokens_to_ids(llama3_special_tokens()) == list(range(3840, 4096))

def test_trained_bpe_backends_agree(garden):
    hf, tt = HFTokenizer(garden), TikTokenizer(garden)
    for a in ("vocab_size", "bos_id", "eos_id", "eot_id", "pad_id", "start_header_id", "end_header_id", "name"):
        assert getattr(hf, a) == getattr(tt, a), a
    assert hf.pad_id != hf.eos_id
    texts = read(UNSEEN_FILES) + [t for t in CRAFTED if len(tiktoken_pieces(t)) == 1]
    assert hf.encode_batch(texts, bos=True, eos=True) == tt.encode_batch(texts, bos=True, eos=True)
    assert [hf.encode(t) for t in texts[-5:]] == [tt.encode(t) for t in texts[-5:]]
    assert [tt.decode(ids) for ids in tt.encode_batch(texts)] == texts
    for chat in CHATS:
        assert hf.render_chat(chat) == tt.render_chat(chat)
        assert hf.decode(hf.render_chat(chat)[0]) == hf.hf.apply_chat_template(chat, tokenize=False)

def test_identity_is_stable_and_distinguishes(garden, llama, tmp_path):
    hf = HFTokenizer(garden)
    assert hf.identity == HFTokenizer(garden).identity and hf.identity.startswith("hf-4096-")
    assert TikTokenizer(garden).identity == TikTokenizer(garden / "tokenizer.model").identity
    assert len({hf.identity, TikTokenizer(garden).identity, llama.identity}) == 3
    other = train_bpe(read(SAMPLE_FILES[:3]), 4096, tmp_path / "other")
    assert HFTokenizer(other).identity != hf.identity

def test_train_bpe_deterministic_across_processes(garden, tmp_path):
    code = ("import sys, sysconfig; from pathlib import Path; from gradient_garden.tokenizer import train_bpe; "
            "s = Path(sysconfig.get_paths()['stdlib']); "
            f"train_bpe([(s / f).read_text(encoding='utf-8') for f in {SAMPLE_FILES!r}], 4096, sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "again")], check=True)
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        assert (tmp_path / "again" / f).read_bytes() == (garden / f).read_bytes(), f

def test_tokenizers_pickle(garden):
    for tok in (HFTokenizer(garden), TikTokenizer(garden)):
        clone = pickle.loads(pickle.dumps(tok))
        assert (clone.encode("def f(x): <|eot_id|>") == tok.encode("def f(x): <|eot_id|>")
                and clone.identity == tok.identity)

def test_hf_backend_state_is_reset_before_encoding(garden):
    tok = HFTokenizer(garden)
    want = tok.encode_batch(["<|eot_id|> " * 20])
    tok.hf(["<|eot_id|> x"], padding="max_length", max_length=64, truncation=True)  # transformers leaves its state
    assert tok.hf.backend_tokenizer.encode_special_tokens is False or tok.hf.backend_tokenizer.padding is not None
    assert tok.encode_batch(["<|eot_id|> " * 20]) == want and tok.encode("<|eot_id|> " * 20) == want[0]


# --- bad input -------------------------------------------------------------------------------------------------------
def _hf_folder_without(tmp_path, missing: str) -> Path:
    "A small HF tokenizer folder holding every Llama 3 special token except `missing`."
    from tokenizers import AddedToken, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from gradient_garden.tokenizer import _new_bpe
    tok = _new_bpe()
    tok.train_from_iterator(read(SAMPLE_FILES[:1]), trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in llama3_special_tokens(16)
                            if t != missing])
    out = tmp_path / ("without-" + "".join(c for c in missing if c.isalnum()))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(out)
    return out

@pytest.mark.parametrize("missing", REQUIRED_SPECIAL_TOKENS)
def test_missing_special_token_is_named(tmp_path, missing):
    folder = _hf_folder_without(tmp_path, missing)
    with pytest.raises(ConfigError, match="required special token") as e: HFTokenizer(folder)
    assert repr(missing) in str(e.value) and str(folder) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        TikTokenizer(LLAMA_FILE, special_tokens=[t for t in llama3_special_tokens() if t != missing])
    assert repr(missing) in str(e.value) and str(LLAMA_FILE) in str(e.value)

def test_complete_folder_loads_without_pad(tmp_path):
    folder = _hf_folder_without(tmp_path, "<|finetune_right_pad_id|>")
    tok = HFTokenizer(folder)
    assert tok.pad_id == tok.special_ids["<|reserved_special_token_0|>"] != tok.eos_id  # first reserved token

@pytest.mark.parametrize("backend,path,match", [
    ("huggingface", "/nonexistent/tokenizer-dir", "tokenizer.path='/nonexistent/tokenizer-dir': no such folder"),
    ("tiktoken", "/nonexistent/tokenizer.model", "tokenizer.path='/nonexistent/tokenizer.model': no tiktoken BPE file"),
])
def test_missing_path(backend, path, match):
    with pytest.raises(ConfigError, match=match): init_tokenizer(TokenizerConfig(backend=backend, path=path))

def test_hub_id_offline_is_one_line():
    with pytest.raises(ConfigError,
                       match="tokenizer.path='gradient-garden/no-such-tokenizer': AutoTokenizer cannot load") as e:
        HFTokenizer("gradient-garden/no-such-tokenizer", local_files_only=True)
    assert "\n" not in str(e.value)

def test_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="AutoTokenizer cannot load"): HFTokenizer(tmp_path / "empty")
    with pytest.raises(ConfigError, match="no tiktoken BPE file"): TikTokenizer(tmp_path / "empty")

def test_malformed_tiktoken_file(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_text("IQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ConfigError, match=r"bad.model': line 2 is not '<base64 token> <rank>'"): TikTokenizer(bad)
    bad.write_text("\n")
    with pytest.raises(ConfigError, match="no tokens"): TikTokenizer(bad)

def test_bad_backend():
    cfg = TokenizerConfig(); cfg.backend = "sentencepiece"
    with pytest.raises(ConfigError,
                       match="tokenizer.backend='sentencepiece': allowed values are 'huggingface', 'tiktoken'"):
        init_tokenizer(cfg)

def test_bad_chat_messages(llama):
    with pytest.raises(ConfigError, match=r"messages\[1\].role='robot': allowed roles are system, user, assistant"):
        llama.render_chat([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    with pytest.raises(ConfigError, match=r"messages\[0\].content: got list; expected a string"):
        llama.render_chat([{"role": "user", "content": ["a"]}])

def test_train_bpe_bad_sizes(tmp_path):
    with pytest.raises(ConfigError, match="vocab_size=300: must exceed 512"): train_bpe(["abc"], 300, tmp_path / "a")
    with pytest.raises(ConfigError, match="vocab_size=4096: the corpus only supports"):
        train_bpe(["a tiny corpus"], 4096, tmp_path / "b")


# --- ensure_tokenizer (what `gg prepare` calls) -----------------------------------------------------------------------
def test_ensure_tokenizer_trains_once(tmp_path, garden):
    calls = []
    def texts_fn(): calls.append(1); return iter(read(SAMPLE_FILES))
    cfg = TokenizerConfig(backend="huggingface", path=str(tmp_path / "data" / "tokenizers" / "garden-bpe-4k"))
    tok = ensure_tokenizer(cfg, texts_fn)
    assert tok.identity == HFTokenizer(garden).identity and tok.vocab_size == 4096 and calls == [1]
    assert ensure_tokenizer(cfg, texts_fn).identity == tok.identity and calls == [1]
    tt = ensure_tokenizer(TokenizerConfig(backend="tiktoken", path=cfg.path), texts_fn)
    assert isinstance(tt, TikTokenizer) and calls == [1]
    assert [p.name for p in (tmp_path / "data" / "tokenizers").iterdir()] == ["garden-bpe-4k"]

def test_ensure_tokenizer_loses_a_race_cleanly(tmp_path, garden):
    import shutil
    target = tmp_path / "tok"
    def texts_fn():  # another rank finishes first, while we are still training
        shutil.copytree(garden, target); return iter(read(SAMPLE_FILES))
    tok = ensure_tokenizer(TokenizerConfig(path=str(target)), texts_fn)
    assert tok.identity == HFTokenizer(garden).identity
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]

def test_ensure_tokenizer_refuses_to_overwrite(tmp_path):
    (tmp_path / "busy").mkdir(); (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds no huggingface tokenizer"):
        ensure_tokenizer(TokenizerConfig(path=str(tmp_path / "busy")), lambda: iter(["x"]))
    with pytest.raises(ConfigError, match="missing.model"):
        ensure_tokenizer(TokenizerConfig(backend="tiktoken", path=str(tmp_path / "missing.model")), lambda: iter(["x"]))
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


def _chatml_folder(out):
    "A ChatML tokenizer folder built on the spot (no Llama 3 control tokens), its Qwen-style template with markers."
    from tokenizers import Tokenizer as Raw, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    template = ("{%- if not messages or messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful "
                "assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{{- '<|im_start|>' + "
                "message['role'] + '\\n' }}{%- if message['role'] == 'assistant' %}{% generation %}{{- "
                "message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}{%- else %}{{- message['content'] "
                "+ '<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- "
                "'<|im_start|>assistant\\n' }}{%- endif %}")
    raw = Raw(models.BPE())
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    raw.train_from_iterator(["What is 12 + 7? 19. Spell cat: c a t. Reverse abc: cba."] * 20,
                            trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            chat_template=template).save_pretrained(out)
    return out


def test_sft_masks_under_the_models_own_template_equal_transformers(tmp_path):
    "SFT's loss mask under a ChatML template equals transformers' assistant mask, for one and several turns."
    from gradient_garden.stages.sft import tokenize_chat
    tok = init_tokenizer(TokenizerConfig(path=str(_chatml_folder(tmp_path/"chatml"))))
    chats = [[{"role": "user", "content": "What is 12 + 7?"}, {"role": "assistant", "content": "19."}],
             [{"role": "system", "content": "Spell."}, {"role": "user", "content": "Spell cat"},
              {"role": "assistant", "content": "c a t."}, {"role": "user", "content": "Reverse abc"},
              {"role": "assistant", "content": "cba."}]]
    for chat in chats:
        want = tok.hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert tok.render_chat(chat) == (list(want["input_ids"]), list(want["assistant_masks"]))
        ids, mask, _ = tokenize_chat(tok, chat)      # SFT's rows end after the last assistant turn's <|im_end|>
        assert (ids, mask) == (want["input_ids"][:len(ids)], want["assistant_masks"][:len(ids)])
        assert not any(want["assistant_masks"][len(ids):])
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "c a t.<|im_end|>cba.<|im_end|>"
    prompt = tok.render_chat(chats[0][:1], add_generation_prompt=True)[0]
    assert prompt == tok.hf.apply_chat_template(chats[0][:1], tokenize=True, add_generation_prompt=True,
                                                return_dict=True)["input_ids"]
    assert set(tok.stop_ids) == {tok.hf.convert_tokens_to_ids("<|im_end|>")}
