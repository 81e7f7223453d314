"""What shard() decides from sizes alone: the flat layout."""
