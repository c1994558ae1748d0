"""A plan made by decode.plan on a test module's tiny models (its `models` fixture), for the tests of the commands
that read plans."""
import json

import pytest

from decode.cli import plan
from decode.planning import costs, search


@pytest.fixture
def planned(models, tmp_path, monkeypatch):
    monkeypatch.setattr(costs, "CACHE_DIR", tmp_path / "costs")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": f"t{i + 2} t{i + 7} t{i + 3}"}) + "\n"
                               for i in range(6)))
    monkeypatch.setattr(search, "BUDGETS", (4, 8, 12))
    monkeypatch.setattr(search, "STAGED_WIDTHS", ((2, 1, 1), (3, 2, 1)))
    args = ["--oracle", str(models["oracle"]), "--draft", str(models["draft"]), "--ngram", str(models["ngram"]),
            "--prompts", str(prompts), "--max-new-tokens", "16", "--widths", "3,2,1"]
    out, replayed, finalists, replay_all = tmp_path / "plan.json", [], [], search.replay_all

    def recorded(candidates, replayer, prompts, desc):  # every candidate; those replayed on every calibration prompt
        replayed.extend(candidates)
        finalists.extend(candidates if not desc.startswith("screening") else [])
        return replay_all(candidates, replayer, prompts, desc)

    monkeypatch.setattr(search, "replay_all", recorded)
    written = plan.main(args + ["--calibration", "3", "--max-budget", "12", "--max-depth", "3", "--draft-vocab", "64",
                                "--concurrency", "1,4", "--out", str(out)])
    return {"args": args, "path": out, "plan": written, "replayed": replayed, "finalists": finalists}


def without(args: list[str], flag: str) -> list[str]:
    """`args` less `flag` and its value."""
    at = args.index(flag)
    return args[:at] + args[at + 2 :]
