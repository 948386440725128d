"""The calculator environment and multi-turn rollouts: the calculator against Python's integers, twin-safe splits,
exact-match rewards that refuse hedges, tool turns rendered and masked as the chat format does, and sampler
log-probabilities equal to one forward over the whole episode."""
import random, re
import pytest
import torch

from gradient_garden.config import ConfigError, ModelConfig, TokenizerConfig
from gradient_garden.evals.environments import (CalculatorEnv, Environment, Step, calc, calc_key, calc_problem,
                                                calc_problems, call_text, env_rollouts, make_environment,
                                                model_sampler, split_of, tool_call, tool_conversation,
                                                tool_turn_ids)
from gradient_garden.models.registry import build_model
from gradient_garden.tokenizer import init_tokenizer, train_bpe


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    texts = [m["content"] for p in calc_problems(300, seed=3) for m in tool_conversation(p)]
    return init_tokenizer(TokenizerConfig(path=str(train_bpe(texts, 640, tmp_path_factory.mktemp("tok")))))


def test_calc_equals_python():
    rng = random.Random(1)
    for _ in range(500):
        a, b = rng.randint(-10 ** 9, 10 ** 9), rng.randint(-10 ** 9, 10 ** 9)
        assert calc(f"{a}+{b}") == str(a + b) and calc(f" {a} - {b} ") == str(a - b)
    for bad in ["2*3", "1+2+3", "__import__('os')", "", "1.5+2", "1e5+1", "9" * 13 + "+1"]:
        assert calc(bad).startswith("error:"), bad
    assert tool_call("x <calc>1+2</calc> y <calc>3+4</calc>") == "1+2" and tool_call("1+2") is None


def test_splits_are_disjoint_and_twins_share_one():
    sets = {s: calc_problems(n, s, seed=5) for s, n in [("train", 1500), ("dev", 150), ("test", 400)]}
    keys = {s: {p.fields["key"] for p in ps} for s, ps in sets.items()}
    assert not (keys["train"] & keys["dev"]) and not (keys["train"] & keys["test"]) and not (keys["dev"] & keys["test"])
    assert len(sets["test"]) == len(keys["test"]) == 400
    for p in sets["test"]:
        a, b = p.fields["a"], p.fields["b"]
        assert 10 ** 3 <= min(a, b) and max(a, b) < 10 ** 6
        assert p.answer == str(a + b if p.task == "add" else a - b) and int(p.answer) >= 0
        if p.task == "add": assert split_of(calc_key("add", b, a)) == "test"
    assert {p.task for p in sets["test"]} == {"add", "subtract"}
    with pytest.raises(ConfigError, match="split: got 'val'"): calc_problems(1, "val")
    with pytest.raises(ConfigError, match="task: got 'mul'"): calc_problem("mul", 1, 2)


@pytest.mark.parametrize("text,reward", [("57340", 1.0), (" 57340.\n", 1.0), ("57341", 0.0), ("57340 or 57341", 0.0),
                                         ("The answer is 57340", 0.0), ("57340\n57341", 0.0), ("", 0.0),
                                         ("057340", 1.0), ("-57340", 0.0)])
def test_final_answer_reward(text, reward):
    env = make_environment("calculator")
    env.reset(calc_problem("add", 48213, 9127))
    assert env.step(text) == Step(None, reward, True)


def test_tool_calls_are_answered_up_to_max_calls():
    env = CalculatorEnv(max_calls=2)
    env.reset(calc_problem("subtract", 48213, 9127))
    assert env.step("<calc>48213-9127</calc>") == Step("39086", 0.0, False)
    assert env.step("<calc>2*3</calc>").observation.startswith("error:")
    assert env.step("<calc>48213-9127</calc>").done        # no calls left: the turn is the (wrong) final answer
    with pytest.raises(ConfigError, match="rl.environment: got 'chess'"): make_environment("chess")


def test_tool_turn_is_masked_from_the_sft_loss(tok):
    p = calc_problem("subtract", 48213, 9127)
    ids, mask = tok.render_chat(tool_conversation(p))
    tool = tool_turn_ids(tok, "39086")
    at = next(i for i in range(len(ids)) if ids[i:i + len(tool)] == tool)
    assert tok.decode(tool).startswith("<|start_header_id|>ipython<|end_header_id|>")
    assert mask[at:at + len(tool)] == [0] * len(tool)
    assert [t for t, m in zip(ids, mask) if m] == (tok.encode(call_text(p)) + [tok.eot_id] + tok.encode("39086")
                                                   + [tok.eot_id])


def _scripted(tok):
    def sample(prompts, group_size):
        outs = []
        for ids in prompts:
            text = tok.decode(ids)
            if "ipython" in text: reply = text.split("ipython<|end_header_id|>\n\n")[-1].split("<|eot_id|>")[0]
            else:
                a, b = map(int, re.findall(r"\d+", text)[-2:])
                reply = call_text(calc_problem("subtract" if " - " in text else "add", a, b))
            outs += [tok.encode(reply) + [tok.eot_id]] * group_size
        return outs, [True] * len(outs), [[-0.25] * len(o) for o in outs]
    return sample


def test_env_rollouts_equal_the_sft_conversation(tok):
    probs = calc_problems(4, "dev", seed=2)
    r = env_rollouts(_scripted(tok), tok, probs, "calculator", group_size=2)
    assert set(r) >= {"prompt_ids", "completion_ids", "logprobs", "tool_mask", "rewards", "ended"}
    for j in range(8):
        ids, mask = tok.render_chat(tool_conversation(probs[j // 2]))
        n = len(r["prompt_ids"][j])
        assert r["prompt_ids"][j] + r["completion_ids"][j] == ids and r["tool_mask"][j] == mask[n:]
        assert [lp != 0 for lp in r["logprobs"][j]] == [bool(m) for m in r["tool_mask"][j]]
    assert r["rewards"].tolist() == [1.0] * 8 and r["ended"] == [True] * 8


def test_truncated_or_out_of_turns_scores_zero(tok):
    p = [calc_problem("add", 48213, 9127)]
    def cut(prompts, g):
        n = len(prompts) * g
        return [tok.encode("57340")] * n, [False] * n, [[-1.0]] * n
    r = env_rollouts(cut, tok, p, "calculator", group_size=2)
    assert r["rewards"].tolist() == [0.0, 0.0] and r["ended"] == [False, False]
    def call(prompts, g):
        o = tok.encode("<calc>1+1</calc>") + [tok.eot_id]
        return [o] * len(prompts) * g, [True] * len(prompts) * g, [[-1.0] * len(o)] * len(prompts) * g
    r = env_rollouts(call, tok, p, lambda: CalculatorEnv(max_calls=9), group_size=1, max_turns=2)
    assert r["rewards"].tolist() == [0.0] and r["ended"] == [False]
    assert r["tool_mask"][0].count(0) == len(tool_turn_ids(tok, "2"))     # one tool turn between the two model turns


class Echo(Environment):
    def step(self, text):
        self.n = getattr(self, "n", 0) + 1
        return Step(str(len(text))) if self.n < 3 else Step(None, 1.0, True)


def test_sampler_logprobs_equal_a_forward_over_the_episode(tok):
    torch.manual_seed(0)
    model = build_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=tok.vocab_size,
                                    max_seq_len=160)).eval()
    stops = [tok.eot_id] + list(range(0, tok.vocab_size, 4))        # an untrained model ends its turns early
    sample = model_sampler(model, 10, stop_ids=stops, generator=torch.Generator().manual_seed(1))
    r = env_rollouts(sample, tok, calc_problems(3, "test"), Echo, group_size=2, max_len=160)
    runs = [sum(1 for a, b in zip([1] + m, m) if a == 1 and b == 0) for m in r["tool_mask"]]
    assert sum(runs) >= 6, runs                        # tool turns in the context of later model turns
    for j in range(6):
        seq = torch.tensor([r["prompt_ids"][j] + r["completion_ids"][j]])
        n, m = len(r["prompt_ids"][j]), torch.tensor(r["tool_mask"][j]).bool()
        with torch.no_grad(): lp = model(seq).float().log_softmax(-1)[0, n - 1:-1].gather(-1, seq[0, n:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r["logprobs"][j])[m], lp[m], atol=1e-4, rtol=0)
        assert torch.tensor(r["logprobs"][j])[~m].abs().sum() == 0


def test_rollout_loader_trains_on_model_tokens_only(tok):
    import dataclasses
    from gradient_garden.config import GlobalConfig
    from gradient_garden.stages.base import IGNORE_INDEX
    from gradient_garden.stages.rewards import Rewarder
    from gradient_garden.stages.rl_rollouts import RolloutLoader, check_environment
    torch.manual_seed(0)
    model = build_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=tok.vocab_size,
                                    max_seq_len=128))
    rl = dataclasses.replace(GlobalConfig().rl, group_size=4, environment="echo-turns", max_new_tokens=8,
                             importance_sampling_correction=True, importance_sampling_mode="token_truncate")
    from gradient_garden.evals.environments import ENVIRONMENTS
    ENVIRONMENTS["echo-turns"] = Echo
    try:
        ld = RolloutLoader(model, tok, calc_problems(8, seed=0), rl, Rewarder(), 128, 4, 2, seed=0)
        ld.stop_ids = [tok.eot_id] + list(range(0, tok.vocab_size, 4))   # an untrained model ends its turns early
        b = ld.next_batch()
    finally: del ENVIRONMENTS["echo-turns"]
    lab = b["labels"] != IGNORE_INDEX
    assert not (b["labels"][lab] == tok.start_header_id).any()
    assert ((b["input_ids"] == tok.start_header_id).sum(1) > 2).any()      # tool turns are in the context
    torch.testing.assert_close(b["sampler_logps"][lab], b["old_logps"][lab], atol=1e-4, rtol=0)
    assert (b["sampler_logps"][~lab] == 0).all()
    with pytest.raises(ConfigError, match="rl.async_rollouts"):
        check_environment(dataclasses.replace(rl, async_rollouts=True))


def test_calculator_sources_for_sft_and_rl(tok):
    from gradient_garden.stages.base import check_messages, check_source
    from gradient_garden.stages.rewards import load_prompts
    from gradient_garden.stages.sft import iter_source_chats, tokenize_chat
    src = check_source({"type": "calculator", "train": 6, "val": 4, "seed": 1}, "data.sources[0]")
    chats = list(iter_source_chats(src, "train", "data.sources[0]"))
    assert [c for _, c in chats] == [tool_conversation(p) for p in calc_problems(6, "train", 1)]
    assert len(list(iter_source_chats(src, "val", "data.sources[0]"))) == 4
    msgs = check_messages(chats[0][1])                                 # the tool role is a chat role of SFT data
    assert tokenize_chat(tok, msgs, 256) is not None
    train, val = load_prompts([src], "train"), load_prompts([src], "val")
    assert [p.prompt for p in train] == [p.prompt for p in calc_problems(6, "train", 1)]
    assert {split_of(p.fields["key"]) for p in val} == {"dev"} and len(val) == 4
    with pytest.raises(ConfigError, match="data.sources\\[0\\].path: unknown key"):
        check_source({"type": "calculator", "path": "x"}, "data.sources[0]")
