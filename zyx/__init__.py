"""zyx: lazy tensors fused into compiled kernels."""
import builtins as _builtins


def _warn_stale_builds():
    """In a source checkout (editable install), Python imports a module's compiled
    extension even when its .py was edited after `build_ext --inplace`: say so. (One
    directory scan per package directory: this runs on every import in a checkout.)"""
    import os
    import warnings
    here = os.path.dirname(os.path.abspath(__file__))
    if not os.path.exists(os.path.join(os.path.dirname(here), "setup.py")):
        return
    stale = []
    for sub in ("", "_core", "nn", os.path.join("nn", "modules"), "optim"):
        d = os.path.join(here, sub)
        src, built = {}, {}
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            stem, ext = os.path.splitext(e.name)
            if ext in (".py", ".pyx"):
                src[stem] = (e.stat().st_mtime, e.name)
            elif ext in (".so", ".pyd"):
                stem = stem.split(".")[0]
                built[stem] = max(built.get(stem, 0.0), e.stat().st_mtime)
        for stem, (mtime, name) in src.items():
            if stem in built and mtime > built[stem]:
                stale.append(os.path.join("zyx", sub, name))
    if stale:
        warnings.warn(f"zyx: {', '.join(sorted(stale))} is newer than its built extension, "
                      "which is what Python imports; rebuild with `python setup.py "
                      "build_ext --inplace`", stacklevel=2)


_warn_stale_builds()
from .dtype import (DType, bool_ as bool, uint8, uint16, uint32, uint64, int8, int16, int32, int64,
                    float16, bfloat16, float32, float64)
from .errors import ZyxError, ShapeError, DTypeError, AllocationError, BackendError, NoBackendAvailable
from .errors import IndexOutOfRangeError, IntegerDivisionByZeroError, ValueOverflowError
from .device import Device, device
from .tensor import *  # noqa: F401,F403
from .tensor import __all__ as _tensor_all
from .runtime import RT as _RT
# --- PyTorch habits: sorting, indexing, products and linalg, small ops (issue 12) ---
from .sorting import *  # noqa: F401,F403,E402  (max/min/where here are torch's forms)
from .indexing import *  # noqa: F401,F403,E402
from .products import *  # noqa: F401,F403,E402
from .misc_ops import *  # noqa: F401,F403,E402
from . import linalg  # noqa: E402
# --- end PyTorch habits ---

half = float16
float = float32  # noqa: A001  (torch spelling: zyx.float is float32)
double = float64
long = int64
int = int32  # noqa: A001

# --- files and datasets (issue 3: zyx/io, zyx/datasets.py) ---
def save(obj, path, metadata=None):
    """Write a state_dict, or nested state (dicts/lists of tensors, numbers, strings), as a
    safetensors file (see zyx.io.checkpoint; a flat dict of tensors is plain safetensors)."""
    from .io.checkpoint import save as _save
    return _save(obj, path, metadata)


def load(path):
    """Open a file written by zyx.save (or any safetensors file) lazily: tensors are read
    when used, nested state comes back with its structure (see zyx.io.checkpoint)."""
    from .io.checkpoint import load as _load
    return _load(path)
# --- end files and datasets ---


def devices():
    """Every device zyx found (the first call initializes the backends), as `zyx.device`
    names that also carry `backend`, `name`, `memory` (bytes) and `compute` (FLOP/s
    estimate). `str(d)` is what `device=` and `.to()` accept ("cpu", "cuda:0"...)."""
    return _RT.names()


def set_default_device(device):
    """Create tensors on `device` from now on, and run graphs with no input there (torch's
    set_default_device). None goes back to the default choice: ZYX_DEVICE, the config's
    "default_device", else the device with the most compute."""
    _RT.set_default_device(device)


def synchronize(device=None):
    """Wait until the work queued on `device` (every device when None) has run; for timing
    GPU code (torch.cuda.synchronize). Reading a value (numpy(), item()...) waits anyway."""
    _RT.synchronize(device)


def realize(*tensors):
    """Compute several tensors in one realization, so the work they share runs once (a
    loss and the gradients of its inputs: `zyx.realize(loss, x.grad, w.grad)`, where
    realizing them one by one would compute the forward for each). None entries are
    skipped (a `.grad` nothing set). Tensors on different devices are realized per
    device. Returns the tensors (one tensor: itself)."""
    from .tensor import Tensor
    groups = {}
    for t in tensors:
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"zyx.realize takes tensors (or None), got {type(t).__name__}")
        dev = _RT.device_of(t._id) if _RT._multi else None
        groups.setdefault(id(dev), []).append(t._id)
    for ids in groups.values():
        _RT.realize(ids)
    return tensors[0] if len(tensors) == 1 else tensors


def memory_allocated(device=None):
    """Bytes of live tensors (and plan buffers) in `device`'s memory pool; every pool when
    None. torch.cuda.memory_allocated's count, for any device (`zyx.cuda` has torch's
    CUDA-only spellings)."""
    return _RT.memory_allocated(device)


def memory_reserved(device=None):
    """`memory_allocated` plus the freed blocks the pool keeps for reuse (GPU pools keep at
    most their `cache_limit_mb`, a tenth of the device by default)."""
    return _RT.memory_reserved(device)


def empty_cache(device=None):
    """Give the freed blocks `device`'s pool keeps for reuse (every pool's when None) back
    to the driver, so other programs and libraries can have the memory
    (torch.cuda.empty_cache). Live tensors are not touched."""
    _RT.empty_cache(device)


def get_default_device():
    """The device new tensors are created on."""
    return _RT.name_of(_RT.device())


def stats():
    """Counters: kernels compiled and launched, plans built/reused, backward passes replayed
    from a template, realizations run through a plan at a bound on a growing size
    (`bound_runs`), bytes in use per pool."""
    s = dict(_RT.stats)
    if _RT.pools is not None:
        s["bytes_allocated"] = _RT.pool_bytes()
        s["compiler_runs"] = _builtins.sum(getattr(d, "compiled", 0) for d in _RT.devices)
    return s


def autotune(enabled: "bool" = True, *, budget: "float" = None, launches: "int" = None,
             save: "bool" = None, progress: "bool" = None) -> None:
    """Turn the kernel autotuner on (or off with `autotune(False)`).

    While on, every kernel a new plan needs has its schedules timed on its device and the
    fastest kept (zyx/tuning.py says what is searched); results are stored on disk per
    device, so later plans and later processes reuse them without searching. `budget`:
    seconds one kernel's search may start new candidates for (default 10); `launches`:
    timed batches per candidate (default 3); `save`: keep results on disk (default True);
    `progress`: print the search on stderr (default True). Unset arguments keep their
    current values (config file section "autotune", ZYX_AUTOTUNE=1). Plans cached before
    are dropped when tuning is switched on or off."""
    from .tuning import Settings
    _RT._ensure()
    cur = _RT.autotune
    _RT.set_autotune(Settings(
        enabled=enabled,
        budget_s=cur.budget_s if budget is None else budget,
        launches=cur.launches if launches is None else launches,
        save_to_disk=cur.save_to_disk if save is None else save,
        progress=cur.progress if progress is None else progress))


def set_float32_matmul_precision(precision: "str") -> None:
    """How float32 matrix products and convolutions may be computed, as PyTorch's
    setting of this name: "highest" (the default) in float32; "high" or "medium" on
    TF32 tensor cores where the device has them (CUDA, compute capability 8.0 and later:
    operands rounded to a 10-bit mantissa, products accumulated in float32; about 1e-3
    relative error instead of 1e-6). Other devices and dtypes are unaffected.
    ZYX_FLOAT32_MATMUL_PRECISION sets it at start. Plans and GPU programs compiled before
    are dropped when it changes."""
    _RT.set_float32_matmul_precision(precision)


def get_float32_matmul_precision() -> "str":
    """The current `set_float32_matmul_precision` value."""
    return _RT.float32_matmul_precision


def set_debug(mask: "int") -> None:
    """Set the ZYX_DEBUG bitmask at run time (see zyx.runtime for the bits)."""
    _RT.debug = mask
    for d in _RT.devices or ():
        d.debug = mask


def set_checks(on: "bool") -> None:
    """Check index tensors (getitem, gather, one_hot, embedding, loss targets) and integer
    divisors when the realization that reads them runs, raising IndexError /
    ZeroDivisionError before any result is stored (on by default). Off: nothing is
    checked or built for it; a bad index reads 0 and an integer division by 0 gives 0,
    as before. (Python numbers that overflow a dtype raise either way.)"""
    _RT.checks.on = _builtins.bool(on)
    if not on:
        _RT.checks.watch.clear()


# --- autograd and optimizers (issue 3) ---
from .autograd import Tape, no_grad, enable_grad, set_grad_enabled, is_grad_enabled  # noqa: E402
from . import inplace as _inplace  # noqa: E402,F401  (in-place ops, __setitem__, views)
# --- end autograd and optimizers ---

# zyx.jit: replays a repeated step's plans without its Python (zyx/jit.py, docs/jit.md). The
# function hides the module as an attribute of zyx, as zyx.tensor does.
from .jit import jit  # noqa: E402
from .errors import JitError  # noqa: E402

# nn, optim, io and datasets load on first use: `import zyx` stays cheap for a first result
_LAZY = ("nn", "optim", "io", "datasets", "examples", "utils", "cuda", "distributed")


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'zyx' has no attribute {name!r}")

__version__ = "0.1.0"
