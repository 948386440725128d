"""The chat page in a real headless browser: Debian's Chromium driven by Playwright (the system browser; nothing is
downloaded at test time). Skipped, with the reason, where no browser is installed (`make install-dev` installs
`chromium` with apt-get where it can)."""
import os, shutil, threading
from pathlib import Path

import pytest

from test_serve import free_port, make_checkpoint, reference, chat_ids, wait_ready

CHROMIUM = next((p for p in (os.environ.get("GG_CHROMIUM"), "/usr/bin/chromium", "/usr/bin/chromium-browser",
                             shutil.which("chromium") or "") if p and Path(p).is_file()), None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync"]

pytestmark = [pytest.mark.skipif(CHROMIUM is None,
                                 reason="no Chromium found (/usr/bin/chromium; apt-get install chromium)")]
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (python package) is not installed")

@pytest.fixture(scope="module")
def page_server(tmp_path_factory):
    "A real uvicorn server in this process serving a tiny instruct checkpoint."
    import uvicorn
    from gradient_garden.checkpoint.checkpoints import load_model_from_checkpoint
    from gradient_garden.serve.api import Served
    from gradient_garden.serve.app import create_app
    from gradient_garden.serve.decoder import BatchDecoder
    from gradient_garden.tokenizer import init_tokenizer, train_bpe
    from test_serve import _corpus
    base = tmp_path_factory.mktemp("page")
    tok_dir = train_bpe(_corpus(), 640, base/"tok")
    model, cfg = load_model_from_checkpoint(make_checkpoint(base, "instruct", tok_dir))
    tok = init_tokenizer(cfg.tokenizer)
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a generator?"}]
    want = reference(dict(model=model, tok=tok), chat_ids(dict(tok=tok), msgs), 64)[0]
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(Served(BatchDecoder(model, tok), "tiny-instruct")), host="127.0.0.1",
                                        port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{port}"
    wait_ready(url)
    yield dict(url=url, msgs=msgs, want=want)
    srv.should_exit = True
    th.join(timeout=30)

def test_page_streams_a_reply(page_server, tmp_path):
    "Load `/`, set greedy sampling and a system prompt, send a message, watch the reply stream in, take a screenshot."
    shot = Path(os.environ.get("GG_SCREENSHOT", tmp_path/"serve.png"))
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 640})
            requests = []
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_server["url"] + "/")
            sync_api.expect(page.locator("#model")).to_contain_text("tiny-instruct")
            page.fill("#system", page_server["msgs"][0]["content"])
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "64")
            page.evaluate("""() => { window.updates = 0;            // count how often the reply's text changes
                new MutationObserver(ms => ms.forEach(m => {
                    if (m.target.classList && m.target.classList.contains("assistant")) window.updates++; }))
                  .observe(document.getElementById("log"), {childList: true, subtree: true, characterData: true}); }""")
            page.fill("#input", page_server["msgs"][1]["content"])
            page.press("#input", "Enter")
            sync_api.expect(page.locator(".msg.user")).to_have_text(page_server["msgs"][1]["content"])
            reply = page.locator(".msg.assistant").last
            sync_api.expect(reply).not_to_have_class("msg assistant streaming", timeout=30_000)
            assert reply.text_content() == page_server["want"]
            updates = page.evaluate("window.updates")
            assert updates > 1, updates                          # it arrived in pieces, not at once
            sync_api.expect(page.locator("#stats")).to_contain_text("tokens in")
            page.screenshot(path=str(shot))
        finally: browser.close()
    assert shot.stat().st_size > 5_000
    assert all(u.startswith(page_server["url"]) for u in requests), requests     # nothing loaded from elsewhere
