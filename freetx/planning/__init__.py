"""Planning a run before renting GPUs: `freetx estimate` (estimate.py: a model's memory
per rank and step time for each strategy; rungs.py: the memory ladder's rungs it counts;
config.py: a training config's, as its schema says what it trains; ladder.py: a config
rung by rung; sources.py: a crosscoder's source models; measure.py: one step on fake
tensors) and `freetx import` (config_import.py: DeepSpeed, Accelerate and FSDP
configs read as freetx's). Only the CLI imports it; no loop does."""
