"""The machinery every op shares: dispatch tables, kernel loading, collectives, variant names,
packed keys, shard geometry and input validation. Nothing here knows what an op computes."""
