"""The documentation stays true: the README's code runs, the generated pages match what the commands print, links
resolve, and the repository speaks of the software, never of its making."""
import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from decode.cli import run

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|[a-z]+teenth|[a-z]+tieth"
            "|[a-z]+ty-(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)")
# How a development diary shows: ordinal work sessions or loans, the words of one, issue numbers, files elsewhere
DIARY = re.compile("|".join([
    rf"\b(?:{ORDINALS}) (?:gpu )?(?:session|loan)s?\b",
    r"\bsessions?\b(?!\")",  # pytest's scope="session" aside
    r"\bthis\s+morning\b", r"\bV[M]s?\b", r"\bscratch\b",  # spelled so that a plain grep finds no hit here
    r"(?:^|[^&\w])#\d{1,4}\b", r"\bissue (?:#|no\.? ?)?\d+",
    r"(?-i:\bDESIGN\.md\b)", r"\bhistory\.md\b", r"\.\./shared\b", r"(?-i:\bGPU\.md\b)",
    # the work's own timeline: what came before, what was tried, the budget it ran under
    r"\b(?:with|in|by) the previous\b", r"\ban earlier (?:plan|planner|run|recipe)\b", r"\bhour earlier\b",
    r"\bthe same hour\b", r"\bnot adopted\b", r"\b\d+-minute (?:command|budget)\b", r"\bdevice tool\b",
    # how one machine behaved once, and the reasoning of choices made on it
    r"\bother tenants\b", r"\bthis shared machine\b", r"\bthat machine's\b", r"\btried and dropped\b",
    r"\bso the runs use\b", r"\bran a quarter slower\b",
]), re.I)


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    paths = [ROOT / name for name in names if not name.startswith("docs/results/")]  # a benchmark's records, not prose
    return [p for p in paths if p.is_file() and p != Path(__file__) and p.suffix not in {".png", ".json"}]


def narrative(text: str) -> list[tuple[int, str, str]]:
    """The diary markers in `text`, a phrase broken over two lines too: (line number, what matched, the line)."""
    lines, found = text.splitlines(), []
    for match in DIARY.finditer(text.replace("\n", " ")):
        number = text.count("\n", 0, match.start()) + 1
        if 'scope="session"' not in lines[number - 1]:
            found.append((number, match.group(0), lines[number - 1]))
    return found


def test_no_development_narrative_in_any_tracked_file():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    hits = [f"{path.relative_to(ROOT)}:{number}: {found!r} in {line.strip()[:100]}"
            for path in tracked_text_files() for number, found, line in narrative(path.read_text(errors="replace"))]
    assert not hits, "the repository speaks of the software, not of its making:\n" + "\n".join(hits)


def test_the_diary_markers_catch_what_they_must():
    session, morning, machine, scratch = "sess" + "ion", "mor" + "ning", "V" + "M", "scr" + "atch"  # whole: hits here
    caught = [f"the thirty-eighth {session} measured", f"on the sixth GPU {session}", f"in an earlier {session}",
              f"this {morning}", f"on a slow {machine}", f"a {scratch} script", "the lever of #13", "see issue 12", "DESIGN.md section 6",
              "docs/history.md", "../shared/GPU.md", "with the previous planner", "an earlier plan on an AMD EPYC",
              "an hour earlier one row took", "repeated the same hour", "also measured and not adopted",
              "stages that each fit a 10-minute command", "the device tool's folder", "repeated the same\nhour",
              "Other tenants load it", "this shared machine's noise", "That machine's kernel did not",
              "the draft-sampled trigram, tried and dropped", "so the runs use the corpus", "prompts ran a quarter slower"]
    assert all(narrative(text) for text in caught), [t for t in caught if not narrative(t)]
    kept = ["a second run of setup", '@pytest.fixture(scope="session")', "the first prompt's seed", "#include <vector>",
            "HTML's &#39;", "replace a previous run in OUT", "tokens that followed earlier occurrences"]
    assert not [text for text in kept if narrative(text)]



def test_the_hub_commands_named_are_hf_ones():
    # huggingface_hub 1.0, which transformers 5 requires, removed `huggingface-cli`: `hf auth login`, `hf download`
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    removed = "huggingface" + "-cli"
    hits = [f"{path.relative_to(ROOT)}:{number}" for path in tracked_text_files()
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if removed in line]
    assert not hits, f"{removed} is gone from huggingface_hub 1.0; name `hf` commands instead: {hits}"

# A figure: a number with a unit of speed, time, size or share ("2.65x", "640.8 tok/s", "11 minutes", "99%")
FIGURE = re.compile(r"(?<![\w.,])\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?(?:x\b|\s?(?:tok/s|tokens/s|tokens a second|GB/s|"
                    r"GMAC/s|ms|us|µs|s|seconds?|min|minutes?|hours?|GB|MB|GiB|MiB|%)(?![\w/]))")
GENERATED = re.compile(r"<!-- generated: .*? -->.*?<!-- end generated -->", re.S)
# The figures the prose of a page may hold, every other figure on README.md and docs/*.md coming from results through
# generated blocks: how long a step takes to set up or run, defaults, a test's power, and the paper setting's
# estimates (marked as such there); not measurements of the software
ALLOWED_PROSE = {
    "README.md": ["13-28 minutes", "13-15 minutes", "70 seconds"],
    "docs/exactness.md": ["8 minutes", "99%"],
    "docs/installation.md": ["70 seconds", "10 minutes", "13-15 minutes"],
    "docs/serving.md": ["1 MiB", "30 seconds", "5 seconds", "60%"],
    "docs/planning.md": ["90%", "3 seconds"],
    "docs/profiling.md": ["256 MB"],
    "docs/training.md": ["2 minutes", "10-15 minutes", "10.5-12 s", "4 hours"],
    "docs/your-model.md": ["19 s", "16 minutes", "22 s", "12 minutes", "10 minutes", "0.6 GB", "2.9 GB", "2.8 GB",
                           "5.9 GB", "5.8 GB"],
    "docs/paper-setting.md": ["40%", "80 GB", "1-2 hours", "1 GB", "0.6 GB", "2 hours", "12 GB", "3 GB", "1.5-2 hours",
                              "1.5-3 GB", "0.5 GB", "2 GB", "20x"],
}
PAGES = ["README.md"] + [f"docs/{page.name}" for page in sorted((ROOT / "docs").glob("*.md")) if page.name != "cli.md"]


def figures_outside_generated_blocks(text: str) -> list[str]:
    return FIGURE.findall(GENERATED.sub("", text))


def test_figures_come_from_generated_blocks():
    stray = {page: sorted(set(figures_outside_generated_blocks((ROOT / page).read_text())) - set(ALLOWED_PROSE.get(page, [])))
             for page in PAGES}
    assert not any(stray.values()), f"figures typed by hand; generate them from docs/results or remove them: {stray}"


def test_the_figure_finder_catches_what_it_must():
    text = ("staged ran at 2.65x, 1,622.0 tok/s and 5,475-6,948 tokens/s; a step of 8.0 ms, 63-65 ms in all, 0.2-0.4 us "
            "a context; 25 s, 11 minutes, 172 MB, 36.6 GB/s, 74.8 GMAC/s, 7-17% <!-- generated: x -->9.9x<!-- end generated -->")
    assert figures_outside_generated_blocks(text) == [
        "2.65x", "1,622.0 tok/s", "5,475-6,948 tokens/s", "8.0 ms", "63-65 ms", "0.2-0.4 us", "25 s", "11 minutes",
        "172 MB", "36.6 GB/s", "74.8 GMAC/s", "7-17%"]
    assert not figures_outside_generated_blocks("a 2 x 128 draft, 16 nodes, 5.3M parameters, the 3rd of 50 prompts, "
                                                "--top-k 50, at 2 threads, 12 rows, vectors.h, 0x1023")


def test_the_readme_is_short_and_its_links_resolve():
    assert len(README.splitlines()) <= 250
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://")):
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


@pytest.mark.processes
def test_generated_pages_match_what_the_commands_print():
    done = subprocess.run([sys.executable, "scripts/make_docs.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_each_result_names_its_own_file_in_the_command_that_wrote_it():
    """A result's recorded command, run again, rewrites that very file: one that wrote elsewhere and was copied in
    cannot be rerun as shown (results from before commits were recorded aside)."""
    for path in sorted((ROOT / "docs" / "results").glob("*.json")):
        result = json.loads(path.read_text())
        settings = result.get("settings", result)
        words = shlex.split(settings.get("command", ""))
        if "commit" in settings and "--out" in words:
            assert words[words.index("--out") + 1] == f"docs/results/{path.name}", (path.name, settings["command"])


def readme_block(after: str, language: str) -> str:
    """The first fenced block of `language` after the line that contains `after`."""
    rest = README[README.index(after):]
    return re.search(rf"```{language}\n(.*?)```", rest, re.S)[1]


def test_the_readmes_python_example_runs_on_a_run(bpe_run):
    code = readme_block("From Python, on the run the quickstart builds", "python")
    assert '"runs/quick"' in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace('"runs/quick"', repr(str(bpe_run["run"]))), "README.md", "exec"), {})
    lines = printed.getvalue().splitlines()
    assert any(re.fullmatch(r"\d+ tokens in \d+ oracle calls", line) for line in lines), lines


def test_the_readmes_decoding_commands_run_on_a_run(bpe_run, tmp_path, monkeypatch):
    commands = [line.split("  #")[0] for line in readme_block("## Decoding", "bash").splitlines() if line.strip()]
    assert len(commands) >= 5 and all(c.startswith("python -m decode.run --run runs/quick") for c in commands)
    monkeypatch.chdir(tmp_path)  # --out out.jsonl lands here
    for command in commands:
        argv = shlex.split(command)[3:]
        argv[argv.index("--run") + 1] = str(bpe_run["run"])
        records = run.main(argv + ["--max-new-tokens", "8"])  # the last --max-new-tokens wins: short for a test
        assert records and all(r["new_tokens"] >= 1 for r in records), command
        if "--out" in argv:
            assert (tmp_path / argv[argv.index("--out") + 1]).read_text().count("\n") == len(records)
