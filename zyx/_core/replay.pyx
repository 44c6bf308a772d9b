# cython: language_level=3, boundscheck=False, wraparound=False
"""Backward templates: a training loop's backward pass, replayed instead of re-derived.

`loss.backward()` runs a Python rule per recorded op, and the rules build the same
gradient nodes step after step: they look only at the recorded structure (ops, args,
shapes, dtypes, which inputs need a gradient), never at values. So the first backward of
a structure is traced (every node the rules add, `Graph.trace`) and turned into a
`Template`: the added nodes as (op, arg, source refs, shape, dtype), the refs pointing at
the walked tensors' nodes or at earlier added nodes. A later backward over an equal
structure (`backward_key`) adds the same nodes in one loop, without rules, tensor objects
or dict bookkeeping: the gradient graph is identical, node for node, so it fuses and
caches exactly as the traced one did.

Only the non-recording backward is replayed (`create_graph` records the backward ops for
autograd, which the rules do through Tensor objects). A trace that reads a node outside
the walked structure, or makes a buffer, is not replayable; its key remembers that.

`ForwardTemplates` does the same for composite forwards (LSTM layers, convolutions),
keyed by their inputs and the parameters their callers name.
"""
from .graph cimport Graph, Node
from .tensorbase cimport TensorBase
from .tensorbase import set_recording


cdef Py_ssize_t _epoch = 0          # one per backward_key call: stamps on tensors and nodes


cdef inline void _ref(TensorBase t, Py_ssize_t ep, list ins, list key, list items,
                      Py_ssize_t* ntensors):
    """Append tensor `t`'s canonical reference to `key`: the number of a tensor seen
    before, or -1 and a node number (a new tensor on a node seen before), or -2 and the
    new node's shape and dtype code (tensors and nodes are numbered in order of first
    appearance; `ins` collects the nodes' ids)."""
    if t._kstamp == ep:
        key.append(t._kindex)
        return
    t._kstamp = ep
    t._kindex = ntensors[0]
    ntensors[0] += 1
    cdef Py_ssize_t nid = t._id
    cdef Node n = <Node>items[nid]
    if n.kstamp == ep:
        key.append(-1)
        key.append(n.kindex)
        return
    n.kstamp = ep
    n.kindex = len(ins)
    ins.append(nid)
    key.append(-2)
    key.append(n.shape)
    key.append(n.dtype.code)


def backward_key(Graph graph, list targets, list out_grads, list order, freed):
    """(structural key, input node ids) of a backward pass over `order` right after the
    walk that made it (the key reads the walk's marks); the key is None when the
    structure holds a freed recording (the rules raise there)."""
    global _epoch
    _epoch += 1
    cdef Py_ssize_t ep = _epoch, nt = 0
    cdef list ins = []
    cdef list key = [len(targets)]
    cdef list items = graph.nodes.items
    cdef TensorBase t
    for x in targets:
        _ref(<TensorBase?>x, ep, ins, key, items, &nt)
    for x in out_grads:
        _ref(<TensorBase?>x, ep, ins, key, items, &nt)
    for x in order:
        t = <TensorBase>x
        ctx = t._ctx
        if ctx is freed:
            return None, None
        _ref(t, ep, ins, key, items, &nt)
        key.append(t._wneed)
        if ctx is None:
            key.append(-3)
            continue
        key.append((<tuple>ctx)[0])
        key.append((<tuple>ctx)[1])
        for s in (<tuple>ctx)[2]:
            t = <TensorBase?>s
            _ref(t, ep, ins, key, items, &nt)
            key.append(t._wneed)
    return tuple(key), ins


cdef class Template:
    """The nodes one backward pass added, ready to add again on other inputs."""
    cdef readonly list ops        # (op, arg, source refs, shape, dtype) per added node
    cdef readonly list results    # (position in walk order of the source, ref of its grad)
    cdef readonly Py_ssize_t n_in

    def __init__(self, list ops, list results, Py_ssize_t n_in):
        self.ops = ops
        self.results = results
        self.n_in = n_in

    def run(self, Graph graph, list ins, list order, wrap):
        """Add the template's nodes on input nodes `ins`; {id(source tensor): gradient},
        in the traced pass's order."""
        cdef list ids = list(ins)
        cdef tuple rec, refs
        cdef Py_ssize_t r, j
        for rec in self.ops:
            refs = <tuple>rec[2]
            if len(refs) == 1:
                srcs = (ids[<Py_ssize_t>refs[0]],)
            elif len(refs) == 2:
                srcs = (ids[<Py_ssize_t>refs[0]], ids[<Py_ssize_t>refs[1]])
            else:
                srcs = tuple([ids[<Py_ssize_t>x] for x in refs])
            ids.append(graph.add(rec[0], rec[1], srcs, rec[3], rec[4]))
        cdef dict out = {}
        for pos, r in self.results:
            nid = ids[r]
            graph.retain(nid)            # the gradient tensor's own reference
            out[id(order[pos])] = wrap(nid)
        for j in range(self.n_in, len(ids)):
            graph.release(ids[j])        # drop the adding reference; consumers keep theirs
        return out


def build_template(list trace, list ins, dict result, list order):
    """A Template from the trace of one backward pass (Graph.trace records) and its result
    {id(source tensor): gradient tensor}; None when the trace cannot be replayed."""
    cdef dict ref = {}
    cdef Py_ssize_t n_in = len(ins), i
    for i in range(n_in):
        ref[ins[i]] = i
    cdef list ops = []
    for rec in trace:
        if rec is None:
            return None
        op, arg, srcs, shape, dtype, nid = rec
        refs = []
        for s in srcs:
            r = ref.get(s)
            if r is None:
                return None              # read a node the key does not describe
            refs.append(r)
        ref[nid] = n_in + len(ops)       # an id freed and reused in the trace maps anew
        ops.append((op, arg, tuple(refs), shape, dtype))
    pos = {id(t): i for i, t in enumerate(order)}
    cdef list results = []
    for k, g in result.items():
        r = ref.get(g._id)
        if r is None:
            return None
        results.append((pos[k], r))
    # drop nodes no gradient reads (rule temporaries that died in the traced pass)
    cdef list live = [False] * len(ops)
    for _, r in results:
        if r >= n_in:
            live[r - n_in] = True
    for i in range(len(ops) - 1, -1, -1):
        if live[i]:
            for r in ops[i][2]:
                if r >= n_in:
                    live[r - n_in] = True
    cdef list renum = list(range(n_in))
    cdef list kept = []
    for i in range(len(ops)):
        if live[i]:
            op, arg, refs, shape, dtype = ops[i]
            kept.append((op, arg, tuple([renum[r] for r in refs]), shape, dtype))
            renum.append(n_in + len(kept) - 1)
        else:
            renum.append(-1)
    return Template(kept, [(p, renum[r]) for p, r in results], n_in)


cdef class ForwardTemplates:
    """Forward templates: a composite forward (an LSTM layer's timesteps, a convolution's
    window view and product) replayed instead of rebuilt op by op.

    Such a function adds nodes that depend only on its inputs' shapes and dtypes and on
    the parameters the caller puts in the key, never on values. Its first call for a key
    runs it under `Graph.trace` and keeps the added nodes as a `Template`; later calls add
    the same nodes in one loop, without tensor objects, shape checks or view bookkeeping.
    A function that makes a buffer or reads a node outside its inputs is remembered as not
    replayable and always runs. Autograd recording is off while it runs: callers record
    the composite themselves. At most `limit` keys are kept (the oldest goes first; 0:
    none, every call builds)."""
    cdef dict cache               # key -> (Template, number of results); False: not replayable
    cdef readonly Py_ssize_t limit

    def __init__(self, Py_ssize_t limit=64):
        self.cache = {}
        self.limit = limit

    def __len__(self):
        return len(self.cache)

    def clear(self):
        self.cache.clear()

    def replayable(self):
        """How many of the kept keys replay (the others were not replayable)."""
        return sum([1 for e in self.cache.values() if e])

    def run(self, Graph graph, tuple key, list ins, build, wrap):
        """build(*ins)'s list of result tensors, replayed when `key` was traced before.
        The key is completed here with the inputs' shapes and dtypes and which inputs
        share a node."""
        cdef list nodes = [(<TensorBase?>t)._id for t in ins]
        cdef list items = graph.nodes.items
        cdef Node n
        cdef list full = list(key)
        for nid in nodes:
            n = <Node>items[<Py_ssize_t>nid]
            full.append(n.shape)
            full.append(n.dtype.code)
            full.append(nodes.index(nid))
        k = tuple(full)
        entry = self.cache.get(k) if self.limit > 0 else False
        if entry:
            tpl, n_out = entry
            outs = [object() for _ in range(n_out)]
            made = (<Template>tpl).run(graph, nodes, outs, wrap)
            return [made[id(o)] for o in outs]
        trace = None
        if entry is None and graph.trace is None:
            graph.trace = trace = []
        prev = set_recording(False)
        try:
            results = list(build(*ins))
        finally:
            set_recording(prev)
            if trace is not None:
                graph.trace = None
        if trace is not None and self.limit > 0:
            outs = [object() for _ in results]
            tpl = build_template(trace, nodes, {id(o): t for o, t in zip(outs, results)},
                                 outs)
            if len(self.cache) >= self.limit:
                del self.cache[next(iter(self.cache))]
            self.cache[k] = (tpl, len(results)) if tpl is not None else False
        return results
