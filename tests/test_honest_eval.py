"Honest evaluation: canonical problem keys, train/dev/test splits, intervals, and GSM8K's test split by default."
import random, re

import numpy as np
import pytest
from scipy import stats

from gradient_garden.data.verifiable import (PROBLEM_SPLITS, TASKS, heldout_examples, sample_examples, split_of,
                                             figure_examples)
from gradient_garden.evals import generative as G


@pytest.mark.parametrize("task", list(TASKS))
def test_twins_share_a_split(task):
    "Problems with the same words in any order and the same answer are one problem: one split, whatever the wording."
    rng, seen = random.Random(1), {}
    for _ in range(20_000):
        key, prompt, answer = TASKS[task](rng)
        sig = (tuple(sorted(re.findall(r"\w+", prompt))), answer)
        seen.setdefault(sig, set()).add(split_of(task, key))
    assert max(len(s) for s in seen.values()) == 1


def test_splits_are_disjoint_and_the_test_set_is_400_distinct_problems():
    test = figure_examples()
    keys = lambda xs: {(e.task, e.key) for e in xs}
    assert len(test) == len(keys(test)) == 400 and {split_of(e.task, e.key) for e in test} == {"test"}
    train, dev = sample_examples(5000, "train", seed=7), heldout_examples(20)
    assert not keys(train) & keys(test) and not keys(dev) & keys(test) and not keys(train) & keys(dev)
    assert {split_of(e.task, e.key) for e in sample_examples(200, "val", seed=3)} == {"dev"}
    assert PROBLEM_SPLITS == ("train", "dev", "test")


def test_the_rl_stage_validates_on_dev_and_evaluate_reports_test():
    dev = G.heldout_examples_for([{"type": "verifiable"}])
    assert [e.prompt for e in dev] == [e.prompt for e in heldout_examples(20)]
    assert [e.prompt for e in G.GENERATIVE_SETS["exact_match"].load(True)] == [e.prompt for e in figure_examples()]


def test_gsm8k_hub_id_scores_the_test_split_unless_train_is_named(monkeypatch):
    import datasets
    asked = []
    def fake_load(path, name=None, split=None, revision=None, **kw):
        asked.append((path, name, split))
        return datasets.Dataset.from_list([{"question": "q", "answer": "x\n#### 3"}])
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    G.GENERATIVE_SETS["gsm8k"].load("openai/gsm8k")
    G.GENERATIVE_SETS["gsm8k"].load("openai/gsm8k:train")
    assert asked == [("openai/gsm8k", "main", "test"), ("openai/gsm8k", "main", "train")]


def test_intervals_match_scipy():
    rng = np.random.default_rng(0)
    for n, p in [(400, 0.2), (194, 0.35), (40, 0.05), (10, 1.0)]:
        hits = (rng.random(n) < p).astype(int).tolist()
        m, se, (lo, hi) = G.mean_interval(hits)
        ci = stats.binomtest(sum(hits), n).proportion_ci(0.95, method="wilson")
        assert abs(m - np.mean(hits)) < 1e-12 and abs(se - stats.sem(hits)) < 1e-12
        assert abs(lo - ci.low) < 1e-9 and abs(hi - ci.high) < 1e-9
    ex = [G.Problem("verifiable", t, "p", "a") for t in ["add"] * 3 + ["upper"] * 2]
    out = G.summarize_hits(ex, [1, 0, 1, 1, 0], [3, 0, 2, 4, 1], 4)
    assert abs(out["avg@4_stderr"] - stats.sem([0.75, 0, 0.5, 1, 0.25])) < 1e-12
    assert abs(out["pass@4_stderr/add"] - stats.sem([1, 0, 1])) < 1e-12


def test_cli_prints_interval_and_per_task_stderr():
    from gradient_garden.cli.evaluate import _task_line
    ex = [G.Problem("verifiable", t, "p", "a") for t in ["add"] * 4]
    m = G.summarize_hits(ex, [1, 0, 1, 1], [1, 0, 1, 1], 1) | {"n": 4, "hits": [1, 0, 1, 1], "source": "generative"}
    first, *table = _task_line("exact_match", m).splitlines()
    lo, hi = m["exact_match_ci95"]
    assert f"exact_match 0.7500 ± {m['exact_match_stderr']:.4f} [{lo:.4f}, {hi:.4f}]" in first
    assert table[1].split()[:4] == ["add", "0.750", "±", f"{m['exact_match_stderr/add']:.3f}"]
