"""Runs a module's `main` with the Mamba2 layer's old one-token decode step (the conv as an XLA
fusion, its history concatenated and copied, the step sizes and decays from XLA, then
`selective_state_update`): `Mamba2._fused_step` turned off. The base side of the decode-step
A/B in benchmarks/REPORT.md ("The decode step as two kernels"):

    python -m benchmarks.experiments.decode_old_step benchmarks.decode ARGS...
    python -m benchmarks.experiments.decode_old_step \
        benchmarks.experiments.generate_step_probe ARGS...
"""
import importlib
import sys

from flax_layers import mamba2


def main():
    module = sys.argv[1]
    mamba2.Mamba2._fused_step = lambda self, *args: None
    sys.argv = [module, *sys.argv[2:]]
    importlib.import_module(module).main()


if __name__ == "__main__":
    main()
