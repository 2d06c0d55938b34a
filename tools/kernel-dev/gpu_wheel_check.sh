#!/usr/bin/env bash
# The GPU path from an installed wheel: builds the wheel (as tests/test_wheel.py does), installs it
# with --no-deps in a fresh venv that borrows the machine's packages (torch, CuPy, ...) through a
# .pth line (which adds their folder, not an editable install's finder of this checkout), then
# runs the decode and prefill GPU tests' kernels against the installed pwctl, whose sources are
# the wheel's pwctl/cuda. Usage (device tool): bash tools/kernel-dev/gpu_wheel_check.sh [-k EXPR]
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
root=$PWD dist=$(mktemp -d) env=$(mktemp -d)/venv
select=("$@")
[ ${#select[@]} -eq 0 ] && select=(-k "match_reference or routed_decode or prefill")
python3 -m pip wheel -q --no-deps --no-build-isolation -w "$dist" . || exit 1
python3 -m venv "$env" && "$env/bin/python" -m pip install -q --no-deps --no-index "$dist"/pwctl-*.whl
site=$("$env/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
python3 -c "import sysconfig; print(sysconfig.get_path('purelib'))" >"$site/borrowed.pth"
cd "$(mktemp -d)" || exit 1
"$env/bin/python" -c "from pwctl.kernels import build; print('sources:', build.cuda_dir())"
"$env/bin/pwctl" bench --kernels --help >/dev/null && echo "pwctl bench --kernels --help: ok"
"$env/bin/python" -m pytest -q -m gpu "$root/tests/test_kernels.py" -p no:cacheprovider \
    --rootdir "$PWD" "${select[@]}" 2>&1 | tail -5
