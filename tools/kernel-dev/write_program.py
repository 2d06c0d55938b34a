"""Write one program of the kernels to a file, for nvcc (a cubin that `PWCTL_CUBIN` loads for every
part): by default every kernel, the whole build; `--kernels a,b` those only; `--probe NAME` a
timing probe or the phase stamps of cuda/probes.cuh (`stamps`, `stamps_chain`, `load_only`, ...).
The program includes the family files by name: give nvcc the sources' folder with -I (cuda/, or
the variant PWCTL_CUDA_DIR names, whose sources the program's hash is then of).
Usage:
  python3 tools/kernel-dev/write_program.py OUT.cu [--probe NAME] [--kernels a,b]
  nvcc -arch=sm_90a -std=c++17 -cubin -I cuda -o x.cubin OUT.cu"""

from __future__ import annotations

import argparse
from pathlib import Path

from pwctl.kernels import build, registry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--probe", default=None, help="a probe of cuda/probes.cuh, e.g. stamps")
    parser.add_argument("--kernels", default=",".join(registry.BY_NAME), help="names, a,b")
    args = parser.parse_args()
    args.out.write_text(build.program_source(args.kernels.split(","), probe=args.probe))
    print(f"{args.out}: -I {build.cuda_dir()}")


if __name__ == "__main__":
    main()
