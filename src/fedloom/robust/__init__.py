"""Byzantine-robust aggregation (docs/security.md): coordinate median, trimmed mean, Krum,
Multi-Krum, Bulyan and norm clipping (``rules``), plugged into the engine's one aggregation
slot (``aggregation``), so every algorithm that aggregates through ``ctx.aggregate`` gets it.
"""
