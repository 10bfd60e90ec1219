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
    "Plan",
    "PlanError",
    "RankStats",
    "Stats",
    "compile",
    "export_torch_csv",
    "import_torch_csv",
    "list_schedules",
    "load",
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

    def __init__(self, handle):
        self._h = handle
        self._dict = None

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

    @property
    def parallel(self) -> dict:
        return self._h.parallel

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
        return self._h.stages

    # Results.
    @property
    def stats(self) -> Stats:
        s = self._h.stats
        return Stats(
            makespan=s.get("makespan"),
            bubble_ratio=s.get("bubble_ratio"),
            step_time=s.get("step_time"),
            ranks=tuple(RankStats(**r) for r in s["ranks"]),
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
        return self._h.grid(bool(compute_only))

    def to_dict(self) -> dict:
        if self._dict is None:
            self._dict = json.loads(self.json)
        return self._dict

    def trace(self) -> str:
        """Chrome/Perfetto trace JSON of the simulated timeline."""
        return self._h.trace()

    def save(self, path) -> None:
        """Write the plan's JSON (atomically: a temporary file, then a rename)."""
        self._h.save(_path("path", path))

    def export_torch_csv(self, comms: bool = False, path=None) -> str:
        return export_torch_csv(self, comms=comms, path=path)

    @property
    def import_report(self) -> str:
        """For a plan made by import_torch_csv: what was inferred and which schedule it is."""
        return self._h.import_report

    def __repr__(self) -> str:
        st = self.stats
        bubble = "" if st.bubble_ratio is None else f", bubble ratio {st.bubble_ratio:.4f}"
        return (f"<pipec.Plan {self.schedule} on {self.model}: pp={self.pp} vpp={self.vpp} "
                f"tp={self.tp} dp={self.dp} microbatches={self.microbatches}{bubble}>")


# Keyword arguments and the command's flags they stand for.
_COMPILE_FLAGS = {
    "vpp": "--vpp",
    "seq_splits": "--seq-splits",
    "tp": "--tp",
    "dp": "--dp",
    "memory_limit": "--memory-limit",
    "microbatch_group_size": "--microbatch-group-size",
    "costs": "--costs",
}
_IMPORT_FLAGS = {
    "vpp": "--vpp",
    "tp": "--tp",
    "dp": "--dp",
    "memory_limit": "--memory-limit",
    "microbatch_group_size": "--microbatch-group-size",
    "schedule": "--schedule",
    "costs": "--costs",
}


def _path(what: str, value) -> str:
    if isinstance(value, (str, os.PathLike)):
        try:
            path = os.fspath(value)
        except TypeError as err:  # an os.PathLike whose __fspath__ returns something else
            raise ValueError(f"{what}: expected a path ({err})") from None
        path = os.fsdecode(path) if isinstance(path, bytes) else path
        if "\0" in path:
            raise ValueError(f"{what}: a path cannot hold a NUL character (got {path!r})")
        return path
    raise ValueError(f"{what}: expected a path (got {type(value).__name__})")


def _flag_value(flag: str, value) -> str:
    if isinstance(value, bool):
        raise ValueError(f"{flag} expects an integer (got {value!r})")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return str(int(value))
    if isinstance(value, str):
        return value
    raise ValueError(f"{flag} expects an integer (got {type(value).__name__} {value!r})")


def _spec_flags(kind: str, value, what: str) -> list[str]:
    """A model or cluster given as a dict (sent as JSON text) or as a path."""
    if isinstance(value, dict):
        try:
            text = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as err:
            raise ValueError(f"{kind}: not JSON ({err})") from None
        return [f"--{kind}-json", text]
    if isinstance(value, (str, os.PathLike)):
        return [f"--{kind}", _path(kind, value)]
    raise ValueError(f"{kind}: expected a dict or a path to a {what} JSON file "
                     f"(got {type(value).__name__})")


def _keyword_flags(call: str, allowed: dict, flags: dict) -> list[str]:
    out: list[str] = []
    for key, value in flags.items():
        if key == "cluster":
            if value is not None:
                out += _spec_flags("cluster", value, "pipecluster/1")
            continue
        if key not in allowed:
            known = ", ".join(sorted([*allowed, "cluster"]))
            raise ValueError(f"{call}: unknown argument {key!r} (known: {known})")
        if value is None:
            continue
        flag = allowed[key]
        if key == "costs":
            out += [flag, _path("costs", value)]
            continue
        if key == "schedule" and not isinstance(value, str):
            raise ValueError(f"--schedule: expected a schedule name (got {type(value).__name__})")
        out += [flag, _flag_value(flag, value)]
    return out


def _inputs(**given) -> list[tuple[str, str]]:
    """The files a call reads, as (argument, path): the arguments given as paths. Its outputs
    are checked against them (by device and inode, so links are caught) before any is written."""
    return [(name, _path(name, value)) for name, value in given.items()
            if isinstance(value, (str, os.PathLike))]


def _as_plan(plan) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return load(plan)
    raise ValueError(f"plan: expected a pipec.Plan or the path of a plan JSON file "
                     f"(got {type(plan).__name__})")


def compile(model, schedule: str, pp: int, microbatches: int, **flags: Any) -> Plan:  # noqa: A001
    """Compile, verify and simulate a plan, as `pipec compile` does.

    model: a pipemodel/1 dict or the path of one. schedule: a name from list_schedules().
    flags: vpp, seq_splits, tp, dp, memory_limit (bytes, or a string such as "80GiB"),
    microbatch_group_size, cluster (a pipecluster/1 dict or path), costs (the path of measured
    costs, pipecost/1: `piperun --profile` or pipec.torch.profile).
    """
    if not isinstance(schedule, str):
        raise ValueError(f"--schedule: expected a schedule name (got {type(schedule).__name__})")
    args = _spec_flags("model", model, "pipemodel/1")
    args += ["--schedule", schedule, "--pp", _flag_value("--pp", pp), "--microbatches",
             _flag_value("--microbatches", microbatches)]
    args += _keyword_flags("compile", _COMPILE_FLAGS, flags)
    return Plan(_pipec.compile(args))


def load(path) -> Plan:
    """A plan from a pipeplan/1 file (validate() checks its streams)."""
    return Plan(_pipec.load_plan(_path("path", path)))


def validate(plan) -> None:
    """Check a plan (a Plan or a path) as `pipec validate` does: dependencies, FIFO matching,
    deadlock freedom, collectives. Raises PlanError with the diagnostic if it is wrong."""
    _pipec.validate(_as_plan(plan)._h)


def simulate(plan, trace=None) -> Plan:
    """Time and memory of a plan (a Plan or a path), as `pipec simulate` does; with `trace`, a
    Chrome/Perfetto trace is written there too. Returns the plan with fresh stats."""
    return Plan(_pipec.simulate(_as_plan(plan)._h, None if trace is None else _path("trace", trace),
                                _inputs(plan=plan)))


def export_torch_csv(plan, comms: bool = False, path=None) -> str:
    """The plan as PyTorch pipelining's schedule CSV, as `pipec export --format torch-csv`
    (or torch-csv-comms with comms=True) writes it; also written to `path` if given."""
    csv = _as_plan(plan)._h.torch_csv(bool(comms))
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
        # The command's input rules: a regular file or a pipe, bounded; /dev/zero, a directory
        # or a socket is refused before a byte is read.
        text = _pipec.read_text(source).decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise ValueError(f"schedule: expected text (got {type(text).__name__})")
    args = _spec_flags("model", model, "pipemodel/1")
    args += _keyword_flags("import_torch_csv", _IMPORT_FLAGS, flags)
    return Plan(_pipec.import_schedule(text, source, args))


def list_schedules() -> list[dict]:
    """Every schedule: name, summary, constraints, placement (`pipec list-schedules`)."""
    return _pipec.list_schedules()
