"""The book's saved outputs are clean: tools/check_book.py finds no absolute path, stderr stream, warning or MFU over
100% beyond the cells its baseline still lists (a list that may only shrink), and catches each kind in a notebook that
has it."""
import json, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT/"tools"))
import check_book  # noqa: E402

def notebook(path: Path, *outputs: list) -> Path:
    "A notebook of code cells with the given outputs."
    cells = [{"cell_type": "code", "metadata": {}, "source": "x", "execution_count": 1, "outputs": o} for o in outputs]
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path

def stream(text, name="stdout"): return {"output_type": "stream", "name": name, "text": text}

def test_the_checker_catches_each_kind_of_unclean_output(tmp_path):
    notebook(tmp_path/"10_bad.ipynb", [stream("saved /tmp/tmpab12/run/metrics.jsonl\n")],
             [stream("progress\r", "stderr")],
             [stream("x.py:3: UserWarning: careful\n")], [stream("steps 20 | mfu 1138.6% | loss 2.1\n")],
             [{"output_type": "execute_result", "data": {"text/plain": "{'mfu': 11.38}"}, "metadata": {},
               "execution_count": 1}],
             [stream("run/metrics.jsonl, /v1/chat/completions, mfu 0.4%, https://example.org/a/b\n")])
    lines = check_book.dirty(tmp_path)
    assert len(lines) == 5, lines   # the last cell is clean: relative paths, API routes, URLs, a sane MFU
    assert "code cell 0 shows an absolute path ('/tmp/tmpab12/run/metrics.jsonl')" in lines[0]
    assert "code cell 1 shows a stderr stream" in lines[1] and "code cell 2 shows a warning" in lines[2]
    assert "an MFU of 1139%" in lines[3] and "an MFU of 1138%" in lines[4]
    assert check_book.over_baseline(lines, {"10_bad.ipynb": 5}) == []
    assert len(check_book.over_baseline(lines, {"10_bad.ipynb": 4})) == 5

def test_the_book_is_within_its_baseline_of_unclean_outputs():
    r = subprocess.run([sys.executable, str(ROOT/"tools"/"check_book.py"), str(ROOT/"nbs")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout
