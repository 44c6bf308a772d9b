"""Which SPIR-V strategy a kernel gets (writer.py writes them): the choice is the C-family
GPU lowering's (`gpu.reduce.choose_strategy`, made from `gpu.analysis` facts), mapped to
what the SPIR-V writer has.

- no loops (elementwise): "serial", one output per invocation, or `items` outputs per
  invocation at a stride of the whole dispatch when there are many more outputs than the
  device runs at once;
- reduce kernels the analysis splits over a group ("group": softmax-like rows, a long
  sum per output): one workgroup per output, lanes split each reduce nest, a tree in
  workgroup memory combines;
- the rest (many outputs with short reductions, and the "columns" case): "serial", each
  invocation loops over its output's reduction.
"""
from __future__ import annotations

from ..._core import kernel as K
from ..gpu.analysis import output_size, reduce_nests
from ..gpu.reduce import choose_strategy

ELEMENTWISE_LOCAL = 256
GROUP_LOCAL = 256
ITEMS = 4                 # outputs per invocation of a large elementwise kernel
ITEMS_FROM = 1 << 22      # outputs from which invocations take ITEMS each


def choose(kernel, info):
    """(strategy, local size, items per invocation, nests) for `kernel` on a device
    described by `info` (DeviceInfo)."""
    ops = kernel.ops
    limit = max(info.max_local_threads, 1)
    if not any(op[0] == K.LOOP for op in ops):
        items = ITEMS if output_size(ops) >= ITEMS_FROM else 1
        return "serial", min(ELEMENTWISE_LOCAL, limit), items, None
    nests = reduce_nests(ops)
    if choose_strategy(ops, nests, info) == "group" and _barrier_free(ops):
        local = min(GROUP_LOCAL, _pow2_floor(limit))
        return "group", local, 1, nests
    return "serial", min(ELEMENTWISE_LOCAL, limit), 1, None


def _barrier_free(ops):
    return not any(op[0] in (K.BARRIER, K.IF_OP) or (op[0] == K.DEFINE and
                                                     op[2] == K.SCOPE_LOCAL) for op in ops)


def _pow2_floor(n):
    p = 1
    while p * 2 <= n:
        p *= 2
    return p
