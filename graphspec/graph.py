"""Stages and the graph that runs them once per decoding step.

- A ``Stage`` has a name, the state fields it reads, the fields it writes, and a ``run(state)``
  step; ``begin(state)`` runs once per generation (allocate a KV cache, prefill the prompt).
  A plain function becomes a stage with ``Stage(name, reads, writes, fn)``.
- A ``Graph`` is an ordered set of stages, validated when it is built: every field a stage reads
  must be a graph input or be written by an earlier stage, and the fields the caller needs
  (``outputs``) must be written by some stage. Errors name the stage and the field.
- Graphs are immutable: ``replace`` / ``insert_before`` / ``insert_after`` / ``without`` return a
  new, re-validated graph, so swapping one stage never touches the others.
- ``run`` times every stage on every step (``time.perf_counter``; with ``sync=True`` the device is
  synchronised before each clock read, so asynchronous CUDA work is charged to the stage that
  queued it). ``describe()`` (also ``str(graph)``) lists the stages with their fields and
  ``to_dot()`` draws the data flow for Graphviz.
- Stages keep no per-run data on themselves: caches and counters live in the run's ``State``
  (``state.scratch(stage)``), so one graph can serve several generations at once.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, Sequence

import torch

__all__ = ["Stage", "Graph"]


def _names(fields: Iterable[str] | str, what: str) -> tuple[str, ...]:
    if isinstance(fields, str):
        fields = (fields,)
    out = tuple(fields)
    for f in out:
        if not isinstance(f, str) or not f.isidentifier() or f.startswith("_"):
            raise ValueError(f"{what} must be public identifiers (field names like 'draft_ids'), got {f!r}")
    return out


class Stage:
    """One step of the decoding graph.

    Subclasses set ``name`` / ``reads`` / ``writes`` (class attributes or via ``__init__``) and
    override ``run`` (and ``begin`` when they need per-generation setup). For a quick custom
    stage pass a function: ``Stage("log", reads=("emitted",), writes=(), fn=lambda s: ...)``.
    """

    name: str = ""
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()

    def __init__(self, name: str | None = None, reads: Iterable[str] | None = None,
                 writes: Iterable[str] | None = None, fn: Callable[["object"], None] | None = None):
        if name is not None:
            self.name = name
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a Stage needs a non-empty name, got {self.name!r}")
        self.reads = _names(self.reads if reads is None else reads, f"stage {self.name!r} reads")
        self.writes = _names(self.writes if writes is None else writes, f"stage {self.name!r} writes")
        if fn is not None and not callable(fn):
            raise ValueError(f"stage {self.name!r}: fn must be callable, got {type(fn).__name__}")
        self._fn = fn

    def check(self, params) -> None:
        """Raise ValueError when this stage cannot serve these ``SamplingParams`` (called before any work)."""

    def begin(self, state) -> None:
        """Per-generation setup (before the first step); the default does nothing."""

    def run(self, state) -> None:
        """Read ``self.reads`` from ``state`` and set ``self.writes`` on it."""
        if self._fn is None:
            raise NotImplementedError(f"stage {self.name!r} ({type(self).__name__}) has no run step: "
                                      f"override run() or pass fn=")
        self._fn(state)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, reads={list(self.reads)}, "
                f"writes={list(self.writes)})")


class Graph:
    """An ordered, validated set of stages.

    ``inputs`` are the fields the caller sets before a step; ``outputs`` are the fields the
    caller reads after it (they must be written by some stage).
    """

    def __init__(self, stages: Sequence[Stage], inputs: Iterable[str] = (), outputs: Iterable[str] = ()):
        self.stages: tuple[Stage, ...] = tuple(stages)
        self.inputs: tuple[str, ...] = _names(inputs, "graph inputs")
        self.outputs: tuple[str, ...] = _names(outputs, "graph outputs")
        self._validate()
        self._written = tuple(dict.fromkeys(f for s in self.stages for f in s.writes))

    # ------------------------------------------------------------------ validation

    def _validate(self) -> None:
        seen_names: set[str] = set()
        available = set(self.inputs)
        for i, stage in enumerate(self.stages):
            if not isinstance(stage, Stage):
                raise ValueError(f"graph stage #{i} is a {type(stage).__name__}, not a graphspec Stage")
            if stage.name in seen_names:
                raise ValueError(f"two stages are named {stage.name!r}; stage names must be unique in a graph")
            seen_names.add(stage.name)
            for field in stage.reads:
                if field not in available:
                    earlier = [s.name for s in self.stages[:i]]
                    raise ValueError(
                        f"stage {stage.name!r} reads field {field!r}, which no earlier stage writes "
                        f"(earlier stages: {earlier or 'none'}) and which is not a graph input "
                        f"(inputs: {list(self.inputs) or 'none'}); add a stage that writes {field!r} before "
                        f"{stage.name!r} or provide it as an input")
            available.update(stage.writes)
        written = {f for s in self.stages for f in s.writes}
        for field in self.outputs:
            if field not in written and field not in self.inputs:
                raise ValueError(f"the graph must produce field {field!r} but no stage writes it "
                                 f"(stages: {self.names})")

    # ------------------------------------------------------------------ access

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    @property
    def written(self) -> tuple[str, ...]:
        """Every field some stage writes, in first-write order."""
        return self._written

    def __iter__(self) -> Iterator[Stage]:
        return iter(self.stages)

    def __len__(self) -> int:
        return len(self.stages)

    def __contains__(self, name: str) -> bool:
        return any(s.name == name for s in self.stages)

    def __getitem__(self, name: str) -> Stage:
        return self.stages[self._index(name)]

    def _index(self, name: str) -> int:
        for i, s in enumerate(self.stages):
            if s.name == name:
                return i
        raise KeyError(f"no stage named {name!r} in the graph (stages: {self.names})")

    # ------------------------------------------------------------------ editing (returns new graphs)

    def _with(self, stages: Sequence[Stage]) -> "Graph":
        return Graph(stages, inputs=self.inputs, outputs=self.outputs)

    def replace(self, name: str, stage: Stage) -> "Graph":
        """A new graph with stage ``name`` swapped for ``stage`` (validated)."""
        i = self._index(name)
        return self._with(self.stages[:i] + (stage,) + self.stages[i + 1:])

    def insert_before(self, name: str, stage: Stage) -> "Graph":
        i = self._index(name)
        return self._with(self.stages[:i] + (stage,) + self.stages[i:])

    def insert_after(self, name: str, stage: Stage) -> "Graph":
        i = self._index(name)
        return self._with(self.stages[:i + 1] + (stage,) + self.stages[i + 1:])

    def without(self, name: str) -> "Graph":
        i = self._index(name)
        return self._with(self.stages[:i] + self.stages[i + 1:])

    # ------------------------------------------------------------------ running

    def begin(self, state) -> None:
        """Per-generation setup of every stage, in order."""
        for stage in self.stages:
            stage.begin(state)

    def run(self, state, seconds: dict[str, float] | None = None, sync: bool = False,
            device: torch.device | None = None) -> None:
        """Run one step: every stage in order, adding each one's wall time to ``seconds[name]``."""
        if seconds is None:
            for stage in self.stages:
                stage.run(state)
            return
        if sync:
            torch.cuda.synchronize(device)
        clock = time.perf_counter()
        for stage in self.stages:
            stage.run(state)
            if sync:
                torch.cuda.synchronize(device)
            now = time.perf_counter()
            seconds[stage.name] = seconds.get(stage.name, 0.0) + (now - clock)
            clock = now

    # ------------------------------------------------------------------ display

    def describe(self) -> str:
        """A table of the stages with the fields they read and write."""
        lines = ["Graph: " + (" -> ".join(self.names) or "(empty)"),
                 f"  inputs:  {', '.join(self.inputs) or '-'}",
                 f"  outputs: {', '.join(self.outputs) or '-'}"]
        rows = [(s.name, type(s).__name__, ", ".join(s.reads) or "-", ", ".join(s.writes) or "-")
                for s in self.stages]
        if rows:
            w0 = max(len(r[0]) for r in rows)
            w1 = max(len(r[1]) for r in rows) + 2
            w2 = max(len(r[2]) for r in rows)
            for name, kind, reads, writes in rows:
                lines.append(f"  {name:<{w0}}  {'(' + kind + ')':<{w1}}  reads {reads:<{w2}}  writes {writes}")
        return "\n".join(lines)

    __str__ = describe

    def __repr__(self) -> str:
        return f"Graph({' -> '.join(self.names)})"

    def to_dot(self) -> str:
        """Graphviz DOT: inputs as ellipses, stages as boxes, one edge per field from producer to reader."""
        def q(s: str) -> str:
            return '"' + s.replace('\\', '\\\\').replace('"', '\\"') + '"'

        lines = ["digraph graphspec {", "  rankdir=LR;", "  node [fontname=Helvetica];"]
        for f in self.inputs:
            lines.append(f"  {q('in:' + f)} [label={q(f)}, shape=ellipse, style=dashed];")
        for s in self.stages:
            label = q(s.name)[:-1] + "\\n" + q(type(s).__name__)[1:]  # DOT's own line break escape
            lines.append(f"  {q(s.name)} [label={label}, shape=box];")
        for f in self.outputs:
            lines.append(f"  {q('out:' + f)} [label={q(f)}, shape=ellipse, style=dashed];")
        producer: dict[str, str] = {f: "in:" + f for f in self.inputs}
        for s in self.stages:
            for f in s.reads:
                lines.append(f"  {q(producer[f])} -> {q(s.name)} [label={q(f)}];")
            for f in s.writes:
                producer[f] = s.name
        for f in self.outputs:
            lines.append(f"  {q(producer[f])} -> {q('out:' + f)} [label={q(f)}];")
        # the execution order, drawn faintly so the data edges stay readable
        for a, b in zip(self.stages, self.stages[1:]):
            lines.append(f"  {q(a.name)} -> {q(b.name)} [style=dotted, arrowhead=none, constraint=false];")
        lines.append("}")
        return "\n".join(lines)
