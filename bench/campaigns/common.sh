# What every session's campaign script shares; sourced after it sets OUT (its
# results folder), from the repository root.  PY: the Python that runs the
# benches (the checkout's .venv by default).
PY=${PY:-.venv/bin/python}
# the median of 3 invocations of `python -m bench ARGS`, in $OUT/NAME
inv() { name=$1; shift; $PY bench/invocations.py --runs 3 --out $OUT/$name -- "$@"; }
# one invocation only (a run too long to repeat)
once() { name=$1; shift; $PY bench/invocations.py --runs 1 --out $OUT/$name -- "$@"; }
