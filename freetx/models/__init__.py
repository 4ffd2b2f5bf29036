"""Models: plain nn.Modules that name their block classes; parallelism comes from outside."""
