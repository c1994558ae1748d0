"""The plan (RUN/plan.json, or a sampling setting's own file): the policy with the best predicted ms per token for
each method, and what it was measured with (the models, the device, the dtype), which it must match to be used."""
import functools
import json
import re
import shlex
from dataclasses import fields, replace
from pathlib import Path

import torch

from decode.atomic import write_json
from decode.devices import device_name, kind
from decode.errors import InputError, path_fault
from decode.fingerprint import TABLES, WEIGHTS, fingerprint
from decode.methods import METHODS
from decode.options import DecoderOptions
from decode.prompts import HUMANEVAL
from decode.sampling import GREEDY, Sampling
from decode.tree import Shape

PLAN_VERSION = 2  # 2: models named by their files' contents, not their paths


# A plan's identity besides the models, with the value a plan written before the setting existed was made with
SETTINGS = {"device": None, "dtype": None, "backend": None, "cuda_graphs": False, "compile_layers": False}


MODELS = {"oracle": WEIGHTS, "draft": WEIGHTS, "ngram": TABLES}  # the artifacts a plan was measured with: their files


def identity(options) -> dict:
    """What a plan's measurements depend on: the models (by content: a copied run keeps its plans; None where the
    directory is absent), the device, the dtype, the backend and whether the forwards replay CUDA graphs (only on a
    GPU with the lean engine), and whether its layers are compiled (likewise). The draft's shortlist and dtype are the
    plan's choice, in each policy."""
    lean_on_gpu = kind(options.device).graphs and options.backend != "hf"
    models = {k: getattr(options, k) for k in MODELS}
    return {**{k: fingerprint(path, MODELS[k]) if path is not None and Path(path).is_dir() else None
               for k, path in models.items()},
            "device": device_name(torch.device(options.device)), "dtype": options.dtype, "backend": options.backend,
            "cuda_graphs": options.cuda_graphs and lean_on_gpu, "compile_layers": options.compile_layers and lean_on_gpu}


def recorded(identity: dict, key: str):
    """A plan identity's `key`, or the default of a setting added after the plan was written."""
    return identity.get(key, SETTINGS.get(key))


def replan(run, options, sampling: Sampling = GREEDY, out=None, prompts=None) -> tuple[str, Path]:
    """The decode.plan command that plans the options' models at this sampling setting, and the plan file it writes.
    In a run (`run`): the run's own plan file (or `out`) when the options decode the run's models; else, with the
    models that are not the run's named, a file of their own (the run's plans stay its models'). Without a run: the
    models one by one into `out` (default the setting's plan file name, here), calibrated on `prompts` (default
    HumanEval's)."""
    if run is not None:
        other = [k for k in MODELS if getattr(options, k) is not None
                 and Path(getattr(options, k)).resolve() != (Path(run) / k).resolve()]
        models = ["--run", str(run), *[arg for k in other for arg in (f"--{k}", str(getattr(options, k)))]]
        own = Path(run) / plan_name(sampling)
        written = Path(run) / f"plan-{Path(options.oracle).name}.json" if other else Path(out or own)
        models += ["--out", str(written)] if written != own else []
    else:
        models = [arg for k in MODELS if getattr(options, k) is not None for arg in (f"--{k}", str(getattr(options, k)))]
        written = Path(out or plan_name(sampling))
        models += ["--prompts", str(prompts or HUMANEVAL), "--out", str(written)]
    setting = [] if sampling.greedy else ["--temperature", f"{sampling.temperature:g}", "--top-k", str(sampling.top_k),
                                          "--top-p", f"{sampling.top_p:g}"]
    command = shlex.join(["python", "-m", "decode.plan", *models, "--dtype", options.dtype, *setting]
                         + ([] if options.cuda_graphs else ["--no-cuda-graphs"])
                         + (["--compile-layers"] if options.compile_layers else []))
    return command, written


def replan_advice(run, options, sampling: Sampling, plan: Path, prompts=None, overwrite: bool = False) -> str:
    """What to run instead of a plan that does not serve (`plan`): the command, and the plan to pass after it where
    that is not the plan the command line would find by itself."""
    command, written = replan(run, options, sampling, plan, prompts)
    then = f", then pass --plan {written}" if written != plan else ""
    return f"`{command}{' --overwrite' if overwrite and written.exists() else ''}`{then}"


def run_of(plan: Path) -> Path | None:
    """The run directory a plan lies in (one holding an oracle/), or None."""
    return plan.parent if (plan.parent / "oracle").is_dir() else None


def save_plan(plan: dict, path: Path, overwrite: bool) -> None:
    write_json(path, plan, overwrite, indent=1)


def plan_name(sampling: Sampling = GREEDY) -> str:
    """A run's plan file for a sampling setting: plan.json for greedy decoding; else one named by the setting
    (plan-t1-k50-p1.json), as acceptance, and so the best trees, differ by setting."""
    if sampling.greedy:
        return "plan.json"
    return f"plan-t{sampling.temperature:g}-k{sampling.top_k}-p{sampling.top_p:g}.json"


PLAN_FILE = re.compile(r"plan(?:-t(\d+(?:\.\d+)?)-k(\d+)-p(\d+(?:\.\d+)?))?\.json")


def setting_of(name: str) -> Sampling | None:
    """The sampling setting a run's plan file is named for (plan_name's inverse), or None for another name."""
    named = PLAN_FILE.fullmatch(name)
    if named is None:
        return None
    return GREEDY if named[1] is None else Sampling(float(named[1]), int(named[2]), float(named[3]))


def setting_distance(a: Sampling, b: Sampling) -> float:
    """How far apart two sampling settings are when a plan made for one serves the other: their temperatures (greedy:
    0), top-k (50 tokens count as 1; none: the whole vocabulary, counted as 200) and top-p apart, summed."""
    k = lambda s: s.top_k if 0 < s.top_k <= 200 else 200
    return abs(a.temperature - b.temperature) + abs(k(a) - k(b)) / 50 + abs(a.top_p - b.top_p)


def nearest_run_plan(run: Path, options, sampling: Sampling = GREEDY) -> tuple[Path | None, list[str]]:
    """The run's plan for `sampling` (`run_plan`); where it has none that fits these settings, the plan of the nearest
    setting that does (`setting_distance`; a plan only chooses trees, never what is accepted), else None. Also what
    the setting's own plan was made for, when it exists and does not fit."""
    own, other = run_plan(run, options, sampling)
    if own is not None:
        return own, other
    settings = {path: setting for path in Path(run).glob("plan*.json") if (setting := setting_of(path.name)) is not None}
    for path in sorted((p for p, s in settings.items() if s != sampling),
                       key=lambda p: (setting_distance(settings[p], sampling), p.name)):
        if (fits := run_plan(run, options, settings[path])[0]) is not None:
            return fits, other
    return None, other


def run_plan(run: Path, options, sampling: Sampling = GREEDY) -> tuple[Path | None, list[str]]:
    """The run's plan for `sampling` (plan_name) when it exists and was measured for these settings (device, dtype,
    backend, CUDA graphs), else None and the settings it was planned for (none: there is no plan). A plan named
    explicitly is checked by load_plan instead, which refuses one measured for other settings."""
    path = Path(run) / plan_name(sampling)
    if not path.is_file():
        return None, []
    try:
        plan = json.loads(path.read_text())
        measured, version = plan["identity"], plan["version"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return path, []  # load_plan says what is wrong with it
    if version != PLAN_VERSION:
        return None, [f"version {version} of decode.plan's files (now {PLAN_VERSION})"]
    current = identity(options)
    other = [f"{k} {recorded(measured, k)!r}" for k in SETTINGS if recorded(measured, k) != current[k]]
    return (None, other) if other else (path, [])


# A planned tree (its shape) stands for the flags of a best-first tree all at once; every other key of a policy
# is the DecoderOptions field it fills ("tokens": lookup_tokens), one of those a plan may fill
PLANNED = {f.name for f in fields(DecoderOptions) if f.metadata.get("planned")}
TREE_SHAPE, TREE_FLAGS = ("parents", "ranks", "expected", "nodes", "depth"), ("budget", "depth", "branch")


def option_of(key: str) -> str:
    """The DecoderOptions field a policy's `key` fills (a planned tree's shape aside)."""
    return "lookup_tokens" if key == "tokens" else key


def unless_given(policy: dict, given) -> dict:
    """The policy less what the caller set (`given`, field names): a flag typed or a keyword passed wins over the plan."""
    fills = lambda key: TREE_FLAGS if "parents" in policy and key in TREE_SHAPE else (option_of(key),)
    kept = {key: value for key, value in policy.items() if set(fills(key)).isdisjoint(given)}
    if "parents" in policy and "parents" not in kept and kept.get("widths") == []:
        del kept["widths"]  # staged with no stage below the draft is a plan's shape only: the flags' tree gets the default widths
    return kept


def with_policy(options, policy: dict):
    """The DecoderOptions with a policy of their method's in place (a planned tree's shape as `tree_shape`)."""
    tree = "parents" in policy
    fields = {option_of(key): value for key, value in policy.items() if not (tree and key in TREE_SHAPE)}
    if tree:
        shape = Shape(policy["parents"], policy["ranks"], policy["expected"])
        fields |= {"tree_shape": shape, "budget": max(2, len(shape.parents)), "depth": max(1, shape.depth)}
    return replace(options, **fields, policy=policy)


SIZING_FLAGS = ("budget", "depth", "branch", "widths", "draft_calls")  # typed, the caller sizes the tree


def default_policy(options, given=frozenset(), sampling: Sampling = GREEDY) -> dict | None:
    """The policy a method decodes with where no plan applies: staged's is the draft's chain where the device drafts
    one unplanned (decode.devices: on a CPU) unless the caller sized the tree; else None, the flags' defaults
    (decode.options.default_tree)."""
    chain = kind(options.device).chain
    if options.method != "staged" or chain is None or set(SIZING_FLAGS) & set(given):
        return None
    n = chain[0] if sampling.greedy else chain[1]
    return {"parents": list(range(-1, n)), "ranks": [0] * (n + 1), "expected": 0.0, "nodes": n + 1, "depth": n,
            "widths": []}


def unplanned_method(options, given=frozenset(), sampling: Sampling = GREEDY) -> str:
    """The method decoding takes where no plan applies: the options' own, save that staged by default (the caller did
    not name a method) when sampling gives way to the device's choice (decode.devices: plain decoding on a GPU, where
    no drafting measured without a plan ran reliably faster than it; docs/gpu.md)."""
    instead = kind(options.device).sampled_method
    if options.method != "staged" or "method" in given or sampling.greedy or instead is None:
        return options.method
    return instead


def with_plan(options, path: Path | None, given=frozenset(), sampling: Sampling = GREEDY, in_flight: int = 1):
    """The DecoderOptions with the plan's policy for their method in place of every field the caller did not set
    (`given`): the plan fills in the tree, and what the caller set wins. The plan must have been measured for these
    models and settings (load_plan); its policy for `in_flight` requests decoding together where it has one. Without
    a plan, the method's `default_policy` for this sampling setting."""
    if not METHODS[options.method].planned:
        return options
    if path is None:
        policy = default_policy(options, given, sampling)
        return with_policy(options, policy) if policy else options
    policy = load_plan(path, options, in_flight).get(options.method)
    policy = policy and unless_given(policy, given)
    return with_policy(replace(options, plan=Path(path)), policy) if policy else options


def describe(policy: dict) -> str:
    """A policy in words, its tree by its size (a planned tree's parents and ranks left out)."""
    return ", ".join(f"{k} {v}" for k, v in policy.items() if k not in ("parents", "ranks", "expected"))


def planned_loads(path: Path | None) -> list[int]:
    """The numbers of requests in flight a plan chose policies for (decode.plan --concurrency), in order; none where
    it was planned for one request alone, or where there is no plan (load_plan refuses a damaged one)."""
    try:
        return sorted(int(n) for n in json.loads(Path(path).read_text()).get("concurrency", {})) if path else []
    except (OSError, UnicodeDecodeError, ValueError, TypeError, AttributeError):
        return []


def load_plan(path: Path, options, in_flight: int = 1) -> dict:
    """The plan's policies, checked to have been measured for these models on this device: for `in_flight` requests
    decoding together, those it chose for the largest number of them up to that (decode.plan --concurrency), else its
    own (one request)."""
    path = Path(path)
    # the command that plans again, built only for a refusal
    advice = functools.partial(replan_advice, run_of(path), options, setting_of(path.name) or GREEDY, path)
    if (fault := path_fault(path, directory=False)) is not None:
        raise InputError(f"plan {path} {fault}; write one with {advice()}, or pass --no-plan")
    try:
        plan = json.loads(path.read_text())
        policies, measured = plan["policies"], plan["identity"]
        loads = {int(n): level["policies"] for n, level in plan.get("concurrency", {}).items()}
        if plan["version"] != PLAN_VERSION:
            raise ValueError
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        raise InputError(f"{path} is not a plan this version of decode.plan wrote; re-plan with "
                         f"{advice(overwrite=True)}, or pass --no-plan") from None
    prompts = plan.get("calibration", {}).get("prompts") if isinstance(plan.get("calibration"), dict) else None
    redo = lambda: f"re-plan with {advice(prompts, overwrite=True)}, or pass --no-plan"
    current = identity(options)
    absent = [k for k in MODELS if measured.get(k) is not None and current[k] is None]
    for k in absent:
        given = getattr(options, k)
        fault = f"the {k} {given} {path_fault(given, directory=True)}" if given is not None else f"no {k} was given"
        raise InputError(f"{path} was planned with its {k}, and {fault}; pass the {k}'s directory to --{k}, or pass "
                         f"--no-plan")
    changed = [k for k in current if recorded(measured, k) != current[k]]
    if changed:
        what = ", ".join(f"{k} {recorded(measured, k)!r} (now {current[k]!r})" if k in SETTINGS else k
                         for k in changed)
        raise InputError(f"{path} was measured for another setting: {what} changed; {redo()}")
    unknown = sorted({key for chosen in (policies, *loads.values()) for policy in chosen.values()
                      if isinstance(policy, dict) for key in policy if key not in TREE_SHAPE and option_of(key) not in PLANNED})
    if unknown:
        raise InputError(f"{path} sets {', '.join(unknown)}, which no plan fills in (a plan fills "
                         f"{', '.join(sorted(PLANNED))}); {redo()}")
    level = max((n for n in loads if n <= in_flight), default=None)
    return policies if level is None else loads[level]
