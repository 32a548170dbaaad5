"""Tools of the mtp_pruning optimization: token counts, keep-sets, draft-head benches."""
