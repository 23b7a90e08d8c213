# Source on the GPU machine from the repository root, before running the benchmarks:
#   source benchmarks/device_setup.sh
# Installs the wheels carried in .whl/ (tokamax and the dependencies the machine lacks) into
# /tmp/site, stubs out `xprof` (imported by tokamax at import time, only used for profiling)
# under /tmp/site_stub, and puts both on PYTHONPATH.

_repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if compgen -G "${_repo_root}/.whl/*.whl" > /dev/null; then
  # Keep the machine's typing_extensions when it is already new enough for pydantic.
  _skip=none
  if python3 -c 'import importlib.metadata as m, sys
v = tuple(int(x) for x in m.version("typing_extensions").split(".")[:2])
sys.exit(v < (4, 16))' 2> /dev/null; then
    _skip=typing_extensions-
  fi
  _wheels=()
  for _w in "${_repo_root}"/.whl/*.whl; do
    [[ "$(basename "${_w}")" == "${_skip}"* ]] || _wheels+=("${_w}")
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${_wheels[@]}" || echo "device_setup: wheel install failed" >&2
  unset _wheels _w _skip
fi

_stub=/tmp/site_stub/xprof/cli/tools
mkdir -p "${_stub}"
touch /tmp/site_stub/xprof/__init__.py /tmp/site_stub/xprof/cli/__init__.py "${_stub}/__init__.py"
cat > "${_stub}/get_kernel_stats_tool.py" << 'PY'
"""Stub: tokamax imports this module at import time; only its xprof profiling path calls it."""


def compute_kernel_stats(*args, **kwargs):
    raise NotImplementedError("xprof is not installed; this is a stub from device_setup.sh")
PY
unset _stub _repo_root

export PYTHONPATH="/tmp/site:/tmp/site_stub${PYTHONPATH:+:${PYTHONPATH}}"
