# Shared by bench/gpu_check.sh and bench/fast_check.sh (sourced, not run): the
# interpreter, the machine's description, the build, and stages run under one
# budget.  The sourcing script sets ROOT, then calls start_run.

MARK=$(mktemp)  # /dev/shm entries newer than this are the stage's

# start_run NAME BUDGET_S: the clock, the budget, and OUT (default:
# ROOT/NAME-<time>) with an empty stages.tsv
start_run() {
    STARTED=$(date +%s)
    BUDGET=$2
    OUT=${OUT:-$ROOT/$1-$(date +%Y%m%d-%H%M%S)}
    mkdir -p "$OUT" || return
    OUT=$(cd "$OUT" && pwd)
    STAGES_FILE=$OUT/stages.tsv
    : > "$STAGES_FILE"
}

say() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - STARTED ))s] $*"; }

# find_python: PYTHON, else the first of python3, python that imports torch
find_python() {
    if [ -z "${PYTHON:-}" ]; then
        for candidate in python3 python; do
            if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then
                PYTHON=$(command -v "$candidate")
                break
            fi
        done
    fi
    [ -n "${PYTHON:-}" ]
}

has() { "$PYTHON" -c "import $1" 2>/dev/null; }

# describe_machine NAME: the commit, CPU, memory, GPU, Python and packages
describe_machine() {
    if commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null); then
        git -C "$ROOT" diff --quiet HEAD 2>/dev/null || commit="$commit (with changes)"
        echo "commit: $commit"
    fi
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores; $(free -g | awk '/^Mem:/ {print $2 " GiB"}')"
    echo "/dev/shm: $(df -h /dev/shm | awk 'NR == 2 {print $2 " (" $4 " free)"}')"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
        --format=csv,noheader | sed 's/^/gpu: /'
    echo "python: $PYTHON ($("$PYTHON" -c 'import platform; print(platform.python_version())'))"
    "$PYTHON" - <<'PYEOF'
import importlib
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"devices: {[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
for name in ("numpy", "pytest", "torchvision", "cryptography", "tqdm", "setuptools"):
    try:
        module = importlib.import_module(name)
        print(f"{name}: {getattr(module, '__version__', 'yes')}")
    except ImportError as exc:
        print(f"{name}: missing ({exc})")
PYEOF
}

# The kernel's UDP counters of this namespace (/proc/net/snmp), "name=value ...":
# what a stage on loopback lost in socket buffers shows as RcvbufErrors.
udp_counters() {
    awk '/^Udp:/ { if (!n) { split($0, names); n = 1 } else { for (i = 2; i <= NF; i++)
        printf "%s=%s ", names[i], $i } }' /proc/net/snmp 2>/dev/null
}
# What grew between two udp_counters readings, the error counters only.
udp_growth() {
    local before=$1 after=$2 pair grown=""
    for pair in $after; do
        local key=${pair%%=*} now=${pair#*=} was
        case $key in *Errors|NoPorts) ;; *) continue ;; esac
        was=$(tr ' ' '\n' <<< "$before" | awk -F= -v k="$key" '$1 == k {print $2}')
        [ -n "$was" ] && [ "$now" -gt "$was" ] && grown="$grown $key +$(( now - was ))"
    done
    echo "${grown# }"
}

# stage NAME CAP_S COMMAND...: run it with at most CAP_S seconds, and never past the
# budget (15 s kept for the summary); its output in OUT/NAME.log; a line in stages.tsv
stage() {
    local name=$1 cap=$2
    shift 2
    local left=$(( BUDGET - ($(date +%s) - STARTED) - 15 ))
    local limit=$(( cap < left ? cap : left ))
    if [ "$limit" -lt 10 ]; then
        say "$name: skipped, the budget is spent"
        printf '%s\t%s\t%s\t%s\n' "$name" skipped 0 "budget spent" >> "$STAGES_FILE"
        return
    fi
    say "$name: start (at most ${limit}s): $*"
    local begun rc
    begun=$(date +%s)
    touch "$MARK"
    local udp_before
    udp_before=$(udp_counters)
    timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    local udp_grown
    udp_grown=$(udp_growth "$udp_before" "$(udp_counters)")
    local took=$(( $(date +%s) - begun ))
    # (tqdm's progress lines left out: the log keeps them)
    tr '\r' '\n' < "$OUT/$name.log" | grep -v 'case/s' | tail -n 15 | sed "s/^/  $name| /"
    local note=""
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && note="timed out after ${limit}s"
    local leftover
    leftover=$(find /dev/shm -maxdepth 1 -name 'switchml-*' -newer "$MARK" 2>/dev/null | wc -l)
    [ "$leftover" != 0 ] && note="${note:+$note; }$leftover switchml segment(s) left in /dev/shm"
    [ -n "$udp_grown" ] && note="${note:+$note; }UDP here: $udp_grown"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$took" "$note" >> "$STAGES_FILE"
    say "$name: exit $rc after ${took}s${note:+ ($note)}"
}

# skipped NAME WHY: a stage that cannot run here, in stages.tsv
skipped() {
    say "$1: skipped, $2"
    printf '%s\t%s\t%s\t%s\n' "$1" skipped 0 "$2" >> "$STAGES_FILE"
}

check_build() {
    "$PYTHON" setup.py build_ext --inplace -q || return
    "$PYTHON" - <<'PYEOF'
import importlib
for name in ("switchml.switch.dataplane._fastpath", "switchml.worker.engine._fastengine",
             "switchml.worker.local._memory"):
    importlib.import_module(name)  # fails here, not as a silent Python fallback later
    print(f"built: {name}")
PYEOF
}
export -f check_build
