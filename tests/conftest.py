import textwrap

import pytest


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
