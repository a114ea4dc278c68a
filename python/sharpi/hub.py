"""`-hf REPO[:QUANT]`: a GGUF model from the Hugging Face Hub, as `llama-cli -hf` takes it.

What it owns: turning "user/repo:Q4_K_M" into local file paths. It lists the repository's files
with huggingface_hub, picks the model the quant tag names (the tag matched case-insensitively as a
whole word of the file path, "Q4_K_M" in "Model-Q4_K_M-00001-of-00003.gguf", as llama.cpp matches
it; no tag: the repository's only model, else its Q4_K_M one), and downloads every file of it (all
shards of a split model) into huggingface_hub's standard cache, which resumes interrupted transfers
and shows a progress bar. It returns the path of the first file; the engine opens the rest itself.

Offline: with HF_HUB_OFFLINE=1, or when the Hub cannot be reached, the listing comes from the cache
(the snapshot huggingface_hub recorded for the revision) and nothing is downloaded; a model that is
not fully cached is then an error. HF_ENDPOINT, HF_HOME, HF_HUB_CACHE and HF_TOKEN are honoured
because huggingface_hub reads them. Only this module imports huggingface_hub, and only when -hf is
used.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict

_SHARD = re.compile(r"-(\d{5,})-of-(\d{5,})\.gguf$", re.IGNORECASE)
# A quant name as it appears in GGUF file names: Q4_K_M, IQ2_XXS, Q8_0, UD-Q4_K_XL, BF16, F16, ...
_QUANT = re.compile(r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d+(?:_[A-Za-z0-9]+)*|TQ\d_\d|BF16|F16|F32))(?![A-Za-z0-9])", re.IGNORECASE)
DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's choice when no tag is given and the repository has several


class HubError(RuntimeError):
    """A -hf request that cannot be satisfied (bad spec, no such quant, not cached offline)."""


def parse_spec(spec: str) -> tuple[str, str | None]:
    """'user/repo[:QUANT]' -> (repo, quant or None)."""
    repo, _, quant = spec.partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise HubError(f"-hf {spec!r}: expected USER/REPO[:QUANT], e.g. unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M")
    return repo, (quant or None)


def _models(files) -> OrderedDict[str, list[str]]:
    """GGUF files grouped into models: key = path without the shard suffix, value = its files in
    shard order. mmproj (vision projector) files are not models."""
    groups: OrderedDict[str, list[str]] = OrderedDict()
    for name in sorted(files):
        if not name.lower().endswith(".gguf") or "mmproj" in os.path.basename(name).lower():
            continue
        key = _SHARD.sub(".gguf", name)
        groups.setdefault(key, []).append(name)
    return groups


def _quant_of(model: str) -> str:
    found = _QUANT.findall(os.path.basename(model))
    return found[-1].upper() if found else os.path.basename(model)


def _check_shards(repo: str, files: list[str]) -> None:
    m = _SHARD.search(files[0])
    if m is None:
        if len(files) > 1:
            raise HubError(f"{repo}: several files for one model: {', '.join(files)}")
        return
    count = int(m.group(2))
    numbers = sorted(int(_SHARD.search(f).group(1)) for f in files)
    if numbers != list(range(1, count + 1)):
        raise HubError(
            f"{repo}: split model {files[0]} has shards {numbers} of {count}: "
            f"shard(s) {sorted(set(range(1, count + 1)) - set(numbers))} missing"
        )


def select_files(repo: str, files, quant: str | None) -> list[str]:
    """The files (in shard order) of the model `quant` names among `files`; HubError otherwise."""
    models = _models(files)
    if not models:
        raise HubError(f"{repo}: no GGUF file in the repository")
    available = ", ".join(
        f"{_quant_of(k)} ({os.path.basename(v[0])}" + (f", {len(v)} shards)" if len(v) > 1 else ")")
        for k, v in models.items()
    )
    if quant is None:
        if len(models) == 1:
            chosen = next(iter(models.values()))
            _check_shards(repo, chosen)
            return chosen
        quant_wanted, explicit = DEFAULT_QUANT, False
    else:
        quant_wanted, explicit = quant, True
    word = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(quant_wanted)}(?![A-Za-z0-9_])", re.IGNORECASE)
    matches = [v for k, v in models.items() if word.search(k)]
    if not matches:
        if explicit:
            raise HubError(f"{repo}: no GGUF file for quant '{quant}'; the repository has: {available}")
        raise HubError(f"{repo} has several models and none is {DEFAULT_QUANT}: name one (-hf {repo}:QUANT) of: {available}")
    if len(matches) > 1:
        names = ", ".join(os.path.basename(v[0]) for v in matches)
        raise HubError(f"{repo}: quant '{quant_wanted}' matches several models ({names}); name one exactly")
    _check_shards(repo, matches[0])
    return matches[0]


def _cached_listing(repo: str, revision: str | None):
    """(snapshot dir, files in it) of the cached revision, or (None, []) when nothing is cached."""
    from huggingface_hub import snapshot_download

    try:
        snapshot = snapshot_download(repo, revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - any failure here means "not in the cache"
        return None, []
    files = []
    for root, _dirs, names in os.walk(snapshot):
        for name in names:
            files.append(os.path.relpath(os.path.join(root, name), snapshot).replace(os.sep, "/"))
    return snapshot, files


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def resolve(spec: str, revision: str | None = None, log=None) -> str:
    """Downloads (or finds in the cache) the model `spec` names; returns the path of its first file."""
    from huggingface_hub import HfApi, hf_hub_download

    repo, quant = parse_spec(spec)
    say = log or (lambda _msg: None)
    files = None
    unreachable = None if _offline() else _unreachable()
    if unreachable is not None:
        say(f"sharpi: the Hub is unreachable ({unreachable}); using the local cache")
    elif not _offline():
        try:
            files = HfApi().list_repo_files(repo, revision=revision)
        except Exception as error:
            if not _is_connection_error(error):
                raise HubError(f"{repo}: cannot list the repository: {_short(error)}") from error
            say(f"sharpi: the Hub is unreachable ({_short(error)}); using the local cache")
    if files is None:
        snapshot, cached = _cached_listing(repo, revision)
        if snapshot is None:
            raise HubError(f"{repo}: offline and not in the Hugging Face cache; run once with network access "
                           f"(or download the .gguf elsewhere and pass it with -m FILE)")
        chosen = select_files(repo, cached, quant)
        return os.path.join(snapshot, chosen[0])
    chosen = select_files(repo, files, quant)
    say(f"sharpi: {repo}: {', '.join(chosen)}")
    try:
        paths = [hf_hub_download(repo, name, revision=revision) for name in chosen]
    except Exception as error:
        raise HubError(f"{repo}: download failed: {_short(error)}") from error
    return paths[0]


def _unreachable(timeout_s: float = 2.0) -> str | None:
    """Why the Hub's endpoint cannot be reached (DNS failure, refused, no route, timeout), or None.

    One TCP connect before any request: huggingface_hub retries a failed connection with backoff
    (about 24 s in all), which is wasted time on a machine with no network; a refused or unresolvable
    endpoint answers at once, and a silent one within timeout_s. Through a proxy (HTTPS_PROXY etc.) the
    proxy is what must answer, so that is the host tried."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    host = url.hostname or ""
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        url = urlsplit(proxy if "://" in proxy else "http://" + proxy)
        host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as error:
        return f"{host}:{port}: {error.strerror or type(error).__name__}"
    return None


def _is_connection_error(error: BaseException) -> bool:
    """True for "the Hub cannot be reached" (no network, DNS, refused, timeout), not for HTTP errors."""
    names = {type(e).__name__ for e in _chain(error)}
    return bool(
        names
        & {
            "ConnectError",
            "ConnectTimeout",
            "ConnectionError",
            "TimeoutException",
            "ReadTimeout",
            "OfflineModeIsEnabled",
            "LocalEntryNotFoundError",
        }
    )


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _short(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__
