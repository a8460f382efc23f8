"""runtime: running sharded programs: ``program`` (what ``shard`` returns), ``compiled`` (one rank's
Inductor-compiled program), ``simulate`` (every rank in one process), ``launch`` (local gloo
processes), ``calibrate`` (measured cost models)."""
