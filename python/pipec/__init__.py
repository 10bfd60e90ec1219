"""pipec from Python: compile, verify, simulate and exchange pipeline schedules.

The same C++ library as the ``pipec`` command (built by the project's Bazel build as
``//python:pipec``), with the command's rules: bad input raises ``ValueError`` carrying the
command's one-line message (naming the flag or JSON field and a valid value), and a plan or
schedule that is wrong raises ``pipec.PlanError`` carrying the verifier's diagnostic.

    >>> import pipec
    >>> plan = pipec.compile("examples/uniform-8.json", "1f1b", pp=4, microbatches=8)
    >>> round(plan.stats.bubble_ratio, 4)
    0.2727

``pipec.torch`` runs a plan's schedule with PyTorch's pipelining runtime (docs/pytorch.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ArgumentTypeError",
    "Plan",
    "PlanError",
    "PlanSearch",
    "RankStats",
    "Stats",
    "compile",
    "export_torch_csv",
    "import_torch_csv",
    "list_schedules",
    "load",
    "options",
    "plan",
    "simulate",
    "validate",
]


def _load_extension():
    """The extension sits next to this file under Bazel (bazel-bin/python/pipec or a test's
    runfiles); from the source tree python/pipec it is found in bazel-bin."""
    try:
        from . import _pipec as ext  # noqa: PLC0415
        return ext
    except ImportError:
        pass
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    built = os.path.join(root, "bazel-bin", "python", "pipec")
    if os.path.isdir(built) and built not in __path__:
        __path__.append(built)
    try:
        from . import _pipec as ext  # noqa: PLC0415
        return ext
    except ImportError as err:
        raise ImportError(
            "pipec's extension is not built (or not for this Python): run `bazel build "
            f"//python:pipec` in {root}, and use the project's Python, {root}/.venv/bin/python "
            f"(made from /usr/bin/python3 by tools/setup.sh): {err}") from None


_pipec = _load_extension()

#: A plan or schedule that is wrong; the message is the verifier's diagnostic (the rank, the
#: step and the grid with the step marked), as `pipec validate` prints it.
PlanError = _pipec.PlanError


@dataclass(frozen=True)
class RankStats:
    """Per-rank results of the timing and memory models (docs/contracts.md#semantics)."""

    rank: int
    busy: float | None = None
    span: float | None = None
    start: float | None = None
    end: float | None = None
    step_end: float | None = None
    peak_activation_bytes: int | None = None
    static_bytes: int | None = None
    peak_memory_bytes: int | None = None


@dataclass(frozen=True)
class Stats:
    """makespan, bubble_ratio (1 - mean busy / max span) and step_time in the plan's time
    unit, and the per-rank figures."""

    makespan: float | None
    bubble_ratio: float | None
    step_time: float | None
    ranks: tuple[RankStats, ...]


class Plan:
    """A compiled, verified and simulated plan (pipeplan/1)."""

    def __init__(self, handle, sources=()):
        self._h = handle
        self._dict = None
        self._header = None
        # The files it was made from, as (argument, path): its writers never write onto them.
        self._sources = tuple(sources)

    # Identity and configuration.
    @property
    def schedule(self) -> str:
        return self._h.schedule

    @property
    def model(self) -> str:
        return self._h.model

    @property
    def placement(self) -> str:
        """"loop" (stage s on rank s % pp) or "v-shape"."""
        return self._h.placement

    @property
    def time_unit(self) -> str:
        return self._h.time_unit

    def _head(self) -> dict:
        """The plan's JSON but its instruction streams, read once."""
        if self._header is None:
            self._header = json.loads(self._h.header_json())
        return self._header

    @property
    def parallel(self) -> dict:
        """pp, vpp, tp, dp, cp (context parallelism; 1: none), microbatches, seq_splits,
        microbatch_group_size (0: the default)."""
        p = self._head()["parallel"]
        out = {key: p.get(key, 0) for key in ("pp", "vpp", "tp", "dp", "microbatches",
                                              "seq_splits", "microbatch_group_size")}
        out["cp"] = p.get("cp", 1)
        return out

    @property
    def pp(self) -> int:
        return self.parallel["pp"]

    @property
    def vpp(self) -> int:
        return self.parallel["vpp"]

    @property
    def tp(self) -> int:
        return self.parallel["tp"]

    @property
    def dp(self) -> int:
        return self.parallel["dp"]

    @property
    def cp(self) -> int:
        return self.parallel["cp"]

    @property
    def microbatches(self) -> int:
        return self.parallel["microbatches"]

    @property
    def seq_splits(self) -> int:
        return self.parallel["seq_splits"]

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    @property
    def stages(self) -> list[dict]:
        """One dict per stage: stage, rank, layers (begin, end) and param_bytes."""
        return [{"stage": s["stage"], "rank": s["rank"], "layers": tuple(s["layers"]),
                 "param_bytes": s["param_bytes"]} for s in self._head()["stages"]]

    # Results.
    @property
    def stats(self) -> Stats:
        s = self._head().get("stats", {})
        return Stats(
            makespan=s.get("makespan"),
            bubble_ratio=s.get("bubble_ratio"),
            step_time=s.get("step_time"),
            ranks=tuple(RankStats(**r) for r in s.get("ranks", ())),
        )

    @property
    def num_instructions(self) -> int:
        return self._h.num_instructions

    @property
    def ranks(self) -> list[list[dict]]:
        """Every rank's instruction stream, as in the plan's JSON."""
        return [r["instructions"] for r in self.to_dict()["ranks"]]

    def instructions(self, rank: int) -> list[dict]:
        """Rank `rank`'s stream: dicts with op, stage, mb, slice (and tensor, peer, bytes,
        group for sends and recvs), as in the plan's JSON."""
        ranks = self.ranks
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(ranks):
            raise ValueError(f"rank: expected a rank in 0..{len(ranks) - 1} (got {rank!r})")
        return ranks[rank]

    # Spellings.
    @property
    def json(self) -> str:
        """pipeplan/1 JSON, byte for byte what `pipec compile -o` writes."""
        return self._h.json()

    @property
    def text(self) -> str:
        """The text form, one "rank N: ..." line per rank (`pipec show --text`)."""
        return self._h.text(False)

    def grid(self, compute_only: bool = False) -> str:
        """The rank x step grid `pipec show` prints."""
        return self._h.grid(_switch("compute_only", compute_only))

    def to_dict(self) -> dict:
        if self._dict is None:
            self._dict = json.loads(self.json)
        return self._dict

    def trace(self) -> str:
        """Chrome/Perfetto trace JSON of the simulated timeline."""
        return self._h.trace()

    def save(self, path) -> None:
        """Write the plan's JSON (atomically: a temporary file, then a rename), never onto a
        file it was made from (its model, cluster, costs or plan file)."""
        path = _path("path", path)
        _pipec.check_output("path", path, list(self._sources))
        self._h.save(path)

    def export_torch_csv(self, comms: bool = False, path=None) -> str:
        return export_torch_csv(self, comms=comms, path=path)

    @property
    def import_report(self) -> str:
        """For a plan made by import_torch_csv: what was inferred and which schedule it is."""
        return self._h.import_report

    @property
    def throughput(self) -> dict | None:
        """The step as published runs report it, for a transformer plan that compile,
        import_torch_csv or plan made (what `pipec compile` prints on its throughput: line):
        tokens_per_second (every microbatch of every replica), tokens_per_second_per_gpu,
        tflops_per_gpu (model FLOPs: forward and both backward passes, no recomputation) and
        mfu (a fraction of the cluster device's peak). None for an abstract model's plan and
        for one read from JSON (load, loads), which does not carry its model."""
        return self._h.throughput

    def __repr__(self) -> str:
        st = self.stats
        bubble = "" if st.bubble_ratio is None else f", bubble ratio {st.bubble_ratio:.4f}"
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        return (f"<pipec.Plan {self.schedule} on {self.model}: pp={self.pp} vpp={self.vpp} "
                f"tp={self.tp}{cp} dp={self.dp} microbatches={self.microbatches}{bubble}>")


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type, or one the call does not take; the message names it and
    the flag it stands for. Also a ValueError, which such mistakes raised before arguments were
    typed."""


def _path(what: str, value) -> str:
    if isinstance(value, (str, os.PathLike)):
        try:
            path = os.fspath(value)
        except TypeError as err:  # an os.PathLike whose __fspath__ returns something else
            raise ArgumentTypeError(f"{what}: expected a path ({err})") from None
        path = os.fsdecode(path) if isinstance(path, bytes) else path
        if "\0" in path:
            raise ValueError(f"{what}: a path cannot hold a NUL character (got {path!r})")
        return path
    raise ArgumentTypeError(f"{what}: expected a path (got {type(value).__name__})")


_TABLES: dict[str, dict[str, dict]] = {}


def _table(command: str) -> dict[str, dict]:
    """The keyword arguments of `command`: its option table's flags that Python may give
    (tools/Options.cpp), by their Python names, with their kinds."""
    if command not in _TABLES:
        _TABLES[command] = {o["python"]: o for o in _pipec.options(command)}
    return _TABLES[command]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _wrong(option: dict, what: str, value) -> ArgumentTypeError:
    return ArgumentTypeError(f"{option['python']}: {option['name']} expects {what} "
                             f"(got {type(value).__name__} {value!r:.80})")


def _text(option: dict, value: str) -> str:
    """A str argument as the command line takes it: a NUL would end it there (the rest
    silently dropped), and a lone surrogate cannot be encoded."""
    if "\0" in value:
        raise ValueError(f"{option['python']}: cannot hold a NUL character (got {value!r})")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{option['python']}: not valid text (got {value!r})") from None
    return value


def _typed(option: dict, value, table: dict) -> list[str]:
    """The flag and value (as the command line spells them) of a typed keyword argument."""
    kind, flag = option["kind"], option["name"]
    twin = table.get(option["python"] + "_json")
    if twin is not None and isinstance(value, dict):  # a model or cluster given as a dict
        try:
            return [twin["name"], json.dumps(value, allow_nan=False)]
        except (TypeError, ValueError, RecursionError) as err:
            raise ValueError(f"{option['python']}: not JSON ({err})") from None
    if kind == "switch":
        if not isinstance(value, bool):
            raise _wrong(option, "True or False", value)
        return [flag] if value else []
    if kind == "int":
        if not _is_int(value):
            raise _wrong(option, "an integer", value)
        return [flag, str(value)]
    if kind == "bytes":
        if not (_is_int(value) or isinstance(value, str)):
            raise _wrong(option, "a byte count (an int, or a str such as '80GiB')", value)
        return [flag, _text(option, str(value))]
    if kind == "double":
        if not (_is_int(value) or isinstance(value, float)):
            raise _wrong(option, "a number", value)
        return [flag, repr(value)]
    if kind == "path":
        if twin is not None and not isinstance(value, (str, os.PathLike)):
            raise ArgumentTypeError(f"{option['python']}: expected a dict or a path to a JSON "
                                    f"file (got {type(value).__name__})")
        return [flag, _path(option["python"], value)]
    if kind in ("string", "enum"):
        if not isinstance(value, str):
            choices = option["value"].replace("|", ", ")
            raise _wrong(option, f"one of {choices}" if kind == "enum" else "a str", value)
        return [flag, _text(option, value)]
    if kind in ("int_list", "string_list"):
        element = _is_int if kind == "int_list" else (lambda v: isinstance(v, str))
        if not isinstance(value, (list, tuple)) or not all(element(v) for v in value):
            raise _wrong(option, "a list of " + ("ints" if kind == "int_list" else "str"),
                         value)
        # The command line joins the list with commas: an element holding one would be two.
        for v in value:
            if kind == "string_list" and "," in v:
                raise ValueError(f"{option['python']}: an element cannot hold a comma "
                                 f"(got {v!r}); give each as its own element")
        return [flag, ",".join(_text(option, str(v)) for v in value)]
    raise AssertionError(f"{flag}: kind {kind} has no Python type")


def _flags(call: str, command: str, given: dict) -> list[str]:
    """The command's flags for a call's arguments, each checked against its table entry's type;
    None leaves a flag out."""
    table = _table(command)
    out: list[str] = []
    for key, value in given.items():
        option = table.get(key)
        if option is None or key.endswith("_json"):
            known = ", ".join(sorted(k for k in table if not k.endswith("_json")))
            raise ArgumentTypeError(f"{call}: unknown argument {key!r} (known: {known})")
        if value is not None:
            out += _typed(option, value, table)
    return out


def _inputs(**given) -> list[tuple[str, str]]:
    """The files a call reads, as (argument, path): the arguments given as paths, and the files
    a Plan among them was made from. Its outputs are checked against them (by device and inode,
    so links are caught) before any is written."""
    out = []
    for name, value in given.items():
        if isinstance(value, (str, os.PathLike)):
            out.append((name, _path(name, value)))
        elif isinstance(value, Plan):
            out += value._sources
    return out


def _switch(what: str, value) -> bool:
    """A True/False argument: a truthy str such as "no" is not taken for True."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{what}: expected True or False (got {type(value).__name__})")
    return value


def _as_plan(plan) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return load(plan)
    raise ArgumentTypeError(f"plan: expected a pipec.Plan or the path of a plan JSON file "
                     f"(got {type(plan).__name__})")


def compile(model, schedule: str, pp: int, microbatches: int, **flags: Any) -> Plan:  # noqa: A001
    """Compile, verify and simulate a plan, as `pipec compile` does.

    model: a pipemodel/1 dict or the path of one. schedule: a name from list_schedules().
    flags: `pipec compile`'s flags by their Python names (options("compile")): vpp, seq_splits,
    tp, dp, cp (int), cluster (a pipecluster/1 dict or path), memory_limit (an int of bytes, or a
    str such as "80GiB"), microbatch_group_size (int), recompute ("none", "selective", "full"),
    microbatch_size (int; overrides the transformer spec's),
    sequence_parallel, distributed_optimizer (bool), seq_split_by ("time", "flops"), costs (the path of measured costs, pipecost/1:
    `piperun --profile` or pipec.torch.profile).
    A wrong type raises ArgumentTypeError (a TypeError) naming the argument.
    """
    given = {"model": model, "schedule": schedule, "pp": pp, "microbatches": microbatches}
    return Plan(_pipec.compile(_flags("compile", "compile", {**given, **flags})),
                _inputs(model=model, cluster=flags.get("cluster"), costs=flags.get("costs")))


@dataclass(frozen=True)
class PlanSearch:
    """What pipec.plan found: the ranked layouts, best first (dicts: schedule, tp, pp, vpp, dp,
    cp, microbatch_size, microbatches, seq_splits, recompute, sequence_parallel and
    distributed_optimizer (bool), costs ("measured" or "model"), step_time, bubble,
    peak_memory_bytes, headroom_bytes, model_flops for a transformer, and held_out_error: the
    cluster spec's calibration record for that schedule, the mean error of its published runs
    predicted held out, as a fraction, or None without one), the best one compiled, the count
    of candidates searched and of those dropped, by reason."""

    best: Plan
    ranked: tuple[dict, ...]
    searched: int
    dropped: dict
    memory_limit: int
    min_headroom: int
    tokens_per_step: int


def plan(model, gpus: int, global_batch: int, **flags: Any) -> PlanSearch:
    """Search layouts and schedules for the fastest step that fits, as `pipec plan` does.

    model: a pipemodel/1 dict or path. flags: `pipec plan`'s by their Python names
    (options("plan")): cluster, schedules (list of str), memory_limit, min_headroom (str such as
    "5%" or "4GiB"), top, recompute (list of str), microbatch_sizes, seq_splits, tp, pp, cp
    (lists of int; cp defaults to [1]), max_vpp, threads (int), tp_across_nodes, sequence_parallel,
    no_sequence_parallel, distributed_optimizer, no_distributed_optimizer (bool; neither of a
    pair: both searched), costs (a pipecost/1 path). Raises PlanError when no layout fits in
    memory.
    """
    given = {"model": model, "gpus": gpus, "global_batch": global_batch}
    found = _pipec.plan(_flags("plan", "plan", {**given, **flags}))
    sources = _inputs(model=model, cluster=flags.get("cluster"), costs=flags.get("costs"))
    return PlanSearch(best=Plan(found["best"], sources), ranked=tuple(found["ranked"]),
                      searched=found["searched"], dropped=found["dropped"],
                      memory_limit=found["memory_limit"], min_headroom=found["min_headroom"],
                      tokens_per_step=found["tokens_per_step"])


def options(command: str) -> list[dict]:
    """The keyword arguments a call takes for `command` ("compile", "import", "plan"): the
    command's option table (name, python, kind, value, help, required; min and max for an
    int), less the command line's outputs and printing."""
    return [dict(o) for o in _table(command).values() if not o["python"].endswith("_json")]


def load(path) -> Plan:
    """A plan from a pipeplan/1 file (validate() checks its streams)."""
    path = _path("path", path)
    return Plan(_pipec.load_plan(path), [("plan", path)])


def validate(plan) -> None:
    """Check a plan (a Plan or a path) as `pipec validate` does: dependencies, FIFO matching,
    deadlock freedom, collectives. Raises PlanError with the diagnostic if it is wrong."""
    _pipec.validate(_as_plan(plan)._h)


def simulate(plan, trace=None) -> Plan:
    """Time and memory of a plan (a Plan or a path), as `pipec simulate` does; with `trace`, a
    Chrome/Perfetto trace is written there too. Returns the plan with fresh stats."""
    given = _as_plan(plan)
    inputs = _inputs(plan=plan)
    return Plan(_pipec.simulate(given._h, None if trace is None else _path("trace", trace),
                                inputs), inputs)


def export_torch_csv(plan, comms: bool = False, path=None) -> str:
    """The plan as PyTorch pipelining's schedule CSV, as `pipec export --format torch-csv`
    (or torch-csv-comms with comms=True) writes it; also written to `path` if given."""
    given = _as_plan(plan)
    csv = given._h.torch_csv(_switch("comms", comms))
    if path is not None:
        _pipec.write_file("path", _path("path", path), csv, _inputs(plan=plan))
    return csv


def import_torch_csv(source, /, model, **flags: Any) -> Plan:
    """Compile a schedule written elsewhere, as `pipec import` does: PyTorch's CSV (either form)
    or pipec's text form, given as a path, a file object, or the text itself (a string with a
    line break). pp, vpp, microbatches and the placement come from the file.

    source is positional only, so that the keyword schedule= is the flag below.
    model: a pipemodel/1 dict or path. flags: vpp (checked against the file), tp, dp,
    memory_limit, microbatch_group_size, schedule (the name it must be), cluster.
    """
    limit = _pipec.TEXT_INPUT_LIMIT
    from_path = False
    read = getattr(source, "read", None)
    if read is not None and not isinstance(source, (str, bytes, os.PathLike)):
        if not callable(read):
            raise ValueError(f"schedule: expected a path, text or a file object "
                             f"(got {type(source).__name__} whose read is not callable)")
        name = getattr(source, "name", "schedule")
        name = name if isinstance(name, str) else "schedule"
        try:
            text = read(limit + 1)  # at most the limit of a file read by path
        except (OSError, ValueError, TypeError) as err:
            raise ValueError(f"{name}: cannot read: {err}") from None
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="replace")
        if isinstance(text, str) and len(text) > limit:
            raise ValueError(f"{name}: more than a schedule text can need (at most 1.00 GiB)")
        source = name
    elif isinstance(source, str) and "\n" in source:
        text, source = source, "schedule"
    else:
        source = _path("schedule", source)
        from_path = True
        # The command's input rules: a regular file or a pipe, bounded; /dev/zero, a directory
        # or a socket is refused before a byte is read.
        text = _pipec.read_text(source).decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise ValueError(f"schedule: expected text (got {type(text).__name__})")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("schedule: not valid text (it holds a lone surrogate)") from None
    args = _flags("import_torch_csv", "import", {"model": model, **flags})
    sources = _inputs(model=model, cluster=flags.get("cluster"))
    if from_path:
        sources.append(("schedule", source))
    return Plan(_pipec.import_schedule(text, source, args), sources)


def list_schedules() -> list[dict]:
    """Every schedule: name, summary, constraints, placement (`pipec list-schedules`)."""
    return _pipec.list_schedules()
