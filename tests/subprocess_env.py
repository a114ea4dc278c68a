"""The environment for a child Python process that must import the same sharpi as the test.

In CI sharpi is pip-installed and the checkout's python/ has no compiled modules; in a developer build
python/sharpi holds _core and _internal. Either way the child finds the package this process imported first.
"""

from __future__ import annotations

import os

import sharpi


def child_env(*extra_paths: str, base: dict | None = None) -> dict:
    """A copy of `base` (default os.environ) whose PYTHONPATH starts with `extra_paths`, then the
    directory holding the imported sharpi package, then what PYTHONPATH held before."""
    env = dict(os.environ if base is None else base)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(sharpi.__file__)))
    paths = [*extra_paths, package_root]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
