"""What a decoder is built from (`DecoderOptions`), and the checks that turn bad settings into one-line errors."""
import math
import numbers
from argparse import BooleanOptionalAction
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from decode.devices import CPU, CPU_CHAIN, GPU, check_compiler, check_device, kind
from decode.errors import InputError
from decode.models.precision import auto_dtype
from decode.models.quantized import FORMATS
from decode.sampling import Sampling
from decode.tree import Shape

MAX_BUDGET, MAX_DEPTH = 512, 64
MIN_DRAFT_VOCAB = 64  # a shortlist holds every draft's top children and a sampled proposal's 64 tokens
MIN_TEMPERATURE = 1e-4  # the least sampling temperature: logits divided by a smaller one can overflow float32
PAPER_WIDTHS, PAPER_BUDGET = (12, 7, 4, 1, 1, 1), 36  # the paper's staged tree, sized for a GPU


def default_tree(device: str) -> tuple[int, list[int]]:
    """The oracle's tree budget and the trigram's widths without a plan, sized for the device."""
    return kind(device).budget, list(kind(device).widths)


DTYPES, BACKENDS, TREE_CHILDREN = ("auto", "float32", "bfloat16"), ("auto", "lean", "hf"), ("top", "sampled")


def setting(default, help: str, planned: bool = False, **flag):
    """A DecoderOptions field that every decoding command takes as a flag of its name (decode.cli.flags): `help` is
    the flag's (a planned one's default is said after it where the help says none); `planned`: a plan's policy fills
    it in unless it is typed or passed (decode.plan_file.with_plan); `flag`: argparse's other keywords (type,
    choices, action, metavar). Choices are checked by DecoderOptions.check."""
    return field(default=default, metadata={"help": help, "planned": planned, "flag": flag})


@dataclass
class DecoderOptions:
    """What a decoder is built from: the models, the method and its tree, the precision. Each field but `policy` is a
    flag of decode.run's and the other decoding commands' (`setting`); a plan's policy fills in the `planned` ones."""

    # the models as typed (not Path, which reads ./gpt2 as the hub name gpt2); decode.models.pretrained.model_dir resolves them
    oracle: Path = setting(None, "the oracle: a directory (save_pretrained) or a hub name (gpt2-large)")
    draft: Path | None = setting(None, "the draft (for speculative methods): a directory or a hub name")
    ngram: Path | None = setting(None, "the Katz trigram's directory (for n-gram drafting)", type=Path)
    method: str = setting("staged", "the decoding method")  # its choices: decode.methods.METHODS
    k: int = setting(4, "speculative: tokens the draft proposes per oracle call", True,
                     type=int)
    budget: int | None = setting(  # None: sized for the device (default_tree)
        None, f"tree methods: nodes in the oracle's tree (default: the plan's; without one {CPU.budget} on a CPU, "
              f"{GPU.budget} on a GPU; unplanned staged on a CPU drafts the draft's chain of {CPU_CHAIN[0]} tokens, "
              f"{CPU_CHAIN[1]} when sampling, unless a tree flag is typed)", True, type=int)
    depth: int = setting(8, "tree methods: deepest drafted level", True, type=int)
    widths: list[int] | None = setting(  # None: sized for the device
        None, f"staged/ngram: trigram children per node at each level, comma-separated (default: the plan's; without one "
              f"{','.join(map(str, CPU.widths))} on a CPU, {','.join(map(str, GPU.widths))} on a GPU)", True)
    branch: int | None = setting(  # None: the drafter's default
        None, "tree: children per expanded node (default 4); staged: the draft's own top children per node (default 1, "
              "its argmax), or with sampled --tree-children its draws per node (default 2)", True, type=int)
    draft_calls: int = setting(
        1, "staged, greedy or top children: the most draft forwards a step makes; past the first, each carries the "
           "draft's own best path through the tree on towards --depth, the trigram's tree below it", True,
        type=int)
    tree_children: str = setting(
        "sampled", "tree, staged, when sampling (greedy decoding always takes the draft's top tokens): the draft's top "
                   "tokens, verified by sample-match (the same seed gives the baseline's very tokens), or draws from it, "
                   "verified by multi-draft rejection (more tokens per call); a planned tree then draws as many children "
                   "per node as its shape gives it", choices=TREE_CHILDREN)
    tree_shape: Shape | None = None  # the tree method's planned tree (decode.plan) in place of a best-first tree
    context_drafter: bool = setting(
        True, "staged: graft onto the trigram's tree the tokens that followed earlier occurrences of the sequence's "
              "current suffix (what the lookup method drafts); the draft ranks them with the rest",
        action=BooleanOptionalAction)
    lookup_tokens: int = setting(10, "lookup: tokens per continuation (staged: at most --depth)", True, type=int)
    lookup_branches: int = setting(1, "lookup, staged: continuations from different earlier occurrences", type=int)
    lookup_ngram: int = setting(3, "lookup, staged: longest suffix matched in the context", type=int)
    dtype: str = setting(
        "auto", "auto: the dtype RUN/plan.json was planned in on this device; else on a CPU the one the oracle's "
                "forward was measured faster in (decode.calibrate and decode.plan time both and keep the choice; "
                "never measured: bfloat16 where the CPU has bfloat16 instructions, else float32), on a GPU bfloat16",
        choices=DTYPES)
    draft_dtype: str | None = setting(  # None: the oracle's dtype
        None, "the draft's dtype (default: the plan's choice, else --dtype's): a draft's forward of a few rows is "
              "per-call overhead, which differs by dtype on a CPU; q8_0 or q4_0: a 16-bit draft's matrices quantized "
              "to that block format as it loads (computing in --dtype), which the output never depends on",
        True, choices=[*DTYPES[1:], *FORMATS])
    device: str = setting("cpu", "cpu or cuda")
    backend: str = setting("auto", "lean: our engine (GPT-2 and the Llama family: Llama, Qwen2, Mistral); hf: any "
                                   "transformers causal LM; auto: lean where it applies", choices=BACKENDS)
    cuda_graphs: bool = setting(
        True, "the lean engine on a GPU: replay each forward as a CUDA graph, one launch instead of a dozen kernels per "
              "layer (a CPU ignores it)", action=BooleanOptionalAction)
    compile_layers: bool = setting(
        False, "the lean engine: compute each layer of torch's forward through torch.compile, which fuses its small "
               "operations into fewer kernels (on a GPU, inside the CUDA graphs; on a CPU, the prompts past the C++ "
               "call's rows); the first forwards compile for tens of seconds, later starts read inductor's cache",
        action=BooleanOptionalAction)
    draft_vocab: int = setting(
        0, "the draft's output layer over its N most frequent training tokens only (RUN/draft/token_counts.npy): a "
           "fraction of its cost; it then proposes only those, and the output stays the oracle's (default: the plan's "
           "choice, else 0: every token)", True, type=int, metavar="N")
    token_healing: bool = setting(
        True, "back off the prompt's last token and let the first new token be only one that extends its text (a "
              "prompt ending in a bare newline otherwise starts where training never went); every method alike",
        action=BooleanOptionalAction)
    plan: Path | None = setting(
        None, "a plan written by decode.plan: its policy for the method (k, tree shape, budget, widths, lookup tokens, "
              "draft vocabulary and dtype) fills in those flags that you do not type (default: the run's plan for the "
              "sampling setting, RUN/plan.json when greedy and e.g. RUN/plan-t1-k50-p1.json at --temperature 1 "
              "--top-k 50, when it exists and was planned for this device, dtype and backend; a plan for other models "
              "is refused)", type=Path)
    policy: dict | None = None  # the plan's policy, as applied

    def check(self) -> "DecoderOptions":
        """Settings that cannot work, as InputError; returns the options with the device's tree and dtype in place
        of None and auto. The method-dependent checks are decode.methods' (check_options, check_tree_shape)."""
        if self.oracle is None:
            raise InputError("no oracle: pass oracle=DIR (a run directory's RUN/oracle) or a hub name")
        check_types(self)
        for f in fields(self):
            choices = f.metadata.get("flag", {}).get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices and not (value is None and f.default is None):
                raise InputError(f"{f.name} must be {', '.join(choices[:-1])} or {choices[-1]} (got {value!r})")
        if self.k < 0:
            raise InputError(f"--k must be at least 0 (got {self.k})")
        if min(self.lookup_tokens, self.lookup_branches, self.lookup_ngram) < 1 or self.lookup_tokens > MAX_DEPTH:
            raise InputError(f"--lookup-tokens (1 to {MAX_DEPTH}), --lookup-branches and --lookup-ngram must be at least 1")
        if self.draft_vocab != 0 and self.draft_vocab < MIN_DRAFT_VOCAB:
            raise InputError(f"--draft-vocab {self.draft_vocab}: use 0 (the whole vocabulary) or at least {MIN_DRAFT_VOCAB} tokens")
        check_device(self.device)
        check_compiler(self.device, ["--compile-layers"] if self.compile_layers else [], "leave out --compile-layers")
        budget, widths = default_tree(self.device)
        dtype = self.dtype if self.dtype != "auto" else auto_dtype(self.device, None, self.oracle)[0]
        return replace(self, budget=budget if self.budget is None else self.budget,
                       widths=list(widths if self.widths is None else self.widths), dtype=dtype)


def check_number(name: str, value, integer: bool = False) -> None:
    """`value` is a number (an integer with `integer`), as InputError: a string or None would fail deep inside."""
    kind = numbers.Integral if integer else numbers.Real
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InputError(f"{name} must be {'an integer' if integer else 'a number'} (got {value!r})", name)


def sampling_of(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> Sampling:
    """The processed distribution's settings, checked (temperature 0: greedy). A temperature under MIN_TEMPERATURE
    would divide float32 logits past their range."""
    check_number("temperature", temperature)
    check_number("top_k", top_k, integer=True)
    check_number("top_p", top_p)
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature < math.inf):
        raise InputError(f"temperature must be 0 (greedy) or a finite number of at least {MIN_TEMPERATURE} "
                         f"(got {temperature})", "temperature")
    if top_k < 0:
        raise InputError(f"top-k must be at least 0, 0 for every token (got {top_k})", "top_k")
    if not 0 < top_p <= 1:
        raise InputError(f"top-p must lie in (0, 1] (got {top_p})", "top_p")
    return Sampling(temperature, top_k, top_p)


# What a field's value must be, by its annotation, with the words that say so (the command line's flags parse to these
# types; the Python API takes what it is given)
KINDS = {int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
         float: ("a number", lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)),
         bool: ("True or False", lambda v: isinstance(v, bool)),
         str: ("a string", lambda v: isinstance(v, str)),
         Path: ("a path", lambda v: isinstance(v, (str, Path))),
         list[int]: ("a list of integers", lambda v: isinstance(v, (list, tuple))
                     and all(isinstance(x, int) and not isinstance(x, bool) for x in v))}


def check_types(options: DecoderOptions) -> None:
    """Refuse, naming the setting, a value of another type than its field's (None where the field allows it)."""
    for f in fields(options):
        value = getattr(options, f.name)
        kinds = [t for t in getattr(f.type, "__args__", (f.type,)) if t is not type(None)] if f.type != list[int] else [f.type]
        if value is None and (f.default is None or type(None) in getattr(f.type, "__args__", ())):
            continue
        known = [KINDS[k] for k in kinds if k in KINDS]
        if known and not any(ok(value) for _, ok in known):
            raise InputError(f"{f.name} must be {' or '.join(words for words, _ in known)} (got {value!r})", f.name)
