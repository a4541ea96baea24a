"""A backward split into an input-gradient pass and a weight-gradient pass that together cost one
ordinary backward (zero-bubble's I and W; the idea of torch.distributed.pipelining's
`stage_backward_input` / `stage_backward_weight`, written here on public autograd APIs).

[Note: split backward]
The autograd graph of a stage, from its outputs (roots) down to its leaves, has two parts:
- the *input path*: the nodes from which a stage input's gradient accumulator can be reached.
  `input_backward` runs only these (`torch.autograd.grad` to the inputs; autograd then computes,
  in each node, only the outputs that lead to the inputs: the input-gradient matmul of a Linear,
  not its weight-gradient one);
- the *weight side*: every edge from an input-path node to a node off it (the weight-gradient
  branch of a Linear, a LayerNorm's weight and bias, an embedding) and every root off the path
  (the whole graph on the first stage, whose input is token ids).
While the input pass runs, a pre-hook on each input-path node with a weight-side edge keeps the
gradient that node receives (the sum of everything flowing into it, the same tensor an ordinary
backward hands it). `weight_backward` later runs each such node once more from that kept gradient,
asking only for its weight-side edges (so only the weight-gradient half of the node runs), and then
one `torch.autograd.backward` from all weight-side edges to the parameters: the weight side holds no
input-path node, so nothing is computed twice, and gradients accumulate into `.grad` through the
ordinary AccumulateGrad nodes (post-accumulate hooks fire as in an ordinary backward).

The cost of the earlier split, which this replaces: the weight pass was
`backward(roots, inputs=params)`, which walks the input path again, since every weight's gradient
needs the activation gradient above it: a second input-gradient pass per micro-batch (profiled:
W = 1.0 x a whole backward, I + W = 1.5x), which made ZB-H1 slower than 1F1B.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["SplitBackward", "input_backward", "weight_backward"]


@dataclasses.dataclass
class SplitBackward:
    """What the input pass leaves for the weight pass."""

    kept: list[tuple[Node, tuple[torch.Tensor | None, ...], list[GradientEdge]]]  # node, its grads, its weight edges
    roots: list[tuple[GradientEdge, torch.Tensor]]  # roots off the input path, with their gradients


def _input_path(roots: Sequence[Node], input_nodes: set[Node]) -> set[Node]:
    """The nodes reachable from `roots` from which a node of `input_nodes` can be reached."""
    on_path: dict[Node, bool] = {}
    for root in roots:
        stack: list[tuple[Node, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in on_path and not expanded:
                continue
            children = [n for n, _ in node.next_functions if n is not None]
            if expanded:
                on_path[node] = node in input_nodes or any(on_path.get(c, False) for c in children)
                continue
            on_path.setdefault(node, False)  # marks "being visited" (graphs are acyclic)
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in on_path)
    return {node for node, yes in on_path.items() if yes}


def input_backward(roots: list[torch.Tensor], grads: list[torch.Tensor] | None,
                   inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], SplitBackward]:
    """The gradients of `inputs` (leaves) from `roots` (with `grads`, None for scalar roots), and
    what `weight_backward` needs. The graph is retained for the weight pass."""
    grad_list = list(grads) if grads is not None else [torch.ones_like(r) for r in roots]
    root_nodes = [r.grad_fn for r in roots]
    input_nodes = {get_gradient_edge(t).node for t in inputs}
    path = _input_path([n for n in root_nodes if n is not None], input_nodes)
    split = SplitBackward([], [])
    for root, grad in zip(roots, grad_list):
        if root.grad_fn is None or root.grad_fn not in path:
            split.roots.append((get_gradient_edge(root), grad))
    handles = []
    try:
        for node in path:
            edges = [GradientEdge(n, nr) for n, nr in node.next_functions if n is not None and n not in path]
            if edges:
                handles.append(node.register_prehook(_keeper(split, node, edges)))
        on_path = [(r, g) for r, g in zip(roots, grad_list) if r.grad_fn is not None and r.grad_fn in path]
        computed: Sequence[torch.Tensor | None] = [None] * len(inputs)
        if on_path:
            computed = torch.autograd.grad([r for r, _ in on_path], inputs, [g for _, g in on_path],
                                           retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return list(computed), split


def _keeper(split: SplitBackward, node: Node, edges: list[GradientEdge]):  # type: ignore[no-untyped-def]
    def keep(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        split.kept.append((node, tuple(grad_outputs), edges))
    return keep


def weight_backward(split: SplitBackward, params: list[torch.nn.Parameter]) -> None:
    """Accumulate the parameters' gradients into `.grad` from what the input pass kept."""
    frontier: list[GradientEdge] = [edge for edge, _ in split.roots]
    frontier_grads: list[torch.Tensor] = [grad for _, grad in split.roots]
    for group in _groups(split.kept):
        edges = list(dict.fromkeys(edge for index in group for edge in split.kept[index][2]))  # once each
        for edge, grad in zip(edges, _weight_edge_grads([split.kept[index] for index in group], edges)):
            if grad is not None:
                frontier.append(edge)
                frontier_grads.append(grad)
    split.kept.clear()
    split.roots.clear()
    if frontier and params:
        torch.autograd.backward(frontier, frontier_grads, inputs=params)


def _groups(kept: list[tuple[Node, tuple[torch.Tensor | None, ...], list[GradientEdge]]]) -> list[list[int]]:
    """The kept nodes in groups whose weight sides share no node (usually one node per group; a
    weight used twice on the input path joins its users into one group)."""
    parent = list(range(len(kept)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[Node, int] = {}
    for index, (_, _, edges) in enumerate(kept):
        stack = [edge.node for edge in edges]
        seen: set[Node] = set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in owner and find(owner[node]) != find(index):
                parent[find(owner[node])] = find(index)
            owner.setdefault(node, index)
            stack.extend(n for n, _ in node.next_functions if n is not None)
    groups: dict[int, list[int]] = {}
    for index in range(len(kept)):
        groups.setdefault(find(index), []).append(index)
    return list(groups.values())


def _weight_edge_grads(members: list[tuple[Node, tuple[torch.Tensor | None, ...], list[GradientEdge]]],
                       edges: list[GradientEdge]) -> Sequence[torch.Tensor | None]:
    """The gradients flowing into the weight-side `edges` when the member nodes run again from their
    kept gradients. One member: autograd runs only that node's weight half. Several (they share a
    weight): the input path between them runs too, and a pre-hook on each member replaces what
    arrives with its kept gradient, so nothing is counted twice (torch's clamp)."""
    outputs, grads = [], []
    for node, grad_outputs, _ in members:
        outputs += [GradientEdge(node, i) for i, g in enumerate(grad_outputs) if g is not None]
        grads += [g for g in grad_outputs if g is not None]
    if not outputs:
        return [None] * len(edges)
    handles = []
    if len(members) > 1:
        handles = [node.register_prehook(lambda _, kept=grad_outputs: kept) for node, grad_outputs, _ in members]
    try:
        return torch.autograd.grad(outputs, edges, grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
