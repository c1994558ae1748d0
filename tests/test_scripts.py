"""Every command installs as a console script (staged-NAME) that runs it."""
import importlib
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from decode.cli import scripts
from decode.cli.scripts import COMMANDS


@pytest.mark.processes
def test_every_command_is_a_console_script():
    scripts = {e.name: e for e in entry_points(group="console_scripts") if e.value.startswith("decode.cli.scripts:")}
    assert sorted(scripts) == sorted(f"staged-{name}" for name in COMMANDS)
    for name, script in scripts.items():
        assert callable(script.load()) and callable(importlib.import_module(COMMANDS[name.removeprefix("staged-")]).main)
    shown = subprocess.run([str(Path(sys.executable).parent / "staged-run"), "--help"], capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0 and "--max-new-tokens" in shown.stdout, shown.stderr[-500:]


def test_a_training_script_outside_a_clone_exits_2_saying_where_the_pipelines_run(monkeypatch, capsys):
    monkeypatch.setattr(scripts, "PIPELINES", scripts.PIPELINES + ("absent",))  # as a wheel without the folders
    with pytest.raises(SystemExit) as exit_info:
        scripts.load_command("prepare")
    assert exit_info.value.code == 2 and "run from a clone of the repository" in capsys.readouterr().err
    assert scripts.load_command("run").main  # the decoding commands are the installed package's own
