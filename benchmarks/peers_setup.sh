# Source on the GPU machine from the repository root, before `python -m benchmarks.ssd` or
# `python -m benchmarks.decode`:
#   source benchmarks/peers_setup.sh
# Makes the peers' Triton kernels importable without installing their packages, from PyPI sdists
# carried to the machine in .peers/ (git-ignored), extracted into /tmp/peers, which is
# prepended to PYTHONPATH. A peer whose sdist is absent is left out (its benchmark records it as
# skipped). Benchmark-time only: none of their code goes into this repository.
#
# mamba_ssm (benchmarks/ssd.py): its package __init__ loads CUDA extensions that the sdist would
# have to compile. From the newest .peers/mamba_ssm-*.tar.gz (see ssd.py's docstring) it extracts
# only mamba_ssm/ops/triton/*.py and mamba_ssm/utils/{torch,determinism}.py, with empty
# __init__.py files for the packages on the way. They need torch, triton, einops and packaging,
# which the machine has. Exports PEERS_MAMBA_SSM=<sdist file name>, which the benchmark records.
#
# vLLM (benchmarks/decode.py): from the newest .peers/vllm-*.tar.gz (`pip download vllm
# --no-deps --no-binary :all:` or the sdist from PyPI's page) it extracts only the Triton decode
# kernel, triton_decode_attention.py (vllm/v1/attention/ops/ in recent versions,
# vllm/attention/ops/ before), with empty __init__.py files on the way (vllm's own imports the
# whole engine). The kernel imports two vllm modules besides torch, triton and packaging; this
# script writes stand-ins for them (and for vllm.logger, which some versions import):
#   vllm/platforms/__init__.py    current_platform.is_rocm() / is_cuda(), from torch.version
#   vllm/triton_utils/__init__.py re-exports triton and triton.language as tl
#   vllm/logger.py                init_logger = logging.getLogger
# and warns if the extracted file imports any other vllm module. Exports PEERS_VLLM=<sdist file
# name>, which the benchmark records.

_peers_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_peers_any=""

# --- mamba_ssm ---
_peers_sdist="$(ls "${_peers_root}"/.peers/mamba_ssm-*.tar.gz 2> /dev/null | sort -V | tail -n 1)"
if [[ -z "${_peers_sdist}" ]]; then
  echo "peers_setup: no .peers/mamba_ssm-*.tar.gz (carry .peers); mamba_ssm will be skipped" >&2
else
  _peers_top="$(basename "${_peers_sdist}" .tar.gz)"
  rm -rf /tmp/peers/mamba_ssm
  mkdir -p /tmp/peers
  # --no-wildcards-match-slash: ops/triton/*.py leaves out the mamba3/ subfolder.
  if tar -xzf "${_peers_sdist}" -C /tmp/peers --strip-components=1 \
      --wildcards --no-wildcards-match-slash \
      "${_peers_top}/mamba_ssm/ops/triton/*.py" \
      "${_peers_top}/mamba_ssm/utils/torch.py" \
      "${_peers_top}/mamba_ssm/utils/determinism.py"; then
    for _peers_pkg in mamba_ssm mamba_ssm/ops mamba_ssm/ops/triton mamba_ssm/utils; do
      : > "/tmp/peers/${_peers_pkg}/__init__.py"
    done
    export PEERS_MAMBA_SSM="$(basename "${_peers_sdist}")"
    _peers_any=1
    echo "peers_setup: mamba_ssm Triton kernels from ${PEERS_MAMBA_SSM} in /tmp/peers" >&2
  else
    echo "peers_setup: extracting ${_peers_sdist} failed; mamba_ssm will be skipped" >&2
  fi
  unset _peers_top _peers_pkg
fi

# --- vLLM ---
_peers_sdist="$(ls "${_peers_root}"/.peers/vllm-*.tar.gz 2> /dev/null | sort -V | tail -n 1)"
if [[ -z "${_peers_sdist}" ]]; then
  echo "peers_setup: no .peers/vllm-*.tar.gz (carry .peers); vllm-triton will be skipped" >&2
else
  # The kernel's folder moved between versions: find it in the archive's listing.
  _peers_member="$(tar -tzf "${_peers_sdist}" 2> /dev/null \
    | grep -E '^[^/]+/vllm/(v1/)?attention/ops/triton_decode_attention\.py$' | sort | tail -n 1)"
  rm -rf /tmp/peers/vllm
  mkdir -p /tmp/peers
  if [[ -n "${_peers_member}" ]] \
      && tar -xzf "${_peers_sdist}" -C /tmp/peers --strip-components=1 "${_peers_member}"; then
    _peers_file="${_peers_member#*/}"  # vllm/.../triton_decode_attention.py
    _peers_pkg="$(dirname "${_peers_file}")"
    while [[ "${_peers_pkg}" != "." ]]; do
      : > "/tmp/peers/${_peers_pkg}/__init__.py"
      _peers_pkg="$(dirname "${_peers_pkg}")"
    done
    mkdir -p /tmp/peers/vllm/platforms /tmp/peers/vllm/triton_utils
    cat > /tmp/peers/vllm/platforms/__init__.py << 'PY'
"""Stand-in from benchmarks/peers_setup.sh: the part of vllm.platforms that vLLM's Triton decode
kernel uses (current_platform.is_rocm(), to pick its AMD tiles)."""

import torch


class _Platform:
    def is_rocm(self):
        return torch.version.hip is not None

    def is_cuda(self):
        return torch.version.cuda is not None and torch.version.hip is None


current_platform = _Platform()
PY
    cat > /tmp/peers/vllm/triton_utils/__init__.py << 'PY'
"""Stand-in from benchmarks/peers_setup.sh: vllm.triton_utils re-exports triton (installed)."""

import triton
import triton.language as tl

HAS_TRITON = True
PY
    cat > /tmp/peers/vllm/logger.py << 'PY'
"""Stand-in from benchmarks/peers_setup.sh: vllm.logger.init_logger as logging.getLogger."""

import logging

init_logger = logging.getLogger
PY
    _peers_other="$(grep -E '^[[:space:]]*(from|import)[[:space:]]+vllm' \
      "/tmp/peers/${_peers_file}" \
      | grep -vE 'vllm\.(platforms|triton_utils|logger)([^.[:alnum:]_]|$)' || true)"
    if [[ -n "${_peers_other}" ]]; then
      echo "peers_setup: warning: ${_peers_file} also imports (no stand-in; it may fail):" >&2
      echo "${_peers_other}" >&2
    fi
    export PEERS_VLLM="$(basename "${_peers_sdist}")"
    _peers_any=1
    echo "peers_setup: vLLM's Triton decode kernel (${_peers_file}) from ${PEERS_VLLM} in" \
      "/tmp/peers" >&2
  else
    echo "peers_setup: no triton_decode_attention.py extracted from ${_peers_sdist};" \
      "vllm-triton will be skipped" >&2
  fi
  unset _peers_member _peers_file _peers_pkg _peers_other
fi

if [[ -n "${_peers_any}" ]]; then
  case ":${PYTHONPATH:-}:" in
    *:/tmp/peers:*) ;;
    *) export PYTHONPATH="/tmp/peers${PYTHONPATH:+:${PYTHONPATH}}" ;;
  esac
fi
unset _peers_root _peers_sdist _peers_any
