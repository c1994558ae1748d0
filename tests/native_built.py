"""The C++ kernels built here (or the test skipped where no compiler can build them), and random trees to run them on."""
import os
import random
import shutil

import pytest

from decode import native
from decode.kernels import NativeKernels
from decode.tree import Tree


def compiler_found() -> bool:
    return bool(shutil.which(os.environ.get("CXX", "c++")) and shutil.which("ninja"))


@pytest.fixture
def built() -> NativeKernels:
    if not compiler_found():
        pytest.skip("no C++ compiler or ninja here: decoding uses the portable kernels")
    if native.module() is None:
        pytest.fail("the C++ loops did not build here although a compiler and ninja were found (see the note above)")
    return NativeKernels()


def random_tree(rng: random.Random, n: int, vocab: int) -> Tree:
    """n nodes below random earlier nodes, siblings holding different tokens."""
    tree = Tree.rooted(rng.randrange(vocab))
    while len(tree) < n:
        parent = rng.randrange(len(tree))
        token = rng.randrange(vocab)
        if all(tree.tokens[c] != token for c in tree.children[parent]):
            tree.add(parent, token)
    return tree
