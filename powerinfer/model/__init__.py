"""Model definition pieces shared by every process: tensor ops, weight access, layer sharding."""
