# Source on the GPU machine from the repository root, before `python -m benchmarks.ssd`:
#   source benchmarks/peers_setup.sh
# Makes mamba_ssm's Triton SSD kernels importable without installing mamba_ssm (its package
# __init__ loads CUDA extensions that the sdist would have to compile). From the newest
# .peers/mamba_ssm-*.tar.gz (the PyPI sdist, carried to the machine; see ssd.py's docstring) it
# extracts only mamba_ssm/ops/triton/*.py and mamba_ssm/utils/{torch,determinism}.py into
# /tmp/peers, with empty __init__.py files for the packages on the way, and prepends /tmp/peers to
# PYTHONPATH. Those modules need torch, triton, einops and packaging, which the machine has.
# Exports PEERS_MAMBA_SSM=<sdist file name>, which the benchmark records.

_peers_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
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
    case ":${PYTHONPATH:-}:" in
      *:/tmp/peers:*) ;;
      *) export PYTHONPATH="/tmp/peers${PYTHONPATH:+:${PYTHONPATH}}" ;;
    esac
    echo "peers_setup: mamba_ssm Triton kernels from ${PEERS_MAMBA_SSM} in /tmp/peers" >&2
  else
    echo "peers_setup: extracting ${_peers_sdist} failed; mamba_ssm will be skipped" >&2
  fi
  unset _peers_top _peers_pkg
fi
unset _peers_root _peers_sdist
