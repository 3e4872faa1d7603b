"""Packs NIXL for a GPU machine that lacks it, small enough to carry beside `.gpu-carry/`.

    .venv/bin/python scripts/gpu_carry_nixl.py   # from the project root: .gpu-carry-nixl/
    device run, carry [".gpu-carry", ".gpu-carry-nixl"], command starting with:
      source .gpu-carry/setup.sh && source .gpu-carry-nixl/setup.sh && ...

The GPU image has CUDA 13 and Python 3.12, so this takes the cp312 wheels of ``nixl`` (the
meta package) and ``nixl-cu13``, the version installed here. The whole wheel is 56 MiB
(226 MiB unpacked): it keeps only what loading the UCX backend needs: the bindings, the UCX
plugin, UCX's own transport modules (the CUDA ones among them), and every shared library
these load, found by their ELF ``NEEDED`` entries. Other backends (S3, Azure, GDS, ...) and
the NIXL EP kernels are left out.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".gpu-carry-nixl"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
SETUP = """# source me on the GPU machine, from the project root, after .gpu-carry/setup.sh
mkdir -p /tmp/site && tar -xzf "$(dirname "${BASH_SOURCE[0]}")/site.tar.gz" -C /tmp/site
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
"""


def download(spec: str, into: Path) -> Path:
    args = ["--no-deps", "--only-binary=:all:", "--python-version=3.12", "--implementation=cp"]
    args += [f"--platform={p}" for p in PLATFORMS]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", *args, "-d", str(into), spec],
                   check=True)  # fmt: skip
    name = spec.split("==")[0].replace("-", "_")
    return next(into.glob(f"{name}-*.whl"))


def needed(lib: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    return [line.rsplit("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def keep(tree: Path) -> set[Path]:
    """The UCX backend's files and the closure of the libraries they load."""
    pkg, libs, meson = tree / "nixl_cu13", tree / "nixl_cu13.libs", tree / ".nixl_cu13.mesonpy.libs"
    roots = [
        *pkg.glob("*.so"),
        meson / "plugins" / "libplugin_UCX.so",
        libs / "nixl" / "libplugin_UCX.so",
    ]
    roots += [p for p in (libs / "ucx").glob("*.so*") if "perftest" not in p.name]
    by_name = {p.name: p for d in (libs, meson) for p in d.iterdir() if p.is_file()}
    kept, todo = set(roots), list(roots)
    while todo:
        for name in needed(todo.pop()):
            lib = by_name.get(name)
            if lib is not None and lib not in kept:
                kept.add(lib)
                todo.append(lib)
    return kept | {p for p in pkg.rglob("*") if p.is_file()}


def main() -> int:
    release = version("nixl")  # the meta package: installed beside nixl-cu12 or nixl-cu13
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        meta = download(f"nixl=={release}", tmpdir)
        wheel = download(f"nixl-cu13=={release}", tmpdir)
        tree = tmpdir / "tree"
        zipfile.ZipFile(wheel).extractall(tree)
        zipfile.ZipFile(meta).extractall(tree)
        files = keep(tree) | {p for p in tree.glob("nixl*/*.py") if "cu13" not in p.parent.name}
        files |= set(tree.glob("nixl_meta_utils.py"))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for path in sorted(files):
                tar.add(path, arcname=str(path.relative_to(tree)))
    (OUT / "site.tar.gz").write_bytes(buf.getvalue())
    (OUT / "setup.sh").write_text(SETUP)
    exclude = ROOT / ".git" / "info" / "exclude"
    if "/.gpu-carry-nixl/" not in exclude.read_text().split():
        with exclude.open("a") as f:
            f.write("/.gpu-carry-nixl/\n")
    print(f"{OUT}: {len(files)} files, {len(buf.getvalue()) >> 20} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
