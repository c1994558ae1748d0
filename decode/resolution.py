"""From what a caller names to the options a decoder runs with: a run's parts, the dtype "auto" stands for, and the
run's plan for each sampling setting, whose policy fills in what the caller did not set. The library
(`SpeculativeDecoder.from_run`) and the commands (decode/cli/flags.py) resolve through `resolve` alike."""
from dataclasses import dataclass, field, replace
from pathlib import Path

from decode.devices import check_device
from decode.methods import METHODS, check_options
from decode.models.precision import auto_dtype
from decode.options import DecoderOptions
from decode.plan_file import default_policy, nearest_run_plan, plan_name, replan, setting_of, unplanned_method, with_plan
from decode.sampling import GREEDY, Sampling


@dataclass(frozen=True)
class Resolved:
    """Options before any plan (`base`, checked), the fields the caller set (`given`, which win over every plan),
    and where plans come from: `plan`, one file for every setting (None: none), unless `run_plans`, when each sampling
    setting takes the run's own plan for it (plan_name) where that was made for these models and settings."""

    base: DecoderOptions
    given: frozenset[str]
    run: Path | None = None
    plan: Path | None = None
    run_plans: bool = False
    dtype_reason: str | None = None  # why "auto" stood for base.dtype (None: the caller chose the dtype)
    found: dict = field(default_factory=dict, compare=False)  # sampling setting -> (its plan, what a refused one was made for)

    def plan_for(self, sampling: Sampling = GREEDY) -> tuple[Path | None, list[str]]:
        """The plan a decoder with this sampling follows (the run's for this setting, else the nearest setting's:
        `nearest_run_plan`), and (when the run's plan for it does not fit these settings) the settings that one was
        planned for."""
        if not self.run_plans:
            return self.plan, []
        if sampling not in self.found:
            assert self.run is not None, "run_plans only with a run"
            self.found[sampling] = nearest_run_plan(self.run, self.base, sampling)
        return self.found[sampling]

    def borrowed(self, sampling: Sampling = GREEDY) -> str | None:
        """Which plan this sampling setting borrows when it follows another setting's, in words (None: its own, or
        none). A plan chooses trees only: what is accepted is the oracle's either way."""
        plan = self.plan_for(sampling)[0]
        made_for = setting_of(plan.name) if plan is not None and self.run_plans else None
        if made_for is None or made_for == sampling:
            return None
        return f"{plan} (planned for {made_for.describe()}, the nearest planned setting to {sampling.describe()})"

    def options(self, sampling: Sampling = GREEDY, method: str | None = None, in_flight: int = 1) -> DecoderOptions:
        """The options for `method` (default: the base's, or without a plan its `unplanned_method`) under this
        sampling, its plan's policy (for `in_flight` requests decoding together) filling in what the caller did not
        set."""
        plan = self.plan_for(sampling)[0]
        if method is None:
            method = self.base.method if plan is not None else unplanned_method(self.base, self.given, sampling)
        return with_plan(replace(self.base, method=method), plan, self.given, sampling, in_flight)

    def without_plan(self, sampling: Sampling = GREEDY) -> str | None:
        """Why the method decodes without the run's plan under this sampling, in words: the run's plan for it was made
        for other settings, or (a tree method whose tree the caller did not size) there is none. None otherwise."""
        if not self.run_plans or self.run is None:
            return None
        plan, other = self.plan_for(sampling)
        if other and plan is None:
            return f"{self.run / plan_name(sampling)} was planned for {', '.join(other)}"
        if plan is None and METHODS[self.base.method].tree and not {"widths", "budget"} & self.given:
            return f"no plan for this setting in {self.run} ({plan_name(sampling)})"
        return None

    def notes(self, sampling: Sampling = GREEDY) -> list[str]:
        """What decoding at this sampling setting says of its plan, a line each: the plan it borrows from another
        setting, or why it has none, what it drafts instead and the command that plans."""
        borrowed, reason = self.borrowed(sampling), self.without_plan(sampling)
        if borrowed is None and reason is None:
            return []
        command, written = replan(self.run, self.base, sampling)
        then = "" if self.run is not None and written == self.run / plan_name(sampling) else f" (then pass --plan {written})"
        notes = []
        if borrowed is not None:
            notes.append(f"{sampling.describe()} decodes with the plan {borrowed}; `{command}` plans its own{then}")
        if reason is not None:
            notes.append(f"{reason}, so {self.base.method} uses {self.unplanned(sampling)}; `{command}` plans each "
                         f"method for these models{then}")
        return notes

    def check_plans(self) -> None:
        """Load every plan a request may decode with (the one plan, or each of the run's plans for its setting), so
        that a damaged one is an InputError naming it now rather than a failure of every request of its setting."""
        settings = {GREEDY} if not self.run_plans else {GREEDY, *(s for p in Path(self.run or ".").glob("plan*.json")
                                                                  if (s := setting_of(p.name)) is not None)}
        for sampling in settings:
            self.options(sampling)

    def unplanned(self, sampling: Sampling = GREEDY) -> str:
        """What the method drafts without a plan under this sampling setting, in words."""
        base, policy = self.base, default_policy(self.base, self.given, sampling)
        if (method := unplanned_method(base, self.given, sampling)) != base.method:
            return (f"{method} ({METHODS[method].summary}): without a plan, no drafting measured on a GPU when "
                    f"sampling ran reliably faster than plain decoding (docs/gpu.md)")
        if policy is not None:
            return f"the draft's chain of {policy['depth']} tokens, the shape plans choose on a CPU"
        if METHODS[base.method].tree:
            return f"a tree sized for this device (budget {base.budget}, widths {','.join(map(str, base.widths or []))})"
        return "its defaults"


def resolve(fields: dict, given: frozenset[str], run: Path | None = None, *, plan: Path | None = None,
            plans: bool = True, calibrate: bool = False) -> Resolved:
    """`fields`: DecoderOptions' fields as the caller has them (oracle, draft and ngram default to the run's parts;
    dtype "auto" or absent: the dtype the run's greedy plan, or `plan`, was planned in on this device, else the
    oracle's calibrated one, measured now with `calibrate`: the planner's, which measures afresh); `given`: the ones
    the caller set. `plan`: one plan file for every setting; `plans=False`: none at all."""
    fields = dict(fields)
    if run is not None:
        for part in ("oracle", "draft", "ngram"):
            fields[part] = fields.get(part) or run / part
    for part in ("oracle", "draft", "ngram"):
        fields[part] = fields.get(part) and Path(fields[part])
    reason = None
    check_device(fields.get("device", "cpu"))  # before anything asks the device what it is (the dtype's choice)
    if fields.get("dtype", "auto") == "auto":
        planned = None if calibrate else plan or (run and run / plan_name())
        fields["dtype"], reason = auto_dtype(fields.get("device", "cpu"), planned, fields.get("oracle"), calibrate)
    base = check_options(DecoderOptions(**fields))
    run_plans = plans and plan is None and run is not None
    return Resolved(base, frozenset(given), run and Path(run), plan if plans else None, run_plans, reason)
