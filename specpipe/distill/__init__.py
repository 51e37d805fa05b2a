"""Self-distillation: the target model's own answers to chat prompts, the corpus of the REST
token datastore. `prompts` builds the prompt source, `corpus` generates answers in resumable
shards and merges them into the shipped Parquet file; `task=distill_corpus` runs both."""
