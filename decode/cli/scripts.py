"""The console scripts pip installs (pyproject.toml's [project.scripts]): each runs a command's `main` and exits 0,
whatever the main returns for the tests and the Python callers (a console script exits with a main's return value).

    staged-prepare, staged-finetune-oracle, staged-distill-draft, staged-calibrate-training, staged-build-katz,
    staged-run, staged-serve, staged-bench, staged-plan, staged-profile-step, staged-bench-engine,
    staged-agreement, staged-report, staged-export, staged-quantize, staged-shaped, staged-calibrate

`python -m decode.run` and the other module and script paths keep working. The training pipelines (data/, train/,
ngram/) are the repository's folders rather than installed packages: their scripts run where the installed decode
package is a clone's (an editable install), and elsewhere exit 2 saying so.
"""
import importlib
import sys
from pathlib import Path

from decode.errors import InputError, exits_on_input_error

PIPELINES = ("data", "train", "ngram")

COMMANDS = {
    "prepare": "data.prepare", "finetune-oracle": "train.finetune_oracle", "distill-draft": "train.distill_draft",
    "calibrate-training": "train.bf16",
    "build-katz": "ngram.build_katz", "run": "decode.cli.run", "serve": "decode.cli.serve", "bench": "decode.cli.bench",
    "plan": "decode.cli.plan", "profile-step": "decode.cli.profile_step", "bench-engine": "decode.cli.bench_engine",
    "agreement": "decode.cli.agreement", "report": "decode.cli.report", "export": "decode.cli.export",
    "quantize": "decode.cli.quantize",
    "shaped": "decode.cli.shaped", "calibrate": "decode.cli.calibrate", "load": "decode.cli.load",
    "profile-start": "decode.cli.profile_start",
}


def repository() -> Path:
    """The clone this decode package belongs to, whose folders hold the training pipelines."""
    root = Path(__file__).resolve().parents[2]
    if not all((root / folder / "__init__.py").is_file() for folder in PIPELINES):
        raise InputError("the training pipelines (data/, train/, ngram/) run from a clone of the repository: clone it "
                         "and install it with `bash scripts/setup.sh` (or `pip install -e .`) there")
    return root


@exits_on_input_error
def load_command(name: str):
    module = COMMANDS[name]
    if module.split(".")[0] in PIPELINES:
        root = str(repository())
        if root not in sys.path:
            sys.path.insert(0, root)
    return importlib.import_module(module)


def command(name: str) -> None:
    load_command(name).main()


def prepare(): command("prepare")
def finetune_oracle(): command("finetune-oracle")
def distill_draft(): command("distill-draft")
def calibrate_training(): command("calibrate-training")
def build_katz(): command("build-katz")
def run(): command("run")
def serve(): command("serve")
def bench(): command("bench")
def plan(): command("plan")
def profile_step(): command("profile-step")
def bench_engine(): command("bench-engine")
def agreement(): command("agreement")
def report(): command("report")
def export(): command("export")
def quantize(): command("quantize")
def shaped(): command("shaped")
def calibrate(): command("calibrate")
def load(): command("load")
def profile_start(): command("profile-start")
