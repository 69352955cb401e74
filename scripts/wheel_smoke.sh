#!/usr/bin/env bash
# Build fxdream's wheel, install it alone into a fresh venv that borrows the test venv's torch
# (no editable install, no download), and run the entry points from outside the source tree.
# Fails when the wheel lacks a package of the source tree or a command fails.
set -euo pipefail
venv=${1:-.venv}
src=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" . >/dev/null
wheel=$(ls "$work"/dist/fxdream-*.whl)
"$venv/bin/python" - "$wheel" <<'PY'
import sys, zipfile, pathlib
names = zipfile.ZipFile(sys.argv[1]).namelist()
in_wheel = {str(pathlib.PurePosixPath(n).parent) for n in names if n.endswith("/__init__.py")}
expected = set()
for root, prefix in (("fxdream", "fxdream"), ("passes", "fxdream/passes"), ("models", "fxdream/models")):
    for init in pathlib.Path(root).rglob("__init__.py"):
        relative = init.parent.relative_to(root).as_posix()
        expected.add(prefix if relative == "." else f"{prefix}/{relative}")
missing = sorted(expected - in_wheel)
if missing:
    sys.exit(f"wheel_smoke: the wheel lacks packages of the source tree: {missing}")
fits = sorted(str(p) for p in pathlib.Path("fxdream/sim/cost/fits").glob("*.json"))
missing_data = [f for f in fits if f not in names]
if missing_data:
    sys.exit(f"wheel_smoke: the wheel lacks data files of the source tree: {missing_data}")
print(f"wheel_smoke: {len(in_wheel)} packages in {pathlib.Path(sys.argv[1]).name}")
PY
"$venv/bin/python" -m venv "$work/venv"
fresh=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# torch, sympy, networkx, tqdm from the test venv (and the system's, where it reuses a GPU
# machine's torch): path entries only (their .pth files, among them the editable install's, are
# not processed), so fxdream comes from the wheel alone
"$venv/bin/python" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith("-packages")))' \
  > "$fresh/test-venv-packages.pth"
"$work/venv/bin/python" -m pip install -q --no-deps --no-index "$wheel"
cd "$work"
py="$work/venv/bin/python"
"$py" -c "import fxdream, sys; assert not fxdream.__file__.startswith('$src'), fxdream.__file__; print('wheel_smoke: fxdream from', fxdream.__file__)"
"$py" -m fxdream -q whatif resnet18 --device h100 --batch 2 > whatif.txt
"$py" -m fxdream -q simulate mnist_convnet --batch 2 --device h100 > simulate.txt
"$py" -c "from fxdream.sim.cost import get_device; s = get_device('h200').source; assert s.startswith('fitted'), s; print('wheel_smoke: h200', s)"
"$py" -m fxdream -q explain mnist_convnet --tiny --batch 2 --out explain > explain.txt
"$py" - <<'PY'
import torch, fxdream
from fxdream import models
model, inputs, _ = models.build("mnist_convnet", 2)
optimized = fxdream.optimize(model.eval(), inputs, passes="auto")
with torch.no_grad():
    torch.testing.assert_close(optimized(*inputs), model(*inputs))
print("wheel_smoke: optimize() on the zoo's mnist_convnet equals eager;", len(optimized.report.passes), "pass rows")
PY
for f in whatif simulate explain; do
  [ -s "$f.txt" ] || { echo "wheel_smoke: '$f' printed nothing"; exit 1; }
done
echo "wheel_smoke: whatif, simulate, explain and optimize ran from the installed wheel"
