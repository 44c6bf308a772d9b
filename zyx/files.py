"""Writing a file so that no reader ever sees part of it: `write_atomic`.

The one place zyx writes files atomically (kernel caches, the probe marker, autotune
schedules, safetensors checkpoints). A leaf module, importing nothing of zyx, so every
layer may use it (zyx.io must not reach zyx.backends).
"""
from __future__ import annotations

import os
import tempfile


def write_atomic(path, data, mode=0o600, prefix="tmp-", suffix=""):
    """Write `data` (bytes, or a function writing into the open binary file) to `path`:
    into a temporary file beside it, then renamed over `path`, so a reader sees the old
    file or the whole new one, never half of one (a crash or a full disk leaves the old
    file). The temporary is removed when anything fails, and the error raised.

    `mode`: the file's permission bits, whatever the umask (mkstemp creates 0600, which
    cache files keep: they are loaded into the process). `prefix` / `suffix` name the
    temporary, so that whoever cleans the directory knows it (the caches remove `tmp-*`
    left by a killed process)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=prefix, suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
        if mode != 0o600:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
