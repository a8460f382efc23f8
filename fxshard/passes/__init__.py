"""passes: graph -> graph rewrites after placement: ``redistribute`` (explicit placement changes),
``lower`` (the per-rank graph), ``bucket`` (fewer collective launches in it)."""
