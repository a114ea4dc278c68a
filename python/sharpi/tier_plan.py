"""`sharpi inspect --plan`: where a GPU session would keep each part of a model (the tier planner).

The decisions are C++ (cpp/src/tier_plan.h, reached through _internal.tier_plan_file): VRAM holds the dense
weights, KV cache and buffers, then every expert if they fit, else a pool of expert slots (plus staging
slots for a predictor and, given a cache prior, the hottest experts pinned); RAM holds what VRAM does
not pin (all of it, or slots within --ram-budget); the rest stays on disk. This module only resolves the
budgets the user typed (bytes with units, or `auto`) and renders the plan.
"""

from __future__ import annotations

from . import _core, _internal


def resolve_vram_budget(text: str) -> tuple[int, str]:
    """(bytes, how it was chosen) for --vram-budget: a size with units, or auto = free VRAM minus a margin
    (DeviceError without a CUDA device)."""
    if text.strip().lower() == "auto":
        a = _internal.vram_budget_auto()
        return a["budget"], a["summary"]
    return _core.parse_byte_size(text), f"--vram-budget {text}"


def resolve_ram_budget(text: str | None) -> tuple[int, str]:
    """(bytes, how) for --ram-budget: None/0 = every expert in RAM, a size with units, or auto."""
    if not text:
        return 0, "no --ram-budget: every expert VRAM does not pin stays in RAM"
    if text.strip().lower() == "auto":
        from .ram_budget import auto_ram_budget

        a = auto_ram_budget()
        return a.budget, a.describe()
    return _core.parse_byte_size(text), f"--ram-budget {text}"


def plan(
    path: str,
    vram_budget: str,
    ram_budget: str | None = None,
    n_ctx: int = 0,
    lookahead: int = 0,
    cache_prior: str | None = None,
) -> dict:
    """The tier plan of `path` as a dict (_internal.tier_plan_file's), with the budgets' provenance."""
    vram, vram_why = resolve_vram_budget(vram_budget)
    ram, ram_why = resolve_ram_budget(ram_budget)
    p = _internal.tier_plan_file(path, vram, ram, n_ctx=n_ctx, lookahead=lookahead, prior_path=cache_prior or "")
    p["vram_budget_source"] = vram_why
    p["ram_budget_source"] = ram_why
    return p


def plan_report(p: dict) -> str:
    lines = [f"tier plan (n_ctx {p['n_ctx']}; {p['vram_budget_source']}; {p['ram_budget_source']}):"]
    lines += ["  " + line for line in p["summary"].splitlines()]
    if p["vram_pinned"]:
        shown = ", ".join(f"L{il}:E{e}" for il, e in p["vram_pinned"][:16])
        more = f", ... ({len(p['vram_pinned'])} in all)" if len(p["vram_pinned"]) > 16 else ""
        lines.append(f"  pinned in VRAM by the prior: {shown}{more}")
    return "\n".join(lines) + "\n"
