"""`conveyor generate` on a run with an environment plays each prompt's episode: the model's turns
and the environment's answers, the task taken from the run's data (guess_number's target), the
same transcript as the run's own greedy evaluation of that task; a prompt the environment cannot
play is refused in one line with a prompt that it can."""
import json
from pathlib import Path

import pytest

from conveyor.cli import main

pytestmark = pytest.mark.slow  # a short run first

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
FAST = ["sft.steps=20", "loop.steps=1", "loop.batch_size=4", "rollout.n=2", "data.eval_size=4",
        "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
        "loop.time_limit_s=null", "loop.eval_every=0", "observe.tensorboard=false", "observe.progress=false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("episodes") / "run"
    assert main(["train", str(RECIPES / "guess_number.yaml"), *FAST, f"--output-dir={out}"]) == 0
    return out


def _final_greedy(run: Path, task_id: str) -> dict:
    recs = [json.loads(line) for line in (run / "eval_samples.jsonl").read_text().splitlines()]
    last = max(r["step"] for r in recs)
    return next(r for r in recs if r["step"] == last and r["eval"] == "eval" and r["task_id"] == task_id)


def test_generate_plays_the_episode_of_the_runs_task(run, capsys):
    from transformers import AutoTokenizer
    rec = _final_greedy(run, "guess-eval-0")
    capsys.readouterr()
    assert main(["generate", str(run), rec["prompt"]]) == 0
    out = capsys.readouterr().out.rstrip("\n")
    tok = AutoTokenizer.from_pretrained(run / "final")
    expected = rec["completion"]
    for special in tok.all_special_tokens:
        expected = expected.replace(special, "")
    assert out == expected
    assert out.count("\n") == len(rec["turns"]) - 1  # one line per turn: the guess and the answer to it
    # every turn but the last ends with the game's answer to the guess
    assert all(line.split()[-1] in ("higher", "lower", "number") for line in out.split("\n")[:-1]), out


def test_a_prompt_the_environment_cannot_play_is_refused_in_one_line(run, capsys):
    capsys.readouterr()
    assert main(["generate", str(run), "pick one:"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("conveyor: error: the environment (env.name=guess_number) could not play an episode "
                          "of 'pick one:' (crash: "), err
    assert "info['target'] must be an int in [1, 15]" in err and err.endswith("e.g. 'guess 1-15:'"), err
    assert main(["generate", str(run), "guess 1-15:", "--raw"]) == 2
    assert "--raw: a run with an environment (env.name=guess_number)" in capsys.readouterr().err
