"""The decoder in parts (`freetx.models.transformer.Transformer` puts them together):

config.py           TransformerConfig: the shape, its checks and what it calls meaningless
rope.py             RoPE: frequencies (llama3, linear, longrope), tables, apply_rope
layers.py           RMSNorm, Attention, FeedForward, DecoderBlock; the shared initialization
core.py             DecoderCore: embedding -> blocks -> norm -> head; forward, counts
capabilities, each a subclass of DecoderCore that a model lists among its bases:
  incremental.py    IncrementalDecoding: a KV cache for generation (DecodesIncrementally)
  masks.py          DocumentMasks: packed batches (PacksDocuments); ContextMasks: this
                    rank's part of each sequence under context parallelism (ShardsContext)
  pipeline.py       PipelineStages: pipeline stages of blocks (SplitsIntoStages)
  tensor_parallel.py  TensorParallelPlan: layers sliced over tp ranks (SlicesLayers)
estimate.py         DecoderActivations: its activation memory, for `freetx estimate`
                    (EstimatesActivations); listed by any model with a TransformerConfig
"""
