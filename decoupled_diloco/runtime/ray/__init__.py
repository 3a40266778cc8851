"""The Ray runtime: learners and syncer shards as actors in their own processes."""
