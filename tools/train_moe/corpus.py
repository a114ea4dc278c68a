"""Training corpus: the Python standard library's own sources, split into train and held-out files.

Owns the file selection and the train / held-out split, nothing else: it reads the standard library
of the interpreter that runs it and never writes outside the output path it is given. The split is a
pure function of each file's path relative to the stdlib root, so every machine with the same Python
version selects the same files; `corpus_manifest.json` beside this file records the selection this
project trained on (path, size and sha256 of every file) and `check_against_manifest` says whether
the local stdlib still matches it.

License: the sources are distributed with CPython under the PSF License Agreement (version 2), the
text of which is the `LICENSE.txt` at the root of the stdlib folder. That file also lists the few
incorporated components under their own permissive notices; all of them allow redistribution and
derivative works.

Selection (every rule states why):
- only `*.py` files;
- not `site-packages` / `dist-packages`: third-party code, not PSF-licensed;
- not test folders (`test`, `tests`, `idle_test`): Debian, Ubuntu and Fedora ship them as a separate
  package, so they are not "on any machine";
- not `_sysconfigdata*` and `config-*`: generated per build, different on every machine;
- not `encodings/` and `pydoc_data/`: generated files (codec tables, a dump of the HTML docs) whose
  repetitive content would teach little and distort the loss.

Held-out: a file is held out when the first 8 hex digits of sha256("sharpi-heldout-v1:" + relpath),
read as an integer below 2**32, fall below HELDOUT_FRACTION * 2**32. No file is chosen by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELDOUT_FRACTION = 0.04
HELDOUT_SALT = "sharpi-heldout-v1:"
SKIP_DIR_NAMES = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "__pycache__",
    "encodings",
    "pydoc_data",
    "lib-dynload",
}
MANIFEST_PATH = Path(__file__).resolve().parent / "corpus_manifest.json"


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # posix path relative to the stdlib root
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def is_heldout(relpath: str) -> bool:
    digest = hashlib.sha256((HELDOUT_SALT + relpath).encode("utf-8")).hexdigest()
    return int(digest[:8], 16) < HELDOUT_FRACTION * 2**32


def _selected(relpath: str) -> bool:
    parts = relpath.split("/")
    if any(p in SKIP_DIR_NAMES or p.startswith("config-") for p in parts[:-1]):
        return False
    name = parts[-1]
    return name.endswith(".py") and not name.startswith("_sysconfigdata")


def collect(root: Path | None = None) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train files, held-out files), each sorted by relative path. Files that are not valid UTF-8
    are skipped (none are in CPython 3.11); the sort makes the order independent of the filesystem."""
    root = root or stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"standard library folder {root} does not exist")
    train, heldout = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for filename in sorted(filenames):
            relpath = Path(dirpath, filename).relative_to(root).as_posix()
            if not _selected(relpath):
                continue
            try:
                text = Path(dirpath, filename).read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            (heldout if is_heldout(relpath) else train).append(SourceFile(relpath, text))
    train.sort(key=lambda f: f.relpath)
    heldout.sort(key=lambda f: f.relpath)
    if not train or not heldout:
        raise RuntimeError(f"{root}: selection gave {len(train)} train and {len(heldout)} held-out files")
    return train, heldout


def manifest(train: list[SourceFile], heldout: list[SourceFile], root: Path | None = None) -> dict:
    import platform

    def rows(files):
        return [{"path": f.relpath, "bytes": len(f.text.encode("utf-8")), "sha256": f.sha256} for f in files]

    return {
        "source": "CPython standard library (*.py), PSF License Agreement version 2",
        "python_version": platform.python_version(),
        "stdlib_root": str(root or stdlib_root()),
        "heldout_rule": f"sha256('{HELDOUT_SALT}' + relpath)[:8] < {HELDOUT_FRACTION} * 2**32",
        "train": rows(train),
        "heldout": rows(heldout),
    }


def check_against_manifest(train: list[SourceFile], heldout: list[SourceFile]) -> list[str]:
    """Differences between the local selection and the committed manifest (empty: identical)."""
    if not MANIFEST_PATH.exists():
        return [f"{MANIFEST_PATH} missing"]
    recorded = json.loads(MANIFEST_PATH.read_text())
    problems = []
    for split, files in (("train", train), ("heldout", heldout)):
        want = {r["path"]: r["sha256"] for r in recorded[split]}
        have = {f.relpath: f.sha256 for f in files}
        for path in sorted(set(want) ^ set(have)):
            problems.append(f"{split}: {path} {'missing locally' if path in want else 'not in manifest'}")
        for path in sorted(set(want) & set(have)):
            if want[path] != have[path]:
                problems.append(f"{split}: {path} differs from the manifest")
    return problems


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="List the corpus selection; --write-manifest records it.")
    parser.add_argument("--write-manifest", action="store_true")
    args = parser.parse_args()
    train_files, heldout_files = collect()
    for name, files in (("train", train_files), ("held-out", heldout_files)):
        total = sum(len(f.text.encode("utf-8")) for f in files)
        print(f"{name}: {len(files)} files, {total / 1e6:.2f} MB")
    print("held-out files:", ", ".join(f.relpath for f in heldout_files))
    if args.write_manifest:
        MANIFEST_PATH.write_text(json.dumps(manifest(train_files, heldout_files), indent=1) + "\n")
        print(f"wrote {MANIFEST_PATH}")
    else:
        diffs = check_against_manifest(train_files, heldout_files)
        print("matches the manifest" if not diffs else "\n".join(diffs[:20]))
