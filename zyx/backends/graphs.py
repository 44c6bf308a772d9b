"""Replaying a plan's launches as driver graphs (CUDA graphs): `GraphReplay`.

A plan that ran before launches the same kernels with the same grids every time; only
the buffers move (a training step's outputs and the weights it reads alternate between
the blocks the pool hands out). A graph of the plan's kernel nodes, instantiated once,
replays with one driver call (cuGraphLaunch) instead of one launch per kernel. Its
buffers are rebound by rewriting the parameters of the nodes that read a moved buffer
(cuGraphExecKernelNodeSetParams), never by capturing again; and since the pool's blocks
come back in a short cycle, a few instantiated variants are kept, each remembering the
buffers it is bound to, so that a loop whose buffers alternate replays a variant that
already matches, with no parameter rewritten at all.

The driver side is an object (`api`) with these methods, handles opaque here:

    build(node_params) -> (graph, nodes)   a graph of one kernel node per launch, each
                                           after the one before (the stream's order)
    instantiate(graph) -> exec             set_params(exec, node, params)
    launch(exec)                           on the device's stream
    destroy(graph, exec)

where `node_params[i]` is the api's own description of launch i (function, grid, block,
shared memory and the address of its parameter block: the driver copies the values at
build and set_params time, so the block may be rewritten for the next run at once).
"""
from __future__ import annotations

import sys

from ..errors import BackendError

VARIANTS = 4      # instantiated graphs kept per plan (the pool's blocks cycle in 2-4)


class _Variant:
    __slots__ = ("graph", "exec", "nodes", "key")

    def __init__(self, graph, exe, nodes, key):
        self.graph = graph
        self.exec = exe
        self.nodes = nodes
        self.key = key          # the slot addresses its nodes are bound to


class GraphReplay:
    """The graph variants of one plan. `launches_of_slot[k]`: the indices of the launches
    whose parameters hold slot k's buffer (the nodes to rewrite when it moves)."""

    def __init__(self, api, node_params, launches_of_slot, debug=0):
        self.api = api
        self.node_params = node_params
        self.launches_of_slot = launches_of_slot
        self.variants = []        # most recently used first
        self.debug = debug
        self.rebinds = 0          # node parameter rewrites (tests, ZYX_DEBUG=64)
        self.builds = 0           # graphs instantiated
        self.replays = 0

    def replay(self, key):
        """Launch the plan bound to the slot addresses `key` (a tuple, one per slot); the
        parameter blocks must hold those addresses already."""
        variants = self.variants
        self.replays += 1
        for i, v in enumerate(variants):
            if v.key == key:
                if i:
                    variants.insert(0, variants.pop(i))
                self.api.launch(v.exec)
                return
        if len(variants) < VARIANTS:
            v = self._build(key)
        else:
            v = variants.pop()
            self._rebind(v, key)
        variants.insert(0, v)
        self.api.launch(v.exec)

    def _build(self, key):
        api = self.api
        graph, nodes = api.build(self.node_params)
        try:
            exe = api.instantiate(graph)
        except BaseException:
            api.destroy(graph, None)
            raise
        self.builds += 1
        if self.debug & 64:
            print(f"zyx: graph of {len(nodes)} launches instantiated "
                  f"(variant {len(self.variants) + 1})", file=sys.stderr)
        return _Variant(graph, exe, nodes, key)

    def _rebind(self, v, key):
        """Rewrite the parameters of `v`'s nodes that read a slot whose buffer moved."""
        dirty = set()
        for k, (was, now) in enumerate(zip(v.key, key)):
            if was != now:
                dirty.update(self.launches_of_slot[k])
        set_params = self.api.set_params
        for i in sorted(dirty):
            set_params(v.exec, v.nodes[i], self.node_params[i])
        self.rebinds += len(dirty)
        v.key = key

    def close(self):
        """Destroy every instantiated graph (an exec still running is freed by the driver
        when it completes)."""
        variants, self.variants = self.variants, []
        for v in variants:
            try:
                self.api.destroy(v.graph, v.exec)
            except BackendError:      # a context torn down at exit: nothing left to free
                pass
