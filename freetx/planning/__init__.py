"""Planning a run before renting GPUs: `freetx estimate` (estimate.py: a model's memory
per rank and step time for each strategy; rungs.py: the memory ladder's rungs it counts;
config.py: a training config's, as its schema says what it trains; ladder.py: a config
rung by rung; sources.py: a crosscoder's source models; measure.py: one step on fake
tensors) and `freetx import` (config_import.py: a config file read and handed to its
format's importer, deepspeed_import.py, accelerate_import.py, fsdp_import.py,
torchtune_import.py, trl_import.py or axolotl_import.py, over what they share,
imported_config.py). Only the CLI imports it;
no loop does."""
