"""Many sequences at once (decode.batch): one C++ forward over several sequences' rows gives each the bits it gets
alone; generate_batch gives each prompt what generate gives it, greedy and sampled, for every method and backend;
sequences join mid-way, leave early, and fail alone."""
import random
from dataclasses import replace

import pytest
import torch
from native_built import random_tree
from test_api import METHODS, TEXTS
from test_native_forward import ARCHITECTURES, engine_in_cpp, tiny_model

from decode import SpeculativeDecoder, native
from decode.batch import Batch
from decode.errors import InputError
from decode.healing import Prompt
from decode.models.cached_lm import Call, ChainCall
from decode.models.together import chain_together, run_together
from decode.planning.concurrency import fitting_batch
from decode.sampling import Sampling
from decode.timing.steps import Hooks
from decode.tree import Shape

SAMPLED = {"do_sample": True, "temperature": 1.5, "top_k": 50}
LONG = "def scale(values):\n    return [v * 2 for v in values]\n\n" * 4  # past a C++ call's rows: read in chunks


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_forward_over_several_caches_gives_each_sequence_the_bits_it_gets_alone(built, tmp_path, architecture,
                                                                                     dtype, monkeypatch):
    engine = engine_in_cpp(tiny_model(architecture, tmp_path / "model", 3), dtype, tiles=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(97) for _ in range(n)] for n in (5, 1, 12)]
    together, alone = [engine.fork() for _ in prompts], [engine.fork() for _ in prompts]
    batches = []
    inner = engine.runtime.blocks.batch
    monkeypatch.setattr(engine.runtime.blocks, "batch", lambda parts: batches.append(len(parts)) or inner(parts))
    for step in range(3):  # the prompts read together, then trees scored, one committed in part, then one more
        if step == 0:
            calls = [Call(torch.tensor(p), last=last, extend=True) for p, last in zip(prompts, (2, 1, 0))]
        else:
            trees = [random_tree(rng, n, 97) for n in (7, 1, 15)]
            calls = [Call(t.tokens, t.positions(m.length), t.mask(m.device)) for t, m in zip(trees, together)]
        got = run_together(list(zip(together, calls)))
        for model, reference, call, logits in zip(together, alone, calls, got):
            assert torch.equal(logits, reference.run(call))
            assert (model.length, model.pending) == (reference.length, reference.pending)
            end = model.length + model.pending
            assert torch.equal(model.kv.cache[..., :end, :], reference.kv.cache[..., :end, :])
        for model, reference in zip(together, alone):
            if model.pending:
                keep = list(range(0, model.pending, 2))
                model.commit(keep)
                reference.commit(keep)
    assert batches == [3, 3, 3]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_long_prompt_read_a_chunk_a_step_beside_other_sequences_gets_the_bits_it_gets_alone(built, tmp_path,
                                                                                           architecture):
    engine = engine_in_cpp(tiny_model(architecture, tmp_path / "model", 3), "bfloat16", tiles=False)
    rng = random.Random(1)
    prompt = Call(torch.tensor([rng.randrange(97) for _ in range(native.Blocks.ROWS + 40)]), last=45, extend=True)
    alone, reading, other = engine.fork(), engine.fork(), engine.fork()
    expected = alone.run(prompt)
    other.run(Call(torch.tensor([5, 6, 7]), extend=True))
    pieces, scored = reading.pieces(prompt), []
    assert [(len(p.token_ids), p.last) for p in pieces] == [(native.Blocks.ROWS, 5), (40, 40)]
    for piece in pieces:  # each piece beside another sequence's tree, one forward a step
        tree = random_tree(rng, 6, 97)
        logits = run_together([(reading, piece), (other, Call(tree.tokens, tree.positions(other.length),
                                                               tree.mask(other.device)))])
        scored.append(logits[0])
        other.commit([0])
    assert torch.equal(torch.cat(scored), expected) and reading.length == alone.length == len(prompt.token_ids)
    assert torch.equal(reading.kv.cache[..., : alone.length, :], alone.kv.cache[..., : alone.length, :])


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_several_sequences_draft_chains_in_one_call_each_getting_what_it_gets_alone(built, tmp_path, architecture,
                                                                                   monkeypatch):
    """Chains of a draft's forwards, several sequences' at once (a greedy one, two under top-k settings, of different
    lengths): each sequence's tokens, distributions and cache are those its chain gives it alone."""
    engine = engine_in_cpp(tiny_model(architecture, tmp_path / "model", 4), "bfloat16", tiles=False)
    rng = random.Random(2)
    settings, steps = [Sampling(), Sampling(1.0, 5), Sampling(0.8, 12, 0.9)], [4, 2, 6]
    fed = [[rng.randrange(97) for _ in range(n)] for n in (5, 1, 9)]
    together, alone = [engine.fork() for _ in fed], [engine.fork() for _ in fed]
    parts = []
    inner = engine.runtime.blocks.chains
    monkeypatch.setattr(engine.runtime.blocks, "chains", lambda asked, shortlist: parts.append(len(asked))
                        or inner(asked, shortlist))

    def chain_calls(models, fed, draws):
        return [ChainCall(model, tokens, list(range(model.length, model.length + len(tokens))), k, setting, uniforms)
                for model, tokens, k, setting, uniforms in zip(models, fed, steps, settings, draws)]

    for _ in range(2):  # from empty caches, then after each kept part of its chain
        draws = [[] if setting.greedy else [rng.random() for _ in range(k)] for setting, k in zip(settings, steps)]
        got = chain_together(chain_calls(together, fed, draws))
        parts_before = len(parts)
        expected = [call.run() for call in chain_calls(alone, fed, draws)]
        assert len(parts) == parts_before + len(alone)  # each alone: a call of one part
        assert got == expected and all(len(tokens) == k for (tokens, _), k in zip(got, steps))
        assert [dists is None for _, dists in got] == [setting.greedy for setting in settings]
        for model, reference in zip(together, alone):
            assert (model.length, model.pending) == (reference.length, reference.pending)
            end = model.length + model.pending
            assert torch.equal(model.kv.cache[..., :end, :], reference.kv.cache[..., :end, :])
            keep = list(range(model.pending - 2))
            model.commit(keep)
            reference.commit(keep)
        fed = [[tokens[-2]] for tokens, _ in got]
    assert parts == [3, 1, 1, 1, 3, 1, 1, 1]


def test_the_sequences_of_a_batch_draft_their_chains_together(bpe_run, monkeypatch):
    dec = SpeculativeDecoder.from_run(bpe_run["run"], method="speculative", k=4)
    parts = []
    inner = native.Blocks.chains
    monkeypatch.setattr(native.Blocks, "chains", lambda self, asked, shortlist: parts.append(len(asked))
                        or inner(self, asked, shortlist))
    for sampling in ({}, SAMPLED):
        together = dec.generate_batch(TEXTS, max_new_tokens=24, seed=3, **sampling)
        assert max(parts) > 1  # the sequences in flight together (each joins as it is first read)
        parts.clear()
        assert [r.token_ids for r in together] == [dec.generate(t, max_new_tokens=24, seed=3, **sampling).token_ids
                                                   for t in TEXTS]
        assert parts and max(parts) == 1


@pytest.fixture(scope="module")
def decoders(bpe_run):
    return {method: SpeculativeDecoder.from_run(bpe_run["run"], method=method, **extra) for method, extra in METHODS.items()}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_generate_batch_gives_each_prompt_what_generate_gives_it(decoders, method, sampling):
    dec, texts = decoders[method], [*TEXTS, LONG]
    assert len(dec.token_ids(LONG)) > native.Blocks.ROWS
    for seed in range(3):
        together = dec.generate_batch(texts, max_new_tokens=24, seed=seed, **sampling)
        for text, result in zip(texts, together):
            alone = dec.generate(text, max_new_tokens=24, seed=seed, **sampling)
            assert (result.text, result.token_ids, result.finish_reason, result.oracle_calls, result.healed) == (
                alone.text, alone.token_ids, alone.finish_reason, alone.oracle_calls, alone.healed)
    assert len(dec.batch) == 0


def test_stop_strings_end_each_prompt_of_a_batch_as_they_end_it_alone(decoders):
    dec = decoders["staged"]
    alone = [dec.generate(text, max_new_tokens=30) for text in TEXTS]
    stops = [result.text[3:5] for result in alone if len(result.text) > 5]  # strings the outputs hold
    together = dec.generate_batch(TEXTS, max_new_tokens=30, stop_strings=stops)
    assert [r.text for r in together] == [dec.generate(text, max_new_tokens=30, stop_strings=stops).text for text in TEXTS]
    assert any(r.finish_reason == "stop" and len(r.text) < len(a.text) for r, a in zip(together, alone))


def test_sequences_join_midway_and_leave_early_without_changing_the_others(decoders):
    dec, batch = decoders["staged"], Batch()
    requests = [(TEXTS[0], {"seed": 1}), (TEXTS[1], SAMPLED | {"seed": 2}), (TEXTS[2], {"seed": 3}),
                (TEXTS[3], SAMPLED | {"seed": 4})]
    joining = {0: [0], 2: [1, 2], 4: [3]}  # step -> the requests that join before it
    streams, pieces, closed = {}, {}, set()
    for step in range(80):
        for i in joining.get(step, []):
            streams[i], pieces[i] = dec.stream_in(batch, requests[i][0], max_new_tokens=30, **requests[i][1]), []
        for i, stream in streams.items():
            if stream.result is None and i not in closed:
                if (piece := next(stream, None)) is not None:
                    pieces[i].append(piece)
                if i == 2 and pieces[i]:  # its reader goes away after its first piece
                    stream.close()
                    closed.add(i)
        assert len(batch) <= sum(s.result is None and i not in closed for i, s in streams.items())
    assert len(batch) == 0 and closed == {2}
    for i, (text, settings) in enumerate(requests):
        alone = dec.generate(text, max_new_tokens=30, **settings)
        if i in closed:
            assert alone.text.startswith("".join(pieces[i]))
        else:
            assert "".join(pieces[i]) == alone.text and streams[i].result.token_ids == alone.token_ids


def test_a_joining_sequence_is_decoded_in_the_next_step_whichever_reader_runs_it(decoders, monkeypatch):
    dec, batch = decoders["staged"], Batch()
    first = dec.stream_in(batch, TEXTS[0], max_new_tokens=30)
    pieces = [next(first)]
    sizes: list[int] = []  # the sequences in each step from here on
    step = batch.step
    monkeypatch.setattr(batch, "step", lambda: (sizes.append(len(batch)), step())[1])
    second = dec.stream_in(batch, TEXTS[1], max_new_tokens=30)
    while not sizes:  # the first's reader runs the next step
        pieces.append(next(first))
    assert sizes == [2] and batch.sequences[1].decoder.oracle.length > 0  # the second's prompt read in it
    unread = dec.stream_in(batch, TEXTS[2], max_new_tokens=30)
    assert len(batch) == 3
    unread.close()  # closed before its first piece: it leaves the batch at once
    assert len(batch) == 2
    pieces += list(first)
    assert "".join(pieces) == dec.generate(TEXTS[0], max_new_tokens=30).text
    assert "".join(second) == dec.generate(TEXTS[1], max_new_tokens=30).text and len(batch) == 0


def test_a_sequence_whose_forward_or_drafting_fails_fails_alone(decoders):
    dec, batch = decoders["staged"], Batch()
    streams = [dec.stream_in(batch, text, max_new_tokens=24) for text in TEXTS]
    for stream in streams:
        next(stream)

    def fail(*args, **kwargs):
        raise RuntimeError("drafting failed")

    batch.sequences[1].decoder.oracle.kv.capacity = 0  # its next tree overflows its cache
    broken_draft = batch.sequences[2].decoder.draft
    broken_draft.forward = broken_draft.chain = fail
    with pytest.raises(InputError, match="overflow the cache"):
        list(streams[1])
    with pytest.raises(RuntimeError, match="drafting failed"):
        list(streams[2])
    for i in (0, 3):
        rest = "".join(streams[i])
        assert streams[i].result.token_ids == dec.generate(TEXTS[i], max_new_tokens=24).token_ids and rest
    assert len(batch) == 0


def test_a_batch_on_the_transformers_backend_decodes_each_prompt_as_alone(bpe_run):
    dec = SpeculativeDecoder.from_run(bpe_run["run"], method="staged", backend="hf", budget=16, widths=[4, 2, 1])
    together = dec.generate_batch(TEXTS[:3], max_new_tokens=16, seed=5, **SAMPLED)
    assert [r.token_ids for r in together] == [dec.generate(t, max_new_tokens=16, seed=5, **SAMPLED).token_ids
                                               for t in TEXTS[:3]]


@pytest.mark.parametrize("prompts, message", [("def f():", "a non-empty list of prompts"), ([], "a non-empty list"),
                                              (["def f():", 7], "a string or a list of token ids"),
                                              (["def f():", ""], "^prompt 1 is empty")])
def test_generate_batch_refuses_bad_prompts_before_decoding_any(decoders, prompts, message):
    dec = decoders["staged"]
    with pytest.raises(InputError, match=message):
        dec.generate_batch(prompts, max_new_tokens=8)
    assert len(dec.batch) == 0
    assert dec.generate_batch(["def f():"], max_new_tokens=8)[0].token_ids == dec.generate("def f():", max_new_tokens=8).token_ids


def test_the_default_batch_is_the_most_sequences_whose_forward_keeps_each_at_the_share_of_its_speed_alone():
    costs = {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0, 16: 15.0, 32: 24.0, 64: 44.0}  # milliseconds by rows
    assert fitting_batch(costs, rows=8, kept=0.6) == 3  # 24 rows cost 19.5 ms, within 12 / 0.6; 32 rows 24 ms
    assert fitting_batch(costs, rows=1, kept=0.6) == 16  # one-row steps: every count up to the most
    assert fitting_batch(costs, rows=32, kept=0.6) == 1
    assert fitting_batch(costs, rows=8, kept=0.9) == 1


ROWS = {"speculative k 5": ("speculative", {"k": 5}), "tree": ("tree", {"budget": 12}),
        "staged": ("staged", {"budget": 16, "widths": [4, 2, 1]}),
        "staged, context": ("staged", {"budget": 10, "widths": [2, 1], "context_drafter": True, "lookup_branches": 2}),
        "staged, a shape": ("staged", {"tree_shape": Shape([-1, 0, 0, 1, 3], [0, 0, 1, 0, 0], 0.0), "widths": [2, 1]}),
        "ngram": ("ngram", {"budget": 16, "widths": [4, 2, 1]}), "lookup": ("lookup", {"lookup_branches": 3})}


@pytest.mark.parametrize("name", ROWS)
def test_a_step_asks_the_oracle_to_score_no_more_nodes_than_its_method_says(bpe_run, name):
    method, extra = ROWS[name]
    dec = SpeculativeDecoder.from_run(bpe_run["run"], method=method, plan=None, **extra)
    scored: list[int] = []
    hooks = Hooks(on_forward=lambda nodes, cached, seconds: scored.append(nodes) if cached else None)
    for i, text in enumerate([*TEXTS, LONG]):
        for sampling in (Sampling(), Sampling(1.5, 50)):
            dec.decoder(Prompt(torch.tensor(dec.token_ids(text))), 40, i, sampling, hooks)
    assert scored and max(scored) <= dec.decoder.oracle_rows()  # the room a batch's fork of the oracle is given


def together(batch: Batch, decoder, prompts: list[Prompt]) -> list[list[int]]:
    """Each prompt's greedy tokens, the prompts decoding at once in `batch`."""
    streams, tokens = dict(enumerate(batch.join(decoder, p, 24, 0, Sampling()) for p in prompts)), {}
    while streams:
        for i, stream in list(streams.items()):
            if (generation := next(stream, None)) is None:
                del streams[i]
            else:
                tokens[i] = list(generation.tokens)
    return [tokens[i] for i in range(len(prompts))]


def test_a_batchs_forks_of_the_oracle_hold_its_steps_and_a_decoder_with_larger_ones_gets_a_larger_fork(bpe_run):
    dec = SpeculativeDecoder.from_run(bpe_run["run"], method="speculative", k=2, plan=None)
    small, oracle, batch = dec.decoder, dec.decoder.oracle, Batch()
    large = replace(small, options=replace(small.options, k=6)).over(oracle, small.draft)  # its steps score 7 nodes
    assert batch.reserve(small, 2) < 2 * (oracle.cache_bytes() + small.draft.cache_bytes())
    assert [fork.speculative_slots() for fork in batch.spare[id(oracle)]] == [3, 3]
    assert oracle.speculative_slots() > 7
    prompts = [Prompt(torch.tensor(dec.token_ids(text))) for text in [*TEXTS, LONG]]
    for decoder in (small, large):
        alone = [decoder(prompt, 24, 0, Sampling()).tokens for prompt in prompts]
        assert together(batch, decoder, prompts) == alone
    assert sorted(fork.speculative_slots() for fork in batch.spare[id(oracle)]) == [3] * len(prompts) + [7] * len(prompts)
