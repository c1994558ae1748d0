import ast
import gzip
import json
from collections import Counter

import numpy as np
import pytest
from conftest import write_corpus
from transformers import AutoTokenizer

from data import corpus, harvest, prepare, shards
from data.tokenizer import END_OF_TEXT, train_bpe
from decode import prompts
from decode.errors import InputError


def error_line(capsys) -> str:
    """The one error line a command printed (progress bars may share stderr)."""
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    return errors[0]


def prepare_run(corpus_dir, out, *extra):
    prepare.main(["--path", str(corpus_dir), "--out", str(out), "--vocab-size", "400",
                  "--val-fraction", "0.3", *extra])
    return out


def test_split_is_deterministic_disjoint_and_drops_duplicates(corpus_dir):
    runs = []
    for _ in range(2):
        skipped = Counter()
        runs.append(corpus.collect(corpus.local_documents([corpus_dir], skipped), 0.3, skipped))
    assert runs[0] == runs[1]
    train = {d.text for d in runs[0]["train"]}
    val = {d.text for d in runs[0]["val"]}
    assert train and val and not train & val
    names = [d.name for split in runs[0].values() for d in split]
    assert len(names) == 60 and skipped["duplicate"] == 1
    assert "notes.txt" not in names
    # the split depends on the content alone, not on which files were read before
    assert all(corpus.split_of(d.text, 0.3) == "val" for d in runs[0]["val"])


def test_collect_caps_documents_and_bytes(corpus_dir):
    docs = lambda: corpus.local_documents([corpus_dir], Counter())  # noqa: E731
    assert sum(map(len, corpus.collect(docs(), 0.3, Counter(), max_docs=7).values())) == 7
    capped = corpus.collect(docs(), 0.3, Counter(), max_bytes=1000)
    kept = [d for split in capped.values() for d in split]
    assert sum(len(d.text) for d in kept[:-1]) < 1000 <= sum(len(d.text) for d in kept)


def test_unreadable_and_non_utf8_files_are_skipped_with_a_count(corpus_dir):
    (corpus_dir / "latin1.py").write_bytes("# caf\xe9\n".encode("latin-1"))
    skipped = Counter()
    corpus.collect(corpus.local_documents([corpus_dir], skipped), 0.3, skipped)
    assert skipped["not UTF-8"] == 1


def test_stdlib_default_excludes_installed_packages():
    files = corpus.python_files(corpus.stdlib_dir())
    assert len(files) > 500
    assert not any("site-packages" in f.parts for f in files)


TRICKY = [
    "def f(x):\n\treturn x  \n",
    "s = 'naïve café ∑ 日本語 🐍'\n\n\n",
    "x = 1\r\ny = 2\r\n",
    "   leading spaces\n\n    \n\t\t\n",
    "",
    "a" * 300 + "   \n",
]


def test_bpe_round_trips_source_exactly(tmp_path, corpus_dir):
    texts = [p.read_text() for p in sorted(corpus_dir.glob("*.py"))]
    tokenizer = train_bpe(texts, vocab_size=400)
    tokenizer.save_pretrained(tmp_path / "tok")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    for t in (reloaded, tokenizer):
        assert t.eos_token == END_OF_TEXT
        for text in TRICKY + texts[:3]:
            ids = t.encode(text, add_special_tokens=False)
            assert t.decode(ids) == text


def test_vocabulary_too_small_is_refused(tmp_path, corpus_dir, capsys):
    with pytest.raises(SystemExit) as exit_:
        prepare_run(corpus_dir, tmp_path / "run", "--vocab-size", "100")
    assert exit_.value.code == 2
    assert "vocabulary size 100 is too small" in error_line(capsys)
    assert not (tmp_path / "run" / "tokenizer").exists()


def test_prepare_writes_shards_that_decode_back_to_the_documents(tmp_path, corpus_dir):
    run = prepare_run(corpus_dir, tmp_path / "run")
    meta = shards.read_meta(run / "data")
    tokenizer = AutoTokenizer.from_pretrained(run / "tokenizer")
    assert meta["vocab_size"] == len(tokenizer) and meta["dtype"] == "uint16"
    splits = corpus.collect(corpus.local_documents([corpus_dir], Counter()), 0.3, Counter())
    for name in corpus.SPLITS:
        tokens = shards.open_split(run / "data", name)
        assert isinstance(tokens, np.memmap) and tokens.size == meta["splits"][name]["tokens"]
        decoded = [tokenizer.decode(d.tolist()) for d in shards.split_documents(tokens, tokenizer.eos_token_id)]
        assert decoded == [d.text for d in splits[name]]
    assert not list(run.glob(".*tmp*")) and not list((run / "data").glob(".*"))


def test_prepare_refuses_to_overwrite_without_flag(tmp_path, corpus_dir, capsys):
    run = prepare_run(corpus_dir, tmp_path / "run")
    with pytest.raises(SystemExit):
        prepare_run(corpus_dir, run)
    assert "--overwrite" in error_line(capsys)
    prepare_run(corpus_dir, run, "--overwrite")
    assert shards.read_meta(run / "data")["vocab_size"] > 256


def test_harvested_prompts_are_signature_and_docstring_from_validation_files(tmp_path, corpus_dir):
    run = prepare_run(corpus_dir, tmp_path / "run")
    records = prompts.read_jsonl(run / "prompts.jsonl")
    splits = corpus.collect(corpus.local_documents([corpus_dir], Counter()), 0.3, Counter())
    val_names = {d.name for d in splits["val"]}
    assert len(records) >= 10
    for r in records:
        assert r["task_id"].split("::")[0] in val_names
        module = ast.parse(r["prompt"])
        fn = module.body[-1]
        assert isinstance(fn, ast.FunctionDef) and fn.name == r["entry_point"]
        assert len(fn.body) == 1 and ast.get_docstring(fn) is not None  # signature + docstring, no body
        assert r["prompt"].rstrip().endswith('"""')
        # the imports the function uses come with it, the others do not
        used = "math" if fn.name.startswith("scale") else "Counter"
        assert f"import {used}" in r["prompt"] and "osp" not in r["prompt"]
        ast.parse(r["prompt"] + r["canonical_solution"])


def test_harvest_keeps_only_top_level_functions_with_docstring_and_body():
    doc = corpus.Document("m.py", (
        'def only_doc():\n    """Only a docstring."""\n\n'
        "def no_doc():\n    return 1\n\n"
        'def test_thing():\n    """A test."""\n    assert True\n\n'
        'class K:\n    def method(self):\n        """Doc."""\n        return 2\n\n'
        'def _helper(x):\n    """Private helpers count."""\n    return x\n'
    ))
    assert [p["entry_point"] for p in harvest.harvest_file(doc)] == ["_helper"]


def test_prompts_harvested_from_other_code_name_their_package_and_keep_the_limits(tmp_path, corpus_dir, capsys):
    run = prepare_run(corpus_dir, tmp_path / "run")
    other = write_corpus(tmp_path / "other", n_files=8)
    out = tmp_path / "other.jsonl"
    harvest.main([str(other), "json", "--run", str(run), "--out", str(out), "--per-file", "1", "--max-prompt-tokens", "80"])
    records = prompts.read_jsonl(out)
    files = [r["task_id"].split("::")[0] for r in records]
    assert len(files) == len(set(files)) >= 8  # one a file
    assert {f.split("/")[0] for f in files} == {"other", "json"}  # the package named, the stdlib's json by import name
    tokenizer = AutoTokenizer.from_pretrained(run / "tokenizer")
    assert all(len(tokenizer(r["prompt"]).input_ids) <= 80 for r in records)
    assert "json/__init__.py" not in files  # json.dump's long docstring is over the limit
    assert f"wrote {out}: {len(records)} prompts" in capsys.readouterr().out
    harvest.main([str(other), "--run", str(run), "--out", str(out), "--count", "3", "--overwrite"])
    assert len(prompts.read_jsonl(out)) == 3


@pytest.mark.parametrize("source, out, message", [
    ("no_such_package_here", "p.jsonl", "neither a directory nor an installed package"),
    ("{other}", "{other}/p.jsonl", "which this command reads as its source"),
    ("{other}", "{kept}", "already holds a file; pass --overwrite"),
    ("{empty}", "p.jsonl", "no .py files under"),
])
def test_harvesting_bad_sources_or_outputs_is_a_one_line_error_that_writes_nothing(
        tmp_path, corpus_dir, capsys, source, out, message):
    run = prepare_run(corpus_dir, tmp_path / "run")
    other, kept = write_corpus(tmp_path / "other", n_files=2), tmp_path / "kept.jsonl"
    kept.write_text("mine\n")
    before = sorted(p.name for p in other.iterdir())
    paths = {"other": other, "kept": kept, "empty": tmp_path / "empty"}
    paths["empty"].mkdir()
    with pytest.raises(SystemExit) as exit:
        harvest.main([source.format(**paths), "--run", str(run), "--out", str(tmp_path / out.format(**paths))])
    assert exit.value.code == 2 and message in error_line(capsys)
    assert sorted(p.name for p in other.iterdir()) == before and kept.read_text() == "mine\n"


def test_humaneval_jsonl_and_gz_load(tmp_path):
    rows = [{"task_id": "HumanEval/0", "prompt": "def f():\n    \"\"\"x\"\"\"\n"}, {"task_id": "HumanEval/1", "prompt": "def g(): pass\n"}]
    prompts.write_jsonl(rows, tmp_path / "p.jsonl")
    with gzip.open(tmp_path / "p.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    assert prompts.load_prompts(str(tmp_path / "p.jsonl")) == rows
    assert prompts.load_prompts(str(tmp_path / "p.jsonl.gz"), limit=1) == rows[:1]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"task_id": "a", "prompt": "x"}\n{"task_id": "b", "prompt": \n', "p.jsonl:2: not valid JSON"),
        ('{"task_id": "a", "prompt": ""}\n', "p.jsonl:1: 'prompt' must be a non-empty string"),
        ('["a"]\n', "p.jsonl:1: expected an object"),
        ("\n\n", "holds no prompts"),
    ],
)
def test_malformed_prompts_file_names_the_line(tmp_path, content, message):
    (tmp_path / "p.jsonl").write_text(content)
    with pytest.raises(InputError, match=message):
        prompts.read_jsonl(tmp_path / "p.jsonl")


@pytest.mark.parametrize(
    "make_path, message",
    [
        (lambda tmp: tmp / "missing", "does not exist"),
        (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "no .py files"),
        (lambda tmp: (tmp / "txt").mkdir() or (tmp / "txt" / "a.txt").write_text("x") and tmp / "txt", "no .py files"),
    ],
)
def test_bad_source_directory_is_a_one_line_error(tmp_path, capsys, make_path, message):
    with pytest.raises(SystemExit) as exit_:
        prepare.main(["--path", str(make_path(tmp_path)), "--out", str(tmp_path / "run")])
    assert exit_.value.code == 2
    assert message in error_line(capsys)
    assert not (tmp_path / "run" / "data").exists() and not (tmp_path / "run" / "tokenizer").exists()


def test_unwritable_output_directory_is_a_one_line_error(tmp_path, corpus_dir, capsys):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exit_:
        prepare.main(["--path", str(corpus_dir), "--out", str(tmp_path / "file" / "run")])
    assert exit_.value.code == 2
    assert "is a file; pass another --out" in error_line(capsys)
