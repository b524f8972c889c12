"""Running the model: one forward on a cache, forward requests a batch can run together, and their clock."""
