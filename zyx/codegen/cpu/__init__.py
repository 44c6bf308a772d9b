"""IR rewrites for the C backend, run on a kernel before `cstyle` renders it: loop-invariant
loads hoisted (`hoist`), NaN kept in a flag for long max/min reductions (`nanflag`), a row
kernel's costly value kept for its next loop (`rowstash`), tap loops narrowed past zero
padding (`padtaps`)."""
