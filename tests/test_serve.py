"""`gg serve` as its users use it: the real server on a free loopback port, talked to with the official `openai`
client (and raw HTTP where a client would refuse to send the request)."""
import contextlib, json, os, signal, socket, subprocess, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

from gradient_garden.config import GlobalConfig, ModelConfig, TokenizerConfig, to_plain
from gradient_garden.checkpoint.checkpoints import load_model_from_checkpoint, save_checkpoint
from gradient_garden.batching import generate
from gradient_garden.generation import special_token_ids
from gradient_garden.models.tendril import Tendril
from gradient_garden.tokenizer import init_tokenizer, train_bpe

ROOT = Path(__file__).resolve().parent.parent
MAX_LEN = 128

def _corpus() -> list[str]:
    "Text that is on every machine: some of the standard library's sources."
    import argparse, dataclasses, json as js, pathlib as pl
    return [Path(m.__file__).read_text() for m in (argparse, dataclasses, js.encoder, js.decoder, pl)]

def make_checkpoint(base: Path, stage: str, tok_dir: Path, max_seq_len: int = MAX_LEN,
                    nan_token: int | None = None) -> Path:
    ("A checkpoint of a tiny random Tendril (seeded) for `stage`, using the tokenizer in `tok_dir` (`nan_token`: its "
     "embedding row NaN).")
    cfg = GlobalConfig()
    cfg.run.name = f"tiny-{stage}"
    cfg.training.stage = stage
    cfg.model = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=640, multiple_of=32,
                            max_seq_len=max_seq_len, init_std=0.1)
    cfg.tokenizer = TokenizerConfig(backend="huggingface", path=str(tok_dir))
    torch.manual_seed(0)
    model = Tendril(cfg.model)
    if nan_token is not None:
        with torch.no_grad(): model.tok_embeddings.weight[nan_token] = float("nan")
    name = f"{stage}-{max_seq_len}" + ("" if nan_token is None else f"-nan{nan_token}")
    return save_checkpoint(dict(step=1, stage=stage, architecture="tendril", config=to_plain(cfg),
                                model=model.state_dict()), base/name/"step_0000001.pt")

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def wait_ready(url: str, proc=None, timeout: float = 300, headers=None):
    "Poll `url/health` until the server answers (or its process dies)."
    t = time.time()
    while time.time() - t < timeout:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"gg serve exited with {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2, headers=headers).status_code == 200: return
        except httpx.HTTPError: pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not come up in {timeout} s")

@contextlib.contextmanager
def served_in_thread(served, api_key=None):
    "A real uvicorn server for `served` in a thread of this process; its base URL while the block runs."
    import uvicorn
    from gradient_garden.serve.app import create_app
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(served, api_key=api_key), host="127.0.0.1", port=port,
                                        log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
        yield url
    finally:
        srv.should_exit = True
        th.join(timeout=30)

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    "Tokenizer, an instruct checkpoint, and the model as `gg generate` loads it."
    base = tmp_path_factory.mktemp("serve")
    tok_dir = train_bpe(_corpus(), 640, base/"tok")
    ckpt = make_checkpoint(base, "instruct", tok_dir)
    model, cfg = load_model_from_checkpoint(ckpt)
    return dict(base=base, tok_dir=tok_dir, ckpt=ckpt, model=model, tok=init_tokenizer(cfg.tokenizer))

def start_gg_serve(ckpt, *flags) -> tuple[subprocess.Popen, str]:
    "`gg serve --checkpoint ckpt FLAGS` in a subprocess on a free loopback port, once it answers: (process, url)."
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("GG_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "gradient_garden.cli", "serve", "--checkpoint", str(ckpt),
                             "--port", str(port), "--log-level", "warning", *flags],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try: wait_ready(url, proc)
    except BaseException: stop(proc); raise
    return proc, url

def stop(proc: subprocess.Popen):
    "Stop a `gg serve` subprocess (SIGTERM: a graceful shutdown), killing it if it takes too long."
    proc.terminate()
    try: proc.wait(timeout=20)
    except subprocess.TimeoutExpired: proc.kill()

@pytest.fixture(scope="module")
def server(tiny):
    "`gg serve` in a subprocess on a free loopback port (the decoder in its own process, as by default)."
    proc, url = start_gg_serve(tiny["ckpt"], "--max-batch-size", "8")
    try: yield dict(url=url, proc=proc,
                    client=openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120))
    finally: stop(proc)

def shown(tok, ids) -> str:
    "The text of `ids` as the server shows it by default: special tokens left out."
    special = special_token_ids(tok)
    return tok.decode([t for t in ids if t not in special])

def reference(tiny, prompt_ids, n):
    "What `generate` (the code behind `gg generate`) makes of one prompt alone, greedy: text and tokens generated."
    out = generate(tiny["model"], tiny["tok"], [prompt_ids], max_new_tokens=n)[0]
    return shown(tiny["tok"], out), len(out) + (len(out) < n)        # an answer that ended on a stop token counts it

def finish_reason(tiny, prompt_ids, n) -> str:
    return "length" if len(generate(tiny["model"], tiny["tok"], [prompt_ids], max_new_tokens=n)[0]) == n else "stop"

def chat_ids(tiny, messages): return tiny["tok"].render_chat(messages, add_generation_prompt=True)[0]

def test_models_and_health(server):
    models = server["client"].models.list()
    assert [m.id for m in models.data] == ["tiny-instruct"]
    h = httpx.get(f"{server['url']}/health").json()
    assert h["status"] == "ok" and h["max_batch_size"] == 8
    from gradient_garden.serve.api import STREAM_INTERVAL_MS, STREAM_INTERVAL_TOKENS
    # gg serve's defaults
    assert h["stream_interval"] == {"tokens": STREAM_INTERVAL_TOKENS, "ms": STREAM_INTERVAL_MS}

def test_chat_plain_and_streamed(server, tiny):
    c, msgs = server["client"], [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def main():"}]
    want, n = reference(tiny, chat_ids(tiny, msgs), 20)
    r = c.chat.completions.create(model="tiny-instruct", messages=msgs, temperature=0, max_tokens=20)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(chat_ids(tiny, msgs)) and r.usage.completion_tokens == n
    assert r.choices[0].finish_reason == finish_reason(tiny, chat_ids(tiny, msgs), 20)
    chunks = list(c.chat.completions.create(model="tiny-instruct", messages=msgs, temperature=0, max_tokens=20,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == n and len(chunks) > 3          # streamed piece by piece
    sampled = [c.chat.completions.create(model="tiny-instruct", messages=msgs, temperature=1.0, top_p=0.9, seed=5,
                                         max_tokens=12, n=2) for _ in range(2)]
    assert [ch.message.content for ch in sampled[0].choices] == [ch.message.content for ch in sampled[1].choices]
    assert len(sampled[0].choices) == 2

def test_completions_plain_and_streamed(server, tiny):
    c, prompt = server["client"], "import os\n"
    want, n = reference(tiny, tiny["tok"].encode(prompt, bos=True), 16)
    r = c.completions.create(model="tiny-instruct", prompt=prompt, temperature=0)     # max_tokens defaults to 16
    assert r.choices[0].text == want and r.usage.completion_tokens == n
    text = "".join(ch.choices[0].text for ch in c.completions.create(model="tiny-instruct", prompt=prompt,
                                                                       temperature=0, max_tokens=16, stream=True))
    assert text == want
    stop = want[3:6]
    if stop.strip():
        r = c.completions.create(model="tiny-instruct", prompt=prompt, temperature=0, stop=[stop])
        assert r.choices[0].text == want[:want.index(stop)] and r.choices[0].finish_reason == "stop"

def test_greedy_equals_gg_generate(server, tiny, tmp_path):
    "The same prompts through `gg generate` and through the server, greedy: the same text."
    import argparse
    from gradient_garden.cli.generate import add_generate_args, run_generate
    prompts = ["def main(", "class Foo:"]
    (tmp_path/"p.json").write_text(json.dumps(prompts))
    out = {}
    for instruct in (False, True):
        f = tmp_path/f"gen{instruct}.json"
        args = add_generate_args(argparse.ArgumentParser()).parse_args(
            ["--checkpoint", str(tiny["ckpt"]), "--prompts", str(tmp_path/"p.json"), "--max-gen-len", "14",
             "--device", "cpu", "--output-file-name", str(f)] + (["--instruct"] if instruct else ["--raw"]))
        assert run_generate(args) == 0
        out[instruct] = [r["completion"] for r in json.loads(f.read_text())["results"]]
    c = server["client"]
    for p, g in zip(prompts, out[False]):
        assert c.completions.create(model="tiny-instruct", prompt=p, temperature=0, max_tokens=14).choices[0].text == g
    for p, g in zip(prompts, out[True]):
        r = c.chat.completions.create(model="tiny-instruct", messages=[{"role": "user", "content": p}], temperature=0,
                                      max_tokens=14)
        assert r.choices[0].message.content == g

def test_16_concurrent_requests(server, tiny):
    "16 requests at once (8 decode together, 8 wait and join as rows free up): each gets its own answer."
    prompts = [f"def f{i}(x):\n    return x * {i}" for i in range(16)]
    want = [reference(tiny, tiny["tok"].encode(p, bos=True), 24)[0] for p in prompts]
    c = server["client"]
    def ask(i):
        if i % 2: return "".join(ch.choices[0].text for ch in c.completions.create(
            model="tiny-instruct", prompt=prompts[i], temperature=0, max_tokens=24, stream=True))
        return c.completions.create(model="tiny-instruct", prompt=prompts[i], temperature=0,
                                    max_tokens=24).choices[0].text
    before = httpx.get(f"{server['url']}/health").json()
    with ThreadPoolExecutor(16) as ex: got = list(ex.map(ask, range(16)))
    assert got == want
    assert len(set(got)) > 1
    after = httpx.get(f"{server['url']}/health").json()
    steps, tokens = after["steps"] - before["steps"], after["tokens"] - before["tokens"]
    assert tokens > 2 * steps, (tokens, steps)                          # many rows per decoding step

def _error(r: httpx.Response, status=400) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in err["message"]
    return err

def test_bad_input_is_a_400_with_openai_error_json(server):
    c, url = server["client"], server["url"]
    chat = lambda **kw: c.chat.completions.create(model="tiny-instruct", messages=[{"role": "user", "content": "hi"}],
                                                  **kw)
    for kw, param in [(dict(temperature=3), "temperature"), (dict(top_p=0), "top_p"),
                      (dict(max_tokens=0), "max_tokens"),
                      (dict(n=99), "n"), (dict(extra_body={"foo": 1}), "foo"), (dict(max_tokens=MAX_LEN), "max_tokens"),
                      (dict(presence_penalty=1.0), "presence_penalty"), (dict(seed=2**70), "seed"),
                      (dict(seed=-2**70), "seed")]:
        with pytest.raises(openai.BadRequestError) as e: chat(**kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kw, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny-instruct", prompt="word " * 300)
    assert (e.value.body["code"] == "context_length_exceeded"
            and f"maximum context length is {MAX_LEN}" in e.value.body["message"])
    with pytest.raises(openai.NotFoundError): c.completions.create(model="gpt-4", prompt="x")
    err = _error(httpx.post(f"{url}/v1/chat/completions", content=b'{"model": "tiny-instruct", "messages": [',
                            headers={"Content-Type": "application/json"}))
    assert err["code"] == "invalid_json"
    err = _error(httpx.post(f"{url}/v1/chat/completions",
                            json={"model": "tiny-instruct", "messages": [{"role": "robot", "content": "x"}]}))
    assert err["param"] == "messages"
    assert "Unrecognized request argument supplied: foo" in _error(httpx.post(
        f"{url}/v1/completions", json={"model": "tiny-instruct", "prompt": "x", "foo": 1}))["message"]
    _error(httpx.get(f"{url}/v1/nothing"), 404)
    assert httpx.get(f"{url}/health").json()["status"] == "ok"

def test_extreme_sampling_settings_still_sample(server, tiny):
    "A repetition penalty of 1e-300 and a temperature of 1e-40 answer (the latter as greedy decoding does), not a 500."
    c = server["client"]
    greedy = c.completions.create(model="tiny-instruct", prompt="def f(", max_tokens=8, temperature=0).choices[0].text
    cold = c.completions.create(model="tiny-instruct", prompt="def f(", max_tokens=8, temperature=1e-40, seed=1)
    assert cold.choices[0].text == greedy and cold.usage.completion_tokens >= 1
    r = c.completions.create(model="tiny-instruct", prompt="def f(", max_tokens=8, temperature=1.0, seed=1,
                             extra_body={"repetition_penalty": 1e-300})
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1

def test_disconnect_mid_stream_stops_generation(tiny):
    "A client that goes away mid-stream cancels its sequence in the decoder process, long before its budget is spent."
    budget = 6000                                # thousands of decoding steps: far longer than noticing the disconnect
    proc, url = start_gg_serve(make_checkpoint(tiny["base"], "instruct", tiny["tok_dir"], max_seq_len=budget + 64))
    try:
        body = {"model": "tiny-instruct", "prompt": "def main(", "temperature": 0, "max_tokens": budget, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
        assert any(l.startswith("data: ") for l in got)
        for _ in range(200):
            h = httpx.get(f"{url}/health").json()
            if h["running"] == 0 and h["cancelled"] > 0: break
            time.sleep(0.05)
        assert h["cancelled"] == 1 and h["running"] == 0, h
        assert h["tokens"] < budget // 2, h                                 # stopped long before its budget was spent
    finally: stop(proc)

def test_cli_refuses_public_address_without_key(tiny, capsys):
    from gradient_garden.cli import main
    env_key = os.environ.pop("GG_API_KEY", None)
    try: rc = main(["serve", "--checkpoint", str(tiny["ckpt"]), "--host", "0.0.0.0"])
    finally:
        if env_key is not None: os.environ["GG_API_KEY"] = env_key
    assert rc == 2
    assert capsys.readouterr().err.strip() == ("error: --host 0.0.0.0: listening beyond this machine requires an API "
                                               "key (--api-key or GG_API_KEY)")

@pytest.fixture()
def small_server(tiny):
    "A real uvicorn server in this process (one decoding row, one waiting place, an API key, a plain checkpoint)."
    from gradient_garden.serve.api import Served
    from gradient_garden.serve.decoder import BatchDecoder
    model, cfg = load_model_from_checkpoint(make_checkpoint(tiny["base"], "pretraining", tiny["tok_dir"]))
    served = Served(BatchDecoder(model, init_tokenizer(cfg.tokenizer), max_batch_size=1, max_queue=1), "tiny-plain",
                    chat=False)
    with served_in_thread(served, api_key="sekrit") as url: yield url

def test_api_key_queue_limit_and_plain_checkpoint(small_server):
    url = small_server
    assert _error(httpx.get(f"{url}/v1/models"), 401)["code"] == "invalid_api_key"
    assert _error(httpx.get(f"{url}/health", headers={"Authorization": "Bearer wrong"}),
                  401)["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/").status_code == 200                   # the page itself holds no data
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="sekrit", max_retries=0, timeout=120)
    assert c.models.list().data[0].chat is False
    with pytest.raises(openai.BadRequestError, match="use /v1/completions"):
        c.chat.completions.create(model="tiny-plain", messages=[{"role": "user", "content": "hi"}])
    def ask(_):
        try: return c.completions.create(model="tiny-plain", prompt="def f(", temperature=0,
                                         max_tokens=MAX_LEN - 8).usage.completion_tokens
        except openai.RateLimitError as e: return e.status_code
    with ThreadPoolExecutor(6) as ex: res = list(ex.map(ask, range(6)))
    assert res.count(429) >= 1 and any(r != 429 for r in res), res       # 1 running + 1 waiting; the rest refused

@pytest.fixture()
def coalescing_server(tiny):
    "A real uvicorn server in this process whose streams send 8 tokens per chunk (no time limit)."
    from gradient_garden.serve.api import Served, StreamInterval
    from gradient_garden.serve.decoder import BatchDecoder
    # its own copy: the decoder owns its model while it runs
    model, _ = load_model_from_checkpoint(tiny["ckpt"])
    served = Served(BatchDecoder(model, tiny["tok"], max_batch_size=4), "tiny-instruct",
                    stream_interval=StreamInterval(8, ms=60_000))
    with served_in_thread(served) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

def test_coalesced_stream_is_the_same_text_in_fewer_chunks(coalescing_server, tiny):
    "The openai client reads chunks of several tokens: the same text and usage, the first chunk with the role."
    c, msgs = coalescing_server, [{"role": "user", "content": "def main():"}]
    ids = chat_ids(tiny, msgs)
    out = generate(tiny["model"], tiny["tok"], [ids], max_new_tokens=40, stop_ids=())[0]
    chunks = list(c.chat.completions.create(model="tiny-instruct", messages=msgs, temperature=0, max_tokens=40,
                                            stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert "".join(texts) == shown(tiny["tok"], out) and chunks[-1].usage.completion_tokens == 40
    assert chunks[0].choices[0].delta.role == "assistant"
    assert 2 <= len(texts) <= 1 + 5 + 1, len(texts)                 # the first token, then 8 per chunk (40 one by one)
    whole = c.completions.create(model="tiny-instruct", prompt="import os\n", temperature=0,
                                 max_tokens=40).choices[0].text
    stop = whole[12:15]
    if stop.strip():                                                 # a stop string inside a chunk still cuts exactly
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model="tiny-instruct", prompt="import os\n", temperature=0, max_tokens=40, stop=[stop], stream=True))
        assert streamed == whole[:whole.index(stop)]

def test_hf_checkpoint_serves_like_the_platform_checkpoint(tiny):
    "`--hf-checkpoint` on the `gg export` folder of the checkpoint: same chat flag, same greedy tokens."
    import argparse
    from gradient_garden.cli.generate import add_export_args, run_export
    from gradient_garden.cli.serve import add_serve_args
    from gradient_garden.batching import Sequence, SamplingParams
    from gradient_garden.serve.process import load_served
    out = tiny["base"]/"hf"
    assert run_export(add_export_args(argparse.ArgumentParser()).parse_args(["--checkpoint", str(tiny["ckpt"]), "--out",
                                                                             str(out)])) == 0
    flags = add_serve_args(argparse.ArgumentParser()).parse_args(["--hf-checkpoint", str(out), "--device", "cpu",
                                                                  "--threads", "1"])
    # the decoder in its own process, as gg serve runs it
    served = load_served(flags)
    try:
        assert served.chat and served.model_id == "hf" and served.max_len == MAX_LEN
        ids = chat_ids(tiny, [{"role": "user", "content": "def main():"}])
        done = threading.Event()
        s = Sequence(ids, SamplingParams(max_tokens=16, temperature=0), emit=lambda kind,
                     _: kind == "done" and done.set())
        served.decoder.start().submit([s])
        assert done.wait(60)
        assert s.out == generate(tiny["model"], tiny["tok"], [ids], max_new_tokens=16)[0]
        assert served.decoder.snapshot()["pid"] == served.decoder.process.pid != os.getpid()
    finally: served.decoder.close()
    assert not served.decoder.process.is_alive()

def test_decoder_process_errors_are_one_line(tmp_path):
    "A checkpoint the decoder process cannot load is a one-line error of `gg serve`, as it is in one process."
    r = subprocess.run([sys.executable, "-m", "gradient_garden.cli", "serve", "--checkpoint", str(tmp_path/"none.pt"),
                        "--port", str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr

def test_a_dead_decoder_process_fails_requests_cleanly(tiny):
    "When the decoder process dies, a running stream ends with an error event and new requests get a 503."
    proc, url = start_gg_serve(tiny["ckpt"])
    try:
        pid = httpx.get(f"{url}/health").json()["pid"]
        assert pid != proc.pid
        body = {"model": "tiny-instruct", "prompt": "def main(", "max_tokens": MAX_LEN - 8, "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(pid, 9)
            rest = [l for l in lines if l.startswith("data: ")]
        died = "the decoding process died (killed by SIGKILL); restart gg serve"
        assert json.loads(rest[-1][6:])["error"]["message"] == died, rest[-3:]
        err = _error(httpx.post(f"{url}/v1/completions", json={"model": "tiny-instruct", "prompt": "x"}), 503)
        assert err["code"] == "unavailable" and err["message"] == died, err
        assert httpx.get(f"{url}/health").status_code == 503
        assert proc.poll() is None                                   # the web server stays up and says why
    finally: stop(proc)

def test_decoder_process_queue_limit(tiny):
    ("With the decoder in its own process the web server counts what is in flight: a full queue is a 429, then it "
     "drains.")
    proc, url = start_gg_serve(tiny["ckpt"], "--max-batch-size", "1", "--max-queue", "1")
    try:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        def ask(_):
            try: return c.completions.create(model="tiny-instruct", prompt="def f(", max_tokens=MAX_LEN - 8,
                                             extra_body={"ignore_eos": True}).usage.completion_tokens
            except openai.RateLimitError as e: return e.status_code
        with ThreadPoolExecutor(6) as ex: res = list(ex.map(ask, range(6)))
        assert res.count(429) >= 1 and res.count(MAX_LEN - 8) >= 2, res       # 1 running + 1 waiting; the rest refused
        h = httpx.get(f"{url}/health").json()
        assert (h["running"], h["waiting"], h["rejected"]) == (0, 0, res.count(429)), h
        assert ask(0) == MAX_LEN - 8                                    # room again once they are done
    finally: stop(proc)

EOT_PROMPT = "import os\n"

def rigged_model(tiny):
    "A copy of the tiny model that writes <|eot_id|> where its greedy answer to EOT_PROMPT had its third token."
    model, _ = load_model_from_checkpoint(tiny["ckpt"])
    tok, p = tiny["tok"], tiny["tok"].encode(EOT_PROMPT, bos=True)
    third = generate(model, tok, [p], max_new_tokens=3, stop_ids=[])[0][2]
    # eot wins where `third` won
    with torch.no_grad(): model.output.weight[tok.eot_id] = model.output.weight[third] * 1.05
    return model

@pytest.fixture(scope="module")
def eot_server(tiny):
    ("A real uvicorn server in this process on the rigged model, and the rigged model's greedy tokens (stop tokens "
     "ignored).")
    from gradient_garden.serve.api import Served
    from gradient_garden.serve.decoder import BatchDecoder
    tok = tiny["tok"]
    ref = generate(rigged_model(tiny), tok, [tok.encode(EOT_PROMPT, bos=True)], max_new_tokens=24, stop_ids=[])[0]
    k = ref.index(tok.eot_id)
    assert 1 <= k < 12 and any(t not in special_token_ids(tok) for t in ref[k + 1:]), ref
    served = Served(BatchDecoder(rigged_model(tiny), tok, max_batch_size=4), "tiny-instruct")
    with served_in_thread(served) as url:
        yield dict(url=url, ref=ref, k=k,
                   client=openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120))

def _complete(c, stream: bool, chat: bool = False, **kw) -> tuple[str, str, int]:
    "Text, finish reason and completion_tokens of one request (streamed: joined chunks and the usage chunk)."
    create = c.chat.completions.create if chat else c.completions.create
    body = dict(messages=[{"role": "user", "content": EOT_PROMPT}]) if chat else dict(prompt=EOT_PROMPT)
    if not stream:
        r = create(model="tiny-instruct", temperature=0, **body, **kw)
        return (r.choices[0].message.content if chat
                else r.choices[0].text), r.choices[0].finish_reason, r.usage.completion_tokens
    chunks = list(create(model="tiny-instruct", temperature=0, stream=True, stream_options={"include_usage": True},
                         **body, **kw))
    piece = (lambda ch: ch.choices[0].delta.content or "") if chat else (lambda ch: ch.choices[0].text)
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    return "".join(piece(ch) for ch in chunks if ch.choices), reasons[-1], chunks[-1].usage.completion_tokens

@pytest.mark.parametrize("stream", [False, True])
def test_special_tokens_hidden_unless_asked(eot_server, tiny, stream):
    "With ignore_eos the answer holds <|eot_id|>: hidden by default (vLLM's skip_special_tokens), shown on request."
    c, ref, tok = eot_server["client"], eot_server["ref"], tiny["tok"]
    hidden, visible = shown(tok, ref), tok.decode(ref)
    assert "<|eot_id|>" in visible and "<|" not in hidden
    assert _complete(c, stream, max_tokens=24, extra_body={"ignore_eos": True}) == (hidden, "length", 24)
    assert _complete(c, stream, max_tokens=24,
                     extra_body={"ignore_eos": True, "skip_special_tokens": False}) == (visible, "length", 24)
    chat = generate(rigged_model(tiny), tok, [chat_ids(tiny, [{"role": "user", "content": EOT_PROMPT}])],
                    max_new_tokens=24, stop_ids=[])[0]
    for skip, want in ((True, shown(tok, chat)), (False, tok.decode(chat))):
        got = _complete(c, stream, chat=True, max_tokens=24,
                        extra_body={"ignore_eos": True, "skip_special_tokens": skip})
        assert got == (want, "length", 24), (skip, got, want)
    with pytest.raises(openai.BadRequestError, match="skip_special_tokens"):
        c.completions.create(model="tiny-instruct", prompt="x", extra_body={"skip_special_tokens": "sometimes"})

@pytest.mark.parametrize("stream", [False, True])
def test_completion_tokens_count_the_stop_token(eot_server, tiny, stream):
    "usage.completion_tokens as vLLM counts it: the stop token that ended the answer is counted, its text is not."
    c, ref, k, tok = eot_server["client"], eot_server["ref"], eot_server["k"], tiny["tok"]
    # EOS: k tokens of text + the stop token
    assert _complete(c, stream, max_tokens=24) == (shown(tok, ref[:k]), "stop", k + 1)
    # length: max_tokens, no stop token
    assert _complete(c, stream, max_tokens=k) == (shown(tok, ref[:k]), "length", k)
    text = shown(tok, ref)
    stop = next(text[i:i + 2] for i in range(len(shown(tok, ref[:k + 1])), len(text) - 2) if text[i:i + 2].strip())
    # the token that completes it
    m = next(m for m in range(1, len(ref) + 1) if stop in shown(tok, ref[:m]))
    got = _complete(c, stream, max_tokens=24, stop=[stop], extra_body={"ignore_eos": True})
    # stop string: text cut, tokens counted
    assert got == (text[:text.index(stop)], "stop", m), (got, stop, m)

def test_decoder_failures_stay_with_their_rows(tiny):
    "A failing prefill fails only its newcomers, a failing forward only the rows running; the decoder goes on."
    from gradient_garden.batching import Sequence, SamplingParams
    from gradient_garden.serve.decoder import BatchDecoder
    model, _ = load_model_from_checkpoint(tiny["ckpt"])
    dec, events = BatchDecoder(model, tiny["tok"], max_batch_size=4), {}
    def seq(name, n=6):
        return Sequence(tiny["tok"].encode(name, bos=True),
                        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                        emit=lambda kind, p: events.setdefault(name, []).append((kind, p)))
    first, second = seq("def a(", 30), seq("def b(")
    prefill, forward = dec._prefill, dec._forward
    dec._prefill = lambda tokens, *a: (_
                                       for _ in ()).throw(MemoryError("no room")) if len(dec.rows) else prefill(tokens,
                                                                                                                *a)
    with dec.running():
        dec.submit([first]); dec.step(); dec.step()
        dec.submit([second]); dec.step()                       # its prefill fails; `first` goes on
        assert events["def b("][-1] == ("error", "generation failed for this request: MemoryError: no room")
        assert [k for k, _ in events["def a("]].count("error") == 0 and len(dec.rows) == 1
        dec._forward = lambda col: (_ for _ in ()).throw(RuntimeError("kernel failed"))
        third = seq("def c(")
        # `third` joins, then the shared forward fails: both rows end
        dec.submit([third]); dec.step()
        assert events["def a("][-1][0] == events["def c("][-1][0] == "error" and not dec.rows
        dec._forward, dec._prefill = forward, prefill
        fourth = seq("def d(")
        dec.submit([fourth])
        while dec.step(): pass
    assert events["def d("][-1][0] == "done" and fourth.out == generate(tiny["model"], tiny["tok"], [fourth.prompt], 6,
                                                                        stop_ids=[])[0]
    assert dec.stats["failed"] == 3

def test_a_failing_request_ends_alone_and_sigterm_still_stops(tiny):
    ("A request whose sampling fails inside the decoder process gets a 500 (streamed: an error event) while another "
     "runs on; SIGTERM still stops the server.")
    poisoned = sorted(set(tiny["tok"].encode("def f(")) - set(tiny["tok"].encode("def main(")))[0]
    # its logits: NaN
    proc, url = start_gg_serve(make_checkpoint(tiny["base"], "instruct", tiny["tok_dir"], nan_token=poisoned))
    try:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        long = dict(model="tiny-instruct", prompt="def main(", temperature=0, max_tokens=MAX_LEN - 8, ignore_eos=True)
        bad = dict(model="tiny-instruct", prompt="def f(", temperature=1.0)
        create = lambda body: c.completions.create(**{k: v for k, v in body.items()
                                                      if k not in ("ignore_eos", "repetition_penalty")},
                                                   extra_body={k: v for k, v in body.items()
                                                               if k in ("ignore_eos", "repetition_penalty")})
        with ThreadPoolExecutor(2) as ex:
            good = ex.submit(create, long)
            time.sleep(0.5)
            with pytest.raises(openai.InternalServerError) as e: create(bad)
            msg = e.value.body["message"]
            assert (msg.startswith("generation failed for this request: ValueError: sample_categorical: a row's "
                               "probabilities are NaN")
                    and "\n" not in msg), msg
            events = [l for l in httpx.post(f"{url}/v1/completions", json={**bad, "stream": True},
                                            timeout=60).text.splitlines() if l.startswith("data: ")]
            message = json.loads(events[-1][6:])["error"]["message"]
            assert message.startswith("generation failed for this request"), events[-2:]
            assert good.result().usage.completion_tokens == MAX_LEN - 8        # the other request ran to its end
        h = httpx.get(f"{url}/health").json()
        assert (h["failed"], h["running"]) == (2, 0), h
        with httpx.stream("POST", f"{url}/v1/completions", json={**long, "stream": True}, timeout=60) as r:
            next(r.iter_lines())                                   # a request is running when SIGTERM comes
            t = time.time()
            proc.terminate()
            proc.wait(timeout=30)
        out = proc.stdout.read()
        # uvicorn re-raises it
        assert time.time() - t < 30 and proc.returncode in (0, -signal.SIGTERM), (proc.returncode, out[-2000:])
        assert "Traceback" not in out, out[-2000:]
    finally: stop(proc)
