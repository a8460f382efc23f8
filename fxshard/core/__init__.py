"""The vocabulary everything else is written in: meshes and their link figures (``mesh``),
placements + shard order of a value (``spec``), what collectives cost (``cost``) and the frozen
configuration of one sharding run (``config``)."""
