import json
import os
import signal
import textwrap
from pathlib import Path

import pytest
from native_built import built  # noqa: F401  (the C++ kernels' tests' fixture: the kernels built here)
from plan_fixtures import planned  # noqa: F401  (the plan tests' fixture: a plan decode.plan made on their models)

ROOT = Path(__file__).resolve().parent.parent


def child_env(**extra) -> dict:
    """This process's environment for a child Python process, with the repository first on its path."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false", **extra}


# --dtype auto resolves by the machine's instructions; the suite pins it so that a test decodes alike on every CPU
# (the tests of auto itself unset it)
os.environ["STAGED_SPECULATIVE_DTYPE"] = "float32"


def write_corpus(root, n_files=60):
    """A small package of Python files: functions with docstrings, imports, and a few duplicates."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        source = textwrap.dedent(
            f'''\
            import math
            import os.path as osp
            from collections import Counter


            def scale_{i}(values, factor={i}):
                """Multiply every value by {i} and return the list."""
                return [v * factor + math.pi for v in values]


            def count_words_{i}(text):
                """Count the words of `text`, ignoring case."""
                counts = Counter(text.lower().split())
                return counts


            class Box{i}:
                def __init__(self):
                    self.path = osp.join("a", "{i}")
            '''
        )
        (root / f"module_{i:03d}.py").write_text(source)
    (root / "sub").mkdir(exist_ok=True)
    (root / "sub" / "copy_of_0.py").write_text((root / "module_000.py").read_text())
    (root / "notes.txt").write_text("not python")
    return root


@pytest.fixture
def corpus_dir(tmp_path):
    return write_corpus(tmp_path / "src")


@pytest.fixture(scope="session")
def bpe_run(tmp_path_factory):
    """A run with a byte-level BPE tokenizer trained on a small corpus, tiny random models and a trigram."""
    from decode_models import PROMPTS, tiny_gpt2

    from data import prepare
    from decode.tokenizer import load_tokenizer
    from ngram import build_katz

    root = tmp_path_factory.mktemp("bpe")
    prepare.main(["--path", str(write_corpus(root / "src")), "--out", str(root / "run"), "--vocab-size", "400"])
    tokenizer = load_tokenizer(root / "run" / "tokenizer")
    oracle = tiny_gpt2(root / "run" / "oracle", vocab_size=len(tokenizer), seed=0, tokenizer=tokenizer)
    tiny_gpt2(root / "run" / "draft", vocab_size=len(tokenizer), seed=1, noise_from=oracle, noise=0.005, tokenizer=tokenizer)
    build_katz.main(["--out", str(root / "run" / "ngram")])
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"task_id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return {"run": root / "run", "tokenizer": tokenizer, "prompts": prompts}


# The tiny models a topic's test modules share (each was one module before it grew past 400 lines), made once
@pytest.fixture(scope="session")
def plan_run_models(tmp_path_factory):
    from decode_models import run_models

    return run_models(tmp_path_factory.mktemp("plan"))


@pytest.fixture(scope="session")
def tree_run_models(tmp_path_factory):
    from decode_models import tree_models

    return tree_models(tmp_path_factory.mktemp("tree"))


@pytest.fixture(scope="session")
def trained_oracle_run(tmp_path_factory):
    """A prepared run with a trained tiny oracle, and the training's metrics."""
    from train_runs import trained_run

    return trained_run(tmp_path_factory.mktemp("train"))


# Fixtures that train a model or run the whole planner: a test that uses one is a pipeline test, which the fast tier
# (bash scripts/test.sh --fast) leaves out
PIPELINE_FIXTURES = {"trained_oracle_run", "trained_llama_run", "planned"}


def pytest_collection_modifyitems(items):
    for item in items:
        if PIPELINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.pipeline)


@pytest.fixture
def interruptible():
    """Python's Ctrl-C handler, which raises KeyboardInterrupt. A Python started with SIGINT ignored (a background
    job of a non-interactive shell, `nohup bash .ci/run &`) keeps ignoring it, and these tests would see nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
