"""Pipeline stages of a traced graph: which stage runs each op, and each stage as a graph of
its own (pure: no MPI).

A node's stage is its Cell's ``pipeline_stage`` (the innermost Cell that sets one); a node
recorded outside every such Cell runs on the latest stage of the ops it reads (the loss
after the last block runs with it), and one that reads no op's output (a weight's cast) on
the earliest stage that reads it. A value may flow only forward, from a stage to itself or a
later one; every stage must run an op.

With interleaved virtual stages (``chunks`` > 1), a Cell's ``pipeline_segment`` ``v`` puts
its ops in chunk ``v`` of its stage ``s``: virtual stage ``v * stages + s``, which runs on
stage ``s``'s ranks; the order above is the virtual stages' (chunk 0 of every stage, then
chunk 1, ...), and everything below is per virtual stage.

:func:`split_stages` cuts the graph into one :class:`Stage` per stage: its own ops, the
parameters and constants they read, and as inputs the batch inputs it reads and the values
earlier stages compute for it (*boundaries*, numbered by :class:`Boundary`); as outputs, the
loss (the last stage) and the boundaries later stages read. A parameter read on two stages
(a tied embedding and output head) is in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from simpar.graph import Graph, Node, RecomputeSegment, Value

__all__ = ["Boundary", "Stage", "balance_stages", "split_stages", "stages_of"]


def stages_of(graph: Graph, stages: int, chunks: int = 1) -> list[int]:
    """The (virtual) stage of every node of ``graph`` (in node order), checked."""
    for node in graph.nodes:
        if node.stage >= stages:
            raise ValueError(f"pipeline: {node.name} is on pipeline_stage {node.stage}, but "
                             f"pipeline_stages is {stages} (stages 0..{stages - 1})")
        if node.chunk >= chunks:
            raise ValueError(f"pipeline: {node.name} is in pipeline_segment {node.chunk}, but "
                             f"there are {chunks} chunk(s) per stage (segments 0.."
                             f"{chunks - 1}; segments need pipeline_interleave=True)")
    produced: dict[int, int] = {}   # value id -> the stage of the node that made it
    out: list[int | None] = []
    for node in graph.nodes:
        producers = [produced[v.id] for v in node.inputs if v.id in produced]
        stage = (max(node.chunk, 0) * stages + node.stage if node.stage >= 0
                 else max(producers, default=None))
        out.append(stage)
        if stage is not None:
            produced.update((v.id, stage) for v in node.outputs)
    consumers: dict[int, list[int]] = {}
    for k, node in enumerate(graph.nodes):
        for v in node.inputs:
            consumers.setdefault(v.id, []).append(k)
    for k in reversed(range(len(graph.nodes))):   # reads no op's output: its readers' stage
        if out[k] is None:
            readers = [out[c] for v in graph.nodes[k].outputs for c in consumers.get(v.id, [])]
            out[k] = min((r for r in readers if r is not None), default=0)
    resolved = [int(s) for s in out if s is not None]
    made = {v.id: s for node, s in zip(graph.nodes, resolved) for v in node.outputs}
    for node, stage in zip(graph.nodes, resolved):
        late = [(v, made[v.id]) for v in node.inputs if made.get(v.id, -1) > stage]
        if late:
            v, src = late[0]
            raise ValueError(f"pipeline: {node.name} runs on {_name(stage, stages, chunks)} "
                             f"but reads {v.name}, which {_name(src, stages, chunks)} computes; "
                             "a value may only flow to its own or a later stage (set "
                             "pipeline_stage so that the stages follow the network's order)")
    empty = sorted(set(range(stages * chunks)) - set(resolved))
    if empty:
        what = "stage(s)" if chunks == 1 else "virtual stage(s) (chunk * stages + stage)"
        raise ValueError(f"pipeline: no op runs on {what} {empty} of the {stages * chunks} "
                         f"{'stages (pipeline_stages)' if chunks == 1 else 'virtual stages'}; "
                         "set Cell.pipeline_stage (and pipeline_segment) so that every stage "
                         "has work")
    return resolved


def balance_stages(graph: Graph, stages: int) -> list[int]:
    """Each node's stage (node order) for a contiguous split of ``graph`` into ``stages``:
    cuts only where the fewest values cross (more only when there are too few such places),
    each placed nearest an even share of the FLOPs."""
    nodes = graph.nodes
    if stages < 1 or stages > len(nodes):
        raise ValueError(f"auto_pipeline: cannot cut {len(nodes)} ops into {stages} stages")
    if stages == 1:
        return [0] * len(nodes)
    made = {v.id: k for k, node in enumerate(nodes) for v in node.outputs}
    last_read: dict[int, int] = {}
    for k, node in enumerate(nodes):
        for v in node.inputs:
            if v.id in made:
                last_read[v.id] = k
    # crossing[k]: values made at or before node k and read after it (a cut after node k).
    crossing = [0] * len(nodes)
    for vid, first in made.items():
        for k in range(first, last_read.get(vid, first)):
            crossing[k] += 1
    flops = [float(node.op.flops(tuple(v.shape for v in node.inputs),
                                 node.outputs[0].shape if node.outputs else ()))
             for node in nodes]
    total = math.fsum(flops)
    done = [math.fsum(flops[:k + 1]) for k in range(len(nodes))]
    places = range(len(nodes) - 1)
    for slack in range(max(crossing) + 1):
        allowed = [k for k in places if crossing[k] <= min(crossing[:-1]) + slack]
        if len(allowed) >= stages - 1:
            break
    cuts: list[int] = []
    for j in range(1, stages):
        left = [k for k in allowed if (not cuts or k > cuts[-1])
                and sum(1 for a in allowed if a > k) >= stages - 1 - j]
        cuts.append(min(left, key=lambda k: (abs(done[k] - j * total / stages), k)))
    out, stage = [], 0
    for k in range(len(nodes)):
        out.append(stage)
        if stage < len(cuts) and k == cuts[stage]:
            stage += 1
    return out


def _name(virtual: int, stages: int, chunks: int) -> str:
    if chunks == 1:
        return f"stage {virtual}"
    return f"stage {virtual % stages} chunk {virtual // stages}"


@dataclass(frozen=True)
class Boundary:
    """A value one stage computes and later stages read: ``index`` numbers it (message tags
    derive from it), ``producer`` and ``consumers`` are stages."""

    index: int
    name: str
    producer: int
    consumers: tuple[int, ...]


@dataclass(frozen=True)
class Stage:
    """One stage's graph and how its inputs and outputs connect. ``batch[k]`` is, for the
    graph input ``k`` of the stage, the position of the batch input it is (or None: it is a
    boundary, ``received[k]``); ``sent[k]`` is the boundary the stage's output ``k`` is (or
    None: the loss, one of the whole graph's outputs, ``loss[k]``)."""

    index: int
    graph: Graph
    batch: tuple[int | None, ...]
    received: tuple[Boundary | None, ...]
    sent: tuple[Boundary | None, ...]
    loss: tuple[int | None, ...]


def split_stages(graph: Graph, stages: int, chunks: int = 1) -> list[Stage]:
    """One :class:`Stage` per (virtual) stage of ``graph`` (``stages_of`` assigns them), in
    the order the data flows through them."""
    of = stages_of(graph, stages, chunks)
    stages *= chunks
    made = {v.id: s for node, s in zip(graph.nodes, of) for v in node.outputs}
    readers: dict[int, set[int]] = {}
    for node, s in zip(graph.nodes, of):
        for v in node.inputs:
            if made.get(v.id, s) != s:
                readers.setdefault(v.id, set()).add(s)
    values = {v.id: v for node in graph.nodes for v in node.outputs}
    boundaries = {vid: Boundary(k, values[vid].name, made[vid], tuple(sorted(readers[vid])))
                  for k, vid in enumerate(sorted(readers))}
    finals = {v.id: k for k, v in enumerate(graph.outputs)}
    wrong = [graph.outputs[k].name for vid, k in finals.items() if made.get(vid) != stages - 1]
    if wrong:
        raise ValueError(f"pipeline: the network's output {wrong[0]} (the loss) must be "
                         f"computed on the last stage ({stages - 1}); put the loss after the "
                         "last stage's Cells")
    return [_stage(graph, s, [n for n, t in zip(graph.nodes, of) if t == s], boundaries,
                   finals) for s in range(stages)]


def _stage(graph: Graph, index: int, nodes: list[Node], boundaries: dict[int, Boundary],
           finals: dict[int, int]) -> Stage:
    """Stage ``index``'s graph: fresh values and nodes (ids kept, nodes numbered anew), the
    batch inputs first, then the boundaries it receives."""
    own = {v.id for n in nodes for v in n.outputs}
    read = {v.id for n in nodes for v in n.inputs}
    fresh: dict[int, Value] = {}

    def copy(v: Value, kind: str | None = None) -> Value:
        found = fresh.get(v.id)
        if found is None:
            found = fresh[v.id] = Value(v.id, v.shape, v.dtype, kind or v.kind, v.name,
                                        param=v.param, const=v.const)
        return found

    g = Graph()
    batch: list[int | None] = []
    received: list[Boundary | None] = []
    for k, v in enumerate(graph.inputs):
        if v.id in read:
            g.inputs.append(copy(v))
            batch.append(k)
            received.append(None)
    for vid in sorted(boundaries):
        b = boundaries[vid]
        if index in b.consumers:
            src = next(v for n in graph.nodes for v in n.outputs if v.id == vid)
            g.inputs.append(copy(src, "input"))
            batch.append(None)
            received.append(b)
    g.grad_inputs = tuple(v.id for v, b in zip(g.inputs, received) if b is not None
                          and v.dtype.kind == "f")
    g.params = [copy(v) for v in graph.params if v.id in read]
    g.consts = [copy(v) for v in graph.consts if v.id in read]
    renumber = {n.id: k for k, n in enumerate(nodes)}
    for k, n in enumerate(nodes):
        node = Node(k, n.op, tuple(copy(v) for v in n.inputs), (), n.name, stage=index)
        node.outputs = tuple(Value(v.id, v.shape, v.dtype, "op", v.name, producer=node,
                                   index=v.index) for v in n.outputs)
        fresh.update((v.id, v) for v in node.outputs)
        g.nodes.append(node)
    sent: list[Boundary | None] = []
    loss: list[int | None] = []
    for vid, k in finals.items():
        if vid in own:
            g.outputs.append(fresh[vid])
            sent.append(None)
            loss.append(k)
    for vid in sorted(boundaries):
        if vid in own:
            g.outputs.append(fresh[vid])
            sent.append(boundaries[vid])
            loss.append(None)
    g.updates = [u for u in graph.updates if u.value in own]   # a BatchNorm's, say
    for seg in graph.segments:   # a recomputed Cell: its ops on this stage, as a run of them
        mine = tuple(renumber[i] for i in seg.nodes if i in renumber)
        if mine:
            g.segments.append(RecomputeSegment(seg.name, mine, seg.mp_comm, seg.opt_comm))
    for n in g.nodes:
        n.segment = next((j for j, seg in enumerate(g.segments) if n.id in seg.nodes), -1)
    return Stage(index, g, tuple(batch), tuple(received), tuple(sent), tuple(loss))
