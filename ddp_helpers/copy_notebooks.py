"""Command line: `ddp-helpers-notebooks DEST` (or `python -m ddp_helpers.copy_notebooks DEST`) copies the
tutorial's notebooks and the classroom exercises into DEST, to open with `jupyter lab DEST`.

A wheel carries them as package data (ddp_helpers/notebooks/); a source checkout has them in its notebooks/.
Existing files in DEST are never overwritten unless --force is given.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional

_PACKAGE = Path(__file__).resolve().parent


def notebook_source() -> Path:
    """The folder holding the notebooks: the installed package data, else the source checkout's notebooks/."""
    for candidate in (_PACKAGE / "notebooks", _PACKAGE.parent / "notebooks"):
        if any(candidate.glob("*.ipynb")):
            return candidate
    raise FileNotFoundError(f"no notebooks found in {_PACKAGE / 'notebooks'} or {_PACKAGE.parent / 'notebooks'}: "
                            "this ddp_helpers installation lacks them; reinstall it from a wheel or a checkout")


def list_notebooks(src: Path) -> Dict[str, Path]:
    """Every notebook under src (exercises/ and appendix/ included) by relative path; hidden folders skipped."""
    found = {}
    for path in sorted(src.rglob("*.ipynb")):
        rel = path.relative_to(src)
        if not any(part.startswith(".") for part in rel.parts):  # .ipynb_checkpoints/
            found[rel.as_posix()] = path
    return found


def copy_notebooks(dest: Path, force: bool = False, src: Optional[Path] = None) -> List[Path]:
    """Copy the notebooks into dest (created if missing); returns the files written.

    Raises FileExistsError naming the files already in dest, before copying anything, unless force is True.
    """
    files = list_notebooks(src or notebook_source())
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise NotADirectoryError(f"DEST {dest} is a file: give a folder (it is created if missing)")
    existing = [rel for rel in files if (dest / rel).exists()]
    if existing and not force:
        shown = ", ".join(existing[:3]) + (f" and {len(existing) - 3} more" if len(existing) > 3 else "")
        raise FileExistsError(f"{dest} already has {shown}: nothing was copied. Pass --force to overwrite them "
                              "(your edits in them are lost), or give another DEST")
    written = []
    for rel, path in files.items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        written.append(target)
    return written


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ddp-helpers-notebooks console script."""
    p = argparse.ArgumentParser(prog="ddp-helpers-notebooks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dest", metavar="DEST", type=Path, help="folder to copy the notebooks into")
    p.add_argument("--force", action="store_true", help="overwrite notebooks already in DEST")
    args = p.parse_args(argv)
    try:
        written = copy_notebooks(args.dest, force=args.force)
    except (FileExistsError, NotADirectoryError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    print(f"copied {len(written)} notebooks into {args.dest}; open them with: jupyter lab {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
