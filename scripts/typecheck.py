"""Run mypy on the `gpufleet` package as it is installed: `python scripts/typecheck.py [MYPY ARGS]`.

setuptools assembles the one `gpufleet` namespace from several folders (`package-dir` in
pyproject.toml: gpufleet/, shared/ -> gpufleet.shared, services/ -> gpufleet.services). mypy
knows packages only as folders; run on the folders themselves it names the modules `shared.x`,
cannot find any `gpufleet.shared.x` import and treats it as Any. So this lays the installed
tree out as symlinks in .typecheck/ (rebuilt on every run, so new files and folders are always
in it), checks it with `MYPYPATH=.typecheck mypy -p gpufleet`, and reports the real paths.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FARM = ROOT / ".typecheck"


def package_dirs() -> dict[str, Path]:
    """The package -> folder mapping that setuptools installs."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        mapping: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {pkg: ROOT / folder for pkg, folder in mapping.items()}


def _link(dst: Path, src: Path) -> None:
    dst.symlink_to(os.path.relpath(src, dst.parent))


def _lay_out(pkg: str, src: Path, dirs: dict[str, Path]) -> None:
    """The package's folder as a link, or, where other folders are mapped into it, link by link."""
    dst = FARM / pkg.replace(".", "/")
    nested = {sub[len(pkg) + 1:].split(".")[0] for sub in dirs if sub.startswith(pkg + ".")}
    if not nested:
        _link(dst, src)
        return
    dst.mkdir(parents=True)
    for entry in sorted(src.iterdir()):
        if entry.name not in nested and entry.name != "__pycache__":
            _link(dst / entry.name, entry)
    for name in sorted(nested):
        sub = f"{pkg}.{name}"
        _lay_out(sub, dirs.get(sub, src / name), dirs)


def build_farm(dirs: dict[str, Path]) -> list[str]:
    """Lay out the package tree in FARM; return the top-level packages."""
    if FARM.exists():
        shutil.rmtree(FARM)  # removes the links, never what they point to
    FARM.mkdir()
    (FARM / ".gitignore").write_text("*\n")
    roots = sorted(pkg for pkg in dirs if pkg.rpartition(".")[0] not in dirs)
    for pkg in roots:
        _lay_out(pkg, dirs[pkg], dirs)
    return roots


def main(argv: list[str]) -> int:
    dirs = package_dirs()
    roots = build_farm(dirs)
    cmd = [sys.executable, "-m", "mypy"]
    for pkg in roots:
        cmd += ["-p", pkg]
    env = {**os.environ, "MYPYPATH": str(FARM.relative_to(ROOT))}
    proc = subprocess.run([*cmd, *argv], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    # .typecheck/gpufleet/shared/x.py -> shared/x.py: the deepest packages first
    prefixes = [
        (f"{FARM.name}/{pkg.replace('.', '/')}/", f"{dirs[pkg].relative_to(ROOT)}/")
        for pkg in sorted(dirs, key=lambda p: p.count("."), reverse=True)
    ]
    for stream, text in ((sys.stdout, proc.stdout), (sys.stderr, proc.stderr)):
        for old, new in prefixes:
            text = text.replace(old, new)
        stream.write(text)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
