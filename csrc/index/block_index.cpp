// (stub: the block index to come)
