"""The ops, one module each: what runs on a rank for one step, stage by stage."""
