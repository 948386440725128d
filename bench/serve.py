"""`gg serve` under load: total output tokens/s and time to first token at 1, 8 and 32 concurrent streaming clients.

What it measures: the real server (`gg serve`, a subprocess with `--threads` torch threads, default 1) and
closed-loop clients in this process (each client one keep-alive connection; it sends its next streaming request
as soon as the last one ended). The server's stream interval (`--stream-interval N --stream-interval-ms T`: a
stream's text goes out as one SSE chunk every N tokens or T ms, the first token at once) is the same for every
level and is read back from `/health` and printed; it changes how many chunks carry the tokens, not how many
tokens are counted. Every request is a streamed `/v1/completions` call for exactly `--max-tokens` new
tokens (greedy, `ignore_eos`), so every level does the same work per request. A client counts a request's tokens
from the usage chunk at the end of the stream it read in full (checked to be `--max-tokens`), and the time to first
token when the first text event arrives. tokens/s = all tokens of a level / the level's wall time. The clients are
lean (asyncio streams; they read every byte but parse only the first text event and the last events) because they
share the CPU with the server. After a warm-up level (not counted), the levels run in rotated order over `--rounds`
rounds with the same settings; figures are medians. Models: the debug pretraining and SFT checkpoints when given (or
found under `runs/`), otherwise a randomly initialised model of the debug shape with a locally trained 4k BPE (same
cost per token). `--decoder process thread` measures each model with the decoder in its own process (gg serve's default)
and on a thread of the web server's process, one server after the other. Besides wall-clock figures, the CPU time the
server (both its processes, and the decoder process's share on its own) and the clients spend per output token is
reported, and the load average before and after, because on a shared machine the wall clock mostly says how much of
the CPU the benchmark got.

    python bench/serve.py --checkpoint debug=runs/pretraining/debug --checkpoint sft=runs/instruct/debug
    python bench/serve.py --device cuda --max-batch-size 64 --concurrency 1 8 32 64
    # a random debug-shape model, 1 and 2 clients, one request of 4 tokens each, one round
    python bench/serve.py --smoke

Prints a table per model and, last, one JSON object with the figures (also written to `--out`). Target: 8 clients
>= 4x the tokens/s of one.
"""
from __future__ import annotations
import argparse, asyncio, json, os, socket, statistics, subprocess, sys, tempfile, time
from pathlib import Path
import httpx
from common import add_smoke, apply_smoke, results_path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["def main(", "import os\nimport sys\n", "class Node:\n    def __init__(self", "for i in range(",
           "What is 12 + 7?", "Reverse the word 'garden'.", "The standard library", "with open(path) as f:"]

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", action="append", default=[], metavar="NAME=PATH", help="model to serve (repeatable)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="OMP_NUM_THREADS of the server (1: a decoding step of a small model is too short to split)")
    p.add_argument("--stream-interval", type=int, default=None, metavar="N",
                   help="the server's --stream-interval (tokens per SSE chunk at most; default: gg serve's)")
    p.add_argument("--stream-interval-ms", type=float, default=None, metavar="T",
                   help="the server's --stream-interval-ms (default: gg serve's); the same for every level")
    p.add_argument("--decoder", nargs="+", default=["process"], choices=["process", "thread"],
                   help="gg serve --decoder: decoding in its own process (the default) or on a thread of the web "
                        "server's; several: each model is measured with each, one after the other")
    p.add_argument("--out", default=str(ROOT/"bench/results/serve.json"), help="where the JSON goes")
    args = apply_smoke(add_smoke(p).parse_args(argv), concurrency=[1, 2], requests_per_client=1, max_tokens=4, rounds=1)
    if args.smoke: args.out = str(results_path(args.out, True))
    return args

def default_checkpoints() -> dict[str, str]:
    "The debug runs of this checkout, where they exist."
    runs = (("debug", "runs/pretraining/debug"), ("sft", "runs/instruct/debug"))
    found = {n: ROOT/p for n, p in runs if (ROOT/p/"checkpoints").is_dir()}
    return {n: str(p) for n, p in found.items()}

def random_debug_checkpoint(tmp: Path) -> str:
    "A randomly initialised checkpoint of the debug recipe's model, with a 4k BPE trained on the standard library."
    import torch
    from gradient_garden.config import TokenizerConfig, to_plain
    from gradient_garden.recipes import load_config
    from gradient_garden.checkpoint.checkpoints import save_checkpoint
    from gradient_garden.models.registry import build_model
    from gradient_garden.tokenizer import train_bpe
    import argparse as a, asyncio as b, dataclasses as c, json.decoder as d, pathlib as e, typing as f
    texts = [Path(m.__file__).read_text() for m in (a, b.base_events, c, d, e, f)]
    cfg, _ = load_config(recipe=str(ROOT/"recipes/pretraining/debug.yaml"))
    cfg.tokenizer = TokenizerConfig(backend="huggingface", path=str(train_bpe(texts, cfg.model.vocab_size, tmp/"tok")))
    torch.manual_seed(0)
    state = dict(step=0, stage="pretraining", architecture=cfg.model.architecture, config=to_plain(cfg),
                 model=build_model(cfg.model).state_dict())
    return str(save_checkpoint(state, tmp/"random"/"step_0000000.pt"))

def cpu_seconds(pid: int) -> float:
    "User + system CPU time of process `pid` so far (Linux /proc)."
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def start_server(ckpt: str, args, decoder: str = "process") -> tuple[subprocess.Popen, str]:
    "`gg serve` on a free port; returns (process, base url) once it answers."
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "gradient_garden.cli", "serve", "--checkpoint", ckpt, "--port", str(port),
           "--device", args.device, "--max-batch-size", str(args.max_batch_size), "--threads", str(args.threads),
           "--decoder", decoder, "--log-level", "warning"]
    if args.stream_interval is not None: cmd += ["--stream-interval", str(args.stream_interval)]
    if args.stream_interval_ms is not None: cmd += ["--stream-interval-ms", str(args.stream_interval_ms)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None: raise SystemExit(f"gg serve exited:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200: return proc, url
        except httpx.HTTPError: pass
        time.sleep(0.2)
    raise SystemExit("gg serve did not start")

class Connection:
    """One keep-alive HTTP/1.1 connection of a bench client, on asyncio streams: it reads every byte of each stream but
    parses only the first text event (time to first token) and the last events (usage), so that the clients, which
    share the machine with the server, cost it little CPU."""
    def __init__(self, url: str): self.host, self.port = url.split("//")[1].split(":")
    async def __aenter__(self):
        self.reader, self.writer = await asyncio.open_connection(self.host, int(self.port))
        return self
    async def __aexit__(self, *exc):
        self.writer.close()
        await self.writer.wait_closed()

    async def stream(self, body: dict) -> tuple[float, int]:
        "POST one streaming completion and read it to its end; (seconds to the first text, output tokens)."
        data = json.dumps(body).encode()
        t0, first = time.perf_counter(), None
        self.writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200") or b"chunked" not in head.lower():
            raise SystemExit(f"unexpected answer: {head[:300]!r}")
        tail = b""
        while not tail.endswith(b"\r\n0\r\n\r\n"):    # the last chunk of a chunked body
            got = await self.reader.read(1 << 16)
            if not got: raise SystemExit("the server closed the connection mid-stream")
            if first is None and b'"text": "' in got.replace(b'"text": ""', b""): first = time.perf_counter() - t0
            tail = (tail + got)[-4096:]
        events = [json.loads(line[6:]) for line in tail.split(b"\n") if line.startswith(b"data: {")]
        if b"data: [DONE]" not in tail or not events or not events[-1].get("usage"):
            raise SystemExit(f"stream did not end with a usage chunk and [DONE]: {tail[-300:]!r}")
        return first, events[-1]["usage"]["completion_tokens"]

async def level(url: str, model: str, clients: int, args, server_pid: int | None = None,
                decoder_pid: int | None = None) -> dict:
    "`clients` closed-loop clients, `requests_per_client` requests each, one connection each: tokens/s and TTFT."
    async def client_loop(i, conn):
        out = []
        for j in range(args.requests_per_client):
            body = dict(model=model, prompt=PROMPTS[(i + j) % len(PROMPTS)], max_tokens=args.max_tokens, temperature=0,
                        stream=True, ignore_eos=True, stream_options={"include_usage": True})
            out.append(await conn.stream(body))
        return out
    conns = [Connection(url) for _ in range(clients)]
    for c in conns: await c.__aenter__()
    try:
        cpus = lambda: (cpu_seconds(server_pid) if server_pid else 0.0, time.process_time(),
                        cpu_seconds(decoder_pid) if decoder_pid and decoder_pid != server_pid else 0.0)
        cpu0 = cpus()
        t = time.perf_counter()
        res = await asyncio.gather(*(client_loop(i, c) for i, c in enumerate(conns)))
        wall = time.perf_counter() - t
        cpu1 = cpus()
    finally:
        for c in conns: await c.__aexit__()
    flat = [r for rs in res for r in rs]
    if any(n != args.max_tokens for _, n in flat):
        raise SystemExit(f"a stream had {min(n for _, n in flat)} tokens, not {args.max_tokens}")
    ttft, tokens = sorted(f for f, _ in flat), sum(n for _, n in flat)
    return dict(tokens_per_s=tokens / wall, ttft_median_s=statistics.median(ttft),
                ttft_p90_s=ttft[int(0.9 * (len(ttft) - 1))],
                tokens=tokens, server_cpu_ms_per_token=1000 * (cpu1[0] - cpu0[0] + cpu1[2] - cpu0[2]) / tokens,
                decoder_cpu_ms_per_token=1000 * (cpu1[2] - cpu0[2]) / tokens,
                client_cpu_ms_per_token=1000 * (cpu1[1] - cpu0[1]) / tokens)

def bench_model(name: str, ckpt: str, args, decoder: str = "process") -> dict:
    "All concurrency levels, rotated over rounds, against one server."
    proc, url = start_server(ckpt, args, decoder)
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        health = httpx.get(f"{url}/health").json()
        # what the server really uses; where it decodes
        interval, decoder_pid = health["stream_interval"], health.get("pid")
        # warm-up
        asyncio.run(level(url, model, 2, argparse.Namespace(**{**vars(args), "requests_per_client": 1})))
        runs = {c: [] for c in args.concurrency}
        for r in range(args.rounds):
            order = args.concurrency[r % len(args.concurrency):] + args.concurrency[:r % len(args.concurrency)]
            for c in order: runs[c].append(asyncio.run(level(url, model, c, args, proc.pid, decoder_pid)))
        health = httpx.get(f"{url}/health").json()
    finally:
        proc.terminate(); proc.wait(timeout=30)
    out = {}
    for c, rs in runs.items():
        keys = ("tokens_per_s", "ttft_median_s", "ttft_p90_s", "server_cpu_ms_per_token", "decoder_cpu_ms_per_token",
                "client_cpu_ms_per_token")
        out[c] = {k: statistics.median(r[k] for r in rs) for k in keys}
        out[c]["tokens_per_round"] = rs[0]["tokens"]
    base = out[args.concurrency[0]]["tokens_per_s"]
    for c in out: out[c]["speedup"] = out[c]["tokens_per_s"] / base
    out["stream_interval"], out["decoder"] = interval, decoder
    print(f"\n{name} ({ckpt}); --decoder {decoder}; stream interval {interval['tokens']} tokens or "
          f"{interval['ms']:g} ms (all levels); decoder: {health['steps']} decoding steps, "
          f"{health['prefills']} prefills, {health['realigns']} realigns")
    print(f"{'clients':>8} {'tokens/s':>10} {'x one':>7} {'TTFT median':>12} {'TTFT p90':>9} {'server CPU/token':>17} "
          f"{'(decoder process)':>17} {'client CPU/token':>17}")
    for c, r in ((c, r) for c, r in out.items() if isinstance(c, int)):
        print(f"{c:>8} {r['tokens_per_s']:>10,.0f} {r['speedup']:>6.2f}x {r['ttft_median_s'] * 1000:>10.0f}ms "
              f"{r['ttft_p90_s'] * 1000:>7.0f}ms {r['server_cpu_ms_per_token']:>15.3f}ms "
              f"{r['decoder_cpu_ms_per_token']:>15.3f}ms {r['client_cpu_ms_per_token']:>15.3f}ms")
    return out

def main(argv=None):
    args = parse_args(argv)
    ckpts = dict(c.split("=", 1) for c in args.checkpoint) or ({} if args.smoke else default_checkpoints())
    if not ckpts: ckpts = {"debug-shape (random weights)": random_debug_checkpoint(Path(tempfile.mkdtemp()))}
    load0 = os.getloadavg()
    print(f"concurrency {args.concurrency}, {args.requests_per_client} requests per client x {args.max_tokens} tokens, "
          f"max batch {args.max_batch_size}, server threads {args.threads}, {args.rounds} rounds (medians); "
          f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    results = {(name if len(args.decoder) == 1 else f"{name}/{decoder}"): bench_model(name, ck, args, decoder)
               for name, ck in ckpts.items() for decoder in args.decoder}
    target = {n: r[8]["speedup"] >= 4 for n, r in results.items() if 8 in r and 1 in r}
    load1 = os.getloadavg()
    print(f"load average after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    for n, r in results.items():
        if 8 in r and 1 in r:
            iv = r["stream_interval"]
            print(f"{n}: 8 clients {r[8]['speedup']:.2f}x one client, both at a stream interval of "
                  f"{iv['tokens']} tokens or {iv['ms']:g} ms (target >= 4x: {'met' if target[n] else 'not met'})")
    out = dict(bench="serve", smoke=args.smoke,
               results={n: {str(c): v for c, v in r.items()} for n, r in results.items()}, target_8x_ge_4=target,
               settings={k: v for k, v in vars(args).items() if k != "out"},
               load_average=dict(before=load0, after=load1), cpu_count=os.cpu_count())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))

if __name__ == "__main__": main()
