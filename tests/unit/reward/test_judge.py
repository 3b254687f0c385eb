"""The generative judge: score parsing and aggregation on strings, then the whole path through a
real native engine on two kinds of tiny locally built judges:

- a random tiny Llama, which writes garbage: every judgement is unparseable, so the fallback
  (a value, or the seeded hash of the completion) and the counters are what is checked;
- a "bigram" Llama whose attention and MLP write nothing, so its next token depends on the
  current token alone (a lookup table in its output head): its judgements are predictable
  (always "Score: 7", or a coin between two scores, or a digit chosen by the last character of
  the prompt), which makes pointwise, sampling + aggregation and pairwise results exact.
"""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from conveyor.config import ConfigError, JudgeConfig, load_config
from conveyor.data.tiny import build_model, build_tokenizer
from conveyor.reward.api import BatchReward
from conveyor.reward.judge import JudgeReward
from conveyor.reward.judge_text import (
    CUT,
    ScoreParser,
    aggregate,
    fit_fields,
    hash_score,
    template_problem,
)
from conveyor.reward.service import RewardService
from conveyor.rollout.native import NativeEngine
from conveyor.run.judge_setup import JudgeSetupError, build_judge
from conveyor.types import Task, Trajectory

EOS = "</s>"


# ---- the text side, on strings ----------------------------------------------------------------

@pytest.mark.parametrize("text,value,reason", [
    ("fine work. Score: 7", 0.7, ""),
    ("Score: 2\nOn reflection... Score: 9.5", 0.95, ""),        # the LAST score counts
    ("Score: 10", 1.0, ""), ("Score: 0", 0.0, ""),
    ("Score: 11", None, "out of range"), ("Score: -1", None, "out of range"),
    ("I cannot decide.", None, "no score"), ("score: 7", None, "no score"),
])
def test_parser_reads_the_last_score_and_maps_the_range(text, value, reason):
    got = ScoreParser().parse(text)
    assert got.reason == reason
    assert got.value == (pytest.approx(value) if value is not None else None)


def test_parser_with_its_own_pattern_and_range():
    p = ScoreParser(r"Rating \[(\d+)/5\]", low=1, high=5)
    assert p.parse("Rating [3/5] then Rating [5/5]").value == pytest.approx(1.0)
    assert p.parse("Rating [1/5]").value == 0.0
    assert p.parse("Rating [0/5]").reason == "out of range"
    with pytest.raises(ValueError, match="has no group"):
        ScoreParser(r"Score: \d+")
    with pytest.raises(ValueError, match="low < high"):
        ScoreParser(low=5, high=5)


def test_aggregate_mean_and_vote():
    assert aggregate([0.2, 0.4, 0.9], "mean") == pytest.approx(0.5)
    assert aggregate([0.2, 0.9, 0.9], "vote") == 0.9
    assert aggregate([0.2, 0.9, 0.2, 0.9, 0.5], "vote") == pytest.approx(0.55)  # a tie: the tied values' mean
    with pytest.raises(ValueError):
        aggregate([], "mean")


def test_hash_fallback_is_deterministic_and_seeded():
    a = hash_score("some text", 0)
    assert a == hash_score("some text", 0) and 0.0 <= a < 1.0
    assert a != hash_score("some text", 1) and a != hash_score("other text", 0)


@pytest.mark.parametrize("template,mode,needle", [
    ("{prompt} {completion}", "pointwise", None),
    ("{prompt} {answer} {completion_a} {completion_b}", "pairwise", None),
    ("{prompt} {completion} {reference}", "pointwise", "unknown field(s) {reference}"),
    ("{prompt} {answer}", "pointwise", "never shows {completion}"),
    ("{completion_a} only", "pairwise", "never shows {completion_b}"),
    ("{completion} {}", "pointwise", "positional field"),
    ("{completion.upper}", "pointwise", "attribute or index access"),
    ("{completion", "pointwise", "not a format string"),
])
def test_template_fields_are_checked(template, mode, needle):
    problem = template_problem(template, mode)
    assert (problem is None) if needle is None else (needle in problem)


def test_config_names_bad_judge_fields_before_the_run():
    for override, needle in [
        ("reward.judge.template='{prompt} {completion} {score}'", "unknown field(s) {score}"),
        ("reward.judge.score_pattern='Score: 7'", "score_pattern has no group"),
        ("reward.judge.score_min=10", "score_min (10.0) must be below score_max"),
        ("reward.judge.samples=4", "at temperature 0 are one judgement repeated"),
        ("reward.judge.engine=remote", "needs reward.judge.remote_url"),
        ("reward.judge.aggregate=median", "reward.judge.aggregate"),
    ]:
        extra = ["reward.judge.temperature=0"] if "samples" in override else []
        with pytest.raises(ConfigError) as e:
            load_config(None, ["reward.fn=judge", override, *extra])
        assert needle in str(e.value), (override, str(e.value))
    with pytest.raises(ConfigError, match="reward.judge is set but reward.fn=auto; set reward.fn=judge"):
        load_config(None, ["reward.judge.samples=3"])
    with pytest.raises(ConfigError, match="reward.judge.device='gpu1': give auto, cpu, cuda or cuda:N"):
        load_config(None, ["reward.fn=judge", "reward.judge.device=gpu1"])


def test_fit_fields_cuts_the_longest_field_in_the_middle():
    tok = build_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    render = lambda f: enc(f"Q:{f['prompt']} A:{f['completion']} Score?")
    fields = {"prompt": "1+1", "completion": "x" * 30 + "MIDDLE" + "y" * 30}
    ids = fit_fields(render, fields, ("completion", "prompt"), 40, enc, tok.decode)
    text = tok.decode(ids)
    assert len(ids) <= 40 and CUT in text and "MIDDLE" not in text
    assert text.startswith("Q:1+1 A:xxx") and text.endswith("yyy Score?")  # head and tail kept
    assert fit_fields(render, fields, ("completion", "prompt"), 200, enc, tok.decode) == render(fields)
    assert fit_fields(render, fields, ("completion", "prompt"), 10, enc, tok.decode) is None  # the frame alone is 16


# ---- tiny judges, built here --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def bigram_judge(tok, path, table: dict[str, str | list[str]], context: int = 512):
    """A Llama whose next token is a function of the current one: ``table[token]`` (one token, or
    several equally likely); tokens not in the table go to EOS. Saved at ``path``."""
    vocab = len(tok)
    model = build_model(tok, hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16,
                        max_position_embeddings=context)
    assert vocab <= 128  # one hidden dimension per token
    ids = lambda t: tok.convert_tokens_to_ids(t)
    with torch.no_grad():
        for layer in model.model.layers:  # attention and MLP add nothing: the residual is the embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, 128))
        head = model.lm_head.weight
        head.zero_()
        for t in range(vocab):
            nxt = table.get(tok.convert_ids_to_tokens(t), EOS)
            for n in [nxt] if isinstance(nxt, str) else nxt:
                head[ids(n), t] = 30.0  # x sqrt(128) after the final norm: a certain choice
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def chain(text: str, start: str = "<|assistant|>") -> dict[str, str]:
    """The table that writes ``text`` then EOS after ``start`` (its characters must be distinct)."""
    assert len(set(text)) == len(text)
    seq = [start, *text, EOS]
    return dict(itertools.pairwise(seq))


def judge(path, **cfg) -> JudgeReward:
    engine = NativeEngine.from_pretrained(path, device="cpu", dtype="float32", max_batch=64)
    kw = {k: cfg.pop(k) for k in ("max_batch", "fallback_value", "seed") if k in cfg}
    return JudgeReward(engine, engine.tokenizer, JudgeConfig(**cfg), **kw)


def traj(task_id: str, text: str, prompt: str = "2+2=", answer: str | None = "4", prompt_ids=(1,),
         info=None) -> Trajectory:
    ids = tuple(range(5, 5 + max(1, len(text))))
    return Trajectory(Task(task_id, prompt, answer, info or {}), tuple(prompt_ids), ids, (0.0,) * len(ids),
                      (0,) * len(ids), (1,) * len(ids), text=text)


def test_a_random_judge_writes_garbage_counted_with_the_hash_fallback(tmp_path, tok):
    model = build_model(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                        max_position_embeddings=512, seed=3)
    model.save_pretrained(tmp_path / "random")
    tok.save_pretrained(tmp_path / "random")
    j = judge(str(tmp_path / "random"), fallback="hash", seed=11, max_new_tokens=12, temperature=1.0,
              samples=2)
    assert isinstance(j, BatchReward)
    texts = ["4", "four", "5"]
    out = j.score_batch([traj(f"t{i}", s) for i, s in enumerate(texts)])
    for o, s in zip(out, texts):
        assert o["reward_error"] == "unparseable" and o["judge_fallback"] == 1.0 and o["judge_parsed"] == 0.0
        assert o["reward"] == hash_score(s, 11)
        assert 0 < o["judge_tokens"] <= 12 and o["judge_tokens_per_s"] > 0
    st = j.stats()
    assert (st["calls"], st["items"], st["prompts"], st["samples"]) == (1, 3, 3, 6)
    assert st["unparseable"] == 6 and st["fallbacks"] == 3 and st["out_of_range"] == 0
    assert st["tokens"] == sum(o["judge_tokens"] * 2 for o in out) and st["tokens_per_s"] > 0
    # The value fallback, through the reward service's batching: one call for the whole batch.
    j2 = JudgeReward(j.engine, tok, JudgeConfig(max_new_tokens=12), max_batch=8, fallback_value=-1.0)
    with RewardService(j2, timeout_s=60, fallback=-1.0, workers=1, batch_wait_s=0.05) as svc:
        scored = svc.score([traj(f"t{i}", s) for i, s in enumerate(texts)])
        assert [t.reward for t in scored] == [-1.0] * 3
        assert all(t.reward_info["reward_error"] == "unparseable" for t in scored)
        assert svc.stats()["batches"] == 1 and svc.stats()["failures"] == 0
    assert j2.stats()["fallbacks"] == 3


def test_pointwise_reads_the_score_the_judge_writes(tmp_path, tok):
    path = bigram_judge(tok, tmp_path / "j7", chain("Score: 7"))
    j = judge(path, max_new_tokens=16, temperature=1.0, seed=0)
    out = j.score_batch([traj("a", "4"), traj("b", "5", prompt="3+3=", answer=None)])
    assert [o["reward"] for o in out] == [pytest.approx(0.7)] * 2
    assert all(o["judge_fallback"] == 0.0 and o["judge_parsed"] == 1.0 for o in out)
    assert out[0]["judge_tokens"] == len("Score: 7") + 1  # the characters and EOS
    assert j.stats()["unparseable"] == 0 and j.stats()["fallbacks"] == 0
    # A declared range the judge's number falls outside of is a counted failure.
    j5 = JudgeReward(j.engine, tok, JudgeConfig(max_new_tokens=16, score_max=5), fallback_value=0.25)
    o = j5.score_batch([traj("a", "4")])[0]
    assert (o["reward"], o["reward_error"]) == (0.25, "unparseable")
    assert j5.stats()["out_of_range"] == 1 and j5.stats()["unparseable"] == 1


def test_long_completions_are_cut_to_fit_and_a_template_too_long_is_counted(tmp_path, tok):
    path = bigram_judge(tok, tmp_path / "j7", chain("Score: 7"), context=160)
    j = judge(path, max_new_tokens=16, temperature=1.0, template="Q: {prompt} A: {completion} Judge it.")
    o = j.score_batch([traj("a", "word " * 200)])[0]  # 1000 characters into a 144-token budget
    assert o["reward"] == pytest.approx(0.7) and o["judge_fallback"] == 0.0
    jt = JudgeReward(j.engine, tok, JudgeConfig(max_new_tokens=16, template="x" * 200 + " {completion}"),
                     fallback_value=0.5)
    o = jt.score_batch([traj("a", "4")])[0]
    assert (o["reward"], o["reward_error"], o["judge_fallback"]) == (0.5, "too long", 1.0)
    assert jt.stats()["too_long"] == 1 and jt.stats()["prompts"] == 0
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        JudgeReward(j.engine, tok, JudgeConfig(max_new_tokens=160))


def test_samples_are_aggregated_by_mean_and_by_vote(tmp_path, tok):
    table = {**chain("Score: "), " ": ["3", "8"], "3": EOS, "8": EOS}  # each judgement a fair coin: 3 or 8
    path = bigram_judge(tok, tmp_path / "coin", table)
    k = 7
    mean = judge(path, max_new_tokens=16, temperature=1.0, samples=k, aggregate="mean", seed=5)
    vote = JudgeReward(mean.engine, tok, JudgeConfig(max_new_tokens=16, temperature=1.0, samples=k,
                                                     aggregate="vote"), seed=5)
    trajs = [traj(f"t{i}", f"answer {i}") for i in range(6)]
    m = [o["reward"] for o in mean.score_batch(trajs)]
    v = [o["reward"] for o in vote.score_batch(trajs)]  # the same call and seed: the same samples
    assert mean.stats()["samples"] == 6 * k and mean.stats()["prompts"] == 6  # one generate, n = k
    possible = {round((j * 0.8 + (k - j) * 0.3) / k, 9) for j in range(k + 1)}
    assert all(round(x, 9) in possible for x in m)
    assert len(set(m)) > 1  # the samples really differ between items
    for x, y in zip(m, v):  # the majority of k = 7 coins is 8 exactly when the mean is above 0.55
        assert y == pytest.approx(0.8 if x > 0.55 else 0.3)


def pairwise_judge(tmp_path, tok, **cfg) -> JudgeReward:
    """Pairwise on the last character of response B: "a" (bad) -> 9 (A better), "b" (good) -> 0."""
    path = bigram_judge(tok, tmp_path / "pair", {"a": "9", "b": "0", "9": EOS, "0": EOS})
    return judge(path, mode="pairwise", template="{prompt}|{completion_a}|{completion_b}",
                 chat_template=False, score_pattern=r"(\d)", score_max=9, max_new_tokens=4, temperature=1.0,
                 **cfg)


def test_pairwise_win_rates_within_a_group_cancel_position_bias(tmp_path, tok):
    j = pairwise_judge(tmp_path, tok)
    group = [traj("g", "xa"), traj("g", "yb"), traj("g", "zb")]
    other = [traj("h", "pb", prompt="5+5=", answer="10"), traj("h", "qa", prompt="5+5=", answer="10")]
    out = j.score_batch([group[0], other[0], group[1], other[1], group[2]])
    # x loses every comparison; y and z beat x and each win one of their two mutual orders.
    assert [o["reward"] for o in out] == [0.0, 1.0, 0.75, 0.0, 0.75]
    assert j.stats()["prompts"] == 3 * 2 + 2 * 1  # m (m - 1) ordered pairs per group
    assert all(o["judge_parsed"] == 1.0 for o in out)


def test_pairwise_lone_samples_meet_the_reference_or_get_the_fallback(tmp_path, tok):
    j = pairwise_judge(tmp_path, tok, fallback_value=0.125, aggregate="vote")
    out = j.score_batch([traj("r1", "ub", answer="4b"), traj("r2", "va", answer="4b"), traj("r3", "wb", answer=None)])
    # vs a reference ending in "b": as A it loses (B is good); as B, "b" wins and "a" loses.
    assert [o["reward"] for o in out] == [0.5, 0.0, 0.125]
    assert out[2]["reward_error"] == "no pair" and "reward_error" not in out[0]
    assert j.stats()["no_pair"] == 1 and j.stats()["prompts"] == 4


# ---- building the judge from the config ------------------------------------------------------------

def test_build_judge_names_what_is_wrong(tmp_path, tok):
    good = bigram_judge(tok, tmp_path / "good", chain("Score: 7"))

    def cfg(*overrides):
        return load_config(None, ["reward.fn=judge", "reward.judge.device=cpu", *overrides])

    j = build_judge(cfg(f"reward.judge.model={good}", "reward.max_batch=16"), "/nowhere")
    assert j.max_batch == 16 and j.engine.label.startswith("native engine")
    j.close()
    with pytest.raises(JudgeSetupError, match="reward.judge.model '/no/such/judge' is not a Hugging Face checkpoint"):
        build_judge(cfg("reward.judge.model=/no/such/judge"), "/nowhere")
    with pytest.raises(JudgeSetupError, match=r"the policy's base checkpoint '/nowhere'\) is not a Hugging Face"):
        build_judge(cfg(), "/nowhere")
    clf = tmp_path / "classifier"
    clf.mkdir()
    (clf / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                 "model_type": "llama"}))
    with pytest.raises(JudgeSetupError, match="is a LlamaForSequenceClassification model, not a causal language"):
        build_judge(cfg(f"reward.judge.model={clf}"), "/nowhere")
    with pytest.raises(JudgeSetupError, match=r"reward.max_batch \(30\) must be a multiple of rollout.n \(8\)"):
        build_judge(cfg(f"reward.judge.model={good}", "reward.judge.mode=pairwise", "reward.max_batch=30",
                        "rollout.n=8"), "/nowhere")
    with pytest.raises(JudgeSetupError, match="max_new_tokens=600 leaves no room"):
        build_judge(cfg(f"reward.judge.model={good}", "reward.judge.max_new_tokens=600"), "/nowhere")
    plain = tmp_path / "plain"
    bigram_judge(tok, plain, {})
    data = json.loads((plain / "tokenizer_config.json").read_text())
    data.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(data))
    for f in plain.glob("chat_template.*"):
        f.unlink()
    with pytest.raises(JudgeSetupError, match="has no chat template; set reward.judge.chat_template=false"):
        build_judge(cfg(f"reward.judge.model={plain}"), "/nowhere")
    build_judge(cfg(f"reward.judge.model={plain}", "reward.judge.chat_template=false"), "/nowhere").close()


def test_a_judge_device_this_machine_lacks_is_refused_before_the_run():
    from conveyor.launch.preflight import DeviceError, check_devices
    judge_on = ["reward.fn=judge", "reward.judge.device=cuda:1"]
    with pytest.raises(DeviceError, match=r"reward.judge.device=cuda:1 but only 1 CUDA GPU\(s\) are visible"):
        check_devices(load_config(None, judge_on), visible_gpus=1)
    with pytest.raises(DeviceError, match="reward.judge.device=cuda:1 but this machine has no usable CUDA GPU"):
        check_devices(load_config(None, judge_on), visible_gpus=0)
    check_devices(load_config(None, judge_on), visible_gpus=2)
    remote = ["reward.judge.engine=remote", "reward.judge.remote_url=http://127.0.0.1:9"]
    check_devices(load_config(None, [*judge_on, *remote]), visible_gpus=0)  # a server's GPUs are its own


def judge_server(tok):
    """An OpenAI-compatible server on loopback that plays a judge: it reads the prompt's token
    ids and answers "Score: 9" when the response is "4", else "Score: 1" (vLLM's reply format)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, payload):
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send({"data": [{"id": "judge", "max_model_len": 512}]} if self.path == "/v1/models" else {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            text = "Looks right. Score: 9" if "Response: 4\n" in tok.decode(body["prompt"]) else "No. Score: 1"
            ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            choice = {"text": text, "finish_reason": "stop", "token_ids": ids,
                      "logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": [0.0] * len(ids)}}
            self._send({"choices": [dict(choice, index=i) for i in range(body["n"])]})

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, seen


def test_a_remote_judge_over_http(tmp_path, tok):
    path = bigram_judge(tok, tmp_path / "tokenizer", {})  # the judge's tokenizer (and EOS) only
    httpd, seen = judge_server(tok)
    try:
        cfg = load_config(None, ["reward.fn=judge", "reward.judge.engine=remote", f"reward.judge.model={path}",
                                 f"reward.judge.remote_url=http://127.0.0.1:{httpd.server_address[1]}",
                                 "reward.judge.samples=3", "reward.judge.temperature=1.0"])
        j = build_judge(cfg, "/nowhere")
        chat = "<|user|>What is 2+2?\n<|assistant|>"  # the policy's prompt; the judge reads the raw question
        out = j.score_batch([traj("a", "4", prompt=chat, info={"raw_prompt": "What is 2+2?"}), traj("b", "5")])
        assert [o["reward"] for o in out] == [pytest.approx(0.9), pytest.approx(0.1)]
        judged = sorted(tok.decode(b["prompt"]) for b in seen)  # requests run concurrently
        assert "Task: 2+2=\n" in judged[0] and "Task: What is 2+2?\n" in judged[1]
        assert not any("<|user|>What" in p for p in judged)
        assert all(o["judge_parsed"] == 1.0 for o in out)
        assert [b["n"] for b in seen] == [3, 3] and j.stats()["samples"] == 6
        j.close()
    finally:
        httpd.shutdown()
        httpd.server_close()
