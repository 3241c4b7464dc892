"""Command line: `ddp-helpers-notebooks DEST` (or `python -m ddp_helpers.cli.copy_notebooks DEST`) copies the
tutorial's notebooks, the classroom exercises and the example scripts notebook 4 reads (into DEST/examples/)
into DEST, to open with `jupyter lab DEST`.

A wheel carries them as package data; a source checkout has them in its notebooks/ and examples/.
Existing files in DEST are never overwritten unless --force is given.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional

from ..common.shipped import examples_source, list_examples, list_notebooks, notebook_source


def shipped_files() -> Dict[str, Path]:
    """What a copy holds, by its path in DEST: the notebooks, and examples/ beside them."""
    return {**list_notebooks(notebook_source()), **list_examples(examples_source())}


def copy_notebooks(dest: Path, force: bool = False) -> List[Path]:
    """Copy the notebooks and examples into dest (created if missing); returns the files written.

    Raises FileExistsError naming the files already in dest, before copying anything, unless force is True.
    """
    files = shipped_files()
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
    scripts = sum(path.suffix == ".py" for path in written)
    print(f"copied {len(written) - scripts} notebooks and the {scripts} scripts they read (examples/) into "
          f"{args.dest}; open them with: jupyter lab {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
