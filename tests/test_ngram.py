import json
from collections import Counter

import numpy as np
import pytest
from nltk.util import ngrams

from data import prepare
from decode.models.successors import SuccessorTable
from ngram import build_katz
from ngram.counts import Vocabulary, count
from ngram.katz import estimate, good_turing_discounts

V = 400
UNUSED = 10  # the top ids never occur in training: unseen tokens
EOS_ID = V - 1  # the end-of-text id that stands for </s> in successor tables (unused in the documents)


def markov_corpus(n_docs, seed):
    """Zipfian unigrams mixed with a sparse second-order Markov chain, so every order has structure."""
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, V - UNUSED + 1) ** 1.05
    p /= p.sum()
    successors = np.random.default_rng(0).integers(0, V - UNUSED, (V, 3))
    docs = []
    for _ in range(n_docs):
        doc = [int(rng.choice(V - UNUSED, p=p))]
        for _ in range(int(rng.integers(0, 60))):
            state = (doc[-1] + 31 * (doc[-2] if len(doc) > 1 else 0)) % V
            doc.append(int(successors[state, rng.integers(3)]) if rng.random() < 0.6 else int(rng.choice(V - UNUSED, p=p)))
        docs.append(np.array(doc))
    return docs


def write_tokens(path, docs):
    path.write_text("".join(" ".join(map(str, d)) + "\n" for d in docs))
    return path


@pytest.fixture(scope="module")
def corpus():
    return markov_corpus(1500, seed=1)


@pytest.fixture(scope="module")
def model(corpus):
    return estimate(count(corpus, Vocabulary(V)), k=5)


@pytest.fixture(scope="module")
def built(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("katz")
    meta = build_katz.main([
        "--tokens", str(write_tokens(root / "train.txt", corpus)), "--vocab-size", str(V),
        "--val-tokens", str(write_tokens(root / "val.txt", markov_corpus(200, seed=2))), "--out", str(root / "ngram"),
        "--eos-id", str(EOS_ID),
    ])
    return root / "ngram", meta


def test_counts_match_nltk(corpus):
    vocab = Vocabulary(V)
    counts = count(corpus[:200], vocab)
    for n in (1, 2, 3):
        expected = Counter()
        for doc in corpus[:200]:
            expected.update(g for g in ngrams([vocab.bos, *doc.tolist(), vocab.eos], n) if g != (vocab.bos,))
        ours = {tuple(int(k) // vocab.base ** (n - 1 - j) % vocab.base for j in range(n)): int(c)
                for k, c in zip(counts.keys[n - 1], counts.counts[n - 1])}
        assert ours == dict(expected)


def test_good_turing_discounts_follow_the_formula():
    counts = np.repeat(np.arange(1, 9), [120, 50, 30, 20, 14, 10, 8, 6])
    d, reason = good_turing_discounts(counts, k=5)
    n = np.bincount(counts)
    a = 6 * n[6] / n[1]
    for r in range(1, 6):
        assert d[r] == pytest.approx(((r + 1) * n[r + 1] / n[r] / r - a) / (1 - a))
    assert reason is None
    ones, reason = good_turing_discounts(np.array([1, 1, 2, 4, 5, 6, 6]), k=5)  # n_3 = 0
    assert (ones == 1).all() and "zero" in reason


def test_every_conditional_distribution_sums_to_one(model):
    vocab = model.vocab
    words = np.r_[np.arange(V), vocab.eos]  # every token id and </s>
    rng = np.random.default_rng(0)
    seen = rng.choice(model.levels[1].histories, 40)
    unseen = rng.integers(0, V, (40, 2)) @ np.array([vocab.base, 1])
    starts = vocab.bos * vocab.base + rng.integers(0, V, 10)  # <s> w
    for history in np.concatenate([seen, unseen, starts]):
        assert model.prob(np.full(words.size, history), words).sum() == pytest.approx(1, abs=1e-6)
    for v in np.r_[rng.integers(0, V, 20), vocab.bos]:
        assert model.prob(np.full(words.size, v), words, order=2).sum() == pytest.approx(1, abs=1e-6)
    assert model.unigram[words].sum() == pytest.approx(1, abs=1e-12)
    assert (model.unigram[V - UNUSED : V] > 0).all()


def test_counts_above_k_are_not_discounted(model, corpus):
    vocab = model.vocab
    counts = count(corpus, vocab)
    keys, c = counts.keys[2], counts.counts[2]
    histories = keys // vocab.base
    totals = Counter()
    for h, n in zip(histories.tolist(), c.tolist()):
        totals[h] += n
    frequent = np.flatnonzero(c > 5)
    assert frequent.size > 50
    p = model.prob(histories[frequent], keys[frequent] % vocab.base)
    assert np.array_equal(p, c[frequent] / np.array([totals[h] for h in histories[frequent].tolist()]))


def test_kenlm_reads_the_arpa_and_agrees_with_our_scores(built, model):
    kenlm = pytest.importorskip("kenlm")  # installed by setup.sh; absent on the GPU machines (no wheel)
    km = kenlm.Model(str(built[0] / "model.arpa"))
    rng = np.random.default_rng(3)
    held_out = markov_corpus(100, seed=4)
    unseen_tokens = [np.r_[d, rng.integers(V - UNUSED, V, 3)] for d in held_out[:30]]
    unseen_contexts = [rng.integers(0, V, int(rng.integers(1, 30))) for _ in range(50)]
    for doc in held_out + unseen_tokens + unseen_contexts + [np.array([], np.int64)]:
        ours = model.sequence_log10(doc).sum()
        assert km.score(" ".join(map(str, doc)), bos=True, eos=True) == pytest.approx(ours, abs=1e-4)


def test_successor_table_holds_the_most_probable_next_tokens(built, model):
    table = SuccessorTable.load(built[0] / "successors.npz")
    vocab = model.vocab
    words = np.r_[np.arange(V), vocab.eos]
    rng = np.random.default_rng(5)
    seen = rng.choice(model.levels[1].histories, 60)
    contexts = [(h // vocab.base, h % vocab.base) for h in seen.tolist()]
    contexts += [tuple(c) for c in rng.integers(0, V, (30, 2)).tolist()] + [(vocab.bos, 7)]
    u, v = np.array(contexts).T
    tokens, probs = table.lookup(u, v)
    assert tokens.shape == (len(contexts), 16)
    for (a, b), tok, pr in zip(contexts, tokens, probs):
        full = np.zeros(vocab.base)
        full[words] = model.prob(np.full(words.size, a * vocab.base + b), words)
        assert np.allclose(pr, np.sort(full)[::-1][:16], rtol=1e-5)  # the 16 largest probabilities, in order
        symbols = np.where(tok == EOS_ID, vocab.eos, tok)  # </s> comes back as the end-of-text id
        assert np.allclose(full[symbols], pr, rtol=1e-5)  # each with its own probability
    for (a, b), tok, pr in zip(contexts, tokens, probs):  # one context at a time answers the same
        one_tok, one_pr = table.lookup(np.array([a]), np.array([b]))
        assert (one_tok[0] == tok).all() and (one_pr[0] == pr).all()


def test_build_reports_perplexity_better_than_lower_orders(built):
    out, meta = built
    ppl = meta["validation_perplexity"]
    assert ppl["order_3"] < ppl["order_2"] < ppl["order_1"]
    assert json.loads((out / "meta.json").read_text())["ngram_types"] == meta["ngram_types"]
    assert meta["lookup_us_per_context"] < 10


@pytest.mark.parametrize(
    "content, extra, message",
    [
        ("\n\n", [], "holds no tokens"),
        ("1 2 3\n4 five 6\n", [], "train.txt:2: 'five' is not an integer"),
        ("1 2 3\n4 400 6\n", [], "train.txt:2: token id 400 is outside the vocabulary"),
    ],
)
def test_bad_token_files_are_one_line_errors(tmp_path, capsys, content, extra, message):
    (tmp_path / "train.txt").write_text(content)
    with pytest.raises(SystemExit) as exit_:
        build_katz.main(["--tokens", str(tmp_path / "train.txt"), "--vocab-size", str(V), "--out", str(tmp_path / "ngram"), *extra])
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0]
    assert not (tmp_path / "ngram").exists()


def test_missing_data_and_vocabulary_mismatch_are_one_line_errors(tmp_path, capsys, corpus_dir, corpus):
    with pytest.raises(SystemExit):
        build_katz.main(["--out", str(tmp_path / "nowhere" / "ngram")])
    assert "data directory" in capsys.readouterr().err
    run = tmp_path / "run"
    prepare.main(["--path", str(corpus_dir), "--out", str(run), "--vocab-size", "300", "--val-fraction", "0.3"])
    with pytest.raises(SystemExit):
        build_katz.main(["--tokens", str(write_tokens(tmp_path / "t.txt", corpus)), "--vocab-size", str(V), "--out", str(run / "ngram")])
    assert "does not match the tokenizer" in capsys.readouterr().err
    assert not (run / "ngram").exists()


def test_builds_from_the_run_data_and_from_draft_samples(tmp_path, corpus_dir):
    from train import finetune_oracle

    run = tmp_path / "run"
    prepare.main(["--path", str(corpus_dir), "--out", str(run), "--vocab-size", "300", "--val-fraction", "0.3"])
    from_data = build_katz.main(["--out", str(run / "ngram")])
    assert from_data["validation_perplexity"]["order_3"] < from_data["validation_perplexity"]["order_1"]
    finetune_oracle.main(["--data", str(run / "data"), "--out", str(run / "draft"), "--max-steps", "20"])
    sampled = build_katz.main(["--from-draft", str(run / "draft"), "--num-tokens", "3000", "--out", str(run / "ngram-draft")])
    assert sampled["training_tokens"] >= 3000 and "sampled from" in sampled["source"]
    pytest.importorskip("kenlm").Model(str(run / "ngram-draft" / "model.arpa"))


def test_a_vocabulary_smaller_than_the_candidate_lists_still_builds(tmp_path):
    rng = np.random.default_rng(7)
    docs = [rng.integers(0, 10, int(rng.integers(1, 20))) for _ in range(200)]
    build_katz.main(["--tokens", str(write_tokens(tmp_path / "t.txt", docs)), "--vocab-size", "12", "--out", str(tmp_path / "ngram")])
    table = SuccessorTable.load(tmp_path / "ngram" / "successors.npz")
    tokens, probs = table.lookup(np.array([3, 12]), np.array([4, 5]))
    assert tokens.shape == (2, 13) and np.all(np.diff(probs, axis=1) <= 1e-7)  # 12 ids and </s>, sorted


@pytest.mark.parametrize("damage, said", [
    (lambda meta: "{not json", "is damaged (JSONDecodeError"),
    (lambda meta: json.dumps({k: v for k, v in meta.items() if k != "vocab_size"}), "lacks vocab_size (int)"),
    (lambda meta: json.dumps(meta | {"splits": ["train", "val"]}), "lacks splits (dict)"),
])
def test_a_damaged_data_meta_json_is_one_line_naming_the_file_and_the_field(bpe_run, tmp_path, capsys, damage, said):
    import shutil

    from ngram import build_katz
    from train import finetune_oracle

    run = tmp_path / "run"
    shutil.copytree(bpe_run["run"] / "data", run / "data")
    shutil.copytree(bpe_run["run"] / "tokenizer", run / "tokenizer")
    meta = run / "data" / "meta.json"
    meta.write_text(damage(json.loads(meta.read_text())))
    for main, argv in ((build_katz.main, ["--data", str(run / "data"), "--out", str(run / "ngram")]),
                       (finetune_oracle.main, ["--preset", "tiny", "--data", str(run / "data"), "--out", str(run / "oracle")])):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert exit_.value.code == 2 and len(errors) == 1 and str(meta) in errors[0] and said in errors[0], errors
    assert not (run / "ngram").exists() and not (run / "oracle").exists()
